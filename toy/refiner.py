"""The embedded default's pieces: the toy world, a tiny refiner, its supervised warm start, and the learning table.

The warm start (TRL SFTTrainer) teaches the output format to convergence but is deliberately imperfect on what the
refiner sees: in ``shift_fraction`` of its examples the colour word is replaced by the next colour of the palette
(red→orange, orange→yellow, …). After it, the refiner names the right colour only part of the time; GRPO must
fix that from the retrieval reward alone, since stating a wrong colour ranks the gold entity lower.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from common.files import read_json, read_jsonl, write_json_atomic
from common.placement import Processes
from retrieval.evaluate import recall_at
from rewards.format import format_completion, parse_query
from rl.generate import generate_completions
from rl.model import load_model, open_vlm_image
from rl.monitor import PhaseProgress, use_phase_progress
from rl.prompts import SYSTEM_PROMPTS, prompt_messages
from toy.drawing import ATTRIBUTE_VALUES, ATTRIBUTES, COLOURS
from toy.world import attribute_words

COLOUR_SHIFT = dict(zip(COLOURS, list(COLOURS)[1:] + list(COLOURS)[:1]))
_VALUE_OF = {v: k for k, vs in ATTRIBUTE_VALUES.items() for v in vs}


def refined(question: str, attrs: dict) -> str:
    return f"{question} {attribute_words(attrs)}"


def target_completion(question: str, attrs: dict) -> str:
    """What the warm start teaches: the attributes in <think>, the question + attributes as the query."""
    return format_completion(refined(question, attrs), think=attribute_words(attrs))


def warm_start_rows(world: Path, shift_fraction: float, seed: int) -> list[dict]:
    """Prompt–completion rows over the train split, with the colour label shifted in a seeded fraction of them."""
    rng = np.random.default_rng(seed)
    rows = []
    for q in read_jsonl(world / "train.jsonl"):
        attrs = dict(q["attributes"])
        if rng.random() < shift_fraction:
            attrs["colour"] = COLOUR_SHIFT[attrs["colour"]]
        rows.append(
            {
                "prompt": prompt_messages(q["question"], "toy"),
                "completion": [{"role": "assistant", "content": target_completion(q["question"], attrs)}],
                "image": str(world / q["image"]),
            }
        )
    return rows


def tokenizer_corpus(world: Path) -> list[str]:
    texts = [r["text"] for r in read_jsonl(world / "kb.jsonl")]
    for q in read_jsonl(world / "train.jsonl"):
        texts.append(target_completion(q["question"], q["attributes"]))
    return texts + list(SYSTEM_PROMPTS.values())


def run_warm_start(
    base: Path,
    world: Path,
    out: Path,
    steps: int,
    batch_size: int,
    learning_rate: float,
    shift_fraction: float,
    seed: int,
    procs=None,
    log=print,
) -> Path:
    """TRL SFTTrainer on the warm-start rows, as one job over ``procs`` (each process takes ``batch_size`` examples a
    step); the finished model is saved to ``out`` by process 0. A finished warm start with the same settings is
    reused; one with other settings is an error naming them (nothing is overwritten)."""
    procs = procs or Processes()
    settings = {
        "base": str(Path(base).resolve()),
        "steps": steps,
        "batch_size": batch_size * procs.count,
        "learning_rate": learning_rate,
        "shift_fraction": shift_fraction,
        "seed": seed,
    }
    done = out / "warm_start.json"
    procs.barrier(f"each process reached the warm start in {out}")  # every process sees the same folder
    if done.exists():
        previous = read_json(done).get("settings")
        if previous is None:
            raise ValueError(
                f"{out} holds a warm start from an earlier version that recorded no settings: delete it "
                "or choose another --output_dir"
            )
        differ = sorted(k for k in settings if previous.get(k) != settings[k])
        if differ:
            raise ValueError(
                f"{out} holds a warm start made with other settings ("
                + "; ".join(f"{k}: {previous.get(k)!r} there, {settings[k]!r} now" for k in differ)
                + "): delete it or choose another --output_dir"
            )
        if procs.rank == 0:  # said once, not once per process
            log(f"warm start: reusing {out} ({steps} steps, seed {seed})")
        return out
    from datasets import Dataset, Image
    from trl import SFTConfig, SFTTrainer

    model, processor = load_model(str(base))
    data = Dataset.from_list(warm_start_rows(world, shift_fraction, seed)).cast_column("image", Image())
    config = SFTConfig(
        output_dir=str(out / "run"),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        warmup_steps=min(50, steps // 10),
        lr_scheduler_type="cosine",
        logging_steps=max(1, steps // 20),
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        max_length=None,
        seed=seed,
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
        disable_tqdm=False,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=processor)
    use_phase_progress(
        trainer, PhaseProgress("warm start (SFT)", {"loss": "loss", "mean_token_accuracy": "token accuracy"})
    )
    result = trainer.train()
    trainer.save_model(str(out))  # process 0 writes
    if procs.rank == 0:
        processor.save_pretrained(str(out))
        write_json_atomic(
            done, {"settings": settings, "processes": procs.count, "train_loss": result.training_loss}
        )  # last: marks it finished
    procs.barrier("process 0 saved the warm start")
    if trainer.is_deepspeed_enabled:
        # accelerate allows one DeepSpeed plugin per process state: the GRPO trainer that follows builds its own
        from accelerate.state import AcceleratorState, GradientState

        trainer.accelerator.free_memory()
        AcceleratorState._reset_state()
        GradientState._reset_state()
    return out


# --------------------------------------------------------------------------- the learning table


def query_words(query: str | None) -> set[str]:
    return set((query or "").lower().replace("?", " ").replace(",", " ").split())


def attribute_stats(query: str | None, gold: dict) -> tuple[int, int, int]:
    """(correct attribute words, wrong attribute words, attribute words stated) of one refined query."""
    if not query:
        return 0, 0, 0
    words = query_words(query)
    stated = [w for w in words if w in _VALUE_OF]
    correct = sum(1 for a in ATTRIBUTES if gold[a] in words)
    return correct, len(stated) - correct, len(stated)


def learning_row(ranks: list[int | None], queries: list[str | None] | None, golds: list[dict]) -> dict:
    n = max(len(ranks), 1)
    row = recall_at(ranks, [1, 5, 10])
    if queries is not None:
        stats = [attribute_stats(q, g) for q, g in zip(queries, golds)]
        stated = sum(s[2] for s in stats)
        row["attribute_accuracy"] = 100.0 * sum(s[0] for s in stats) / (len(ATTRIBUTES) * n)
        row["wrong_attribute_words"] = 100.0 * sum(s[1] for s in stats) / max(stated, 1)
        row["attribute_words_per_query"] = stated / n
        row["parse_rate"] = 100.0 * sum(q is not None for q in queries) / n
        words = [query_words(q) for q in queries]
        for a in ATTRIBUTES:  # which attribute the refiner gets right, e.g. the warm start's shifted colour
            row[f"{a}_accuracy"] = 100.0 * sum(g[a] in w for w, g in zip(words, golds)) / n
    return row


def evaluate_refiner(
    index,
    world: Path,
    alpha: float,
    model=None,
    processor=None,
    split: str = "test",
    batch_size: int = 64,
    max_new_tokens: int = 64,
) -> tuple[dict, list[dict]]:
    """Greedy refined queries for a split → (learning-table row, per-question records). Without a model the
    original question is the query. An unparseable completion falls back to the original question."""
    rows = list(read_jsonl(world / f"{split}.jsonl"))
    images = [open_vlm_image(world / r["image"]) for r in rows]
    questions = [r["question"] for r in rows]
    if model is None:
        raw, queries = None, None
        texts = questions
    else:
        raw = generate_completions(
            model, processor, images, questions, prompt="toy", batch_size=batch_size, max_new_tokens=max_new_tokens
        )
        queries = [parse_query(t) for t in raw]
        texts = [q if q is not None else orig for q, orig in zip(queries, questions)]
    ranks = index.entity_ranks(images, texts, [r["entity_id"] for r in rows], alpha=alpha, depth=200)
    records = [
        {"id": r["id"], "question": r["question"], "query": t, "rank": k, "raw": None if raw is None else raw[i]}
        for i, (r, t, k) in enumerate(zip(rows, texts, ranks))
    ]
    return learning_row(ranks, queries, [r["attributes"] for r in rows]), records


def format_learning_table(table: dict) -> str:
    cols = ["R@1", "R@5", "R@10", "attribute_accuracy", "wrong_attribute_words", "attribute_words_per_query"]
    lines = ["| queries | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for name in ("original", "warm_start", "grpo"):
        if name in table:
            row = table[name]
            lines.append(
                f"| {name} | "
                + " | ".join(
                    "—" if c not in row else (f"{row[c]:.2f}" if c == "attribute_words_per_query" else f"{row[c]:.1f}")
                    for c in cols
                )
                + " |"
            )
    return "\n".join(lines)
