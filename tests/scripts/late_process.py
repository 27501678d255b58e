"""Two processes; process 1 never reaches the barrier (it waits, at most a minute, for process 0 to say it is done).
Process 0's barrier must fail after the group's timeout with an error naming its step, instead of waiting for ever.
Run under torchrun by tests/test_multiprocess.py."""

import sys
import time
from datetime import timedelta
from pathlib import Path

from accelerate import PartialState

from common.placement import Processes

state = PartialState(cpu=True, timeout=timedelta(seconds=int(sys.argv[1])))
procs, done = Processes(state), Path(sys.argv[2])
if procs.rank == 1:
    deadline = time.monotonic() + 60
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    sys.exit(0)
try:
    procs.barrier("process 0 wrote the shards")
except TimeoutError as e:
    print(f"TimeoutError: {e}", flush=True)
    done.write_text("done")
    sys.exit(3)
done.write_text("done")
