"""QA metrics as the benchmarks' official scorers define them, pure functions (the BEM model itself is an argument).

E-VQA (google-research ``encyclopedic_vqa/evaluation_utils.py``): answers are normalised (lowercase, punctuation
deleted, "the answer is" and articles removed, number words to digits, whitespace collapsed); a single-answer question
is right on exact match; a ``multi_answer`` question compares the reference's ``&&`` parts with the candidate split on
",", " and ", " & " (split before lowercasing, as the official code does) by set IoU ≥ 0.5; otherwise BEM decides
(P[equivalent] ≥ 0.5 on ``[CLS] candidate [SEP] reference [SEP] question [SEP]``, the raw strings, ``&&`` turned into
commas for multi-answer questions). A CSV answer holds ``|`` alternatives: the best over them counts.

InfoSeek (edchengg/infoseek_eval, the scorer the InfoSeek README links): String and Time questions by normalised
exact match against the ``answer_eval`` aliases (the Time docstring's ±1 year is not in the official code, so not
here); Numerical questions against ``answer_eval``'s range, the prediction read as its first one or two numbers (two
ascending numbers are a range, else the first number), a number right inside the range, a range right inside it or
with IoU ≥ 0.5. A split's score is the mean over all its questions; the final score is the harmonic mean of the
unseen-question and unseen-entity scores (each rounded to two decimals first, as the official code does).

VQA accuracy (the VQA / OK-VQA ``vqaEval.py``): min(1, matches / 3) averaged over the leave-one-annotator-out subsets,
with the standard normalisation applied when the annotators disagree.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence

from retrieval.answers import answer_in_passage, normalize_answer

__all__ = ["answer_in_passage", "evqa_correct", "official_correct", "evqa_normalize", "infoseek_correct", "infoseek_scores",
           "normalize_answer", "numeric_answer", "vqa_accuracy", "harmonic_mean", "infoseek_match", "token_accuracy"]

# --------------------------------------------------------------------------- E-VQA

EVQA_QUESTION_TYPES = ("templated", "automatic", "multi_answer", "2_hop")
_EVQA_PUNCT = set(string.punctuation + "‘’´`_")
_EVQA_ARTICLES = re.compile(r"\b(the answer is|a|an|the)\b")
_DIGITS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
           "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
_EVQA_WORDS = {**_DIGITS, "entailment": "yes", "true": "yes", "contradiction": "no", "false": "no"}
# The official E-VQA normalisation also maps contractions ("dont" → "don't"), after punctuation is deleted: a
# one-to-one renaming of apostrophe-free words applied to both sides, so it never changes a match; left out here.

BEM = Callable[[Sequence[str], Sequence[str], Sequence[str]], Sequence[float]]  # (candidates, references, questions)


def evqa_normalize(answer) -> str:
    text = str(answer or "").lower().replace("\n", " ").replace("\t", " ").strip()
    if text.startswith("<extra_id_0> "):
        text = text[len("<extra_id_0> "):]
    text = "".join(c for c in text if c not in _EVQA_PUNCT)
    text = _EVQA_ARTICLES.sub(" ", text)
    return " ".join(_EVQA_WORDS.get(w, w) for w in text.split())


def _evqa_exact(prediction: str, reference: str, question_type: str) -> bool:
    if question_type != "multi_answer":
        return bool(evqa_normalize(reference)) and evqa_normalize(reference) == evqa_normalize(prediction)
    ref = {p for p in (evqa_normalize(x) for x in reference.split("&&")) if p}
    cand = {p for p in (evqa_normalize(x) for x in
                        str(prediction).replace(" and ", ",").replace(" & ", ",").split(",")) if p}
    return bool(ref) and len(ref & cand) / len(ref | cand) >= 0.5


def _alternatives(answer: str) -> list[str]:
    alts = [a.strip() for a in str(answer or "").split("|") if a.strip()]
    if not alts:
        raise ValueError(f"E-VQA reference answer is empty: {answer!r}")
    return alts


def evqa_undecided(prediction: str, answer: str, question_type: str) -> list[str] | None:
    """None when exact match (or the multi-answer rule) already accepts ``prediction``; else the references BEM must
    judge (``&&`` turned into commas for multi-answer questions)."""
    if question_type not in EVQA_QUESTION_TYPES:
        raise ValueError(f"unknown E-VQA question type {question_type!r} (expected one of "
                         f"{', '.join(EVQA_QUESTION_TYPES)})")
    alts = _alternatives(answer)
    if any(_evqa_exact(str(prediction or ""), ref, question_type) for ref in alts):
        return None
    return [ref.replace("&&", ",") if question_type == "multi_answer" else ref for ref in alts]


def evqa_correct(prediction: str, answer: str, question: str, question_type: str, bem: BEM | None = None) -> bool:
    """The official E-VQA decision for one question; ``bem`` is called only when exact match has not decided
    (without it, an undecided answer is wrong)."""
    refs = evqa_undecided(prediction, answer, question_type)
    if refs is None:
        return True
    if bem is None or not str(prediction or "").strip():
        return False
    return max(bem([str(prediction)] * len(refs), refs, [question] * len(refs))) >= 0.5


def evqa_correct_batch(records: Sequence[dict], bem: BEM | None = None) -> list[bool]:
    """``evqa_correct`` for many records (``prediction``, ``answer``, ``question``, ``question_type``), with one BEM
    call for every undecided (candidate, reference) pair."""
    out: list[bool] = []
    pending: list[tuple[int, str, str, str]] = []
    for i, r in enumerate(records):
        refs = evqa_undecided(r["prediction"], r["answer"], r["question_type"])
        out.append(refs is None)
        if refs is not None and bem is not None and str(r["prediction"] or "").strip():
            pending += [(i, str(r["prediction"]), ref, str(r["question"])) for ref in refs]
    if pending:
        probs = bem([p[1] for p in pending], [p[2] for p in pending], [p[3] for p in pending])
        for (i, *_), p in zip(pending, probs):
            out[i] = out[i] or p >= 0.5
    return out


def evqa_report(records: Sequence[dict], correct: Sequence[bool]) -> dict:
    """Accuracy (%) per question kind: single-hop (every type but 2_hop), two-hop, overall."""
    def pct(sel):
        sel = list(sel)
        return 100.0 * sum(sel) / len(sel) if sel else None

    two = [c for r, c in zip(records, correct) if r["question_type"] == "2_hop"]
    one = [c for r, c in zip(records, correct) if r["question_type"] != "2_hop"]
    return {"single_hop": pct(one), "two_hop": pct(two), "overall": pct(correct), "n": len(correct)}


# --------------------------------------------------------------------------- InfoSeek

INFOSEEK_TYPES = ("String", "Numerical", "Time")


def is_infoseek_type(question_type) -> bool:
    """One of InfoSeek's question types, in any case (the official scorer lowercases them)."""
    return str(question_type or "").lower() in ("string", "numerical", "time")

