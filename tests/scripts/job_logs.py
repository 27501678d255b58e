"""Where a launched test script's output goes: ``output_to(path)`` sends this process's stdout and stderr (file
descriptors 1 and 2, so a library's own writes and a traceback included) to ``path`` until the block ends. Each
process of a two-process launch writes its own file: the processes share the launcher's pipe otherwise, where their
lines interleave in whatever order the scheduler ran them (tests/scripts/run_jobs.py, build_and_die.py)."""

import contextlib
import os
import sys
import traceback
from pathlib import Path


@contextlib.contextmanager
def output_to(path: Path):
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w", encoding="utf-8") as log:
        os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
        try:
            yield
        except (Exception, KeyboardInterrupt):
            traceback.print_exc()  # into the log, where the test reads it (a SystemExit has said its own words)
            raise
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])
