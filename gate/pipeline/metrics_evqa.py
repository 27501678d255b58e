"""E-VQA's QA metric as its official scorer defines it, pure functions (the BEM model itself is an argument); the
rules written anew, checked by tests/test_metrics_official.py.

google-research ``encyclopedic_vqa/evaluation_utils.py``: answers normalised by ``preprocess_answer``; a question
right on exact match (``singleanswer_exact_match``) or, for ``multi_answer``, on the IoU of the reference's ``&&``
parts and the candidate split on ",", " and ", " & " (``multianswer_exact_match``); otherwise BEM decides,
P[equivalent] ≥ 0.5 (``initialize_bem_scoring_function``; gate/pipeline/bem.py builds its input). The best over a
question's ``|`` alternatives counts (``evaluate_example``). A blank prediction goes to BEM like any other.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence

from retrieval.answers import who

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


def evqa_exact_match(prediction: str, references, question_type: str) -> bool:
    """E-VQA's exact step alone (the official scorer's first; BEM decides what it leaves): ``prediction`` matches one
    of ``references`` (the ``|`` alternatives) by ``singleanswer_exact_match`` / ``multianswer_exact_match``. A
    reference that normalises to nothing matches nothing."""
    if not isinstance(prediction, str):
        return False
    return any(
        _evqa_exact(prediction, str(r), question_type) for r in references if _scorable_reference(str(r), question_type)
    )


def _scorable_reference(reference: str, question_type: str) -> bool:
    """Whether a reference answer normalises to something (for ``multi_answer``: one of its ``&&`` parts does); the
    official scorer refuses one that does not."""
    return bool(reference) and bool(
        _evqa_parts(reference.split("&&") if question_type == "multi_answer" else [reference])
    )


def _evqa_references(answer, question_type: str, qid) -> list[str]:
    """The ``|`` alternatives of a CSV answer, each refused (as the official code refuses it) when empty or when it
    normalises to empty (for ``multi_answer``: when every ``&&`` part does)."""
    if not isinstance(answer, str):
        raise ValueError(f"E-VQA {who(qid)}: the reference answer must be a string, got {answer!r}")
    alternatives = [a.strip() for a in answer.split("|")]
    for ref in alternatives:
        if not _scorable_reference(ref, question_type):
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
