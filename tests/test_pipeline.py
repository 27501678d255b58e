"""gate.pipeline on the toy world with tiny models for every stage: stages on and off, baselines, resume after an
interruption, missing images, failing endpoints, and models that are missing."""

import dataclasses
import json
import re
import runpy
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from common.files import read_jsonl, write_json_atomic, write_jsonl_atomic
from gate.pipeline.arguments import PipelineArgs
from gate.pipeline.run import run

QUIET = dict(log=lambda *a: None)


@pytest.fixture(scope="module")
def gates(tiny_gate_vlm, tmp_path_factory):
    """Untrained tiny gates (real models, random decisions) for the boundary, Inspector and srt stages."""
    from gate.scoring import GATE_FILE

    root = tmp_path_factory.mktemp("gates")
    out = {}
    for variant in ("hkb", "inspector", "srt", "mct"):
        shutil.copytree(tiny_gate_vlm, root / variant)
        write_json_atomic(root / variant / GATE_FILE, {"variant": variant})
        out[variant] = str(root / variant)
    return out


@pytest.fixture()
def queries(tiny_world, tmp_path):
    from toy.gates import gate_questions

    rows = gate_questions(list(read_jsonl(tiny_world / "test.jsonl")), 3, seed=0)  # 3 knowledge + 3 attribute
    path = tmp_path / "q.jsonl"
    write_jsonl_atomic(path, rows)
    return path, rows


def args_for(queries, tiny_world, tiny_index_dir, tiny_gate_vlm, tmp_path, **kw):
    base = dict(
        queries=str(queries[0]),
        images_root=str(tiny_world),
        out=str(tmp_path / "out"),
        gate="always",
        answerer=str(tiny_gate_vlm),
        refiner="none",
        index=str(tiny_index_dir),
        alpha=0.5,
        k=3,
        generator=str(tiny_gate_vlm),
        generator_image=True,
        generator_prompt="toy",
        max_new_tokens=6,
        batch_size=3,
    )
    return PipelineArgs(**{**base, **kw})


@pytest.fixture()
def make_args(queries, tiny_world, tiny_index_dir, tiny_gate_vlm, tmp_path):
    return lambda **kw: args_for(queries, tiny_world, tiny_index_dir, tiny_gate_vlm, tmp_path, **kw)


def tmp_path_of(args):
    return Path(args.out)


def predictions(args):
    return list(read_jsonl(Path(args.out) / "predictions.jsonl"))


def test_every_stage_on(make_args, gates, tiny_refiner, queries):
    args = make_args(
        gate=gates["hkb"],
        refiner=str(tiny_refiner),
        reranker=f"vlm:{gates['srt']}",
        reranker_verbalisers="Rel,NoRel",
        text_reranker="tiny",
        inspector=gates["inspector"],
    )
    metrics = run(args, **QUIET)
    recs = predictions(args)
    assert [r["id"] for r in recs] == [q["id"] for q in queries[1]]
    for r in recs:
        assert 0.0 <= r["gate"]["score"] <= 1.0 and r["gate"]["retrieve"] == (r["gate"]["score"] >= 0.5)
        rag = r["rag"]
        assert len(rag["retrieved"]) == 3 and isinstance(rag["section_right"], bool)
        assert rag["gold_rank"] is None or rag["gold_rank"] >= 1
        assert 0.0 <= rag["inspector"]["p_pass"] <= 1.0
        assert r["answer"] == (rag if r["gate"]["retrieve"] else r["alone"])["answer"]
        assert {"gate", "answer alone", "refine", "retrieve", "rerank", "inspect"} <= set(r["latency"])
    assert metrics["n"] == 6 and set(metrics["baselines"]) == {"No RAG", "All RAG", "random gate", "oracle gate"}
    confusion = metrics["inspector_confusion"]
    assert sum(v for k, v in confusion.items() if k != "routing_accuracy") == 6
    # the generator answered every retrieved question too: the run without the Inspector comes with it
    assert all("without_inspector" in r["rag"] for r in recs) and metrics["without_inspector"] is not None
    for r in recs:
        if r["rag"]["inspector"]["pass"]:
            assert r["rag"]["without_inspector"]["answer"] == r["rag"]["answer"]
    out = args.out
    assert json.load(open(f"{out}/metrics.json", encoding="utf-8"))["accuracy"] == pytest.approx(metrics["accuracy"])
    assert (
        json.load(open(f"{out}/metrics.json", encoding="utf-8"))["placement"]["index α"] == "0.5"
    )  # the α it ran with, recorded
    assert open(f"{out}/metrics.md", encoding="utf-8").read().startswith("| system | accuracy | retrieval ratio |")
    assert (tmp_path_of(args) / "accuracy_vs_retrieval.png").stat().st_size > 0


