"""gate.train.build_data: sample → judge → label, resumable per question id, polarity of the labels."""

import json

import pytest

from gate.train.build_data import BuildDataArgs, build, stage_sample

QUIET = dict(log=lambda *a: None)


def canned(answers_by_question):
    """A stand-in generator: for each question, cycles through the given answers."""
    counters = {}

    def generate(images, questions, sample):
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
    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")]
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
    with pytest.raises(ValueError, match=r"other settings \(samples: 4 then, 5 now\)"):  # R = 5 is not mixed in
        stage_sample(BuildDataArgs(stage="sample", **{**args, "samples": 5}), tmp_path / "d", generate=gen, **QUIET)
    # another batch size draws other samples; a question file made again (a corrected gold, another draw) is another
    # input: neither is mixed in (the new file's questions joined the old ones' samples)
    with pytest.raises(ValueError, match=r"other settings \(batch_size: 1 then, 2 now\)"):
        stage_sample(BuildDataArgs(stage="sample", **{**args, "batch_size": 2}), tmp_path / "d", generate=gen, **QUIET)
    original = path.read_text()
    path.write_text(original.replace(json.dumps(known["answers"][0]), json.dumps("corrected")))
    with pytest.raises(ValueError, match=r"other settings \(queries: 'sha256:"):
        stage_sample(BuildDataArgs(stage="sample", **args), tmp_path / "d", generate=gen, **QUIET)
    path.write_text(original)
    samples = [json.loads(x) for x in open(tmp_path / "d" / "samples.jsonl", encoding="utf-8")]
    assert [len(s["samples"]) for s in samples] == [4, 4]

    assert build(BuildDataArgs(stage="judge", out=str(tmp_path / "d"), judge="exact"), **QUIET) == 2
    another_judge = r"other settings \(exact_rule: 2 then, None now; judge: 'exact' then, 'token' now\)"
    with pytest.raises(ValueError, match=another_judge):
        build(BuildDataArgs(stage="judge", out=str(tmp_path / "d"), judge="token"), **QUIET)
    judged = {r["id"]: r["scores"] for r in map(json.loads, open(tmp_path / "d" / "judged.jsonl", encoding="utf-8"))}
    assert judged[known["id"]] == [5.0] * 4 and judged[unknown["id"]] == [1.0] * 4

    labels = {}
    for variant in ["hkb", "skb", "kbm-acc", "kbm-cert"]:
        build(BuildDataArgs(stage="label", out=str(tmp_path / "d"), variant=variant), **QUIET)
        labels[variant] = {
            r["id"]: r for r in map(json.loads, open(tmp_path / "d" / f"labels-{variant}.jsonl", encoding="utf-8"))
        }
    # the model knows the first question: no search; it does not know the second: search
    assert labels["hkb"][known["id"]]["search"] is False and labels["hkb"][unknown["id"]]["search"] is True
    assert labels["skb"][known["id"]]["search_score"] == 1.0 and labels["skb"][unknown["id"]]["search_score"] == 5.0
    assert labels["kbm-acc"][known["id"]]["search"] is False and labels["kbm-acc"][unknown["id"]]["search"] is True
    assert labels["kbm-cert"][known["id"]]["certainty"] == 1.0 and labels["kbm-cert"][known["id"]]["search"] is False
    # two answers twice each among four samples: C = 1 − log 2 / log 4
    assert labels["kbm-cert"][unknown["id"]]["certainty"] == pytest.approx(0.5)
    assert labels["kbm-cert"][unknown["id"]]["search"] is True


