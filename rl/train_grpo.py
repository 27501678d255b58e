"""Train a query refiner with GRPO against a multimodal retrieval reward.

    accelerate launch rl/train_grpo.py [--config configs/grpo/X.yaml] [--any_field value ...]

Arguments are TRL's (every GRPOConfig and ModelConfig field) plus RefinerArguments (rl/arguments.py), from YAML or
flags. The loop is TRL's GRPOTrainer; the rewards are rewards.FormatReward + rewards.RetrievalReward over the index.

With no --config it runs the embedded default (configs/grpo/toy.yaml): its ``world: toy.embedded_default`` generates
the toy world and its index if missing, builds a tiny Qwen2.5-VL refiner and gives it a supervised warm start before
GRPO, and prints a table of test-set retrieval for the original question, the warm start and the GRPO refiner after.
"""

from __future__ import annotations

import time
from pathlib import Path

from transformers.utils import logging as hf_logging
from trl import GRPOTrainer

from common.cli import run
from common.placement import Processes, configure_threads
from retrieval.index import MultimodalIndex
from rl.arguments import check_generation_phase, parse_arguments, validate, validate_files
from rl.data import question_dataset, warn_absent_entities
from rl.model import lora_config, quiet_checkpointing_deprecation
from rl.model_card import write_run_cards
from rl.monitor import RefinerMonitor, setup_wandb
from rl.run_record import (
    check_output_dir,
    check_resume,
    checkpoint_step,
    make_run_record,
    trim_run_logs,
    write_run_record,
)
from rl.trainer_parts import (
    announce_rank,
    build_rewards,
    check_full_finetune_fits,
    check_train_fills_a_generation,
    load_policy,
    ready_trainer,
    save_final,
    whole_round_eval,
)


def main(argv=None) -> dict:
    t_start = time.time()
    quiet_checkpointing_deprecation()
    hf_logging.disable_progress_bar()  # weight loading / shard writing bars inside phases that have their own
    args, training_args, model_args, world, world_args, state = parse_arguments(argv, description=__doc__)
    geometry = validate(args, training_args, model_args, state.num_processes)
    say = print if state.is_main_process else (lambda *a, **k: None)  # facts every process shares: said once
    say(geometry)
    threads = configure_threads()  # torch intra-op and FAISS threads: this node's cores ÷ its processes
    load_dtype, precision = announce_rank(state, training_args, model_args, threads)
    output_dir = Path(training_args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    # model: the world (the embedded default's toy world) may build it first
    procs = Processes(state)
    model_path = (
        world.prepare(args, world_args, model_args, training_args, procs) if world else model_args.model_name_or_path
    )
    validate_files(args)
    # the folder: a resume goes on as its checkpoint's run trained; a new run replaces nothing of another
    record = make_run_record(args, training_args, model_path, precision=precision)
    checkpoint = training_args.resume_from_checkpoint
    if checkpoint:  # the same settings as its run, at a step between two generations
        check_resume(checkpoint, record)
        check_generation_phase(training_args, checkpoint_step(checkpoint), f"resume_from_checkpoint {checkpoint}")
    else:
        check_output_dir(output_dir, record)
    if state.is_main_process:  # before any process scores a completion: that needs every process in a step
        trim_run_logs(output_dir, checkpoint)

    # data, before any model loads: the questions whose images are readable, in whole batches
    bad_images = output_dir if state.is_main_process else None
    train_data = question_dataset(args.train_file, args.images_root, args.prompt, bad_images_dir=bad_images)
    check_train_fills_a_generation(train_data, training_args)
    eval_data = (
        question_dataset(args.eval_file, args.images_root, args.prompt, args.eval_limit, bad_images_dir=bad_images)
        if args.eval_file
        else None
    )
    eval_data = whole_round_eval(eval_data, training_args, state.num_processes, say)

    model, processor, budget = load_policy(model_path, args, training_args, model_args, state, load_dtype, say)
    if state.is_main_process:
        write_run_record(output_dir, {**record, "image_budget": budget})

    # rewards: one replica of the index per process, exact ranks on this rank's device, FAISS top-k on the CPU
    index = MultimodalIndex.load(args.index, device=str(state.device), search_device="cpu")
    warn_absent_entities(index, train_data, "train_file")
    reward_funcs, retrieval, encoders = build_rewards(args, index, train_data, eval_data, state, output_dir, say)

    # trainer
    peft_config = lora_config(model, model_args, args.freeze_vision_tower, say)
    monitor = RefinerMonitor(retrieval, reward_funcs[0], reward_funcs, args.log_table_steps, training_args.output_dir)
    setup_wandb(training_args.output_dir, training_args.report_to)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_data,
        eval_dataset=eval_data,
        processing_class=processor,
        peft_config=peft_config,
        callbacks=[monitor],
    )
    ready_trainer(trainer, model, processor, retrieval, model_path, budget, args, training_args, say)
    check_full_finetune_fits(model, index, encoders, training_args, model_args, state.device, state.num_processes, say)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    best = save_final(trainer, processor, output_dir, procs, training_args.load_best_model_at_end)
    if state.is_main_process:
        write_run_cards(output_dir, trainer.state.log_history, best)  # over TRL's placeholder cards
    result = {"reward_time": getattr(monitor, "summary", {}), "log_history": trainer.state.log_history}
    if world and state.is_main_process:
        result["world_report"] = world.report(args, world_args, index, model_path, processor, output_dir, t_start)
    return result


if __name__ == "__main__":
    run(main)
