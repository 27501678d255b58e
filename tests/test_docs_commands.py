"""Every command the docs tell a researcher to run (the ```bash blocks of the README and docs/) parses as written:
its module exists, and every flag and config key it names is a field of that job's arguments (TRL's parser refuses
unknown ones), with the checks a job makes on its settings alone. Each command stops right after its arguments are
parsed: no model loads and no data file is read, so the downloads the commands name need not exist."""

import importlib
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
ENTRY_POINTS = {"gate.pipeline": "gate.pipeline.run"}  # a package run with -m: the module its __main__ runs
TRAINING = ("rl.train_grpo", "gate.train.sft")  # TrainingArguments: bf16 needs a GPU, so it is turned off here


def commands(text: str) -> list[tuple[str, list[str]]]:
    """(module, its arguments) of each `python -m M …`, `python path.py …` and `accelerate launch … (-m M | path.py)
    …` line of the text's code blocks (a trailing backslash joins lines; comments and VAR= prefixes dropped)."""
    out = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n", " ", block).splitlines():
            try:
                tokens = shlex.split(line.replace("<(yes)", "yes"), comments=True)
            except ValueError:  # not shell (a file tree drawn in a block); a command line always splits
                assert "python" not in line and "accelerate" not in line, line
                continue
            while tokens and re.match(r"^[A-Z_]+=", tokens[0]):
                tokens = tokens[1:]
            if tokens[:1] in (["python"], ["python3"]) or tokens[:2] == ["accelerate", "launch"]:
                for i, token in enumerate(tokens[1:], 1):
                    if token == "-m":
                        out.append((tokens[i + 1], tokens[i + 2 :]))
                        break
                    if token.endswith(".py"):
                        out.append((token[:-3].replace("/", "."), tokens[i + 1 :]))
                        break
    return out


COMMANDS = [(doc, module, argv) for doc in DOCS for module, argv in commands((REPO / doc).read_text())]


def test_the_docs_name_the_commands_of_every_step():
    named = {module for _, module, _ in COMMANDS}
    for step in ("retrieval.upstream.convert", "retrieval.build_index", "rl.data", "rl.train_grpo", "rl.export"):
        assert step in named
    for step in ("rl.refine", "rl.baselines", "gate.train.build_data", "gate.train.sft", "gate.pipeline"):
        assert step in named


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
