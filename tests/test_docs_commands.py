"""Every command the docs tell a researcher to run (the ```bash blocks of the README and docs/, whatever folder
their python or accelerate is in, ``make demo`` and the ``make demo ARGS="…"`` the prose quotes) parses as written:
its module exists, and every flag and config key it names is a field of that job's arguments (TRL's parser refuses
unknown ones), with the checks a job makes on its settings alone. Each command stops right after its arguments are
parsed: no model loads and no data file is read, so the downloads the commands name need not exist. Every job
(documented or not) calls its ``main`` when run as a script."""

import ast
import importlib
import importlib.util
import itertools
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
ENTRY_POINTS = {"gate.pipeline": "gate.pipeline.run"}  # a package run with -m: the module its __main__ runs
TRAINING = ("rl.train_grpo", "gate.train.sft")  # TrainingArguments: bf16 needs a GPU, so it is turned off here


PROGRAMS = ("python", "python3", "accelerate")  # a command line naming one of these is a job
# the recipe `make demo` runs, as the Makefile writes it: `make demo ARGS="…"` passes ARGS on to it
DEMO = re.search(r"^demo:.*\n\t(.*)", (REPO / "Makefile").read_text(), re.M).group(1)


def job(tokens: list[str]) -> tuple[str, list[str]] | None:
    """(module, its arguments) of ``python -m M …``, ``python path.py …`` or ``accelerate launch … (-m M | path.py) …``,
    the program under any folder (``.venv/bin/python``); None for any other command."""
    program = Path(tokens[0]).name if tokens else ""
    if program not in PROGRAMS or program == "accelerate" and tokens[1:2] != ["launch"]:
        return None
    for i, token in enumerate(tokens[1:], 1):
        if token == "-m":
            return tokens[i + 1], tokens[i + 2 :]
        if token.endswith(".py"):
            return token[:-3].replace("/", "."), tokens[i + 1 :]
    return None


def demo(tokens: list[str]) -> list[str]:
    """The command ``make … demo … [ARGS=…]`` runs: the Makefile's recipe with ARGS in place of ``$(ARGS)``."""
    args = [a for t in tokens[1:] if t.startswith("ARGS=") for a in shlex.split(t[len("ARGS=") :])]
    recipe = shlex.split(DEMO.replace("$(VENV)", ".venv"))
    return [a for t in recipe for a in (args if t == "$(ARGS)" else [t])]


def lines(block: str):
    """The block's lines (a trailing backslash joins lines), a line inside ``for NAME in VALUES; do … done`` once per
    value with ``$NAME`` replaced."""
    loops = []  # (name, values) of the loops open at this line
    for line in re.sub(r"\\\n", " ", block).splitlines():
        if loop := re.match(r"\s*for (\w+) in ([^;]*); do\b(.*)", line):
            loops.append((loop[1], loop[2].split()))
            line = loop[3]
        line, done = re.subn(r"(^|;)\s*done\s*(?=#|$)", "", line)
        for values in itertools.product(*(values for _, values in loops)):
            expanded = line
            for (name, _), value in zip(loops, values):
                expanded = re.sub(rf"\${name}\b", value, expanded)
            yield expanded
        del loops[len(loops) - done :]


def commands(text: str) -> list[tuple[str, list[str]]]:
    """(module, its arguments) of each job (``job``) and each ``make demo`` line of the text's code blocks (comments
    and VAR= prefixes dropped), and of each ``make demo ARGS=…`` the prose quotes."""
    out = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S):
        for line in lines(block):
            try:
                tokens = shlex.split(line.replace("<(yes)", "yes"), comments=True)
            except ValueError:  # not shell (a file tree drawn in a block); a command line always splits
                assert "python" not in line and "accelerate" not in line, line
                continue
            while tokens and re.match(r"^[A-Z_]+=", tokens[0]):
                tokens = tokens[1:]
            if tokens[:1] == ["make"] and "demo" in tokens:
                tokens = demo(tokens)
            found = job(tokens)
            unread = tokens and Path(tokens[0]).name in PROGRAMS and tokens[1:2] != ["-c"]  # -c: a program inline
            assert found or not unread, f"a command this test cannot read: {line}"
            if found:
                assert "$" not in " ".join(found[1]), f"a shell expansion this test cannot check: {line}"
                out.append(found)
    for span in re.findall(r"`(make demo ARGS=[^`\n]*)`", text):  # in prose too: `make demo ARGS="--seed 1"`
        out.append(job(demo(shlex.split(span))))
    return out


COMMANDS = [(doc, module, argv) for doc in DOCS for module, argv in commands((REPO / doc).read_text())]


def test_the_docs_name_the_commands_of_every_step():
    named = {module for _, module, _ in COMMANDS}
    for step in ("retrieval.upstream.convert", "retrieval.build_index", "rl.data", "rl.train_grpo", "rl.export"):
        assert step in named
    for step in ("rl.refine", "rl.baselines", "gate.train.build_data", "gate.train.sft", "gate.pipeline"):
        assert step in named
    # the toy recipe's commands run .venv/bin/python and .venv/bin/accelerate
    toy = {module for doc, module, _ in COMMANDS if doc == "docs/toy-world.md"}
    assert {"rl.train_grpo", "rl.export", "toy.gates", "gate.train.sft", "gate.pipeline"} <= toy


