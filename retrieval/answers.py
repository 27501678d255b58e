"""Answer strings against text, pure functions shared by retrieval evaluation (pseudo-recall) and the QA metrics.

``normalize_answer`` is InfoSeek's official normalisation (edchengg/infoseek_eval, the scorer the InfoSeek README
links): lowercase, punctuation deleted (not replaced by a space: "Eiffel-Tower" → "eiffeltower"), the articles
a / an / the removed, whitespace collapsed.

``answer_in_passage`` is the pseudo-recall rule: an answer counts as present when, after that normalisation, it
occurs in the passage as whole words (so "12" is not found in "1200" nor in "12.5", which normalises to "125"); an
answer written with ``&&`` parts (E-VQA's multi-answer questions) is present only when every part is.

``who`` names a question in the scorers' error messages.
"""

from __future__ import annotations

import re
import string

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_DELETE_PUNCT = str.maketrans("", "", string.punctuation)


def who(qid) -> str:
    """A question as an error message names it: by its id, or as having none."""
    return "a question without an id" if qid is None else f"question {qid!r}"


def normalize_answer(text) -> str:
    """InfoSeek's official normalisation: lowercase, delete punctuation, drop a/an/the, collapse whitespace."""
    if text is None:
        return ""
    text = str(text).lower().translate(_DELETE_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _present(part: str, passage: str) -> bool:
    return bool(part) and re.search(rf"(?<!\w){re.escape(part)}(?!\w)", passage) is not None


def answer_in_passage(answers: list[str], passage: str) -> bool:
    """True when one of ``answers`` (each possibly ``a && b``) is present, as whole words, in ``passage``."""
    text = normalize_answer(passage)
    for answer in answers if isinstance(answers, (list, tuple)) else [answers]:
        parts = [normalize_answer(p) for p in str(answer or "").split("&&")]
        parts = [p for p in parts if p]
        if parts and all(_present(p, text) for p in parts):
            return True
    return False
