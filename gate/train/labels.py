"""Gate labels from sampled, judged answers — pure functions.

Polarity, everywhere: a HIGH judged score / accuracy / certainty means the VLM KNOWS the answer, so NO search.
- HKB (hard knowledge boundary): "true" = search needed, when the mean judged score is below ε.
- SKB (soft knowledge boundary): 6 − mean, on 1.0–5.0, so 5 = search needed.
- KBM accuracy: True = unknown (search) when sampled accuracy < τ.
- KBM certainty: True = search when C = 1 − H/Hmax over clusters of normalised answers is < τ (no gold answer needed).
"""

from __future__ import annotations

import math
import random
from collections import Counter

from gate.pipeline.end_to_end import is_gold_section
from retrieval.answers import normalize_answer

SCORE_MIN, SCORE_MAX = 1.0, 5.0


def judged_mean(scores) -> float:
    """Mean of judged scores on the 1–5 scale; every score must lie in [1, 5]."""
    scores = [float(s) for s in scores]
    if not scores:
        raise ValueError("judged_mean needs at least one score")
    for s in scores:
        if not (SCORE_MIN <= s <= SCORE_MAX):
            raise ValueError(f"judged scores must lie in [1, 5], got {s}")
    return sum(scores) / len(scores)


def hkb_label(scores, epsilon: float) -> str:
    """ "true" (search needed) when the mean judged score is below ε, else "false"."""
    return "true" if judged_mean(scores) < epsilon else "false"


def skb_label(scores) -> float:
    """The flipped mean, 6 − mean, in [1, 5]: 5 = the model never answers right = search needed."""
    return 6.0 - judged_mean(scores)


def stochastic_digit(score: float, seed: int) -> int:
    """A score on 1.0–5.0 as a digit: floor, or floor + 1 with probability equal to its fraction (seeded), so the
    digit's expectation is the score — SKB's soft target as one SFT completion."""
    score = float(score)
    if not SCORE_MIN <= score <= SCORE_MAX:
        raise ValueError(f"an skb score must lie in [1, 5], got {score}")
    low = math.floor(score)
    return low + int(random.Random(seed).random() < score - low)


def kbm_accuracy_label(correct, tau: float = 0.9) -> bool:
    """True = unknown (search) when the share of correct sampled answers is below τ."""
    correct = list(correct)
    if not correct:
        raise ValueError("kbm_accuracy_label needs at least one sampled answer")
    return sum(bool(c) for c in correct) / len(correct) < tau


def certainty(answers) -> float:
    """C = 1 − H/Hmax over the clusters of normalised answers (H: entropy of the cluster shares; Hmax = log n, the
    entropy of n answers that all differ); 1.0 when every answer falls in one cluster. (Hmax = log k for k clusters
    would measure how evenly the answers split, not how sure the model is: 29 of 30 answers agreeing would score
    0.79, below τ = 0.9; here 0.96.) An answer that normalises to nothing ("", "the", "...") agrees with no other:
    a model that answers nothing 30 times is not certain of anything."""
    keys = [normalize_answer(a) or (None, i) for i, a in enumerate(answers)]  # each non-answer its own cluster
    clusters = Counter(keys)
    n, k = sum(clusters.values()), len(clusters)
    if n == 0:
        raise ValueError("certainty needs at least one answer")
    if k == 1:
        return 1.0 if isinstance(keys[0], str) else 0.0
    entropy = -sum((c / n) * math.log(c / n) for c in clusters.values())
    return max(0.0, min(1.0, 1.0 - entropy / math.log(n)))


def kbm_certainty_label(answers, tau: float = 0.9) -> bool:
    """True = search when the certainty of the sampled answers is below τ."""
    return certainty(answers) < tau


# ---------------------------------------------------------------- MMKB token system (the paper's text, not its
# Algorithm 1 box): a correctly answered question needs no retrieval; a document is relevant if it turns a wrong
# answer right, not relevant if it turns a right answer wrong; pairs that change nothing carry no label.


def ret_label(correct_without_retrieval: bool) -> str:
    """ "NoRet" when the VLM alone answered correctly, else "Ret"."""
    return "NoRet" if correct_without_retrieval else "Ret"


def srt_label(correct_without: bool, correct_with_document: bool) -> str | None:
    """ "Rel" if the document turns a wrong answer right, "NoRel" if it turns a right answer wrong, None (drop the
    pair) if it changes nothing."""
    if correct_with_document and not correct_without:
        return "Rel"
    if correct_without and not correct_with_document:
        return "NoRel"
    return None


# ---------------------------------------------------------------- Inspector (WikiSeeker)


def inspector_label(
    top_entity: str,
    gold_entity: str,
    gold_answer: str,
    text_only_correct: bool | None = None,
    top_section: int | None = None,
    gold_section: int | None = None,
) -> dict:
    """PASS when the context is the gold section — the gold entity's, and its evidence section when the data has one
    (``is_gold_section``) — and, when given, a text-only answer with that context was judged correct (the paper's
    proxy); otherwise FAIL with the gold answer as the Inspector's own answer."""
    if is_gold_section(top_entity, top_section, gold_entity, gold_section) and text_only_correct is not False:
        return {"pass": "true"}
    return {"pass": "false", "answer": gold_answer}


# ---------------------------------------------------------------- MCT (MMKB-RAG Algorithm 3)


def mct_example(rel_probs, gamma: float = 0.5, negative_ratio: float = 0.3, seed: int = 0) -> dict | None:
    """One consistency example from the SRT relevance P(Rel) of a question's retrieved documents: None unless more
    than one document is relevant (P(Rel) ≥ γ); otherwise every relevant document plus round(τ · #NoRel) of the NoRel
    ones (τ = ``negative_ratio``), shown in a seeded random order. ``shown``: the documents' original indices in the
    order shown; ``consistent``: the 1-based positions, in that order, of the relevant ones, most relevant first."""
    if not 0.0 <= negative_ratio <= 1.0:
        raise ValueError(f"the negative ratio τ must lie in [0, 1], got {negative_ratio}")
    probs = [float(p) for p in rel_probs]
    relevant = [j for j, p in enumerate(probs) if p >= gamma]
    if len(relevant) < 2:
        return None
    rng = random.Random(seed)
    norel = [j for j, p in enumerate(probs) if p < gamma]
    shown = relevant + rng.sample(norel, round(negative_ratio * len(norel)))
    rng.shuffle(shown)
    position = {j: i + 1 for i, j in enumerate(shown)}
    ranked = sorted(relevant, key=lambda j: (-probs[j], j))
    return {"shown": shown, "consistent": [position[j] for j in ranked]}
