"""A job of two processes (``main(["--config", CONFIG])``, as tests/scripts/run_jobs.py calls it) whose process 0
alone meets an error: first a ``common.job_parts`` job whose process 1 writes to a folder process 0 cannot see (another
node's disk: records missing at the merge), then a start whose output holds a broken line (process 0's merge refuses
it). Each process prints what it got at each step, then waits at a barrier as the jobs' callers do
(tests/test_inference_multiprocess.py reads the lines)."""

import time
from pathlib import Path

import yaml
from accelerate import PartialState

from common.job_parts import JobParts


def finish_apart(folder: Path, rank: int, state) -> None:
    rows = [{"id": f"q{i}"} for i in range(6)]
    parts = JobParts(folder / ("out.jsonl" if rank == 0 else "node1/out.jsonl"), state)
    for batch in parts.start(rows, 2):
        parts.append([{"id": r["id"]} for r in batch])
    parts.finish(rows)


def start_on_a_broken_file(folder: Path, rank: int, state) -> None:
    JobParts(folder / "broken.jsonl", state).start([{"id": "q0"}], 1)


def main(argv: list[str]) -> None:
    folder = Path(yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text(encoding="utf-8"))["folder"])
    state = PartialState()
    for step in (finish_apart, start_on_a_broken_file):
        began = time.monotonic()
        try:
            step(folder, state.process_index, state)
            said = "no error"
        except Exception as e:
            said = f"{type(e).__name__}: {e}"
        print(f"{step.__name__}, process {state.process_index}: {said} ({time.monotonic() - began:.1f} s)", flush=True)
        JobParts(folder / "x", state).barrier(f"{step.__name__}")
