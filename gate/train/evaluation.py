"""Held-out evaluation of a trained gate, and the threshold sweep: CSV + a PNG of positive (retrieval) ratio vs
accuracy, from one scoring pass.

    python -m gate.train.evaluation --model DIR --data DIR/hkb.test.jsonl --out DIR [--threshold 0.5]
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.cli import parse, require_file, run
from common.files import pyplot, save_figure, write_json_atomic, write_jsonl_atomic, write_text_atomic
from gate.scoring import (
    check_gate_threshold,
    check_threshold,
    decisions,
    first_token_scores,
    generate_parsed,
    load_gate,
    threshold_grid,
)
from gate.train.render import read_rows
from gate.variants import BINARY, parse_completion
from retrieval.answers import normalize_answer
from rl.model import open_vlm_image


def sweep(scores, labels, thresholds) -> list[dict]:
    """Accuracy and positive ratio at each threshold, from one set of scores. ``labels``: True = positive."""
    labels = np.asarray(labels, dtype=bool)
    rows = []
    for t in thresholds:
        d = decisions(scores, t)
        rows.append(
            {
                "threshold": float(t),
                "positive_ratio": float(d.mean()) if len(d) else 0.0,
                "accuracy": float((d == labels).mean()) if len(d) else 0.0,
            }
        )
    return rows


def read_targets(s: dict, rows: list[dict]) -> list:
    """Each rendered row's target as the gate reads its own output (``parse_completion``). A completion the gate
    cannot read (rows rendered for another variant, or with other ``--verbalisers``) is an error naming the row, not
    a negative or a miss; gate/train/sft.py calls this on its eval_file before any model loads."""
    targets = [parse_completion(s, r["completion"][0]["content"]) for r in rows]
    unread = [(r.get("id"), r["completion"][0]["content"]) for r, t in zip(rows, targets) if t is None]
    if unread:
        (first_id, first_text), n = unread[0], len(unread)
        words = f"its verbalisers: {', '.join(map(str, s['verbalisers']))}" if s["verbalisers"] else "its JSON"
        raise ValueError(
            f"{n} of {len(rows)} rows have a completion the {s['name']} gate cannot read ({words}); first: row "
            f"{first_id}, {first_text!r}: rows rendered for another variant, or with other --verbalisers?"
        )
    return targets


def true_labels(s: dict, rows: list[dict], threshold: float) -> tuple[np.ndarray, np.ndarray | None]:
    """From rendered rows: the positive/negative truth, and for skb the target score (the row's non-integer
    ``target`` when it has one, else the completion's digit). skb's truth is "search" when the target exceeds the
    threshold: 6 − mean > 3 is mean < 3, hkb's label at ε = 3, so both variants call the same questions "search"
    (15 of 30 answers right, a mean of exactly 3 with the exact judge, is "no search" in both). A completion the gate
    cannot read is an error (``read_targets``)."""
    targets = read_targets(s, rows)
    if s["name"] == "skb":
        values = np.asarray([r.get("target", t) for r, t in zip(rows, targets)], dtype=float)
        return values > threshold, values
    if s["name"] == "inspector":
        return np.asarray([t["pass"] for t in targets]), None
    return np.asarray(targets, dtype=bool), None


def evaluate_gate(
    model, processor, s: dict, rows: list[dict], threshold: float | None = None, batch_size: int = 16
) -> dict:
    """Held-out metrics of a gate on rendered rows: accuracy and balanced accuracy (mean recall of the two classes)
    at the threshold, the positive ratio predicted and true, the majority-class accuracy to beat, and (skb) the mean
    absolute error of the expected score."""
    threshold = check_threshold(s["name"], threshold)
    images = [open_vlm_image(r["image"]) for r in rows]
    questions = [r["question"] for r in rows]
    contexts = [r.get("context") for r in rows]
    truth, values = true_labels(s, rows, threshold)
    scores = first_token_scores(model, processor, s, images, questions, contexts, batch_size)
    d = decisions(scores, threshold)
    majority = max(truth.mean(), 1 - truth.mean()) if len(truth) else 0.0
    recalls = [float((d[truth == c] == c).mean()) for c in (True, False) if (truth == c).any()]
    out = {
        "variant": s["name"],
        "n": len(rows),
        "threshold": threshold,
        "accuracy": float((d == truth).mean()),
        "balanced_accuracy": float(np.mean(recalls)) if recalls else 0.0,
        "majority_baseline": float(majority),
        "predicted_positive_ratio": float(d.mean()),
        "true_positive_ratio": float(truth.mean()),
    }
    if values is not None:
        out["mae"] = float(np.abs(scores - values).mean())
    return out | {"scores": scores.tolist(), "truth": truth.tolist()}


def evaluate_generated(model, processor, s: dict, rows: list[dict], batch_size: int = 16) -> dict:
    """Held-out accuracy of generate-and-parse: the parsed output equals the parsed target (answers compared after
    InfoSeek normalisation), and the share of outputs that parse."""
    want = read_targets(s, rows)
    images = [open_vlm_image(r["image"]) for r in rows]
    got = generate_parsed(
        model, processor, s, images, [r["question"] for r in rows], [r.get("context") for r in rows], batch_size
    )
    if s["name"] == "answer":
        got, want = [normalize_answer(g) for g in got], [normalize_answer(w) for w in want]
    if s["name"] == "mct":  # the documents listed, in order; the free-text summary is not compared
        got, want = [g and g["consistent"] for g in got], [w and w["consistent"] for w in want]
    right = [g is not None and g == w for g, w in zip(got, want)]
    by_class: dict[str, list[bool]] = {}
    for r, ok in zip(rows, right):
        by_class.setdefault(r.get("class", ""), []).append(ok)
    return {
        "variant": s["name"],
        "n": len(rows),
        "accuracy": float(np.mean(right)) if rows else 0.0,
        "parsed": float(np.mean([g is not None for g in got])) if rows else 0.0,
        "accuracy_by_class": {k: float(np.mean(v)) for k, v in sorted(by_class.items())},
    }


@dataclass
class ScoringArgs:
    model: str = field(default=None, metadata={"help": "trained gate folder (train_sft output_dir/final)"})
    data: str = field(default=None, metadata={"help": "rendered rows (gate.train.build_data --stage render)"})
    out: str = field(default=None, metadata={"help": "folder for scores.jsonl, metrics.json, sweep.csv, sweep.png"})
    threshold: float = field(
        default=None,
        metadata={
            "help": "scoring threshold γ (binary, default 0.5), or t on skb's expected digit (default 3; its "
            "truth: target > t, a mean judge score below 6 − t)"
        },
    )
    batch_size: int = field(default=16, metadata={"help": "examples per forward pass"})
    device: str = field(default=None, metadata={"help": "cuda / cuda:N / cpu (default: this process's own)"})
    dtype: str = field(default=None, metadata={"help": "bfloat16 / float16 / float32 (default: bf16 on a GPU)"})


def write_sweep(out: Path, scores, truth, name: str) -> list[dict]:
    rows = sweep(scores, truth, threshold_grid(scores, soft=name == "skb", points=41))  # both ends of the curve
    write_text_atomic(
        out / "sweep.csv",
        "threshold,positive_ratio,accuracy\n"
        + "".join(f"{r['threshold']:.3f},{r['positive_ratio']:.4f},{r['accuracy']:.4f}\n" for r in rows),
    )
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.plot([r["positive_ratio"] for r in rows], [r["accuracy"] for r in rows], marker=".")
    ax.set_xlabel("positive (retrieval) ratio")
    ax.set_ylabel("gate accuracy")
    ax.set_title(f"{name}: threshold sweep")
    save_figure(fig, out / "sweep.png")
    return rows


def score_file(args: ScoringArgs, log=print) -> dict:
    require_file(args.data, "data")
    if not args.out:
        raise ValueError("--out is required")
    rows = read_rows(args.data)  # an empty file wrote NaN metrics over an earlier run's
    check_gate_threshold(args.model, args.threshold)  # before the model loads
    model, processor, s = load_gate(args.model, device=args.device, dtype=args.dtype)
    if s["name"] not in BINARY and s["name"] != "skb":
        raise ValueError(f"variant {s['name']} has no first-token score (generate-and-parse only)")
    result = evaluate_gate(model, processor, s, rows, args.threshold, args.batch_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl_atomic(
        out / "scores.jsonl",
        ({"id": r["id"], "score": sc, "positive": t} for r, sc, t in zip(rows, result["scores"], result["truth"])),
    )
    write_sweep(out, result["scores"], result["truth"], s["name"])
    metrics = {k: v for k, v in result.items() if k not in ("scores", "truth")}
    write_json_atomic(out / "metrics.json", metrics)
    log(json.dumps(metrics, indent=1))
    return metrics


def main(argv=None) -> None:
    (args,) = parse((ScoringArgs,), argv, description=__doc__)
    score_file(args)


if __name__ == "__main__":
    run(main)