def test_sample_with_a_real_tiny_vlm(questions, tiny_world, tiny_refiner, tmp_path):
    path, picked = questions
    n = build(
        BuildDataArgs(
            stage="sample",
            queries=str(path),
            images_root=str(tiny_world),
            model=str(tiny_refiner),
            out=str(tmp_path / "d"),
            samples=3,
            max_new_tokens=8,
        ),
        **QUIET,
    )
    rows = [json.loads(x) for x in open(tmp_path / "d" / "samples.jsonl", encoding="utf-8")]
    assert n == 2 and [r["id"] for r in rows] == [p["id"] for p in picked]
    assert all(len(r["samples"]) == 3 and all(isinstance(s, str) for s in r["samples"]) for r in rows)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(stage="nope", out="x"), "--stage: 'nope' is not one of sample, judge"),
        (dict(out="x"), "--stage is required"),
        (dict(stage="label", out="X", variant="odd"), "--variant: 'odd' is not one of hkb, skb"),
        (dict(stage="render", out="X"), "--stage render needs --variant"),
        (
            dict(stage="label", out="X", variant="mct", mct_rule="vote"),
            "--mct_rule: 'vote' is not one of srt, gold-entity",
        ),
        (dict(stage="label", out="X", variant="ret", alone_rule="vote"), "--alone_rule: 'vote' is not one of greedy"),
        (dict(stage="render", out="X", variant="skb", skb_target="floor"), "--skb_target: 'floor' is not one of"),
        (dict(stage="judge", out="X"), "run --stage sample first"),
        (dict(stage="sample", out="X", queries="/none.jsonl"), "--queries"),
        (dict(stage="judge", out="X", judge="vibes"), "unknown judge"),
        (dict(stage="judge", out="X", judge="llm"), "--judge_url"),
        (dict(stage="retrieve", out="X", queries="/none.jsonl", index="/none"), "--index"),
        (dict(stage="label", out="X", variant="srt"), "run the earlier stages first"),
        (dict(stage="render", out="X", variant="hkb"), "--stage label --variant hkb"),
        (dict(stage="sample", out="X", k=0), "must be positive"),
        (dict(stage="sample", out="X", samples=0), "--samples, --batch_size and --k must be positive"),
        (dict(stage="judge", out="X", batch_size=-1), "--samples, --batch_size and --k must be positive"),
        (dict(stage="judge", out="X", batch_size=0), "--samples, --batch_size and --k must be positive"),
        (dict(stage="label", out="X", variant="hkb", samples=1, batch_size=1, k=1), "run the earlier stages first"),
        (dict(stage="judge", out=None), "--out is required"),
        # off their scales, every question got one label (an ε of 30 on the judge's 1–5 scores: all "search")
        (dict(stage="label", out="X", variant="hkb", epsilon=30), r"--epsilon must lie in \[1, 5\], got 30"),
        (dict(stage="label", out="X", variant="ret", correct_score=9), r"--correct_score must lie in \[1, 5\]"),
        (dict(stage="label", out="X", variant="kbm-acc", tau=5), r"--tau must lie in \[0, 1\], got 5"),
        (dict(stage="consistency", out="X", mct_gamma=-0.5), r"--mct_gamma must lie in \[0, 1\]"),
        (dict(stage="label", out="X", variant="mct", mct_negative_ratio=2), r"--mct_negative_ratio must lie in"),
        (dict(stage="label", out="X", variant="mct", mct_negative_ratio=1.2), r"--mct_negative_ratio must lie in"),
        # every setting at an end of its scale is taken: the stage then finds no earlier stage's file
        (
            dict(stage="label", out="X", variant="hkb", epsilon=5, correct_score=1, tau=1, mct_gamma=0),
            "run the earlier stages first",
        ),
        (
            dict(stage="label", out="X", variant="kbm-acc", epsilon=1, correct_score=5, tau=0, mct_negative_ratio=1),
            "run the earlier stages first",
        ),
        (dict(stage="label", out="X", variant="hkb", mct_gamma=1, mct_negative_ratio=0), "run the earlier stages"),
    ],
)
def test_bad_input(kw, match, tmp_path):
    kw = {**kw, "out": kw["out"] and str(tmp_path / kw["out"])}
    with pytest.raises(ValueError, match=match):
        build(BuildDataArgs(**kw), **QUIET)


def test_sample_and_judge_resume_after_an_interruption(questions, tiny_world, tmp_path, monkeypatch):
    path, picked = questions
    calls = []

    def dies_on_second_batch(images, texts, sample):  # two calls a batch: R samples, then one greedy answer
        calls.append(len(texts))
        if len(calls) == 3:
            raise RuntimeError("killed")
        return ["red"] * len(texts)

    args = BuildDataArgs(
        stage="sample", queries=str(path), images_root=str(tiny_world), out=str(tmp_path / "d"), samples=3, batch_size=1
    )
    with pytest.raises(RuntimeError, match="^killed$"):
        stage_sample(args, tmp_path / "d", generate=dies_on_second_batch, **QUIET)
    part = tmp_path / "d" / "samples.jsonl.part0"  # this process's part, merged when the stage finishes
    assert [json.loads(x)["id"] for x in open(part, encoding="utf-8")] == [picked[0]["id"]]
    assert stage_sample(args, tmp_path / "d", generate=lambda i, t, s: ["blue"] * len(t), **QUIET) == 1
    rows = [json.loads(x) for x in open(tmp_path / "d" / "samples.jsonl", encoding="utf-8")]
    assert [r["id"] for r in rows] == [p["id"] for p in picked] and rows[0]["samples"] == ["red"] * 3

    import gate.train.build_data as build_data  # where the judge stage calls judge_all

    real, seen = build_data.judge_all, []

    def judge_dies(batch, judge, cache):
        seen.append(len(batch))
        if len(seen) == 1:
            raise RuntimeError("endpoint died")
        return real(batch, judge, cache)

    monkeypatch.setattr(build_data, "judge_all", judge_dies)
    with pytest.raises(RuntimeError, match="^endpoint died$"):
        build(BuildDataArgs(stage="judge", out=str(tmp_path / "d")), **QUIET)
    assert (
        not (tmp_path / "d" / "judged.jsonl").exists()
        or not open(tmp_path / "d" / "judged.jsonl", encoding="utf-8").read()
    )
    assert build(BuildDataArgs(stage="judge", out=str(tmp_path / "d")), **QUIET) == 2
    assert build(BuildDataArgs(stage="judge", out=str(tmp_path / "d")), **QUIET) == 0


