"""Device and dtype plumbing of the stages' model loader, and first-token scoring that computes only the last
position's logits (logits_to_keep=1) yet gives the same probabilities as the full forward pass."""

import sys

import numpy as np
import pytest
import torch


def test_load_model_places_the_model_in_the_requested_dtype(tiny_gate_vlm):
    from rl.model import load_model

    model, _ = load_model(str(tiny_gate_vlm), dtype="bf16", device="cpu")
    dtypes = {p.dtype for p in model.parameters()}
    devices = {p.device.type for p in model.parameters()}
    assert dtypes == {torch.bfloat16} and devices == {"cpu"}
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(str(tiny_gate_vlm), dtype="int3")


def test_first_token_scores_keep_only_the_last_position(tiny_gate_vlm, tiny_world, monkeypatch):
    from PIL import Image

    from common.files import read_jsonl
    from gate.scoring import first_token_scores
    from gate.variants import spec
    from rl.model import load_model

    model, processor = load_model(str(tiny_gate_vlm), device="cpu")
    rows = list(read_jsonl(tiny_world / "test.jsonl"))[:4]
    images = [Image.open(tiny_world / r["image"]).convert("RGB") for r in rows]
    questions = [r["question"] for r in rows]
    s = spec("ret")
    seen = []
    forward = type(model).forward

    def spy(self, *a, **kw):
        out = forward(self, *a, **kw)
        seen.append(out.logits.shape[1])
        return out

    monkeypatch.setattr(type(model), "forward", spy)
    kept = first_token_scores(model, processor, s, images, questions, batch_size=2)
    assert seen and set(seen) == {1}  # one position of logits per example, never the whole sequence
    monkeypatch.undo()
    # the same probabilities from the full forward pass (every position's logits)
    from gate.scoring import _prompt_texts, verbaliser_ids

    ids = verbaliser_ids(processor.tokenizer, s)
    texts = _prompt_texts(processor, s, questions, None, with_prefix=True)
    with torch.no_grad():
        batch = processor(text=texts, images=images, return_tensors="pt", padding=True)
        full = model(**batch).logits
    assert full.shape[1] > 1
    probs = torch.softmax(full[:, -1, ids].float(), dim=-1)[:, 0].numpy()
    np.testing.assert_allclose(kept, probs, atol=1e-5)


def test_every_pipeline_stage_loads_on_the_device_and_dtype_asked(
    tiny_world, tiny_index_dir, tiny_gate_vlm, tiny_refiner, tmp_path, monkeypatch
):
    """dtype bf16 on the CPU: every model the pipeline loads (gate, answerer, refiner, reranker, Inspector, generator)
    is asked for, and holds, bf16 weights on the given device; the placement is logged and one batch runs."""
    import shutil

    import rl.model as rm
    from common.files import read_jsonl, write_json_atomic, write_jsonl_atomic
    from gate.pipeline.arguments import PipelineArgs
    from gate.pipeline.run import run
    from gate.pipeline.stages import Stages
    from gate.scoring import GATE_FILE

    gates = {}
    for variant in ("ret", "inspector", "srt"):
        shutil.copytree(tiny_gate_vlm, tmp_path / variant)
        write_json_atomic(tmp_path / variant / GATE_FILE, {"variant": variant})
        gates[variant] = str(tmp_path / variant)
    rows = list(read_jsonl(tiny_world / "test.jsonl"))[:2]
    write_jsonl_atomic(tmp_path / "q.jsonl", rows)
    loads = []
    real = rm.load_model

    def spy(path, dtype=None, device="cpu", **kw):
        loads.append((dtype, device))
        return real(path, dtype=dtype, device=device, **kw)

    for module in list(sys.modules.values()):  # wherever a module holds rl.model.load_model under that name
        if getattr(module, "load_model", None) is real:
            monkeypatch.setattr(module, "load_model", spy)
    args = PipelineArgs(
        queries=str(tmp_path / "q.jsonl"),
        images_root=str(tiny_world),
        out=str(tmp_path / "out"),
        gate=gates["ret"],
        answerer=str(tiny_gate_vlm),
        refiner=str(tiny_refiner),
        index=str(tiny_index_dir),
        alpha=0.5,
        k=2,
        reranker=f"gate:{gates['srt']}",
        inspector=gates["inspector"],
        generator=str(tiny_gate_vlm),
        generator_image=True,
        generator_prompt="toy",
        max_new_tokens=4,
        batch_size=2,
        device="cpu",
        dtype="bf16",
    )
    stages = Stages(args)
    assert len(loads) == 6 and set(loads) == {("bf16", "cpu")}  # gate, answerer, refiner, srt, inspector, generator
    for model in (stages.gate.model, stages.inspect.model, stages.rerank.reranker.model):
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert set(stages.placement) >= {"gate", "answerer", "refiner", "reranker", "inspector", "generator", "index"}
    assert stages.placement["gate"] == "cpu bfloat16"
    lines = []
    metrics = run(args, stages=stages, log=lines.append)
    assert metrics["n"] == 2 and any(x.startswith("placement: gate: cpu bfloat16") for x in lines)
    assert metrics["placement"] == stages.placement  # in metrics.json: runs on other devices can be told apart


