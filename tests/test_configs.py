"""The shipped configs parse with TRL's parser into our dataclasses (GRPO, SFT, gate data, pipeline); the real SFT
configs carry the paper's settings; a tiny toy SFT config runs as shipped with only its paths pointed at test data."""

import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SFT = sorted((ROOT / "configs" / "sft").glob("*.yaml"))
VARIANTS = ["hkb", "skb", "kbm-acc", "kbm-cert", "ret", "srt", "mct", "inspector"]


def parse_sft(path, *extra):
    from trl import ModelConfig, SFTConfig

    from gate.train_sft import GateArguments
    from retrieval.cli import parse

    return parse((GateArguments, SFTConfig, ModelConfig), ["--config", str(path), *extra])


def test_every_variant_has_a_real_and_a_toy_config():
    names = {p.stem for p in SFT}
    assert {*VARIANTS, *(f"toy_{v}" for v in VARIANTS), "toy_answerer"} <= names


@pytest.mark.parametrize("path", SFT, ids=lambda p: p.stem)
def test_sft_configs_parse(path):
    from gate.variants import spec

    real = not path.stem.startswith("toy_")
    args, training, model = parse_sft(path, *(["--bf16", "false"] if real else []))  # this machine has no bf16 GPU
    spec(args.variant)
    assert path.stem.removeprefix("toy_") == args.variant or (path.stem == "toy_answerer" and args.variant == "answer")
    assert training.max_length is None and args.freeze_vision_tower
    if real:  # the papers' settings
        assert model.use_peft and model.lora_r == 8 and model.lora_alpha == 32
        assert set(model.lora_target_modules) == {"q_proj", "k_proj", "v_proj"}
        assert training.learning_rate == 1e-4 and training.lr_scheduler_type == "linear"
        assert yaml.safe_load(open(path))["bf16"] is True
        assert training.per_device_train_batch_size == 1 and training.gradient_accumulation_steps == 16
        expected = "Qwen/Qwen3-VL-8B-Instruct" if args.variant == "inspector" else "Qwen/Qwen2.5-VL-7B-Instruct"
        assert model.model_name_or_path == expected


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "pipeline").glob("*.yaml")), ids=lambda p: p.stem)
def test_pipeline_configs_parse(path):
    from gate.pipeline import PipelineArgs
    from gate.stages import GENERATOR_PROMPTS
    from retrieval.cli import parse

    (args,) = parse((PipelineArgs,), ["--config", str(path)])
    assert args.generator_prompt in GENERATOR_PROMPTS and args.gate_threshold is None


def test_toy_data_config_parses():
    from gate.build_data import BuildDataArgs
    from retrieval.cli import parse

    (args,) = parse((BuildDataArgs,), ["--config", str(ROOT / "configs" / "gate" / "toy_data.yaml"), "--stage", "judge"])
    assert args.samples == 10 and args.judge == "exact" and args.refiner == "outputs/refiner"


def test_a_toy_sft_config_runs_as_shipped(tiny_world, tiny_gate_vlm, tmp_path):
    from gate.render import render_rows
    from gate.scoring import load_gate
    from gate.train_sft import main
    from gate.variants import prompt_file_for
    from retrieval.files import write_json_atomic, write_jsonl_atomic

    images = sorted((tiny_world / "images").glob("*_test*.png"))[:6]
    recs = [{"id": f"q{i}", "question": "Where?", "image_path": str(p), "search": i % 2 == 0} for i, p in
            enumerate(images)]
    # rendered with a replacement prompt, as --stage render --gate_prompt writes it: the gate keeps and scores with it
    prompt = {"system": "Published RET wording.", "user_template": "Q: {question}"}
    write_jsonl_atomic(tmp_path / "ret.jsonl", render_rows("ret", recs, prompt=prompt))
    write_json_atomic(prompt_file_for(tmp_path, "ret"), {**prompt, "source": "published.yaml"})
    shipped = yaml.safe_load(open(ROOT / "configs" / "sft" / "toy_ret.yaml"))
    result = main(["--config", str(ROOT / "configs" / "sft" / "toy_ret.yaml"), "--train_file", str(tmp_path / "ret.jsonl"),
                   "--eval_file", str(tmp_path / "ret.jsonl"), "--model_name_or_path", str(tiny_gate_vlm),
                   "--output_dir", str(tmp_path / "out"), "--max_steps", "2", "--per_device_train_batch_size", "3",
                   "--disable_tqdm", "true"])
    assert shipped["use_peft"] and result["eval"]["n"] == 6
    info = json.loads((tmp_path / "out" / "final" / "gate.json").read_text())
    assert info["prompt"] == {"system": "Published RET wording.", "user_template": "Q: {question}"}
    _, _, s = load_gate(tmp_path / "out" / "final")
    assert (s["system"], s["user"]) == ("Published RET wording.", "Q: {question}")


@pytest.mark.parametrize("name", ["toy", "infoseek", "evqa"])
def test_grpo_configs_parse(name):
    from trl import GRPOConfig, ModelConfig

    from retrieval.cli import parse
    from rl.train_grpo import RefinerArguments

    args, training, _ = parse((RefinerArguments, GRPOConfig, ModelConfig),
                              ["--config", str(ROOT / "configs" / "grpo" / f"{name}.yaml"), "--bf16", "false"])
    assert 0.0 <= args.alpha <= 1.0 and (training.per_device_train_batch_size * training.gradient_accumulation_steps
                                         ) % training.num_generations == 0


@pytest.mark.parametrize("name", ["infoseek", "evqa"])
def test_real_grpo_configs_state_the_objective_and_bound_the_checkpoints(name):
    """Parsed as TRL reads them: the paper's per-output GRPO objective (not TRL 1.16's default dapo), every setting of
    it written in the file, and a bounded number of ~52 GB checkpoints."""
    from trl import GRPOConfig, ModelConfig

    from retrieval.cli import parse
    from rl.train_grpo import RefinerArguments

    path = ROOT / "configs" / "grpo" / f"{name}.yaml"
    _, training, _ = parse((RefinerArguments, GRPOConfig, ModelConfig), ["--config", str(path), "--bf16", "false"])
    assert (training.loss_type, training.scale_rewards, training.epsilon, training.beta) == ("grpo", "group", 0.2, 0.0)
    assert training.vllm_importance_sampling_correction and training.vllm_importance_sampling_mode == "sequence_mask"
    assert training.save_total_limit == 2 and training.load_best_model_at_end
    written = yaml.safe_load(path.read_text())
    assert {"loss_type", "scale_rewards", "epsilon", "beta", "vllm_importance_sampling_correction",
            "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max", "save_total_limit"} <= set(written)