def test_retrieve_context_and_the_retrieval_labels(questions, tiny_world, tiny_index_dir, tiny_index, tmp_path):
    path, picked = questions
    out = tmp_path / "d"
    common = dict(queries=str(path), images_root=str(tiny_world), out=str(out), samples=2, k=3, alpha=0.5)
    gold = {p["question"]: p["answers"][0] for p in picked}
    # alone: the first question right, the second wrong; with a section in context: right only for the gold section
    stage_sample(
        BuildDataArgs(stage="sample", **common),
        out,
        generate=lambda i, t, s: [gold[t[0]] if t[0] == picked[0]["question"] else "no idea"] * len(t),
        **QUIET,
    )
    build(BuildDataArgs(stage="judge", out=str(out)), **QUIET)
    from gate.pipeline.context import stage_context, stage_retrieve

    assert (
        stage_retrieve(
            BuildDataArgs(stage="retrieve", index=str(tiny_index_dir), **common), out, index=tiny_index, **QUIET
        )
        == 2
    )
    retrieved = {r["id"]: r for r in map(json.loads, open(out / "retrieved.jsonl", encoding="utf-8"))}
    with pytest.raises(ValueError, match=r"other settings \(k: 3 then, 5 now\)"):  # 5 hits beside 3 are not mixed
        stage_retrieve(
            BuildDataArgs(stage="retrieve", index=str(tiny_index_dir), **{**common, "k": 5}), out, index=tiny_index
        )
    entity_of_text = {}
    for r in retrieved.values():
        assert len(r["hits"]) == 3 and r["query"] == r["question"] and r["alpha"] == 0.5
        assert r["gold_rank"] is None or r["gold_rank"] >= 1
        entity_of_text.update({h["text"]: h["entity_id"] for h in r["hits"]})
    answers = {p["id"]: p for p in picked}

    def reads_context(images, texts, sample):
        out_ = []
        for t in texts:
            context, question = t[len("Context: ") :].split("\nQuestion: ")
            mine = [p for p in picked if p["question"] == question][0]
            right = any(
                h["entity_id"] == mine["entity_id"] and h["text"] in context for h in retrieved[mine["id"]]["hits"]
            )
            out_.append(mine["answers"][0] if right else "no idea")
        return out_

    assert stage_context(BuildDataArgs(stage="context", **common), out, generate=reads_context, **QUIET) == 2
    with pytest.raises(ValueError, match=r"other settings \(max_new_tokens: 32 then, 8 now\)"):
        stage_context(BuildDataArgs(stage="context", **common, max_new_tokens=8), out, generate=reads_context)
    labels = {}
    for variant in ("ret", "srt", "mct", "inspector"):
        build(BuildDataArgs(stage="label", out=str(out), variant=variant, mct_rule="gold-entity"), **QUIET)
        labels[variant] = list(map(json.loads, open(out / f"labels-{variant}.jsonl", encoding="utf-8")))
    known, unknown = picked
    assert {r["id"]: r["search"] for r in labels["ret"]} == {known["id"]: False, unknown["id"]: True}
    for r in labels["srt"]:  # Rel only where the section turned the wrong answer right (the gold entity's)
        qid, j = r["id"].split("#d")
        hit = retrieved[qid]["hits"][int(j) - 1]
        assert r["relevant"] == (qid == unknown["id"]) and (hit["entity_id"] == answers[qid]["entity_id"]) == (
            qid == unknown["id"]
        )
    for r in labels["mct"]:
        hits = retrieved[r["id"]]["hits"]
        assert r["consistent"] == [j + 1 for j, h in enumerate(hits) if h["entity_id"] == answers[r["id"]]["entity_id"]]
    for r in labels["inspector"]:
        assert r["pass"] == (retrieved[r["id"]]["hits"][0]["entity_id"] == answers[r["id"]]["entity_id"])
    build(BuildDataArgs(stage="render", out=str(out), variant="inspector"), **QUIET)
    rendered = list(map(json.loads, open(out / "inspector.test.jsonl", encoding="utf-8")))
    assert len(rendered) == 2 and all(r["prompt"][1]["content"].startswith("Context: ") for r in rendered)

    # MCT (Algorithm 3): without an srt gate, a document is relevant when the answer with it was judged right — here
    # the gold entity's only, so no question has two relevant documents and mct has no example
    from gate.pipeline.consistency import stage_consistency

    summaries = []

    def summarise(images, texts, sample):
        summaries.extend(texts)
        return ["they agree"] * len(texts)

    cons_args = BuildDataArgs(stage="consistency", out=str(out), mct_negative_ratio=0.0)
    assert stage_consistency(cons_args, out, summarise=summarise, **QUIET) == 2
    cons = {r["id"]: r for r in map(json.loads, open(out / "consistency.jsonl", encoding="utf-8"))}
    for qid, r in cons.items():
        assert (
            r["rel_probs"]
            == [1.0 if h["entity_id"] == answers[qid]["entity_id"] else 0.0 for h in retrieved[qid]["hits"]]
            and r["summary"] is None
        )
    assert summaries == []
    with pytest.raises(ValueError, match=r"other settings \(mct_gamma: 0.5 then, 0.7 now"):  # other relevance: refused
        stage_consistency(BuildDataArgs(**{**cons_args.__dict__, "mct_gamma": 0.7}), out, summarise=summarise, **QUIET)
    # an srt gate that finds two relevant documents for one question: summary of those two, then the label
    (out / "consistency.jsonl").unlink()
    assert (
        stage_consistency(
            cons_args,
            out,
            summarise=summarise,
            relevance=lambda images, batch: [
                [0.6, 0.1, 0.9] if r["id"] == unknown["id"] else [0.9, 0.1, 0.1] for r in batch
            ],
            **QUIET,
        )
        == 2
    )
    (text,) = summaries
    hits = retrieved[unknown["id"]]["hits"]
    assert f"[1] {hits[0]['title']}" in text and f"[2] {hits[2]['title']}" in text and hits[1]["title"] not in text
    (out / "labels-mct.jsonl").unlink()  # the gold-entity rule's labels above
    build(BuildDataArgs(stage="label", out=str(out), variant="mct", mct_negative_ratio=0.0), **QUIET)
    (label,) = map(json.loads, open(out / "labels-mct.jsonl", encoding="utf-8"))
    shown = [line.split("] ", 1)[1] for line in label["context"].split("\n")]
    assert label["id"] == unknown["id"] and label["summary"] == "they agree" and len(shown) == 2
    # labelled at another γ, the relevant documents would not be the ones the summaries cover
    with pytest.raises(ValueError, match=r"made with γ = 0.5 .* --mct_gamma is 0.3"):
        build(BuildDataArgs(stage="label", out=str(out), variant="mct", mct_gamma=0.3), **QUIET)
    assert shown[label["consistent"][0] - 1].startswith(hits[2]["title"])  # P(Rel) 0.9 first


