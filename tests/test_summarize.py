"""Long KB sections summarised before embedding: which sections, resume, failures counted, a prompt file, and the
build embedding the summary in place of the section's text (the manifest saying how many)."""

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest

from common.files import read_jsonl, write_jsonl_atomic
from retrieval.summarize import SUMMARY_PROMPT, SummarizeArgs, long_sections, summarize_kb, text_sha

QUIET = dict(log=lambda *a: None)
WORDS = lambda text: len(text.split())  # noqa: E731  a stand-in tokenizer: one token per word


def kb_rows(n: int) -> list[dict]:
    """Rows whose section text has 3 + 4·(i mod 4) words; rows i and i + 4 share a section."""
    return [
        {
            "entry_id": f"r{i}",
            "entity_id": f"E{i % 4}",
            "title": f"T{i % 4}",
            "section_title": "S",
            "text": " ".join(["word"] * (3 + 4 * (i % 4))) + f" of E{i % 4}",
            "image": f"images/{i}.png",
        }
        for i in range(n)
    ]


def test_long_sections_are_the_distinct_texts_over_the_limit():
    path_rows = kb_rows(8)
    long, distinct = long_sections_from(path_rows, max_tokens=10)
    assert distinct == 4 and [r["entity_id"] for r in long] == ["E1", "E2", "E3"]  # 11, 15, 19 words; E0 has 7
    assert all(r["tokens"] > 10 for r in long)


def long_sections_from(rows, max_tokens):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        write_jsonl_atomic(Path(d) / "kb.jsonl", rows)
        return long_sections(Path(d) / "kb.jsonl", "{title}. {section_title}. {text}", WORDS, max_tokens)


class Interrupted(Exception):
    pass


def test_summaries_resume_count_failures_and_take_a_prompt_file(tmp_path):
    write_jsonl_atomic(
        tmp_path / "kb.jsonl",
        kb_rows(40) + [{**r, "entity_id": f"F{i}", "text": f"long {i} " * 20} for i, r in enumerate(kb_rows(6))],
    )
    (tmp_path / "p.yaml").write_text("system: Published summary prompt.\nuser_template: 'Summarise: {text}'\n")
    calls = []

    def summarize(users):
        calls.append(users)
        if len(calls) == 2:
            raise Interrupted
        return ["" if "long 3 " in u else "too long " * 10 if "long 5 " in u else "a short summary" for u in users]

    args = SummarizeArgs(
        kb=str(tmp_path / "kb.jsonl"),
        out=str(tmp_path / "s.jsonl"),
        max_tokens=10,
        batch_size=3,
        summary_prompt=str(tmp_path / "p.yaml"),
    )
    with pytest.raises(Interrupted):
        summarize_kb(args, summarize=summarize, count_tokens=WORDS, **QUIET)
    with open(tmp_path / "s.jsonl", "a", encoding="utf-8") as fh:
        fh.write('{"text_sha": "ab')  # a crash mid-append: the resume drops that line
    counts = summarize_kb(args, summarize=summarize, count_tokens=WORDS, **QUIET)
    assert calls[0][0].startswith("Summarise: ") and sum(len(c) for c in calls[2:]) == 6  # 9 long, 3 done before
    assert counts["over_max_tokens"] == 9 and counts["summaries"] == 8 and counts["failed_now"] == 1
    assert counts["summaries_still_over"] == 1  # "too long" × 10: the build would still truncate it, and it says so
    rows = {r["summary"]: r for r in read_jsonl(tmp_path / "s.jsonl")}
    assert rows["a short summary"]["summary_tokens"] < 10 < rows[("too long " * 10).strip()]["summary_tokens"]
    assert json.loads((tmp_path / "s.jsonl.counts.json").read_text()) == counts
    (tmp_path / "p2.yaml").write_text("system: Another prompt.\nuser_template: 'Shorten: {text}'\n")
    with pytest.raises(ValueError, match="other settings .*prompt"):  # summaries of two wordings are not mixed
        summarize_kb(
            SummarizeArgs(**{**args.__dict__, "summary_prompt": str(tmp_path / "p2.yaml")}),
            summarize=summarize,
            count_tokens=WORDS,
            **QUIET,
        )
    with pytest.raises(ValueError, match=r"--summary_prompt .*user_template lacks \{text\}"):
        (tmp_path / "bad.yaml").write_text("system: s\nuser_template: '{title}'\n")
        summarize_kb(
            SummarizeArgs(**{**args.__dict__, "summary_prompt": str(tmp_path / "bad.yaml")}),
            summarize=summarize,
            count_tokens=WORDS,
            **QUIET,
        )


