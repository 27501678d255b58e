"""Batched refiner inference: questions in, refined queries out.

    python -m rl.refine --model DIR --queries q.jsonl --out refined.jsonl [--batch_size N] [--backend hf|vllm]
        [--sample [--seed S]] [--images_root DIR]

``--model`` is an exported folder (``rl.export``) or a checkpoint; its own prompt and parser come from
``refiner.json`` (or the run record). Each output record is the input record plus ``refined_query``,
``raw_output`` and ``format_ok``; a completion that does not parse falls back to the original question, and so does
a question whose image does not decode or is refused by the processor (``image_error`` says why; such
records are made again by the next run). Resumable:
ids already in ``--out`` are skipped, and every batch is appended and flushed, so an interrupted run loses nothing
it wrote. ``accelerate launch -m rl.refine …`` splits the questions over processes (each on its own device, every
N-th batch) and merges their parts into ``--out`` in input order (common.job_parts). Greedy by default; ``--sample``
samples with the run's settings (``refiner.json``, the same as its ``generation_config.json``), on either backend,
every setting passed explicitly (rl.generate.sampling_settings); ``--seed`` makes its draws repeatable (per batch).

Python API: ``Refiner.load(path)`` and ``refiner.refine(images, questions) -> list[str]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from common.cli import parse, require_file, require_other_file
from common.files import check_unique_ids, input_settings, read_json, read_jsonl, weights_fingerprint
from common.job_parts import JobParts
from common.placement import dist_timeout_field, process_state, resolve_device
from retrieval.kb import QUESTION_KEYS, check_images
from rewards.format import MAX_QUERY_TOKENS, parse_query
from rl.generate import generate_completions, generate_vllm, load_vllm
from rl.image_budget import apply_image_budget
from rl.model import load_model, usable_batch
from rl.prompts import prompt_spec
from rl.run_record import RUN_RECORD, find_run_record

BACKENDS = ("hf", "vllm")
FALLBACK_GENERATION = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 256}  # a model with no record of its run
IMAGE_ERROR = "image_error"  # a question whose image could not be used: why, in its output record


def unrefined(question: str) -> dict:
    """The output fields of a question left as it was (no refiner output)."""
    return {"refined_query": question, "raw_output": None, "format_ok": False}


def load_spec(path: Path, say=print) -> dict:
    """refiner.json of an exported folder, else built from the record of the run a checkpoint belongs to, else (a base
    model, or a checkpoint moved out of its run folder) our wikiseeker prompt and ``FALLBACK_GENERATION``, said in one
    line: a refiner trained on another prompt, or on longer replies, is then refined otherwise than it was trained."""
    if (path / "refiner.json").exists():
        return read_json(path / "refiner.json")
    rec = find_run_record(path)
    if rec is not None:
        return {
            "prompt": rec["prompt"],
            "generation": rec["generation"],
            "index": rec["index"],
            "image_budget": rec.get("image_budget"),
            "max_query_tokens": rec["refiner_args"].get("max_query_tokens", MAX_QUERY_TOKENS),
        }
    say(
        f"note: {path} has neither refiner.json (a folder written by python -m rl.export) nor a run record "
        f"({RUN_RECORD}) in it or in the two folders above, so it refines with our wikiseeker prompt, up to "
        f"{FALLBACK_GENERATION['max_new_tokens']} new tokens and a {MAX_QUERY_TOKENS}-token query cap, whatever it was "
        "trained with: export the checkpoint (python -m rl.export) or keep it in its run folder to refine as trained"
    )
    return {"prompt": prompt_spec("wikiseeker"), "generation": dict(FALLBACK_GENERATION)}


class Refiner:
    """A refiner VLM with its own prompt and parser."""

    def __init__(self, model, processor, spec: dict, backend: str = "hf", llm=None):
        self.model, self.processor, self.spec, self.backend, self.llm = model, processor, spec, backend, llm

    @classmethod
    def load(cls, path, backend: str = "hf", device: str | None = None, dtype: str | None = None) -> Refiner:
        path = Path(path)
        if backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if not (path / "config.json").exists():
            raise ValueError(f"--model: {path} has no config.json (export a checkpoint with python -m rl.export)")

        spec = load_spec(path)
        budget = spec.get("image_budget")  # the pixel budget the refiner was trained with, on both backends
        if backend == "vllm":
            from transformers import AutoProcessor

            llm = load_vllm(path, image_budget=budget)
            return cls(None, apply_image_budget(AutoProcessor.from_pretrained(str(path)), budget), spec, "vllm", llm)

        device = resolve_device(device)
        model, processor = load_model(str(path), dtype, device=device)
        return cls(model.to(device), apply_image_budget(processor, budget), spec)

    def generate(
        self, images: list, questions: list[str], batch_size: int = 16, sample: bool = False, progress: bool = False
    ) -> list[str]:
        gen = self.spec["generation"]
        if self.backend == "vllm":
            return self._generate_vllm(images, questions, sample)

        return generate_completions(
            self.model,
            self.processor,
            images,
            questions,
            prompt=self.spec["prompt"],
            batch_size=batch_size,
            max_new_tokens=gen["max_new_tokens"],
            do_sample=sample,
            sampling=gen,
            progress=progress,
        )

    def _generate_vllm(self, images, questions, sample):
        gen = self.spec["generation"]
        return generate_vllm(
            self.llm,
            self.processor,
            images,
            questions,
            self.spec["prompt"],
            gen["max_new_tokens"],
            do_sample=sample,
            sampling=gen,
        )

    def refine_with_outputs(self, images, questions, **kw) -> list[dict]:
        if not questions:
            return []
        raw = self.generate(images, questions, **kw)
        out = []
        for q, text in zip(questions, raw):
            query = parse_query(text, self.spec.get("max_query_tokens", MAX_QUERY_TOKENS))  # as training parsed
            out.append(
                {"refined_query": query if query is not None else q, "raw_output": text, "format_ok": query is not None}
            )
        return out

    def refine(self, images, questions, **kw) -> list[str]:
        """Refined query per (image, question); the original question where the output does not parse."""
        return [r["refined_query"] for r in self.refine_with_outputs(images, questions, **kw)]


@dataclass
class RefineArgs:
    model: str = field(default=None, metadata={"help": "exported refiner folder or checkpoint"})
    queries: str = field(default=None, metadata={"help": "question JSONL"})
    out: str = field(default=None, metadata={"help": "output JSONL (appended; resumable)"})
    images_root: str = field(default=None, metadata={"help": "default: the queries file's folder"})
    batch_size: int = field(default=16, metadata={"help": "questions per generation batch"})
    backend: str = field(default="hf", metadata={"help": "hf | vllm"})
    sample: bool = field(default=False, metadata={"help": "sample with the run's sampling settings (default: greedy)"})
    seed: int = field(
        default=None,
        metadata={
            "help": "--sample: each batch draws from seed + the position of its first question in --queries, so a "
            "rerun with the same --batch_size samples the same queries, on any number of processes"
        },
    )
    dist_timeout_minutes: int = dist_timeout_field()


def refine_file(args: RefineArgs, log=print, refiner: Refiner | None = None, state=None) -> int:
    """Refine every question not yet in ``args.out``; with an accelerate ``state`` of N processes each takes every
    N-th batch and the output is merged in input order (common.job_parts). Returns the questions refined here."""
    if args.backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {args.backend!r}")
    if not args.model and refiner is None:
        raise ValueError("--model is required: an exported refiner folder (python -m rl.export) or a checkpoint")
    require_file(args.queries, "queries")
    if not args.out:
        raise ValueError("--out is required")
    require_other_file(args.out, args.queries, "out", "queries")
    if args.batch_size <= 0:
        raise ValueError(f"--batch_size must be positive, got {args.batch_size}")
    root = Path(args.images_root or Path(args.queries).parent)
    rows = list(read_jsonl(args.queries, QUESTION_KEYS))
    check_images(rows, root, args.queries)
    check_unique_ids(rows, args.queries)
    out = Path(args.out)
    parts = JobParts(out, state)
    parts.same_settings(  # what makes each refined query: a model re-exported into the same folder is another one
        {
            "model": str(args.model),
            "weights": args.model and weights_fingerprint(Path(args.model)),
            "sample": args.sample,
            "seed": args.seed if args.sample else None,
            "backend": args.backend,  # vLLM and transformers decode alike only up to their numerics
            **input_settings(args.queries, root),  # another queries file's records are not kept beside these
        }
    )
    batches = parts.start(rows, args.batch_size, redo=lambda r: IMAGE_ERROR in r)  # an image mended since: again
    position = {r["id"]: i for i, r in enumerate(rows)}
    log(f"refine, {parts.status}")
    unreadable, parsed, generated = [], 0, 0
    if batches:
        refiner = refiner or Refiner.load(
            args.model, backend=args.backend, device=str(state.device) if state is not None else None
        )
        with tqdm(total=parts.mine, desc="refining", unit="q") as bar:
            for batch in batches:
                good, images, problems = usable_batch(batch, root)
                if args.sample and args.seed is not None:  # both backends draw from torch's generator
                    torch.manual_seed(args.seed + position[batch[0]["id"]])
                results = refiner.refine_with_outputs(
                    images, [r["question"] for r in good], batch_size=args.batch_size, sample=args.sample
                )
                done = {r["id"]: {**r, **res} for r, res in zip(good, results)}
                parsed, generated = parsed + sum(res["format_ok"] for res in results), generated + len(results)
                for r in batch:
                    if r["id"] in problems:  # the question stays as it was, as for an output that does not parse
                        done[r["id"]] = {**r, **unrefined(r["question"]), IMAGE_ERROR: problems[r["id"]]}
                        unreadable.append(f"{r['id']}: {problems[r['id']]}")
                parts.append([done[r["id"]] for r in batch])
                bar.update(len(batch))
    if generated:  # every output that does not parse falls back to its question: a refiner that never parses
        log(  # would leave the question's own figures in every table, unannounced
            f"refine: {parsed} of {generated} output(s) here parsed ({100 * parsed / generated:.1f} %); the other "
            f"{generated - parsed} kept their question (format_ok false in their records)"
        )
    if unreadable:
        log(
            f"{len(unreadable)} question(s) kept their question unrefined, their image not usable "
            f"({'; '.join(unreadable[:3])}{'; …' if len(unreadable) > 3 else ''}): {IMAGE_ERROR} in their records, "
            "refined on the next run with the same --out"
        )
    parts.finish(rows)
    return parts.mine


def main(argv=None) -> None:
    (args,) = parse((RefineArgs,), argv, description=__doc__)
    refine_file(args, state=process_state(None, args.dist_timeout_minutes))


if __name__ == "__main__":
    from common.cli import run

    run(main)