def test_retrieved_sections_of_an_index_built_again_at_the_same_path_are_not_resumed(
    questions, tiny_world, tiny_index_dir, tiny_index, tmp_path
):
    """retrieved.jsonl recorded its index by path: built again there (another KB, other encoders), the hits of the
    old index were resumed beside the new one's, and every later stage (context, labels) read them."""
    import shutil

    from gate.pipeline.context import stage_retrieve

    path, _ = questions
    index = tmp_path / "index"  # a copy: the shared index stays as it is
    shutil.copytree(tiny_index_dir, index)
    args = BuildDataArgs(
        stage="retrieve", index=str(index), queries=str(path), images_root=str(tiny_world), out=str(tmp_path / "d"),
        k=2, alpha=0.5,
    )  # fmt: skip
    stage_retrieve(args, tmp_path / "d", index=tiny_index, **QUIET)
    assert stage_retrieve(args, tmp_path / "d", index=tiny_index, **QUIET) == 0  # the same index: resumed
    manifest = json.loads((index / "manifest.json").read_text())
    (index / "manifest.json").write_text(json.dumps({**manifest, "built_again": True}))
    with pytest.raises(ValueError, match=r"other settings \(index_files: "):
        stage_retrieve(args, tmp_path / "d", index=tiny_index, **QUIET)


def test_vllm_sampling_backend_without_vllm_is_a_clear_error(questions, tiny_world, tiny_gate_vlm, tmp_path):
    path, _ = questions
    args = BuildDataArgs(
        stage="sample",
        queries=str(path),
        images_root=str(tiny_world),
        model=str(tiny_gate_vlm),
        out=str(tmp_path / "d"),
        backend="vllm",
    )
    with pytest.raises(ValueError, match="needs vLLM"):
        build(args, **QUIET)
    with pytest.raises(ValueError, match="--backend: 'tgi' is not one of hf, vllm"):
        build(BuildDataArgs(stage="sample", out=str(tmp_path / "d"), backend="tgi"), **QUIET)


def test_answerable_without_retrieval_by_the_greedy_answer_or_the_sampled_majority(tmp_path):
    """MMKB-RAG's RET/SRT labels read the VLM's one greedy answer; the sampled-majority rule is the option. Here the
    greedy answer is right but most samples are wrong, so the two rules disagree."""
    from gate.train.labelling import label_records

    rec = {
        "id": "q1",
        "question": "What does it eat?",
        "answers": ["seeds"],
        "samples": ["x", "y", "seeds"],
        "scores": [1.0, 1.0, 5.0],
        "greedy": "seeds",
        "greedy_score": 5.0,
    }
    ctx = {
        "q1": {
            "hits": [{"entity_id": "E1", "title": "t", "section_title": "s", "text": "It eats seeds."}],
            "doc_scores": [1.0],
        }
    }
    greedy = BuildDataArgs(stage="label", out=str(tmp_path), alone_rule="greedy")
    majority = BuildDataArgs(stage="label", out=str(tmp_path), alone_rule="sampled-majority")
    assert label_records("ret", rec, greedy) == [{"search": False}]  # answered right: NoRet
    assert label_records("ret", rec, majority) == [{"search": True}]  # mostly wrong: Ret
    # the document turns a right (greedy) answer wrong: NoRel; under the majority rule it changes nothing: no pair
    assert [r["relevant"] for r in label_records("srt", rec, greedy, ctx)] == [False]
    assert label_records("srt", rec, majority, ctx) == []
    with pytest.raises(ValueError, match="alone_rule"):
        label_records("ret", {k: v for k, v in rec.items() if k != "greedy_score"}, greedy)


