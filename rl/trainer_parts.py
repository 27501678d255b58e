"""The parts rl/train_grpo.py assembles around TRL's GRPOTrainer, each from the parsed arguments: the policy with its
image budget (and the folder vLLM loads), the two rewards over the index, and what a built trainer gets before its
first step (progress, exact metric means, the vLLM prompt fix and probe, the frozen-tower and memory checks)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from transformers.integrations import is_deepspeed_zero3_enabled

from common.files import replace_folder, write_json_atomic
from retrieval.encoders import parameter_elements
from rewards import FormatReward, RetrievalReward, parse_tiers
from rl.arguments import whole_eval_rounds
from rl.checkpoints import best_weights_step, seed_each_epoch, use_converting_loads
from rl.image_budget import (
    apply_image_budget,
    check_budget,
    check_image_tokens,
    check_same_image_tokens,
    write_vllm_model,
)
from rl.image_embeddings import stored_image_embeddings
from rl.model import (
    check_fits,
    ddp_full_finetune_bytes,
    freeze_vision_tower,
    load_model,
    master_dtype,
    restore_base_path,
    trainable_names,
    trainable_parameters,
    vision_tower,
    zero_stage,
)
from rl.monitor import PhaseProgress, TimedReward, use_exact_metric_means, use_phase_progress
from rl.vllm_prompts import fix_colocated_vllm_prompts, probe_vllm_prompt

FINAL_STAGING = ".final.saving"  # beside final/: dot-named, as no reader takes it for a model


def announce_rank(state, training_args, model_args, threads: int) -> tuple[str, str]:
    """Print this rank's device, distributed kind, threads and precision → (dtype the weights load in, the master
    weights' precision)."""
    stage = zero_stage(training_args)
    mixed = "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else None
    load_dtype, precision = master_dtype(
        model_args.dtype, model_args.use_peft, stage, mixed, str(state.device), use_vllm=training_args.use_vllm
    )
    kind = f"DeepSpeed ZeRO-{stage} over {state.backend}" if stage is not None else state.distributed_type
    print(
        f"rank {state.process_index}/{state.num_processes} on {state.device} ({kind}, {threads} CPU threads); "
        f"{precision}; mixed precision: {mixed or 'no'}"
    )
    return load_dtype, precision


def load_policy(model_path: str, args, training_args, model_args, state, load_dtype: str, say):
    """The policy and its processor with the run's image budget (checked against the model), the folder colocated or
    served vLLM loads, and the vision tower frozen → (model, processor, budget)."""
    budget = check_budget(args.min_pixels, args.max_pixels)
    model, processor = load_model(
        model_path,
        load_dtype,
        device=str(state.device),
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
    )
    apply_image_budget(processor, budget)
    tokens = check_image_tokens(model, processor, budget, run_vision=not is_deepspeed_zero3_enabled())
    say(
        f"image budget {budget}: a {tokens['probe_size']} probe image → {tokens['image_tokens']} image tokens "
        f"(processor and model agree)"
    )
    if training_args.use_vllm:
        # TRL's vLLM loads model.name_or_path with its own image processor: give it the policy with our budget
        folder = write_vllm_model(state, model_path, processor, Path(training_args.output_dir))
        check_same_image_tokens(processor, folder, budget)
        model.name_or_path = model.config._name_or_path = str(folder)
        say(
            f"vLLM ({training_args.vllm_mode}) loads {folder}: the policy's files with the training image budget"
            + ("; serve it with: trl vllm-serve --model " + str(folder) if training_args.vllm_mode == "server" else "")
        )
    if args.freeze_vision_tower:
        say(f"vision tower frozen ({freeze_vision_tower(model):,} parameters)")
    return model, processor, budget