_NUMBER = re.compile(r"[-+]?[.]?[\d]+(?:,\d\d\d)*[\.]?\d*(?:[eE][-+]?\d+)?")


def numeric_answer(text: str) -> float | list[float]:
    """The official reading of a numerical prediction: its first two numbers as a range when ascending, else its first
    number; [0, 0] when it holds none. A hyphen after a digit is a range dash, not a minus sign."""
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
    pred = numeric_answer(prediction)
    if not isinstance(pred, list):
        return low <= pred <= high
    if low <= pred[0] <= high and low <= pred[1] <= high:
        return True
    return _range_iou(pred, [low, high]) >= 0.5 - 1e-12


def _answer_range(answer_eval) -> tuple[float, float]:
    item = answer_eval[0] if isinstance(answer_eval, (list, tuple)) else answer_eval
    if not isinstance(item, dict) or item.get("range") is None:
        raise ValueError(f"a Numerical InfoSeek question needs answer_eval with a range, got {answer_eval!r}")
    low, high = (float(x) for x in list(item["range"])[:2])
    return low, high


def infoseek_correct(prediction: str, answer_eval, question_type: str) -> bool:
    """The official InfoSeek decision for one question of type String / Numerical / Time."""
    kind = str(question_type or "").lower()
    if not is_infoseek_type(kind):
        raise ValueError(f"unknown InfoSeek question type {question_type!r} (expected one of "
                         f"{', '.join(INFOSEEK_TYPES)})")
    if kind == "numerical":
        return numeric_correct(prediction, *_answer_range(answer_eval))
    aliases = answer_eval if isinstance(answer_eval, (list, tuple)) else [answer_eval]
    pred = normalize_answer(prediction)
    return any(not isinstance(a, dict) and normalize_answer(a) == pred and pred for a in aliases)  # "" never matches


def infoseek_scores(records: Sequence[dict]) -> dict:
    """Official InfoSeek scores (%) of records with ``prediction``, ``answer_eval``, ``question_type`` and
    ``data_split`` (``val_unseen_question`` / ``val_unseen_entity``): per split, and ``final`` = their harmonic mean.
    A record without a question type is refused (the final score is not defined without them)."""
    untyped = [r.get("id", i) for i, r in enumerate(records) if not r.get("question_type")]
    if untyped:
        raise ValueError(f"{len(untyped)} InfoSeek record(s) have no question_type (e.g. {untyped[0]!r}): the official "
                         "score needs them (retrieval.convert --qtype infoseek_val_qtype.jsonl)")
    splits: dict[str, list[bool]] = {"unseen_question": [], "unseen_entity": []}
    per_type: dict[str, list[bool]] = {}
    for r in records:
        ok = infoseek_correct(r["prediction"], r["answer_eval"], r["question_type"])
        split = str(r.get("data_split") or "")
        key = "unseen_question" if split.endswith("unseen_question") else \
            "unseen_entity" if split.endswith("unseen_entity") else None
        if key is None:
            raise ValueError(f"InfoSeek record {r.get('id')!r} has data_split {split!r}: expected one ending in "
                             "unseen_question or unseen_entity")
        splits[key].append(ok)
        per_type.setdefault(str(r["question_type"]).lower(), []).append(ok)
    out = {k: round(100.0 * sum(v) / len(v), 2) if v else 0.0 for k, v in splits.items()}
    safe = [v if v else 1e-12 for v in out.values()]
    out["final"] = round(len(safe) / sum(1 / v for v in safe), 2)
    out["per_type"] = {k: round(100.0 * sum(v) / len(v), 2) for k, v in per_type.items()}
    out["n"] = {k: len(v) for k, v in splits.items()}
    return out


