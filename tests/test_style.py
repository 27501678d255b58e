"""One line-length rule for the whole repository, applied by the formatter: the code is as `ruff format` writes it and
`ruff check` (with E501 at the same length) finds nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUFF = Path(sys.executable).with_name("ruff")


@pytest.mark.skipif(not RUFF.exists(), reason="ruff is not installed beside this Python (pip install -e '.[dev]')")
@pytest.mark.parametrize("command", [["format", "--check"], ["check"]])
def test_ruff_finds_nothing(command):
    result = subprocess.run([str(RUFF), *command, "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