@pytest.mark.parametrize(
    "alpha,trained_on,expected",
    [
        (0.3, ("EVA", "Qwen3"), 0.3),  # --alpha given: used, whatever the refiner's
        (None, ("tiny", "tiny"), 0.9),  # the refiner's α, on the encoders it was trained on
        (None, (None, None), 0.9),  # a refiner.json that does not say: taken as before
        (None, ("EVA", "Qwen3"), "--alpha is required: the refiner's α 0.9 weighs an index of EVA ⊕ Qwen3"),
    ],
)
def test_the_refiners_alpha_holds_only_for_an_index_of_its_encoders(alpha, trained_on, expected):
    """A refiner's α, chosen for its index's encoders, was applied silently to an index of other encoders."""
    from types import SimpleNamespace

    from gate.pipeline.context import resolve_alpha

    index = {"alpha": 0.9, **dict(zip(("image_encoder", "text_encoder"), trained_on))}
    refiner = SimpleNamespace(spec={"index": {k: v for k, v in index.items() if v is not None}})
    manifest = {"image_encoder": "tiny", "text_encoder": "tiny"}
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected + ", and --index holds tiny ⊕ tiny"):
            resolve_alpha(alpha, refiner, manifest)
    else:
        assert resolve_alpha(alpha, refiner, manifest) == expected


@pytest.mark.parametrize("gate,baseline", [("always", "All RAG"), ("never", "No RAG")])
def test_always_and_never_equal_their_baselines(make_args, gate, baseline):
    m = run(make_args(gate=gate), **QUIET)
    assert m["retrieval_ratio"] == (1.0 if gate == "always" else 0.0)
    assert m["accuracy"] == pytest.approx(m["baselines"][baseline]["accuracy"])


def test_srt_gate_as_reranker_and_no_baselines(make_args, gates):
    args = make_args(gate=gates["hkb"], reranker=f"gate:{gates['srt']}", baselines=False)
    metrics = run(args, **QUIET)
    for r in predictions(args):
        assert (r["rag"] is not None) == r["gate"]["retrieve"] and (r["alone"] is not None) != r["gate"]["retrieve"]
    assert metrics["baselines"] == {} and metrics["n"] == 6


def test_endpoint_generator_answers_and_failures(make_args, queries, stub):
    golds = [q["answers"][0] for q in queries[1]]
    good = stub(golds)
    m = run(make_args(generator="endpoint", generator_url=good.url, generator_model="m"), **QUIET)
    assert m["accuracy"] == 1.0 and m["baselines"]["All RAG"]["accuracy"] == 1.0
    assert good.requests[0]["body"]["messages"][1]["content"].startswith("Context: ")

    down = stub([], status=500)
    args = make_args(
        generator="endpoint",
        generator_url=down.url,
        generator_model="m",
        generator_retries=2,
        generator_backoff=0.0,
        out=str(tmp_path_of(make_args()).parent / "down"),
    )
    m = run(args, **QUIET)
    assert len(down.requests) == 2 * 6 and m["accuracy"] == 0.0 and m["failed"] == 6
    assert all(
        r["rag"]["answer"] is None and "generator failed after 2 attempts" in r["rag"]["failed"]
        for r in predictions(args)
    )
    # the server is back: a rerun on the same --out asks again for what failed, instead of keeping the failures
    down.status, down.replies = 200, list(golds)
    printed = []
    m = run(args, log=printed.append)
    assert m["accuracy"] == 1.0 and len(down.requests) == 2 * 6 + 6
    assert all(r["rag"]["answer"] is not None and "failed" not in r["rag"] for r in predictions(args))
    assert any("6 left unfinished by the last run, done again" in line for line in printed)


