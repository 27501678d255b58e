"""The stages of gate data construction that need retrieval: what the index returns for each question, and what
the VLM answers with each retrieved section in its context (MMKB's SRT labels, the Inspector's optional check).

``retrieve`` → ``DIR/retrieved.jsonl``: per question the query used (the refiner's when ``--refiner`` is given, else
the question), the gold entity's rank and the top-k hits with their section text.
``context`` → ``DIR/contexts.jsonl``: per question, one greedy answer per retrieved section and its judged score.
Both append per batch and skip question ids already written.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tqdm import tqdm

from common.cli import require_file
from common.files import append_jsonl, completed_ids, input_settings, read_jsonl, weights_fingerprint
from common.job_parts import JobParts
from common.placement import job_device
from gate.pipeline.judges import judge_from_args, judge_settings
from gate.variants import spec, user_text
from retrieval.index import MultimodalIndex, index_fingerprint, require_index
from retrieval.kb import GOLD_KEYS, check_images
from retrieval.upstream.articles import open_store
from rl.generate import vlm_generator
from rl.model import open_vlm_image
from rl.refine import Refiner


def load_questions(queries, images_root, required=("id", "question")) -> tuple[list[dict], Path]:
    """Question rows with ``image_path`` (absolute) added; every row must hold the ``required`` fields and every image
    must exist."""
    require_file(queries, "queries")
    root = Path(images_root or Path(queries).parent)
    rows = list(read_jsonl(queries, required))
    check_images(rows, root, queries)
    return [{**r, "image_path": str((root / r["image"]).resolve())} for r in rows], root


def resolve_alpha(alpha, refiner, manifest: dict) -> float:
    """--alpha, else the α the refiner was trained with (its refiner.json), which holds only for an index of the
    encoders it was trained on (``manifest``: the index's)."""
    if alpha is not None:
        return float(alpha)
    index_spec = (refiner.spec.get("index") or {}) if refiner is not None else {}
    if index_spec.get("alpha") is None:
        raise ValueError("--alpha is required (no refiner with an index α was given)")
    trained = [index_spec.get(k) for k in ("image_encoder", "text_encoder")]
    here = [manifest.get(k) for k in ("image_encoder", "text_encoder")]
    if None not in trained and trained != here:
        raise ValueError(
            f"--alpha is required: the refiner's α {index_spec['alpha']} weighs an index of {' ⊕ '.join(trained)}, "
            f"and --index holds {' ⊕ '.join(map(str, here))}"
        )
    return float(index_spec["alpha"])


def stage_retrieve(args, out: Path, log=print, index=None, refiner=None) -> int:
    manifest = require_index(args.index) if index is None else index.manifest
    if args.refiner and refiner is None and not (Path(args.refiner) / "config.json").exists():
        raise ValueError(f"--refiner: {args.refiner} has no config.json (an exported refiner folder)")
    rows, root = load_questions(args.queries, args.images_root, GOLD_KEYS)
    kb_path = require_file(args.kb or manifest.get("kb_path"), "kb")
    target = out / "retrieved.jsonl"
    JobParts(target).same_settings(  # hits of another index, refiner (or its weights), α, k or input are not mixed in
        {
            "index": str(args.index),
            "index_files": index_fingerprint(args.index),  # an index built again at the same path
            "refiner": args.refiner and str(args.refiner),
            "refiner_weights": args.refiner and weights_fingerprint(args.refiner),
            "alpha": args.alpha,
            "k": args.k,
            **input_settings(args.queries, root),
        }
    )
    done = completed_ids(target)
    todo = [r for r in rows if str(r["id"]) not in done]
    log(f"retrieve: {len(done)} done, {len(todo)} to go, k = {args.k}")
    if not todo:
        return 0
    if refiner is None and args.refiner:
        refiner = Refiner.load(args.refiner)
    alpha = resolve_alpha(args.alpha, refiner, manifest)
    if index is None:
        index = MultimodalIndex.load(args.index)

    store = open_store(kb_path, getattr(args, "articles", None), log)
    for start in tqdm(range(0, len(todo), args.batch_size), desc="retrieving"):
        batch = todo[start : start + args.batch_size]
        images = [open_vlm_image(r["image_path"]) for r in batch]
        questions = [r["question"] for r in batch]
        texts = refiner.refine(images, questions, batch_size=len(batch)) if refiner is not None else questions
        hits, ranks = index.search_and_rank(images, texts, [r["entity_id"] for r in batch], alpha, args.k)
        entries = [[store.entry(h.entry_id) for h in hs] for hs in hits]
        if any(e is None for es in entries for e in es):
            raise ValueError(
                f"article store {store.path} lacks entries the index returned: it was built from another "
                f"KB than {kb_path}"
            )
        append_jsonl(
            target,
            [
                {
                    **r,
                    "query": t,
                    "alpha": alpha,
                    "gold_rank": rank,
                    "hits": [
                        {
                            "entity_id": h.entity_id,
                            "entry_id": h.entry_id,
                            "score": round(h.score, 6),
                            "title": e["title"],
                            "section_title": e["section_title"],
                            "text": e["text"],
                            "section": e["section"],
                        }
                        for h, e in zip(hs, es)
                    ],
                }
                for r, t, hs, es, rank in zip(batch, texts, hits, entries, ranks)
            ],
        )
    return len(todo)


def section_text(hit: dict) -> str:
    """How a retrieved section is shown to a model: its title, section title and text."""
    head = " - ".join(x for x in (hit.get("title"), hit.get("section_title")) if x)
    return f"{head}: {hit['text']}" if head else hit["text"]


def hits_digest(hits: list[dict]) -> str:
    """What a question's retrieved sections were, in 16 hex: a context record answered for other sections than the
    retrieval's is told apart (``stage_context`` redoes it, ``label`` refuses it)."""
    return hashlib.sha1(json.dumps([section_text(h) for h in hits]).encode()).hexdigest()[:16]


def answered_other_sections(rec: dict, hits: list[dict], per_section: str = "doc_scores") -> bool:
    """A record (contexts.jsonl; consistency.jsonl with ``per_section="rel_probs"``) made for other sections than
    ``hits`` (the retrieval's now): by its digest, or by its count of sections for a record written before digests
    were kept."""
    now = hits_digest(hits)
    return len(rec[per_section]) != len(hits) or rec.get("hits_digest", now) != now


def stage_context(args, out: Path, log=print, generate=None, state=None) -> int:
    """One greedy answer per retrieved section (the section in the prompt), judged like the samples."""
    source = out / "retrieved.jsonl"
    if not source.is_file():
        raise ValueError(f"context: {source} does not exist (run --stage retrieve first)")
    if not args.model and generate is None:
        raise ValueError("--model is required for the context stage")
    judge = judge_from_args(args)
    rows = list(read_jsonl(source))
    parts = JobParts(out / "contexts.jsonl", state)
    parts.same_settings(  # answers of another model (or its weights) or length, or another judge's, are not mixed in
        {
            "model": args.model,
            "weights": args.model and weights_fingerprint(args.model),
            "max_new_tokens": args.max_new_tokens,
            **judge_settings(args),
        }
    )
    hits = {str(r["id"]): r["hits"] for r in rows}
    # answered again: a failed judgement (None), or sections retrieved anew since (retrieved.jsonl made again)
    batches = parts.start(
        rows,
        args.batch_size,
        redo=lambda rec: None in rec["doc_scores"] or answered_other_sections(rec, hits.get(str(rec["id"]), [])),
    )
    log(f"context, {parts.status}")
    if generate is None and batches:
        generate = vlm_answerer(
            args.model,
            args.max_new_tokens,
            backend=args.backend,
            device=job_device(getattr(args, "device", None), state),
            dtype=getattr(args, "dtype", None),
        )
    answer = spec("answer")
    for batch in tqdm(batches, desc="answering with context", disable=not batches):
        pairs = [(r, h) for r in batch for h in r["hits"]]
        images = [open_vlm_image(r["image_path"]) for r, _ in pairs]
        texts = generate(images, [user_text(answer, r["question"], section_text(h)) for r, h in pairs], False)
        records, i = [], 0
        for r in batch:
            answers = [t.strip() for t in texts[i : i + len(r["hits"])]]
            i += len(r["hits"])
            scores = [
                judge.score(r["question"], a, r.get("answers") or [], r.get("answer_eval"), r.get("question_type"))
                for a in answers
            ]
            records.append(
                {"id": r["id"], "doc_answers": answers, "doc_scores": scores, "hits_digest": hits_digest(r["hits"])}
            )
        parts.append(records)
    parts.finish(rows)
    return parts.mine


def vlm_answerer(
    model_path: str,
    max_new_tokens: int,
    temperature: float = 1.0,
    backend: str = "hf",
    system: str | None = None,
    device: str = "cpu",
    dtype: str | None = None,
):
    """generate(images, user_texts, sample) with any VLM (rl.generate.vlm_generator) and the answer prompt (or
    ``system``)."""
    prompt = {"system": system or spec("answer")["system"], "user_template": "{question}"}
    return vlm_generator(model_path, prompt, max_new_tokens, backend, device, dtype, temperature=temperature)
