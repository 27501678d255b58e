"""The Inspector's training data as published: FAIL targets expanded into sentences that keep the short answer
(resumable), and per-benchmark PASS/FAIL targets (counts or shares) sampled with a seed and reported."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.files import read_jsonl, write_jsonl_atomic
from gate.train.answer_expansion import expansion_target, parse_expansion, stage_expand
from gate.train.build_data import BuildDataArgs
from gate.train.labelling import stage_render
from gate.train.render import class_targets, parse_class_targets


@pytest.mark.parametrize(
    "text,sentence",
    [
        ('{"expanded_answer": "The tower is 324 metres tall."}', "The tower is 324 metres tall."),
        ('Here: ```{"expanded_answer": " It opened in 1889. "}```', "It opened in 1889."),
        ('{"answer": "x"} {"expanded_answer": "second"}', "second"),
        ('{"expanded_answer": ""}', None),
        ('{"expanded_answer": 3}', None),
        ("no json", None),
        (None, None),
    ],
)
def test_parse_expansion(text, sentence):
    assert parse_expansion(text) == sentence


@pytest.mark.parametrize(
    "short,reply,target,expanded",
    [
        ("324 m", '{"expanded_answer": "The Eiffel Tower is 324 m tall."}', "The Eiffel Tower is 324 m tall.", True),
        ("Paris", '{"expanded_answer": "It stands in the French capital."}', "Paris", False),  # short answer lost
        ("1889", "It opened in 1889.", "1889", False),  # no JSON
        ("the Seine", '{"expanded_answer": "The river is Seine."}', "The river is Seine.", True),  # articles normalised
    ],
)
def test_a_sentence_must_keep_the_short_answer(short, reply, target, expanded):
    out = expansion_target(short, reply)
    assert out["target"] == target and out["expanded"] == expanded and (out["reason"] is None) == expanded


@given(st.text(max_size=100), st.text(max_size=100))
def test_any_reply_gives_a_target(short, reply):
    out = expansion_target(short, reply)
    assert out["target"] == short or (out["expanded"] and out["target"].strip())


@pytest.mark.parametrize(
    "available,targets,taken",
    [
        ({"pass": 4000, "fail": 4500}, {"pass": 3000, "fail": 5000}, {"pass": 3000, "fail": 4500}),  # counts, capped
        ({"pass": 20000, "fail": 16000}, {"pass": 15000, "fail": 15000}, {"pass": 15000, "fail": 15000}),
        ({"pass": 10, "fail": 30}, {"pass": 0.5, "fail": 0.5}, {"pass": 10, "fail": 10}),  # shares
        ({"pass": 300, "fail": 1000}, {"pass": 0.375, "fail": 0.625}, {"pass": 300, "fail": 500}),
        ({"pass": 5, "fail": 5}, {"pass": 1.0, "fail": 0.0}, {"pass": 5, "fail": 0}),
        ({"pass": 4000, "fail": 4500}, {"pass": 3000, "fail": 0}, {"pass": 3000, "fail": 0}),  # counts, one of 0
        ({"pass": 10, "fail": 10}, {"pass": 2, "fail": 2}, {"pass": 2, "fail": 2}),  # the smallest counts
        ({"pass": 4000}, {"pass": 3000, "fail": 5000}, {"pass": 3000}),  # a class named but absent
        # the largest total the shares fit, 10 / 0.375 = 26.7, not 26; then each share of it rounded down
        ({"pass": 10, "fail": 100}, {"pass": 0.375, "fail": 0.625}, {"pass": 10, "fail": 16}),
    ],
)
def test_class_targets(available, targets, taken):
    assert class_targets(available, targets) == taken


@given(st.dictionaries(st.sampled_from(["pass", "fail", "x"]), st.integers(0, 500), min_size=1), st.floats(0.05, 0.95))
def test_shares_never_exceed_what_is_available_and_keep_the_proportion(available, share):
    classes = sorted(available)
    targets = {c: (share if i == 0 else (1 - share) / max(1, len(classes) - 1)) for i, c in enumerate(classes)}
    if len(classes) == 1:
        targets = {classes[0]: 1.0}
    taken = class_targets(available, targets)
    assert all(0 <= taken[c] <= available[c] for c in classes)
    total = sum(taken.values())
    if total >= 100 and len(classes) > 1:
        assert taken[classes[0]] / total == pytest.approx(targets[classes[0]], abs=0.05)


def test_bad_targets_are_named():
    with pytest.raises(ValueError, match="names no target for class.*fail"):
        class_targets({"pass": 1, "fail": 1}, {"pass": 3})
    with pytest.raises(ValueError, match="shares that sum to 1"):
        class_targets({"pass": 1, "fail": 1}, {"pass": 0.5, "fail": 0.2})
    with pytest.raises(ValueError, match="shares that sum to 1"):  # a count beside a share
        class_targets({"pass": 1, "fail": 1}, {"pass": 3000, "fail": 0.5})
    for text in ("pass:many", "pass"):
        with pytest.raises(ValueError, match=f"{text!r} must look like class:count or class:share"):
            parse_class_targets(text)
    for text in (":5", "pass:-1"):
        with pytest.raises(ValueError, match=f"{text!r} needs a class name and a value ≥ 0"):
            parse_class_targets(f"fail:2,{text}")


def test_parse_class_targets():
    assert parse_class_targets(" pass : 3000,fail:5000") == {"pass": 3000.0, "fail": 5000.0}
    assert parse_class_targets("pass:0.375,fail:0.625") == {"pass": 0.375, "fail": 0.625}
    assert parse_class_targets("pass:1,fail:0") == {"pass": 1.0, "fail": 0.0}  # a class left out on purpose


def test_class_targets_without_a_report_to_fill():
    from gate.train.render import render_rows

    recs = [
        {"id": f"q{i}", "question": "Q?", "image_path": "/x.png", "context": "c", **r}
        for i, r in enumerate(label_rows(6))
    ]
    rows = render_rows("inspector", recs, targets={"pass": 1.0, "fail": 0.0}, seed=0)
    assert [r["class"] for r in rows] == ["pass", "pass"]


class Interrupted(Exception):
    pass


def label_rows(n: int) -> list[dict]:
    return [
        {
            "id": f"q{i}",
            "question": f"How tall is tower {i}?",
            "context": f"Tower {i} is tall.",
            "image_path": f"/img/{i}.png",
            "variant": "inspector",
            "pass": i % 3 == 0,
            "split": "train",
            "inspector": {"pass": "true"} if i % 3 == 0 else {"pass": "false", "answer": f"{i}0 m"},
        }
        for i in range(n)
    ]


def test_fail_answers_are_expanded_resumably_and_rendered_with_the_published_balance(tmp_path):
    write_jsonl_atomic(tmp_path / "labels-inspector.jsonl", label_rows(12))  # 4 PASS, 8 FAIL
    calls = []

    def expand(questions, answers):
        calls.append(list(answers))
        if len(calls) == 2:
            raise Interrupted
        return [
            json.dumps({"expanded_answer": f"The tower is {a} tall."})
            if j % 2 == 0
            else json.dumps({"expanded_answer": "It is very tall."})
            for j, a in enumerate(answers)
        ]

    args = BuildDataArgs(stage="expand", out=str(tmp_path), batch_size=3)
    with pytest.raises(Interrupted):
        stage_expand(args, tmp_path, log=lambda *a: None, expand=expand)
    lines = []
    assert stage_expand(args, tmp_path, log=lines.append, expand=expand) == 5  # 8 FAIL, 3 written before
    assert calls[2] == ["50 m", "70 m", "80 m"]
    expanded = {r["id"]: r for r in read_jsonl(tmp_path / "expanded-inspector.jsonl")}
    assert len(expanded) == 8 and expanded["q1"]["target"] == "The tower is 10 m tall."
    assert expanded["q2"]["target"] == "20 m" and "does not contain the short answer" in expanded["q2"]["reason"]
    assert "kept the short answer" in lines[-1]

    render = BuildDataArgs(
        stage="render",
        out=str(tmp_path),
        variant="inspector",
        inspector_expanded=True,
        class_targets="pass:3,fail:5",
        seed=1,
    )
    said = []
    stage_render(render, tmp_path, log=said.append)
    rows = list(read_jsonl(tmp_path / "inspector.train.jsonl"))
    assert sorted(r["class"] for r in rows) == ["fail"] * 5 + ["pass"] * 3
    fails = {r["id"]: json.loads(r["completion"][0]["content"]) for r in rows if r["class"] == "fail"}
    assert all(body["answer"] == expanded[i]["target"] for i, body in fails.items())
    assert any("  fail: 5 taken of 8 available (target 5)" == x for x in said)
    stage_render(render, tmp_path, log=lambda *a: None)
    assert list(read_jsonl(tmp_path / "inspector.train.jsonl")) == rows  # seeded: the same sample again

    (tmp_path / "expanded-inspector.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"8 FAIL example\(s\) have no expanded answer"):
        stage_render(render, tmp_path, log=lambda *a: None)


def test_expand_asks_an_openai_compatible_endpoint_with_the_stages_prompt(tmp_path, stub):
    """The expansion stage on the wire (common.llm.replier, shared with section summaries): the system prompt and
    the formatted user turn reach the endpoint, its JSON reply becomes the target."""
    from gate.train.answer_expansion import EXPANSION_PROMPT

    write_jsonl_atomic(tmp_path / "labels-inspector.jsonl", label_rows(2))  # q0 PASS, q1 FAIL ("10 m")
    server = stub(['{"expanded_answer": "Tower 1 is 10 m tall."}'])
    stage_expand(
        BuildDataArgs(stage="expand", out=str(tmp_path), expander_url=server.url, expander_model="m"),
        tmp_path,
        log=lambda *a: None,
    )
    (sent,) = server.requests
    assert sent["body"]["max_tokens"] == 128  # a JSON object holding a sentence, not sample's 32-token answers
    assert sent["body"]["model"] == "m" and sent["body"]["messages"] == [
        {"role": "system", "content": EXPANSION_PROMPT["system"]},
        {"role": "user", "content": "Question: How tall is tower 1?\nShort answer: 10 m"},
    ]
    (row,) = read_jsonl(tmp_path / "expanded-inspector.jsonl")
    assert row["id"] == "q1" and row["target"] == "Tower 1 is 10 m tall." and row["expanded"]


def test_a_failed_expansion_request_is_asked_again_on_the_next_run(tmp_path):
    """A request that failed after its retries (None) is not written as done: the next run asks for it again, and
    the log says how many to retry."""
    write_jsonl_atomic(tmp_path / "labels-inspector.jsonl", label_rows(6))  # q1 q2 q4 q5 FAIL
    outage = [True]

    def expand(questions, answers):
        return [
            None if outage[0] and "2" in q else json.dumps({"expanded_answer": f"It is {a} tall."})
            for q, a in zip(questions, answers)
        ]

    args = BuildDataArgs(stage="expand", out=str(tmp_path), batch_size=8)
    lines = []
    assert stage_expand(args, tmp_path, log=lines.append, expand=expand) == 3
    assert "1 requests failed and were not written" in lines[-1]
    assert "q2" not in {r["id"] for r in read_jsonl(tmp_path / "expanded-inspector.jsonl")}
    outage[0] = False
    assert stage_expand(args, tmp_path, log=lines.append, expand=expand) == 1
    expanded = {r["id"]: r["target"] for r in read_jsonl(tmp_path / "expanded-inspector.jsonl")}
    assert expanded["q2"] == "It is 20 m tall." and len(expanded) == 4
    other = BuildDataArgs(stage="expand", out=str(tmp_path), batch_size=8, expander="another-model")
    with pytest.raises(ValueError, match="other settings .*expander"):  # another model's sentences are not mixed in
        stage_expand(other, tmp_path, log=lines.append, expand=expand)


def test_an_empty_expansion_is_the_models_answer_not_a_request_to_retry_forever(tmp_path, stub):
    """An endpoint that answers nothing (a reasoning model out of tokens) was a failed request: never written, asked
    again on every run, and render then refused the rows. It keeps the short answer, saying why, once."""
    write_jsonl_atomic(tmp_path / "labels-inspector.jsonl", label_rows(2))  # q1 FAIL
    server = stub([""] * 20)
    args = BuildDataArgs(stage="expand", out=str(tmp_path), expander_url=server.url, expander_model="m")
    assert stage_expand(args, tmp_path, log=lambda *a: None) == 1
    (row,) = read_jsonl(tmp_path / "expanded-inspector.jsonl")
    assert row["target"] == "10 m" and not row["expanded"] and "no expanded_answer" in row["reason"]
    asked = len(server.requests)
    assert stage_expand(args, tmp_path, log=lambda *a: None) == 0 and len(server.requests) == asked


def test_a_question_labelled_again_with_another_answer_is_expanded_again(tmp_path):
    """Expansions were matched by id alone: relabelled with another short answer (London → Paris), the question kept
    "The city shown is London." as its FAIL target, and render used it."""
    rows = label_rows(2)  # q1 FAIL, "10 m"
    write_jsonl_atomic(tmp_path / "labels-inspector.jsonl", rows)
    asked = []

    def expand(questions, answers):
        asked.extend(answers)
        return [json.dumps({"expanded_answer": f"Tower 1 is {a} tall."}) for a in answers]

    args = BuildDataArgs(stage="expand", out=str(tmp_path))
    assert stage_expand(args, tmp_path, log=lambda *a: None, expand=expand) == 1
    relabelled = [rows[0], {**rows[1], "inspector": {"pass": "false", "answer": "12 m"}}]
    write_jsonl_atomic(tmp_path / "labels-inspector.jsonl", relabelled)
    render = BuildDataArgs(stage="render", out=str(tmp_path), variant="inspector", inspector_expanded=True)
    with pytest.raises(ValueError, match=r"1 FAIL example\(s\) have no expanded answer for their short answer"):
        stage_render(render, tmp_path, log=lambda *a: None)
    assert stage_expand(args, tmp_path, log=lambda *a: None, expand=expand) == 1 and asked == ["10 m", "12 m"]
    assert stage_expand(args, tmp_path, log=lambda *a: None, expand=expand) == 0
    stage_render(render, tmp_path, log=lambda *a: None)
    rendered = "\n".join(json.dumps(r) for r in read_jsonl(tmp_path / "inspector.train.jsonl"))
    assert "Tower 1 is 12 m tall." in rendered and "10 m tall" not in rendered


@pytest.mark.parametrize(
    "device,dtype,loaded",
    [(None, "auto", ("cuda:0", None)), ("cpu", "auto", ("cpu", None)), ("cuda:1", "bf16", ("cuda:1", "bf16"))],
)
def test_a_local_expander_loads_on_this_processs_device_unless_told(device, dtype, loaded, monkeypatch):
    """``--expander MODEL`` without ``--device`` loaded the text LLM on the CPU (in fp32) on a GPU machine, where
    every other model of the gate data takes this process's own device."""
    import common.placement
    import gate.train.answer_expansion as expansion

    monkeypatch.setattr(common.placement, "process_device", lambda: "cuda:0")  # a machine with a GPU
    calls = []
    monkeypatch.setattr(expansion, "replier", lambda *a, **k: calls.append(k) or (lambda users: []))
    args = BuildDataArgs(stage="expand", out="unused", expander="local-llm", device=device, dtype=dtype)
    expansion.expander(args, expansion.EXPANSION_PROMPT)
    assert [(k["device"], k["dtype"]) for k in calls] == [loaded]