def test_resume_after_an_interruption(make_args, monkeypatch):
    import gate.pipeline.run as pipeline

    real, calls = pipeline.run_batch, []

    def flaky(*a, **kw):
        calls.append(len(a[1]))
        if len(calls) == 2:
            raise RuntimeError("killed")
        return real(*a, **kw)

    monkeypatch.setattr(pipeline, "run_batch", flaky)
    args = make_args()
    with pytest.raises(RuntimeError, match="^killed$"):
        run(args, **QUIET)
    part = Path(args.out) / "predictions.jsonl.part0"  # this process's part, merged when the run finishes
    assert sum(1 for _ in open(part, encoding="utf-8")) == 3  # the first batch was written
    run(args, **QUIET)
    assert not part.exists()
    ids = [r["id"] for r in predictions(args)]
    assert len(ids) == 6 == len(set(ids)) and calls == [3, 3, 3]


def test_missing_image_is_skipped_and_the_run_goes_on(make_args, queries, tiny_world, tmp_path):
    path, rows = queries
    late = tmp_path / "late" / "lost.png"  # outside the shared toy world: another test's missing image stays missing
    write_jsonl_atomic(path, rows + [{**rows[0], "id": "lost", "image": str(late)}])
    m = run(make_args(), **QUIET)
    recs = {r["id"]: r for r in predictions(make_args())}
    assert "image file missing" in recs["lost"]["skipped"] and m["n"] == 6 and m["skipped"] == 1
    assert (
        "1 question(s) skipped (image missing or unusable) are in no figure above"
        in (tmp_path_of(make_args()) / "metrics.md").read_text()
    )
    # the image fetched afterwards: a rerun on the same --out answers that question and keeps the others
    kept = {i: r for i, r in recs.items() if i != "lost"}
    late.parent.mkdir()
    shutil.copy(tiny_world / rows[0]["image"], late)
    m = run(make_args(), **QUIET)
    recs = {r["id"]: r for r in predictions(make_args())}
    assert "skipped" not in recs["lost"] and m["n"] == 7 and m["skipped"] == 0
    assert {i: r for i, r in recs.items() if i != "lost"} == kept


def test_an_image_that_does_not_decode_is_skipped_and_the_run_goes_on(make_args, queries, tmp_path):
    path, rows = queries
    cut = tmp_path / "cut.png"  # a download cut short: it stopped the run at its batch, on every run
    cut.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    write_jsonl_atomic(path, rows + [{**rows[0], "id": "cut", "image": str(cut)}])
    m = run(make_args(), **QUIET)
    recs = {r["id"]: r for r in predictions(make_args())}
    assert "image unreadable" in recs["cut"]["skipped"] and str(cut) in recs["cut"]["skipped"]
    assert m["n"] == 6 and m["skipped"] == 1


@pytest.mark.parametrize(
    "override,match",
    [
        (dict(gate="/no/gate"), "--gate: /no/gate is not a model folder"),
        (dict(answerer=None), "--answerer"),
        (dict(inspector="/no/inspector"), "--inspector: /no/inspector"),
        (dict(generator_retries=0), "--generator_retries must be at least 1"),
        (dict(generator="endpoint"), "generator_url"),
        (dict(generator=None, inspector="/no/inspector"), "--generator is required"),  # PASS answers through it
        (dict(generator_prompt="poem"), "--generator_prompt"),
        (dict(beta2=1.5, text_reranker="tiny"), r"--beta2 must lie in \[0, 1\], got 1.5"),  # before any model
        (dict(beta1=-0.1), r"--beta1 must lie in \[0, 1\]"),
        (dict(consistency_strategy="vote"), "--consistency_strategy: 'vote' is not one of filter, merge, rerank"),
        (dict(consistency="/no/mct"), "--consistency: /no/mct"),
    ],
)
def test_bad_input_is_named_before_models_load(make_args, override, match):
    with pytest.raises(ValueError, match=match):
        run(make_args(**override), **QUIET)


def test_an_alpha_outside_0_1_is_refused_before_any_model_loads(make_args, monkeypatch):
    monkeypatch.setattr("gate.pipeline.run.Stages", lambda *a, **k: pytest.fail("the models loaded first"))
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\], got 1.5"):
        run(make_args(alpha=1.5), **QUIET)


def test_a_stage_that_fails_to_load_is_named(make_args, tiny_gate_vlm):
    with pytest.raises(ValueError, match="inspector: could not load"):
        run(make_args(inspector=str(tiny_gate_vlm)), **QUIET)  # a model folder, but not a trained gate


