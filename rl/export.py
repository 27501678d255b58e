"""Export a trained refiner to a self-contained serving folder.

    python -m rl.export --checkpoint DIR --out DIR [--dtype bf16|fp16|fp32] [--force] [--verify false]

``--checkpoint`` is a trainer checkpoint (full weights, a PEFT adapter whose LoRA is merged into the base weights, or
only DeepSpeed ZeRO shards, gathered by DeepSpeed's zero_to_fp32), a run's ``final`` folder, or a run's output dir
(its best checkpoint by ``metric_for_best_model``, else its latest). The folder gets safetensors weights (sharded when
large), config, processor, tokenizer and chat
template, ``generation_config.json`` (the run's sampling settings), ``refiner.json`` (prompt, output format and
parser version, the index's α and encoders, training step, held-out metrics at that step) and ``README.md``, its
model card (rl.model_card: base model, task, reward, index, held-out figures, the serving commands).

It is written to a temporary sibling, reloaded in a fresh process with AutoModelForImageTextToText +
AutoProcessor, made to generate for the run's first held-out question (``probe_question``), whose output must parse,
and only then renamed to ``--out``. That check costs one more start of Python, transformers and the model (seconds
for the tiny models, a minute or more for a 3B model on a CPU); ``--verify false`` skips it, and says so.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from common.cli import check_choices, parse
from common.files import atomic_folder, read_json, write_json_atomic
from common.model_card import write_card
from common.placement import DTYPE_NAMES, resolve_dtype
from rewards import parse_query
from rewards.format import MAX_QUERY_TOKENS, PARSER_VERSION
from rl.generate import generate_completions, sampling_settings
from rl.image_budget import apply_image_budget
from rl.model import open_vlm_image, quiet_checkpointing_deprecation, vlm_image_or_reason
from rl.model_card import held_out, refiner_card, vllm_serve_command
from rl.run_record import RUN_RECORD, checkpoint_folders, find_run_record

VERIFY_MODE = "--verify_folder"  # python -m rl.export --verify_folder DIR [IMAGE QUESTION]: the fresh process's check
VERIFY_TIMEOUT_S = 3600  # a 3B model loaded and run once on a slow CPU stays far below this
DTYPES = {short: DTYPE_NAMES[short] for short in ("bf16", "fp16", "fp32")}  # the export's choices → torch names


@dataclass
class ExportArgs:
    checkpoint: str = field(default=None, metadata={"help": "checkpoint, final folder, or run output dir"})
    out: str = field(default=None, metadata={"help": "serving folder to write"})
    dtype: str = field(default="bf16", metadata={"help": "the exported weights' dtype", "choices": tuple(DTYPES)})
    force: bool = field(default=False, metadata={"help": "replace a non-empty --out"})
    max_shard_size: str = field(default="2GB", metadata={"help": "safetensors shard size"})
    verify: bool = field(
        default=True,
        metadata={"help": "reload the folder in a fresh process and require one parseable generation before renaming"},
    )


def sampling(recorded: dict) -> dict:
    """The generation settings a run sampled with (rl.generate.sampling_settings: what its record holds, neutral
    values for what an older record lacks) and its length. Every one is written, so none is inherited from the base
    model's generation_config.json (Qwen2.5-VL's sets a repetition penalty and a top-k that training never used)."""
    return {**sampling_settings(recorded), "max_new_tokens": recorded["max_new_tokens"]}


def resolve_checkpoint(path: Path) -> Path:
    """A folder with weights or an adapter; a run dir resolves to its best (else latest) checkpoint, else final."""
    if (path / "config.json").exists() or (path / "adapter_config.json").exists():
        return path
    checkpoints = checkpoint_folders(path)
    saved = [c for c in checkpoints if (c / "trainer_state.json").exists()]  # transformers writes it last
    for cut in (c for c in checkpoints if c not in saved):
        print(f"{cut} has no trainer_state.json (its save was cut short): not exported")
    if saved:
        state = read_json(saved[-1] / "trainer_state.json")
        best = state.get("best_model_checkpoint")  # output_dir/checkpoint-N, output_dir as the run was given it
        if best and (path / Path(best).name).is_dir():  # in this folder: the recorded path may name another run's
            return path / Path(best).name
        if best:
            print(f"the best checkpoint {best} is not in {path}: exporting the latest, {saved[-1].name}")
        return saved[-1]
    if (path / "final").is_dir():
        return path / "final"
    raise ValueError(f"--checkpoint: {path} holds no model weights, adapter or checkpoint-* folder")


def run_record(ckpt: Path) -> dict:
    record = find_run_record(ckpt)
    if record is None:
        raise ValueError(f"no {RUN_RECORD} next to {ckpt}: export needs the run's record (written by rl/train_grpo.py)")
    return record


def step_and_metrics(ckpt: Path) -> tuple[int | None, dict]:
    """Training step of a checkpoint and the latest held-out (eval_*) metrics at or before it."""
    state_file = next(
        (f for f in (ckpt / "trainer_state.json", ckpt.parent / "trainer_state.json") if f.exists()), None
    )
    if state_file is None:
        return None, {}
    state = read_json(state_file)
    step = state.get("global_step")
    return step, held_out(state.get("log_history", []), step)


def load_for_export(ckpt: Path, record: dict, dtype: str):
    """Model (LoRA merged) and processor of a checkpoint."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch_dtype = resolve_dtype(dtype)
    adapter = ckpt / "adapter_config.json"
    if adapter.exists():
        from peft import PeftModel

        base = read_json(adapter).get("base_model_name_or_path")
        candidates = [b for b in (base, record.get("base_model")) if b]
        base = next((b for b in candidates if Path(b).exists()), candidates[0] if candidates else None)
        if base is None:
            raise ValueError(f"{adapter} names no base model and the run record has none")
        if not Path(base).exists() and os.environ.get("HF_HUB_OFFLINE") == "1":
            raise ValueError(
                f"the adapter in {ckpt} needs its base model {base!r}, which is not a local folder "
                "(and the hub is offline)"
            )
        model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch_dtype)
        model = PeftModel.from_pretrained(model, str(ckpt)).merge_and_unload()
        processor_source = ckpt if (ckpt / "tokenizer_config.json").exists() else Path(base)
    elif zero_shards_only(ckpt):
        model = from_zero_shards(ckpt, torch_dtype)
        processor_source = ckpt if (ckpt / "tokenizer_config.json").exists() else Path(record["base_model"])
    else:
        model = AutoModelForImageTextToText.from_pretrained(str(ckpt), dtype=torch_dtype)
        processor_source = ckpt if (ckpt / "tokenizer_config.json").exists() else Path(record["base_model"])
    processor = AutoProcessor.from_pretrained(str(processor_source))
    return model, processor


