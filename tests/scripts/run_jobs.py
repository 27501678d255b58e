"""Several jobs, one after the other, in one launch of two processes: ``run_jobs.py LOGDIR MODULE CONFIG [MODULE
CONFIG …]`` calls ``MODULE.main(["--config", CONFIG])`` through ``common.cli.run`` for each pair, exactly what
``python -m MODULE --config CONFIG`` runs, with this process's stdout and stderr for that job in
``LOGDIR/<i>-<MODULE>.rank<r>.log``.

One launch instead of one per job: each start of two processes costs ~11 s here (torch, transformers and TRL imported
by the launcher and by each process), whatever the job. The jobs share what a process keeps between them
(accelerate's process state, DeepSpeed's comm setup, imported modules); each job's outputs are its own. Run under
torchrun or ``accelerate launch`` by ``launch_jobs`` (tests/test_multiprocess.py) for the suite's shared launches
(tests/conftest.py: ``torchrun_jobs``, ``zero3_jobs``)."""

import functools
import importlib
import os
import sys
from pathlib import Path

from common.cli import run
from tests.scripts.job_logs import output_to

logs, pairs = Path(sys.argv[1]), sys.argv[2:]
rank = os.environ["RANK"]
for i, (module, config) in enumerate(zip(pairs[::2], pairs[1::2])):
    with output_to(logs / f"{i}-{module}.rank{rank}.log"):
        run(functools.partial(importlib.import_module(module).main, ["--config", config]))
