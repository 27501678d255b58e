"""Supervised fine-tuning of a gate (knowledge boundary, KBM, token system, Inspector) on rendered gate data.

    accelerate launch gate/train/sft.py --config configs/sft/paper.yaml --variant hkb --dataset infoseek
        [--any_field value ...]

Arguments are TRL's (SFTConfig, ModelConfig: LoRA through PEFT with ``use_peft``) plus GateArguments. One config
serves every variant of a family and every benchmark: ``{variant}`` and ``{dataset}`` in ``train_file``,
``eval_file``, ``output_dir`` and ``run_name`` are replaced by ``--variant`` and ``--dataset`` (an error without
them). The loop is
TRL's SFTTrainer on a conversational prompt–completion dataset with one image per row (``gate.train.build_data --stage
render``), loss on the completion only, vision tower frozen. Everything checkable is checked before a model loads:
the variant, the files, the class balance (printed; an empty class is an error unless ``allow_single_class``), and
that the verbalisers start with different tokens of the model's tokenizer (first-token scoring reads those).

Writes ``output_dir/final``: the merged model (LoRA folded in), its processor and ``gate.json`` (variant,
verbalisers), loadable by ``gate.scoring.load_gate``; and, with ``eval_file``, ``output_dir/gate_eval.json``: the
held-out accuracy of first-token scoring at the default threshold next to the majority-class baseline.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from common.cli import check_choices, parse, require_file
from common.files import atomic_folder, read_json, write_json_atomic
from common.placement import Processes, outside_zero3_init
from gate.scoring import GATE_FILE, verbaliser_ids
from gate.train.evaluation import evaluate_gate, evaluate_generated, read_targets
from gate.train.model_card import write_gate_cards
from gate.train.render import class_balance, format_balance, read_rows
from gate.variants import BINARY, VARIANTS, completion, prompt_file_for, spec
from rl.checkpoints import use_converting_loads
from rl.model import (
    check_model_flags,
    freeze_vision_tower,
    load_model,
    load_trained,
    lora_config,
    master_dtype,
    quiet_checkpointing_deprecation,
    trainable_parameters,
    vision_tower,
    zero_stage,
)
from rl.monitor import setup_wandb

PLACEHOLDERS = ("variant", "dataset")  # {variant}, {dataset} in the paths below, filled from the fields of that name


@dataclass
class GateArguments:
    variant: str = field(
        default=None,
        metadata={
            "help": "the gate variant; fills {variant} in train_file, eval_file, output_dir and run_name",
            "choices": tuple(VARIANTS),
        },
    )
    dataset: str = field(
        default=None,
        metadata={"help": "the benchmark the gate data comes from (infoseek, evqa); fills {dataset} like {variant}"},
    )
    train_file: str = field(
        default=None, metadata={"help": "rendered rows (<variant>.train.jsonl; may hold {variant}, {dataset})"}
    )
    eval_file: str = field(
        default=None,
        metadata={"help": "held-out rendered rows, scored after training (may hold {variant}, {dataset})"},
    )
    verbalisers: list[str] = field(default=None, metadata={"help": "the verbalisers the data was rendered with"})
    freeze_vision_tower: bool = field(default=True, metadata={"help": "train no vision-tower parameter"})
    allow_single_class: bool = field(default=False, metadata={"help": "train even if a class has no example"})
    eval_batch_size: int = field(default=16, metadata={"help": "examples per forward pass when scoring eval_file"})


def fill_placeholders(args: GateArguments, training_args) -> None:
    """``{variant}`` and ``{dataset}`` in ``train_file``, ``eval_file`` and the SFTConfig's ``output_dir`` and
    ``run_name`` replaced by ``--variant`` and ``--dataset``, in place. Nothing else of the SFTConfig is derived from
    those two when it is built (transformers 5's TrainingArguments.__post_init__ only expands ``~`` in output_dir,
    which a placeholder does not change; the hub id and W&B's run name are read from them at training time)."""
    check_choices(args)
    if args.dataset is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", str(args.dataset)):
        raise ValueError(f"--dataset must be a plain name (letters, digits, _ . -), got {args.dataset!r}")
    for obj, name in (
        (args, "train_file"),
        (args, "eval_file"),
        (training_args, "output_dir"),
        (training_args, "run_name"),
    ):
        value = getattr(obj, name, None)
        for key in PLACEHOLDERS:
            mark = "{" + key + "}"
            if not isinstance(value, str) or mark not in value:
                continue
            if not getattr(args, key):
                choices = f" ({', '.join(VARIANTS)})" if key == "variant" else " (infoseek, evqa)"
                raise ValueError(f"--{name} {value!r} holds {mark}: give --{key}{choices}")
            value = value.replace(mark, getattr(args, key))
        if value is not None:
            setattr(obj, name, value)


def parse_args(argv=None):
    """(GateArguments, SFTConfig, ModelConfig) from ``--config`` and flags, ``{variant}`` and ``{dataset}`` filled."""
    from trl import ModelConfig, SFTConfig

    args, training_args, model_args = parse((GateArguments, SFTConfig, ModelConfig), argv, description=__doc__)
    fill_placeholders(args, training_args)
    return args, training_args, model_args


def check_balance(args: GateArguments, rows: list[dict], log=print) -> dict:
    """Print the class balance; an empty class of a binary gate is an error unless allowed."""
    balance = class_balance(rows)
    log(f"{args.variant} training data: {len(rows)} rows; classes {format_balance(balance)}")
    if args.variant in BINARY:
        s = spec(args.variant, args.verbalisers)
        expected = {
            completion(s, True) if args.variant != "inspector" else "pass",
            completion(s, False) if args.variant != "inspector" else "fail",
        }
        empty = sorted(expected - set(balance))
        unknown = sorted(set(balance) - expected)
        if unknown:
            raise ValueError(
                f"{args.train_file}: classes {unknown} are not verbalisers of {args.variant} "
                f"{sorted(expected)} (rendered with other --verbalisers?)"
            )
        if empty and not args.allow_single_class:
            raise ValueError(
                f"{args.train_file}: class {empty} has no example; the gate would learn one answer "
                "(set allow_single_class to train anyway)"
            )
    return balance


def validate(args: GateArguments, training_args, model_args) -> tuple[list[dict], list[dict] | None]:
    check_choices(args)
    if not args.variant:
        raise ValueError(f"--variant is required ({', '.join(VARIANTS)})")
    spec(args.variant, args.verbalisers)
    require_file(args.train_file, "train_file")
    if args.eval_file:
        require_file(args.eval_file, "eval_file")
    if not model_args.model_name_or_path:
        raise ValueError("--model_name_or_path is required")
    check_model_flags(model_args)
    if training_args.completion_only_loss is False or training_args.assistant_only_loss:
        raise ValueError(
            "completion_only_loss false / assistant_only_loss true: a gate learns its answer only; with these TRL puts "
            "loss on the prompt and its image tokens too (set completion_only_loss: true, assistant_only_loss: false)"
        )
    if getattr(training_args, "max_length", None) is not None:  # TRL's SFTConfig sets 1024 when nothing does
        raise ValueError(
            f"max_length {training_args.max_length}: TRL cuts each example's end, the completion first (the label "
            "then carries no loss), and can cut image tokens; set max_length: null (TRL's default is 1024)"
        )
    rendered_verbalisers(args)
    rows = read_rows(args.train_file)
    check_balance(args, rows)
    eval_rows = read_rows(args.eval_file) if args.eval_file else None
    if eval_rows:  # held-out rows the gate cannot read: refused now, not when training is over
        read_targets(spec(args.variant, args.verbalisers), eval_rows)
    return rows, eval_rows


def rendered_prompt(train_file: str, variant: str) -> dict | None:
    """The prompt the rows were rendered with (``<variant>.prompt.json`` beside them, written by gate.train.build_data's
    render), so the trained gate is scored with it; None for rows rendered before that file existed."""

    path = prompt_file_for(Path(train_file).parent, variant)
    return read_json(path) if path.is_file() else None


def rendered_verbalisers(args: GateArguments) -> None:
    """``args.verbalisers`` from the render's record, in its order (the first is what the gate's score reads as
    positive): taken when none are given, refused when other ones, or the same in another order, are. The classes
    are only a set in the rows, so reversed verbalisers trained an inverted gate whose held-out check, parsed with
    the same reversed words, looked right."""
    recorded = (rendered_prompt(args.train_file, args.variant) or {}).get("verbalisers")
    if recorded is None:
        return
    if args.verbalisers and list(args.verbalisers) != list(recorded):
        raise ValueError(
            f"--verbalisers {list(args.verbalisers)}: {args.train_file} was rendered with {list(recorded)} "
            f"({prompt_file_for(Path(args.train_file).parent, args.variant).name}), in that order; give those or none"
        )
    args.verbalisers = list(recorded)


def longest_completion_tokens(tokenizer, rows: list[dict]) -> int:
    """Tokens in the longest SFT target: how long a reply the gate learnt to write (``gate.scoring.generate_parsed``
    generates that much, where the Inspector's expanded-answer sentences ran past a fixed 48 tokens and were lost)."""
    texts = [r["completion"][-1]["content"] for r in rows]
    return max((len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]), default=0)