def test_sample_and_judge_record_the_greedy_answer(questions, tiny_world, tmp_path):
    path, picked = questions

    def generate(images, texts, sample):
        return ["red" if sample else picked[0]["answers"][0]] * len(texts)

    out = tmp_path / "d"
    stage_sample(
        BuildDataArgs(
            stage="sample", queries=str(path), images_root=str(tiny_world), out=str(out), samples=2, batch_size=2
        ),
        out,
        generate=generate,
        **QUIET,
    )
    rows = [json.loads(x) for x in open(out / "samples.jsonl", encoding="utf-8")]
    assert [r["greedy"] for r in rows] == [picked[0]["answers"][0]] * 2 and rows[0]["samples"] == ["red", "red"]
    build(BuildDataArgs(stage="judge", out=str(out)), **QUIET)
    judged = {r["id"]: r for r in map(json.loads, open(out / "judged.jsonl", encoding="utf-8"))}
    assert judged[picked[0]["id"]]["greedy_score"] == 5.0 and judged[picked[1]["id"]]["greedy_score"] == 1.0


def test_questions_without_gold_answers_are_not_judged(questions, tiny_world, tmp_path):
    """Nothing to judge against (a question with neither answers nor answer_eval): no judge call, scores None, so
    only kbm-cert labels it."""
    path, picked = questions
    rows = [{**picked[0], "answers": [], "answer_eval": None}, picked[1]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "d"
    stage_sample(
        BuildDataArgs(stage="sample", queries=str(path), images_root=str(tiny_world), out=str(out), samples=3),
        out,
        generate=lambda images, texts, sample: ["red"] * len(texts),
        **QUIET,
    )
    asked = []

    class Judge:
        def score(self, question, answer, golds, answer_eval=None, question_type=None):
            asked.append(question)
            return 1.0

    from gate.train.build_data import stage_judge

    args = BuildDataArgs(stage="judge", out=str(out))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("gate.train.build_data.judge_from_args", lambda a: Judge())
        stage_judge(args, out, **QUIET)
    judged = {r["id"]: r for r in map(json.loads, open(out / "judged.jsonl", encoding="utf-8"))}
    assert asked == [picked[1]["question"]]  # its samples and greedy answer are all "red": judged once
    assert judged[picked[0]["id"]]["scores"] == [None] * 3 and judged[picked[0]["id"]]["greedy_score"] is None
    assert judged[picked[1]["id"]]["scores"] == [1.0] * 3


def test_a_failed_judgement_and_answers_sampled_since_are_judged_again(tmp_path, monkeypatch):
    """A judgement that failed (the endpoint down: None) was written as done, and a resumed run skipped it for good;
    answers sampled anew (samples.jsonl made again) kept the old answers' scores. Both are judged again."""
    from common.files import read_jsonl, write_jsonl_atomic
    from gate.train.build_data import stage_judge

    samples = [
        {"id": "q0", "question": "Which bird?", "answers": ["wren"], "samples": ["wren", "crow"], "greedy": "wren"},
        {"id": "q1", "question": "Which tree?", "answers": ["oak"], "samples": ["oak", "elm"], "greedy": "oak"},
    ]
    write_jsonl_atomic(tmp_path / "samples.jsonl", samples)
    down = {"on": True}

    class Judge:
        failures = 0

        def score(self, question, answer, golds, answer_eval=None, question_type=None):
            if down["on"] and question == "Which bird?":
                return None  # its requests failed after their retries
            return 5.0 if answer in golds else 1.0

    monkeypatch.setattr("gate.train.build_data.judge_from_args", lambda a: Judge())
    args = BuildDataArgs(stage="judge", out=str(tmp_path))
    judged = lambda: {r["id"]: r for r in read_jsonl(tmp_path / "judged.jsonl")}  # noqa: E731
    assert stage_judge(args, tmp_path, **QUIET) == 2 and judged()["q0"]["scores"] == [None, None]
    down["on"] = False
    assert stage_judge(args, tmp_path, **QUIET) == 1  # q0 again
    assert judged()["q0"]["scores"] == [5.0, 1.0] and judged()["q0"]["greedy_score"] == 5.0 and len(judged()) == 2
    assert stage_judge(args, tmp_path, **QUIET) == 0
    write_jsonl_atomic(tmp_path / "samples.jsonl", [samples[0], {**samples[1], "samples": ["oak", "oak"]}])
    assert stage_judge(args, tmp_path, **QUIET) == 1 and judged()["q1"]["scores"] == [5.0, 5.0]


@pytest.mark.parametrize("variant", ["hkb", "skb", "kbm-acc", "ret"])
def test_a_question_with_an_unjudged_sample_gets_no_label(tmp_path, variant):
    """A reply the judge's parser cannot read is the same on every retry at temperature 0: labelled from the scores
    that survived (3 right of 10), the question read as known; its true mean, 2.2, says search."""
    from common.files import write_jsonl_atomic

    write_jsonl_atomic(
        tmp_path / "judged.jsonl",
        [
            {
                "id": "q0",
                "question": "Which river?",
                "answers": ["Rhine"],
                "samples": ["Rhine"] * 3 + ["Danube"] * 7,
                "scores": [5.0] * 3 + [None] * 7,
                "greedy": "Rhine",
                "greedy_score": 5.0,
            },
            {
                "id": "q1",
                "question": "Which tree?",
                "answers": ["oak"],
                "samples": ["oak", "elm"],
                "scores": [5, 1],
                "greedy": "oak",
                "greedy_score": 5.0,
            },
        ],
    )
    said = []
    build(BuildDataArgs(stage="label", out=str(tmp_path), variant=variant), log=said.append)
    assert [
        r["question_id"] for r in map(json.loads, open(tmp_path / f"labels-{variant}.jsonl", encoding="utf-8"))
    ] == ["q1"]
    assert "1 questions without a label (1 with a sampled answer the judge gave no score for" in said[-1]


def test_labels_follow_the_settings_of_the_latest_run(tmp_path):
    """The label stage relabels every question on every run: a rerun with another ε (or τ, or rule) changes the
    labels it should, never keeping those of the run before."""
    from common.files import write_jsonl_atomic

    write_jsonl_atomic(
        tmp_path / "judged.jsonl",
        [
            {"id": "q0", "question": "Which bird?", "answers": ["wren"], "samples": ["wren", "crow"], "scores": [5, 1]},
            {"id": "q1", "question": "Which tree?", "answers": ["oak"], "samples": ["oak", "oak"], "scores": [5, 5]},
        ],
    )

    def labels(**kw):
        build(BuildDataArgs(stage="label", out=str(tmp_path), variant="hkb", **kw), **QUIET)
        return {r["id"]: r["search"] for r in map(json.loads, open(tmp_path / "labels-hkb.jsonl", encoding="utf-8"))}

    assert labels(epsilon=3.0) == {"q0": False, "q1": False}  # mean 3 is not below 3
    assert labels(epsilon=4.0) == {"q0": True, "q1": False}  # mean 3 is below 4
    assert labels(epsilon=3.0) == {"q0": False, "q1": False}


def test_judged_relevance_refuses_contexts_that_do_not_match_the_retrieval():
    """MCT's relevance from judged answers: each retrieved section's answer judged right is relevant; a question with
    no contexts, or contexts of another retrieval (another number of sections), is named, not taken as "nothing is
    relevant"."""
    from gate.pipeline.consistency import judged_relevance
    from gate.pipeline.context import hits_digest

    hits = [{"text": t} for t in "abc"]
    contexts = {
        "q0": {"doc_scores": [4.0, 3.9, None], "hits_digest": hits_digest(hits)},  # right: a score ≥ correct_score
        "q1": {"doc_scores": [5.0]},
        "q3": {"doc_scores": [5.0, 5.0, 5.0], "hits_digest": hits_digest([{"text": t} for t in "abd"])},
    }
    relevance = judged_relevance(contexts, 4.0)
    assert relevance(None, [{"id": "q0", "hits": hits}]) == [[1.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match=r"answers for other sections \(1\) for question q1, which has 3 retrieved"):
        relevance(None, [{"id": "q1", "hits": hits}])
    with pytest.raises(ValueError, match="has none for question q2"):
        relevance(None, [{"id": "q2", "hits": hits}])
    with pytest.raises(ValueError, match=r"other sections \(3\) for question q3"):  # as many, but not these
        relevance(None, [{"id": "q3", "hits": hits}])


def test_consistency_is_made_again_for_sections_retrieved_since_and_label_refuses_stale_records(tiny_world, tmp_path):
    """consistency.jsonl kept the P(Rel) and summary of an earlier retrieval's sections when retrieve ran again (same
    k), and label mct joined them to the new sections' texts: such a record is made again, and label refuses one."""
    from common.files import read_jsonl, write_jsonl_atomic
    from gate.pipeline.consistency import stage_consistency

    image = str(next((tiny_world / "images").glob("*.png")))
    hit = lambda text: {"title": "T", "section_title": "S", "text": text, "entity_id": "E1", "section": 0}  # noqa: E731
    retrieved = [
        {"id": "q0", "question": "Which?", "answers": ["red"], "image_path": image, "hits": [hit(t) for t in "abc"]}
    ]
    write_jsonl_atomic(tmp_path / "retrieved.jsonl", retrieved)
    asked = []

    def summarise(images, texts, sample):
        assert sample is False  # a summary is the MLLM's greedy one
        asked.extend(texts)
        return [f"summary {len(asked)}"] * len(texts)

    args = BuildDataArgs(stage="consistency", out=str(tmp_path), model="stub", mct_negative_ratio=0.0)
    relevance = lambda images, batch: [[0.5, 0.8, 0.1] for _ in batch]  # noqa: E731  (relevant: P(Rel) ≥ γ = 0.5)
    run = lambda: stage_consistency(args, tmp_path, relevance=relevance, summarise=summarise, **QUIET)  # noqa: E731
    assert run() == 1 and run() == 0 and len(asked) == 1
    assert asked[0] == "Documents:\n[1] T - S: a\n[2] T - S: b\nQuestion: Which?"  # the relevant ones, numbered
    with pytest.raises(ValueError, match=r"other settings \(mct_gamma: 0.5 then, 0.6 now"):
        stage_consistency(BuildDataArgs(**{**args.__dict__, "mct_gamma": 0.6}), tmp_path, relevance=relevance, **QUIET)
    write_jsonl_atomic(tmp_path / "retrieved.jsonl", [{**retrieved[0], "hits": [hit(t) for t in "dbc"]}])
    stale = list(read_jsonl(tmp_path / "consistency.jsonl"))
    assert run() == 1 and "T - S: d" in asked[-1]
    (made,) = read_jsonl(tmp_path / "consistency.jsonl")
    assert made["summary"] == "summary 2"
    build(BuildDataArgs(stage="label", out=str(tmp_path), variant="mct", mct_negative_ratio=0.0), **QUIET)
    (label,) = read_jsonl(tmp_path / "labels-mct.jsonl")
    assert label["summary"] == "summary 2" and "T - S: d" in label["context"]
    write_jsonl_atomic(tmp_path / "consistency.jsonl", stale)
    with pytest.raises(ValueError, match=r"made 1 question\(s\) \(first: q0\) for other sections"):
        build(BuildDataArgs(stage="label", out=str(tmp_path), variant="mct", mct_negative_ratio=0.0), **QUIET)


def test_a_question_qualifies_for_a_summary_with_more_than_one_relevant_section(tiny_world, tmp_path):
    from common.files import read_jsonl, write_jsonl_atomic
    from gate.pipeline.consistency import stage_consistency

    image = str(next((tiny_world / "images").glob("*.png")))
    hits = [{"title": "T", "section_title": "S", "text": t, "entity_id": "E1", "section": 0} for t in "abc"]
    write_jsonl_atomic(
        tmp_path / "retrieved.jsonl",
        [{"id": q, "question": "Which?", "image_path": image, "hits": hits} for q in ("two", "one", "none")],
    )
    probs = {"two": [0.5, 0.8, 0.1], "one": [0.9, 0.4999, 0.1], "none": [0.0, 0.2, 0.1]}  # γ = 0.5
    stage_consistency(
        BuildDataArgs(stage="consistency", out=str(tmp_path), model="stub"),
        tmp_path,
        relevance=lambda images, batch: [probs[r["id"]] for r in batch],
        summarise=lambda images, texts, sample: ["both say so"] * len(texts),
        **QUIET,
    )
    made = {r["id"]: r for r in read_jsonl(tmp_path / "consistency.jsonl")}
    assert {q: r["summary"] for q, r in made.items()} == {"two": "both say so", "one": None, "none": None}
    assert {q: r["rel_probs"] for q, r in made.items()} == probs


def test_the_consistency_stage_names_what_it_lacks(tiny_world, tmp_path):
    from common.files import read_jsonl, write_jsonl_atomic
    from gate.pipeline.consistency import stage_consistency
    from gate.pipeline.context import hits_digest

    def stage(**kw):
        return stage_consistency(BuildDataArgs(stage="consistency", out=str(tmp_path), **kw), tmp_path, **QUIET)

    with pytest.raises(ValueError, match="retrieved.jsonl does not exist \\(run --stage retrieve first\\)"):
        stage(model="m")
    write_jsonl_atomic(tmp_path / "retrieved.jsonl", [{"id": "q0", "question": "Which?", "hits": []}])
    with pytest.raises(ValueError, match="--model \\(the MLLM that writes the summaries\\) is required"):
        stage()
    with pytest.raises(ValueError, match="contexts.jsonl, which does not exist \\(run --stage context first"):
        stage(model="m")
    # with them, relevance is each section's judged answer (a score ≥ correct_score is right)
    image = str(next((tiny_world / "images").glob("*.png")))
    hits = [{"title": "T", "section_title": "S", "text": t} for t in "ab"]
    write_jsonl_atomic(
        tmp_path / "retrieved.jsonl", [{"id": "q0", "question": "Which?", "image_path": image, "hits": hits}]
    )
    write_jsonl_atomic(
        tmp_path / "contexts.jsonl", [{"id": "q0", "doc_scores": [1.0, 5.0], "hits_digest": hits_digest(hits)}]
    )
    summarise = lambda images, texts, sample: ["s"] * len(texts)  # noqa: E731
    args = BuildDataArgs(stage="consistency", out=str(tmp_path), model="m")
    assert stage_consistency(args, tmp_path, summarise=summarise, **QUIET) == 1
    (made,) = read_jsonl(tmp_path / "consistency.jsonl")
    assert (made["rel_probs"], made["relevance"], made["summary"]) == ([0.0, 1.0], "judged answers", None)


def test_context_answers_are_made_again_for_failed_judgements_and_sections_retrieved_since(
    tiny_world, tmp_path, monkeypatch
):
    """The context stage wrote a failed judgement (None) as done, and kept answers made for sections an earlier
    retrieval returned; label then joined those scores to the new sections' texts. Both are answered again, and
    label refuses contexts made for other sections, and srt halves judged by two judges."""
    from common.files import read_jsonl, write_json_atomic, write_jsonl_atomic
    from gate.pipeline.context import stage_context

    image = str(next((tiny_world / "images").glob("*.png")))
    hit = lambda text: {"title": "T", "section_title": "S", "text": text, "entity_id": "E1", "section": 0}  # noqa: E731
    retrieved = [
        {"id": "q0", "question": "Which?", "answers": ["red"], "image_path": image, "hits": [hit("a"), hit("b")]}
    ]
    write_jsonl_atomic(tmp_path / "retrieved.jsonl", retrieved)
    down, asked = {"on": True}, []

    class Judge:
        def score(self, question, answer, golds, answer_eval=None, question_type=None):
            return None if down["on"] else 5.0

    monkeypatch.setattr("gate.pipeline.context.judge_from_args", lambda a: Judge())
    args = BuildDataArgs(stage="context", out=str(tmp_path), model="stub")
    generate = lambda images, texts, sample: asked.extend(texts) or ["red"] * len(texts)  # noqa: E731
    assert stage_context(args, tmp_path, generate=generate, **QUIET) == 1
    down["on"] = False
    assert stage_context(args, tmp_path, generate=generate, **QUIET) == 1  # the failed judgements: again
    assert [r["doc_scores"] for r in read_jsonl(tmp_path / "contexts.jsonl")] == [[5.0, 5.0]]
    assert stage_context(args, tmp_path, generate=generate, **QUIET) == 0
    write_jsonl_atomic(tmp_path / "retrieved.jsonl", [{**retrieved[0], "hits": [hit("c"), hit("b")]}])
    write_jsonl_atomic(  # a stale contexts file, as the stage before this fix left it
        tmp_path / "stale.jsonl", list(read_jsonl(tmp_path / "contexts.jsonl"))
    )
    assert stage_context(args, tmp_path, generate=generate, **QUIET) == 1 and "T - S: c" in asked[-2]
    # label srt: the contexts of the earlier retrieval are refused, as are halves judged by two judges
    write_jsonl_atomic(
        tmp_path / "judged.jsonl",
        [{**retrieved[0], "samples": ["blue"], "scores": [1.0], "greedy": "blue", "greedy_score": 1.0}],
    )
    write_json_atomic(tmp_path / "judged.settings.json", {"judge": "exact", "judge_model": None})
    assert build(BuildDataArgs(stage="label", out=str(tmp_path), variant="srt"), **QUIET) == 2
    (tmp_path / "stale.jsonl").replace(tmp_path / "contexts.jsonl")
    with pytest.raises(ValueError, match=r"answered 1 question\(s\) \(first: q0\) with other sections"):
        build(BuildDataArgs(stage="label", out=str(tmp_path), variant="srt"), **QUIET)
    write_json_atomic(tmp_path / "judged.settings.json", {"judge": "llm", "judge_model": "m"})
    with pytest.raises(ValueError, match=r"judged by \{'judge': 'llm', 'judge_model': 'm'\} and contexts.jsonl by"):
        build(BuildDataArgs(stage="label", out=str(tmp_path), variant="srt"), **QUIET)
    # a record written before digests were kept, for three sections where two are retrieved now: made again
    legacy = {"id": "q0", "doc_answers": ["red"] * 3, "doc_scores": [5.0] * 3}
    write_jsonl_atomic(tmp_path / "contexts.jsonl", [legacy])
    assert stage_context(args, tmp_path, generate=generate, **QUIET) == 1
    assert [len(r["doc_scores"]) for r in read_jsonl(tmp_path / "contexts.jsonl")] == [2]


@pytest.mark.parametrize(
    "rec,again",
    [
        ({"judge": "exact", "scores": [5.0, None]}, True),  # a sample's judgement failed
        ({"judge": "exact", "scores": [5.0], "greedy": "x", "greedy_score": None}, True),  # the greedy answer's
        ({"judge": "exact", "scores": [5.0], "greedy": "x", "greedy_score": 4.0}, False),
        ({"judge": "exact", "scores": [1.0]}, False),  # sampled before the greedy answer was recorded
        ({"judge": None, "scores": [None, None], "greedy": "x", "greedy_score": None}, False),  # no gold: done
    ],
)
def test_judge_failed(rec, again):
    from gate.train.build_data import judge_failed

    assert judge_failed(rec) is again
