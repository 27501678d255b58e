"""QA metrics, pure functions: answer normalisation, InfoSeek matching (strings and numeric ranges), token
accuracy, harmonic mean."""

from __future__ import annotations

import re
import string

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans({c: " " for c in string.punctuation})
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def normalize_answer(text) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse whitespace (InfoSeek / SQuAD style)."""
    if text is None:
        return ""
    text = str(text).lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _numbers(text: str) -> list[float]:
    return [float(x) for x in _NUMBER.findall(str(text).replace(",", ""))]


def _numeric_match(prediction: str, low: float, high: float) -> bool:
    """A predicted number inside [low, high], or a predicted range "a - b" / "a to b" that overlaps it."""
    text = str(prediction).replace(",", "")
    span = re.search(r"(-?\d+(?:\.\d+)?)\s*(?:-|–|to)\s*(-?\d+(?:\.\d+)?)", text)
    if span:
        a, b = sorted((float(span.group(1)), float(span.group(2))))
        if a <= high and b >= low:
            return True
    return any(low <= x <= high for x in _numbers(text))


def infoseek_match(prediction, answer_eval) -> bool:
    """InfoSeek's rule: ``answer_eval`` is a list of acceptable strings (normalised exact match), or — for
    numerical questions — a dict (or a list holding dicts) with ``range: [low, high]``."""
    items = answer_eval if isinstance(answer_eval, (list, tuple)) else [answer_eval]
    pred = normalize_answer(prediction)
    for item in items:
        if isinstance(item, dict):
            if "range" in item and item["range"] is not None:
                low, high = sorted(float(x) for x in item["range"])
                if _numeric_match(str(prediction), low, high):
                    return True
            elif "wikidata" in item and normalize_answer(item["wikidata"]) == pred:
                return True
        elif item is not None and normalize_answer(item) == pred and pred:
            return True
    return False


def token_accuracy(prediction, golds) -> float:
    """Fraction of a gold answer's (normalised) tokens present in the prediction, best over the golds; in [0, 1]."""
    pred = set(normalize_answer(prediction).split())
    best = 0.0
    for gold in golds if isinstance(golds, (list, tuple)) else [golds]:
        tokens = normalize_answer(gold).split()
        if tokens:
            best = max(best, sum(t in pred for t in tokens) / len(tokens))
    return best


def harmonic_mean(a: float, b: float) -> float:
    """2ab / (a + b); 0 when both are 0 (InfoSeek's unseen-question / unseen-entity summary)."""
    return 0.0 if a + b == 0 else 2 * a * b / (a + b)