def build_rewards(
    args, index, train_data, eval_data, state, output_dir: Path, say
) -> tuple[list[TimedReward], RetrievalReward, list]:
    """The format reward and the retrieval reward (timed, in TRL's order), the retrieval reward itself, and the
    encoders it loaded on this process. Question images whose embeddings are stored (rl.image_embeddings) enter its
    cache; when all are stored the image encoder is never built."""
    log = output_dir / f"completions.rank{state.process_index}.jsonl" if args.completions_log else None
    retrieval = RetrievalReward(
        index,
        args.alpha,
        depth=args.depth,
        tiers=parse_tiers(args.reward_tiers, args.miss_reward),
        miss=args.miss_reward,
        unparseable=args.unparseable_retrieval_reward,
        max_query_tokens=args.max_query_tokens,
        completions_log=log,
    )
    covered, total = stored_image_embeddings(retrieval, index, args, train_data, eval_data)
    if covered == total:
        say(
            f"question-image embeddings: all {total} train/eval images stored (rl.image_embeddings, "
            f"{index.manifest['image_encoder']}): the image encoder is not built"
        )
        encoders = [index.text_encoder]
    else:
        say(
            f"question-image embeddings: {covered} of {total} train/eval images stored; the image encoder "
            f"({index.manifest['image_encoder']}) is built on every process for the rest (python -m "
            f"rl.image_embeddings --queries <file> --index {args.index} stores them once)"
        )
        encoders = [index.image_encoder, index.text_encoder]
    # the encoders and the exact ranker's rows load now, on this device, outside ZeRO-3 init: whole on every process
    exact_gb = index.exact.nbytes / 1e9 if index.uses_exact_ranks else 0.0
    print(
        f"rank {state.process_index}: index: {len(index):,} rows, {len(encoders)} encoder(s) "
        f"({sum(parameter_elements(e) for e in encoders):,} parameter elements here) and exact ranks on "
        f"{index.device} ({exact_gb:.2f} GB; exact: {index.uses_exact_ranks}), FAISS top-k on {index.search_device}"
    )
    fmt = FormatReward(args.format_valid_reward, args.format_invalid_reward, args.max_query_tokens)
    return [TimedReward(fmt), TimedReward(retrieval)], retrieval, encoders


def ready_trainer(
    trainer, model, processor, retrieval: RetrievalReward, model_path: str, budget: dict, args, training_args, say
) -> None:
    """What a built GRPOTrainer needs before its first step; every check here refuses to train on failure."""
    use_phase_progress(
        trainer,
        PhaseProgress(
            "GRPO",
            {
                "reward": "reward",
                "retrieval/hit@1": "hit@1",
                "retrieval/parse_rate": "parse",
                "eval_retrieval/hit@1": "val hit@1",
            },
        ),
    )
    use_exact_metric_means(trainer, [retrieval, *trainer.reward_funcs])
    if training_args.use_vllm:  # vLLM has read name_or_path: saved configs and adapters name the real base again
        restore_base_path(trainer.model, model, model_path)
    if fix_colocated_vllm_prompts(trainer, model.config.image_token_id):
        say(
            "colocated vLLM receives one image placeholder per image and expands it itself (TRL 1.16 would hand it "
            "the processor's expanded ids: rl/vllm_prompts.py); the trainer keeps its own prompt ids"
        )
    if training_args.use_vllm:  # what vLLM samples from must be the prompt the trainer scores, or no training
        probe = probe_vllm_prompt(trainer, processor, budget)
        say(
            f"vLLM probe: a {probe['probe_size']} image gives a {probe['prompt_tokens']}-token prompt with image-token "
            f"runs {probe['image_tokens']} in vLLM, as in the trainer's prompt"
        )
    if args.freeze_vision_tower:
        leaked = trainable_names(vision_tower(trainer.model))
        if leaked:
            raise RuntimeError(
                f"{len(leaked)} vision-tower parameters are trainable despite freeze_vision_tower: "
                f"{', '.join(leaked[:5])}"
            )
    say(f"trainable parameters: {trainable_parameters(trainer.model):,}")
    seed_each_epoch(trainer)
    if use_converting_loads(trainer) and (training_args.resume_from_checkpoint or training_args.load_best_model_at_end):
        say("checkpoint weights load through from_pretrained's key conversion (rl/checkpoints.py)")


