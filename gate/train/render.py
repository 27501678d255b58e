"""Labelled gate examples → TRL conversational prompt–completion rows with an image; class balance (pure); the rows
read back from a rendered file (``read_rows``)."""

from __future__ import annotations

import zlib
from collections import Counter
from pathlib import Path

import numpy as np

from common.files import read_jsonl
from gate.train.labels import stochastic_digit
from gate.variants import completion, messages, spec


def label_value(variant: str, rec: dict):
    """The label a labelled record carries for its variant (the key named in gate.variants)."""
    s = spec(variant)
    if variant == "inspector":
        return rec["inspector"]
    if variant == "answer":
        return (rec.get("answers") or [""])[0]
    if variant == "mct":
        return {"consistent": rec["consistent"], "summary": rec.get("summary")}
    return rec[s["label"]]


def class_of(variant: str, rec: dict, verbalisers=None) -> str:
    """The class an example counts in: the completion for binary and skb, pass/fail for the Inspector, the number
    of consistent documents for mct."""
    s = spec(variant, verbalisers)
    value = label_value(variant, rec)
    if variant == "inspector":
        return "pass" if value.get("pass") == "true" else "fail"
    if variant == "mct":
        return f"{len(value['consistent'])} consistent"
    if variant == "answer":
        return str(rec.get("question_type") or "answer")
    return completion(s, value)


def render_row(
    variant: str, rec: dict, verbalisers=None, skb_target: str = "stochastic", prompt: dict | None = None
) -> dict:
    """One SFT row. skb's non-integer score becomes a digit by ``skb_target``: ``round``, or ``stochastic`` (rounded
    up with probability equal to its fraction, seeded by the id: over examples the expected target is the score, the
    soft target without a custom loss); the row keeps the score as ``target``. ``prompt`` replaces the variant's."""
    s = spec(variant, verbalisers, prompt)
    extra = {}
    if variant == "skb":
        score = float(label_value(variant, rec))
        digit = stochastic_digit(score, zlib.crc32(str(rec["id"]).encode())) if skb_target == "stochastic" else score
        rec, extra = {**rec, s["label"]: digit}, {"target": score}
    return {
        "id": str(rec["id"]),
        "prompt": messages(s, rec["question"], rec.get("context")),
        "completion": [{"role": "assistant", "content": completion(s, label_value(variant, rec))}],
        "image": rec["image_path"],
        "class": class_of(variant, rec, verbalisers),
        "question": rec["question"],
        "context": rec.get("context"),
        **extra,
    }


def check_max_per_class(value) -> int | None:
    """``--max_per_class``: None (no cap) or a positive integer; 0 or less emptied or shrank the data without a word."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"--max_per_class must be a positive integer (or unset: no cap), got {value!r}")
    return value


def check_shaping(max_per_class, balance: bool, targets) -> None:
    """How the train split's classes are shaped: a cap (``--max_per_class``), ``--balance``, or ``--class_targets``,
    which sets every class's count itself (a cap or balance beside it was dropped without a word)."""
    check_max_per_class(max_per_class)
    if targets and (max_per_class is not None or balance):
        raise ValueError(
            "--class_targets sets each class's count: leave out --max_per_class and --balance, or --class_targets"
        )


def cap_classes(rows: list[dict], max_per_class: int | None, balance: bool, seed: int | None) -> list[dict]:
    """At most ``max_per_class`` rows per class (``balance``: the smallest class's size), chosen with ``seed``;
    input order is kept."""
    check_max_per_class(max_per_class)
    counts = Counter(r["class"] for r in rows)
    cap = min(counts.values()) if balance and counts else None
    if max_per_class is not None:
        cap = max_per_class if cap is None else min(cap, max_per_class)
    if cap is None:
        return rows
    rng = np.random.default_rng(seed)
    keep = set()
    for cls in counts:
        idx = [i for i, r in enumerate(rows) if r["class"] == cls]
        keep.update(rng.permutation(idx)[:cap].tolist() if len(idx) > cap else idx)
    return [r for i, r in enumerate(rows) if i in keep]


def parse_class_targets(text: str) -> dict[str, float]:
    """``"pass:3000,fail:5000"`` (counts) or ``"pass:0.375,fail:0.625"`` (shares) → {class: value}."""
    out = {}
    for part in str(text).split(","):
        name, _, value = part.strip().partition(":")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--class_targets: {part.strip()!r} must look like class:count or class:share") from None
        if not name.strip() or out[name.strip()] < 0:
            raise ValueError(f"--class_targets: {part.strip()!r} needs a class name and a value ≥ 0")
    return out


