"""QA metrics as the benchmarks' official scorers define them, pure functions (the BEM model itself is an argument).

Each function names the official function whose rule it follows; the official code is not copied here, its rules are
written anew (and checked by table-driven tests built from reading it, tests/test_metrics_official.py).

E-VQA — google-research ``encyclopedic_vqa/evaluation_utils.py``: answers normalised by ``preprocess_answer``; a
question right on exact match (``singleanswer_exact_match``) or, for ``multi_answer``, on the IoU of the reference's
``&&`` parts and the candidate split on ",", " and ", " & " (``multianswer_exact_match``); otherwise BEM decides,
P[equivalent] ≥ 0.5 (``initialize_bem_scoring_function``; gate/pipeline/bem.py builds its input). The best over a
question's
``|`` alternatives counts (``evaluate_example``). A blank prediction goes to BEM like any other.

InfoSeek — edchengg/infoseek_eval ``infoseek_eval.py`` (the scorer the InfoSeek README links): Time and String
(every type but Time / Numerical) by normalised exact match against ``answer_eval``; Numerical by the range rule
(``metric_numerical_range``). Questions are split by ``data_split`` (ending in ``unseen_question`` or not); a split's
score is ``round(fraction * 100, 2)`` over the predictions it was given, per type likewise, and the final score the
harmonic mean of the two rounded split scores, rounded (``evaluate``, ``evaluate_infoseek``,
``evaluate_infoseek_full``). A question with no prediction is not in the official denominator; ``infoseek_report``
gives that figure and ours (every question, no prediction = wrong) side by side.

VQA / OK-VQA accuracy: gate/pipeline/vqa_accuracy.py.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence

from retrieval.answers import answer_in_passage, normalize_answer

__all__ = [
    "answer_in_passage",
    "evqa_correct",
    "official_correct",
    "evqa_normalize",
    "infoseek_correct",
    "infoseek_scores",
    "infoseek_report",
    "normalize_answer",
    "numeric_answer",
    "harmonic_mean",
    "infoseek_match",
    "token_accuracy",
]


def who(qid) -> str:
    return "a question without an id" if qid is None else f"question {qid!r}"


# --------------------------------------------------------------------------- E-VQA

EVQA_QUESTION_TYPES = ("templated", "automatic", "multi_answer", "2_hop")
_EVQA_PUNCT = set(string.punctuation + "‘’´`_")
_EVQA_ARTICLES = re.compile(r"\b(the answer is|a|an|the)\b")
_SPAN_PREFIX = "<extra_id_0> "
DIGIT_WORDS = {
    "none": "0",
    "zero": "0",
    "one": "1",
    "two": "2",
    "three": "3",
    "four": "4",
    "five": "5",
    "six": "6",
    "seven": "7",
    "eight": "8",
    "nine": "9",
    "ten": "10",
}
_EVQA_WORDS = {**DIGIT_WORDS, "entailment": "yes", "true": "yes", "contradiction": "no", "false": "no"}

BEM = Callable[[Sequence[str], Sequence[str], Sequence[str]], Sequence[float]]  # (candidates, references, questions)


CONTRACTIONS = dict(
    pair.split(":")
    for pair in (
        "aint:ain't arent:aren't cant:can't couldve:could've couldnt:couldn't couldn'tve:couldn't've "
        "couldnt've:couldn't've didnt:didn't doesnt:doesn't dont:don't hadnt:hadn't hadnt've:hadn't've "
        "hadn'tve:hadn't've hasnt:hasn't havent:haven't hed:he'd hed've:he'd've he'dve:he'd've hes:he's howd:how'd "
        "howll:how'll hows:how's Id've:I'd've I'dve:I'd've Im:I'm Ive:I've isnt:isn't itd:it'd itd've:it'd've "
        "it'dve:it'd've itll:it'll let's:let's maam:ma'am "
        "mightnt:mightn't mightnt've:mightn't've mightn'tve:mightn't've mightve:might've mustnt:mustn't mustve:must've "
        "neednt:needn't notve:not've oclock:o'clock oughtnt:oughtn't "
        "ow's'at:'ow's'at 'ows'at:'ow's'at 'ow'sat:'ow's'at shant:shan't shed've:she'd've she'dve:she'd've she's:she's "
        "shouldve:should've shouldnt:shouldn't shouldnt've:shouldn't've shouldn'tve:shouldn't've "
        "somebody'd:somebodyd somebodyd've:somebody'd've somebody'dve:somebody'd've somebodyll:somebody'll "
        "somebodys:somebody's someoned:someone'd someoned've:someone'd've someone'dve:someone'd've "
        "someonell:someone'll someones:someone's somethingd:something'd somethingd've:something'd've "
        "something'dve:something'd've somethingll:something'll thats:that's thered:there'd thered've:there'd've "
        "there'dve:there'd've therere:there're theres:there's theyd:they'd theyd've:they'd've they'dve:they'd've "
        "theyll:they'll theyre:they're theyve:they've twas:'twas wasnt:wasn't wed've:we'd've we'dve:we'd've "
        "weve:we've werent:weren't whatll:what'll whatre:what're whats:what's whatve:what've whens:when's "
        "whered:where'd wheres:where's whereve:where've whod:who'd whod've:who'd've who'dve:who'd've wholl:who'll "
        "whos:who's whove:who've whyll:why'll whyre:why're whys:why's wont:won't wouldve:would've wouldnt:wouldn't "
        "wouldnt've:wouldn't've wouldn'tve:wouldn't've yall:y'all yall'll:y'all'll y'allll:y'all'll "
        "yall'd've:y'all'd've y'alld've:y'all'd've y'all'dve:y'all'd've youd:you'd youd've:you'd've "
        "you'dve:you'd've youll:you'll youre:you're youve:you've"
    ).split()
)


def evqa_normalize(answer: str) -> str:
    """E-VQA's ``preprocess_answer``: lowercase, newlines and tabs to spaces, strip; if the text then starts with the
    span prefix "<extra_id_0> ", every occurrence of that prefix is deleted (the official code replaces them all, not
    only the first); punctuation (ASCII and ‘’´`_) deleted; "the answer is", "a", "an", "the" removed as words; number
    words to digits, entailment / true to yes, contradiction / false to no, then the contraction table (the VQA one,
    entry for entry) word by word; whitespace collapsed."""
    if not isinstance(answer, str):
        raise ValueError(f"E-VQA normalisation needs a string, got {answer!r}")
    text = answer.lower().replace("\n", " ").replace("\t", " ").strip()
    if text.startswith(_SPAN_PREFIX):
        text = text.replace(_SPAN_PREFIX, "")
    text = "".join(c for c in text if c not in _EVQA_PUNCT)
    text = _EVQA_ARTICLES.sub(" ", text)
    words = (_EVQA_WORDS.get(w, w) for w in text.split())
    return " ".join(CONTRACTIONS.get(w, w) for w in words)


def _evqa_parts(text: str) -> set[str]:
    return {p for p in (evqa_normalize(x) for x in text) if p}


def _evqa_exact(prediction: str, reference: str, question_type: str) -> bool:
    """``singleanswer_exact_match`` / ``multianswer_exact_match`` (the candidate split before lowercasing, as there);
    the reference is known not to normalise to empty."""
    if question_type != "multi_answer":
        return evqa_normalize(reference) == evqa_normalize(prediction)
    ref = _evqa_parts(reference.split("&&"))
    cand = _evqa_parts(prediction.replace(" and ", ",").replace(" & ", ",").split(","))
    return len(ref & cand) / len(ref | cand) >= 0.5


def _evqa_references(answer, question_type: str, qid) -> list[str]:
    """The ``|`` alternatives of a CSV answer, each refused (as the official code refuses it) when empty or when it
    normalises to empty (for ``multi_answer``: when every ``&&`` part does)."""
    if not isinstance(answer, str):
        raise ValueError(f"E-VQA {who(qid)}: the reference answer must be a string, got {answer!r}")
    alternatives = [a.strip() for a in answer.split("|")]
    for ref in alternatives:
        parts = ref.split("&&") if question_type == "multi_answer" else [ref]
        if not ref or not _evqa_parts(parts):
            raise ValueError(
                f"E-VQA {who(qid)}: a reference answer in {answer!r} is empty after normalisation "
                "(the official scorer refuses it)"
            )
    return alternatives


def evqa_undecided(prediction: str, answer: str, question_type: str, qid=None) -> list[str] | None:
    """None when exact match (or the multi-answer rule) already accepts ``prediction`` for one of the ``|``
    alternatives; else the references BEM must judge (``&&`` turned into commas for ``multi_answer``, as the official
    BEM scoring does). A None prediction, an unknown question type or an empty reference is refused."""
    if not isinstance(prediction, str):
        raise ValueError(
            f"E-VQA {who(qid)}: the prediction must be a string (an empty answer is ''), got {prediction!r}"
        )
    if question_type not in EVQA_QUESTION_TYPES:
        raise ValueError(
            f"E-VQA {who(qid)}: unknown question type {question_type!r} (expected one of "
            f"{', '.join(EVQA_QUESTION_TYPES)})"
        )
    alternatives = _evqa_references(answer, question_type, qid)
    if any(_evqa_exact(prediction, ref, question_type) for ref in alternatives):
        return None
    return [ref.replace("&&", ",") if question_type == "multi_answer" else ref for ref in alternatives]


def evqa_correct(
    prediction: str, answer: str, question: str, question_type: str, bem: BEM | None = None, qid=None
) -> bool:
    """The official E-VQA decision for one question (``encyclopedic_vqa_evaluation_function`` and
    ``evaluate_example``): exact match first, then BEM on the raw strings for every undecided alternative — a blank
    prediction included. Without ``bem``, an undecided answer is wrong (exact match only)."""
    refs = evqa_undecided(prediction, answer, question_type, qid)
    if refs is None:
        return True
    if bem is None:
        return False
    return max(bem([prediction] * len(refs), refs, [str(question)] * len(refs))) >= 0.5


def evqa_correct_batch(records: Sequence[dict], bem: BEM | None = None) -> list[bool]:
    """``evqa_correct`` for many records (``prediction``, ``answer``, ``question``, ``question_type``, optional
    ``id``), with one BEM call for every undecided (candidate, reference) pair."""
    out: list[bool] = []
    pending: list[tuple[int, str, str, str]] = []
    for i, r in enumerate(records):
        refs = evqa_undecided(r["prediction"], r["answer"], r["question_type"], r.get("id", f"#{i}"))
        out.append(refs is None)
        if refs is not None and bem is not None:
            pending += [(i, r["prediction"], ref, str(r["question"])) for ref in refs]
    if pending:
        probs = bem([p[1] for p in pending], [p[2] for p in pending], [p[3] for p in pending])
        for (i, *_), p in zip(pending, probs):
            out[i] = out[i] or p >= 0.5
    return out


def evqa_report(records: Sequence[dict], correct: Sequence[bool]) -> dict:
    """Accuracy (%) per question kind: single-hop (every type but 2_hop), two-hop, overall (the E-VQA README: the
    accuracy of a split is the mean score over its questions)."""

    def pct(sel):
        sel = list(sel)
        return 100.0 * sum(sel) / len(sel) if sel else None

    two = [c for r, c in zip(records, correct) if r["question_type"] == "2_hop"]
    one = [c for r, c in zip(records, correct) if r["question_type"] != "2_hop"]
    return {"single_hop": pct(one), "two_hop": pct(two), "overall": pct(correct), "n": len(correct)}


# --------------------------------------------------------------------------- InfoSeek

INFOSEEK_TYPES = ("String", "Numerical", "Time")
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
    ``answer_eval``'s range; Time and every other type (String, or anything else: scored as String) by exact match of
    the normalised prediction with one normalised alias (``evaluate_time`` / ``evaluate_entity``) — so an empty
    prediction matches an alias that normalises to empty ("A", "the"). ``empty_matches=False`` is our stricter rule
    (an empty prediction never matches), which ``infoseek_match`` uses. A None prediction, a missing question type or
    an empty ``answer_eval`` is refused."""
    if not isinstance(prediction, str):
        raise ValueError(
            f"InfoSeek {who(qid)}: the prediction must be a string (an empty answer is ''), got {prediction!r}"
        )
    if question_type is None:
        raise ValueError(f"InfoSeek {who(qid)}: no question_type (the official scorer needs one per question)")
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
    if any(isinstance(i, dict) and i.get("range") is not None for i in items):
        return infoseek_correct(prediction, answer_eval, "Numerical")
    aliases = [
        str(i["wikidata"]) if isinstance(i, dict) else i
        for i in items
        if not isinstance(i, dict) or i.get("wikidata") is not None
    ]
    aliases = [a for a in aliases if a is not None]
    return bool(aliases) and infoseek_correct(prediction, aliases, "String", empty_matches=False)


# --------------------------------------------------------------------------- a benchmark's rule, by name

METRICS = ("infoseek", "evqa")


def official_correct(
    metric: str, records: Sequence[dict], predictions: Sequence[str | None], bem: BEM | None = None
) -> list[bool]:
    """Correctness of ``predictions`` for question ``records`` (our question format) under a benchmark's rule:
    ``evqa`` (the CSV answer is ``|``.join(answers); BEM batched over the undecided ones, blank predictions included)
    or ``infoseek`` (``infoseek_correct`` when the record has an InfoSeek question type, else ``infoseek_match``).
    A None prediction is the pipeline's "no answer": wrong, and never shown to BEM (the official scorers have no
    such case; ``infoseek_report`` leaves such questions out of the official InfoSeek figure)."""
    if len(records) != len(predictions):
        raise ValueError(f"{len(records)} question records but {len(predictions)} predictions")
    if metric == "evqa":
        given = [i for i, p in enumerate(predictions) if p is not None]
        rows = [
            {
                "id": records[i].get("id", f"#{i}"),
                "prediction": predictions[i],
                "answer": "|".join(str(a) for a in records[i].get("answers") or []),
                "question": records[i]["question"],
                "question_type": records[i].get("question_type") or "automatic",
            }
            for i in given
        ]
        out = [False] * len(records)
        for i, ok in zip(given, evqa_correct_batch(rows, bem)):
            out[i] = ok
        return out
    if metric == "infoseek":
        out = []
        for i, (r, p) in enumerate(zip(records, predictions)):
            golds = r["answer_eval"] if r.get("answer_eval") is not None else (r.get("answers") or [])
            if p is None:
                out.append(False)
            elif is_infoseek_type(r.get("question_type")):
                out.append(infoseek_correct(p, golds, r["question_type"], qid=r.get("id", f"#{i}")))
            else:
                out.append(infoseek_match(p, golds))
        return out
    raise ValueError(f"unknown metric {metric!r} (expected one of {', '.join(METRICS)})")


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
