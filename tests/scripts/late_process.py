"""Two processes; process 1 never reaches the barrier (it waits, at most a minute, for process 0 to say it is done).
Process 0's barrier must fail after the group's timeout (``sys.argv[1]`` seconds) with an error naming its step,
instead of waiting for ever. The group is set up with a long timeout, which also bounds the two processes meeting at
its start (on a busy machine one may start seconds after the other), and shortened once both are in.
Run under torchrun by tests/test_multiprocess.py."""

import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed
from accelerate import PartialState

from common.files import wait_for_path
from common.placement import Processes

state = PartialState(cpu=True, timeout=timedelta(seconds=120))
torch.distributed.set_timeout(timedelta(seconds=int(sys.argv[1])))
procs, done = Processes(state), Path(sys.argv[2])
if procs.rank == 1:
    wait_for_path(done, 60, "process 0 to finish waiting at its barrier")
    sys.exit(0)
try:
    procs.barrier("process 0 wrote the shards")
except TimeoutError as e:
    print(f"TimeoutError: {e}", flush=True)
    done.write_text("done", encoding="utf-8")
    sys.exit(3)
done.write_text("done", encoding="utf-8")
