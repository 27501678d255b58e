"""The run record: what a GRPO run writes for export and inference to find later (JSON; TRL's own
``training_args.bin`` is a pickle, which we never read)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from common.files import file_fingerprint, read_json, readable_records, write_json_atomic, write_jsonl_atomic
from retrieval.index import MANIFEST_FILE
from rl.prompts import prompt_spec

RUN_RECORD = "refine_rl_run.json"
RUN_LOGS = ("completions.rank*.jsonl", "samples.jsonl")  # appended to step by step, each record with its "step"


# What a resumed run must train under as its checkpoint's run did (refiner_args by name; the other sections whole):
# the index's encoders, α and the reward, the prompt, the sampling, the update's settings but max_steps (a run may be
# extended), the training questions' content. Paths may move between machines, and are not compared.
RESUME_FIXED_ARGS = (
    "alpha",
    "depth",
    "reward_tiers",
    "miss_reward",
    "unparseable_retrieval_reward",
    "format_valid_reward",
    "format_invalid_reward",
    "max_query_tokens",
    "freeze_vision_tower",
    "min_pixels",
    "max_pixels",
    "completions_per_step",
)
RESUME_FIXED_SECTIONS = ("prompt", "generation", "optimisation", "train_content")


def resume_differences(saved: dict, now: dict) -> list[str]:
    """The settings a resumed run (``now``) trains under otherwise than its checkpoint's run (``saved``), as
    ``name: saved → now``; a setting the saved record lacks (an older version) is not held against it."""
    pairs = [(f"--{k}", saved.get("refiner_args", {}), now["refiner_args"], k) for k in RESUME_FIXED_ARGS]
    pairs += [(f"index {k}", saved.get("index", {}), now["index"], k) for k in ("image_encoder", "text_encoder")]
    pairs += [(k, saved, now, k) for k in RESUME_FIXED_SECTIONS]
    out = []
    for name, old, new, key in pairs:
        a, b = old.get(key, new.get(key)), new.get(key)
        if key == "optimisation" and isinstance(a, dict) and isinstance(b, dict):
            a, b = ({k: v for k, v in d.items() if k != "max_steps"} for d in (a, b))
        if a != b:
            out.append(f"{name}: {a!r} → {b!r}")
    return out


def check_resume(checkpoint, record: dict) -> None:
    """Refuse to resume ``checkpoint`` under other settings than its run's (``resume_differences``), naming them: its
    weights and optimizer state were trained for those, and the run record, export and card would report only the
    new ones. A checkpoint with no run record beside it is not checked; one that is not a folder is TRL's to name."""
    if not Path(checkpoint).is_dir():
        return
    saved = find_run_record(Path(checkpoint))
    differ = resume_differences(saved, record) if saved is not None else []
    if differ:
        raise ValueError(
            f"resume_from_checkpoint {checkpoint}: its run trained under other settings ("
            + "; ".join(differ)
            + "): resume with those, or start a new run from its weights (model_name_or_path)"
        )


def check_output_dir(output_dir: Path, record: dict) -> None:
    """Refuse a new run (no resume) into a folder holding what another run trained (checkpoints, ``final/``,
    metrics) under other settings, another base model, seed or max_steps: they would be replaced without a word. The
    same run again (the same command) may replace them, and a run that stopped before its first checkpoint (out of
    memory in step 1) may be tried again under other settings."""
    output_dir = Path(output_dir)
    path = output_dir / RUN_RECORD
    if not path.is_file():
        return
    checkpoints = checkpoint_folders(output_dir)
    trained = [p.name for p in (*checkpoints, output_dir / "final", output_dir / "metrics.json") if p.exists()]
    if not trained:
        return
    saved = read_json(path)
    differ = resume_differences(saved, record)
    for name, key in (("base model", "base_model"), ("--seed", "seed"), ("--max_steps", "max_steps")):
        a = saved.get(key, saved.get("optimisation", {}).get(key))
        b = record.get(key, record["optimisation"].get(key))
        if a is not None and a != b:
            differ.append(f"{name}: {a!r} → {b!r}")
    if differ:
        resumable = [p for p in checkpoints if saved_step(p) is not None]
        resume = f", or resume it (--resume_from_checkpoint {resumable[-1]})" if resumable else ""
        raise ValueError(
            f"--output_dir {output_dir} holds another run ({'; '.join(differ)}): a new run would replace its "
            f"{', '.join(trained[-3:])}. Choose another --output_dir, delete it{resume}"
        )