def class_targets(available: dict[str, int], targets: dict[str, float]) -> dict[str, int]:
    """How many rows of each class to take. Counts (every value a whole number, one above 1): each class up to its
    count. Shares (values summing to 1): the largest total whose shares every class can fill. Every available class
    must be named."""
    missing = sorted(set(available) - set(targets))
    if missing:
        raise ValueError(
            f"--class_targets names no target for class(es) {', '.join(missing)} "
            f"(classes here: {', '.join(sorted(available))})"
        )
    values = [targets[c] for c in available]
    if all(float(v).is_integer() for v in values) and any(v > 1 for v in values):
        return {c: min(available[c], int(targets[c])) for c in available}
    if abs(sum(values) - 1.0) > 1e-6:
        raise ValueError(f"--class_targets {targets}: give whole counts, or shares that sum to 1")
    total = min((available[c] / targets[c] for c in available if targets[c] > 0), default=0)
    return {c: min(available[c], int(targets[c] * total + 1e-9)) for c in available}


def take_classes(rows: list[dict], take: dict[str, int], seed: int | None) -> list[dict]:
    """``take[class]`` rows of each class, chosen with ``seed``; input order kept."""
    rng = np.random.default_rng(seed)
    keep = set()
    for cls, n in take.items():
        idx = [i for i, r in enumerate(rows) if r["class"] == cls]
        keep.update(rng.permutation(idx)[:n].tolist())
    return [r for i, r in enumerate(rows) if i in keep]


def render_rows(
    variant: str,
    recs: list[dict],
    verbalisers=None,
    max_per_class: int | None = None,
    seed: int | None = 0,
    balance: bool = False,
    skb_target: str = "stochastic",
    targets: dict[str, float] | None = None,
    report: dict | None = None,
    prompt: dict | None = None,
) -> list[dict]:
    """SFT rows; ``targets`` (``class_targets``) samples each class to its count or share, and ``report`` gets
    {class: {available, wanted, taken}}; ``prompt`` replaces the variant's."""
    check_shaping(max_per_class, balance, targets)
    rows = [render_row(variant, r, verbalisers, skb_target, prompt) for r in recs]
    if targets is None:
        return cap_classes(rows, max_per_class, balance, seed)
    available = dict(Counter(r["class"] for r in rows))
    take = class_targets(available, targets)
    if report is not None:
        report.update({c: {"available": available[c], "wanted": targets[c], "taken": take[c]} for c in available})
    return take_classes(rows, take, seed)


def class_balance(rows: list[dict]) -> dict[str, int]:
    return dict(sorted(Counter(r["class"] for r in rows).items()))


def format_balance(balance: dict[str, int]) -> str:
    total = sum(balance.values()) or 1
    return ", ".join(f"{k}: {v} ({100 * v / total:.1f} %)" for k, v in balance.items()) or "none"


def question_of(rec: dict) -> str:
    """The question a labelled example comes from (srt's and mct's per-document examples share it)."""
    return str(rec.get("question_id") or rec["id"])


def hold_out(by_split: dict[str, list[dict]], fraction: float, seed: int) -> dict[str, list[dict]]:
    """``fraction`` of the train split's questions moved, with every example of theirs, to a ``test`` split: the
    held-out rows a gate's ``eval_file`` reads when all the questions came from one split (InfoSeek's or E-VQA's
    train). A question is held out by a hash of its id and ``seed``, so the same questions in every variant."""
    if not 0 < fraction < 1:
        raise ValueError(f"--holdout must be a fraction in (0, 1), got {fraction}")
    if "test" in by_split:
        raise ValueError("--holdout: the labels already have a test split (the questions' own split); leave it out")
    train = by_split.get("train", [])
    chosen = [zlib.crc32(f"{seed}:{question_of(r)}".encode()) < fraction * 2**32 for r in train]
    held = [r for r, c in zip(train, chosen) if c]
    kept = [r for r, c in zip(train, chosen) if not c]
    if not held or not kept:
        raise ValueError(
            f"--holdout {fraction}: the train split's {len(held) + len(kept)} examples would leave a split empty"
        )
    return {**by_split, "train": kept, "test": [{**r, "split": "test"} for r in held]}


RENDERED_FIELDS = ("id", "prompt", "completion", "image", "question")  # what render_row writes in every row
NOT_RENDERED = "not a rendered file (python -m gate.train.build_data --stage render writes one)"


def read_rows(path) -> list[dict]:
    """A rendered file's rows: a file without rows, a row without a rendered field (a labels file passed instead) or
    an image file that is not there is an error naming it."""
    rows = list(read_jsonl(path, RENDERED_FIELDS, NOT_RENDERED))
    if not rows:
        raise ValueError(f"{path} has no rows")
    missing = [r.get("id") for r in rows if not Path(r.get("image") or "").is_file()]
    if missing:
        raise ValueError(f"{path}: {len(missing)} row(s) have no image file (first: {missing[:3]})")
    return rows
