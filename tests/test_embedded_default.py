"""The embedded default as `make demo` runs it: two CPU processes over gloo (torchrun, which accelerate's
configs/accelerate/cpu2.yaml starts), shortened. The same seed twice gives the same learning table; another seed
another warm start. Plus the pieces: the batch split over processes, the warm start's reuse check, one progress bar
per training phase."""

import json
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from common.placement import per_device_batch
from rl import arguments as tg
from tests.test_multiprocess import encoder_elements, two_processes
from toy.embedded_default import Arguments as ToyArguments

ROOT = Path(__file__).resolve().parent.parent
WARM_START_STEPS = 12  # the runs below, shortened (the embedded default takes 1200): what they check needs a few


# --------------------------------------------------------------------------- the batch over processes


@pytest.mark.parametrize(
    "total,processes,accumulation,per_device",
    [
        (32, 1, 1, 32),
        (32, 2, 1, 16),
        (32, 2, 2, 8),
        (16, 8, 1, 2),
        (160, 8, 1, 20),
        (1, 1, 1, 1),
    ],
)
def test_per_device_batch_splits_the_total(total, processes, accumulation, per_device):
    assert per_device_batch(total, processes, accumulation, "x") == per_device
    assert per_device * processes * accumulation == total


@pytest.mark.parametrize("total,processes,accumulation", [(32, 3, 1), (0, 1, 1), (16, 2, 3), (-8, 2, 1), (6, 2, 2)])
def test_per_device_batch_refuses_an_uneven_split_naming_the_setting(total, processes, accumulation):
    with pytest.raises(ValueError, match=r"completions_per_step \(" + str(total)):
        per_device_batch(total, processes, accumulation, "completions_per_step")


@pytest.mark.parametrize("accumulation", [0, -1])
def test_per_device_batch_refuses_an_accumulation_that_is_not_positive(accumulation):
    with pytest.raises(ValueError, match=f"gradient_accumulation_steps must be positive, got {accumulation}"):
        per_device_batch(32, 1, accumulation, "completions_per_step")  # 0 divided by zero, -1 gave -32


def test_a_fractional_completions_per_step_from_yaml_is_named(tmp_path):
    """TRL's parser hands YAML values over unconverted: 32.0 became --per_device_train_batch_size 16.0, an argparse
    error about a flag nobody gave."""
    config = tmp_path / "c.yaml"
    config.write_text("completions_per_step: 32.0\n")
    argv = ["--config", str(config)]
    with pytest.raises(ValueError, match="completions_per_step must be a whole number, got 32.0"):
        tg.with_completions_per_step(argv, tg.early_settings(argv), 2)


def test_world_is_read_as_argparse_reads_it(tmp_path):
    """``--world=module`` is the same flag as ``--world module``; a config that is not a mapping is named."""
    from rl.arguments import world_module

    assert world_module(["--world=toy.embedded_default"]).__name__ == "toy.embedded_default"
    assert world_module(["--world", "toy.embedded_default"]).__name__ == "toy.embedded_default"
    (tmp_path / "list.yaml").write_text("- alpha: 0.3\n")
    with pytest.raises(ValueError, match="a YAML mapping of settings is needed, got a list"):
        world_module(["--config", str(tmp_path / "list.yaml")])


def parse_toy(extra=()):
    from trl import GRPOConfig, ModelConfig

    from common.cli import parse

    argv = ["--config", str(tg.DEFAULT_CONFIG), *extra]
    return argv, parse((tg.RefinerArguments, GRPOConfig, ModelConfig, ToyArguments), argv)


@pytest.mark.parametrize("processes", [1, 2, 4])
def test_the_embedded_default_takes_32_completions_a_step_however_many_processes(processes):
    from trl import GRPOConfig, ModelConfig

    from common.cli import parse

    argv = ["--config", str(tg.DEFAULT_CONFIG)]
    early = tg.early_settings(argv)
    assert early.completions_per_step == 32
    argv = tg.with_completions_per_step(argv, early, processes)
    args, training, _, _ = parse((tg.RefinerArguments, GRPOConfig, ModelConfig, ToyArguments), argv)
    assert training.per_device_train_batch_size * processes * training.gradient_accumulation_steps == 32
    assert "4 prompts × 8 generations = 32 completions" in tg.validate(
        args, training, SimpleNamespace(model_name_or_path="tiny"), processes
    )


