"""Long inference jobs as two CPU processes over gloo (torchrun; `accelerate launch --cpu` would start only one):
each process takes every other batch and process 0 merges the parts — the same output as one process.

The four jobs run one after the other in the suite's shared torchrun launch (``torchrun_jobs`` in conftest.py;
tests/scripts/run_jobs.py calls each module's ``main`` with its config, as ``python -m`` does). Each job's
one-process reference runs first, in the test process."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from common.files import read_jsonl, write_json_atomic, write_jsonl_atomic

QUIET = dict(log=lambda *a: None)


def refine_job(folder: Path, tiny_refiner, tiny_world, **_) -> dict:
    from rl.refine import RefineArgs, refine_file

    rows = list(read_jsonl(tiny_world / "test.jsonl"))[:14]
    write_jsonl_atomic(folder / "q.jsonl", rows)
    config = dict(model=str(tiny_refiner), queries=str(folder / "q.jsonl"), images_root=str(tiny_world), batch_size=4)
    refine_file(RefineArgs(**config, out=str(folder / "one.jsonl")), **QUIET)
    return {**config, "out": str(folder / "two.jsonl")}


def pipeline_job(folder: Path, tiny_refiner, tiny_world, tiny_index_dir, tiny_gate_vlm, **_) -> dict:
    from gate.pipeline.arguments import PipelineArgs
    from gate.pipeline.run import run
    from gate.scoring import GATE_FILE
    from toy.gates import gate_questions

    gates = {}
    for variant in ("hkb", "inspector"):
        shutil.copytree(tiny_gate_vlm, folder / variant)
        write_json_atomic(folder / variant / GATE_FILE, {"variant": variant})
        gates[variant] = str(folder / variant)
    rows = gate_questions(list(read_jsonl(tiny_world / "test.jsonl")), 4, seed=0)  # 8 questions, 4 batches
    write_jsonl_atomic(folder / "q.jsonl", rows)
    config = dict(
        queries=str(folder / "q.jsonl"),
        images_root=str(tiny_world),
        gate=gates["hkb"],
        answerer=str(tiny_gate_vlm),
        refiner=str(tiny_refiner),
        index=str(tiny_index_dir),
        alpha=0.5,
        k=3,
        inspector=gates["inspector"],
        generator=str(tiny_gate_vlm),
        generator_image=True,
        generator_prompt="toy",
        max_new_tokens=6,
        batch_size=2,
        device="cpu",
    )
    run(PipelineArgs(**config, out=str(folder / "one")), **QUIET)
    return {**config, "out": str(folder / "two")}


def gate_data_job(folder: Path, tiny_world, tiny_gate_vlm, **_) -> dict:
    from gate.train.build_data import BuildDataArgs, build

    rows = list(read_jsonl(tiny_world / "test.jsonl"))[:6]
    write_jsonl_atomic(folder / "q.jsonl", rows)
    config = dict(
        stage="sample",
        queries=str(folder / "q.jsonl"),
        images_root=str(tiny_world),
        model=str(tiny_gate_vlm),
        samples=3,
        batch_size=2,
        max_new_tokens=4,
        device="cpu",
    )
    build(BuildDataArgs(**config, out=str(folder / "one")), **QUIET)
    return {**config, "out": str(folder / "two")}


def rl_data_job(folder: Path, tiny_world, tiny_index_dir, **_) -> dict:
    from rl.data import RLDataArgs, build_rl_data

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
    build_rl_data(RLDataArgs(**config, out=str(folder / "one.jsonl")), **QUIET)
    return {**config, "out": str(folder / "two.jsonl")}


def job_parts_apart_job(folder: Path, **_) -> dict:
    (folder / "node1").mkdir()
    (folder / "broken.jsonl").write_text('{"id": "q0"}\nnot json\n{"id": "q1"}\n')
    return {"folder": str(folder)}


JOBS = {  # job → (the module `python -m` runs, what prepares its config and runs its one-process reference)
    "refine": ("rl.refine", refine_job),
    "pipeline": ("gate.pipeline.run", pipeline_job),  # python -m gate.pipeline runs gate.pipeline.run's main
    "gate_data": ("gate.train.build_data", gate_data_job),
    "rl_data": ("rl.data", rl_data_job),
    "job_parts_apart": ("tests.scripts.job_parts_apart", job_parts_apart_job),
}


def inference_configs(tmp: Path, **fixtures) -> dict:
    """Each job's folder ``tmp/<job>`` with its one-process output (``one*``, run here) and the config of its
    two-process run (output ``two*``) as ``{job: (module, config)}``, for the suite's shared torchrun launch
    (``torchrun_jobs`` in conftest.py)."""
    configs = {}
    for name, (module, prepare) in JOBS.items():
        (tmp / name).mkdir()
        (tmp / name / "cfg.yaml").write_text(yaml.safe_dump(prepare(tmp / name, **fixtures)))
        configs[name] = (module, tmp / name / "cfg.yaml")
    return configs


@pytest.fixture(scope="module")
def jobs(torchrun_jobs):
    """Each job's folder (one-process output ``one*``, two-process output ``two*``) and the two processes' log of it."""
    return {name: torchrun_jobs[name][0] for name in JOBS}, {name: torchrun_jobs[name][1] for name in JOBS}


def test_refine_on_two_processes_equals_one(jobs, tiny_world):
    folders, logs = jobs
    folder, log = folders["refine"], logs["refine"]
    assert "process 0/2" in log and "process 1/2" in log and "8 to go here" in log and "6 to go here" in log
    one, two = list(read_jsonl(folder / "one.jsonl")), list(read_jsonl(folder / "two.jsonl"))
    assert [r["id"] for r in two] == [r["id"] for r in read_jsonl(folder / "q.jsonl")] and two == one
    assert not list(folder.glob("two.jsonl.part*"))


def test_pipeline_on_two_processes_equals_one(jobs):
    folders, logs = jobs
    folder = folders["pipeline"]
    assert "pipeline, process 1/2" in logs["pipeline"]
    a, b = (
        list(read_jsonl(folder / "one" / "predictions.jsonl")),
        list(read_jsonl(folder / "two" / "predictions.jsonl")),
    )
    assert [r["id"] for r in b] == [r["id"] for r in read_jsonl(folder / "q.jsonl")]
    for x, y in zip(a, b):
        x.pop("latency"), y.pop("latency")
        for r in (x, y):
            r["gate"]["score"] = round(r["gate"]["score"], 5)
            r["rag"]["inspector"]["p_pass"] = round(r["rag"]["inspector"]["p_pass"], 5)
        assert x == y
    one, two = (json.loads((folder / run / "metrics.json").read_text()) for run in ("one", "two"))
    assert two["n"] == one["n"] == 8 and two["accuracy"] == pytest.approx(one["accuracy"])


def test_gate_data_sampling_on_two_processes_equals_one(jobs):
    """gate.train.build_data --stage sample: seeded per batch, so two processes draw the very samples one process
    draws."""
    folders, logs = jobs
    folder = folders["gate_data"]
    assert "sample, process 1/2" in logs["gate_data"]
    one = list(read_jsonl(folder / "one" / "samples.jsonl"))
    assert list(read_jsonl(folder / "two" / "samples.jsonl")) == one and len(one) == 6
    assert len({s for r in one for s in r["samples"]}) > 1  # real samples, not one repeated string


def test_rl_data_on_two_processes_equals_one(jobs, tiny_index_dir):
    """The baseline retrieval and the sampled images' embeddings split over two processes: the same RL file, skip
    list and embedding store as one process."""
    from retrieval.index import MultimodalIndex
    from rl.image_embeddings import load_store

    folders, logs = jobs
    folder = folders["rl_data"]
    assert "process 1/2" in logs["rl_data"] and "24 to go here" in logs["rl_data"]  # 48 questions, 6 batches of 8
    assert (folder / "two.jsonl").read_text() == (folder / "one.jsonl").read_text()
    assert (folder / "two.jsonl.skipped.jsonl").read_text() == (folder / "one.jsonl.skipped.jsonl").read_text()
    manifest = MultimodalIndex.load(tiny_index_dir).manifest
    one, two = load_store(folder / "one.jsonl", manifest), load_store(folder / "two.jsonl", manifest)
    assert one.keys() == two.keys() and one
    for image in one:
        np.testing.assert_allclose(two[image], one[image], atol=1e-6)


def test_an_error_process_0_meets_alone_is_raised_on_both_processes(jobs):
    """Process 0 alone merges and checks; its error (records missing at the end, a broken output at the start) was
    raised there only, and process 1 went on to the next collective, where it waited for a process 0 that had left."""
    log = jobs[1]["job_parts_apart"]
    for step, error in (
        ("finish_apart", r"RuntimeError: .*2 of 6 records are missing after the merge \(first: q2, q3\)"),
        ("start_on_a_broken_file", r"ValueError: .*broken\.jsonl: line 2 is not a JSON record with an id"),
    ):
        for rank in (0, 1):
            assert re.search(rf"{step}, process {rank}: {error}", log), log[-2000:]
        assert re.search(rf"{step}, process 1: \w+: process 0: ", log)  # process 1's error says whose it is
