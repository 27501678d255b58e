"""retrieval/build_index.py's main, killed (KeyboardInterrupt) after this process saved DIE_AFTER shards.
Run under torchrun by tests/test_build_multiprocess.py to interrupt a multi-process build at a known point."""

import os
import sys

import retrieval.build_shards as bs
from retrieval.build_index import main

real, saved = bs.save_shard, []


def dying(*a, **k):
    if len(saved) == int(os.environ["DIE_AFTER"]):
        raise KeyboardInterrupt(f"killed after {len(saved)} shards")
    saved.append(a[1:3])
    return real(*a, **k)


bs.save_shard = dying
main(sys.argv[1:])