@pytest.mark.parametrize(
    "gpus,stage_gpus,device,rank,visible,expected",
    [
        (1, None, "cpu", 0, 0, dict.fromkeys(("gate", "inspector", "bem"), "cpu")),  # one device a process: as before
        (1, None, "cuda:3", 3, 8, dict.fromkeys(("gate", "inspector", "bem"), "cuda:3")),
        (2, "inspector:1,generator:1", "cuda:0", 0, 8, {"gate": "cuda:0", "inspector": "cuda:1", "bem": "cuda:0"}),
        (
            2,
            "inspector:1,generator:1",
            "cuda:3",
            3,
            8,
            {"gate": "cuda:6", "inspector": "cuda:7", "generator": "cuda:7"},
        ),
        (4, "gate:0,answerer:1,inspector:2,generator:3", "cuda:1", 1, 8, {"answerer": "cuda:5", "bem": "cuda:4"}),
    ],
)
def test_each_stage_goes_to_its_gpu_of_the_process(gpus, stage_gpus, device, rank, visible, expected):
    """The paper's pipeline on one 80 GB GPU a process (~117 GB of bf16 weights and FAISS replica: docs/scaling.md)
    cannot load: with gpus_per_process k, process r spreads its stages over GPUs r·k … r·k + k − 1 as stage_gpus
    says."""
    from types import SimpleNamespace

    from gate.pipeline.stages import PLACED_STAGES, stage_devices

    on = stage_devices(SimpleNamespace(gpus_per_process=gpus, stage_gpus=stage_gpus), device, rank, visible)
    assert set(on) == set(PLACED_STAGES) and {s: on[s] for s in expected} == expected


@pytest.mark.parametrize(
    "gpus,stage_gpus,device,rank,visible,match",
    [
        (2, None, "cpu", 0, 0, r"spread the stages over GPUs; this process runs on cpu"),
        (1, "gate:1", "cuda:0", 0, 8, r"gate on GPU 1 of the process's 1 \(--gpus_per_process\)"),
        (2, "gates:1", "cuda:0", 0, 8, r"unknown stage 'gates' \(stages: gate, answerer"),
        (2, "gate=1", "cuda:0", 0, 8, r"unknown stage 'gate=1'"),
        (2, "gate:x", "cuda:0", 0, 8, r"'gate:x' is not stage:GPU"),
        (0, None, "cuda:0", 0, 8, r"--gpus_per_process must be a positive integer, got 0"),
        (4, None, "cuda:2", 2, 8, r"process 2 takes GPUs 8–11 \(--gpus_per_process 4\), but 8 are visible: launch 2"),
    ],
)
def test_a_placement_the_processes_cannot_take_is_named(gpus, stage_gpus, device, rank, visible, match):
    from types import SimpleNamespace

    from gate.pipeline.stages import stage_devices

    with pytest.raises(ValueError, match=match):
        stage_devices(SimpleNamespace(gpus_per_process=gpus, stage_gpus=stage_gpus), device, rank, visible)