def zero_shards_only(ckpt: Path) -> bool:
    """A DeepSpeed checkpoint whose weights exist only as ZeRO shards (``global_step*/``, named by ``latest``): what the
    Trainer writes under ZeRO-3 without ``zero3_save_16bit_model`` (a config.json, but no weights beside it)."""
    weights = list(ckpt.glob("*.safetensors")) + list(ckpt.glob("pytorch_model*.bin"))
    return not weights and (ckpt / "latest").exists()


def from_zero_shards(ckpt: Path, dtype):
    """The model of a shards-only DeepSpeed checkpoint: its config, its generation config (the end-of-sequence ids
    training stopped completions at: ``from_config`` derives one from config.json, which lists fewer), and the fp32
    weights DeepSpeed's own zero_to_fp32 gathers from the shards (CPU memory: the whole model in fp32)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForImageTextToText, GenerationConfig

    state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(str(ckpt)))
    if (ckpt / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(ckpt))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = (
        {k for k in missing if k.endswith("lm_head.weight")}
        if getattr(model.config, "tie_word_embeddings", False)
        else set()
    )
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"the ZeRO shards in {ckpt} do not fit its config: {len(set(missing) - tied)} weights missing "
            f"({sorted(set(missing) - tied)[:3]}), {len(unexpected)} unexpected ({unexpected[:3]})"
        )
    model.tie_weights()
    return model.to(dtype)


def probe_question(record: dict, tries: int = 20) -> tuple[str | None, str]:
    """(image path, question) of the run's own first held-out question whose image can be used (its eval file, else
    its train file; the first ``tries`` questions of each: training left out those whose image it could not use) to
    verify an export with; (None, a plain question) when neither file is on this machine."""
    args = record.get("refiner_args", {})
    for name in ("eval_file", "train_file"):
        path = Path(args.get(name) or "")
        if not path.is_file():
            continue
        with path.open(encoding="utf-8") as f:
            rows = (json.loads(line) for line in f if line.strip())
            for row in itertools.islice(rows, tries):
                if isinstance(row, dict) and row.get("image") and row.get("question"):
                    image = Path(args.get("images_root") or path.parent) / row["image"]
                    if vlm_image_or_reason(image)[0] is not None:
                        return str(image), row["question"]
    return None, "What is shown in this image?"


def verify(folder: Path, image_path: str | None = None, question: str = "What is shown in this image?") -> str:
    """In this process: reload the folder, generate for one question (a plain grey image without ``image_path``),
    require that the output parses."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    spec = read_json(folder / "refiner.json")
    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(str(folder))
    image = open_vlm_image(image_path) if image_path else Image.new("RGB", (224, 224), (128, 128, 128))
    text = generate_completions(
        model,
        processor,
        [image],
        [question],
        prompt=spec["prompt"],  # the exact wording it was trained with, not a prompt file read again by name
        max_new_tokens=spec["generation"]["max_new_tokens"],
        sampling=spec["generation"],  # greedy with the run's repetition penalty, as rl.refine decodes
    )[0]
    if parse_query(text, spec.get("max_query_tokens", MAX_QUERY_TOKENS)) is None:
        raise ValueError(f"exported model's output does not parse: {text[:200]!r}")
    return text


