"""The label and render stages of gate.train.build_data: each question's stage records → the variant's labelled
examples (``labels-<variant>.jsonl``, by the pure rules of gate.train.labels) → TRL conversational prompt–completion
rows with an image (``<variant>.<split>.jsonl``, gate.train.render). ``args`` is build_data's ``BuildDataArgs``.
"""

from __future__ import annotations

import glob
import zlib
from pathlib import Path

from common.files import read_json, read_jsonl, write_json_atomic, write_jsonl_atomic
from common.job_parts import JobParts
from gate.pipeline.context import answered_other_sections, section_text
from gate.train.answer_expansion import EXPANDED_FILE, expanded_targets
from gate.train.labels import (
    certainty,
    hkb_label,
    inspector_label,
    kbm_accuracy_label,
    kbm_certainty_label,
    mct_example,
    ret_label,
    skb_label,
    srt_label,
)
from gate.train.render import class_balance, format_balance, hold_out, parse_class_targets, render_rows
from gate.variants import BINARY, load_gate_prompt, numbered_documents, prompt_file_for, spec
from retrieval.kb import has_gold

LABEL_SOURCES = {
    "hkb": "judged",
    "skb": "judged",
    "kbm-acc": "judged",
    "kbm-cert": "samples",
    "ret": "judged",
    "srt": "judged",
    "mct": "retrieved",
    "inspector": "retrieved",
}  # the stage file each variant labels


def _scores(rec: dict) -> list[float]:
    """A question's judged scores, every one or none: a judgement that failed (a reply the judge's parser could not
    read, the same on every retry at temperature 0) leaves the question without a label, not labelled from the samples
    whose judgements survived (wrong answers draw the explanatory replies most: the label leaned to "knows")."""
    return [] if unjudged(rec) else list(rec.get("scores", []))


def answer_as_written(gold: str) -> str:
    """A gold answer as the Inspector writes it for a FAIL: E-VQA's multi-answer "A && B" as "A, B" (its answer becomes
    the pipeline's, and E-VQA's scorer splits an answer at commas and "and", not at "&&")."""
    return ", ".join(p.strip() for p in gold.split("&&") if p.strip()) if "&&" in gold else gold


def unjudged(rec: dict) -> bool:
    """Whether some of a question's sampled answers have no judgement."""
    return any(s is None for s in rec.get("scores", []))


def correct_alone(rec: dict, correct_score: float, rule: str = "sampled-majority") -> bool | None:
    """Did the VLM answer correctly without retrieval: its one greedy answer scores ≥ ``correct_score`` (``greedy``,
    MMKB-RAG's definition), or at least half its judged samples do (``sampled-majority``: 15 of 30 is right, as hkb
    at ε = 3 calls a mean of exactly 3 known); None when unknown."""
    if rule == "greedy":
        if "greedy_score" not in rec:
            raise ValueError(
                f"question {rec.get('id')!r} has no judged greedy answer: --alone_rule greedy needs the "
                "sample and judge stages of this version (or use --alone_rule sampled-majority)"
            )
        return None if rec["greedy_score"] is None else rec["greedy_score"] >= correct_score
    scores = _scores(rec)
    return None if not scores else sum(s >= correct_score for s in scores) / len(scores) >= 0.5


def mct_from_consistency(args) -> bool:
    """mct labelled by Algorithm 3 from consistency.jsonl (not from the gold entity)."""
    return args.variant == "mct" and args.mct_rule == "srt"


def label_records(variant: str, rec: dict, args, contexts: dict | None = None) -> list[dict]:
    """The labelled examples one question yields for a variant (none when it cannot be labelled). Binary labels are
    bools whose True is the variant's positive verbaliser (search / relevant / pass)."""
    if variant == "kbm-cert":
        return [{"search": kbm_certainty_label(rec["samples"], args.tau), "certainty": certainty(rec["samples"])}]
    if variant == "mct" and args.mct_rule == "srt":
        cons = (contexts or {}).get(str(rec["id"]))
        example = cons and mct_example(
            cons["rel_probs"],
            args.mct_gamma,
            args.mct_negative_ratio,
            seed=args.seed + zlib.crc32(str(rec["id"]).encode()),
        )
        if not example:
            return []
        return [
            {
                "consistent": example["consistent"],
                "summary": cons.get("summary"),
                "context": numbered_documents([section_text(rec["hits"][j]) for j in example["shown"]]),
            }
        ]
    if not has_gold(rec):
        return []
    if variant in ("mct", "inspector"):
        hits, gold = rec["hits"], str(rec["entity_id"])
        if variant == "mct":
            return [
                {
                    "consistent": [j + 1 for j, h in enumerate(hits) if str(h["entity_id"]) == gold],
                    "context": numbered_documents([section_text(h) for h in hits]),
                }
            ]
        text_ok = None
        if args.inspector_check_answer:
            ctx = (contexts or {}).get(str(rec["id"]))
            if ctx is None or ctx["doc_scores"][0] is None:
                return []
            text_ok = ctx["doc_scores"][0] >= args.correct_score
        label = inspector_label(
            hits[0]["entity_id"],
            gold,
            answer_as_written(str((rec.get("answers") or [""])[0])),
            text_ok,
            top_section=hits[0].get("section"),
            gold_section=rec.get("evidence_section_id"),
        )
        return [{"pass": label["pass"] == "true", "inspector": label, "context": section_text(hits[0])}]
    scores = _scores(rec)
    if not scores:
        return []
    if variant == "hkb":
        return [{"search": hkb_label(scores, args.epsilon) == "true"}]
    if variant == "skb":
        return [{"search_score": skb_label(scores)}]
    if variant == "kbm-acc":
        return [{"search": kbm_accuracy_label([s >= args.correct_score for s in scores], args.tau)}]
    alone = correct_alone(rec, args.correct_score, args.alone_rule)
    if alone is None:
        return []
    if variant == "ret":
        return [{"search": ret_label(alone) == "Ret"}]
    ctx = (contexts or {}).get(str(rec["id"]))  # srt: one example per document that changes the answer
    if ctx is None:
        return []
    out = []
    for j, (hit, score) in enumerate(zip(ctx["hits"], ctx["doc_scores"])):
        label = None if score is None else srt_label(alone, score >= args.correct_score)
        if label is not None:
            out.append({"id": f"{rec['id']}#d{j + 1}", "relevant": label == "Rel", "context": section_text(hit)})
    return out


