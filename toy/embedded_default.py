"""The embedded default's hook into rl/train_grpo.py (``world: toy.embedded_default`` in configs/grpo/toy.yaml): its
arguments, the toy world / tiny base model / warm start before GRPO (``prepare``), and the learning table after it
(``report``). A run without ``world`` never imports this: rl/train_grpo.py trains the model it is given."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from common.files import write_json_atomic, write_jsonl_atomic
from common.placement import outside_zero3_init, per_device_batch
from rl.model import load_trained
from toy.refiner import evaluate_refiner, format_learning_table, run_warm_start, tokenizer_corpus
from toy.tiny_vlm import build_tiny_vlm
from toy.world import build, world_args


@dataclass
class Arguments:
    toy_world: str = field(
        default=None,
        metadata={
            "help": "the toy world's folder; generated there if missing (a world already there is used as it is)"
        },
    )
    warm_start_steps: int = field(default=0, metadata={"help": "supervised warm start steps before GRPO"})
    warm_start_batch_size: int = field(default=16, metadata={"help": "warm start batch size over all processes"})
    warm_start_learning_rate: float = field(default=1e-3, metadata={"help": "warm start learning rate"})
    warm_start_shift: float = field(
        default=0.5, metadata={"help": "share of warm-start examples with a shifted colour"}
    )
    learning_table: bool = field(
        default=False, metadata={"help": "print/write the toy-world learning table at the end"}
    )


def prepare(args, toy, model_args, training_args, procs) -> str:
    """Toy world + index if missing, tiny base model if asked, supervised warm start if asked → model path.

    Process 0 builds the toy world, its index and the tiny base model while the others wait; the warm start is one
    SFT job over all processes (``warm_start_batch_size`` examples per step in total)."""
    output_dir, seed = Path(training_args.output_dir), training_args.seed
    tiny = model_args.model_name_or_path == "tiny"
    if tiny and not toy.toy_world:
        raise ValueError("--model_name_or_path tiny builds its tokenizer from the toy world: set --toy_world")
    if toy.warm_start_steps > 0 and not toy.toy_world:
        raise ValueError("--warm_start_steps needs --toy_world (the warm start is the toy world's)")
    # one tiny base per seed: its random initialisation is the seed's
    model_path = str(output_dir / f"tiny-base-seed{seed}") if tiny else model_args.model_name_or_path
    if procs.rank == 0:
        # models built by one process only (the index's encoders, the tiny base) must be built whole: inside
        # DeepSpeed ZeRO-3's partitioned init every new parameter is a collective the other processes never join
        with outside_zero3_init():
            if toy.toy_world:
                build(world_args(toy.toy_world, args.alpha))
            if tiny:
                build_tiny_vlm(model_path, tokenizer_corpus(Path(toy.toy_world)), seed=seed)
    procs.barrier("process 0 built the toy world, its index and the tiny base model")
    if toy.warm_start_steps > 0:
        batch = per_device_batch(toy.warm_start_batch_size, procs.count, 1, "warm_start_batch_size")
        model_path = str(
            run_warm_start(
                Path(model_path),
                Path(toy.toy_world),
                output_dir / "warm_start",
                toy.warm_start_steps,
                batch,
                toy.warm_start_learning_rate,
                toy.warm_start_shift,
                seed=seed,
                procs=procs,
            )
        )
    if training_args.deepspeed_plugin is not None:  # the warm start's SFT config registered its own with transformers
        training_args.deepspeed_plugin.set_deepspeed_weakref()
    return model_path


def report(args, toy, index, model_path: str, processor, output_dir: Path, t_start: float) -> dict | None:
    """With ``learning_table``, on process 0 (``model_path``: the warm start GRPO began from): test-set R@k and
    attribute accuracy of the original question, the
    warm-started refiner and the GRPO refiner."""
    if not toy.learning_table:
        return None
    world = Path(toy.toy_world)
    table, samples = {}, {}
    t0 = time.time()
    # process 0 alone, outside the ZeRO-3 registration: it loads whole models, and generate() would otherwise sync
    # every decoding step with the other processes (synced_gpus), which have finished
    with outside_zero3_init(), tqdm(total=3, desc="evaluation (test set)", unit="refiner") as bar:
        table["original"], samples["original"] = evaluate_refiner(index, world, args.alpha)
        bar.update()
        # loaded whole from disk (under ZeRO-3 the engine's model is partitioned)
        warm, warm_processor = load_trained(model_path)
        table["warm_start"], samples["warm_start"] = evaluate_refiner(index, world, args.alpha, warm, warm_processor)
        bar.update()
        model, _ = load_trained(output_dir / "final", base=model_path)
        table["grpo"], samples["grpo"] = evaluate_refiner(index, world, args.alpha, model, processor)
        bar.update()
    print(
        f"evaluation: original question, warm start and GRPO refiner on {len(samples['original'])} test "
        f"questions in {time.time() - t0:.0f} s"
    )
    table["wall_seconds"] = time.time() - t_start
    table["test_questions"] = len(samples["original"])
    write_json_atomic(output_dir / "learning.json", table)
    for name, recs in samples.items():
        write_jsonl_atomic(output_dir / f"test_queries_{name}.jsonl", recs)
    print(f"\ntoy-world test set ({table['test_questions']} held-out questions), α = {args.alpha}:")
    print(format_learning_table(table))
    print(f"wall time {table['wall_seconds']:.0f}s; written to {output_dir / 'learning.json'}")
    return table
