"""Command-line plumbing shared by every entry point: TRL's parser (YAML via --config, flags override) and a
clean one-line error for bad input instead of a traceback."""

from __future__ import annotations

import gc
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import yaml

OUR_PACKAGES = ("common", "retrieval", "rewards", "rl", "gate", "toy")
TEXT_TYPES = {"str", "str | None", "typing.Optional[str]"}
TEXT_LIST_TYPES = {"list[str]", "list[str] | None", "typing.Optional[list[str]]"}


def parse(dataclass_types, argv=None, description: str | None = None, known_only: bool = False):
    """Parse ``--config X.yaml`` plus flags into the given dataclasses with TRL's parser. ``known_only``: settings
    the dataclasses do not hold are left alone (returned last, as strings) instead of refused. ``--config=X`` is read
    as ``--config X``; a missing or malformed config file, or a YAML value that is not the text one of our settings
    holds, is a ValueError naming it."""
    from trl import TrlParser

    argv = config_flag(list(sys.argv[1:] if argv is None else argv))
    if "--config" in argv:
        read_config(argv[argv.index("--config") + 1])  # a clear error before TRL's parser opens it
    parser = TrlParser(dataclass_types, description=description)
    parsed = parser.parse_args_and_config(argv, return_remaining_strings=known_only)
    for obj in parsed:
        if type(obj).__module__.split(".")[0] in OUR_PACKAGES:
            check_text_fields(obj)
        if hasattr(obj, "__dataclass_fields__"):
            convert_number_lists(obj)
    return parsed


def convert_number_lists(obj) -> None:
    """A YAML list of numbers into a ``list[float]`` / ``list[int]`` setting (TRL's ``reward_weights``) as numbers: YAML
    reads ``5e-1`` (no dot) as text, and argparse converts only what the command line gives, so ``[1.0, 5e-1]``
    reached TRL as ``[1.0, '5e-1']`` and failed deep in the trainer. An item that is no number is named."""
    for f in fields(obj):
        declared = f.type if isinstance(f.type, str) else str(f.type)
        kind = float if "list[float]" in declared else int if "list[int]" in declared else None
        value = getattr(obj, f.name)
        if kind is None or not isinstance(value, (list, tuple)):
            continue
        try:
            setattr(obj, f.name, [kind(v) if isinstance(v, str) else v for v in value])
        except ValueError:
            raise ValueError(f"--{f.name}: {list(value)!r} holds an item that is not a number") from None


def config_flag(argv: list[str]) -> list[str]:
    """``--config=X`` as ``--config X`` (TRL's parser finds the flag only so); a ``--config`` with no file after it
    is a ValueError."""
    argv = [part for a in argv for part in (["--config", a[9:]] if a.startswith("--config=") else [a])]
    if "--config" in argv:
        after = argv[argv.index("--config") + 1 :]
        if not after or not after[0] or after[0].startswith("--"):
            raise ValueError("--config needs a YAML file after it")
    return argv


def read_config(path) -> dict:
    """A ``--config`` file's settings; a ValueError naming it when it is not a readable YAML mapping."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config {path}: no such file")
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {path}: not valid YAML: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config {path}: a YAML mapping of settings is needed, got a {type(config).__name__}")
    return config


def check_text_fields(obj) -> None:
    """Every text setting of our dataclass ``obj`` holds text: a YAML value becomes the parser's default as YAML read
    it (``yes`` / ``no`` / ``true`` are booleans, ``1.5`` a number), and argparse converts only text defaults."""
    for f in fields(obj):
        declared = f.type if isinstance(f.type, str) else "str" if f.type is str else str(f.type)
        value = getattr(obj, f.name)
        if value is None:
            continue
        if declared in TEXT_TYPES and not isinstance(value, str):
            raise ValueError(f"--{f.name}: {value!r} is not text (YAML reads it as {type(value).__name__}): quote it")
        if declared in TEXT_LIST_TYPES:
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"--{f.name}: {value!r} is not a list: give a YAML list, one item per entry")
            wrong = [v for v in value if not isinstance(v, str)]
            if wrong:
                raise ValueError(
                    f"--{f.name}: {wrong[0]!r} is not text (YAML reads it as {type(wrong[0]).__name__}): quote it"
                )


TRACEBACK_VARIABLE = "REFINE_RL_TRACEBACK"  # set (to anything): a bad-input error prints its whole traceback


def run(main: Callable[[], object]) -> None:
    """An entry point's last call (``if __name__ == "__main__": run(main)``): call ``main``; a
    ValueError/FileNotFoundError (bad input) becomes ``error: …`` and exit status 2, with the line that raised it (a
    ValueError from a defect deep in a job is one too: the whole traceback with ``REFINE_RL_TRACEBACK`` set).

    Either way, the process then skips the interpreter's last garbage collections (``freeze_for_exit``)."""
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        if os.environ.get(TRACEBACK_VARIABLE):
            traceback.print_exc()
        else:
            where = traceback.extract_tb(e.__traceback__)[-1]
            print(
                f"(raised at {where.filename}:{where.lineno}, in {where.name}; {TRACEBACK_VARIABLE}=1 prints the whole "
                "traceback)",
                file=sys.stderr,
            )
        sys.exit(2)
    finally:
        freeze_for_exit()


def nanobind_extension_loaded() -> bool:
    """Whether a loaded module holds a class made by nanobind (triton 3.9's compiler, which torch._dynamo imports
    whenever triton is installed, as it is beside torch's CUDA builds)."""
    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            if type(value).__module__ == "nanobind":  # type() reads no attribute (deprecation proxies stay quiet)
                return True
    return False


def freeze_for_exit() -> bool:
    """Freeze the objects alive now out of the garbage collector (``gc.freeze``): with torch, transformers and TRL
    loaded, the interpreter's last collections at exit cost ~1.4 s of CPU per process here, for memory the operating
    system takes back anyway; exit handlers still run. Not when a nanobind extension is loaded: nanobind checks at
    exit that its objects were freed, and what the freeze keeps (triton's, in cycles) it reports as dozens of
    'nanobind: leaked …' lines. Returns whether it froze."""
    if nanobind_extension_loaded():
        return False
    gc.freeze()
    return True


def require_file(value, flag: str) -> Path:
    """``value`` as a Path if it names an existing file, else a ValueError naming the flag."""
    if not value or not Path(value).is_file():
        raise ValueError(f"--{flag}: file {value!r} does not exist")
    return Path(value)


def require_other_file(value, source, flag: str, source_flag: str) -> Path:
    """``value`` as a Path if it names another file than ``source`` (a job's input), else a ValueError naming both
    flags: a job appending to its own input would count every input row as done."""
    same = Path(value).resolve() == Path(source).resolve()
    if same or (Path(value).exists() and os.path.samefile(value, source)):  # a hard link too
        raise ValueError(f"--{flag} {value} is the --{source_flag} file: give another --{flag} (its input is kept)")
    return Path(value)


def check_choices(obj) -> None:
    """Every field of the dataclass ``obj`` whose metadata lists ``choices`` holds one of them (None, unset, passes;
    a list, each item), else a ValueError naming the flag. argparse checks a flag's choices, but not a value from a
    ``--config`` file (TRL's parser makes those the defaults) nor one of a dataclass built directly."""
    for f in fields(obj):
        choices = f.metadata.get("choices")
        if choices is None:
            continue
        value = getattr(obj, f.name)
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if v is not None and v not in choices:
                raise ValueError(f"--{f.name}: {v!r} is not one of {', '.join(map(str, choices))}")
