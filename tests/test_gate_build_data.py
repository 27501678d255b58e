"""gate.build_data: sample → judge → label, resumable per question id, polarity of the labels."""

import json

import pytest

from gate.build_data import BuildDataArgs, build, stage_sample

QUIET = dict(log=lambda *a: None)


def canned(answers_by_question):
    """A stand-in generator: for each question, cycles through the given answers."""
    counters = {}

    def generate(images, questions):
        out = []
        for q in questions:
            i = counters.get(q, 0)
            counters[q] = i + 1
            options = answers_by_question[q]
            out.append(options[i % len(options)])
        return out
    return generate


@pytest.fixture()
def questions(tiny_world, tmp_path):
    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl")]
    by_type = {}
    for r in rows:
        by_type.setdefault(r["question_type"], r)
    picked = list(by_type.values())[:2]
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in picked))
    return path, picked


def test_sample_judge_label_pipeline(questions, tiny_world, tmp_path):
    path, picked = questions
    known, unknown = picked  # the first always answers right, the second never
    gen = canned({known["question"]: [known["answers"][0]], unknown["question"]: ["no idea", "maybe rocks"]})
    args = dict(queries=str(path), images_root=str(tiny_world), out=str(tmp_path / "d"), samples=4, batch_size=1)
    assert stage_sample(BuildDataArgs(stage="sample", **args), tmp_path / "d", generate=gen, **QUIET) == 2
    assert stage_sample(BuildDataArgs(stage="sample", **args), tmp_path / "d", generate=gen, **QUIET) == 0  # resumed
    samples = [json.loads(x) for x in open(tmp_path / "d" / "samples.jsonl")]
    assert [len(s["samples"]) for s in samples] == [4, 4]

    assert build(BuildDataArgs(stage="judge", out=str(tmp_path / "d"), judge="exact"), **QUIET) == 2
    judged = {r["id"]: r["scores"] for r in map(json.loads, open(tmp_path / "d" / "judged.jsonl"))}
    assert judged[known["id"]] == [5.0] * 4 and judged[unknown["id"]] == [1.0] * 4

    labels = {}
    for variant in ["hkb", "skb", "kbm-acc", "kbm-cert"]:
        build(BuildDataArgs(stage="label", out=str(tmp_path / "d"), variant=variant), **QUIET)
        labels[variant] = {r["id"]: r for r in map(json.loads, open(tmp_path / "d" / f"labels-{variant}.jsonl"))}
    # the model knows the first question: no search; it does not know the second: search
    assert labels["hkb"][known["id"]]["search"] == "false" and labels["hkb"][unknown["id"]]["search"] == "true"
    assert labels["skb"][known["id"]]["search_score"] == 1.0 and labels["skb"][unknown["id"]]["search_score"] == 5.0
    assert labels["kbm-acc"][known["id"]]["search"] is False and labels["kbm-acc"][unknown["id"]]["search"] is True
    assert labels["kbm-cert"][known["id"]]["certainty"] == 1.0 and labels["kbm-cert"][known["id"]]["search"] is False
    assert labels["kbm-cert"][unknown["id"]]["certainty"] == 0.0 and labels["kbm-cert"][unknown["id"]]["search"] is True


def test_sample_with_a_real_tiny_vlm(questions, tiny_world, tiny_refiner, tmp_path):
    path, picked = questions
    n = build(BuildDataArgs(stage="sample", queries=str(path), images_root=str(tiny_world), model=str(tiny_refiner),
                            out=str(tmp_path / "d"), samples=3, max_new_tokens=8), **QUIET)
    rows = [json.loads(x) for x in open(tmp_path / "d" / "samples.jsonl")]
    assert n == 2 and [r["id"] for r in rows] == [p["id"] for p in picked]
    assert all(len(r["samples"]) == 3 and all(isinstance(s, str) for s in r["samples"]) for r in rows)


@pytest.mark.parametrize("kw,match", [
    (dict(stage="nope", out="x"), "--stage"),
    (dict(stage="label", out="X", variant="odd"), "--variant"),
    (dict(stage="judge", out="X"), "run --stage sample first"),
    (dict(stage="sample", out="X", queries="/none.jsonl"), "--queries"),
    (dict(stage="judge", out="X", judge="vibes"), "run --stage sample first"),
])
def test_bad_input(kw, match, tmp_path):
    kw = {**kw, "out": str(tmp_path / kw["out"])}
    with pytest.raises(ValueError, match=match):
        build(BuildDataArgs(**kw), **QUIET)