@pytest.mark.parametrize(
    "flags,refused",
    [
        ({}, True),
        ({"expander_url": "http://x"}, True),  # an endpoint needs its model's name
        ({"expander_model": "m"}, True),
        ({"expander_url": "http://x", "expander_model": "m"}, False),
        ({"expander": "local-llm"}, False),
    ],
)
def test_expand_needs_an_endpoint_and_its_model_or_a_local_model(flags, refused, tmp_path, monkeypatch):
    import gate.train.answer_expansion as expansion

    args = BuildDataArgs(stage="expand", out=str(tmp_path), **flags)
    with pytest.raises(ValueError, match=r"labels-inspector.jsonl does not exist \(run --stage label --variant insp"):
        stage_expand(args, tmp_path, log=lambda *a: None)
    write_jsonl_atomic(tmp_path / "labels-inspector.jsonl", label_rows(2))  # q1 FAIL
    monkeypatch.setattr(expansion, "replier", lambda *a, **k: lambda users: ['{"expanded_answer": "It is 10 m."}'])
    if refused:
        with pytest.raises(ValueError, match="expand: give --expander_url and --expander_model .* or --expander"):
            stage_expand(args, tmp_path, log=lambda *a: None)
    else:
        assert stage_expand(args, tmp_path, log=lambda *a: None) == 1


def test_nothing_left_to_expand_loads_no_model(tmp_path, monkeypatch):
    import gate.train.answer_expansion as expansion

    write_jsonl_atomic(tmp_path / "labels-inspector.jsonl", label_rows(1))  # q0 PASS only
    monkeypatch.setattr(expansion, "replier", lambda *a, **k: pytest.fail("a model was loaded"))
    args = BuildDataArgs(stage="expand", out=str(tmp_path), expander="local-llm")
    assert stage_expand(args, tmp_path, log=lambda *a: None) == 0
