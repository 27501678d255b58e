"""The shipped configs parse with TRL's parser into our dataclasses (GRPO, SFT, gate data, pipeline); one real and
one toy SFT config serve every gate variant (``--variant``), the real one with the paper's settings; the toy SFT config
runs as shipped with only its paths pointed at test data."""

import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SFT = ROOT / "configs" / "sft"
VARIANTS = ["hkb", "skb", "kbm-acc", "kbm-cert", "ret", "srt", "mct", "inspector"]
RUNS = [("paper", v) for v in VARIANTS] + [("toy", v) for v in VARIANTS] + [("toy_answerer", None)]


def documented_flags(path, variant) -> list[str]:
    """The flags a family config's comment adds for one variant (a line ``#   <variant>: --flag value ...``)."""
    flags = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        head, _, rest = line.lstrip("# ").partition(": ")
        if line.startswith("#") and head == variant and rest.startswith("--"):
            flags += rest.split()
    return flags


def parse_sft(path, *extra):
    from gate.train.sft import parse_args

    return parse_args(["--config", str(path), *extra])


def test_one_real_and_one_toy_config_serve_every_variant():
    assert {p.stem for p in SFT.glob("*.yaml")} == {"paper", "toy", "toy_answerer"}
    from gate.variants import VARIANTS as ALL

    assert set(VARIANTS) == set(ALL) - {"answer"}


@pytest.mark.parametrize("name,variant", RUNS, ids=lambda x: str(x))
def test_sft_configs_parse(name, variant):
    from gate.variants import spec

    path = SFT / f"{name}.yaml"
    real = name == "paper"
    given = ["--variant", variant, *documented_flags(path, variant)] if variant else []
    given += ["--dataset", "evqa"] if real else []
    args, training, model = parse_sft(path, *given, *(["--bf16", "false"] if real else []))  # no bf16 GPU here
    spec(args.variant)
    assert args.variant == (variant or "answer")
    if variant:  # {variant} (and the real config's {dataset}) filled everywhere
        assert args.train_file.endswith(f"/{variant}.train.jsonl") and args.eval_file.endswith(f"/{variant}.test.jsonl")
        assert training.output_dir.endswith(f"-evqa-{variant}" if real else f"/{variant}")
        assert ("/evqa/" in args.train_file and "/evqa/" in args.eval_file) == real
        assert "{" not in f"{args.train_file}{args.eval_file}{training.output_dir}{training.run_name}"
    assert training.max_length is None and args.freeze_vision_tower
    if real:  # the papers' settings
        assert training.run_name == f"refine-rl-sft-evqa-{variant}"
        assert model.use_peft and model.lora_r == 8 and model.lora_alpha == 32
        assert set(model.lora_target_modules) == {"q_proj", "k_proj", "v_proj"}
        assert training.learning_rate == 1e-4 and training.lr_scheduler_type == "linear"
        assert yaml.safe_load(open(path, encoding="utf-8"))["bf16"] is True
        assert training.per_device_train_batch_size == 1 and training.gradient_accumulation_steps == 16
        expected = "Qwen/Qwen3-VL-8B-Instruct" if args.variant == "inspector" else "Qwen/Qwen2.5-VL-7B-Instruct"
        assert model.model_name_or_path == expected
    elif variant == "inspector":  # a full fine-tune of the tiny model
        assert not model.use_peft and training.max_steps == 600 and training.learning_rate == 5e-4
    elif variant:
        assert model.use_peft and model.lora_r == 16 and training.max_steps == 300


def test_a_family_config_needs_a_known_variant(tmp_path, capsys):
    with pytest.raises(ValueError, match="--train_file .*holds \\{variant\\}: give --variant"):
        parse_sft(SFT / "toy.yaml")
    with pytest.raises(ValueError, match="--train_file .*holds \\{dataset\\}: give --dataset \\(infoseek, evqa\\)"):
        parse_sft(SFT / "paper.yaml", "--variant", "hkb", "--bf16", "false")
    with pytest.raises(ValueError, match="--dataset must be a plain name"):
        parse_sft(SFT / "paper.yaml", "--variant", "hkb", "--dataset", "../x", "--bf16", "false")
    with pytest.raises(SystemExit) as refused:  # argparse's choices
        parse_sft(SFT / "toy.yaml", "--variant", "vibes")
    assert refused.value.code == 2 and "argument --variant: invalid choice: 'vibes'" in capsys.readouterr().err
    config = tmp_path / "c.yaml"  # a YAML value is not checked by argparse
    config.write_text(yaml.safe_dump({**yaml.safe_load((SFT / "toy.yaml").read_text()), "variant": "vibes"}))
    with pytest.raises(ValueError, match="--variant: 'vibes' is not one of hkb, skb"):
        parse_sft(config)


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "pipeline").glob("*.yaml")), ids=lambda p: p.stem)
def test_pipeline_configs_parse(path):
    from common.cli import parse
    from gate.pipeline.arguments import PipelineArgs
    from gate.pipeline.stages import GENERATOR_PROMPTS

    (args,) = parse((PipelineArgs,), ["--config", str(path)])
    assert args.generator_prompt in GENERATOR_PROMPTS and args.gate_threshold is None


