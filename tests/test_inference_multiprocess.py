"""Long inference jobs as two CPU processes over gloo (torchrun; `accelerate launch --cpu` would start only one):
each process takes every other batch and process 0 merges the parts — the same output as one process."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from common.files import read_jsonl, write_json_atomic, write_jsonl_atomic
from tests.test_multiprocess import two_processes

ROOT = Path(__file__).resolve().parent.parent
QUIET = dict(log=lambda *a: None)


def torchrun_module(module: str, config: dict, cwd: Path):
    (cwd / "cfg.yaml").write_text(yaml.safe_dump(config))
    return two_processes(["-m", module, "--config", str(cwd / "cfg.yaml")], cwd=cwd)


def test_refine_on_two_processes_equals_one(tiny_refiner, tiny_world, tmp_path):
    from rl.refine import RefineArgs, refine_file

    rows = list(read_jsonl(tiny_world / "test.jsonl"))[:14]
    write_jsonl_atomic(tmp_path / "q.jsonl", rows)
    config = dict(model=str(tiny_refiner), queries=str(tmp_path / "q.jsonl"), images_root=str(tiny_world), batch_size=4)
    refine_file(RefineArgs(**config, out=str(tmp_path / "one.jsonl")), **QUIET)
    proc = torchrun_module("rl.refine", {**config, "out": str(tmp_path / "two.jsonl")}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stdout + proc.stderr
    assert "process 0/2" in log and "process 1/2" in log and "8 to go here" in log and "6 to go here" in log
    one, two = list(read_jsonl(tmp_path / "one.jsonl")), list(read_jsonl(tmp_path / "two.jsonl"))
    assert [r["id"] for r in two] == [r["id"] for r in rows] and two == one
    assert not list(tmp_path.glob("two.jsonl.part*"))


@pytest.fixture()
def gate_folders(tiny_gate_vlm, tmp_path):
    from gate.scoring import GATE_FILE

    out = {}
    for variant in ("hkb", "inspector"):
        shutil.copytree(tiny_gate_vlm, tmp_path / variant)
        write_json_atomic(tmp_path / variant / GATE_FILE, {"variant": variant})
        out[variant] = str(tmp_path / variant)
    return out


def test_pipeline_on_two_processes_equals_one(
    gate_folders, tiny_gate_vlm, tiny_refiner, tiny_world, tiny_index_dir, tmp_path
):
    from gate.pipeline.run import PipelineArgs, run
    from toy.gates import gate_questions

    rows = gate_questions(list(read_jsonl(tiny_world / "test.jsonl")), 4, seed=0)  # 8 questions, 4 batches
    write_jsonl_atomic(tmp_path / "q.jsonl", rows)
    config = dict(
        queries=str(tmp_path / "q.jsonl"),
        images_root=str(tiny_world),
        gate=gate_folders["hkb"],
        answerer=str(tiny_gate_vlm),
        refiner=str(tiny_refiner),
        index=str(tiny_index_dir),
        alpha=0.5,
        k=3,
        inspector=gate_folders["inspector"],
        generator=str(tiny_gate_vlm),
        generator_image=True,
        generator_prompt="toy",
        max_new_tokens=6,
        batch_size=2,
        device="cpu",
    )
    one = run(PipelineArgs(**config, out=str(tmp_path / "one")), **QUIET)
    proc = torchrun_module("gate.pipeline", {**config, "out": str(tmp_path / "two")}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "pipeline, process 1/2" in proc.stdout + proc.stderr
    a, b = (
        list(read_jsonl(tmp_path / "one" / "predictions.jsonl")),
        list(read_jsonl(tmp_path / "two" / "predictions.jsonl")),
    )
    assert [r["id"] for r in b] == [r["id"] for r in rows]
    for x, y in zip(a, b):
        x.pop("latency"), y.pop("latency")
        for r in (x, y):
            r["gate"]["score"] = round(r["gate"]["score"], 5)
            r["rag"]["inspector"]["p_pass"] = round(r["rag"]["inspector"]["p_pass"], 5)
        assert x == y
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert two["n"] == one["n"] == 8 and two["accuracy"] == pytest.approx(one["accuracy"])


def test_gate_data_sampling_on_two_processes_equals_one(tiny_gate_vlm, tiny_world, tmp_path):
    """gate.train.build_data --stage sample: seeded per batch, so two processes draw the very samples one process
    draws."""
    from gate.train.build_data import BuildDataArgs, build

    rows = list(read_jsonl(tiny_world / "test.jsonl"))[:6]
    write_jsonl_atomic(tmp_path / "q.jsonl", rows)
    config = dict(
        stage="sample",
        queries=str(tmp_path / "q.jsonl"),
        images_root=str(tiny_world),
        model=str(tiny_gate_vlm),
        samples=3,
        batch_size=2,
        max_new_tokens=4,
        device="cpu",
    )
    build(BuildDataArgs(**config, out=str(tmp_path / "one")), **QUIET)
    proc = torchrun_module("gate.train.build_data", {**config, "out": str(tmp_path / "two")}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "sample, process 1/2" in proc.stdout + proc.stderr
    one = list(read_jsonl(tmp_path / "one" / "samples.jsonl"))
    assert list(read_jsonl(tmp_path / "two" / "samples.jsonl")) == one and len(one) == 6
    assert len({s for r in one for s in r["samples"]}) > 1  # real samples, not one repeated string


def test_rl_data_on_two_processes_equals_one(tiny_world, tiny_index_dir, tmp_path):
    """The baseline retrieval and the sampled images' embeddings split over two processes: the same RL file, skip
    list and embedding store as one process."""
    from retrieval.index import MultimodalIndex
    from rl.data import RLDataArgs, build_rl_data
    from rl.image_embeddings import load_store

    config = dict(
        queries=str(tiny_world / "train.jsonl"),
        index=str(tiny_index_dir),
        alpha=0.5,
        seed=1,
        strata="1-5:3,6-24:100",
        batch_size=8,
        images_root=str(tiny_world),
        workers=0,
    )
    build_rl_data(RLDataArgs(**config, out=str(tmp_path / "one.jsonl")), **QUIET)
    proc = torchrun_module("rl.data", {**config, "out": str(tmp_path / "two.jsonl")}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stdout + proc.stderr
    assert "process 1/2" in log and "24 to go here" in log  # 48 questions, 6 batches of 8: 3 each
    assert (tmp_path / "two.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()
    assert (tmp_path / "two.jsonl.skipped.jsonl").read_text() == (tmp_path / "one.jsonl.skipped.jsonl").read_text()
    manifest = MultimodalIndex.load(tiny_index_dir).manifest
    one, two = load_store(tmp_path / "one.jsonl", manifest), load_store(tmp_path / "two.jsonl", manifest)
    assert one.keys() == two.keys() and one
    for image in one:
        np.testing.assert_allclose(two[image], one[image], atol=1e-6)