KEEP = (
    "id",
    "image",
    "image_path",
    "question",
    "answers",
    "answer_eval",
    "entity_id",
    "question_type",
    "split",
    "evidence_section_id",
)


def same_judge(judged: Path, contexts: Path) -> None:
    """srt compares an answer without retrieval (``judged``) with one per section (``contexts``): both must be
    judged by one judge, or a document that changed nothing reads as one that did."""
    recorded = [JobParts(f).settings_file for f in (judged, contexts)]
    made = [
        {k: v for k, v in read_json(r).items() if k in ("judge", "judge_model")} if r.is_file() else None
        for r in recorded
    ]
    if None not in made and made[0] != made[1]:
        raise ValueError(
            f"label srt: {judged.name} was judged by {made[0]} and {contexts.name} by {made[1]}: the two halves of "
            "an srt label must come from one judge; run --stage judge or --stage context again with the other's"
        )


def stage_label(args, out: Path, log=print) -> int:
    source = out / f"{LABEL_SOURCES[args.variant]}.jsonl"
    if not source.is_file():
        raise ValueError(f"label: {source} does not exist (run the earlier stages first)")
    contexts = None
    if mct_from_consistency(args):
        cons_path = out / "consistency.jsonl"
        if not cons_path.is_file():
            raise ValueError(
                f"label mct: {cons_path} does not exist (run --stage consistency first, or set --mct_rule gold-entity)"
            )
        recorded = JobParts(cons_path).settings_file
        made_with = read_json(recorded).get("mct_gamma") if recorded.is_file() else None
        if made_with is not None and made_with != args.mct_gamma:
            raise ValueError(
                f"label mct: {cons_path} was made with γ = {made_with} (its summaries cover the documents with P(Rel) "
                f"≥ {made_with}), but --mct_gamma is {args.mct_gamma}: label with --mct_gamma {made_with}, or rerun "
                "--stage consistency into another --out"
            )
        contexts = {str(r["id"]): r for r in read_jsonl(cons_path)}
        hits = {str(r["id"]): r["hits"] for r in read_jsonl(source)}
        stale = [
            qid
            for qid, cons in contexts.items()
            if qid in hits and answered_other_sections(cons, hits[qid], per_section="rel_probs")
        ]
        if stale:
            raise ValueError(
                f"label mct: {cons_path} made {len(stale)} question(s) (first: {', '.join(stale[:3])}) for other "
                f"sections than {source} holds now (retrieved again since): run --stage consistency again"
            )
    elif args.variant == "srt" or (args.variant == "inspector" and args.inspector_check_answer):
        ctx_path = out / "contexts.jsonl"
        if not ctx_path.is_file():
            raise ValueError(f"label {args.variant}: {ctx_path} does not exist (run --stage context first)")
        if args.variant == "srt":
            same_judge(out / "judged.jsonl", ctx_path)
        hits = {str(r["id"]): r["hits"] for r in read_jsonl(out / "retrieved.jsonl")}
        contexts = {str(r["id"]): {**r, "hits": hits.get(str(r["id"]), [])} for r in read_jsonl(ctx_path)}
        stale = [qid for qid, ctx in contexts.items() if answered_other_sections(ctx, ctx["hits"])]
        if stale:
            raise ValueError(
                f"label {args.variant}: {ctx_path} answered {len(stale)} question(s) (first: {', '.join(stale[:3])}) "
                f"with other sections than {out / 'retrieved.jsonl'} holds now (retrieved again since): run --stage "
                "context again"
            )
    target = out / f"labels-{args.variant}.jsonl"
    rows, skipped, no_gold, partly_judged = [], 0, 0, 0
    for rec in read_jsonl(source):  # every question, every run (a label costs no model call)
        labelled = label_records(args.variant, rec, args, contexts)
        if not labelled:
            no_gold += not has_gold(rec) and not mct_from_consistency(args)
            partly_judged += unjudged(rec) and has_gold(rec)
            skipped += 1
            continue
        base = {k: rec[k] for k in KEEP if k in rec} | {"variant": args.variant, "question_id": str(rec["id"])}
        rows += [base | lab for lab in labelled]
    write_jsonl_atomic(target, rows)  # ε, τ or a rule changed: the whole file is relabelled, never a mix
    log(
        f"label ({args.variant}): {len(rows)} examples, {skipped} questions without a label"
        + (f" ({no_gold} have no gold answer: usable by kbm-cert only)" if no_gold else "")
        + (
            f" ({partly_judged} with a sampled answer the judge gave no score for: see judged.jsonl's scores, and "
            "judge again, or with another judge)"
            if partly_judged
            else ""
        )
    )
    return len(rows)