def test_toy_data_config_parses():
    from common.cli import parse
    from gate.train.build_data import BuildDataArgs

    (args,) = parse(
        (BuildDataArgs,), ["--config", str(ROOT / "configs" / "gate" / "toy_data.yaml"), "--stage", "judge"]
    )
    assert args.samples == 10 and args.judge == "exact" and args.refiner == "outputs/refiner"


@pytest.mark.parametrize("dataset", ["infoseek", "evqa"])
def test_real_gate_data_feeds_the_paper_sft_config_and_the_pipeline(dataset):
    """configs/gate/<dataset>.yaml renders where configs/sft/paper.yaml --dataset reads (a held-out test split
    included), from the refiner and index the pipeline uses; the pipeline reads the gates that SFT run writes."""
    from common.cli import parse
    from gate.pipeline.arguments import PipelineArgs
    from gate.train.build_data import BuildDataArgs

    (data,) = parse(
        (BuildDataArgs,), ["--config", str(ROOT / "configs" / "gate" / f"{dataset}.yaml"), "--stage", "render"]
    )
    (pipeline,) = parse((PipelineArgs,), ["--config", str(ROOT / "configs" / "pipeline" / f"{dataset}.yaml")])
    args, training, _ = parse_sft(SFT / "paper.yaml", "--variant", "srt", "--dataset", dataset, "--bf16", "false")
    assert args.train_file == f"{data.out}/srt.train.jsonl" and args.eval_file == f"{data.out}/srt.test.jsonl"
    assert 0 < data.holdout < 1 and data.alone_rule == "greedy" and data.samples == 30
    assert (data.refiner, data.index, data.model) == (pipeline.refiner, pipeline.index, pipeline.answerer)
    assert data.images_root == pipeline.images_root
    assert pipeline.reranker == f"gate:{training.output_dir}/final"
    assert pipeline.gate == f"{training.output_dir.replace('-srt', '-hkb')}/final"


def test_a_toy_sft_config_runs_as_shipped(tiny_world, tiny_gate_vlm, tmp_path):
    from common.files import write_json_atomic, write_jsonl_atomic
    from gate.scoring import load_gate
    from gate.train.render import render_rows
    from gate.train.sft import main
    from gate.variants import prompt_file_for

    images = sorted((tiny_world / "images").glob("*_test*.png"))[:6]
    recs = [
        {"id": f"q{i}", "question": "Where?", "image_path": str(p), "search": i % 2 == 0} for i, p in enumerate(images)
    ]
    # rendered with a replacement prompt, as --stage render --gate_prompt writes it: the gate keeps and scores with it
    prompt = {"system": "Published RET wording.", "user_template": "Q: {question}"}
    write_jsonl_atomic(tmp_path / "ret.jsonl", render_rows("ret", recs, prompt=prompt))
    write_json_atomic(prompt_file_for(tmp_path, "ret"), {**prompt, "source": "published.yaml"})
    shipped = yaml.safe_load(open(SFT / "toy.yaml", encoding="utf-8"))
    result = main(
        [
            "--config",
            str(SFT / "toy.yaml"),
            "--variant",
            "ret",
            "--train_file",
            str(tmp_path / "ret.jsonl"),
            "--eval_file",
            str(tmp_path / "ret.jsonl"),
            "--model_name_or_path",
            str(tiny_gate_vlm),
            "--output_dir",
            str(tmp_path / "out"),
            "--max_steps",
            "2",
            "--per_device_train_batch_size",
            "3",
            "--disable_tqdm",
            "true",
        ]
    )
    assert shipped["use_peft"] and result["eval"]["n"] == 6
    info = json.loads((tmp_path / "out" / "final" / "gate.json").read_text())
    assert info["prompt"] == {"system": "Published RET wording.", "user_template": "Q: {question}"}
    _, _, s = load_gate(tmp_path / "out" / "final")
    assert (s["system"], s["user"]) == ("Published RET wording.", "Q: {question}")


