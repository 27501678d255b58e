"""Gate training data, in stages cached to JSONL and resumable per question id.

    python -m gate.build_data --stage sample --queries q.jsonl --model VLM --out DIR [--samples 30] [--temperature 1.0]
    python -m gate.build_data --stage judge  --out DIR --judge exact|token|llm [--judge_url URL --judge_model M]
    python -m gate.build_data --stage label  --out DIR --variant hkb|skb|kbm-acc|kbm-cert [--epsilon 3] [--tau 0.9]

``sample`` answers each question R times with any AutoModelForImageTextToText VLM (batched, progress bar) →
``DIR/samples.jsonl``; ``judge`` scores every sampled answer on the 1–5 scale (each distinct answer once) →
``DIR/judged.jsonl``; ``label`` turns judged samples into the variant's labels (gate.labels) →
``DIR/labels-<variant>.jsonl``. Every stage appends per batch and skips ids already written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from retrieval.cli import require_file
from retrieval.files import completed_ids, read_jsonl
from retrieval.kb import check_images

STAGES = ("sample", "judge", "label")
VARIANTS = ("hkb", "skb", "kbm-acc", "kbm-cert")
ANSWER_PROMPT = {"name": "answer", "user_template": "{question}",
                 "system": "Answer the question about the image with a short phrase."}


@dataclass
class BuildDataArgs:
    stage: str = field(default=None, metadata={"help": "sample | judge | label"})
    out: str = field(default=None, metadata={"help": "stage folder (samples.jsonl, judged.jsonl, labels-*.jsonl)"})
    queries: str = field(default=None, metadata={"help": "sample: question JSONL"})
    images_root: str = field(default=None, metadata={"help": "sample: default the queries file's folder"})
    model: str = field(default=None, metadata={"help": "sample: VLM path or name"})
    samples: int = field(default=30, metadata={"help": "sample: answers per question (R)"})
    temperature: float = field(default=1.0, metadata={"help": "sample: sampling temperature"})
    max_new_tokens: int = field(default=32, metadata={"help": "sample: answer length"})
    batch_size: int = field(default=8, metadata={"help": "sample: questions per batch"})
    judge: str = field(default="exact", metadata={"help": "judge: exact | token | llm"})
    judge_url: str = field(default=None, metadata={"help": "judge llm: OpenAI-compatible base URL"})
    judge_model: str = field(default=None, metadata={"help": "judge llm: model name"})
    judge_key_env: str = field(default="OPENAI_API_KEY", metadata={"help": "judge llm: env var holding the key"})
    variant: str = field(default=None, metadata={"help": "label: hkb | skb | kbm-acc | kbm-cert"})
    epsilon: float = field(default=3.0, metadata={"help": "label hkb: search needed when mean score < ε"})
    tau: float = field(default=0.9, metadata={"help": "label kbm-*: threshold τ"})
    correct_score: float = field(default=4.0, metadata={"help": "label kbm-acc: a judged score ≥ this is correct"})


def _append(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        fh.flush()


def stage_sample(args: BuildDataArgs, out: Path, log=print, generate=None) -> int:
    from PIL import Image
    from tqdm import tqdm

    require_file(args.queries, "queries")
    if not args.model and generate is None:
        raise ValueError("--model is required for the sample stage")
    root = Path(args.images_root or Path(args.queries).parent)
    rows = list(read_jsonl(args.queries))
    check_images(rows, root, args.queries)
    target = out / "samples.jsonl"
    done = completed_ids(target)
    todo = [r for r in rows if str(r["id"]) not in done]
    log(f"sample: {len(done)} done, {len(todo)} to go, R = {args.samples}")
    if generate is None and todo:
        from rl.generate import generate_completions
        from rl.model import load_model

        model, processor = load_model(args.model)

        def generate(images, questions):
            return generate_completions(model, processor, images, questions, prompt=ANSWER_PROMPT,
                                        batch_size=len(questions), max_new_tokens=args.max_new_tokens,
                                        do_sample=True, temperature=args.temperature)
    for start in tqdm(range(0, len(todo), args.batch_size), desc="sampling", disable=not todo):
        batch = todo[start:start + args.batch_size]
        images = [Image.open(root / r["image"]).convert("RGB") for r in batch for _ in range(args.samples)]
        texts = generate(images, [r["question"] for r in batch for _ in range(args.samples)])
        _append(target, [{**r, "samples": [t.strip() for t in texts[i * args.samples:(i + 1) * args.samples]]}
                         for i, r in enumerate(batch)])
    return len(todo)


def stage_judge(args: BuildDataArgs, out: Path, log=print) -> int:
    from gate.judges import judge_all, make_judge

    source = out / "samples.jsonl"
    if not source.is_file():
        raise ValueError(f"judge: {source} does not exist (run --stage sample first)")
    kwargs = dict(url=args.judge_url, model=args.judge_model, api_key_env=args.judge_key_env) \
        if args.judge == "llm" else {}
    judge = make_judge(args.judge, **kwargs)
    target = out / "judged.jsonl"
    done = completed_ids(target)
    todo = [r for r in read_jsonl(source) if str(r["id"]) not in done]
    cache: dict = {}
    for start in range(0, len(todo), 64):
        batch = todo[start:start + 64]
        _append(target, [{**r, "judge": args.judge, "scores": s} for r, s in zip(batch, judge_all(batch, judge, cache))])
    failures = getattr(judge, "failures", 0)
    log(f"judge ({args.judge}): {len(todo)} questions, {len(cache)} distinct answers judged, {failures} failures")
    return len(todo)


def label_of(rec: dict, args: BuildDataArgs):
    """The variant's label for one judged record (None when it cannot be labelled, e.g. every judging failed)."""
    from gate.labels import certainty, hkb_label, kbm_accuracy_label, kbm_certainty_label, skb_label

    if args.variant == "kbm-cert":
        return {"search": kbm_certainty_label(rec["samples"], args.tau), "certainty": certainty(rec["samples"])}
    scores = [s for s in rec.get("scores", []) if s is not None]
    if not scores:
        return None
    if args.variant == "hkb":
        return {"search": hkb_label(scores, args.epsilon)}
    if args.variant == "skb":
        return {"search_score": skb_label(scores)}
    return {"search": kbm_accuracy_label([s >= args.correct_score for s in scores], args.tau)}


