"""The toy world's calibration: where its test questions rank the gold entity as asked, and with 0–3 of the
creature's attribute words (or a wrong one) added — the properties a refiner needs to learn from the retrieval
reward. ``calibrate`` returns the report that toy/world.py writes to calibration.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from toy.drawing import ATTRIBUTE_VALUES, ATTRIBUTES

# The paper's Table 5 buckets (hit-rank strata of the RL data)
BUCKETS = [("1-5", 1, 5), ("6-10", 6, 10), ("11-20", 11, 20), ("21-200", 21, 200)]


def bucket_histogram(ranks: list[int | None]) -> dict[str, float]:
    """Share of ranks in each Table-5 bucket (1–5, 6–10, 11–20, 21–200) and beyond (miss)."""
    n = max(len(ranks), 1)
    hist = {name: sum(1 for r in ranks if r is not None and lo <= r <= hi) / n for name, lo, hi in BUCKETS}
    hist["miss"] = sum(1 for r in ranks if r is None or r > 200) / n
    return hist


def median_rank(ranks: list[int | None], depth: int) -> float:
    return float(np.median([depth + 1 if r is None else r for r in ranks]))


def calibrate(index, world_dir: Path, alpha: float, depth: int = 200, seed: int = 0) -> dict:
    """Rank the test questions with and without attribute words; returns the calibration report."""
    rows = [json.loads(line) for line in open(world_dir / "test.jsonl", encoding="utf-8")]
    image_emb = index.encode_images([Image.open(world_dir / r["image"]).convert("RGB") for r in rows])
    gold = [r["entity_id"] for r in rows]
    rng = np.random.default_rng(seed)

    def ranks(texts):
        return index.entity_ranks(image_emb, texts, gold, alpha=alpha, depth=depth)

    def with_words(keys_per_row, wrong=None):
        texts = []
        for r, keys in zip(rows, keys_per_row):
            words = [r["attributes"][k] for k in keys]
            if wrong is not None:
                k = wrong(r)
                words.append(str(rng.choice([v for v in ATTRIBUTE_VALUES[k] if v != r["attributes"][k]])))
            texts.append(" ".join([r["question"], *words]))
        return texts

    subsets = {n: [sorted(rng.choice(len(ATTRIBUTES), size=n, replace=False)) for _ in rows] for n in range(4)}
    keys = {n: [[ATTRIBUTES[i] for i in s] for s in subsets[n]] for n in range(4)}
    original = ranks([r["question"] for r in rows])
    by_count = {n: ranks(with_words(keys[n])) for n in range(4)}
    # two correct attribute words, plus the third one wrong
    third = [next(a for a in ATTRIBUTES if a not in k) for k in keys[2]]
    it = iter(third)
    two_plus_wrong = ranks(with_words(keys[2], wrong=lambda r: next(it)))
    medians = {n: median_rank(by_count[n], depth) for n in range(4)}
    report = {
        "alpha": alpha,
        "depth": depth,
        "questions": len(rows),
        "entities": index.num_entities,
        "original_buckets": bucket_histogram(original),
        "original_median_rank": median_rank(original, depth),
        "all_attributes_top5": float(np.mean([r is not None and r <= 5 for r in by_count[3]])),
        "median_rank_by_correct_attributes": medians,
        "median_rank_two_correct_one_wrong": median_rank(two_plus_wrong, depth),
    }
    spread = sum(1 for name, _, _ in BUCKETS if report["original_buckets"][name] >= 0.05)
    report["checks"] = {
        "original ranks spread over ≥ 3 reward buckets (≥ 5 % each)": spread >= 3,
        "all three attributes rank the gold entity top-5 for most questions": report["all_attributes_top5"] >= 0.7,
        "each additional correct attribute improves the median rank": all(
            medians[n + 1] <= medians[n] for n in range(3)
        )
        and medians[3] < medians[0],
        "a wrong attribute word worsens the median rank": report["median_rank_two_correct_one_wrong"] > medians[2],
    }
    return report


def format_report(rep: dict) -> str:
    b = rep["original_buckets"]
    lines = [
        f"toy-world calibration: {rep['questions']} test questions, {rep['entities']} entities, α = {rep['alpha']}",
        "original-question rank buckets: " + "  ".join(f"{k}: {100 * v:.0f}%" for k, v in b.items()),
        "median rank by correct attribute words: "
        + "  ".join(f"{n}: {v:g}" for n, v in rep["median_rank_by_correct_attributes"].items())
        + f"   (2 correct + 1 wrong: {rep['median_rank_two_correct_one_wrong']:g})",
        f"all three attributes → top-5: {100 * rep['all_attributes_top5']:.0f}%",
    ]
    lines += [f"  [{'ok' if ok else 'FAIL'}] {name}" for name, ok in rep["checks"].items()]
    return "\n".join(lines)
