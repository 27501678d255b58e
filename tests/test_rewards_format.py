"""Format parser and format reward: table-driven cases and hypothesis fuzzing (it never raises)."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewards import format_completion, format_reward, parse_completion, parse_query
from rewards.format import FormatReward, completion_text

A = '{"query": "red star"}'
CASES = [
    (f"<think>x</think><answer>{A}</answer>", "red star"),
    (f"<think></think><answer>{A}</answer>", "red star"),  # empty think is fine
    (f"  \n<think>x</think>\n <answer> {A} </answer>\n\n", "red star"),  # whitespace around
    (f"<think>x</think><answer>```json\n{A}\n```</answer>", "red star"),  # fenced JSON
    (f"<think>x</think><answer>```\n{A}\n```</answer>", "red star"),
    ('<think>x</think><answer>{"query": "  red star  ", "extra": 1}</answer>', "red star"),
    ('<think>é</think><answer>{"query": "étoile rouge ★"}</answer>', "étoile rouge ★"),
    (f"<think>x</think><answer>{A}</answer>trailing", None),  # text after </answer>
    (f"lead<think>x</think><answer>{A}</answer>", None),  # text before <think>
    (f"<answer>{A}</answer><think>x</think>", None),  # wrong order
    (f"<think>x</think>between<answer>{A}</answer>", None),  # text between
    (f"<think>x</think><answer>{A}</answer><answer>{A}</answer>", None),  # repeated tag
    (f"<think><think>x</think></think><answer>{A}</answer>", None),  # nested
    (f"<think>x</think><answer>{A}", None),  # unclosed
    ('<think>x</think><answer>["red star"]</answer>', None),  # JSON list
    ('<think>x</think><answer>{"query": 3}</answer>', None),  # number for query
    ('<think>x</think><answer>{"query": ""}</answer>', None),
    ('<think>x</think><answer>{"query": "   "}</answer>', None),
    ('<think>x</think><answer>{"q": "red"}</answer>', None),
    ("<think>x</think><answer>red star</answer>", None),  # not JSON
    ("", None),
    ("<think></think><answer></answer>", None),
    ('<think>x</think><answer>{"query": "red circle \\ud83d"}</answer>', None),  # half an emoji, escaped
    ('<think>x</think><answer>{"query": "red \\ud83d\\ude00"}</answer>', "red \U0001f600"),  # a whole pair is kept
]


@pytest.mark.parametrize("text,expected", CASES)
def test_parse_query_table(text, expected):
    assert parse_query(text) == expected
    query, reason = parse_completion(text)
    assert (reason == "ok") == (expected is not None) and isinstance(reason, str)


@pytest.mark.parametrize("bad", [None, 3, b"<think></think>", ["x"], {"a": 1}])
def test_non_strings_never_raise(bad):
    assert parse_query(bad) is None


def test_length_cap():
    long = " ".join(["word"] * 129)
    text = format_completion(long)
    assert parse_query(text) == long  # no cap unless asked
    assert parse_query(text, max_tokens=128) is None
    assert parse_query(format_completion(" ".join(["w"] * 128)), max_tokens=128) is not None
    assert format_reward([text]) == [-4.0]
    assert FormatReward(max_query_tokens=None)([text]) == [1.0]


def test_format_reward_accepts_trl_shapes():
    ok, bad = format_completion("red star"), "nope"
    conversational = [[{"role": "assistant", "content": ok}], [{"role": "assistant", "content": bad}]]
    parts = [[{"role": "assistant", "content": [{"type": "text", "text": ok}]}]]
    assert format_reward([ok, bad]) == [1.0, -4.0]
    assert format_reward(conversational, prompts=[[], []], trainer_state=None) == [1.0, -4.0]
    assert format_reward(parts) == [1.0]
    assert FormatReward(valid=2, invalid=-1)([ok, bad]) == [2.0, -1.0]
    assert FormatReward().__name__ == format_reward.__name__ == "format_reward"  # TRL logs rewards/<__name__>
    assert completion_text(None) == ""


def test_huge_and_deeply_nested_inputs():
    assert parse_query("<think>" + "x" * 2_000_000 + "</think><answer>" + A + "</answer>") == "red star"
    deep = "[" * 100_000 + "]" * 100_000
    assert parse_query(f"<think></think><answer>{deep}</answer>") is None
    assert parse_query(f'<think></think><answer>{{"query": {deep}}}</answer>') is None


fragments = st.sampled_from(
    [
        "<think>",
        "</think>",
        "<answer>",
        "</answer>",
        "{",
        "}",
        '"query"',
        ":",
        '"',
        "```",
        "json",
        " ",
        "\n",
        "[",
        "]",
        "null",
        "3",
        "red",
        "\\",
        "\x00",
        "é",
        "★",
    ]
)


@settings(max_examples=3000, deadline=None)
@given(st.one_of(st.text(), st.lists(fragments, max_size=40).map("".join)))
def test_fuzz_never_raises_and_is_consistent(text):
    query, reason = parse_completion(text)
    assert (query is None) != (reason == "ok")
    if query is not None:
        assert query == query.strip() and query
        assert text.count("<answer>") == 1 and text.strip().endswith("</answer>")
    assert format_reward([text]) == [1.0 if query is not None and len(query.split()) <= 128 else -4.0]


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1).filter(lambda s: s.strip() and "<" not in s), st.text())
def test_round_trip(query, think):
    think = think.replace("<", "").replace(">", "")
    assert parse_query(format_completion(query, think)) == query.strip()
    assert json.loads(json.dumps({"query": query}))["query"] == query


def test_the_default_cap_is_128_tokens():
    assert format_reward([format_completion(" ".join(["w"] * 128))]) == [1.0]
    assert format_reward([format_completion(" ".join(["w"] * 129))]) == [-4.0]


@pytest.mark.parametrize(
    "completion,text",
    [
        ({"role": "assistant", "content": "a"}, "a"),  # one message, not in a list
        ([{"role": "assistant", "content": None}], ""),
        ([{"role": "assistant", "content": 3}], ""),
        ([{"role": "assistant", "content": [{"type": "image"}, {"type": "text", "text": "a"}]}], "a"),
        ([{"role": "assistant", "content": [{"type": "text", "text": None}, "stray", {"text": "b"}]}], "b"),
        (["a", {"content": "b"}], "ab"),
    ],
)
def test_completion_text_reads_odd_shapes_without_raising(completion, text):
    assert completion_text(completion) == text
