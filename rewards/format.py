"""The refiner's output format, its parser and the format reward.

Valid output: ``<think>…</think>`` (content may be empty) then ``<answer>…</answer>``, each tag exactly once and
in that order, optional whitespace around them and nothing but whitespace after ``</answer>``. The answer holds a
JSON object (optionally inside a ```json fence) with a non-empty string ``query`` that holds no lone UTF-16 surrogate
(an escaped half of a pair, which no tokenizer encodes). Nothing here ever raises.
"""

from __future__ import annotations

import json
import re

from common.files import LONE_SURROGATE

PARSER_VERSION = "2"  # 2: a query holding a lone surrogate escape is invalid
TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_LAYOUT = re.compile(r"\A\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*\Z", re.S)
_FENCE = re.compile(r"\A```(?:json)?\s*(.*?)\s*```\Z", re.S | re.I)

VALID_REWARD = 1.0
INVALID_REWARD = -4.0
MAX_QUERY_TOKENS = 128


def completion_text(completion) -> str:
    """Text of a completion as TRL passes it: a string, or conversational ``[{"role", "content"}]`` messages
    whose content is a string or a list of ``{"type": "text", "text": …}`` parts."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)):
        parts = []
        for msg in completion:
            content = msg.get("content") if isinstance(msg, dict) else msg
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, (list, tuple)):
                parts += [p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return "".join(parts)
    return ""


def query_tokens(query: str) -> int:
    """Length of a query in tokens (whitespace-separated words: independent of any model's tokenizer)."""
    return len(query.split())


def parse_completion(text, max_tokens: int | None = None) -> tuple[str | None, str]:
    """Return ``(query, "ok")`` or ``(None, reason)`` for any input."""
    try:
        if not isinstance(text, str):
            return None, f"not a string ({type(text).__name__})"
        for tag in TAGS:
            n = text.count(tag)
            if n != 1:
                return None, f"{tag} appears {n} times"
        m = _LAYOUT.match(text)
        if m is None:
            return None, "tags out of order or text outside them"
        body = m.group(2).strip()
        fence = _FENCE.match(body)
        if fence:
            body = fence.group(1)
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            return None, "answer is not valid JSON"
        if not isinstance(obj, dict):
            return None, f"answer is a JSON {type(obj).__name__}, not an object"
        query = obj.get("query")
        if not isinstance(query, str):
            return None, "answer has no string 'query'"
        query = query.strip()
        if not query:
            return None, "query is empty"
        if LONE_SURROGATE.search(query):  # an escaped half of a pair: no text encoder or UTF-8 file takes it
            return None, "query holds a lone UTF-16 surrogate escape"
        if max_tokens is not None and query_tokens(query) > max_tokens:
            return None, f"query longer than {max_tokens} tokens"
        return query, "ok"
    except Exception as e:  # never raise, whatever the input
        return None, f"unparseable ({type(e).__name__})"


def parse_query(text, max_tokens: int | None = None) -> str | None:
    """The refined query in ``text``, or None when the format is not met. No length cap unless asked."""
    return parse_completion(text, max_tokens)[0]


class FormatReward:
    """TRL reward function: ``valid`` when the completion parses (within the length cap), else ``invalid``."""

    __name__ = "format_reward"

    def __init__(
        self,
        valid: float = VALID_REWARD,
        invalid: float = INVALID_REWARD,
        max_query_tokens: int | None = MAX_QUERY_TOKENS,
    ):
        self.valid, self.invalid, self.max_query_tokens = float(valid), float(invalid), max_query_tokens

    def __call__(self, completions, **kwargs) -> list[float]:
        return [
            self.valid if parse_query(completion_text(c), self.max_query_tokens) is not None else self.invalid
            for c in completions
        ]


def format_reward(completions, **kwargs) -> list[float]:
    """TRL reward function with the paper's defaults: +1 valid, −4 otherwise; queries over 128 tokens are invalid."""
    return FormatReward()(completions, **kwargs)


def format_completion(query: str, think: str = "") -> str:
    """The canonical completion for a query (used by the warm start and the tests)."""
    return f"<think>{think}</think><answer>{json.dumps({'query': query}, ensure_ascii=False)}</answer>"
