"""Every job over a question file names the file, line and field a row lacks, before any model loads (each was a bare
KeyError, most of them after the models had loaded and the images were decoded)."""

import re

import pytest

from common.files import read_jsonl, write_jsonl_atomic

QUIET = dict(log=lambda *a: None)


def not_loaded(*a, **k):
    pytest.fail("a model was loaded")


def refine(q, tmp_path, tiny_world, tiny_index_dir, monkeypatch, out=None):
    from rl.refine import RefineArgs, Refiner, refine_file

    monkeypatch.setattr(Refiner, "load", not_loaded)
    args = RefineArgs(model="m", queries=str(q), out=str(out or tmp_path / "o.jsonl"), images_root=str(tiny_world))
    refine_file(args, **QUIET)


def baselines(q, tmp_path, tiny_world, tiny_index_dir, monkeypatch, out=None):
    from rl.baselines import BaselineArgs, run_baselines

    args = BaselineArgs(model="m", queries=str(q), out=str(out or tmp_path / "o.jsonl"), images_root=str(tiny_world))
    run_baselines(args, generate=not_loaded, **QUIET)


def rl_data(q, tmp_path, tiny_world, tiny_index_dir, monkeypatch):
    import rl.data
    from rl.data import RLDataArgs, build_rl_data

    monkeypatch.setattr(rl.data.MultimodalIndex, "load", not_loaded)
    args = RLDataArgs(
        queries=str(q),
        index=str(tiny_index_dir),
        alpha=0.5,
        out=str(tmp_path / "rl.jsonl"),
        images_root=str(tiny_world),
    )
    build_rl_data(args, **QUIET)


def training_questions(q, tmp_path, tiny_world, tiny_index_dir, monkeypatch):
    from rl.data import question_dataset

    question_dataset(q, images_root=tiny_world, **QUIET)


def pipeline(q, tmp_path, tiny_world, tiny_index_dir, monkeypatch):
    pipeline_run(q, tmp_path, tiny_world, tiny_index_dir, monkeypatch)


def pipeline_run(q, tmp_path, tiny_world, tiny_index_dir, monkeypatch, log=QUIET["log"], **kw):
    import gate.pipeline.run
    from gate.pipeline.arguments import PipelineArgs

    monkeypatch.setattr(gate.pipeline.run, "Stages", not_loaded)
    args = PipelineArgs(
        queries=str(q),
        images_root=str(tiny_world),
        out=str(tmp_path / "out"),
        gate="always",
        baselines=False,
        refiner="none",
        index=str(tiny_index_dir),
        alpha=0.5,
        generator="endpoint",
        generator_url="http://localhost:1",
        generator_model="m",
        bem="none",
        **kw,
    )
    gate.pipeline.run.run(args, log=log)


def gate_retrieve(q, tmp_path, tiny_world, tiny_index_dir, monkeypatch):
    """The gate data's (and the noise study's) retrieval stage: gate.pipeline.context."""
    from types import SimpleNamespace

    import gate.pipeline.context as context

    monkeypatch.setattr(context.MultimodalIndex, "load", not_loaded)
    args = SimpleNamespace(
        index=str(tiny_index_dir), refiner=None, queries=str(q), images_root=str(tiny_world), kb=None, alpha=0.5, k=3
    )
    context.stage_retrieve(args, tmp_path, **QUIET)


def image_embeddings(q, tmp_path, tiny_world, tiny_index_dir, monkeypatch):
    import rl.image_embeddings

    monkeypatch.setattr(rl.image_embeddings.MultimodalIndex, "load", not_loaded)
    rl.image_embeddings.main(["--queries", str(q), "--index", str(tiny_index_dir), "--images_root", str(tiny_world)])


@pytest.mark.parametrize(
    "job,key",
    [
        (refine, "id"),
        (refine, "question"),
        (baselines, "id"),
        (baselines, "question"),
        (rl_data, "id"),
        (rl_data, "question"),
        (rl_data, "entity_id"),
        (training_questions, "question"),
        (training_questions, "entity_id"),
        (pipeline, "id"),
        (pipeline, "question"),
        (gate_retrieve, "id"),
        (gate_retrieve, "entity_id"),
        (image_embeddings, "image"),
    ],
)
def test_a_row_without_a_field_its_job_reads_is_named(job, key, tiny_world, tiny_index_dir, tmp_path, monkeypatch):
    rows = list(read_jsonl(tiny_world / "test.jsonl"))[:3]
    del rows[1][key]
    q = tmp_path / "q.jsonl"
    write_jsonl_atomic(q, rows)
    said = f'{q}:2 lacks "{key}"'
    with pytest.raises(ValueError, match=f"^{re.escape(said)}$"):
        job(q, tmp_path, tiny_world, tiny_index_dir, monkeypatch)


