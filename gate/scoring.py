"""Scoring a trained gate: the probability of the positive verbaliser from the first generated token's logits.

One function for every binary gate (``first_token_scores``): the logits of the next token after the prompt (and the
variant's completion prefix, e.g. the Inspector's ``{"pass": "``), softmax over the verbaliser tokens — the same as
renormalising their probabilities — and the positive one's share, compared with the scoring threshold γ (a
probability; KBM's τ only builds labels); for ``skb`` the expected value over the digit tokens 1–5, compared with ε. A
verbaliser is scored by its first token, so the verbalisers of a variant must start with different tokens of the
model's tokenizer (``verbaliser_ids`` names those that do not); a verbaliser may be longer (Qwen2.5's tokenizer splits
MMKB-RAG's ``NoRet`` into ``No`` + ``Ret``): the SFT completion is the whole word, whose first token decides. The
Inspector's FAIL answer and ``mct`` come from generate-and-parse (``generate_parsed``). Held-out evaluation and the
threshold sweep: gate.train.evaluation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from common.files import read_json
from common.placement import resolve_device
from gate.variants import BINARY, messages, parse_completion, spec
from rl.generate import generate_completions
from rl.model import load_model

GATE_FILE = "gate.json"
DEFAULT_THRESHOLDS = {"skb": 3.0}  # γ = 0.5 for the binary gates (KBM's τ = 0.9 labels data only)
REPLY_MARGIN = 16  # tokens a generated reply may run past the longest the gate was trained on
DEFAULT_REPLY_TOKENS = 160  # a gate folder without its longest target: above expand's 128-token sentences and JSON


def verbaliser_ids(tokenizer, s: dict) -> list[int]:
    """The token each verbaliser starts with, after the variant's prefix: first-token scoring compares these. A
    ValueError names verbalisers that start with one token (they cannot be told apart) or that the tokenizer merges
    with the prefix."""
    prefix = tokenizer.encode(s["prefix"], add_special_tokens=False) if s["prefix"] else []
    ids, merged = [], []
    for v in s["verbalisers"]:
        toks = tokenizer.encode(s["prefix"] + v, add_special_tokens=False)
        if len(toks) <= len(prefix) or toks[: len(prefix)] != prefix:
            merged.append(repr(v))
        else:
            ids.append(toks[len(prefix)])
    if merged:
        raise ValueError(
            f"variant {s['name']}: this model's tokenizer merges verbaliser(s) {', '.join(merged)} with the "
            f"completion prefix {s['prefix']!r}; choose others with --verbalisers"
        )
    first = [tokenizer.convert_ids_to_tokens(i) for i in ids]
    if len(set(ids)) != len(ids):
        shown = "; ".join(f"{v!r} → {t!r}" for v, t in zip(s["verbalisers"], first))
        raise ValueError(
            f"variant {s['name']}: first-token scoring needs verbalisers that start with different tokens of this "
            f"model's tokenizer, but {shown}; choose others with --verbalisers (e.g. single characters or digits)"
        )
    return ids


def load_gate(path, device: str | None = None, dtype: str | None = None):
    """A trained gate folder (train_sft's ``final``): model, processor and its spec from gate.json, on ``device``
    (default: this process's own, ``common.placement.resolve_device``) in ``dtype`` (default: bf16 on a GPU, fp32 on
    the CPU)."""
    path = Path(path)
    if not (path / GATE_FILE).is_file():
        raise ValueError(f"gate model {path}: no {GATE_FILE} (a folder written by gate/train/sft.py)")
    info = read_json(path / GATE_FILE)
    s = spec(info["variant"], info.get("verbalisers"), info.get("prompt"))
    model, processor = load_model(str(path), dtype=dtype, device=resolve_device(device))
    if info["variant"] in BINARY or info["variant"] == "skb":
        verbaliser_ids(processor.tokenizer, s)
    if info.get("longest_completion_tokens"):
        s["longest_completion_tokens"] = int(info["longest_completion_tokens"])
    return model.eval(), processor, s


def gate_of(path: str, device: str, dtype: str | None, *variants):
    """``load_gate``, refusing a gate of another variant than ``variants`` (the pipeline's stages)."""
    model, processor, s = load_gate(path, device=device, dtype=dtype)
    if s["name"] not in variants:
        raise ValueError(f"{path} is a {s['name']} gate; expected {' or '.join(variants)}")
    return model, processor, s


def _prompt_texts(processor, s: dict, questions, contexts, with_prefix: bool) -> list[str]:
    contexts = contexts if contexts is not None else [None] * len(questions)
    return [
        processor.apply_chat_template(
            messages(s, q, c, with_image_block=True), add_generation_prompt=True, tokenize=False
        )
        + (s["prefix"] if with_prefix else "")
        for q, c in zip(questions, contexts)
    ]


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
            batch = processor(
                text=texts[i : i + batch_size], images=images[i : i + batch_size], return_tensors="pt", padding=True
            ).to(model.device)
            logits = model(**batch, logits_to_keep=1).logits[:, -1, :].float()  # no vocab × positions tensor
            probs = torch.softmax(logits[:, ids], dim=-1).cpu().numpy()
            out.append(probs @ np.arange(1, 6) if s["name"] == "skb" else probs[:, 0])
    return np.concatenate(out) if out else np.zeros(0)


def reply_tokens(s: dict) -> int:
    """How many tokens a gate may generate: its longest SFT target (``longest_completion_tokens`` in gate.json, which
    ``load_gate`` puts in its spec) and ``REPLY_MARGIN`` more; ``DEFAULT_REPLY_TOKENS`` for a folder that does not
    record it. A reply cut short is no JSON, and the answer in it is lost."""
    longest = s.get("longest_completion_tokens")
    return longest + REPLY_MARGIN if longest else DEFAULT_REPLY_TOKENS


def generate_parsed(
    model,
    processor,
    s: dict,
    images,
    questions,
    contexts=None,
    batch_size: int = 16,
    max_new_tokens: int | None = None,
    reply_prefix: str = "",
) -> list:
    """Greedy generation, parsed by the variant (the Inspector's {"pass", "answer"}, mct's documents and summary);
    ``reply_prefix``: the start of every reply, written for the model and parsed with what it generates. Up to
    ``max_new_tokens``, by default ``reply_tokens(s)``."""
    max_new_tokens = max_new_tokens or reply_tokens(s)
    users = [
        m[1]["content"]
        for m in (
            messages(s, q, c) for q, c in zip(questions, contexts if contexts is not None else [None] * len(questions))
        )
    ]
    texts = generate_completions(
        model,
        processor,
        images,
        users,
        prompt={"system": s["system"], "user_template": "{question}"},
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        reply_prefix=reply_prefix,
    )
    return [parse_completion(s, reply_prefix + t) for t in texts]


def check_threshold(name: str, threshold: float | None, flag: str = "--threshold") -> float:
    """The gate's threshold (its default when None), refused off its scale: skb's expected digit 1–5, else a
    probability. (skb at the binary gates' 0.5 called every example "search" against a truth, target > 0.5, that
    every example meets: accuracy, balanced accuracy and the majority baseline all 1.0.)"""
    if threshold is None:
        return DEFAULT_THRESHOLDS.get(name, 0.5)
    lo, hi = (1.0, 5.0) if name == "skb" else (0.0, 1.0)
    if not lo <= threshold <= hi:
        raise ValueError(f"{flag} {threshold:g} is off the {name} gate's scale [{lo:g}, {hi:g}]")
    return threshold


def check_gate_threshold(folder, threshold: float | None, flag: str = "--threshold") -> None:
    """``check_threshold`` for a trained gate folder, by the variant its gate.json names, before its model loads (a
    folder without gate.json is named when it loads)."""
    info = Path(folder) / GATE_FILE
    if info.is_file():
        check_threshold(read_json(info).get("variant"), threshold, flag)


def decisions(scores, threshold: float) -> np.ndarray:
    """Positive (search / relevant / pass) when the score reaches the threshold."""
    return np.asarray(scores, dtype=float) >= threshold


def threshold_grid(scores, soft: bool | None = None, points: int = 21) -> np.ndarray:
    """``points`` thresholds over the gate's scale (``soft``: skb's 1–5, else 0–1; by default skb's when a score
    exceeds 1), the first lowered to the lowest score and one past the highest added: swept with ``decisions``, the
    curve starts with every example positive (All RAG) and ends with none (No RAG) exactly (a float32 softmax gives
    1.0 exactly, and skb's probabilities may sum to just under 1)."""
    soft = max(scores) > 1 if soft is None else soft
    grid = np.linspace(1, 5, points) if soft else np.linspace(0, 1, points)
    grid[0] = min(grid[0], min(scores))
    return np.append(grid, np.nextafter(max(grid[-1], max(scores)), np.inf))