def stage_label(args: BuildDataArgs, out: Path, log=print) -> int:
    if args.variant not in VARIANTS:
        raise ValueError(f"--variant must be one of {', '.join(VARIANTS)}, got {args.variant!r}")
    source = out / ("samples.jsonl" if args.variant == "kbm-cert" else "judged.jsonl")
    if not source.is_file():
        raise ValueError(f"label: {source} does not exist (run the earlier stages first)")
    target = out / f"labels-{args.variant}.jsonl"
    done = completed_ids(target)
    rows, skipped = [], 0
    for rec in read_jsonl(source):
        if str(rec["id"]) in done:
            continue
        label = label_of(rec, args)
        if label is None:
            skipped += 1
            continue
        rows.append({k: rec[k] for k in ("id", "image", "question") if k in rec} | {"variant": args.variant, **label})
    _append(target, rows)
    log(f"label ({args.variant}): {len(rows)} labelled, {skipped} without a usable judgement")
    return len(rows)


def build(args: BuildDataArgs, log=print) -> int:
    if args.stage not in STAGES:
        raise ValueError(f"--stage must be one of {', '.join(STAGES)}, got {args.stage!r}")
    if not args.out:
        raise ValueError("--out is required")
    if args.samples <= 0 or args.batch_size <= 0:
        raise ValueError("--samples and --batch_size must be positive")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return {"sample": stage_sample, "judge": stage_judge, "label": stage_label}[args.stage](args, out, log)


def main(argv=None) -> None:
    from retrieval.cli import parse

    (args,) = parse((BuildDataArgs,), argv, description=__doc__)
    build(args)


if __name__ == "__main__":
    from retrieval.cli import run

    run(main)
