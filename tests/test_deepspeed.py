"""DeepSpeed ZeRO-2 and ZeRO-3, run for real: two CPU processes over gloo (DeepSpeed's CPU accelerator), launched as a
user launches them (`accelerate launch --config_file configs/accelerate/zero{2,3}-cpu2.yaml …`). The ZeRO-3 jobs
below run one after the other in one launch (``zero3_jobs`` in conftest.py, the jobs' configs in ``zero3_configs``).

- The embedded default under ZeRO-3: tests/test_embedded_default.py (seed 1's run).
- GRPO from a warm-started tiny refiner under ZeRO-3 (ZeRO-2: tests/test_multiprocess.py): ``final/`` reloads to
  the engine's own gathered fp32 weights (DeepSpeed's zero_to_fp32 on the last checkpoint), the vision tower is
  bit-identical to the start, the text model moved, and the reward's encoders are whole on every process.
- Resuming from the step-2 ZeRO-3 checkpoint gives the uninterrupted run's step-3 and step-4 losses and weights.
- LoRA under ZeRO-3 saves an adapter that ``rl.export`` merges from a ZeRO checkpoint folder; ``rl.export`` gathers
  a checkpoint that holds only ZeRO shards.
- gate/train/sft.py under ZeRO-3 writes a merged ``final/`` and its held-out evaluation.
- A barrier nobody reaches: tests/test_multiprocess.py.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_multiprocess import (
    check_saved_engine_weights,
    engine_weights,
    grpo_config,
    is_vision,
    reloaded,
)
from tests.test_train_grpo import weights

pytest.importorskip("deepspeed")


def zero3_configs(tmp: Path, small_default_world, tiny_world, tiny_index_dir, tiny_refiner, tiny_gate_vlm) -> dict:
    """The suite's ZeRO-3 jobs, run one after the other in one launch by ``zero3_jobs`` (conftest.py), as
    ``{name: (module, config)}``: the embedded default (seed 1, shortened: tests/test_embedded_default.py), GRPO for 4
    steps with checkpoints at 2 and 4, the same run resumed from its step-2 checkpoint, LoRA GRPO, gate SFT."""
    from gate.train.render import render_rows
    from tests.test_embedded_default import default_config
    from tests.test_gate_sft import gate_records, sft_config

    world = (tiny_world, tiny_index_dir, tiny_refiner)
    (tmp / "gate").mkdir()
    lora = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"], learning_rate=1e-2)
    resume = str(tmp / "grpo" / "run" / "checkpoint-2")
    rows = render_rows("hkb", gate_records(tiny_world))
    gate = sft_config(tmp / "gate", tiny_gate_vlm, "hkb", rows, per_device_train_batch_size=2, ddp_timeout=120)[-1]
    return {
        "embedded_default": (
            "rl.train_grpo",
            default_config(tmp / "embedded_default", small_default_world, 1, max_steps=1),
        ),
        "grpo": ("rl.train_grpo", grpo_config(tmp / "grpo", *world)[-1]),
        "resumed": ("rl.train_grpo", grpo_config(tmp / "resumed", *world, resume_from_checkpoint=resume)[-1]),
        "lora": ("rl.train_grpo", grpo_config(tmp / "lora", *world, max_steps=2, dtype="bfloat16", **lora)[-1]),
        "gate": ("gate.train.sft", gate),
    }


@pytest.fixture(scope="module")
def zero3_run(zero3_jobs):
    folder, log = zero3_jobs["grpo"]
    return folder / "run", log


def test_grpo_under_zero3_saves_the_engines_weights(zero3_run, tiny_refiner, encoders):
    run, output = zero3_run
    check_saved_engine_weights(run, 4, 3, output, tiny_refiner, encoders)  # ZeRO-2: tests/test_multiprocess.py


def test_resuming_a_zero3_checkpoint_continues_the_run(zero3_jobs):
    run, resumed = zero3_jobs["grpo"][0] / "run", zero3_jobs["resumed"][0] / "run"

    def losses(folder):
        state = json.loads((folder / "checkpoint-4" / "trainer_state.json").read_text())
        return {h["step"]: h["loss"] for h in state["log_history"] if "loss" in h}

    full, again = losses(run), losses(resumed)
    assert full[3] == pytest.approx(again[3], abs=1e-5) and full[4] == pytest.approx(again[4], abs=1e-5)
    a, b = engine_weights(run / "checkpoint-4"), engine_weights(resumed / "checkpoint-4")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)


def test_export_gathers_a_checkpoint_that_holds_only_zero_shards(zero3_run, tmp_path):
    """Without zero3_save_16bit_model the Trainer writes a ZeRO-3 checkpoint with a config but no weights beside it:
    rl.export gathers them from the shards (DeepSpeed's zero_to_fp32) instead of loading a randomly initialised
    model; the result is the final model's."""
    import shutil

    from rl.export import ExportArgs, export

    run, _ = zero3_run
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    shards_only = tmp_path / "shards-only" / "checkpoint-4"  # a copy: the shared run's checkpoint keeps its weights
    shutil.copytree(run / "checkpoint-4", shards_only)
    shutil.copy(run / "refine_rl_run.json", shards_only.parent)  # the run's record, beside its checkpoints
    for f in shards_only.glob("*.safetensors"):
        f.unlink()
    assert not [*shards_only.glob("*.safetensors"), *shards_only.glob("pytorch_model*.bin")]  # no weights beside it
    step = shards_only / (shards_only / "latest").read_text().strip()
    assert list(step.glob("*model_states.pt"))  # only the ZeRO shards (DeepSpeed's global_step*/), named by latest
    # a Qwen chat checkpoint stops at two ids where its config.json names one: from_config alone lost the second
    generation = json.loads((shards_only / "generation_config.json").read_text())
    eos = [generation["eos_token_id"]] if isinstance(generation["eos_token_id"], int) else generation["eos_token_id"]
    (shards_only / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [*eos, 0]}))
    export(
        ExportArgs(checkpoint=str(shards_only), out=str(tmp_path / "exported"), dtype="fp32", verify=False),
        log=lambda *a: None,
    )  # the weights are compared below; the fresh-process check: tests/test_export.py
    assert json.loads((tmp_path / "exported" / "generation_config.json").read_text())["eos_token_id"] == [*eos, 0]
    exported, final = reloaded(tmp_path / "exported"), reloaded(run / "final")
    assert exported.keys() == final.keys()
    for k in final:
        assert torch.equal(exported[k], final[k]), k
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # nothing written into the shared run


