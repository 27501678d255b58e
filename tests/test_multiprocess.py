"""rl/train_grpo.py as two CPU processes over gloo, data parallel under DeepSpeed ZeRO-2 as on 8 GPUs
(configs/accelerate/zero2-cpu2.yaml; plain DDP through torchrun is what tests/test_embedded_default.py runs): it
finishes, each rank scores only its own completions, the logged retrieval metrics are the exact means over both
ranks' completions (also on steps where one rank has no hit at all), eval and checkpoints run, one final model, which
is the engine's own weights. Plus the helpers every multi-process test uses, and a barrier nobody reaches."""

import json
import os
import socket
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
ZERO = {stage: ROOT / "configs" / "accelerate" / f"zero{stage}-cpu2.yaml" for stage in (2, 3)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_processes(
    argv: list[str], cwd: Path, timeout: int = 600, accelerate_config: Path | None = None, **env: str
) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node 2 <argv>`` from ``cwd``: two CPU processes over gloo, one thread each, offline, W&B
    disabled (``env`` adds or overrides variables). The way to test anything distributed on this machine. With
    ``accelerate_config`` (a two-process config such as configs/accelerate/zero3-cpu2.yaml): ``accelerate launch
    --config_file …`` instead, as a user runs it."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",  # a process the launcher stops (its peer failed) has written what it printed
        "WANDB_MODE": "disabled",
        **env,
    }
    if accelerate_config is None:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    else:
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config)]
        launcher.append("--main_process_port")
    for _ in range(3):  # a port free when chosen may be taken before the launcher binds it: then another port
        proc = subprocess.run(
            [*launcher, str(free_port()), *argv], env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd
        )
        if proc.returncode == 0 or not port_taken(proc.stderr):
            return proc
    return proc


def port_taken(stderr: str) -> bool:
    """Whether a launch failed because its rendezvous port was taken (nothing of the job ran then)."""
    return "address already in use" in stderr.lower() or "EADDRINUSE" in stderr


def launch_jobs(
    jobs: dict, folder: Path, accelerate_config: Path | None = None, timeout: int = 1200, **env: str
) -> dict:
    """Several jobs one after the other in one launch of two processes (tests/scripts/run_jobs.py), ``jobs`` being
    ``{name: (module, config)}``: each start of two processes costs ~11 s here (the launcher's and each process's
    imports of torch, transformers, TRL), whatever the job. Fails on a non-zero exit or past ``timeout`` seconds for
    all the jobs together; returns each job's log (both processes', process 0's first) by name. ``env``: as for
    ``two_processes``."""
    argv = [str(ROOT / "tests" / "scripts" / "run_jobs.py"), str(folder)]
    for module, config in jobs.values():
        argv += [module, str(config)]
    proc = two_processes(argv, cwd=folder, timeout=timeout, accelerate_config=accelerate_config, **env)
    logs = {
        name: "".join(p.read_text() for p in sorted(folder.glob(f"{i}-{module}.rank*.log")))
        for i, (name, (module, _)) in enumerate(jobs.items())
    }
    assert proc.returncode == 0, proc.stderr[-3000:] + "\n".join(log[-3000:] for log in logs.values())
    return logs


def grpo_config(folder: Path, world: Path, index: Path, model: Path, **overrides) -> list[str]:
    """``folder/cfg.yaml``: a short GRPO run of the tiny refiner on the tiny world (``overrides`` change or add
    settings); the argv that runs it."""
    cfg = dict(
        index=str(index),
        train_file=str(world / "train.jsonl"),
        alpha=0.5,
        prompt="toy",
        model_name_or_path=str(model),
        output_dir=str(folder / "run"),
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        seed=0,
        num_generations=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        max_steps=4,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        temperature=1.0,
        max_completion_length=40,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to="none",
        log_table_steps=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        min_pixels=112 * 112,
        max_pixels=112 * 112,
        ddp_timeout=120,
    )
    cfg.update(overrides)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return [str(ROOT / "rl" / "train_grpo.py"), "--config", str(folder / "cfg.yaml")]


