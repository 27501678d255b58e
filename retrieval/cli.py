"""Command-line plumbing shared by every entry point: TRL's parser (YAML via --config, flags override) and a
clean one-line error for bad input instead of a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable


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