def test_the_collector_reads_every_form_of_a_command():
    text = """```bash
.venv/bin/python -m rl.export --config a.yaml   # a comment
HF_HUB_OFFLINE=1 .venv/bin/accelerate launch --config_file c.yaml gate/train/sft.py --variant hkb \\
  --seed 1
for v in hkb skb; do
  python3 -m gate.train.build_data --stage label --variant $v; done
make demo ARGS="--seed 2 --max_steps 3"
python -c "import torch"
```
and the prose's `make demo ARGS="--seed 1"`."""
    label = ["--stage", "label", "--variant"]
    assert commands(text) == [
        ("rl.export", ["--config", "a.yaml"]),
        ("gate.train.sft", ["--variant", "hkb", "--seed", "1"]),
        ("gate.train.build_data", [*label, "hkb"]),
        ("gate.train.build_data", [*label, "skb"]),
        ("rl.train_grpo", ["--seed", "2", "--max_steps", "3"]),  # the Makefile's recipe runs rl/train_grpo.py
        ("rl.train_grpo", ["--seed", "1"]),
    ]


def test_a_command_the_collector_cannot_read_fails_it():
    with pytest.raises(AssertionError, match="cannot read"):
        commands("```bash\n.venv/bin/python benchmarks/learning\n```")
    with pytest.raises(AssertionError, match="cannot check"):
        commands("```bash\npython -m rl.refine --model $MODEL\n```")


class Parsed(BaseException):
    """Raised right after a job's arguments are parsed: nothing more of the job runs."""


@pytest.mark.parametrize("doc,module,argv", COMMANDS, ids=[f"{d}:{m}:{i}" for i, (d, m, _) in enumerate(COMMANDS)])
def test_a_documented_command_parses(doc, module, argv, monkeypatch):
    monkeypatch.chdir(REPO)  # the configs' paths are relative to the repository
    if module in TRAINING:
        argv = [*argv, "--bf16", "false"]
    if module == "rl.train_grpo":
        from rl.arguments import parse_arguments, validate

        args, training_args, model_args, *_, state = parse_arguments(argv)
        validate(args, training_args, model_args, state.num_processes)
        return
    if module == "gate.train.sft":
        from gate.train.sft import parse_args

        parse_args(argv)
        return
    job = importlib.import_module(ENTRY_POINTS.get(module, module))
    real = job.parse

    def parse_then_stop(*args, **kwargs):
        real(*args, **kwargs)
        raise Parsed

    monkeypatch.setattr(job, "parse", parse_then_stop)
    with pytest.raises(Parsed):
        job.main(argv)


def runs_main_as_a_script(source: str) -> bool:
    """Whether the module's top level calls ``main`` when it runs as a script: a ``__main__.py`` anywhere at its top
    level, any other module inside ``if __name__ == "__main__":`` (``main()``, or ``main`` handed to a runner)."""
    tree = ast.parse(source)

    def calls_main(nodes) -> bool:
        return any(
            isinstance(n, ast.Call)
            and (
                isinstance(n.func, ast.Name)
                and n.func.id == "main"
                or any(isinstance(a, ast.Name) and a.id == "main" for a in n.args)
            )
            for node in nodes
            for n in ast.walk(node)
        )

    guards = [
        node.body
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"'
    ]
    return any(calls_main(body) for body in guards) or (
        not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body) and calls_main(tree.body)
    )


def script_path(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    return Path(spec.submodule_search_locations[0]) / "__main__.py" if spec.submodule_search_locations else spec.origin


# every job: the modules the docs run, and every module or benchmark with a main (one a comment names, say)
JOBS = {module: script_path(module) for _, module, _ in COMMANDS} | {
    ".".join(path.relative_to(REPO).with_suffix("").parts): path
    for path in sorted(REPO.glob("*/**/*.py"))
    if path.relative_to(REPO).parts[0] not in ("tests", ".venv")
    and re.search(r"^def main\(", path.read_text(encoding="utf-8"), re.M)
}


@pytest.mark.parametrize("module", sorted(JOBS))
def test_every_job_runs_its_main_as_a_script(module):
    assert runs_main_as_a_script(Path(JOBS[module]).read_text(encoding="utf-8")), (
        f"`python -m {module}` would not run main"
    )


@pytest.mark.parametrize(
    "source,runs",
    [
        ('def main(): pass\nif __name__ == "__main__":\n    main()\n', True),
        ('def main(): pass\nif __name__ == "__main__":\n    from common.cli import run\n    run(main)\n', True),
        ("def main(): pass\nif __name__ == '__main__':\n    run(main)\n", True),
        ('def main(): pass\nif __name__ == "__main__":\n    pass\n', False),  # the guard, without the call
        ('def main(): pass\nif __name__ != "__main__":\n    main()\n', False),
        ("def main(): pass\nif False:\n    main()\n", False),
        ("def main(): pass\n", False),
        ("from a import main\nrun(main)\n", True),  # a package's __main__.py
    ],
)
def test_the_script_check_reads_each_form(source, runs):
    assert runs_main_as_a_script(source) is runs
