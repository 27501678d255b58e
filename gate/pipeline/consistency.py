"""MMKB-RAG's multi-document consistency token (MCT): its data and its use in the pipeline.

Data (Algorithm 3), ``gate.train.build_data --stage consistency`` after ``retrieve`` (and ``context``): every retrieved
document of a question gets its relevance P(Rel) — from a trained ``srt`` gate (``srt_gate``, the paper's way) or,
without one, 1/0 by whether the answer with that document was judged correct (``contexts.jsonl``). A question whose
documents include more than one relevant one (P(Rel) ≥ γ) gets a summary of the relevant documents written by the
MLLM (``model``). ``--stage label --variant mct`` then mixes in τ of the NoRel documents, shuffles, and targets the
relevant documents' numbers ranked by P(Rel) plus that summary (``gate.train.labels.mct_example``).

Inference (``gate.pipeline``, ``consistency: <mct gate>``): the trained gate reads the first-stage top-k sections,
numbered, and writes {"consistent": [...], "summary": "..."}; ``consistency_strategy`` says what the generator gets:
``filter`` — only the listed sections, in the first stage's order; ``merge`` — the summary; ``rerank`` — the first
listed section's article, then the usual within-article choice. When the output does not parse or lists no valid
section, the first stage's choice stands (counted as a fallback).
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from common.files import read_jsonl, weights_fingerprint
from common.job_parts import JobParts
from common.placement import job_device
from gate.pipeline.context import answered_other_sections, hits_digest, section_text, vlm_answerer
from gate.pipeline.rerank import FirstTokenReranker
from gate.scoring import gate_of, generate_parsed
from gate.variants import numbered_documents
from rl.model import open_vlm_image

STRATEGIES = ("filter", "merge", "rerank")
SUMMARY_SYSTEM = (
    "You are given an image, a question about it and numbered documents that help answer it. In one or "
    "two sentences, summarise what the documents say that answers the question."
)


# ---------------------------------------------------------------- data


def judged_relevance(contexts: dict, correct_score: float):
    """P(Rel) without an srt gate: 1.0 for a document whose answer was judged correct, else 0.0 (a judge that failed
    on it included). A question whose contexts are missing, or were answered for other sections than it has retrieved
    now (contexts of an earlier retrieval), is an error naming it, not a question with nothing relevant."""

    def relevance(images, batch):
        out = []
        for r in batch:
            context = contexts.get(str(r["id"]))
            if context is None or answered_other_sections(context, r["hits"]):
                found = "none" if context is None else f"answers for other sections ({len(context['doc_scores'])})"
                raise ValueError(
                    f"consistency: contexts.jsonl has {found} for question {r['id']}, which has {len(r['hits'])} "
                    "retrieved sections now: run --stage context again after --stage retrieve"
                )
            out.append([1.0 if s is not None and s >= correct_score else 0.0 for s in context["doc_scores"]])
        return out

    return relevance


def srt_relevance(path: str, device: str, dtype: str | None):
    """P(Rel) of every (image, question, document) from a trained srt gate's first token."""
    reranker = FirstTokenReranker.srt_gate(path, device=device, dtype=dtype)

    def relevance(images, batch):
        scores = reranker.score(
            images, [r["question"] for r in batch], [[section_text(h) for h in r["hits"]] for r in batch]
        )
        return [[float(x) for x in s] for s in scores]

    return relevance