def infoseek_match(prediction, answer_eval) -> bool:
    """InfoSeek's rule when the question type is not at hand: a range in ``answer_eval`` means Numerical, else String."""
    items = answer_eval if isinstance(answer_eval, (list, tuple)) else [answer_eval]
    if any(isinstance(i, dict) and i.get("range") is not None for i in items):
        return infoseek_correct(prediction, answer_eval, "Numerical")
    aliases = [str(i["wikidata"]) if isinstance(i, dict) else i for i in items
               if not isinstance(i, dict) or i.get("wikidata") is not None]
    return infoseek_correct(prediction, aliases, "String")


# --------------------------------------------------------------------------- a benchmark's rule, by name

METRICS = ("infoseek", "evqa")


def official_correct(metric: str, records: Sequence[dict], predictions: Sequence[str | None],
                     bem: BEM | None = None) -> list[bool]:
    """Correctness of ``predictions`` for question ``records`` (our question format) under a benchmark's rule:
    ``evqa`` (the CSV answer is ``|``.join(answers); BEM batched over the undecided ones) or ``infoseek`` (per question
    type when the record has an InfoSeek one, else by whether ``answer_eval`` holds a range). A missing prediction is
    wrong."""
    if metric == "evqa":
        rows = [{"prediction": p or "", "answer": "|".join(str(a) for a in r.get("answers") or []),
                 "question": r["question"], "question_type": r.get("question_type") or "automatic"}
                for r, p in zip(records, predictions)]
        return [ok and p is not None for ok, p in zip(evqa_correct_batch(rows, bem), predictions)]
    if metric == "infoseek":
        out = []
        for r, p in zip(records, predictions):
            golds = r["answer_eval"] if r.get("answer_eval") is not None else (r.get("answers") or [])
            if p is None:
                out.append(False)
            elif is_infoseek_type(r.get("question_type")):
                out.append(infoseek_correct(p, golds, r["question_type"]))
            else:
                out.append(infoseek_match(p, golds))
        return out
    raise ValueError(f"unknown metric {metric!r} (expected one of {', '.join(METRICS)})")


# --------------------------------------------------------------------------- VQA accuracy

_VQA_PUNCT = [";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?", "!"]
_PERIOD = re.compile(r"(?!<=\d)(\.)(?!\d)")
_COMMA_DIGITS = re.compile(r"(\d)(,)(\d)")
_CONTRACTIONS = dict(pair.split(":") for pair in (
    "aint:ain't arent:aren't cant:can't couldve:could've couldnt:couldn't couldn'tve:couldn't've "
    "couldnt've:couldn't've didnt:didn't doesnt:doesn't dont:don't hadnt:hadn't hadnt've:hadn't've "
    "hadn'tve:hadn't've hasnt:hasn't havent:haven't hed:he'd hed've:he'd've he'dve:he'd've hes:he's howd:how'd "
    "howll:how'll hows:how's isnt:isn't itd:it'd itd've:it'd've it'dve:it'd've itll:it'll maam:ma'am "
    "mightnt:mightn't mightnt've:mightn't've mightn'tve:mightn't've mightve:might've mustnt:mustn't mustve:must've "
    "neednt:needn't notve:not've oclock:o'clock oughtnt:oughtn't shant:shan't shed've:she'd've she'dve:she'd've "
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
    "you'dve:you'd've youll:you'll youre:you're youve:you've").split())


def vqa_normalize(text: str) -> str:
    """The VQA evaluation's punctuation, period, number-word, article and contraction processing."""
    out = str(text).replace("\n", " ").replace("\t", " ").strip()
    original = out
    for p in _VQA_PUNCT:
        if (p + " " in original or " " + p in original) or _COMMA_DIGITS.search(original):
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    out = _PERIOD.sub("", out, count=re.UNICODE)  # as the official code: re.UNICODE (32) lands in the count slot
    words = [_DIGITS.get(w, w) for w in out.lower().split()]
    return " ".join(_CONTRACTIONS.get(w, w) for w in words if w not in ("a", "an", "the"))


def vqa_accuracy(prediction: str, answers: list[str]) -> float:
    """VQA accuracy in [0, 1]: min(1, matching other annotators / 3), averaged over leaving each annotator out."""
    if not answers:
        raise ValueError("VQA accuracy needs the annotators' answers")
    pred = str(prediction).replace("\n", " ").replace("\t", " ").strip()
    golds = [str(a).replace("\n", " ").replace("\t", " ").strip() for a in answers]
    if len(set(golds)) > 1:
        golds, pred = [vqa_normalize(a) for a in golds], vqa_normalize(pred)
    accs = [min(1.0, sum(g == pred for j, g in enumerate(golds) if j != i) / 3) for i in range(len(golds))]
    return sum(accs) / len(accs)


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
