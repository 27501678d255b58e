"""Gate training data, in stages cached to JSONL and resumable per question id.

    python -m gate.train.build_data --stage sample   --queries q.jsonl --model VLM --out DIR [--samples 30]
    [--temperature 1.0]
    python -m gate.train.build_data --stage judge    --out DIR --judge exact|token|llm [--judge_url URL --judge_model M]
    python -m gate.train.build_data --stage retrieve --queries q.jsonl --index IDX --out DIR [--refiner DIR] [--k 5]
    python -m gate.train.build_data --stage context  --model VLM --out DIR --judge exact
    python -m gate.train.build_data --stage consistency --model VLM --out DIR [--srt_gate DIR]        (mct's data)
    python -m gate.train.build_data --stage label    --out DIR --variant hkb|skb|kbm-acc|kbm-cert|ret|srt|mct|inspector
    python -m gate.train.build_data --stage expand   --out DIR --expander_url URL --expander_model M   (Inspector,
    E-VQA)
    python -m gate.train.build_data --stage render   --out DIR --variant V [--max_per_class N] [--balance]
        [--class_targets pass:3000,fail:5000] [--inspector_expanded] [--holdout 0.05]

``sample`` answers each question R times with any AutoModelForImageTextToText VLM (batched, progress bar) →
``samples.jsonl``; ``judge`` scores every sampled answer on the 1–5 scale (each distinct answer once) →
``judged.jsonl``; ``retrieve`` and ``context`` (gate.pipeline.context) record the top-k retrieved sections and the
VLM's answer with each; ``consistency`` (gate.pipeline.consistency) each document's P(Rel) and, for questions with more
than one relevant document, the MLLM's summary of them (MMKB-RAG's MCT data); ``label`` turns them into the variant's
labels → ``labels-<variant>.jsonl``; ``expand`` turns the Inspector's FAIL answers into sentences
(gate.train.answer_expansion); ``render`` writes TRL conversational prompt–completion datasets
``<variant>.<split>.jsonl`` and prints the class balance (label and render: gate.train.labelling). Every stage
appends per batch and skips ids already written. A question without a gold answer is labelled for ``kbm-cert`` only
(reported).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from common.cli import check_choices, parse
from common.files import input_settings, read_jsonl, weights_fingerprint
from common.job_parts import JobParts
from common.placement import dist_timeout_field, job_device, process_state
from gate.pipeline.consistency import stage_consistency
from gate.pipeline.context import load_questions, stage_context, stage_retrieve, vlm_answerer
from gate.pipeline.judges import judge_all, judge_from_args, judge_settings
from gate.train.answer_expansion import stage_expand
from gate.train.labelling import LABEL_SOURCES, stage_label, stage_render
from gate.train.render import check_shaping
from retrieval.kb import has_gold
from rl.model import open_vlm_image

STAGES = ("sample", "judge", "retrieve", "context", "consistency", "label", "expand", "render")
PARALLEL = ("sample", "context", "consistency")  # the long ones: split over processes when launched on many
MCT_RULES = ("srt", "gold-entity")
SKB_TARGETS = ("stochastic", "round")
ALONE_RULES = ("greedy", "sampled-majority")
BACKENDS = ("hf", "vllm")  # rl.generate.vlm_generator's


@dataclass
class BuildDataArgs:
    stage: str = field(default=None, metadata={"help": "the stage to run", "choices": STAGES})
    out: str = field(default=None, metadata={"help": "stage folder (samples, judged, retrieved, contexts, labels-*)"})
    queries: str = field(default=None, metadata={"help": "sample/retrieve: question JSONL"})
    images_root: str = field(default=None, metadata={"help": "sample/retrieve: default the queries file's folder"})
    model: str = field(default=None, metadata={"help": "sample/context: VLM path or name"})
    samples: int = field(default=30, metadata={"help": "sample: answers per question (R)"})
    temperature: float = field(default=1.0, metadata={"help": "sample: sampling temperature"})
    backend: str = field(
        default="hf", metadata={"help": "sample/context: vllm when vLLM is installed", "choices": BACKENDS}
    )
    device: str = field(
        default=None,
        metadata={
            "help": "sample/context/consistency/expand: the model's device (default: this process's own, "
            "cuda:LOCAL_RANK or cpu)"
        },
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "sample/context/consistency/expand: the model's weights: auto (bf16 on a GPU, fp32 on the CPU), "
            "bf16, fp16, fp32"
        },
    )
    max_new_tokens: int = field(default=32, metadata={"help": "sample/context: answer length"})
    batch_size: int = field(default=8, metadata={"help": "questions per batch"})
    judge: str = field(default="exact", metadata={"help": "judge/context: exact | token | llm"})
    judge_url: str = field(default=None, metadata={"help": "judge llm: OpenAI-compatible base URL"})
    judge_model: str = field(default=None, metadata={"help": "judge llm: model name"})
    judge_key_env: str = field(default="OPENAI_API_KEY", metadata={"help": "judge llm: env var holding the key"})
    index: str = field(default=None, metadata={"help": "retrieve: index directory"})
    kb: str = field(default=None, metadata={"help": "retrieve: KB JSONL (default: the one the index was built from)"})
    refiner: str = field(default=None, metadata={"help": "retrieve: exported refiner folder (default: the question)"})
    alpha: float = field(default=None, metadata={"help": "retrieve: α (default: the refiner's index α)"})
    k: int = field(default=5, metadata={"help": "retrieve: sections per question"})
    variant: str = field(
        default=None, metadata={"help": "label/render: the gate variant", "choices": tuple(LABEL_SOURCES)}
    )
    epsilon: float = field(default=3.0, metadata={"help": "label hkb: search needed when mean score < ε"})
    tau: float = field(
        default=0.9,
        metadata={
            "help": "label kbm-*: the label threshold τ on sampled accuracy / certainty (not the scoring threshold γ, "
            "which is gate_threshold at inference)"
        },
    )
    correct_score: float = field(default=4.0, metadata={"help": "label: a judged score ≥ this is a correct answer"})
    alone_rule: str = field(
        default="greedy",
        metadata={
            "help": "ret/srt labels: did the VLM answer right without retrieval — greedy (MMKB-RAG: its one greedy "
            "answer, judged) or sampled-majority (at least half of the R judged samples right)",
            "choices": ALONE_RULES,
        },
    )
    inspector_check_answer: bool = field(
        default=False,
        metadata={"help": "label inspector: PASS also needs the answer with the top section to be judged correct"},
    )
    mct_rule: str = field(
        default="srt",
        metadata={
            "help": "label mct: srt (MMKB-RAG Algorithm 3, from --stage consistency: questions with more than one "
            "relevant document, τ of the NoRel ones mixed in, target ranked by P(Rel) plus a summary) or gold-entity "
            "(every retrieved section, the gold entity's ones consistent)",
            "choices": MCT_RULES,
        },
    )
    srt_gate: str = field(
        default=None,
        metadata={
            "help": "consistency: trained srt gate whose P(Rel) judges each document (default: 1/0 by the judged "
            "answer with the document)"
        },
    )
    mct_gamma: float = field(
        default=0.5, metadata={"help": "consistency/label mct: a document is relevant when P(Rel) ≥ γ"}
    )
    mct_negative_ratio: float = field(
        default=0.3, metadata={"help": "label mct: τ, the share of a question's NoRel documents mixed in (0–1)"}
    )
    summary_max_new_tokens: int = field(default=64, metadata={"help": "consistency: length of the MLLM's summary"})
    skb_target: str = field(
        default="stochastic",
        metadata={
            "help": "render skb: the non-integer score 1.0–5.0 as the target digit — stochastic (rounded up with "
            "probability equal to its fraction, seeded per example: the expected target is the score) or round",
            "choices": SKB_TARGETS,
        },
    )
    verbalisers: list[str] = field(default=None, metadata={"help": "render: replace the variant's verbalisers"})
    holdout: float = field(
        default=None,
        metadata={
            "help": "render: move this share of the train questions (the same ones in every variant, by a hash of "
            "their id and --seed) with all their examples to <variant>.test.jsonl, the held-out eval_file"
        },
    )
    max_per_class: int = field(default=None, metadata={"help": "render: cap per class (train split)"})
    balance: bool = field(default=False, metadata={"help": "render: cap every train class at the smallest's size"})
    seed: int = field(default=0, metadata={"help": "sample: sampling seed (per batch); render: seed for capping"})
    class_targets: str = field(
        default=None,
        metadata={
            "help": "render: per-class counts (pass:3000,fail:5000) or "
            "shares (pass:0.5,fail:0.5) of the train split, "
            "sampled with --seed"
        },
    )
    expander: str = field(default=None, metadata={"help": "expand: a local text LLM (path or name)"})
    expander_url: str = field(
        default=None, metadata={"help": "expand: OpenAI-compatible base URL (key from --judge_key_env)"}
    )
    expander_model: str = field(default=None, metadata={"help": "expand: the endpoint's model name"})
    expansion_max_new_tokens: int = field(
        default=128, metadata={"help": "expand: reply length (a JSON object holding a sentence; not sample's 32)"}
    )
    expansion_prompt: str = field(default=None, metadata={"help": "expand: YAML prompt file ({question}, {answer})"})
    gate_prompt: str = field(
        default=None,
        metadata={
            "help": "render: the variant's prompt from a YAML file "
            "(system, user_template); train_sft and scoring use it"
        },
    )
    inspector_expanded: bool = field(
        default=False, metadata={"help": "render inspector: FAIL completions use the expanded answers (--stage expand)"}
    )
    dist_timeout_minutes: int = dist_timeout_field()


def stage_sample(args: BuildDataArgs, out: Path, log=print, generate=None, state=None) -> int:
    import torch

    rows, root = load_questions(args.queries, args.images_root)
    if not args.model and generate is None:
        raise ValueError("--model is required for the sample stage")
    parts = JobParts(out / "samples.jsonl", state)
    parts.same_settings(  # samples of another model or its weights, R, temperature, length, seed or input are not
        {  # mixed in; the batch size too: each batch's samples are drawn together
            "model": args.model,
            "weights": args.model and weights_fingerprint(args.model),
            "samples": args.samples,
            "temperature": args.temperature,
            "max_new_tokens": args.max_new_tokens,
            "seed": args.seed,
            "batch_size": args.batch_size,
            **input_settings(args.queries, root),
        }
    )
    batches = parts.start(rows, args.batch_size)
    log(f"sample, {parts.status}, R = {args.samples}")
    if generate is None and batches:
        generate = vlm_answerer(
            args.model,
            args.max_new_tokens,
            args.temperature,
            backend=args.backend,
            device=job_device(args.device, state),
            dtype=args.dtype,
        )
    for batch in tqdm(batches, desc="sampling", disable=not batches):
        images = [open_vlm_image(r["image_path"]) for r in batch for _ in range(args.samples)]
        torch.manual_seed(args.seed + zlib.crc32(str(batch[0]["id"]).encode()))  # same samples on a rerun
        texts = generate(images, [r["question"] for r in batch for _ in range(args.samples)], True)
        greedy = generate(images[:: args.samples], [r["question"] for r in batch], False)  # MMKB-RAG's one answer
        parts.append(
            [
                {
                    **r,
                    "samples": [t.strip() for t in texts[i * args.samples : (i + 1) * args.samples]],
                    "greedy": greedy[i].strip(),
                }
                for i, r in enumerate(batch)
            ]
        )
    parts.finish(rows)
    return parts.mine


def judge_failed(rec: dict) -> bool:
    """A judged record to judge again: a sample or the greedy answer whose judgement failed (None) although the
    question has gold answers (without them nothing is judged, and the record is done)."""
    return rec.get("judge") is not None and (None in rec["scores"] or ("greedy" in rec and rec["greedy_score"] is None))


def stage_judge(args: BuildDataArgs, out: Path, log=print) -> int:
    source = out / "samples.jsonl"
    if not source.is_file():
        raise ValueError(f"judge: {source} does not exist (run --stage sample first)")
    judge = judge_from_args(args)
    rows = list(read_jsonl(source))
    sampled = {str(r["id"]): (r["samples"], r.get("greedy")) for r in rows}
    parts = JobParts(out / "judged.jsonl")
    parts.same_settings(judge_settings(args))  # scores of another judge are not mixed in
    # judged again: a failed judgement, and answers sampled since (samples.jsonl made anew)
    batches = parts.start(
        rows,
        64,
        redo=lambda rec: judge_failed(rec) or sampled.get(str(rec["id"])) != (rec["samples"], rec.get("greedy")),
    )
    cache: dict = {}
    for batch in batches:
        unjudged = [r for r in batch if not has_gold(r)]  # nothing to judge against: kbm-cert labels them unjudged
        batch = [r for r in batch if has_gold(r)]
        greedy = [{**r, "samples": [r["greedy"]]} for r in batch if "greedy" in r]
        greedy_scores = iter(judge_all(greedy, judge, cache))  # the same cache: an answer is judged once
        parts.append(
            [
                {
                    **r,
                    "judge": args.judge,
                    "scores": s,
                    **({"greedy_score": next(greedy_scores)[0]} if "greedy" in r else {}),
                }
                for r, s in zip(batch, judge_all(batch, judge, cache))
            ]
            + [
                {**r, "judge": None, "scores": [None] * len(r["samples"])}
                | ({"greedy_score": None} if "greedy" in r else {})
                for r in unjudged
            ],
        )
    parts.finish(rows)
    failures, no_gold = getattr(judge, "failures", 0), sum(not has_gold(r) for b in batches for r in b)
    log(
        f"judge ({args.judge}): {parts.mine} questions"
        + (f" ({parts.redone} judged again: a failed judgement, or answers sampled since)" if parts.redone else "")
        + f", {len(cache)} distinct answers judged, {failures} failures"
        + (" (judged again by the next run)" if failures else "")
        + (f"; {no_gold} without gold answers, not judged" if no_gold else "")
    )
    return parts.mine


def build(args: BuildDataArgs, log=print, state=None) -> int:
    check_choices(args)
    if not args.stage:
        raise ValueError(f"--stage is required ({', '.join(STAGES)})")
    if not args.out:
        raise ValueError("--out is required")
    if args.samples <= 0 or args.batch_size <= 0 or args.k <= 0:
        raise ValueError("--samples, --batch_size and --k must be positive")
    for name, lo, hi in (  # the judge's 1–5 scale; shares and probabilities: a setting off its scale labels alike
        ("epsilon", 1.0, 5.0),
        ("correct_score", 1.0, 5.0),
        ("tau", 0.0, 1.0),
        ("mct_gamma", 0.0, 1.0),
        ("mct_negative_ratio", 0.0, 1.0),
    ):
        if not lo <= getattr(args, name) <= hi:
            raise ValueError(f"--{name} must lie in [{lo:g}, {hi:g}], got {getattr(args, name)}")
    check_shaping(args.max_per_class, args.balance, args.class_targets)  # before render removes other splits
    if args.stage in ("label", "render") and not args.variant:
        raise ValueError(f"--stage {args.stage} needs --variant ({', '.join(LABEL_SOURCES)})")
    if args.stage in ("judge", "context"):
        judge_from_args(args)  # a bad judge name or missing URL fails before any model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    stages = {
        "sample": stage_sample,
        "judge": stage_judge,
        "retrieve": stage_retrieve,
        "context": stage_context,
        "consistency": stage_consistency,
        "label": stage_label,
        "expand": stage_expand,
        "render": stage_render,
    }
    if args.stage in PARALLEL:
        return stages[args.stage](args, out, log, state=state)
    return stages[args.stage](args, out, log)


def main(argv=None) -> None:
    (args,) = parse((BuildDataArgs,), argv, description=__doc__)
    if args.stage not in PARALLEL and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            f"--stage {args.stage} runs in one process (only {', '.join(PARALLEL)} split over processes): every "
            "launched process would do all of it and append to the same file; run it without accelerate launch"
        )
    build(args, state=process_state(args.device, args.dist_timeout_minutes) if args.stage in PARALLEL else None)


if __name__ == "__main__":
    from common.cli import run

    run(main)
