"""The embedded default over seeds: what `make demo` learns, and how long it takes, seed by seed.

    .venv/bin/python benchmarks/learning.py [--seeds 0 1 2] [--out outputs/learning]

Each seed runs `make demo ARGS="--seed S --output_dir <out>/seedS --run_name …"`: the embedded default exactly as
`make demo` launches it (two CPU processes over gloo), in its own output folder (the toy world and index are shared and
built by the first run if missing, inside its wall time: the first seed's "wall s" includes that build unless
outputs/toyworld exists; a folder holding a finished warm start of the same seed reuses it (its "warm start s" is —,
left out of the mean), so delete <out> for honest wall times). Its output goes to <out>/seedS/run.log; the learning
table is read from learning.json and the phase times from the one-line summaries in the log.

Prints per seed and as mean (min – max):
- test R@1 of the original question, the warm start and the GRPO refiner; attribute words per query (GRPO);
- accuracy per attribute (colour, shape, pattern) of the warm start and of the GRPO refiner;
- wall time, warm start and GRPO seconds, and the cores the run kept busy on average (user + system CPU seconds of
  every process it started ÷ wall seconds).
Run it on an otherwise idle machine: anything else running takes the same cores.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from common.files import read_json
from toy.refiner import ATTRIBUTES

PHASES = {"warm start s": r"^warm start \(SFT\): \d+ steps in (\d+) s", "GRPO s": r"^GRPO: \d+ steps in (\d+) s"}


def phase_seconds(log: str) -> dict[str, float]:
    """Seconds of each phase from its summary line (NaN when the phase did not run, e.g. a reused warm start)."""
    found = {}
    for name, pattern in PHASES.items():
        m = re.search(pattern, log, flags=re.M)
        found[name] = float(m.group(1)) if m else float("nan")
    return found


def run_seed(seed: int, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    flags = f"--seed {seed} --output_dir {out} --run_name refine-rl-toy-seed{seed}"
    with open(out / "run.log", "w", encoding="utf-8") as log:
        subprocess.run(
            ["make", "-s", "demo", f"ARGS={flags}"], cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT
        )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    table = read_json(out / "learning.json")
    text = (out / "run.log").read_text(encoding="utf-8").replace("\r", "\n")
    return {
        "seed": seed,
        "retrieval": {
            "R@1 original": table["original"]["R@1"],
            "R@1 warm start": table["warm_start"]["R@1"],
            "R@1 GRPO": table["grpo"]["R@1"],
            "GRPO attribute words / query": table["grpo"]["attribute_words_per_query"],
        },
        "attributes": {
            f"{name} {a} %": table[key][f"{a}_accuracy"]
            for key, name in (("warm_start", "warm"), ("grpo", "GRPO"))
            for a in ATTRIBUTES
        },
        "time": {"wall s": wall, **phase_seconds(text), "cores busy": cpu / wall},
    }


def print_table(title: str, rows: list[dict], part: str) -> None:
    cols = list(rows[0][part])

    def fmt(c, v):
        if v != v:  # NaN: the phase did not run (a reused warm start)
            return "—"
        return f"{v:.2f}" if c in ("cores busy", "GRPO attribute words / query") else f"{v:.1f}"

    print(f"\n{title}\n")
    print("| seed | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for r in rows:
        print(f"| {r['seed']} | " + " | ".join(fmt(c, r[part][c]) for c in cols) + " |")
    if len(rows) > 1:
        cells = []
        for c in cols:
            vals = [v for v in (r[part][c] for r in rows) if v == v]  # the seeds where the phase ran
            cells.append(
                f"{fmt(c, sum(vals) / len(vals))} ({fmt(c, min(vals))} – {fmt(c, max(vals))})" if vals else "—"
            )
        print("| mean (min – max) | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default="outputs/learning")
    args = p.parse_args()
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(seed, (ROOT / args.out / f"seed{seed}").resolve()))
        r = rows[-1]
        print(
            f"seed {seed}: "
            + ", ".join(f"{k} {v:.1f}" for part in ("retrieval", "attributes", "time") for k, v in r[part].items()),
            flush=True,
        )
    where = f"this machine ({os.cpu_count()} cores), `make demo` per seed"
    print_table(f"embedded default, {len(rows)} seeds, {where}: test R@1 (360 held-out questions)", rows, "retrieval")
    print_table("accuracy per attribute of the stated query words", rows, "attributes")
    print_table("time", rows, "time")


if __name__ == "__main__":
    main()
