"""Command-line plumbing shared by every entry point: TRL's parser (YAML via --config, flags override) and a
clean one-line error for bad input instead of a traceback."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path


def parse(dataclass_types, argv=None, description: str | None = None):
    """Parse ``--config X.yaml`` plus flags into the given dataclasses with TRL's parser."""
    from trl import TrlParser

    parser = TrlParser(dataclass_types, description=description)
    return parser.parse_args_and_config(argv)


def run(main: Callable[[], object]) -> None:
    """Call ``main``; a ValueError/FileNotFoundError (bad input) becomes ``error: …`` and exit status 2."""
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def require_file(value, flag: str) -> Path:
    """``value`` as a Path if it names an existing file, else a ValueError naming the flag."""
    if not value or not Path(value).is_file():
        raise ValueError(f"--{flag}: file {value!r} does not exist")
    return Path(value)


def require_index(value, flag: str = "index") -> dict:
    """The manifest of a finished index directory, else a ValueError naming the flag."""
    from retrieval.index import MANIFEST_FILE

    manifest = Path(value or "") / MANIFEST_FILE
    if not value or not manifest.is_file():
        raise ValueError(f"--{flag}: {value!r} is not a finished index directory (no {MANIFEST_FILE})")
    return json.loads(manifest.read_text())
