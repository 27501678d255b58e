"""Per-stage latency share and questions/s of the KB-VQA pipeline on the toy world, with and without the gate.

    .venv/bin/python benchmarks/pipeline.py [--config configs/pipeline/toy.yaml] [--questions 240]

Runs the pipeline twice on the same questions with ``baselines: false`` (only the path each question takes): once
with the configured boundary gate, once with ``gate: always`` (every question retrieves). Models are loaded once
per run and not timed. Needs docs/toy-world.md's gate section to have been run (outputs/gate/...).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import yaml  # noqa: E402

from common.files import read_jsonl  # noqa: E402
from gate.pipeline.arguments import PipelineArgs  # noqa: E402
from gate.pipeline.run import run, stage_names  # noqa: E402
from gate.pipeline.stages import Stages  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--config", default="configs/pipeline/toy.yaml")
p.add_argument("--questions", type=int, default=240)
args = p.parse_args()

config = yaml.safe_load(open(args.config, encoding="utf-8"))
STAGES = stage_names(config.get("consistency", "none") != "none")
rows = []
for label, gate in (("with the gate", config["gate"]), ("without (always retrieve)", "always")):
    with tempfile.TemporaryDirectory() as out:
        cfg = PipelineArgs(**{**config, "gate": gate, "out": out, "baselines": False, "limit": args.questions})
        stages = Stages(cfg)
        t0 = time.perf_counter()
        metrics = run(cfg, log=lambda *a: None, stages=stages)
        wall = time.perf_counter() - t0
        recs = [r for r in read_jsonl(Path(out) / "predictions.jsonl") if "skipped" not in r]
    # a question's latency holds only the stages it went through, so the sums are each stage's seconds
    seconds = {s: sum(r["latency"].get(s, 0.0) for r in recs) for s in STAGES}
    rows.append((label, metrics, wall, seconds))
    placement = placement if rows[1:] else stages.placement  # the gated run's, which has every stage

print(
    f"pipeline {args.config} on {rows[0][1]['n']} toy-world test questions, CPU ({os.cpu_count()} cores), "
    "models loaded beforehand\n"
)
print("| run | questions/s | accuracy | retrieval ratio | " + " | ".join(f"{s} %" for s in STAGES) + " |")
print("|---|---|---|---|" + "---|" * len(STAGES))
for label, m, wall, seconds in rows:
    total = sum(seconds.values()) or 1.0
    shares = " | ".join(f"{100 * seconds[s] / total:.1f}" for s in STAGES)
    print(
        f"| {label} | {m['n'] / wall:.1f} | {100 * m['accuracy']:.1f} | {100 * m['retrieval_ratio']:.1f} | {shares} |"
    )

# where each stage's model ran (Stages.placement: one device and dtype for the whole pipeline, set by device / dtype)
print("\n| stage | device and dtype |")
print("|---|---|")
for stage, where in placement.items():
    print(f"| {stage} | {where} |")
