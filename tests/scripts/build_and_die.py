"""retrieval/build_index.py's main for each argument list in turn (``build_and_die.py ARGS [--then ARGS]``), the last
one killed (KeyboardInterrupt) after this process saved DIE_AFTER shards; each later list's output follows a line
``=== then`` (one start of two processes for two builds). Run under torchrun by tests/test_build_multiprocess.py to
interrupt a multi-process build at a known point."""

import os
import sys

import retrieval.build_shards as bs
from retrieval.build_index import main

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

real, saved = bs.save_shard, []


def dying(*a, **k):
    if len(saved) == int(os.environ["DIE_AFTER"]):
        raise KeyboardInterrupt(f"killed after {len(saved)} shards")
    saved.append(a[1:3])
    return real(*a, **k)


bs.save_shard = dying
main(last)