@pytest.mark.parametrize("name", ["toy", "infoseek", "evqa"])
def test_grpo_configs_parse(name):
    from trl import GRPOConfig, ModelConfig

    from common.cli import parse
    from rl.arguments import RefinerArguments, world_module

    argv = ["--config", str(ROOT / "configs" / "grpo" / f"{name}.yaml"), "--bf16", "false"]
    world = world_module(argv)  # the toy config's world settings join the parse, as in rl.arguments.parse_arguments
    args, training, *_ = parse(
        (RefinerArguments, GRPOConfig, ModelConfig, *((world.Arguments,) if world else ())), argv
    )
    assert (
        0.0 <= args.alpha <= 1.0
        and (training.per_device_train_batch_size * training.gradient_accumulation_steps) % training.num_generations
        == 0
    )


@pytest.mark.parametrize("name", ["infoseek", "evqa"])
def test_real_grpo_configs_state_the_objective_and_bound_the_checkpoints(name):
    """Parsed as TRL reads them: the paper's per-output GRPO objective (not TRL 1.16's default dapo), every setting of
    it written in the file, and a bounded number of ~52 GB checkpoints."""
    from trl import GRPOConfig, ModelConfig

    from common.cli import parse
    from rl.arguments import RefinerArguments

    path = ROOT / "configs" / "grpo" / f"{name}.yaml"
    args, training, _ = parse((RefinerArguments, GRPOConfig, ModelConfig), ["--config", str(path), "--bf16", "false"])
    assert (training.loss_type, training.scale_rewards, training.epsilon, training.beta) == ("grpo", "group", 0.2, 0.0)
    assert training.vllm_importance_sampling_correction and training.vllm_importance_sampling_mode == "sequence_mask"
    assert training.save_total_limit == 2 and training.load_best_model_at_end
    written = yaml.safe_load(path.read_text())
    assert {
        "loss_type",
        "scale_rewards",
        "epsilon",
        "beta",
        "vllm_importance_sampling_correction",
        "vllm_importance_sampling_mode",
        "vllm_importance_sampling_clip_max",
        "save_total_limit",
    } <= set(written)


@pytest.mark.parametrize("name", ["infoseek", "evqa"])
def test_real_grpo_configs_get_the_papers_reward_and_image_budget_from_the_code(name):
    """The reward constants and the image budget are stated once, as RefinerArguments' defaults (from rewards/ and
    rl/image_budget.py): the real configs do not repeat them, and parse to the paper's values."""
    from trl import GRPOConfig, ModelConfig

    from common.cli import parse
    from rewards.rank import DEFAULT_TIERS, parse_tiers
    from rl.arguments import RefinerArguments

    path = ROOT / "configs" / "grpo" / f"{name}.yaml"
    args, _, _ = parse((RefinerArguments, GRPOConfig, ModelConfig), ["--config", str(path), "--bf16", "false"])
    assert (
        parse_tiers(args.reward_tiers)
        == DEFAULT_TIERS
        == ((1, 5, 4.0), (6, 10, 3.5), (11, 20, 3.0), (21, 50, 1.0), (51, 100, 0.5), (101, 200, 0.1))
    )
    assert args.reward_tiers == "1-5:4,6-10:3.5,11-20:3,21-50:1,51-100:0.5,101-200:0.1"
    assert (args.depth, args.miss_reward, args.unparseable_retrieval_reward) == (200, -2.5, -2.5)
    assert (args.format_valid_reward, args.format_invalid_reward, args.max_query_tokens) == (1.0, -4.0, 128)
    assert (args.min_pixels, args.max_pixels) == (3136, 802816)
    stated = {
        "depth",
        "reward_tiers",
        "miss_reward",
        "unparseable_retrieval_reward",
        "format_valid_reward",
        "format_invalid_reward",
        "max_query_tokens",
        "min_pixels",
        "max_pixels",
    }
    assert not stated & set(yaml.safe_load(path.read_text()))


def test_train_grpo_help_lists_every_field(capsys, monkeypatch):
    """--help prints every RefinerArguments, GRPOConfig and ModelConfig field (and the world's), not only the four
    the early parse reads, and starts no process group."""
    import rl.arguments as ra
    import rl.train_grpo as tg

    started = []
    real = ra.early_settings
    monkeypatch.setattr(ra, "early_settings", lambda argv: started.append(argv) or real(argv))
    with pytest.raises(SystemExit) as done:
        tg.main(["--help"])
    said = capsys.readouterr().out
    assert done.value.code == 0 and not started
    for flag in ("--alpha", "--reward_tiers", "--learning_rate", "--num_generations", "--lora_r", "--world"):
        assert f"{flag} " in said
    assert tg.__doc__.split("\n")[0] in said
