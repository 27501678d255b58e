"""Questions per second of batched refiner inference (HF backend) against batch size 1.

    .venv/bin/python benchmarks/refine.py [--model outputs/refiner] [--world outputs/toyworld] [--questions 64]
        [--batch-sizes 1,8,32,64]

Uses an exported refiner (run the embedded default and `python -m rl.export --config configs/grpo/export_toy.yaml`
first) and the toy world's test questions; greedy decoding, as `python -m rl.refine` does by default.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from PIL import Image  # noqa: E402

from rl.refine import Refiner  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", default="outputs/refiner")
p.add_argument("--world", default="outputs/toyworld")
p.add_argument("--questions", type=int, default=64)
p.add_argument("--batch-sizes", default="1,8,32,64")
args = p.parse_args()

refiner = Refiner.load(args.model, device="cpu")
world = Path(args.world)
rows = [json.loads(x) for x in open(world / "test.jsonl", encoding="utf-8")][: args.questions]
images = [Image.open(world / r["image"]).convert("RGB") for r in rows]
questions = [r["question"] for r in rows]
refiner.refine(images[:4], questions[:4], batch_size=4)  # warm-up

results = []
for bs in [int(b) for b in args.batch_sizes.split(",")]:
    t0 = time.perf_counter()
    out = refiner.refine_with_outputs(images, questions, batch_size=bs)
    dt = time.perf_counter() - t0
    results.append((bs, dt, sum(r["format_ok"] for r in out) / len(out)))

first, base = results[0][:2]  # the first batch size asked for (1 by default)
print(f"refiner {args.model} on {len(rows)} toy-world test questions, greedy, CPU ({os.cpu_count()} cores)\n")
print(f"| batch size | seconds | questions/s | speed-up vs batch {first} | parse rate |")
print("|---|---|---|---|---|")
for bs, dt, ok in results:
    print(f"| {bs} | {dt:.2f} | {len(rows) / dt:.1f} | {base / dt:.1f}× | {100 * ok:.0f}% |")