def trim_run_logs(output_dir: Path, checkpoint=None) -> None:
    """The logs a run appends to step by step (``RUN_LOGS``), as the run starts: a resume keeps the records up to its
    checkpoint's step (the steps after it are done again: they were appended twice), a new run none of them. A
    checkpoint without its step (no trainer_state.json) leaves them as they are."""
    step = checkpoint_step(checkpoint) if checkpoint else None
    if checkpoint and step is None:
        return
    for pattern in RUN_LOGS:
        for path in sorted(Path(output_dir).glob(pattern)):
            if step is None:
                path.unlink()
            else:  # a line a killed run cut short is left out: these are logs, not anyone's input
                steps = ((r, r.get("step", 0)) for r in readable_records(path))
                write_jsonl_atomic(path, [r for r, s in steps if isinstance(s, int) and s <= step])


def checkpoint_folders(run_dir) -> list[Path]:
    """A run folder's ``checkpoint-N`` folders, oldest first (by N, as transformers orders them)."""
    found = [p for p in Path(run_dir).glob("checkpoint-*") if p.is_dir() and p.name.split("-", 1)[1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-", 1)[1]))


def saved_step(checkpoint) -> int | None:
    """``checkpoint_step``, None for a trainer_state.json a run killed mid-save left unreadable too."""
    try:
        return checkpoint_step(checkpoint)
    except ValueError:
        return None


def checkpoint_step(checkpoint) -> int | None:
    """The optimizer step a checkpoint folder was saved at (its trainer_state.json), None when it has none."""
    state = Path(checkpoint) / "trainer_state.json"
    return read_json(state).get("global_step") if state.is_file() else None


def make_run_record(
    args,
    training_args,
    model_path: str,
    image_budget: dict | None = None,
    precision: str | None = None,
) -> dict:
    """What ``write_run_record`` writes."""
    manifest = read_json(Path(args.index) / MANIFEST_FILE)
    return {
        "base_model": str(Path(model_path).resolve()) if Path(model_path).exists() else model_path,
        "refiner_args": asdict(args),
        "prompt": prompt_spec(args.prompt),
        "index": {
            "path": str(Path(args.index).resolve()),
            "alpha": args.alpha,
            "image_encoder": manifest["image_encoder"],
            "text_encoder": manifest["text_encoder"],
        },
        "generation": {  # every sampling setting TRL passes to generation, so an export samples the same way
            "temperature": training_args.temperature,
            "top_p": training_args.top_p,
            "top_k": training_args.top_k,
            "min_p": training_args.min_p,
            "repetition_penalty": training_args.repetition_penalty,
            "max_new_tokens": training_args.max_completion_length,
        },
        "optimisation": {  # what GRPO trained on: how the two rewards were combined, and the update's settings
            "reward_weights": list(training_args.reward_weights) if training_args.reward_weights else None,
            "multi_objective_aggregation": training_args.multi_objective_aggregation,
            "scale_rewards": training_args.scale_rewards,
            "num_generations": training_args.num_generations,
            "learning_rate": training_args.learning_rate,
            "beta": training_args.beta,
            "loss_type": training_args.loss_type,
            "max_steps": training_args.max_steps,
        },
        "image_budget": image_budget,
        "precision": precision,
        "seed": training_args.seed,
        "train_content": file_fingerprint(args.train_file),
    }


def write_run_record(output_dir: Path, record: dict) -> None:
    write_json_atomic(Path(output_dir) / RUN_RECORD, record)


def find_run_record(path: Path) -> dict | None:
    """The record of the run a checkpoint (or final folder, or run dir) belongs to, if there is one."""
    for folder in (path, path.parent, path.parent.parent):
        if (folder / RUN_RECORD).exists():
            return read_json(folder / RUN_RECORD)
    return None