def test_a_vlm_as_text_generator_is_named_with_the_setting_it_needs(make_args, tiny_gate_vlm):
    from gate.pipeline.stages import load_generator

    with pytest.raises(ValueError, match=r"not a text-only causal LM .*generator_image: true"):
        load_generator(make_args(generator=str(tiny_gate_vlm), generator_image=False), "cpu", None)


def test_text_llm_generator(make_args, tiny_text_llm):
    args = make_args(generator=str(tiny_text_llm), generator_image=False, generator_prompt="infoseek")
    m = run(args, **QUIET)
    recs = predictions(args)
    assert m["n"] == 6
    for r in recs:  # a random LM may say nothing: that is recorded as a failure, never an empty answer
        rag = r["rag"]
        assert (rag["answer"] is None and rag["failed"] == "empty answer" and not rag["correct"]) or (
            rag["answer"] and rag["answer"] == rag["answer"].strip()
        )


def test_the_text_generator_decodes_greedily_whatever_its_generation_config_says(tiny_text_llm, tmp_path):
    """A repetition penalty in the folder's generation_config.json applied to greedy decoding too (Qwen2.5-7B-Instruct
    ships 1.05): the answers, and the accuracy reported, hung on a setting nothing recorded."""
    import shutil

    from common.llm import text_generator

    shutil.copytree(tiny_text_llm, tmp_path / "penalised")
    config = json.loads((tmp_path / "penalised" / "generation_config.json").read_text())
    config |= {"repetition_penalty": 3.0, "no_repeat_ngram_size": 0, "top_k": 5, "temperature": 0.3}
    (tmp_path / "penalised" / "generation_config.json").write_text(json.dumps(config))
    prompt = {"system": "Answer.", "user_template": "{question} {context}"}
    questions, contexts = ["what is it", "where does it live"], ["a red star", "a blue ring"]
    answers = [
        text_generator(str(folder), prompt, max_new_tokens=12)(None, questions, contexts)
        for folder in (tiny_text_llm, tmp_path / "penalised")
    ]
    assert answers[0] == answers[1]


def test_a_folder_resumes_only_its_own_settings(make_args):
    run(make_args(gate="never"), **QUIET)
    with pytest.raises(ValueError, match=r"other settings \(gate\)"):
        run(make_args(gate="always"), **QUIET)
    assert run(make_args(gate="never", batch_size=2), **QUIET)["n"] == 6  # batch size may change on resume


def test_an_interrupted_folder_resumes_only_its_own_settings(make_args):
    """An interrupted run leaves only its part files (merged when a run finishes): other settings are refused there
    too, not merged with them."""
    args = make_args(gate="never")
    run(args, **QUIET)
    out = Path(args.out)
    (out / "predictions.jsonl").rename(out / "predictions.jsonl.part1")  # as a process of an interrupted run left it
    with pytest.raises(ValueError, match=r"other settings \(gate\)"):
        run(make_args(gate="always"), **QUIET)
    assert run(make_args(gate="never"), **QUIET)["n"] == 6