@pytest.mark.parametrize("generations,per_step", [(5, 20), (3, 12), (7, 28)])
def test_a_group_size_that_does_not_divide_trls_default_batch_still_parses(generations, per_step):
    """GRPOConfig checks its generation batch against num_generations as soon as it is built: the per-device batch
    completions_per_step implies is among the flags before that (TRL's default batch of 8 holds no group of 5)."""
    from trl import GRPOConfig

    flags = ["--num_generations", str(generations), "--completions_per_step", str(per_step)]
    flags += ["--per_device_eval_batch_size", str(per_step)]
    with pytest.raises(ValueError, match="must be divisible by num_generations"):  # what a parse of the flags alone did
        parse_toy(flags)
    argv = ["--config", str(tg.DEFAULT_CONFIG), *flags]
    argv = tg.with_completions_per_step(argv, tg.early_settings(argv), 1)
    _, (_, training, _, _) = parse_toy(argv[2:])
    assert isinstance(training, GRPOConfig)
    assert training.per_device_train_batch_size == per_step and training.num_generations == generations


def test_early_settings_read_the_config_and_let_flags_override_it():
    flags = ["--ddp_timeout", "77", "--lora_r", "4", "--use_peft", "--gradient_accumulation_steps", "2"]
    early = tg.early_settings(["--config", str(tg.DEFAULT_CONFIG), *flags])  # other flags are left alone
    toy = yaml.safe_load(tg.DEFAULT_CONFIG.read_text())
    assert toy["use_cpu"] is True and toy["completions_per_step"] == 32  # neither is the default
    assert (early.use_cpu, early.completions_per_step) == (True, 32)
    assert (early.ddp_timeout, early.gradient_accumulation_steps) == (77, 2)


