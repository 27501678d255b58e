"""VQA accuracy as the VQA / OK-VQA official scorer defines it, pure functions (the rules written anew, checked by
tests/test_metrics_official.py).

VQA / OK-VQA — GT-Vision-Lab/VQA ``PythonEvaluationTools/vqaEvaluation/vqaEval.py`` (``VQAEval``): min(1, matches /
3) averaged over leaving each annotator out, the answers normalised only when the annotators disagree; per-question
accuracies in % rounded to 2 decimals, the overall / per-question-type / per-answer-type figures from the unrounded
ones, rounded to 2 decimals the way that Python 2 file's ``round`` does.

The file as it stands since its commit a013f00 ("Fixed processing answers bug", March 2021), read in that repository.
Copies made before it (many projects vendor one) score differently: they always normalise the prediction
(punctuation, digits, articles) and the answers only by punctuation, when the annotators disagree — "Cat" against ten
"cat" scores 1.0 there and 0.0 here. A figure compared with a paper's should use the version that paper used.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from decimal import ROUND_HALF_UP, Decimal

from gate.pipeline.metrics_evqa import CONTRACTIONS, DIGIT_WORDS
from retrieval.answers import who

_VQA_PUNCT = [";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?", "!"]
_PERIOD = re.compile(r"(?!<=\d)(\.)(?!\d)")
_COMMA_DIGITS = re.compile(r"(\d)(,)(\d)")


# vqaEval.py's contraction table, entry for entry (E-VQA's preprocess_answer has the same one); the capitalised keys
# never match (both scorers lowercase first), and neither do identities like "let's", but they are the table
def vqa_normalize(text: str) -> str:
    """vqaEval.py's ``processPunctuation`` then ``processDigitArticle``: each listed punctuation mark deleted when
    it touches a space (or the text has a digit-comma-digit) else turned into a space, periods not beside a digit
    deleted, lowercase, number words to digits, articles dropped, the contraction table applied word by word."""
    out = str(text).replace("\n", " ").replace("\t", " ").strip()
    original = out
    for p in _VQA_PUNCT:
        if (p + " " in original or " " + p in original) or _COMMA_DIGITS.search(original):
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    out = _PERIOD.sub("", out, count=re.UNICODE)  # as the official code: re.UNICODE (32) lands in the count slot
    words = [DIGIT_WORDS.get(w, w) for w in out.lower().split()]
    return " ".join(CONTRACTIONS.get(w, w) for w in words if w not in ("a", "an", "the"))


def vqa_accuracy(prediction: str, answers: list[str], qid=None) -> float:
    """VQA accuracy in [0, 1] of one question (``VQAEval.evaluate``): min(1, matching other annotators / 3), averaged
    over leaving each annotator out; prediction and answers normalised only when the annotators disagree. Unrounded
    (``vqa_scores`` rounds as the official report does). A None prediction or no answers is refused."""
    if not isinstance(prediction, str):
        raise ValueError(f"VQA {who(qid)}: the prediction must be a string, got {prediction!r}")
    if not answers or any(a is None for a in answers):
        raise ValueError(f"VQA {who(qid)}: needs the annotators' answers, got {answers!r}")
    pred = prediction.replace("\n", " ").replace("\t", " ").strip()
    golds = [str(a).replace("\n", " ").replace("\t", " ").strip() for a in answers]
    if len(set(golds)) > 1:
        golds, pred = [vqa_normalize(a) for a in golds], vqa_normalize(pred)
    accs = [min(1.0, sum(g == pred for j, g in enumerate(golds) if j != i) / 3) for i in range(len(golds))]
    return sum(accs) / len(accs)


def round_py2(x: float, digits: int = 2) -> float:
    """Python 2's ``round(x, digits)``, which vqaEval.py (Python 2 code) calls: the float's exact value rounded, an
    exact tie away from zero (Python 3's ``round`` takes it to even: 0.125 → 0.12 there, 0.13 here)."""
    return float(Decimal(x).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def vqa_scores(records: Sequence[dict]) -> dict:
    """The official VQA report (``VQAEval.evaluate``, ``setAccuracy``, ``setEvalQA``) of records with
    ``question_id``, ``prediction``, ``answers`` (the annotators'), ``question_type`` and ``answer_type``:
    ``per_question`` = round(100 · accuracy, 2); ``overall``, ``per_question_type`` and ``per_answer_type`` =
    round(100 · sum / count, 2) of the unrounded accuracies. Every question needs its prediction (the official
    loader refuses results that miss one); a repeated question id is refused."""
    if not records:
        raise ValueError("VQA scores need at least one question")
    accs: list[float] = []
    per_question: dict = {}
    by_qtype: dict[str, list[float]] = {}
    by_atype: dict[str, list[float]] = {}
    for i, r in enumerate(records):
        qid = r.get("question_id", r.get("id", f"#{i}"))
        if qid in per_question:
            raise ValueError(f"VQA {who(qid)} appears twice")
        for key in ("question_type", "answer_type"):
            if r.get(key) is None:
                raise ValueError(f"VQA {who(qid)}: no {key} (the official report groups by it)")
        acc = vqa_accuracy(r.get("prediction"), r.get("answers") or [], qid=qid)
        accs.append(acc)
        per_question[qid] = round_py2(100 * acc)
        by_qtype.setdefault(r["question_type"], []).append(acc)
        by_atype.setdefault(r["answer_type"], []).append(acc)

    def pct(values):
        return round_py2(100 * float(sum(values)) / len(values))

    return {
        "overall": pct(accs),
        "per_question_type": {k: pct(v) for k, v in by_qtype.items()},
        "per_answer_type": {k: pct(v) for k, v in by_atype.items()},
        "per_question": per_question,
        "n": len(accs),
    }
