"""Judges that score a sampled answer against the gold answers on the paper's 1–5 scale (5 = correct).

Factories keyed by plain strings: ``exact`` (5 or 1: E-VQA questions by E-VQA's exact step, others by InfoSeek's
normalisation and numeric ranges), ``token`` (token recall r of the gold answer in the prediction: 1 + 4r), ``llm``
(an OpenAI-compatible chat endpoint, a 1–5 correctness prompt in the style of LlamaIndex's CorrectnessEvaluator; the
API key is read from an environment variable and never logged; an unparseable reply is retried, then recorded as a
failure — ``None`` — never a score).
``judge_all`` judges each distinct (question, answer as written) once, through a cache.
"""

from __future__ import annotations

import re

from common.llm import ask_with_retries, chat, chat_url
from gate.pipeline.metrics import token_accuracy
from gate.pipeline.metrics_evqa import EVQA_QUESTION_TYPES, evqa_exact_match
from gate.pipeline.metrics_infoseek import infoseek_match

CORRECTNESS_SYSTEM = (
    "You are an expert evaluation system for a question answering chatbot.\n"
    "You are given a user query, a reference answer, and a generated answer.\n"
    "Judge the relevance and correctness of the generated answer. Output a single score that represents a "
    "holistic evaluation, on a line by itself as 'Score: N', followed by your reasoning on the next line.\n"
    "The score must be a number between 1 and 5, where 1 is the worst and 5 is the best.\n"
    "If the generated answer is not relevant to the query, give a score of 1.\n"
    "If the generated answer is relevant but contains mistakes, give a score between 2 and 3.\n"
    "If the generated answer is relevant and fully correct, give a score between 4 and 5."
)
CORRECTNESS_USER = "## User Query\n{question}\n\n## Reference Answer\n{reference}\n\n## Generated Answer\n{answer}"
# "Score: 4", "**Score:** 4", "The score is 4.5", "a score of 1", "score=2", "Score: 4/5", JSON's "score": 4: the
# whole number is read
# ("45", "10/10" are out of range, not 4 and 1); a reply whose first line is only the number counts too, a list marker
# does not
_SCORE = re.compile(r"score\"?[*_\s]*(?:is\s*|of\s*)?[:=]?[*_\s]*(\d+(?:\.\d+)?)(?!\d)", re.I)
_ALONE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:/\s*5)?\s*(?:\n|$)")
# the verdict line the prompt asks for: "Score: N" at the start of a line ("**Final Score (1-5):** 4", "Overall score
# = 3", "Generated answer score: 2" too: up to three words before it), the last one read before any "score" in the
# reasoning ("a fully right answer would score 5, but … Score: 2"); a number on another scale ("4/10", "3 out of 10",
# "4,5") is not a 1–5 score; a verdict line with nothing after its colon takes the next line that holds something
_VERDICT = re.compile(r"^[\s*_#>-]*(?:[A-Za-z]+\s+){0,3}score\b[*_\s]*(?:\([^)\n]*\))?[*_\s]*[:=](.*)$", re.I | re.M)
_NUMBER = re.compile(r"[*_\s]*(\d+(?:\.\d+)?)(?![.,]\d)(?!\d)(?!\s*(?:/|out\s+of)\s*(?!5(?:\.0)?\b)\d)", re.I)
_THINKING = re.compile(r"<think>.*?(?:</think>|$)", re.S | re.I)


def parse_score(reply: str) -> float | None:
    """The 1–5 score in a judge reply: the last verdict line ('Score: N', 'Final score: N', as the prompt asks), else
    'score N' anywhere in any of its usual spellings, else a first line that is only the number; a reasoning model's
    thinking (a ``<think>`` block, or all before a lone ``</think>``) is left out. None when there is none, or when
    the verdict line holds no 1–5 number ('Score: N/A'): an unreadable reply is never turned into a score."""
    if not isinstance(reply, str):
        return None
    reply = _THINKING.sub("", re.split(r"</think>", reply, flags=re.I)[-1])  # after the last closing tag
    verdicts = list(_VERDICT.finditer(reply))
    if verdicts:
        verdict = verdicts[-1].group(1)
        if not verdict.strip("*_ \t"):  # "**Score:**" with the number on a line of its own below
            verdict = next((line for line in reply[verdicts[-1].end() :].splitlines() if line.strip()), "")
        m = _NUMBER.match(verdict)
    else:
        m = _SCORE.search(reply) or _ALONE.match(reply)
    if not m:
        return None
    value = float(m.group(1))
    return value if 1.0 <= value <= 5.0 else None


