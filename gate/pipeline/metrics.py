"""A benchmark's QA rule by name, and the small answer scores the gates use; pure functions.

Each benchmark's official scorer is written anew in its own module, which names the official function each rule
follows: E-VQA in gate/pipeline/metrics_evqa.py (exact match, then BEM), InfoSeek in gate/pipeline/metrics_infoseek.py
(exact match and the numerical range rule, split scores and their harmonic mean), VQA / OK-VQA accuracy in
gate/pipeline/vqa_accuracy.py. ``official_correct`` applies one of the first two to the pipeline's predictions.
"""

from __future__ import annotations

from collections.abc import Sequence

from gate.pipeline.metrics_evqa import BEM, evqa_correct_batch
from gate.pipeline.metrics_infoseek import infoseek_correct, infoseek_match, is_infoseek_type
from retrieval.answers import normalize_answer

METRICS = ("infoseek", "evqa")


def official_correct(
    metric: str, records: Sequence[dict], predictions: Sequence[str | None], bem: BEM | None = None
) -> list[bool]:
    """Correctness of ``predictions`` for question ``records`` (our question format) under a benchmark's rule:
    ``evqa`` (the CSV answer is ``|``.join(answers); BEM batched over the undecided ones, blank predictions included)
    or ``infoseek`` (``infoseek_correct`` when the record has an InfoSeek question type, else ``infoseek_match``).
    A None prediction is the pipeline's "no answer": scored as the empty prediction a results file holds for that
    question, as the official scorers score one (E-VQA: exact match, then BEM; InfoSeek: String and Time match only an
    alias that normalises to nothing, Numerical reads it as [0, 0])."""
    if len(records) != len(predictions):
        raise ValueError(f"{len(records)} question records but {len(predictions)} predictions")
    predictions = ["" if p is None else p for p in predictions]
    if metric == "evqa":
        rows = [
            {
                "id": r.get("id", f"#{i}"),
                "prediction": p,
                "answer": "|".join(str(a) for a in r.get("answers") or []),
                "question": r["question"],
                "question_type": r.get("question_type") or "automatic",
            }
            for i, (r, p) in enumerate(zip(records, predictions))
        ]
        return evqa_correct_batch(rows, bem)
    if metric == "infoseek":
        out = []
        for i, (r, p) in enumerate(zip(records, predictions)):
            golds = r["answer_eval"] if r.get("answer_eval") else (r.get("answers") or [])  # [] holds no answer
            if is_infoseek_type(r.get("question_type")):
                out.append(infoseek_correct(p, golds, r["question_type"], qid=r.get("id", f"#{i}")))
            else:
                out.append(infoseek_match(p, golds))
        return out
    raise ValueError(f"unknown metric {metric!r} (expected one of {', '.join(METRICS)})")


def refuses_unanswered(metric: str, record: dict) -> bool:
    """Whether ``official_correct`` under ``metric`` refuses a question record that has no answers (nor
    ``answer_eval``): E-VQA's rule always (its reference is then empty), InfoSeek's for a question of an InfoSeek type;
    an untyped question without answers is a miss (``infoseek_match``)."""
    return metric == "evqa" or is_infoseek_type(record.get("question_type"))


# --------------------------------------------------------------------------- small helpers used by the gates


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
    """2ab / (a + b); 0 when both are 0."""
    return 0.0 if a + b == 0 else 2 * a * b / (a + b)