def test_the_build_embeds_summaries_in_place_of_long_sections(tiny_world, encoders, tmp_path):
    from retrieval.build_index import BuildArgs, build_index
    from tests.test_build import vectors

    kb = list(read_jsonl(tiny_world / "kb.jsonl"))[:12]
    write_jsonl_atomic(tmp_path / "kb.jsonl", kb)
    summary = "A short summary."
    write_jsonl_atomic(tmp_path / "s.jsonl", [{"text_sha": text_sha(kb[0]["text"]), "summary": summary, "tokens": 99}])
    settings = dict(
        kb=str(tmp_path / "kb.jsonl"),
        images_root=str(tiny_world),
        image_encoder="tiny",
        text_encoder="tiny",
        shard_size=8,
        batch_size=4,
        device="cpu",
    )
    plain = build_index(BuildArgs(**settings, out=str(tmp_path / "plain")), encoders=encoders, **QUIET)
    summed = build_index(
        BuildArgs(**settings, out=str(tmp_path / "summed"), summaries=str(tmp_path / "s.jsonl")),
        encoders=encoders,
        **QUIET,
    )
    assert plain["text_summaries"] is None and summed["text_summaries"]["texts_summarized"] == 1
    a, b = vectors(tmp_path / "plain"), vectors(tmp_path / "summed")
    same_text = [i for i, r in enumerate(kb) if r["text"] == kb[0]["text"]]
    others = [i for i in range(len(kb)) if i not in same_text]
    image_dim = plain["image_dim"]
    np.testing.assert_allclose(a[others], b[others], atol=1e-6)  # only the summarised section's rows changed
    expected = encoders[1].encode([f"{kb[0]['title']}. {kb[0]['section_title']}. {summary}"], is_query=False)[0]
    for i in same_text:
        text_part = b[i, image_dim:]
        np.testing.assert_allclose(
            text_part / np.linalg.norm(text_part), expected / np.linalg.norm(expected), atol=1e-5
        )
    with pytest.raises(ValueError, match="other settings"):  # another summaries file is another index
        write_jsonl_atomic(tmp_path / "s.jsonl", [])
        build_index(
            BuildArgs(**settings, out=str(tmp_path / "summed"), summaries=str(tmp_path / "s.jsonl")),
            encoders=encoders,
            **QUIET,
        )


def test_a_summaries_file_rewritten_between_two_builds_of_one_process_is_read_again(tmp_path):
    """The build's settings fingerprint the summaries file's content on every build; the summaries it embeds must be
    that content too, not an earlier build's kept in memory (a notebook, or a driver building several indexes)."""
    import os

    from retrieval.build_shards import summaries_of
    from retrieval.summarize import text_sha

    path = tmp_path / "summaries.jsonl"
    path.write_text(json.dumps({"text_sha": text_sha("long text"), "summary": "first wording"}) + "\n")
    assert summaries_of(str(path)) == {text_sha("long text"): "first wording"}
    path.write_text(json.dumps({"text_sha": text_sha("long text"), "summary": "second wording"}) + "\n")
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten a second later
    assert summaries_of(str(path)) == {text_sha("long text"): "second wording"}


def test_a_section_at_the_limit_or_without_text_is_not_summarised():
    """Long means strictly over ``max_tokens``; a row without section text is no section, however long its title."""
    rows = kb_rows(4) + [
        {**kb_rows(1)[0], "entity_id": "N", "title": "long title " * 20, "text": text} for text in ("", None)
    ]
    long, distinct = long_sections_from(rows, max_tokens=11)  # E1's embedded text is exactly 11 words
    assert distinct == 4 and [r["entity_id"] for r in long] == ["E2", "E3"]
    assert text_sha(None) == text_sha("") != text_sha("None")  # a missing text is not the section whose text is "None"


def long_kb(tmp_path):
    write_jsonl_atomic(tmp_path / "kb.jsonl", kb_rows(4))  # E1, E2, E3 are over 10 words
    return str(tmp_path / "kb.jsonl")


@pytest.mark.parametrize(
    "given,error",
    [
        (dict(kb=None), "--kb: file None does not exist"),
        (dict(out=None), "--out is required"),
        (dict(), "give --summarizer_url and --summarizer_model"),
        (dict(summarizer_url="http://h/v1"), "give --summarizer_url and --summarizer_model"),
        (dict(summarizer_model="m"), "give --summarizer_url and --summarizer_model"),
        (
            dict(batch_size=-1, summarizer="local/llm"),
            "--batch_size must be a positive integer, got -1",
        ),  # summarised nothing
        (dict(batch_size=0, summarizer="local/llm"), "--batch_size must be a positive integer, got 0"),
        (dict(max_tokens=0, summarizer="local/llm"), "--max_tokens must be a positive integer, got 0"),
        (dict(max_new_tokens=0, summarizer="local/llm"), "--max_new_tokens must be a positive integer, got 0"),
    ],
)
def test_missing_inputs_or_summariser_are_named(tmp_path, monkeypatch, given, error):
    import retrieval.summarize as sm

    monkeypatch.setattr(sm, "replier", lambda *a, **k: pytest.fail("a summariser was built"))
    args = SummarizeArgs(**{"kb": long_kb(tmp_path), "out": str(tmp_path / "s.jsonl"), "max_tokens": 10, **given})
    with pytest.raises(ValueError, match=re.escape(error)):
        summarize_kb(args, count_tokens=WORDS, **QUIET)


