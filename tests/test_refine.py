"""Batched refiner inference: the Python API, fallback to the question, resume after an interruption."""

import json

import pytest

import rl.train_grpo as tg
from rl.export import ExportArgs, export
from rl.model import load_model
from rl.prompts import prompt_spec
from rl.refine import RefineArgs, Refiner, refine_file

QUIET = dict(log=lambda *a: None)


@pytest.fixture(scope="module")
def toy_refiner(tiny_refiner):
    model, processor = load_model(str(tiny_refiner))
    spec = {"prompt": prompt_spec("toy"), "generation": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 40}}
    return Refiner(model, processor, spec)


def test_refine_file_resumes_without_losing_or_repeating(toy_refiner, tiny_world, tmp_path, monkeypatch):
    out = tmp_path / "refined.jsonl"
    args = RefineArgs(queries=str(tiny_world / "test.jsonl"), out=str(out), batch_size=8)
    real = toy_refiner.refine_with_outputs
    calls = []

    def dying(images, questions, **kw):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(len(questions))
        return real(images, questions, **kw)

    monkeypatch.setattr(toy_refiner, "refine_with_outputs", dying)
    with pytest.raises(KeyboardInterrupt):
        refine_file(args, refiner=toy_refiner, **QUIET)
    assert sum(1 for _ in open(out)) == 16  # two finished batches are on disk
    with open(out, "a") as fh:
        fh.write('{"id": "cut-short')  # a line cut by a crash
    monkeypatch.setattr(toy_refiner, "refine_with_outputs", real)
    assert refine_file(args, refiner=toy_refiner, **QUIET) == 48 - 16
    rows = [json.loads(x) for x in open(out)]
    inputs = [json.loads(x) for x in open(tiny_world / "test.jsonl")]
    assert [r["id"] for r in rows] == [r["id"] for r in inputs]  # ids and order kept, nothing twice
    for r, q in zip(rows, inputs):
        assert {"refined_query", "raw_output", "format_ok"} <= set(r) and r["question"] == q["question"]
        if not r["format_ok"]:
            assert r["refined_query"] == r["question"]  # fallback to the original question
    assert sum(r["format_ok"] for r in rows) > len(rows) // 2
    assert refine_file(args, refiner=toy_refiner, **QUIET) == 0


def test_missing_image_is_named(toy_refiner, tmp_path):
    (tmp_path / "q.jsonl").write_text(json.dumps({"id": "a", "image": "gone.png", "question": "?"}) + "\n")
    with pytest.raises(ValueError, match="gone.png"):
        refine_file(RefineArgs(queries=str(tmp_path / "q.jsonl"), out=str(tmp_path / "o.jsonl")),
                    refiner=toy_refiner, **QUIET)
    assert not (tmp_path / "o.jsonl").exists()


def test_vllm_backend_without_vllm_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="vLLM"):
        Refiner.load(tmp_path, backend="vllm")
    with pytest.raises(ValueError, match="--backend"):
        Refiner.load(tmp_path, backend="tgi")


def test_exported_refiner_loads_and_refines(config, tiny_world, tmp_path):
    tg.main(config(max_steps=1, save_strategy="steps", save_steps=1))
    folder = export(ExportArgs(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "serve"), dtype="fp32"),
                    **QUIET)
    refiner = Refiner.load(folder)
    assert refiner.spec["prompt"]["name"] == "toy"
    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl")][:4]
    from PIL import Image

    queries = refiner.refine([Image.open(tiny_world / r["image"]) for r in rows], [r["question"] for r in rows])
    assert len(queries) == 4 and all(q.startswith(r["question"]) for q, r in zip(queries, rows))