class ExactJudge:
    """5 or 1: an E-VQA question (its question type, no ``answer_eval``) by E-VQA's own exact step (number words as
    digits, a multi-answer by its parts' overlap), else InfoSeek's normalisation and numeric ranges."""

    name = "exact"

    def score(self, question: str, answer: str, golds, answer_eval=None, question_type=None) -> float:
        if not answer_eval and question_type in EVQA_QUESTION_TYPES:
            return 5.0 if evqa_exact_match(answer, golds, question_type) else 1.0
        return 5.0 if infoseek_match(answer, answer_eval if answer_eval else golds) else 1.0


class TokenJudge:
    name = "token"

    def score(self, question: str, answer: str, golds, answer_eval=None, question_type=None) -> float:
        return 1.0 + 4.0 * token_accuracy(answer, golds)


class LLMJudge:
    name = "llm"

    def __init__(
        self,
        url: str,
        model: str,
        api_key_env: str = "OPENAI_API_KEY",
        retries: int = 3,
        timeout: float = 60.0,
        backoff: float = 1.0,
    ):
        if not url or not model:
            raise ValueError("the llm judge needs --judge_url (an OpenAI-compatible endpoint) and --judge_model")
        self.url = chat_url(url)
        self.model, self.api_key_env = model, api_key_env
        self.retries, self.timeout, self.backoff = retries, timeout, backoff
        self.failures = 0

    def _ask(self, question: str, answer: str, golds) -> str:
        messages = [
            {"role": "system", "content": CORRECTNESS_SYSTEM},
            {
                "role": "user",
                "content": CORRECTNESS_USER.format(
                    question=question, reference=" | ".join(map(str, golds)), answer=answer
                ),
            },
        ]
        return chat(self.url, self.model, messages, self.api_key_env, self.timeout)

    def score(self, question: str, answer: str, golds, answer_eval=None, question_type=None) -> float | None:
        value, reason = ask_with_retries(
            lambda: self._ask(question, answer, golds), parse_score, self.retries, self.backoff, "unparseable reply"
        )
        if value is None:
            self.failures += 1
            self.last_failure = reason
        return value


def make_judge(name: str, **kwargs):
    judges = {"exact": ExactJudge, "token": TokenJudge, "llm": LLMJudge}
    if name not in judges:
        raise ValueError(f"unknown judge {name!r}: choose one of {', '.join(judges)}")
    return judges[name](**kwargs) if name == "llm" else judges[name]()


def judge_from_args(args):
    """The judge a data-construction config names (``judge``, and for ``llm`` its URL, model and key variable)."""
    kwargs = (
        dict(url=args.judge_url, model=args.judge_model, api_key_env=args.judge_key_env) if args.judge == "llm" else {}
    )
    return make_judge(args.judge, **kwargs)


def judge_settings(args) -> dict:
    """The judge a stage's resume must match (``judge_from_args``'s choice; the URL may change, the model not). The
    exact judge's version: since 2, E-VQA questions by E-VQA's exact step (scores of version 1 are not mixed in)."""
    return {
        "judge": args.judge,
        "judge_model": args.judge_model if args.judge == "llm" else None,
        **({"exact_rule": 2} if args.judge == "exact" else {}),
    }


def judge_all(records: list[dict], judge, cache: dict | None = None) -> list[list[float | None]]:
    """Scores for each record's ``samples``, judging each distinct (question id, answer) once — the answer as written,
    spaces collapsed: a judge reads it as written ("1.5 m" and "15 m" are different numbers, which
    ``retrieval.answers.normalize_answer`` would merge by deleting punctuation). A failed judgement (None) is not
    cached.

    A record: {"id", "question", "answers" (golds), optional "answer_eval", "samples": [str, ...]}.
    """
    cache = {} if cache is None else cache
    out = []
    for rec in records:
        scores = []
        for sample in rec["samples"]:
            key = (str(rec["id"]), " ".join(str(sample).split()))
            score = cache.get(key)
            if score is None:  # a failure (None) is not cached: the next sample with this answer asks again
                score = judge.score(
                    rec["question"], sample, rec.get("answers") or [], rec.get("answer_eval"), rec.get("question_type")
                )
                if score is not None:
                    cache[key] = score
            scores.append(score)
        out.append(scores)
    return out
