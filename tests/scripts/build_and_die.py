"""retrieval/build_index.py's main for each argument list in turn (``build_and_die.py ARGS [--then ARGS]``), the last
one killed (KeyboardInterrupt) after this process saved DIE_AFTER shards; each later list's output follows a line
``=== then`` (one start of two processes for two builds). Run under torchrun by tests/test_build_multiprocess.py to
interrupt a multi-process build at a known point."""

import os
import sys

import pytest

from retrieval.build_index import main
from tests.test_build import die_after

runs = [[]]
for arg in sys.argv[1:]:
    if arg == "--then":
        runs.append([])
    else:
        runs[-1].append(arg)
*finished, last = runs
for argv in finished:
    main(argv)
    print("=== then", flush=True), print("=== then", file=sys.stderr, flush=True)
die_after(pytest.MonkeyPatch(), int(os.environ["DIE_AFTER"]))  # the test's own interruption, in this process
main(last)
