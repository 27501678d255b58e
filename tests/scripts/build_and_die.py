"""retrieval/build_index.py's main for each argument list in turn (``build_and_die.py LOGDIR ARGS [--then ARGS]``),
the last one killed (KeyboardInterrupt) after this process saved DIE_AFTER shards; build i's output (this process's
stdout and stderr, the traceback of the kill included) goes to ``LOGDIR/<i>.rank<RANK>.log``. One start of two
processes for two builds: run under torchrun by tests/test_build_multiprocess.py to interrupt a multi-process build
at a known point."""

import os
import sys
from pathlib import Path

import pytest

from retrieval.build_index import main
from tests.scripts.job_logs import output_to
from tests.test_build import die_after

logs, runs = Path(sys.argv[1]), [[]]
for arg in sys.argv[2:]:
    if arg == "--then":
        runs.append([])
    else:
        runs[-1].append(arg)
*finished, last = runs
for i, argv in enumerate(finished):
    with output_to(logs / f"{i}.rank{os.environ['RANK']}.log"):
        main(argv)
die_after(pytest.MonkeyPatch(), int(os.environ["DIE_AFTER"]))  # the test's own interruption, in this process
with output_to(logs / f"{len(finished)}.rank{os.environ['RANK']}.log"):
    main(last)
