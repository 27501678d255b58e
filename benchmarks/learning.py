"""The embedded default over seeds: what `make demo` learns, and how long it takes, seed by seed.

    .venv/bin/python benchmarks/learning.py [--seeds 0 1 2] [--out outputs/learning]

Each seed runs the embedded default exactly as `make demo` does (`accelerate launch rl/train_grpo.py --seed S`, its
own output folder; the toy world and index are shared and built by the first run if missing) and reads the
learning table it wrote (learning.json; its output in run.log). Prints per seed and as mean (min – max): test R@1 of the original question,
the warm start and the GRPO refiner; the GRPO refiner's accuracy per attribute and attribute words per query; wall
time and the cores the run kept busy on average (user + system CPU seconds ÷ wall seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rl.toy import ATTRIBUTES  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
p.add_argument("--out", default="outputs/learning")
args = p.parse_args()

accelerate = Path(sys.executable).with_name("accelerate")
rows = []
for seed in args.seeds:
    out = Path(args.out) / f"seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([str(accelerate), "launch", "rl/train_grpo.py", "--seed", str(seed), "--output_dir", str(out),
                    "--run_name", f"refine-rl-toy-seed{seed}"], cwd=ROOT, check=True,
                   stdout=open(out / "run.log", "w"), stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    table = json.loads((ROOT / out / "learning.json").read_text())
    row = {"seed": seed, "R@1 original": table["original"]["R@1"], "R@1 warm start": table["warm_start"]["R@1"],
           "R@1 GRPO": table["grpo"]["R@1"],
           **{f"GRPO {a} %": table["grpo"][f"{a}_accuracy"] for a in ATTRIBUTES},
           "GRPO attribute words / query": table["grpo"]["attribute_words_per_query"],
           "wall s": wall, "cores busy": cpu / wall}
    rows.append(row)
    print(f"seed {seed}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if k != "seed"), flush=True)

cols = [k for k in rows[0] if k != "seed"]
print(f"\nembedded default, {len(rows)} seeds, this machine ({os.cpu_count()} cores)\n")
print("| seed | " + " | ".join(cols) + " |")
print("|---|" + "---|" * len(cols))
for r in rows:
    print(f"| {r['seed']} | " + " | ".join(f"{r[c]:.1f}" if c != "cores busy" else f"{r[c]:.2f}" for c in cols) + " |")
summary = []
for c in cols:
    vals = [r[c] for r in rows]
    fmt = "{:.2f}" if c == "cores busy" else "{:.1f}"
    summary.append(f"{fmt.format(sum(vals) / len(vals))} ({fmt.format(min(vals))} – {fmt.format(max(vals))})")
print("| mean (min – max) | " + " | ".join(summary) + " |")