def test_a_folder_refuses_a_queries_file_or_weights_made_again_at_the_same_paths(
    make_args, queries, tiny_gate_vlm, tmp_path
):
    """The settings are paths: a queries file rewritten in place (other gold answers) or a model exported again into
    the same folder resumed, and the old predictions, judged against the old answers, stayed in the report."""
    import os
    import shutil

    generator = tmp_path / "generator"
    shutil.copytree(tiny_gate_vlm, generator)
    args = make_args(gate="never", generator=str(generator), limit=2)
    run(args, **QUIET)
    path, rows = queries
    write_jsonl_atomic(path, [{**r, "answers": ["London"]} for r in rows])
    with pytest.raises(ValueError, match=r"other settings \(queries_content\)"):
        run(make_args(gate="never", generator=str(generator)), **QUIET)
    write_jsonl_atomic(path, rows)
    weights = next(generator.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # exported again
    with pytest.raises(ValueError, match=r"other settings \(weights of generator\)"):
        run(make_args(gate="never", generator=str(generator)), **QUIET)


def test_a_folder_refuses_an_index_built_again_at_the_same_path(make_args, tiny_index_dir, tmp_path):
    """An index folder holds no weights file: rebuilt at the same path, it resumed and mixed its hits with the old."""
    import shutil

    index = tmp_path / "index"  # a copy: the shared index stays as it is
    shutil.copytree(tiny_index_dir, index)
    run(make_args(gate="always", index=str(index), limit=2), **QUIET)
    manifest = json.loads((index / "manifest.json").read_text())
    (index / "manifest.json").write_text(json.dumps({**manifest, "built_again": True}))
    with pytest.raises(ValueError, match=r"other settings \(index_files\)"):
        run(make_args(gate="always", index=str(index), limit=2), **QUIET)


def test_the_e_vqa_metric_asks_bem_once_per_batch_about_undecided_answers(make_args, queries, tiny_bem, monkeypatch):
    """metric: evqa — exact match decides first; BEM (loaded once; a tiny BERT whose verdict the test sets) judges
    the rest, in one call per batch for both paths; the report adds single-hop / two-hop / overall accuracy."""
    import torch

    import gate.pipeline.bem as gb
    from gate.pipeline.stages import Stages

    rows = [dict(r, question_type="automatic" if i % 2 else "2_hop") for i, r in enumerate(queries[1])]
    write_jsonl_atomic(queries[0], rows)
    by_question = {r["question"] + r["image"]: r for r in rows}
    calls = []
    real_call = gb.BEMScorer.__call__
    monkeypatch.setattr(
        gb.BEMScorer, "__call__", lambda self, c, r, q: calls.append(len(c)) or real_call(self, c, r, q)
    )
    args = make_args(metric="evqa", bem=str(tiny_bem), bem_device="cpu")
    stages = Stages(args)
    exact = {}

    def answer_alone(images, questions):  # the gold answer (other case, punctuation) for half, else a paraphrase
        out = []
        for q in questions:
            r = next(v for k, v in by_question.items() if k.startswith(q) and v["id"] not in exact)
            exact[r["id"]] = len(exact) % 2 == 0
            out.append(r["answers"][0].upper() + "." if exact[r["id"]] else "something else")
        return out

    stages.answer = answer_alone
    stages.generate = lambda images, questions, contexts: [("another thing", None)] * len(questions)
    metrics = run(args, stages=stages, **QUIET)
    recs = predictions(args)
    assert len(calls) == 2 and sum(calls) == 6 + 3  # per batch of 3: every RAG answer, the non-exact alone ones
    assert all(r["alone"]["correct"] and r["rag"]["correct"] for r in recs)  # this BEM calls everything equivalent
    hops = metrics["accuracy_by_hops"]
    assert set(hops) == {"single_hop", "two_hop", "overall"} and hops["overall"] == pytest.approx(metrics["accuracy"])

    with torch.no_grad():  # now BEM calls nothing equivalent: exact matches only
        stages.judge.bem.model.classifier.bias.copy_(torch.tensor([1.0, 0.0]))
    exact.clear()
    args2 = make_args(metric="evqa", bem=str(tiny_bem), bem_device="cpu", out=str(Path(args.out).parent / "out2"))
    run(args2, stages=stages, **QUIET)
    for r in predictions(args2):
        assert r["alone"]["correct"] is exact[r["id"]] and r["rag"]["correct"] is False


def test_an_untrained_mct_gate_falls_back_to_the_first_stage(make_args, gates, monkeypatch):
    import gate.pipeline.consistency as consistency

    real, parsed = consistency.generate_parsed, []  # what the untrained gate's outputs parse to, recorded

    def recorded(*a, **kw):
        out = real(*a, **kw)
        parsed.extend(out)
        return out

    monkeypatch.setattr(consistency, "generate_parsed", recorded)
    args = make_args(consistency=gates["mct"], consistency_max_new_tokens=8)
    metrics = run(args, **QUIET)
    plain = run(make_args(out=str(tmp_path_of(args).parent / "plain")), **QUIET)
    k = args.k  # first-stage sections the gate numbers 1..k
    no_valid_section = [
        not any(isinstance(i, int) and 1 <= i <= k for i in (p or {}).get("consistent") or []) for p in parsed
    ]
    recs = predictions(args)
    assert len(parsed) == len(recs) == 6 and any(no_valid_section)  # 8 tokens of an untrained gate: not a listing
    for r, p in zip(recs, predictions(make_args(out=str(tmp_path_of(args).parent / "plain")))):
        mct = r["rag"]["consistency"]
        assert mct["strategy"] == "filter" and "consistency" in r["latency"]
        if mct["fallback"]:  # nothing usable listed: the same section and answer as without the MCT stage
            assert (r["rag"]["section"], r["rag"]["answer"]) == (p["rag"]["section"], p["rag"]["answer"])
    fell_back = sum(r["rag"]["consistency"]["fallback"] for r in recs)
    assert fell_back == sum(no_valid_section) >= 1  # each output that lists no valid section, and only those
    assert metrics["consistency"]["n"] == 6
    assert metrics["consistency"]["fallback_ratio"] == pytest.approx(fell_back / 6)
    assert plain["consistency"] is None


@pytest.mark.parametrize("strategy", ["filter", "merge", "rerank"])
def test_mct_strategies_decide_what_the_generator_reads(make_args, gates, stub, strategy):
    """A scripted mct gate lists the 3rd and 2nd first-stage sections; the endpoint generator shows the context."""
    from gate.pipeline.consistency import apply_strategy
    from gate.pipeline.stages import Stages

    server = stub(["x"] * 12)
    args = make_args(
        consistency=gates["mct"],
        consistency_strategy=strategy,
        generator="endpoint",
        generator_url=server.url,
        generator_model="m",
        baselines=False,
    )
    stages = Stages(args)
    seen = []

    def scripted(images, questions, sections):
        seen.extend(sections)
        return [
            {**apply_strategy(strategy, len(s), {"consistent": [3, 2], "summary": "SUMMARY"}), "listed": [3, 2]}
            for s in sections
        ]

    stages.consistency = scripted
    run(args, stages=stages, **QUIET)
    contexts = [
        req["body"]["messages"][1]["content"].split("\nQuestion: ")[0][len("Context: ") :] for req in server.requests
    ]
    recs = predictions(args)
    assert len(contexts) == len(seen) == 6
    for r, sections, context in zip(recs, seen, contexts):
        assert r["rag"]["consistency"]["listed"] == [3, 2]
        if strategy == "filter":  # the listed sections, in the first stage's order
            assert context == "\n\n".join([sections[1], sections[2]])
        elif strategy == "merge":
            assert context == "SUMMARY"
        if strategy != "rerank":  # the record names the sections shown (it named the unused within-article choice)
            assert isinstance(r["rag"]["section"], list) and len(r["rag"]["section"]) == 2
        else:  # the article of the first listed section (the 3rd retrieved), its best section
            assert re.split(r"[#-]", r["rag"]["section"])[0] == r["rag"]["retrieved"][2]
            assert context != "SUMMARY" and "\n\n" not in context


@pytest.mark.parametrize(
    "answer,failed,expected",
    [
        ("Paris", None, {"answer": "Paris"}),
        ("", None, {"answer": None, "failed": "empty answer"}),
        (
            "  ",
            "the Inspector gave no parseable answer",
            {"answer": None, "failed": "the Inspector gave no parseable answer"},
        ),
        (None, None, {"answer": None, "failed": "no answer"}),
    ],
)
def test_an_empty_answer_is_recorded_as_none_whichever_stage_gave_it(answer, failed, expected):
    from gate.pipeline.run import answered

    assert answered(answer, failed) == expected


def test_a_question_written_twice_is_reported_once(make_args):
    """predictions.jsonl with a line repeated (by hand: JobParts merges parts to one line per id) counted it twice."""
    args = make_args(gate="never")
    first = run(args, **QUIET)
    path = Path(args.out) / "predictions.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines + lines[:1] * 3))
    again = run(args, **QUIET)
    assert again["n"] == first["n"] == 6 and again["accuracy"] == pytest.approx(first["accuracy"])


def test_the_pipeline_benchmark_names_the_questions_it_ran(make_args, gates, tmp_path, monkeypatch, capsys):
    """benchmarks/pipeline.py's header counts the questions both runs took (6 here), not the --questions asked for."""
    config = tmp_path / "pipeline.yaml"
    config.write_text(yaml.safe_dump(dataclasses.asdict(make_args(gate=gates["hkb"]))))
    monkeypatch.setattr(sys, "argv", ["pipeline.py", "--config", str(config), "--questions", "480"])
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "pipeline.py"), run_name="__main__")
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith(f"pipeline {config} on 6 toy-world test questions"), header