@pytest.mark.parametrize(
    "given,expected",
    [
        (  # an endpoint: its URL, model and key variable; the local device defaults to the CPU
            dict(summarizer_url="http://h/v1", summarizer_model="m", key_env="MY_KEY"),
            ("http://h/v1", "m", "MY_KEY", None, "cpu"),
        ),
        (dict(summarizer="local/llm"), (None, None, "OPENAI_API_KEY", "local/llm", "cpu")),
        (dict(summarizer="local/llm", device="cuda:1"), (None, None, "OPENAI_API_KEY", "local/llm", "cuda:1")),
    ],
)
def test_the_summariser_is_built_from_the_arguments_only_when_a_section_needs_it(
    tmp_path, monkeypatch, given, expected
):
    import retrieval.summarize as sm

    built = []

    def replier(system, max_new_tokens, url, model, key_env, local, device):
        built.append((system, max_new_tokens, url, model, key_env, local, device))
        return lambda users: ["a short summary" for _ in users]

    monkeypatch.setattr(sm, "replier", replier)
    args = SummarizeArgs(kb=long_kb(tmp_path), out=str(tmp_path / "s.jsonl"), max_tokens=10, max_new_tokens=64, **given)
    counts = summarize_kb(args, count_tokens=WORDS, **QUIET)
    assert built == [(SUMMARY_PROMPT["system"], 64, *expected)] and counts["summaries"] == 3
    assert counts["prompt"] == "section_summary"  # the shipped prompt when no --summary_prompt is given
    summarize_kb(args, count_tokens=WORDS, **QUIET)  # every long section done: no model is loaded again
    assert len(built) == 1


def test_the_shipped_prompt_names_the_article_and_section(tmp_path):
    users = []
    args = SummarizeArgs(kb=long_kb(tmp_path), out=str(tmp_path / "s.jsonl"), max_tokens=18)
    summarize_kb(args, summarize=lambda u: users.extend(u) or ["s"] * len(u), count_tokens=WORDS, **QUIET)
    assert users == ["Article: T3\nSection: S\n\n" + " ".join(["word"] * 15) + " of E3"]  # 19 words: E3 alone


def test_sections_are_measured_with_the_text_encoders_tokenizer_special_tokens_included(tmp_path, encoders):
    """The build truncates to ``text_max_seq_length`` tokens with the special tokens kept, so they count here too."""
    from retrieval.kb import entry_text

    tokenizer = encoders[1].model.tokenizer
    template = SummarizeArgs().text_template
    rows = kb_rows(4)
    sizes = [len(tokenizer(entry_text(r, template), add_special_tokens=True)["input_ids"]) for r in rows]
    bare = [len(tokenizer(entry_text(r, template), add_special_tokens=False)["input_ids"]) for r in rows]
    assert sizes[1] > bare[1] and sizes[0] < sizes[1]
    write_jsonl_atomic(tmp_path / "kb.jsonl", rows)
    args = SummarizeArgs(
        kb=str(tmp_path / "kb.jsonl"), out=str(tmp_path / "s.jsonl"), text_encoder="tiny", max_tokens=bare[1]
    )
    counts = summarize_kb(args, summarize=lambda u: ["s"] * len(u), **QUIET)
    written = {r["text_sha"]: r["tokens"] for r in read_jsonl(tmp_path / "s.jsonl")}
    assert written == {text_sha(r["text"]): n for r, n in zip(rows, sizes) if n > bare[1]}
    assert counts["over_max_tokens"] == sum(n > bare[1] for n in sizes) and text_sha(rows[1]["text"]) in written


def test_the_command_line_counts_failed_blank_and_at_limit_summaries(tmp_path, monkeypatch):
    """A failed request (None) and a blank reply are failures, not summaries; a summary exactly at the limit is not
    still over it; a row without a title or section title fills the prompt with nothing, not "None"."""
    import retrieval.summarize as sm

    rows = kb_rows(4)
    rows[3] = {**rows[3], "title": None, "section_title": None}
    write_jsonl_atomic(tmp_path / "kb.jsonl", rows)
    users = []

    def replies(batch):
        users.extend(batch)
        return [None, "   ", " ".join(["w"] * 8)][: len(batch)]  # ". . " + 8 words: 10 tokens, the limit

    monkeypatch.setattr(sm, "replier", lambda *a, **k: replies)
    words = SimpleNamespace(model=SimpleNamespace(tokenizer=lambda text, **k: {"input_ids": text.split()}))
    monkeypatch.setattr(sm, "TextEncoder", lambda *a, **k: words)
    out = str(tmp_path / "s.jsonl")
    sm.main(["--kb", str(tmp_path / "kb.jsonl"), "--out", out, "--summarizer", "local/llm", "--max_tokens", "10"])
    counts = json.loads((tmp_path / "s.jsonl.counts.json").read_text())
    assert counts["summaries"] == 1 and counts["failed_now"] == 2 and counts["summaries_still_over"] == 0
    assert users[2].startswith("Article: \nSection: \n\n")