def save_final(final: Path, model, processor, info: dict) -> None:
    """Model + processor + gate.json into a temporary sibling, then renamed: a crash leaves no half folder."""
    with atomic_folder(final) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        write_json_atomic(tmp / GATE_FILE, info)


def main(argv=None) -> dict:
    from accelerate import PartialState
    from datasets import Dataset, Image
    from transformers import AutoProcessor
    from transformers.integrations import is_deepspeed_zero3_enabled
    from trl import SFTTrainer

    quiet_checkpointing_deprecation()
    args, training_args, model_args = parse_args(argv)
    rows, eval_rows = validate(args, training_args, model_args)
    prompt = rendered_prompt(args.train_file, args.variant)
    s = spec(args.variant, args.verbalisers, prompt)
    processor = AutoProcessor.from_pretrained(
        model_args.model_name_or_path, trust_remote_code=training_args.trust_remote_code
    )
    if args.variant in BINARY or args.variant == "skb":
        verbaliser_ids(processor.tokenizer, s)  # before the model loads
    s["longest_completion_tokens"] = longest_completion_tokens(processor.tokenizer, rows)  # gate.json; evaluation
    # CPU processes under torchrun form one gloo group only when the first state knows use_cpu; every collective
    # waits at most ddp_timeout seconds
    state = PartialState(cpu=training_args.use_cpu, timeout=training_args.ddp_timeout_delta)
    mixed = "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else None
    load_dtype, precision = master_dtype(
        model_args.dtype, model_args.use_peft, zero_stage(training_args), mixed, str(state.device)
    )
    if state.is_main_process:
        print(precision)
    model, processor = load_model(
        model_args.model_name_or_path,
        load_dtype,
        device=str(state.device),
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
    )
    if args.freeze_vision_tower:
        print(f"vision tower frozen ({freeze_vision_tower(model):,} parameters)")
    data = Dataset.from_list(
        [{"prompt": r["prompt"], "completion": r["completion"], "image": r["image"]} for r in rows]
    ).cast_column("image", Image())
    peft_config = lora_config(model, model_args, args.freeze_vision_tower)
    setup_wandb(training_args.output_dir, training_args.report_to)  # offline without credentials, in output_dir
    trainer = SFTTrainer(
        model=model, args=training_args, train_dataset=data, processing_class=processor, peft_config=peft_config
    )
    if args.freeze_vision_tower and trainable_parameters(vision_tower(trainer.model)):
        raise RuntimeError("vision-tower parameters are trainable despite freeze_vision_tower")
    print(f"trainable parameters: {trainable_parameters(trainer.model):,}")
    use_converting_loads(trainer)  # a full fine-tune's checkpoint loads through from_pretrained (rl/checkpoints.py)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    result = {"log_history": trainer.state.log_history}
    output_dir = Path(training_args.output_dir)
    zero3 = is_deepspeed_zero3_enabled()
    if zero3:
        # the engine's model is partitioned: every process gathers the trained weights (an adapter, or whole weights)
        # into trained/, and process 0 alone loads them whole, merged, for final/ and the evaluation
        trainer.save_model(str(output_dir / "trained"))
        Processes(state).barrier("the trained weights were saved")
    if not state.is_main_process:
        return result
    if zero3:
        model, _ = load_trained(
            output_dir / "trained", model_args.dtype, device=str(state.device), base=model_args.model_name_or_path
        )
    else:
        model = trainer.model.merge_and_unload() if hasattr(trainer.model, "merge_and_unload") else trainer.model
    save_final(
        output_dir / "final",
        model,
        processor,
        {
            "variant": args.variant,
            "verbalisers": list(s["verbalisers"]),
            "base_model": model_args.model_name_or_path,
            "prompt": {"system": s["system"], "user_template": s["user"]},
            "longest_completion_tokens": s["longest_completion_tokens"],
            "training": {  # what the card says of how the gate was trained
                "freeze_vision_tower": args.freeze_vision_tower,
                "lora_r": model_args.lora_r if model_args.use_peft else None,
                "learning_rate": training_args.learning_rate,
                "global_step": trainer.state.global_step,
            },
        },
    )
    if zero3:
        shutil.rmtree(output_dir / "trained")  # final/ holds it, merged
    if eval_rows:
        with outside_zero3_init():  # process 0 alone: generate() must not sync with the others (synced_gpus)
            metrics = evaluate(args, s, model, processor, eval_rows)
        write_json_atomic(output_dir / "gate_eval.json", metrics)
        print("held-out: " + json.dumps(metrics))
        result["eval"] = metrics

    write_gate_cards(output_dir, result.get("eval"))  # our card over TRL's placeholder, after every save
    return result


def evaluate(args: GateArguments, s: dict, model, processor, eval_rows: list[dict]) -> dict:
    """Held-out metrics of the trained gate: scored verbalisers (binary and SKB variants) or generated answers."""
    if args.variant in BINARY or args.variant == "skb":
        metrics = evaluate_gate(model.eval(), processor, s, eval_rows, batch_size=args.eval_batch_size)
        return {k: v for k, v in metrics.items() if k not in ("scores", "truth")}
    return evaluate_generated(model.eval(), processor, s, eval_rows, batch_size=args.eval_batch_size)


if __name__ == "__main__":
    from common.cli import run

    run(main)
