"""The run record: what a GRPO run writes for export and inference to find later (JSON; TRL's own
``training_args.bin`` is a pickle, which we never read)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from common.files import write_json_atomic
from retrieval.index import MANIFEST_FILE
from rl.prompts import prompt_spec

RUN_RECORD = "refine_rl_run.json"


def write_run_record(
    output_dir: Path,
    args,
    training_args,
    model_path: str,
    image_budget: dict | None = None,
    precision: str | None = None,
) -> None:
    manifest = json.loads((Path(args.index) / MANIFEST_FILE).read_text())
    write_json_atomic(
        Path(output_dir) / RUN_RECORD,
        {
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
        },
    )


def find_run_record(path: Path) -> dict | None:
    """The record of the run a checkpoint (or final folder, or run dir) belongs to, if there is one."""
    for folder in (path, path.parent, path.parent.parent):
        if (folder / RUN_RECORD).exists():
            return json.loads((folder / RUN_RECORD).read_text())
    return None