def stage_consistency(args, out: Path, log=print, relevance=None, summarise=None, state=None) -> int:
    """consistency.jsonl: per question the documents' P(Rel) (``relevance``: which source) and, when more than one
    is relevant, the MLLM's summary of the relevant ones."""
    source = out / "retrieved.jsonl"
    if not source.is_file():
        raise ValueError(f"consistency: {source} does not exist (run --stage retrieve first)")
    if not args.model and summarise is None:
        raise ValueError("--model (the MLLM that writes the summaries) is required for the consistency stage")
    contexts = None
    if not args.srt_gate and relevance is None:
        ctx_path = out / "contexts.jsonl"
        if not ctx_path.is_file():
            raise ValueError(
                f"consistency without --srt_gate judges relevance by {ctx_path}, which does not exist "
                "(run --stage context first, or give --srt_gate)"
            )
        contexts = {str(r["id"]): r for r in read_jsonl(ctx_path)}
    rows = list(read_jsonl(source))
    parts = JobParts(out / "consistency.jsonl", state)
    parts.same_settings(
        {
            "srt_gate": args.srt_gate,
            "srt_gate_weights": args.srt_gate and weights_fingerprint(args.srt_gate),
            "mct_gamma": args.mct_gamma,
            "correct_score": None if args.srt_gate else args.correct_score,
            "model": args.model,
            "weights": args.model and weights_fingerprint(args.model),
            "summary_max_new_tokens": args.summary_max_new_tokens,
        }
    )
    hits = {str(r["id"]): r["hits"] for r in rows}
    # made again: a question retrieved anew since (retrieved.jsonl made again), whose P(Rel) and summary were of
    # other sections
    batches = parts.start(
        rows,
        args.batch_size,
        redo=lambda rec: answered_other_sections(rec, hits.get(str(rec["id"]), []), per_section="rel_probs"),
    )
    origin = f"srt gate {args.srt_gate}" if args.srt_gate else "judged answers"
    log(f"consistency, {parts.status}; relevance from {origin}, γ = {args.mct_gamma}")
    if batches:
        device = job_device(args.device, state)
        if relevance is None:
            relevance = (
                srt_relevance(args.srt_gate, device, args.dtype)
                if args.srt_gate
                else judged_relevance(contexts, args.correct_score)
            )
        if summarise is None:
            summarise = vlm_answerer(
                args.model, args.summary_max_new_tokens, system=SUMMARY_SYSTEM, device=device, dtype=args.dtype
            )
    qualified = 0
    for batch in tqdm(batches, desc="consistency", disable=not batches):
        images = [open_vlm_image(r["image_path"]) for r in batch]
        probs = relevance(images, batch)
        relevant = [
            [section_text(h) for h, x in zip(r["hits"], p) if x >= args.mct_gamma] for r, p in zip(batch, probs)
        ]
        todo = [i for i, docs in enumerate(relevant) if len(docs) > 1]
        texts = [f"Documents:\n{numbered_documents(relevant[i])}\nQuestion: {batch[i]['question']}" for i in todo]
        summaries = dict(zip(todo, summarise([images[i] for i in todo], texts, False))) if todo else {}
        qualified += len(todo)
        parts.append(
            [
                {
                    "id": r["id"],
                    "rel_probs": p,
                    "relevance": origin,
                    "summary": summaries[i].strip() if i in summaries else None,
                    "hits_digest": hits_digest(r["hits"]),
                }
                for i, (r, p) in enumerate(zip(batch, probs))
            ]
        )
    log(f"consistency: {qualified} of {parts.mine} questions here have more than one relevant document")
    parts.finish(rows)
    return parts.mine


# ---------------------------------------------------------------- inference


def apply_strategy(strategy: str, n_docs: int, parsed: dict | None) -> dict:
    """What the generator gets from the MCT gate's parsed output over ``n_docs`` first-stage sections (pure):
    ``docs`` — section indices in the order they are used (the first one's article is the one chosen), ``summary``
    (merge) and ``fallback`` — True when the output named no valid section, so the first stage's choice stands."""
    if strategy not in STRATEGIES:
        raise ValueError(f"consistency strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    listed = []
    for i in (parsed or {}).get("consistent") or []:
        if 1 <= i <= n_docs and i - 1 not in listed:
            listed.append(i - 1)
    summary = (parsed or {}).get("summary")
    if not listed or (strategy == "merge" and not summary):
        docs, summary, fallback = [0], None, True
    elif strategy == "filter":
        docs, summary, fallback = sorted(listed), None, False
    elif strategy == "merge":
        docs, fallback = listed, False
    else:
        docs, summary, fallback = listed + [j for j in range(n_docs) if j not in listed], None, False
    return {"strategy": strategy, "docs": docs, "summary": summary, "fallback": fallback}


class ConsistencyChecker:
    """A trained mct gate over the first-stage sections: one strategy decision per question."""

    def __init__(self, path: str, strategy: str, max_new_tokens: int, device: str, dtype: str | None):
        if strategy not in STRATEGIES:
            raise ValueError(f"consistency strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        self.model, self.processor, self.spec = gate_of(path, device, dtype, "mct")
        self.strategy, self.max_new_tokens = strategy, max_new_tokens

    def __call__(self, images, questions, sections: list[list[str]]) -> list[dict]:
        parsed = generate_parsed(
            self.model,
            self.processor,
            self.spec,
            images,
            questions,
            [numbered_documents(s) for s in sections],
            batch_size=len(questions),
            max_new_tokens=self.max_new_tokens,
        )
        return [
            {**apply_strategy(self.strategy, len(s), p), "listed": (p or {}).get("consistent")}
            for s, p in zip(sections, parsed)
        ]