# --------------------------------------------------------------------------- LoRA under ZeRO-3, and export


def test_lora_under_zero3_exports_merged_from_final_and_from_a_checkpoint(zero3_jobs, tiny_refiner, tmp_path):
    from rl.export import ExportArgs, export

    folder, output = zero3_jobs["lora"]
    # no mixed precision on the CPU: zero.Init made every parameter fp32 though bfloat16 was asked, and TRL left the
    # adapters in the weights' dtype (on GPUs with bf16 mixed precision, both are bf16)
    assert (
        "weights in float32, frozen (ZeRO-3's partitioned init casts every parameter to float32, not the "
        "bfloat16 asked for); LoRA adapters in float32 (TRL: autocast_adapter_dtype=False under ZeRO-3)" in output
    )
    run = folder / "run"
    adapter = load_file(str(run / "final" / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter) and all(v.numel() > 0 for v in adapter.values())
    assert {v.dtype for v in adapter.values()} == {torch.float32}  # as the line says
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at zero: it moved
    # rl.export from the step-2 ZeRO checkpoint folder (the adapter, merged) gives the final adapter merged here
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    export(
        ExportArgs(checkpoint=str(run / "checkpoint-2"), out=str(tmp_path / "exported"), dtype="fp32", verify=False),
        log=lambda *a: None,
    )
    merged = reloaded(tmp_path / "exported")
    base = AutoModelForImageTextToText.from_pretrained(str(tiny_refiner), dtype=torch.float32)
    here = PeftModel.from_pretrained(base, str(run / "final")).merge_and_unload().state_dict()
    start = reloaded(tiny_refiner)
    assert merged.keys() == start.keys() == here.keys()
    moved = [k for k in start if not torch.equal(start[k], merged[k])]
    assert moved and all(("q_proj" in k or "v_proj" in k) and not is_vision(k) for k in moved)
    for k in merged:
        torch.testing.assert_close(merged[k], here[k], msg=k)


# --------------------------------------------------------------------------- gate SFT under ZeRO-3


def test_gate_sft_under_zero3(zero3_jobs, tiny_world, tiny_gate_vlm):
    from gate.train.render import render_rows
    from tests.test_gate_sft import gate_records

    out = zero3_jobs["gate"][0] / "hkb"
    rows = render_rows("hkb", gate_records(tiny_world))
    base, tuned = weights(tiny_gate_vlm), weights(out / "final")
    assert base.keys() == tuned.keys()
    changed = {k for k in base if not torch.equal(base[k], tuned[k])}
    assert changed and not any("visual" in k for k in changed)
    assert all(any(p in k for p in ("q_proj", "k_proj", "v_proj")) for k in changed)
    assert json.loads((out / "gate_eval.json").read_text())["n"] == len(rows)
    assert not (out / "trained").exists()
