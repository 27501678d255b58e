"""InfoSeek's QA metric as its official scorer defines it, pure functions; the rules written anew, checked by
tests/test_metrics_official.py.

edchengg/infoseek_eval ``infoseek_eval.py`` (the scorer the InfoSeek README links): Time and String (every type but
Time / Numerical) by normalised exact match against ``answer_eval``; Numerical by the range rule
(``metric_numerical_range``). Questions are split by ``data_split`` (ending in ``unseen_question`` or not); a split's
score is ``round(fraction * 100, 2)`` over the predictions it was given, per type likewise, and the final score the
harmonic mean of the two rounded split scores, rounded (``evaluate``, ``evaluate_infoseek``,
``evaluate_infoseek_full``). A question with no prediction is not in the official denominator; ``infoseek_report``
gives that figure and ours (every question, no prediction = wrong) side by side.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from retrieval.answers import normalize_answer, who

INFOSEEK_SPLITS = ("unseen_question", "unseen_entity")


def is_infoseek_type(question_type) -> bool:
    """One of InfoSeek's question types, in any case (the official scorer lowercases them)."""
    return str(question_type or "").lower() in ("string", "numerical", "time")


def infoseek_kind(question_type) -> str:
    """How the official ``evaluation`` routes a question type: lowercased ``time`` and ``numerical`` as such, anything
    else as ``string``."""
    kind = str(question_type).lower()
    return kind if kind in ("time", "numerical") else "string"


def infoseek_split(data_split) -> str:
    """The official ``evaluate``'s split: ``unseen_question`` when ``data_split`` ends so, else ``unseen_entity``."""
    return "unseen_question" if str(data_split).endswith("unseen_question") else "unseen_entity"


_NUMBER = re.compile(r"[-+]?[.]?[\d]+(?:,\d\d\d)*[\.]?\d*(?:[eE][-+]?\d+)?")


def numeric_answer(text: str) -> float | list[float]:
    """The official reading of a numerical prediction (``process_numerical_answer``, ``clean_str_range``): its first
    two numbers as a range when ascending, else its first number; [0, 0] when it holds none. A hyphen after a digit is
    a range dash, not a minus sign."""
    text = str(text)
    text = "".join(" - " if c == "-" and i >= 1 and text[i - 1].isdigit() else c for i, c in enumerate(text))
    numbers = []
    for n in (m.replace(",", "").strip(".") for m in _NUMBER.findall(text)):
        numbers.append(float(n.split(".")[0] if n.count(".") > 1 else n))
    if len(numbers) >= 2:
        return numbers[:2] if numbers[0] <= numbers[1] else numbers[0]
    return numbers[0] if numbers else [0.0, 0.0]


def _range_iou(x: Sequence[float], y: Sequence[float]) -> float:
    overlap = max(0.0, min(max(x), max(y)) - max(min(x), min(y)))
    union = (max(x) - min(x) + 1e-12) + (max(y) - min(y) + 1e-12) - overlap
    return overlap / union if union else 0.0


def numeric_correct(prediction: str, low: float, high: float) -> bool:
    """``metric_numerical_range`` with the answer's range: a number inside it, a range inside it, or IoU ≥ 0.5."""
    pred = numeric_answer(prediction)
    if not isinstance(pred, list):
        return low <= pred <= high
    if low <= pred[0] <= high and low <= pred[1] <= high:
        return True
    return _range_iou(pred, [low, high]) >= 0.5 - 1e-12


def _answer_range(answer_eval, qid) -> tuple[float, float]:
    """``prepare_qid2example``'s reading of a Numerical question's ``answer_eval``: the first item's (or the dict's)
    ``range``, its first two values."""
    if isinstance(answer_eval, (list, tuple)):
        if not answer_eval:
            raise ValueError(f"InfoSeek {who(qid)}: answer_eval is empty (the official scorer needs a range)")
        answer_eval = answer_eval[0]
    if not isinstance(answer_eval, dict) or answer_eval.get("range") is None or len(list(answer_eval["range"])) < 2:
        raise ValueError(
            f"InfoSeek {who(qid)}: a Numerical question needs answer_eval with a range of two numbers, "
            f"got {answer_eval!r}"
        )
    low, high = (float(x) for x in list(answer_eval["range"])[:2])
    return low, high


def _aliases(answer_eval, qid) -> list[str]:
    items = [answer_eval] if isinstance(answer_eval, str) else answer_eval
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(
            f"InfoSeek {who(qid)}: answer_eval must be a non-empty list of answers (the official scorer "
            f"takes the best over them), got {answer_eval!r}"
        )
    if any(a is None or isinstance(a, (dict, list, tuple)) for a in items):
        raise ValueError(f"InfoSeek {who(qid)}: a String / Time answer_eval must hold strings, got {answer_eval!r}")
    return [str(a) for a in items]


def infoseek_correct(prediction: str, answer_eval, question_type: str, qid=None, *, empty_matches: bool = True) -> bool:
    """The official InfoSeek decision for one question (``evaluation``): Numerical by ``numeric_correct`` on
    ``answer_eval``'s range; Time and every other type (String, or anything else: scored as String) by exact match
    of the normalised prediction with one normalised alias (``evaluate_time`` / ``evaluate_entity``) — so an empty
    prediction matches an alias that normalises to empty ("A", "the"). ``empty_matches=False`` is our stricter rule
    (an empty prediction never matches, nor reads as [0, 0] on a Numerical question), which ``infoseek_match`` uses.
    A None prediction, a missing question type or an empty ``answer_eval`` is refused."""
    if not isinstance(prediction, str):
        raise ValueError(
            f"InfoSeek {who(qid)}: the prediction must be a string (an empty answer is ''), got {prediction!r}"
        )
    if question_type is None:
        raise ValueError(f"InfoSeek {who(qid)}: no question_type (the official scorer needs one per question)")
    if not empty_matches and not prediction.strip():
        return False
    if infoseek_kind(question_type) == "numerical":
        return numeric_correct(prediction, *_answer_range(answer_eval, qid))
    aliases = _aliases(answer_eval, qid)
    pred = normalize_answer(prediction)
    if not pred and not empty_matches:
        return False
    return any(normalize_answer(a) == pred for a in aliases)


