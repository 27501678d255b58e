"""Scoring a trained gate: the probability of the positive verbaliser from the first generated token's logits.

    python -m gate.scoring --model DIR --data DIR/hkb.test.jsonl --out DIR [--threshold 0.5]

One function for every binary gate (``first_token_scores``): the logits of the next token after the prompt (and the
variant's completion prefix, e.g. the Inspector's ``{"pass": "``), softmax over the verbaliser tokens — the same as
renormalising their probabilities — and the positive one's share, compared with the scoring threshold γ (a probability; KBM's τ only builds labels); for
``skb`` the expected value over the digit tokens 1–5, compared with ε. Verbalisers must be single tokens in the
model's tokenizer (``verbaliser_ids`` says which is not). The Inspector's FAIL answer and ``mct`` come from
generate-and-parse (``generate_parsed``). One scoring pass gives the threshold sweep: CSV + a PNG of positive
(retrieval) ratio vs accuracy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gate.variants import BINARY, messages, parse_completion, spec

GATE_FILE = "gate.json"
DEFAULT_THRESHOLDS = {"skb": 3.0}  # γ = 0.5 for the binary gates (KBM's τ = 0.9 labels data only)


def verbaliser_ids(tokenizer, s: dict) -> list[int]:
    """Token id of each verbaliser (after the variant's prefix); a ValueError naming any that is not one token."""
    prefix = tokenizer.encode(s["prefix"], add_special_tokens=False) if s["prefix"] else []
    ids, bad = [], []
    for v in s["verbalisers"]:
        toks = tokenizer.encode(s["prefix"] + v, add_special_tokens=False)
        if len(toks) != len(prefix) + 1 or toks[:len(prefix)] != prefix:
            bad.append(f"{v!r} → {tokenizer.convert_ids_to_tokens(toks[len(prefix):])}")
        else:
            ids.append(toks[-1])
    if bad:
        raise ValueError(f"variant {s['name']}: verbalisers must be single tokens in this model's tokenizer; "
                         f"{'; '.join(bad)}. Choose others with --verbalisers (e.g. single characters or digits)")
    if len(set(ids)) != len(ids):
        raise ValueError(f"variant {s['name']}: verbalisers {s['verbalisers']} map to the same token")
    return ids


def load_gate(path, device: str | None = None, dtype: str | None = None):
    """A trained gate folder (train_sft's ``final``): model, processor and its spec from gate.json, on ``device``
    (default: cpu) in ``dtype`` (default: bf16 on a GPU, fp32 on the CPU)."""
    from rl.model import load_model

    path = Path(path)
    if not (path / GATE_FILE).is_file():
        raise ValueError(f"gate model {path}: no {GATE_FILE} (a folder written by gate/train_sft.py)")
    info = json.loads((path / GATE_FILE).read_text())
    s = spec(info["variant"], info.get("verbalisers"), info.get("prompt"))
    model, processor = load_model(str(path), dtype=dtype, device=device or "cpu")
    if info["variant"] in BINARY or info["variant"] == "skb":
        verbaliser_ids(processor.tokenizer, s)
    return model.eval(), processor, s


def gate_of(path: str, device: str, dtype: str | None, *variants):
    """``load_gate``, refusing a gate of another variant than ``variants`` (the pipeline's stages)."""
    model, processor, s = load_gate(path, device=device, dtype=dtype)
    if s["name"] not in variants:
        raise ValueError(f"{path} is a {s['name']} gate; expected {' or '.join(variants)}")
    return model, processor, s


def _prompt_texts(processor, s: dict, questions, contexts, with_prefix: bool) -> list[str]:
    contexts = contexts if contexts is not None else [None] * len(questions)
    return [processor.apply_chat_template(messages(s, q, c, with_image_block=True), add_generation_prompt=True,
                                          tokenize=False) + (s["prefix"] if with_prefix else "")
            for q, c in zip(questions, contexts)]


def first_token_scores(model, processor, s: dict, images, questions, contexts=None, batch_size: int = 16) -> np.ndarray:
    """Binary variants: P(positive verbaliser) per example; skb: the expected digit 1–5. Left padding keeps the next
    token's logits at the last position, and only that position's logits are computed (``logits_to_keep=1``)."""
    import torch

    ids = verbaliser_ids(processor.tokenizer, s)
    processor.tokenizer.padding_side = "left"
    texts = _prompt_texts(processor, s, questions, contexts, with_prefix=True)
    out = []
    with torch.no_grad():
        for i in range(0, len(texts), batch_size):
            batch = processor(text=texts[i:i + batch_size], images=images[i:i + batch_size], return_tensors="pt",
                              padding=True).to(model.device)
            logits = model(**batch, logits_to_keep=1).logits[:, -1, :].float()  # no vocab × positions tensor
            probs = torch.softmax(logits[:, ids], dim=-1).cpu().numpy()
            out.append(probs @ np.arange(1, 6) if s["name"] == "skb" else probs[:, 0])
    return np.concatenate(out) if out else np.zeros(0)


def generate_parsed(model, processor, s: dict, images, questions, contexts=None, batch_size: int = 16,
                    max_new_tokens: int | None = None) -> list:
    """Greedy generation, parsed by the variant (the Inspector's {"pass", "answer"}, mct's documents and summary)."""
    from rl.generate import generate_completions

    max_new_tokens = max_new_tokens or (128 if s["name"] == "mct" else 48)  # mct writes a summary too
    users = [m[1]["content"] for m in (messages(s, q, c) for q, c in
                                       zip(questions, contexts if contexts is not None else [None] * len(questions)))]
    texts = generate_completions(model, processor, images, users, prompt={"system": s["system"],
                                 "user_template": "{question}"}, batch_size=batch_size, max_new_tokens=max_new_tokens)
    return [parse_completion(s, t) for t in texts]


def decisions(scores, threshold: float) -> np.ndarray:
    """Positive (search / relevant / pass) when the score reaches the threshold."""
    return np.asarray(scores, dtype=float) >= threshold


def sweep(scores, labels, thresholds) -> list[dict]:
    """Accuracy and positive ratio at each threshold, from one set of scores. ``labels``: True = positive."""
    labels = np.asarray(labels, dtype=bool)
    rows = []
    for t in thresholds:
        d = decisions(scores, t)
        rows.append({"threshold": float(t), "positive_ratio": float(d.mean()) if len(d) else 0.0,
                     "accuracy": float((d == labels).mean()) if len(d) else 0.0})
    return rows


def true_labels(s: dict, rows: list[dict], threshold: float) -> tuple[np.ndarray, np.ndarray | None]:
    """From rendered rows: the positive/negative truth, and for skb the target score (the row's non-integer
    ``target`` when it has one, else the completion's digit)."""
    targets = [parse_completion(s, r["completion"][0]["content"]) for r in rows]
    if s["name"] == "skb":
        values = np.asarray([r.get("target", t) for r, t in zip(rows, targets)], dtype=float)
        return values >= threshold, values
    if s["name"] == "inspector":
        return np.asarray([t["pass"] for t in targets]), None
    return np.asarray(targets, dtype=bool), None


def evaluate_gate(model, processor, s: dict, rows: list[dict], threshold: float | None = None,
                  batch_size: int = 16) -> dict:
    """Held-out metrics of a gate on rendered rows: accuracy and balanced accuracy (mean recall of the two classes)
    at the threshold, the positive ratio predicted and true, the majority-class accuracy to beat, and (skb) the mean
    absolute error of the expected score."""
    from PIL import Image

    threshold = DEFAULT_THRESHOLDS.get(s["name"], 0.5) if threshold is None else threshold
    images = [Image.open(r["image"]).convert("RGB") for r in rows]
    questions = [r["question"] for r in rows]
    contexts = [r.get("context") for r in rows]
    truth, values = true_labels(s, rows, threshold)
    scores = first_token_scores(model, processor, s, images, questions, contexts, batch_size)
    d = decisions(scores, threshold)
    majority = max(truth.mean(), 1 - truth.mean()) if len(truth) else 0.0
    recalls = [float((d[truth == c] == c).mean()) for c in (True, False) if (truth == c).any()]
    out = {"variant": s["name"], "n": len(rows), "threshold": threshold, "accuracy": float((d == truth).mean()),
           "balanced_accuracy": float(np.mean(recalls)) if recalls else 0.0,
           "majority_baseline": float(majority), "predicted_positive_ratio": float(d.mean()),
           "true_positive_ratio": float(truth.mean())}
    if values is not None:
        out["mae"] = float(np.abs(scores - values).mean())
    return out | {"scores": scores.tolist(), "truth": truth.tolist()}


def evaluate_generated(model, processor, s: dict, rows: list[dict], batch_size: int = 16) -> dict:
    """Held-out accuracy of generate-and-parse: the parsed output equals the parsed target (answers compared after
    InfoSeek normalisation), and the share of outputs that parse."""
    from PIL import Image

    from gate.metrics import normalize_answer

    images = [Image.open(r["image"]).convert("RGB") for r in rows]
    got = generate_parsed(model, processor, s, images, [r["question"] for r in rows], [r.get("context") for r in rows],
                          batch_size)
    want = [parse_completion(s, r["completion"][0]["content"]) for r in rows]
    if s["name"] == "answer":
        got, want = [normalize_answer(g) for g in got], [normalize_answer(w) for w in want]
    if s["name"] == "mct":  # the documents listed, in order; the free-text summary is not compared
        got, want = [g and g["consistent"] for g in got], [w and w["consistent"] for w in want]
    right = [g is not None and g == w for g, w in zip(got, want)]
    by_class: dict[str, list[bool]] = {}
    for r, ok in zip(rows, right):
        by_class.setdefault(r.get("class", ""), []).append(ok)
    return {"variant": s["name"], "n": len(rows), "accuracy": float(np.mean(right)) if rows else 0.0,
            "parsed": float(np.mean([g is not None for g in got])) if rows else 0.0,
            "accuracy_by_class": {k: float(np.mean(v)) for k, v in sorted(by_class.items())}}


@dataclass
class ScoringArgs:
    model: str = field(default=None, metadata={"help": "trained gate folder (train_sft output_dir/final)"})
    data: str = field(default=None, metadata={"help": "rendered rows (gate.build_data --stage render)"})
    out: str = field(default=None, metadata={"help": "folder for scores.jsonl, metrics.json, sweep.csv, sweep.png"})
    threshold: float = field(default=None, metadata={"help": "scoring threshold γ (binary, default 0.5) or ε (skb, default 3)"})
    batch_size: int = field(default=16, metadata={"help": "examples per forward pass"})


def write_sweep(out: Path, scores, truth, name: str) -> list[dict]:
    from retrieval.files import pyplot, save_figure, write_text_atomic

    grid = np.linspace(1, 5, 41) if name == "skb" else np.linspace(0, 1, 41)
    rows = sweep(scores, truth, grid)
    write_text_atomic(out / "sweep.csv", "threshold,positive_ratio,accuracy\n" + "".join(
        f"{r['threshold']:.3f},{r['positive_ratio']:.4f},{r['accuracy']:.4f}\n" for r in rows))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.plot([r["positive_ratio"] for r in rows], [r["accuracy"] for r in rows], marker=".")
    ax.set_xlabel("positive (retrieval) ratio")
    ax.set_ylabel("gate accuracy")
    ax.set_title(f"{name}: threshold sweep")
    save_figure(fig, out / "sweep.png")
    return rows


def score_file(args: ScoringArgs, log=print) -> dict:
    from retrieval.cli import require_file
    from retrieval.files import read_jsonl, write_json_atomic, write_jsonl_atomic

    require_file(args.data, "data")
    if not args.out:
        raise ValueError("--out is required")
    model, processor, s = load_gate(args.model)
    if s["name"] not in BINARY and s["name"] != "skb":
        raise ValueError(f"variant {s['name']} has no first-token score (generate-and-parse only)")
    rows = list(read_jsonl(args.data))
    result = evaluate_gate(model, processor, s, rows, args.threshold, args.batch_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl_atomic(out / "scores.jsonl", ({"id": r["id"], "score": sc, "positive": t}
                                              for r, sc, t in zip(rows, result["scores"], result["truth"])))
    write_sweep(out, result["scores"], result["truth"], s["name"])
    metrics = {k: v for k, v in result.items() if k not in ("scores", "truth")}
    write_json_atomic(out / "metrics.json", metrics)
    log(json.dumps(metrics, indent=1))
    return metrics


def main(argv=None) -> None:
    from retrieval.cli import parse

    (args,) = parse((ScoringArgs,), argv, description=__doc__)
    score_file(args)


if __name__ == "__main__":
    from retrieval.cli import run

    run(main)
