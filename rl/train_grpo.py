"""Train a query refiner with GRPO against a multimodal retrieval reward.

    accelerate launch rl/train_grpo.py [--config configs/grpo/X.yaml] [--any_field value ...]

With no --config it runs the embedded default (configs/grpo/toy.yaml): it generates the toy world and its index
if missing, builds a tiny Qwen2.5-VL refiner, gives it a supervised warm start, runs GRPO on the CPU, and prints
a table of test-set retrieval for the original question, the warm start and the GRPO refiner.

Arguments are TRL's: every GRPOConfig and ModelConfig field, plus ours (RefinerArguments), from YAML or flags.
The loop is TRL's GRPOTrainer; the rewards are rewards.FormatReward + rewards.RetrievalReward.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# run as a script (accelerate launch rl/train_grpo.py): import the packages, not this folder's modules
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "rl"]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import time  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

from rl.embedded_default import per_device_batch  # noqa: E402

DEFAULT_CONFIG = ROOT / "configs" / "grpo" / "toy.yaml"


@dataclass
class RefinerArguments:
    index: str = field(default=None, metadata={"help": "index directory (retrieval.build_index output)"})
    alpha: float = field(default=0.63, metadata={"help": "image weight α of the query"})
    train_file: str = field(default=None, metadata={"help": "question JSONL for RL (rl.data output)"})
    eval_file: str = field(default=None, metadata={"help": "held-out question JSONL scored during training"})
    eval_limit: int = field(default=None, metadata={"help": "use only the first N eval questions"})
    images_root: str = field(default=None, metadata={"help": "image folder (default: each question file's folder)"})
    prompt: str = field(default="wikiseeker", metadata={"help": "refiner prompt: wikiseeker | toy | a .yaml "
                                                                            "file (rl/prompts.py)"})
    depth: int = field(default=200, metadata={"help": "rank depth of the retrieval reward"})
    reward_tiers: str = field(default="1-5:4,6-10:3.5,11-20:3,21-50:1,51-100:0.5,101-200:0.1",
                              metadata={"help": "rank tiers lo-hi:reward (the paper's by default)"})
    miss_reward: float = field(default=-2.5, metadata={"help": "retrieval reward beyond the last tier"})
    unparseable_retrieval_reward: float = field(default=-2.5, metadata={"help": "retrieval reward of a completion that does not parse"})
    format_valid_reward: float = field(default=1.0, metadata={"help": "format reward when the format holds"})
    format_invalid_reward: float = field(default=-4.0, metadata={"help": "format reward otherwise"})
    max_query_tokens: int = field(default=128, metadata={"help": "longer queries count as invalid format"})
    freeze_vision_tower: bool = field(default=True, metadata={"help": "train no vision-tower parameter"})
    log_table_steps: int = field(default=50, metadata={"help": "completions table every N steps (0 = never)"})
    toy_world: str = field(default=None, metadata={"help": "embedded default: the toy world's folder; generated there "
                                                         "if missing (a world already there is used as it is)"})
    warm_start_steps: int = field(default=0, metadata={"help": "supervised warm start steps before GRPO (toy world)"})
    warm_start_batch_size: int = field(default=16, metadata={"help": "warm start batch size over all processes"})
    warm_start_learning_rate: float = field(default=1e-3, metadata={"help": "warm start learning rate"})
    warm_start_shift: float = field(default=0.5, metadata={"help": "share of warm-start examples with a shifted colour"})
    learning_table: bool = field(default=False, metadata={"help": "print/write the toy-world learning table at the end"})
    min_pixels: int = field(default=4 * 28 * 28, metadata={"help": "image budget: fewest pixels an image is resized to "
                                                                  "(training, vLLM, export, refine)"})
    max_pixels: int = field(default=1024 * 28 * 28, metadata={"help": "image budget: most pixels an image is resized "
                                                                     "to (Qwen2.5-VL: ≤ max_pixels/28² image tokens)"})
    completions_per_step: int = field(default=0, metadata={
        "help": "completions per optimizer step over all processes: sets per_device_train_batch_size to this ÷ "
                "(processes × gradient_accumulation_steps), so one process and several run the same recipe "
                "(0 = per_device_train_batch_size as given)"})
    completions_log: bool = field(default=False, metadata={"help": "append every completion this rank scores to "
                                                                   "completions.rank<R>.jsonl in the output dir"})


def with_completions_per_step(argv: list[str], args: RefinerArguments, training_args, processes: int) -> list[str]:
    """``argv`` with the per-device batch ``completions_per_step`` implies for this many processes (unchanged when
    it is 0); an explicit ``--per_device_train_batch_size`` that disagrees is an error naming both."""
    if not args.completions_per_step:
        return argv
    n = per_device_batch(args.completions_per_step, processes, training_args.gradient_accumulation_steps,
                         "completions_per_step")
    flag = "--per_device_train_batch_size"
    given = [a.split("=", 1)[1] if a.startswith(flag + "=") else argv[i + 1]
             for i, a in enumerate(argv) if a.startswith(flag + "=") or (a == flag and i + 1 < len(argv))]
    if given and int(given[-1]) != n:
        raise ValueError(f"completions_per_step {args.completions_per_step} over {processes} processes means "
                         f"{flag} {n}, but {flag} {given[-1]} was given: set one of them (--completions_per_step 0 "
                         f"to use {flag} as given)")
    return [*argv, flag, str(n)]


def validate(args: RefinerArguments, training_args, model_args, num_processes: int) -> str:
    """Settings that need no files: fail before anything loads, naming the setting. Returns the batch geometry."""
    from retrieval.index import check_alpha, check_k
    from rewards.rank import parse_tiers, validate_tiers
    from rl.image_budget import check_budget
    from rl.prompts import check_prompt

    check_alpha(args.alpha)
    check_budget(args.min_pixels, args.max_pixels)
    check_k(args.depth, "depth")
    check_prompt(args.prompt)
    validate_tiers(parse_tiers(args.reward_tiers), args.miss_reward)
    if not model_args.model_name_or_path:
        raise ValueError("--model_name_or_path is required")
    per_step = training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps * num_processes
    if per_step % training_args.num_generations:
        raise ValueError(f"batch geometry: per_device_train_batch_size ({training_args.per_device_train_batch_size}) "
                         f"× gradient_accumulation_steps ({training_args.gradient_accumulation_steps}) × processes "
                         f"({num_processes}) = {per_step} completions per step is not a multiple of "
                         f"num_generations ({training_args.num_generations})")
    return (f"batch geometry: {per_step // training_args.num_generations} prompts × {training_args.num_generations} "
            f"generations = {per_step} completions per optimizer step ({num_processes} processes × "
            f"{training_args.per_device_train_batch_size} × {training_args.gradient_accumulation_steps} accumulation)")


def validate_files(args: RefinerArguments) -> None:
    from retrieval.cli import require_file, require_index
    from retrieval.encoders import check_image_encoder_name, check_text_encoder_name

    manifest = require_index(args.index)
    check_image_encoder_name(manifest["image_encoder"])
    check_text_encoder_name(manifest["text_encoder"])
    require_file(args.train_file, "train_file")
    if args.eval_file:
        require_file(args.eval_file, "eval_file")


def main(argv=None) -> dict:
    from accelerate import PartialState
    from transformers.integrations import is_deepspeed_zero3_enabled
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer, ModelConfig, get_peft_config

    from retrieval.cli import parse
    from retrieval.encoders import parameter_elements
    from retrieval.index import MultimodalIndex
    from retrieval.placement import Processes, configure_threads
    from rewards import FormatReward, RetrievalReward, parse_tiers
    from rl.data import question_dataset, warn_absent_entities
    from rl.embedded_default import learning_table, prepare_embedded_default
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
        exclude_vision_tower,
        freeze_vision_tower,
        load_model,
        master_dtype,
        restore_base_path,
        trainable_names,
        trainable_parameters,
        vision_tower,
        zero_stage,
    )
    from rl.monitor import (
        PhaseProgress,
        RefinerMonitor,
        TimedReward,
        setup_wandb,
        use_exact_metric_means,
        use_phase_progress,
    )
    from rl.run_record import write_run_record
    from rl.vllm_prompts import fix_colocated_vllm_prompts, probe_vllm_prompt

    # TRL 1.16 reads model.is_gradient_checkpointing (deprecated in transformers 5.23) at every generation: its own
    # call, nothing a user can change
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    hf_logging.disable_progress_bar()  # weight loading / shard writing bars inside phases that have their own
    t_start = time.time()
    argv = list(sys.argv[1:] if argv is None else argv)
    embedded_default = "--config" not in argv
    if embedded_default:
        argv = ["--config", str(DEFAULT_CONFIG), *argv]
    args, training_args, model_args = parse((RefinerArguments, GRPOConfig, ModelConfig), argv, description=__doc__)
    # the first accelerate state of the process: under torchrun on CPUs it must know use_cpu, or every process
    # believes it is alone; every collective waits at most ddp_timeout seconds (a barrier then names its step)
    state = PartialState(cpu=training_args.use_cpu, timeout=training_args.ddp_timeout_delta)
    if args.completions_per_step:
        argv = with_completions_per_step(argv, args, training_args, state.num_processes)
        args, training_args, model_args = parse((RefinerArguments, GRPOConfig, ModelConfig), argv, description=__doc__)
    geometry = validate(args, training_args, model_args, state.num_processes)
    say = print if state.is_main_process else (lambda *a, **k: None)  # facts every process shares: said once
    if embedded_default:
        say(f"no --config given: running the embedded default ({DEFAULT_CONFIG.relative_to(ROOT)})")
    say(geometry)
    threads = configure_threads()  # torch intra-op and FAISS threads: this node's cores ÷ its processes
    budget = check_budget(args.min_pixels, args.max_pixels)
    stage = zero_stage(training_args)
    mixed = "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else None
    load_dtype, precision = master_dtype(model_args.dtype, model_args.use_peft, stage, mixed)
    kind = f"DeepSpeed ZeRO-{stage} over {state.backend}" if stage is not None else state.distributed_type
    print(f"rank {state.process_index}/{state.num_processes} on {state.device} ({kind}, "
          f"{threads} CPU threads); {precision}; mixed precision: {mixed or 'no'}")
    output_dir = Path(training_args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model_path = prepare_embedded_default(args, model_args, training_args.seed, output_dir, Processes(state))
    if training_args.deepspeed_plugin is not None:  # the warm start's SFT config registered its own with transformers
        training_args.deepspeed_plugin.set_deepspeed_weakref()
    validate_files(args)
    if state.is_main_process:
        write_run_record(output_dir, args, training_args, model_path, budget, precision)

    model, processor = load_model(model_path, load_dtype, device=str(state.device),
                                  trust_remote_code=training_args.trust_remote_code,
                                  attn_implementation=model_args.attn_implementation)
    apply_image_budget(processor, budget)
    zero3 = is_deepspeed_zero3_enabled()
    tokens = check_image_tokens(model, processor, budget, run_vision=not zero3)
    say(f"image budget {budget}: a {tokens['probe_size']} probe image → {tokens['image_tokens']} image tokens "
          f"(processor and model agree)")
    if training_args.use_vllm:
        # TRL's vLLM loads model.name_or_path with its own image processor: give it the policy with our budget
        folder = write_vllm_model(state, model_path, processor, output_dir)
        check_same_image_tokens(processor, folder, budget)
        model.name_or_path = model.config._name_or_path = str(folder)
        say(f"vLLM ({training_args.vllm_mode}) loads {folder}: the policy's files with the training image budget"
              + ("; serve it with: trl vllm-serve --model " + str(folder) if training_args.vllm_mode == "server"
                 else ""))
    if args.freeze_vision_tower:
        frozen = freeze_vision_tower(model)
        say(f"vision tower frozen ({frozen:,} parameters)")
    # one replica of the index per process: exact ranks on this rank's device, FAISS top-k (tables) memory-mapped
    index = MultimodalIndex.load(args.index, device=str(state.device), search_device="cpu")
    bad_images_dir = output_dir if state.is_main_process else None
    train_data = question_dataset(args.train_file, args.images_root, args.prompt, bad_images_dir=bad_images_dir)
    eval_data = question_dataset(args.eval_file, args.images_root, args.prompt, args.eval_limit,
                                 bad_images_dir=bad_images_dir) if args.eval_file else None
    warn_absent_entities(index, train_data, "train_file")

    retrieval = RetrievalReward(index, args.alpha, depth=args.depth, tiers=parse_tiers(args.reward_tiers),
                                miss=args.miss_reward, unparseable=args.unparseable_retrieval_reward,
                                max_query_tokens=args.max_query_tokens,
                                completions_log=output_dir / f"completions.rank{state.process_index}.jsonl"
                                if args.completions_log else None)
    # the query images never change: embedded once (rl.image_embeddings), the image encoder is not needed here
    covered, total = stored_image_embeddings(retrieval, index, args, train_data, eval_data)
    if covered == total:
        say(f"question-image embeddings: all {total} train/eval images stored (rl.image_embeddings, "
            f"{index.manifest['image_encoder']}): the image encoder is not built")
        encoders = [index.text_encoder]
    else:
        say(f"question-image embeddings: {covered} of {total} train/eval images stored; the image encoder "
            f"({index.manifest['image_encoder']}) is built on every process for the rest (python -m "
            f"rl.image_embeddings --queries <file> --index {args.index} stores them once)")
        encoders = [index.image_encoder, index.text_encoder]
    # the encoders load now, on this device, outside ZeRO-3 init: whole on every process
    whole = sum(parameter_elements(e) for e in encoders)
    if index.uses_exact_ranks:
        index.exact  # noqa: B018
    print(f"rank {state.process_index}: index: {len(index):,} rows, {len(encoders)} encoder(s) ({whole:,} parameter "
          f"elements here) and exact ranks on {index.device} (exact: {index.uses_exact_ranks}), FAISS top-k on "
          f"{index.search_device}")
    fmt = TimedReward(FormatReward(args.format_valid_reward, args.format_invalid_reward, args.max_query_tokens))
    ret = TimedReward(retrieval)
    monitor = RefinerMonitor(retrieval, fmt, [fmt, ret], args.log_table_steps, training_args.output_dir)
    setup_wandb(training_args.output_dir, training_args.report_to)
    peft_config = get_peft_config(model_args)
    if args.freeze_vision_tower:
        peft_config = exclude_vision_tower(model, peft_config)
    trainer = GRPOTrainer(model=model, reward_funcs=[fmt, ret], args=training_args, train_dataset=train_data,
                          eval_dataset=eval_data, processing_class=processor, peft_config=peft_config,
                          callbacks=[monitor])
    use_phase_progress(trainer, PhaseProgress("GRPO", {"reward": "reward", "retrieval/hit@1": "hit@1",
                                                       "retrieval/parse_rate": "parse",
                                                       "eval_retrieval/hit@1": "val hit@1"}))
    retrieval.mode = lambda: "train" if trainer.model.training else "eval"
    use_exact_metric_means(trainer, retrieval)
    if training_args.use_vllm:  # vLLM has read name_or_path: saved configs and adapters name the real base again
        restore_base_path(trainer.model, model, model_path)
    if fix_colocated_vllm_prompts(trainer, model.config.image_token_id):
        say("colocated vLLM receives one image placeholder per image and expands it itself (TRL 1.16 would hand it "
            "the processor's expanded ids: rl/vllm_prompts.py); the trainer keeps its own prompt ids")
    if training_args.use_vllm:  # what vLLM samples from must be the prompt the trainer scores, or no training
        probe = probe_vllm_prompt(trainer, processor, budget)
        say(f"vLLM probe: a {probe['probe_size']} image gives a {probe['prompt_tokens']}-token prompt with image-token "
            f"runs {probe['image_tokens']} in vLLM, as in the trainer's prompt")
    if args.freeze_vision_tower:
        leaked = trainable_names(vision_tower(trainer.model))
        if leaked:
            raise RuntimeError(f"{len(leaked)} vision-tower parameters are trainable despite freeze_vision_tower: "
                               f"{', '.join(leaked[:5])}")
    say(f"trainable parameters: {trainable_parameters(trainer.model):,}")
    if state.device.type == "cuda" and stage is None and not model_args.use_peft:  # e.g. configs/accelerate/ddp.yaml
        import torch

        total = torch.cuda.get_device_properties(state.device).total_memory
        vllm = training_args.vllm_gpu_memory_utilization * total if training_args.use_vllm and \
            training_args.vllm_mode == "colocate" else 0.0
        need = check_fits(ddp_full_finetune_bytes(
            sum(p.numel() for p in model.parameters()), trainable_parameters(model), vllm,
            index.exact.nbytes if index.uses_exact_ranks else 0.0,
            sum(p.numel() * p.element_size() for e in encoders for p in e.model.parameters())),
            total, "full fine-tuning without DeepSpeed")
        say(f"full fine-tuning without DeepSpeed: at least {need / 1e9:.1f} GB per GPU before activations, of "
            f"{total / 1e9:.1f}")
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(str(output_dir / "final"))  # gathers ZeRO-3 shards (zero3_save_16bit_model) on rank 0
    if state.is_main_process:
        processor.save_pretrained(str(output_dir / "final"))
    result = {"reward_time": getattr(monitor, "summary", {}), "log_history": trainer.state.log_history}
    if args.learning_table and state.is_main_process:
        result["learning"] = learning_table(args, index, model_path, processor, output_dir, t_start)
    return result


if __name__ == "__main__":
    from retrieval.cli import run

    run(main)