def _percent(values: Sequence[bool]) -> float:
    """``evaluate_infoseek``'s figure: ``round(fraction * 100, 2)``, 0 without questions (``safe_division``)."""
    return round(sum(values) / len(values) * 100, 2) if values else 0.0


def _final(scores: Sequence[float]) -> float:
    """``evaluate_infoseek_full``: the harmonic mean of the rounded split scores (a 0 taken as 1e-12), rounded."""
    safe = [s if s != 0 else 1e-12 for s in scores]
    return round(len(safe) / sum(1.0 / s for s in safe), 2)


def _infoseek_checked(records: Sequence[dict]) -> None:
    untyped = [r.get("id", i) for i, r in enumerate(records) if r.get("question_type") is None]
    if untyped:
        raise ValueError(
            f"{len(untyped)} InfoSeek record(s) have no question_type (e.g. {untyped[0]!r}): the official "
            "score needs them (retrieval.upstream.convert --qtype infoseek_val_qtype.jsonl)"
        )
    for i, r in enumerate(records):
        if r.get("data_split") is None:
            raise ValueError(f"InfoSeek {who(r.get('id', i))}: no data_split (the official scorer splits on it)")


def infoseek_report(records: Sequence[dict], correct: Sequence[bool | None]) -> dict:
    """InfoSeek's scores (%) from per-question decisions: ``records`` carry ``data_split`` and ``question_type`` (and
    ``id``), ``correct[i]`` is the decision, or None for a question with no prediction.

    The top-level figures are the official scorer's (``evaluate``): per split over the questions with a prediction
    (the official scorer only sees those), ``final`` their harmonic mean, ``per_type`` per split (time / numerical /
    string, 0 for a type with no question), ``n`` the questions scored, ``no_prediction`` those left out.
    ``all_questions`` is ours beside it: every question counted, one without a prediction wrong."""
    if len(records) != len(correct):
        raise ValueError(f"{len(records)} InfoSeek records but {len(correct)} decisions")
    _infoseek_checked(records)
    scored = {s: {"time": [], "numerical": [], "string": []} for s in INFOSEEK_SPLITS}
    everyone: dict[str, list[bool]] = {s: [] for s in INFOSEEK_SPLITS}
    missing = dict.fromkeys(INFOSEEK_SPLITS, 0)
    for r, ok in zip(records, correct):
        split = infoseek_split(r["data_split"])
        everyone[split].append(bool(ok))
        if ok is None:
            missing[split] += 1
        else:
            scored[split][infoseek_kind(r["question_type"])].append(bool(ok))
    pooled = {s: [ok for kind in ("time", "numerical", "string") for ok in scored[s][kind]] for s in INFOSEEK_SPLITS}
    out: dict = {s: _percent(pooled[s]) for s in INFOSEEK_SPLITS}
    out["final"] = _final([out[s] for s in INFOSEEK_SPLITS])
    out["per_type"] = {s: {kind: _percent(v) for kind, v in scored[s].items()} for s in INFOSEEK_SPLITS}
    out["n"] = {s: len(pooled[s]) for s in INFOSEEK_SPLITS}
    out["no_prediction"] = missing
    ours: dict = {s: _percent(everyone[s]) for s in INFOSEEK_SPLITS}
    ours["final"] = _final([ours[s] for s in INFOSEEK_SPLITS])
    ours["n"] = {s: len(everyone[s]) for s in INFOSEEK_SPLITS}
    out["all_questions"] = ours
    return out


def infoseek_scores(records: Sequence[dict]) -> dict:
    """``infoseek_report`` of records with ``prediction``, ``answer_eval``, ``question_type`` and ``data_split``
    (and ``id``), each decided by ``infoseek_correct``. A record without a ``prediction`` key is a question with no
    prediction (left out of the official figures, wrong in ``all_questions``); ``prediction: None`` is refused, as the
    official scorer cannot read it."""
    _infoseek_checked(records)
    correct = [
        infoseek_correct(r["prediction"], r.get("answer_eval"), r["question_type"], qid=r.get("id", i))
        if "prediction" in r
        else None
        for i, r in enumerate(records)
    ]
    return infoseek_report(records, correct)


def infoseek_match(prediction, answer_eval) -> bool:
    """Our rule when the question type is not at hand (gate labels, untyped records) — not the official scorer,
    which needs types: a range in ``answer_eval`` means Numerical, else String with the ``wikidata`` values as
    aliases; an empty (or None) prediction never matches, and no answers at all is a miss."""
    if prediction is None:
        return False
    items = answer_eval if isinstance(answer_eval, (list, tuple)) else [answer_eval]
    ranged = [i for i in items if isinstance(i, dict) and i.get("range") is not None]
    if ranged:
        return infoseek_correct(prediction, ranged, "Numerical", empty_matches=False)
    aliases = [
        str(i["wikidata"]) if isinstance(i, dict) else i
        for i in items
        if not isinstance(i, dict) or i.get("wikidata") is not None
    ]
    aliases = [a for a in aliases if a is not None]
    return bool(aliases) and infoseek_correct(prediction, aliases, "String", empty_matches=False)