def export(args: ExportArgs, log=print) -> Path:
    quiet_checkpointing_deprecation()
    check_choices(args)
    if not args.checkpoint or not Path(args.checkpoint).is_dir():
        raise ValueError(f"--checkpoint: folder {args.checkpoint!r} does not exist")
    if not args.out:
        raise ValueError("--out is required")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} is a file, not a folder")
    if out.exists() and any(out.iterdir()) and not args.force:
        raise ValueError(f"--out: {out} is not empty (pass --force to replace it)")
    ckpt = resolve_checkpoint(Path(args.checkpoint))
    if out.resolve() == ckpt.resolve() or out.resolve() in ckpt.resolve().parents:  # --force would delete it
        raise ValueError(f"--out: {out} holds the checkpoint {ckpt} being exported; choose a new folder")
    record = run_record(ckpt)
    step, metrics = step_and_metrics(ckpt)
    log(f"exporting {ckpt} (step {step})")
    try:
        model, processor = load_for_export(ckpt, record, args.dtype)
    except ValueError:
        raise
    except Exception as e:  # corrupt or incomplete files surface as many exception types
        raise ValueError(
            f"cannot load the checkpoint {ckpt}: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        ) from None

    budget = record.get("image_budget")
    with atomic_folder(out) as tmp:  # renamed to --out only once verified
        model.save_pretrained(tmp, max_shard_size=args.max_shard_size)
        apply_image_budget(processor, budget).save_pretrained(tmp)  # the training budget, for HF and vLLM alike
        gen = sampling(record["generation"])
        model.generation_config.update(do_sample=True, **gen)
        model.generation_config.save_pretrained(tmp)
        write_json_atomic(
            tmp / "refiner.json",
            {
                "prompt": record["prompt"],
                "user_template": record["prompt"]["user_template"],
                "output_format": '<think>…</think><answer>{"query": "…"}</answer>',
                "parser_version": PARSER_VERSION,
                "max_query_tokens": record["refiner_args"].get("max_query_tokens", MAX_QUERY_TOKENS),
                "index": record["index"],
                "generation": gen,
                "training_step": step,
                "held_out_metrics": metrics,
                "source_checkpoint": str(ckpt.resolve()),
                "dtype": args.dtype,
                "image_budget": budget,
            },
        )
        write_card(
            tmp,
            refiner_card(
                record,
                metrics,
                name=out.resolve().name,
                step=step,
                folder=out.resolve(),
                export={"dtype": DTYPES[args.dtype], "source": str(ckpt.resolve())},
            ),
        )
        checked = "not verified (--verify false)"
        if args.verify:
            image_path, question = probe_question(record)
            try:
                result = subprocess.run(
                    [sys.executable, "-m", "rl.export", VERIFY_MODE, str(tmp), image_path or "", question],
                    capture_output=True,
                    text=True,
                    timeout=VERIFY_TIMEOUT_S,
                )
            except subprocess.TimeoutExpired:
                raise ValueError(
                    f"verification of the exported folder did not finish within {VERIFY_TIMEOUT_S} s "
                    "(--verify false skips it)"
                ) from None
            if result.returncode != 0:
                raise ValueError(
                    f"verification of the exported folder failed: {result.stderr.strip().splitlines()[-1:]}"
                )
            checked = f"verified in a fresh process: {result.stdout.strip().splitlines()[-1]}"
    log(f"exported to {out}; {checked}")
    log(f"serve it with: {vllm_serve_command(out.resolve(), DTYPES[args.dtype], budget)}")
    return out


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [VERIFY_MODE]:
        print("generated:", verify(Path(argv[1]), *(argv[2:3] if argv[2:3] != [""] else [None]), *argv[3:4]))
        return

    (args,) = parse((ExportArgs,), argv, description=__doc__)
    export(args)


if __name__ == "__main__":
    from common.cli import run

    run(main)