@pytest.fixture(scope="module")
def two_process_runs(tiny_world, tiny_index_dir, tiny_refiner, tmp_path_factory):
    """One launch under ZeRO-2: a GRPO run of 6 steps, 2 prompts a step over 4 questions (epochs of 2 steps), with
    evaluation and checkpoints at 3 and 6; then the same run resumed from checkpoint-3, within epoch 1.
    ``{name: (the run's folder, its log)}``."""
    tmp = tmp_path_factory.mktemp("ddp")
    rows = [json.loads(x) for x in open(tiny_world / "train.jsonl", encoding="utf-8")]
    # two ordinary questions and two whose gold entity is not in the index: those can never hit, so a rank that
    # draws one has no hit at all in that step
    train = rows[:2] + [dict(r, id=f"ghost-{i}", entity_id=f"GHOST{i}") for i, r in enumerate(rows[2:4])]
    (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    settings = dict(
        train_file=str(tmp / "train.jsonl"),
        images_root=str(tiny_world),
        eval_file=str(tiny_world / "val.jsonl"),
        eval_limit=4,
        per_device_eval_batch_size=4,
        max_steps=6,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        eval_strategy="steps",
        eval_steps=3,
        save_steps=3,
        completions_log=True,
    )
    world = (tiny_world, tiny_index_dir, tiny_refiner)
    resume = str(tmp / "run" / "checkpoint-3")
    jobs = {
        "run": ("rl.train_grpo", grpo_config(tmp, *world, **settings)[-1]),
        "resumed": (
            "rl.train_grpo",
            grpo_config(tmp / "resumed", *world, **settings, resume_from_checkpoint=resume)[-1],
        ),
    }
    # an empty model cache: both processes ask for the `tiny` text encoder at once and must share one build
    # (transformers' save_pretrained writes nothing on rank 1 once torch.distributed is up: process 0 builds it)
    (tmp / "cache").mkdir()
    logs = launch_jobs(jobs, tmp, ZERO[2], REFINE_RL_CACHE=str(tmp / "cache"))
    return {"run": (tmp / "run", logs["run"]), "resumed": (tmp / "resumed" / "run", logs["resumed"])}


@pytest.fixture(scope="module")
def two_process_run(two_process_runs):
    return two_process_runs["run"]


def reloaded(folder: Path) -> dict:
    """The weights ``from_pretrained`` gives for a folder, by the model's own parameter names."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_weights(checkpoint: Path) -> dict:
    """The DeepSpeed engine's fp32 weights at a checkpoint, gathered from its ZeRO shards by DeepSpeed itself."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))


def is_vision(name: str) -> bool:
    return ".visual." in name or name.startswith("visual.")


def encoder_elements(output: str) -> dict[int, int]:
    """``rank R: index: … N encoder(s) (E parameter elements here)`` → {R: E}."""
    import re

    return {
        int(r): int(n.replace(",", ""))
        for r, n in re.findall(
            r"rank (\d+): index: [\d,]+ rows, \d encoder\(s\) \(([\d,]+) parameter elements here\)", output
        )
    }


def check_saved_engine_weights(run: Path, steps: int, stage: int, output: str, start_model: Path, encoders) -> None:
    """``final/`` is what the DeepSpeed engine holds at the last checkpoint (fp32 on the CPU: to the last bit), the
    vision tower is bit-identical to the start, the text model moved, the encoders are whole on both processes."""
    assert f"(DeepSpeed ZeRO-{stage} over gloo" in output
    assert (run / f"checkpoint-{steps}" / f"global_step{steps}").is_dir()  # DeepSpeed's own shards
    final, engine = reloaded(run / "final"), engine_weights(run / f"checkpoint-{steps}")
    trained = [k for k in final if not is_vision(k)]
    assert engine.keys() <= final.keys() and set(trained) <= engine.keys()
    for k in engine:
        assert torch.equal(final[k], engine[k].float()), k
    start = reloaded(start_model)
    vision = [k for k in start if is_vision(k)]
    assert vision and all(torch.equal(start[k], final[k]) for k in vision)  # frozen: bit-identical
    assert any(not torch.equal(start[k], final[k]) for k in trained)  # the text model moved
    expected = sum(p.numel() for e in encoders for p in e.model.parameters())
    assert encoder_elements(output) == {0: expected, 1: expected}  # the reward's encoders, whole on both


def completions(run, rank):
    return [json.loads(x) for x in open(run / f"completions.rank{rank}.jsonl", encoding="utf-8")]


def test_both_processes_train_as_one_job(two_process_run):
    run, output = two_process_run
    assert "rank 0/2 on cpu:0 (DeepSpeed ZeRO-2 over gloo, 1 CPU threads)" in output and "rank 1/2 on cpu" in output
    assert "4 prompts × 4 generations = 16 completions" not in output
    assert "2 prompts × 4 generations = 8 completions per optimizer step" in output
    assert (run / "final" / "model.safetensors").exists() and not (run / "final" / "final").exists()
    assert {p.name for p in run.glob("checkpoint-*")} == {"checkpoint-3", "checkpoint-6"}
    state = json.loads((run / "checkpoint-6" / "trainer_state.json").read_text())
    assert sum("eval_retrieval/hit@1" in h for h in state["log_history"]) == 2


def test_both_processes_share_one_build_of_a_tiny_model_on_a_cold_cache(two_process_run):
    run, _ = two_process_run
    built = sorted(p.name for p in (run.parent / "cache").iterdir())
    assert len(built) == 1 and built[0].startswith("tiny-text-")  # one folder, no temporary left behind
    assert (run.parent / "cache" / built[0] / "modules.json").is_file()
    assert (run.parent / "cache" / built[0] / "model.safetensors").is_file()


def test_zero2_saves_the_engines_weights(two_process_run, tiny_refiner, encoders):
    run, output = two_process_run
    check_saved_engine_weights(run, 6, 2, output, tiny_refiner, encoders)


def test_each_rank_scores_only_its_own_completions(two_process_run):
    run, _ = two_process_run
    by_rank = [completions(run, r) for r in (0, 1)]
    for step in range(1, 7):
        ids = [[c["id"] for c in recs if c["step"] == step and c["mode"] == "train"] for recs in by_rank]
        assert len(ids[0]) == len(ids[1]) == 4  # one prompt × 4 generations per rank
        assert len(set(ids[0])) == len(set(ids[1])) == 1 and set(ids[0]) != set(ids[1])


def test_logged_metrics_are_exact_over_both_ranks(two_process_run):
    run, _ = two_process_run
    state = json.loads((run / "checkpoint-6" / "trainer_state.json").read_text())
    logged = {h["step"]: h for h in state["log_history"] if "retrieval/hit@1" in h}
    pooled = defaultdict(list)
    for rank in (0, 1):
        for c in completions(run, rank):
            if c["mode"] == "train":
                pooled[c["step"]].append((rank, c))
    one_rank_without_hits = 0
    for step, recs in pooled.items():
        ranks = [c["rank"] for _, c in recs]
        hits_per_rank = [sum(c["rank"] is not None for r, c in recs if r == k) for k in (0, 1)]
        one_rank_without_hits += min(hits_per_rank) == 0 < max(hits_per_rank)
        for k in (1, 5):
            expected = np.mean([r is not None and r <= k for r in ranks])
            assert logged[step][f"retrieval/hit@{k}"] == pytest.approx(expected, abs=1e-6), (step, k)
        assert logged[step]["retrieval/miss_rate"] == pytest.approx(np.mean([r is None for r in ranks]), abs=1e-6)
        hits = [r for r in ranks if r is not None]
        if hits:
            assert logged[step]["retrieval/mean_hit_rank"] == pytest.approx(np.mean(hits), abs=1e-4)
        else:
            assert "retrieval/mean_hit_rank" not in logged[step]
    assert one_rank_without_hits >= 1


def test_a_run_resumed_within_an_epoch_trains_on_the_uninterrupted_runs_prompts(two_process_runs):
    """Resumed from checkpoint-3 (epoch 1's first step done): with two processes transformers wraps the loader to skip
    the trained batch, and its set_epoch no longer reached TRL's sampler, which drew epoch 0's order for the rest of
    epoch 1 (rl.checkpoints.seed_each_epoch)."""
    (run, _), (resumed, _) = two_process_runs["run"], two_process_runs["resumed"]

    def prompts(folder, rank):
        by_step = {}
        for c in completions(folder, rank):
            if c["mode"] == "train":
                by_step.setdefault(c["step"], set()).add(c["id"])
        return by_step

    for rank in (0, 1):
        full, again = prompts(run, rank), prompts(resumed, rank)
        assert sorted(again) == [4, 5, 6] and all(again[s] == full[s] for s in again), (rank, full, again)
    epochs = [set().union(*(prompts(run, r)[s] for r in (0, 1))) for s in (1, 3)]
    assert epochs[0] != epochs[1]  # epoch 1 starts with other prompts than epoch 0: its own order

    def losses(folder):
        state = json.loads((folder / "checkpoint-6" / "trainer_state.json").read_text())
        return {h["step"]: h["loss"] for h in state["log_history"] if "loss" in h}

    full, again = losses(run), losses(resumed)
    assert all(again[s] == pytest.approx(full[s], abs=1e-5) for s in (4, 5, 6))


def test_a_barrier_nobody_reaches_is_an_error_naming_the_step(tmp_path):
    """A process that never arrives: the other one's barrier fails after the group's timeout (3 s here) with an
    error naming what it waited for, instead of a wait without end."""
    proc = two_processes(
        [str(ROOT / "tests" / "scripts" / "late_process.py"), "3", str(tmp_path / "done")], cwd=tmp_path, timeout=120
    )
    assert proc.returncode != 0
    assert (
        "TimeoutError: process 0/2: the other processes did not arrive at the barrier after process 0 wrote the "
        "shards within the collective timeout" in proc.stdout
    )


def test_a_launch_whose_port_was_taken_meanwhile_goes_on_with_another(tmp_path, monkeypatch):
    """The port ``free_port`` chose can be taken before the launcher binds it (another job on the machine): torchrun
    then fails at its rendezvous, before any process of the job starts, and ``two_processes`` launches again on
    another port."""
    script = tmp_path / "hello.py"
    # one write per line: both processes share the pipe, unbuffered, and print(a, b) writes its pieces one by one
    script.write_text(
        "import os, sys\nsys.stdout.write(f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\\n\")\n"
    )
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        # the module two_processes reads it from (pytest and conftest import this file under two names)
        monkeypatch.setitem(two_processes.__globals__, "free_port", lambda real=free_port: next(ports, None) or real())
        proc = two_processes([str(script)], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and {"rank 0 of 2", "rank 1 of 2"} <= set(proc.stdout.splitlines()), proc.stderr[-2000:]