def test_the_process_group_starts_with_ddp_timeout_on_cpus(monkeypatch):
    """Under torchrun on CPUs, the first init_process_group (accelerate's, for the run's first PartialState) gets
    --ddp_timeout: GRPOConfig's own device setup would start the group first, with no timeout on that path. Run as
    rank 0 of 2 up to that call, which a recording stand-in replaces."""
    import torch.distributed
    from accelerate.state import AcceleratorState

    class Started(Exception):
        pass

    calls = []

    def init_process_group(**kwargs):
        calls.append(kwargs)
        raise Started

    env = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    for name, value in (env | {"MASTER_PORT": "29999", "OMP_NUM_THREADS": "1"}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with pytest.raises(Started):
            tg.parse_arguments(["--ddp_timeout", "77"])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert len(calls) == 1 and calls[0]["backend"] == "gloo" and calls[0]["world_size"] == 2
    assert calls[0].get("timeout") == timedelta(seconds=77)


def test_a_config_given_with_an_equals_sign_is_not_the_embedded_default(capsys):
    """``--config=FILE`` is read as ``--config FILE``: it was taken for no config, and the embedded default's was put
    before it."""
    evqa = tg.DEFAULT_CONFIG.parents[2] / "configs" / "grpo" / "evqa.yaml"
    args, *_ = tg.parse_arguments([f"--config={evqa}", "--use_cpu", "true", "--bf16", "false"])
    assert args.alpha == 0.59 and "no --config given" not in capsys.readouterr().out


def test_an_explicit_per_device_batch_that_disagrees_is_an_error_naming_both():
    def early(extra):
        argv = ["--config", str(tg.DEFAULT_CONFIG), *extra]
        return argv, tg.early_settings(argv)

    argv, settings = early(["--per_device_train_batch_size", "8"])
    with pytest.raises(
        ValueError,
        match="completions_per_step 32 over 2 processes means "
        "--per_device_train_batch_size 16, but --per_device_train_batch_size 8",
    ):
        tg.with_completions_per_step(argv, settings, 2)
    argv, settings = early(["--per_device_train_batch_size=8"])  # the `=` form too
    with pytest.raises(ValueError, match="but --per_device_train_batch_size 8 was given"):
        tg.with_completions_per_step(argv, settings, 2)
    argv, settings = early(["--per_device_train_batch_size", "16"])
    assert tg.with_completions_per_step(argv, settings, 2)[-2:] == ["--per_device_train_batch_size", "16"]
    argv, settings = early(["--completions_per_step", "0", "--per_device_train_batch_size", "8"])
    assert tg.with_completions_per_step(argv, settings, 2) == argv


# --------------------------------------------------------------------------- the warm start's reuse check


def test_a_finished_warm_start_is_reused_only_with_the_same_settings(tmp_path, monkeypatch):
    from toy.refiner import run_warm_start

    base, out = tmp_path / "base", tmp_path / "warm"
    out.mkdir()
    settings = {
        "base": str(base.resolve()),
        "steps": 20,
        "batch_size": 16,
        "learning_rate": 1e-3,
        "shift_fraction": 0.5,
        "seed": 0,
    }
    (out / "warm_start.json").write_text(json.dumps({"settings": settings, "processes": 2, "train_loss": 1.0}))
    monkeypatch.setattr("toy.refiner.load_model", lambda *a, **k: pytest.fail("a finished warm start was redone"))
    said = []
    assert run_warm_start(base, tmp_path, out, 20, 16, 1e-3, 0.5, seed=0, log=said.append) == out
    assert "reusing" in said[0]
    with pytest.raises(ValueError, match=r"seed: 0 there, 1 now.*delete it or choose another --output_dir"):
        run_warm_start(base, tmp_path, out, 20, 16, 1e-3, 0.5, seed=1)
    with pytest.raises(ValueError, match=r"batch_size: 16 there, 32 now; steps: 20 there, 40 now"):
        run_warm_start(base, tmp_path, out, 40, 32, 1e-3, 0.5, seed=0)
    assert json.loads((out / "warm_start.json").read_text())["settings"] == settings  # nothing overwritten
    (out / "warm_start.json").write_text(json.dumps({"steps": 20, "shift_fraction": 0.5, "train_loss": 1.0}))
    with pytest.raises(ValueError, match="earlier version that recorded no settings"):
        run_warm_start(base, tmp_path, out, 20, 16, 1e-3, 0.5, seed=0)


# --------------------------------------------------------------------------- one progress bar per phase


def test_a_phase_shows_one_bar_and_ends_with_one_summary_line(capsys):
    from rl.monitor import PhaseProgress

    progress = PhaseProgress("GRPO", {"reward": "reward", "eval_retrieval/hit@1": "val hit@1"})
    state = SimpleNamespace(is_world_process_zero=True, max_steps=3, global_step=0)
    args = SimpleNamespace()
    progress.on_train_begin(args, state, None)
    logs = [
        {"reward": 1.5, "loss": 0.1, "completions": "text"},
        {"eval_retrieval/hit@1": 0.25},
        {"reward": 2.0, "loss": 0.2},
        {"train_runtime": 9.0},
    ]
    for step, log in enumerate(logs, 1):
        state.global_step = min(step, 3)
        progress.on_step_end(args, state, None)
        progress.on_log(args, state, None, logs=log)
    progress.on_prediction_step(args, state, None, eval_dataloader=[1, 2])
    assert progress.prediction_bar is None  # evaluation adds no bar of its own
    assert progress.training_bar.postfix == "reward=2, val hit@1=0.25"
    progress.on_train_end(args, state, None)
    out = capsys.readouterr()
    lines = [x for x in out.out.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("GRPO: 3 steps in ")
    assert lines[0].endswith("reward 1.5 → 2, val hit@1 0.25")
    assert "loss" not in out.out + out.err and "{" not in out.out + out.err  # no log dicts printed


def test_other_processes_draw_no_bar_and_print_nothing(capsys):
    from rl.monitor import PhaseProgress

    progress = PhaseProgress("warm start", {"loss": "loss"})
    state = SimpleNamespace(is_world_process_zero=False, max_steps=3, global_step=1)
    progress.on_train_begin(None, state, None)
    progress.on_log(None, state, None, logs={"loss": 1.0})
    progress.on_train_end(None, state, None)
    out = capsys.readouterr()
    assert progress.training_bar is None and out.out == "" and out.err == ""


# --------------------------------------------------------------------------- two processes, seeded


def default_settings(world: Path, out: Path, seed: int, **overrides) -> dict:
    """The embedded default's settings that the runs below change: shortened, on the small default world."""
    settings = dict(
        toy_world=str(world),
        index=str(world / "index"),
        train_file=str(world / "train.jsonl"),
        eval_file=str(world / "val.jsonl"),
        output_dir=str(out),
        seed=seed,
        warm_start_steps=WARM_START_STEPS,
        max_steps=2,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        log_table_steps=0,
        logging_steps=1,
        ddp_timeout=120,
    )
    return settings | overrides


def run_default(world: Path, out: Path, seed: int) -> str:
    """The embedded default (shortened, no --config) as two CPU processes over gloo, the way `make demo` launches it."""
    flags = [x for k, v in default_settings(world, out, seed).items() for x in (f"--{k}", str(v))]
    proc = two_processes([str(ROOT / "rl" / "train_grpo.py"), *flags], cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def default_config(folder: Path, world: Path, seed: int, **overrides) -> Path:
    """``folder/cfg.yaml``: the embedded default's config (configs/grpo/toy.yaml) with the shortened settings, for
    the suite's shared launches (conftest.py: seed 0 again in ``torchrun_jobs``, seed 1 under ZeRO-3 in
    ``zero3_jobs``); its output in ``folder/run``."""
    config = yaml.safe_load(tg.DEFAULT_CONFIG.read_text()) | default_settings(world, folder / "run", seed, **overrides)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cfg.yaml").write_text(yaml.safe_dump(config))
    return folder / "cfg.yaml"


@pytest.fixture(scope="module")
def seeded_runs(small_default_world, torchrun_jobs, zero3_jobs, tmp_path_factory):
    """Seed 0 twice (same learning table?) and seed 1 (another base and warm start), each in its own processes.
    Seed 0 first runs as `make demo` launches it (no --config), then again from its config as the first job of the
    suite's shared torchrun launch. Seed 1 runs under DeepSpeed ZeRO-3 (configs/accelerate/zero3-cpu2.yaml), which
    once hung there, as the first job of the suite's ZeRO-3 launch: what its seed test checks holds under any
    launcher. Shared launches keep `make test` short: each start of two processes costs ~11 s here."""
    tmp = tmp_path_factory.mktemp("seeded")
    runs, output = {"seed0": tmp / "seed0"}, {}
    output["seed0"] = run_default(small_default_world, runs["seed0"], 0)
    for name, jobs in (("seed0-again", torchrun_jobs), ("seed1", zero3_jobs)):
        folder, output[name] = jobs["embedded_default"]
        runs[name] = folder / "run"
    return runs, output


def learning(run: Path) -> dict:
    table = json.loads((run / "learning.json").read_text())
    return {f"{name}/{k}": v for name in ("original", "warm_start", "grpo") for k, v in table[name].items()}


def test_two_processes_share_the_warm_start_and_grpo(seeded_runs, small_default_world):
    runs, output = seeded_runs
    text = output["seed0"]
    assert "rank 0/2 on cpu:0 (DistributedType.MULTI_CPU, 1 CPU threads)" in text and "rank 1/2" in text
    assert "= 32 completions per optimizer step (2 processes × 16 × 1 accumulation)" in text
    assert text.count("no --config given") == 1 and text.count("batch geometry") == 1  # said once, not per rank
    assert "already generated" in text  # the 48-entity world given with --toy_world is used as it is
    assert json.loads((small_default_world / "world.json").read_text())["entities"] == 48
    warm = json.loads((runs["seed0"] / "warm_start" / "warm_start.json").read_text())
    assert (
        warm["processes"] == 2
        and warm["settings"]["batch_size"] == 16
        and warm["settings"]["steps"] == WARM_START_STEPS
    )
    assert warm["settings"]["base"].endswith("tiny-base-seed0")


def test_the_same_seed_gives_the_same_learning_table_with_two_processes(seeded_runs):
    runs, _ = seeded_runs
    a, b = learning(runs["seed0"]), learning(runs["seed0-again"])
    assert a.keys() == b.keys() and "grpo/R@1" in a
    for k in a:
        assert a[k] == pytest.approx(b[k], abs=1e-9), k
    for name in ("grpo", "warm_start"):
        queries = [
            [json.loads(x)["query"] for x in open(r / f"test_queries_{name}.jsonl", encoding="utf-8")]
            for r in (runs["seed0"], runs["seed0-again"])
        ]
        assert queries[0] == queries[1]
    losses = [
        [h["loss"] for h in json.loads((r / "metrics.json").read_text())["log_history"] if "loss" in h]
        for r in (runs["seed0"], runs["seed0-again"])
    ]
    assert len(losses[0]) == 2 and losses[0] == pytest.approx(losses[1], abs=1e-9)


def test_the_seed_reaches_the_base_model_and_the_warm_start(seeded_runs):
    runs, _ = seeded_runs
    warm = [json.loads((runs[n] / "warm_start" / "warm_start.json").read_text()) for n in ("seed0", "seed1")]
    assert [w["settings"]["seed"] for w in warm] == [0, 1]
    assert abs(warm[0]["train_loss"] - warm[1]["train_loss"]) > 1e-4
    assert (runs["seed1"] / "tiny-base-seed1" / "config.json").exists()
    from safetensors.numpy import load_file

    bases = [load_file(runs[n] / f"tiny-base-seed{s}" / "model.safetensors") for n, s in (("seed0", 0), ("seed1", 1))]
    name = next(k for k in bases[0] if k.endswith("embed_tokens.weight"))
    assert abs(bases[0][name] - bases[1][name]).max() > 1e-3


def test_the_embedded_default_under_zero3_prints_its_learning_table(seeded_runs):
    """Under ZeRO-3 (seed 1's run): process 0 builds the tiny base model outside the partitioned init (inside it, every
    new parameter is a broadcast the other process never joins: the run hung), the warm start is one SFT job over
    both processes, and process 0 alone computes the learning table from the saved weights."""
    runs, output = seeded_runs
    out = output["seed1"]
    assert (
        "rank 0/2 on cpu:0 (DeepSpeed ZeRO-3 over gloo, 1 CPU threads); weights in float32 (ZeRO-3's "
        "partitioned init casts every parameter to float32)"
        in out
        and "rank 1/2" in out
    )
    assert (runs["seed1"] / "tiny-base-seed1" / "config.json").exists()  # built in this run, by process 0
    assert json.loads((runs["seed1"] / "warm_start" / "warm_start.json").read_text())["processes"] == 2
    table = json.loads((runs["seed1"] / "learning.json").read_text())
    assert {"original", "warm_start", "grpo"} <= set(table) and table["test_questions"] == 48
    assert "| grpo |" in out
    whole = encoder_elements(out)
    assert set(whole) == {0, 1} and whole[0] == whole[1] > 0  # the MiniLM encoder whole on both processes


@pytest.mark.parametrize(
    "world,message",
    [("no_such_module_xyz", "no module 'no_such_module_xyz'"), ("common.files", "lacks Arguments, prepare, report")],
)
def test_a_world_that_is_not_a_hook_module_is_refused_naming_it(world, message):
    with pytest.raises(ValueError, match=message):
        tg.world_module(["--world", world])


def test_the_embedded_default_names_its_world_in_its_config():
    world = tg.world_module(["--config", str(tg.DEFAULT_CONFIG)])
    assert world.__name__ == "toy.embedded_default" and tg.world_module(["--output_dir", "x"]) is None