@pytest.mark.parametrize("job", [refine, baselines, gate_retrieve])
def test_a_row_whose_image_is_not_there_is_named_before_a_model_loads(
    job, tiny_world, tiny_index_dir, tmp_path, monkeypatch
):
    rows = list(read_jsonl(tiny_world / "test.jsonl"))[:3]
    rows[1]["image"] = "gone.png"
    q = tmp_path / "q.jsonl"
    write_jsonl_atomic(q, rows)
    with pytest.raises(
        ValueError, match=f"1 question\\(s\\) in {re.escape(str(q))} have no image file: {rows[1]['id']} → "
    ):
        job(q, tmp_path, tiny_world, tiny_index_dir, monkeypatch)


@pytest.mark.parametrize(
    "metric,record,refused",
    [
        ("evqa", {"question_type": "automatic"}, True),  # its reference would be empty: E-VQA's scorer refuses it
        ("evqa", {}, True),
        ("infoseek", {"question_type": "String"}, True),  # an InfoSeek type: the official scorer needs answer_eval
        ("infoseek", {"question_type": "numerical"}, True),
        ("infoseek", {}, False),  # untyped (a test file converted for inference): a miss
        ("infoseek", {"question_type": "name"}, False),
    ],
)
def test_which_rule_cannot_score_a_question_without_answers(metric, record, refused):
    from gate.pipeline.metrics import official_correct, refuses_unanswered

    assert refuses_unanswered(metric, record) is refused
    record = {"id": "q", "question": "?", **record}
    if refused:  # as official_correct would, once the models had answered
        with pytest.raises(ValueError):
            official_correct(metric, [record], ["Paris"])
    else:
        assert official_correct(metric, [record], ["Paris"]) == [False]


@pytest.mark.parametrize(
    "metric,goes_on,said",
    [
        (
            "infoseek",
            True,
            "2 of 3 question(s) in {q} have no answers (nor answer_eval): every answer to them is scored",
        ),
        ("evqa", False, "{q}: 2 question(s) have no answers (nor answer_eval), which the evqa rule cannot score"),
    ],
)
def test_the_pipeline_says_how_many_questions_lack_answers_before_models_load(
    metric, goes_on, said, tiny_world, tiny_index_dir, tmp_path, monkeypatch
):
    """Without answers accuracy was 0 without a word (or, under E-VQA's rule, a ValueError once the models had
    answered the first batch). Where they are scored wrong the run goes on (to the models, here refused)."""
    rows = list(read_jsonl(tiny_world / "test.jsonl"))[:3]
    for r in rows[1:]:
        del r["answers"]
    q = tmp_path / "q.jsonl"
    write_jsonl_atomic(q, rows)
    lines = []
    with pytest.raises(pytest.fail.Exception if goes_on else ValueError) as raised:
        pipeline_run(q, tmp_path, tiny_world, tiny_index_dir, monkeypatch, metric=metric, log=lines.append)
    assert said.format(q=q) in (" ".join(lines) if goes_on else str(raised.value))


@pytest.mark.parametrize(
    "record,gold",
    [
        ({"answers": ["Paris"]}, True),
        ({"answers": [], "answer_eval": ["Paris"]}, True),
        ({"answers": [], "answer_eval": []}, False),  # an empty answer_eval counted as gold: scored, then refused
        ({"answers": ["Paris"], "answer_eval": []}, True),
        ({"answers": None}, False),
    ],
)
def test_an_empty_answer_eval_holds_no_answer(record, gold):
    from gate.pipeline.judges import ExactJudge
    from gate.pipeline.metrics import official_correct
    from retrieval.kb import has_gold

    assert has_gold(record) is gold
    if gold:  # scored by what the record holds: ["Paris"], taken from answers where answer_eval is empty
        row = {"id": "q", "question": "?", **record}
        assert official_correct("infoseek", [row], ["Paris"]) == [True]
        assert ExactJudge().score("?", "Paris", record["answers"], record.get("answer_eval")) == 5.0


@pytest.mark.parametrize("job", [refine, baselines])
@pytest.mark.parametrize("link", [False, True])
def test_a_job_never_takes_its_queries_file_for_its_output(
    job, link, tiny_world, tiny_index_dir, tmp_path, monkeypatch
):
    """rl.refine --out naming its --queries file said "4 of 4 done" (every id was in the output) and refined
    nothing; a later run would have appended to the question file."""
    import os

    q = tmp_path / "q.jsonl"
    write_jsonl_atomic(q, list(read_jsonl(tiny_world / "test.jsonl"))[:4])
    out = tmp_path / "link.jsonl" if link else q
    if link:
        os.link(q, out)
    before = q.read_bytes()
    with pytest.raises(ValueError, match=f"^--out {re.escape(str(out))} is the --queries file"):
        job(q, tmp_path, tiny_world, tiny_index_dir, monkeypatch, out=out)
    assert q.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == sorted({"q.jsonl", out.name})
