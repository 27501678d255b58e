"""Zero-shot query baselines (WikiSeeker's Table 8): what a VLM writes as a retrieval query without RL.

    [accelerate launch -m] python -m rl.baselines --model VLM --queries q.jsonl --out baselines.jsonl \
        [--backend hf|vllm] [--prompt_file my_prompt.yaml] [--batch_size N] [--images_root DIR]

One generation per question, from one prompt that asks for a JSON object with an image ``caption`` and a zero-shot
expanded ``query``; three baseline queries are read from it (``BASELINES``):

    query_caption                   the caption alone
    query_zs_expansion              the expanded query alone
    query_zs_expansion+caption      the expanded query, then the caption

An answer that does not parse, or lacks the field a baseline needs, falls back to the original question for that
baseline (``baseline_fallback`` lists which); a question whose image does not decode, or that the processor refuses,
falls back in every baseline (``image_error`` says why; made again by the next run). Each output record is the
input record plus those fields, ``baseline_raw`` and ``baseline_parsed``. Resumable and split over processes like
rl.refine (common.job_parts). Then every method is a row of one table:

    python -m retrieval.evaluate --index DIR --alpha A --queries refined_and_baselines.jsonl \
        --text_field question --compare refined_query,query_caption,query_zs_expansion,query_zs_expansion+caption

The shipped prompt is our own wording; ``--prompt_file`` takes the published one (a YAML file with ``system`` and
``user_template`` containing ``{question}``; the answer must stay the JSON object this module parses).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from common.cli import parse, require_file, require_other_file
from common.files import check_unique_ids, input_settings, read_jsonl, weights_fingerprint
from common.job_parts import JobParts
from common.placement import dist_timeout_field, job_device, process_state, resolve_device
from common.prompts import json_objects, load_prompt, wording
from retrieval.kb import QUESTION_KEYS, check_images
from rl.generate import vlm_generator
from rl.model import usable_batch
from rl.refine import BACKENDS, IMAGE_ERROR

BASELINE_PROMPT = {
    "name": "query_baselines",
    "system": "You help search an encyclopedia with a picture and a question about it. Describe the picture in one "
    "sentence, naming what it shows as precisely as you can, and rewrite the question into a search query "
    "that adds what a searcher would need to know. Reply with one JSON object only: "
    '{"caption": "...", "query": "..."}.',
    "user_template": "Question: {question}",
}
BASELINES = ("query_caption", "query_zs_expansion", "query_zs_expansion+caption")


def parse_baseline(text: str) -> dict[str, str]:
    """The ``caption`` and ``query`` strings of the first JSON object in ``text`` that parses ({} when none does);
    a field that is missing, empty or not a string is left out."""
    obj = next(json_objects(text), {})
    return {k: v.strip() for k in ("caption", "query") if isinstance(v := obj.get(k), str) and v.strip()}


def baseline_queries(parsed: dict[str, str], question: str) -> tuple[dict[str, str], list[str]]:
    """({baseline: query}, the baselines that fell back to ``question`` because their field is missing)."""
    caption, query = parsed.get("caption"), parsed.get("query")
    wanted = {
        "query_caption": caption,
        "query_zs_expansion": query,
        "query_zs_expansion+caption": f"{query} {caption}" if query and caption else None,
    }
    return ({k: v if v else question for k, v in wanted.items()}, [k for k, v in wanted.items() if not v])


@dataclass
class BaselineArgs:
    model: str = field(
        default=None, metadata={"help": "any image-text model folder or name (the paper: Qwen2.5-VL-7B-Instruct)"}
    )
    queries: str = field(default=None, metadata={"help": "question JSONL (e.g. rl.refine's output, to add rows)"})
    out: str = field(default=None, metadata={"help": "output JSONL (appended; resumable)"})
    images_root: str = field(default=None, metadata={"help": "default: the queries file's folder"})
    prompt_file: str = field(default=None, metadata={"help": "YAML with system and user_template (default: ours)"})
    batch_size: int = field(default=16, metadata={"help": "questions per generation batch"})
    max_new_tokens: int = field(default=256, metadata={"help": "longest answer"})
    backend: str = field(default="hf", metadata={"help": "hf | vllm"})
    device: str = field(default=None, metadata={"help": "cuda / cuda:N / cpu (default: this process's own)"})
    dist_timeout_minutes: int = dist_timeout_field()


def generator(args: BaselineArgs, prompt: dict, device: str | None):
    """(images, questions) → raw answers, greedy, on the chosen backend."""
    return vlm_generator(
        args.model, prompt, args.max_new_tokens, args.backend, resolve_device(device), batch_size=args.batch_size
    )


def run_baselines(args: BaselineArgs, log=print, state=None, generate=None) -> int:
    """Every question not yet in ``args.out``: one answer, three baseline queries. Returns the questions done here."""
    if args.backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {args.backend!r}")
    require_file(args.queries, "queries")
    if not args.out:
        raise ValueError("--out is required")
    require_other_file(args.out, args.queries, "out", "queries")
    prompt = load_prompt(args.prompt_file, {}, flag="--prompt_file") if args.prompt_file else BASELINE_PROMPT
    root = Path(args.images_root or Path(args.queries).parent)
    rows = list(read_jsonl(args.queries, QUESTION_KEYS))
    check_images(rows, root, args.queries)
    check_unique_ids(rows, args.queries)
    parts = JobParts(Path(args.out), state)
    parts.same_settings(  # as rl.refine records its own: the model's weights, the backend and the input
        {
            "model": str(args.model),
            "weights": args.model and weights_fingerprint(Path(args.model)),
            "backend": args.backend,
            "prompt": wording(prompt),
            "max_new_tokens": args.max_new_tokens,
            **input_settings(args.queries, root),
        }
    )
    batches = parts.start(rows, args.batch_size, redo=lambda r: IMAGE_ERROR in r)  # an image mended since: again
    log(f"query baselines ({prompt['name']}), {parts.status}")
    fell_back, unreadable = 0, []
    if batches:
        generate = generate or generator(args, prompt, job_device(args.device, state))
        with tqdm(total=parts.mine, desc="query baselines", unit="q") as bar:
            for batch in batches:
                good, images, problems = usable_batch(batch, root)
                raw = generate(images, [r["question"] for r in good]) if good else []
                texts = dict(zip((r["id"] for r in good), raw))
                done = []
                for rec in batch:
                    why = problems.get(rec["id"])
                    text = texts.get(rec["id"])  # None: the image could not be used, every baseline falls back
                    parsed = parse_baseline(text) if why is None else {}
                    queries, fallback = baseline_queries(parsed, rec["question"])
                    fell_back += bool(fallback) and why is None
                    done.append(
                        {
                            **rec,
                            **queries,
                            "baseline_raw": text,
                            "baseline_parsed": parsed,
                            "baseline_fallback": fallback,
                            **({IMAGE_ERROR: why} if why else {}),
                        }
                    )
                    if why:
                        unreadable.append(f"{rec['id']}: {why}")
                parts.append(done)
                bar.update(len(batch))
    if unreadable:
        log(
            f"{len(unreadable)} question(s) fell back to their question in every baseline, their image not usable "
            f"({'; '.join(unreadable[:3])}{'; …' if len(unreadable) > 3 else ''}): {IMAGE_ERROR} in their records, "
            "made again on the next run with the same --out"
        )
    parts.finish(rows)
    if parts.mine:
        log(
            f"query baselines: {fell_back} of {parts.mine} answer(s) here lacked a field and fell back to the "
            f"question for it (listed per record in baseline_fallback)"
        )
    return parts.mine


def main(argv=None) -> None:
    (args,) = parse((BaselineArgs,), argv, description=__doc__)
    run_baselines(args, state=process_state(args.device, args.dist_timeout_minutes))


if __name__ == "__main__":
    from common.cli import run

    run(main)
