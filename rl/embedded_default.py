"""The embedded default's own pieces (the toy world), kept out of the production entry point's way: the batch of
``completions_per_step`` split over processes, the toy world / tiny base model / warm start before GRPO, and the
learning table after it. Without ``toy_world``, ``model_name_or_path: tiny`` or ``warm_start_steps`` nothing here
runs: rl/train_grpo.py trains the model it is given."""

from __future__ import annotations

import time
from pathlib import Path


def per_device_batch(total: int, processes: int, accumulation: int, name: str) -> int:
    """The per-process batch that makes ``total`` examples per optimizer step over ``processes`` × ``accumulation``."""
    if total <= 0 or total % (processes * accumulation):
        raise ValueError(f"{name} ({total}) must be a positive multiple of processes ({processes}) × "
                         f"gradient_accumulation_steps ({accumulation}) = {processes * accumulation}")
    return total // (processes * accumulation)


def prepare_embedded_default(args, model_args, seed: int, output_dir: Path, procs) -> str:
    """Toy world + index if missing, tiny base model if asked, supervised warm start if asked → model path.

    Process 0 builds the toy world, its index and the tiny base model while the others wait; the warm start is one
    SFT job over all processes (``warm_start_batch_size`` examples per step in total)."""
    from retrieval.placement import outside_zero3_init
    from retrieval.toyworld import build, world_args
    from rl.tiny_vlm import build_tiny_vlm
    from rl.toy import run_warm_start, tokenizer_corpus

    tiny = model_args.model_name_or_path == "tiny"
    if tiny and not args.toy_world:
        raise ValueError("--model_name_or_path tiny builds its tokenizer from the toy world: set --toy_world")
    if args.warm_start_steps > 0 and not args.toy_world:
        raise ValueError("--warm_start_steps needs --toy_world (the warm start is the toy world's)")
    # one tiny base per seed: its random initialisation is the seed's
    model_path = str(output_dir / f"tiny-base-seed{seed}") if tiny else model_args.model_name_or_path
    if procs.rank == 0:
        # models built by one process only (the index's encoders, the tiny base) must be built whole: inside
        # DeepSpeed ZeRO-3's partitioned init every new parameter is a collective the other processes never join
        with outside_zero3_init():
            if args.toy_world:
                build(world_args(args.toy_world, args.alpha))
            if tiny:
                build_tiny_vlm(model_path, tokenizer_corpus(Path(args.toy_world)), seed=seed)
    procs.barrier("process 0 built the toy world, its index and the tiny base model")
    if args.warm_start_steps > 0:
        batch = per_device_batch(args.warm_start_batch_size, procs.count, 1, "warm_start_batch_size")
        model_path = str(run_warm_start(Path(model_path), Path(args.toy_world), output_dir / "warm_start",
                                        args.warm_start_steps, batch, args.warm_start_learning_rate,
                                        args.warm_start_shift, seed=seed, procs=procs))
    return model_path


def learning_table(args, index, warm_path, processor, output_dir: Path, t_start: float) -> dict:
    """Test-set R@k and attribute accuracy: original question, warm-started refiner, GRPO refiner."""
    from tqdm import tqdm

    from retrieval.files import write_json_atomic, write_jsonl_atomic
    from retrieval.placement import outside_zero3_init
    from rl.model import load_trained
    from rl.toy import evaluate_refiner, format_learning_table

    world = Path(args.toy_world)
    table, samples = {}, {}
    t0 = time.time()
    # process 0 alone, outside the ZeRO-3 registration: it loads whole models, and generate() would otherwise sync
    # every decoding step with the other processes (synced_gpus), which have finished
    with outside_zero3_init(), tqdm(total=3, desc="evaluation (test set)", unit="refiner") as bar:
        table["original"], samples["original"] = evaluate_refiner(index, world, args.alpha)
        bar.update()
        # loaded whole from disk (under ZeRO-3 the engine's model is partitioned)
        warm, warm_processor = load_trained(warm_path)
        table["warm_start"], samples["warm_start"] = evaluate_refiner(index, world, args.alpha, warm, warm_processor)
        bar.update()
        model, _ = load_trained(output_dir / "final", base=warm_path)
        table["grpo"], samples["grpo"] = evaluate_refiner(index, world, args.alpha, model, processor)
        bar.update()
    print(f"evaluation: original question, warm start and GRPO refiner on {len(samples['original'])} test "
          f"questions in {time.time() - t0:.0f} s")
    table["wall_seconds"] = time.time() - t_start
    table["test_questions"] = len(samples["original"])
    write_json_atomic(output_dir / "learning.json", table)
    for name, recs in samples.items():
        write_jsonl_atomic(output_dir / f"test_queries_{name}.jsonl", recs)
    print(f"\ntoy-world test set ({table['test_questions']} held-out questions), α = {args.alpha}:")
    print(format_learning_table(table))
    print(f"wall time {table['wall_seconds']:.0f}s; written to {output_dir / 'learning.json'}")
    return table