def stage_render(args, out: Path, log=print) -> int:
    """labels-<variant>.jsonl → <variant>.<split>.jsonl: TRL conversational prompt–completion rows with an image."""
    source = out / f"labels-{args.variant}.jsonl"
    if not source.is_file():
        raise ValueError(f"render: {source} does not exist (run --stage label --variant {args.variant} first)")

    targets = parse_class_targets(args.class_targets) if args.class_targets else None
    prompt = load_gate_prompt(args.gate_prompt, args.variant) if args.gate_prompt else None
    used = spec(args.variant, args.verbalisers, prompt)
    write_json_atomic(
        prompt_file_for(out, args.variant),
        {
            "system": used["system"],
            "user_template": used["user"],
            "verbalisers": list(used["verbalisers"]),  # in order: SFT reads its classes from them (gate.train.sft)
            "source": prompt["name"] if prompt else "built-in",
        },
    )
    by_split: dict[str, list[dict]] = {}
    for rec in read_jsonl(source):
        by_split.setdefault(rec.get("split") or "train", []).append(rec)
    if args.inspector_expanded:
        by_split = {split: with_expanded_answers(recs, out) for split, recs in by_split.items()}
    if args.holdout:
        by_split = hold_out(by_split, args.holdout, args.seed)
    for stale in sorted(out.glob(f"{glob.escape(args.variant)}.*.jsonl")):
        split = stale.name[len(args.variant) + 1 : -len(".jsonl")]
        if split not in by_split:  # an earlier render's split (--holdout's test) would hold this render's train rows
            stale.unlink()
            log(f"render ({args.variant}): removed {stale}, a split this render does not make")
    total = 0
    for split, recs in sorted(by_split.items()):
        report: dict = {}
        rows = render_rows(
            args.variant,
            recs,
            verbalisers=args.verbalisers,
            max_per_class=args.max_per_class if split == "train" else None,
            seed=args.seed if split == "train" else None,
            balance=args.balance and split == "train",
            skb_target=args.skb_target,
            targets=targets if split == "train" else None,
            report=report,
            prompt=prompt,
        )
        write_jsonl_atomic(out / f"{args.variant}.{split}.jsonl", rows)
        balance = class_balance(rows)
        log(
            f"render ({args.variant}, {split}): {len(rows)} rows → {out / f'{args.variant}.{split}.jsonl'}; "
            f"classes {format_balance(balance)}"
        )
        if split == "train" and args.variant in BINARY and len(balance) < 2:
            log(
                "  note: one class only: a gate trained on it learns one answer, and gate SFT refuses it unless "
                "allow_single_class (label more questions, or another threshold)"
            )
        for cls, rep in report.items():
            short = (
                "" if rep["taken"] >= rep["wanted"] or rep["wanted"] <= 1 else f"   (only {rep['available']} available)"
            )
            log(f"  {cls}: {rep['taken']} taken of {rep['available']} available (target {rep['wanted']:g}){short}")
        total += len(rows)
    return total


def with_expanded_answers(recs: list[dict], out: Path) -> list[dict]:
    """Inspector label rows whose FAIL answer is the expanded sentence (``--stage expand``); every FAIL row must have
    one."""
    targets = expanded_targets(out)
    missing = [  # none, or one expanded from another short answer (the question was labelled again since)
        str(r["id"])
        for r in recs
        if not r["pass"] and targets.get(str(r["id"]), (None,))[0] != str(r["inspector"].get("answer", ""))
    ]
    if missing:
        raise ValueError(
            f"render --inspector_expanded: {len(missing)} FAIL example(s) have no expanded answer for their short "
            f"answer in {out / EXPANDED_FILE} (first: {', '.join(missing[:3])}); run --stage expand"
        )
    return [
        r if r["pass"] else {**r, "inspector": {**r["inspector"], "answer": targets[str(r["id"])][1]}} for r in recs
    ]