def whole_round_eval(eval_data, training_args, processes: int, say):
    """The eval questions that fill whole evaluation rounds (``rl.arguments.whole_eval_rounds``), said when some are
    left out; an error naming the settings when not one round is filled."""
    if eval_data is None:
        return None
    if training_args.eval_strategy == "no":
        say(f"eval_file: {len(eval_data)} questions, never evaluated (eval_strategy no)")
        return eval_data
    generations = training_args.num_generations_eval or training_args.num_generations
    per_device = training_args.per_device_eval_batch_size
    kept = whole_eval_rounds(len(eval_data), per_device, processes, generations)
    if kept == 0:
        raise ValueError(
            f"eval_file: {len(eval_data)} usable questions, fewer than one evaluation round "
            f"(per_device_eval_batch_size {per_device} × {processes} processes ÷ {generations} "
            "generations): give more questions or a smaller per_device_eval_batch_size"
        )
    if kept < len(eval_data):
        say(
            f"eval: the first {kept} of {len(eval_data)} questions, whole rounds of {per_device} × "
            f"{processes} completions (a short last round would score the first questions twice)"
        )
        eval_data = eval_data.select(range(kept))
    return eval_data


def check_train_fills_a_generation(train_data, training_args) -> None:
    """Refuse a train set smaller than one generation batch's prompts: TRL's sampler yields whole batches only
    (``RepeatSampler``), so the run would train nothing and save the untouched model as ``final``."""
    prompts = training_args.generation_batch_size // training_args.num_generations
    if len(train_data) < prompts:
        raise ValueError(
            f"train_file: {len(train_data)} usable questions, fewer than the {prompts} prompts of one generation "
            f"batch (generation_batch_size {training_args.generation_batch_size} ÷ num_generations "
            f"{training_args.num_generations}): TRL would train no step; give more questions or fewer completions "
            "per step"
        )


def check_full_finetune_fits(model, index, encoders, training_args, model_args, device, processes, say) -> None:
    """Full fine-tuning on a GPU without DeepSpeed (configs/accelerate/ddp.yaml): refused, itemised, when the
    weights, gradients, DDP buckets, Adam state, vLLM's share, the exact ranker and the encoders exceed the GPU."""
    if device.type != "cuda" or zero_stage(training_args) is not None or model_args.use_peft:
        return
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    colocated = training_args.use_vllm and training_args.vllm_mode == "colocate"
    need = check_fits(
        ddp_full_finetune_bytes(
            sum(p.numel() for p in model.parameters()),
            trainable_parameters(model),
            training_args.vllm_gpu_memory_utilization * total if colocated else 0.0,
            index.exact.nbytes if index.uses_exact_ranks else 0.0,
            sum(p.numel() * p.element_size() for e in encoders for p in e.model.parameters()),
            processes,
            colocated and training_args.vllm_enable_sleep_mode,
        ),
        total,
        "full fine-tuning without DeepSpeed",
    )
    say(
        f"full fine-tuning without DeepSpeed: at least {need / 1e9:.1f} GB per GPU before activations, of "
        f"{total / 1e9:.1f}"
    )


def save_final(trainer, processor, output_dir: Path, procs, load_best_model_at_end: bool) -> int | None:
    """The trained model, its processor and ``trainer_state.json`` (the step of its weights and the run's log, which
    rl.export reads) in ``output_dir/final``, whole or not at all: every process saves into one staging folder beside
    it (under DeepSpeed every process takes part: ZeRO-3 gathers, or writes its own shards), then process 0 completes
    it and renames it onto ``final`` (``replace_folder``). Saved in place, a run killed mid-save over an earlier
    ``final/`` left new weights files beside old ones under the old ``trainer_state.json``. Returns, on process 0, the
    step of the checkpoint the Trainer loaded at the end, if it loaded one (``best_weights_step``)."""
    staging = Path(output_dir) / FINAL_STAGING
    if procs.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # what a save killed before left
    procs.barrier(f"process 0 cleared {staging}")
    trainer.save_model(str(staging))  # gathers ZeRO-3 shards (zero3_save_16bit_model) on rank 0
    procs.barrier(f"each process saved its part of the final model into {staging}")
    if procs.rank != 0:
        return None
    processor.save_pretrained(str(staging))
    best = best_weights_step(trainer.state, load_best_model_at_end)
    write_json_atomic(
        staging / "trainer_state.json",
        {**dataclasses.asdict(trainer.state), "global_step": best or trainer.state.global_step},
    )
    replace_folder(staging, Path(output_dir) / "final")
    return best
