"""The full KB-VQA pipeline: gate → refine → retrieve → rerank → inspect → generate, and its evaluation.

    python -m gate.pipeline --config configs/pipeline/X.yaml --queries q.jsonl --out DIR

Per question: the boundary gate (a trained hkb/skb/kbm/ret gate, or ``always`` / ``never``) decides whether to
retrieve; without retrieval the VLM (``answerer``) answers alone. With retrieval: the refiner rewrites the question
(``none`` = the question itself), the index returns the top-k entities' best sections, a reranker (optional) rescores
them (β1) and the sections of the chosen article (β2), the Inspector (optional) passes or fails the selected
section — PASS → the generator answers with it, FAIL → the Inspector's own answer (decoupled generation).

With ``baselines: true`` (default) every question goes through both paths, so No RAG, All RAG, a random gate at the
same retrieval ratio and the oracle gate come from the same run and table; ``baselines: false`` runs only the path
the gate chose. Every stage is batched with its own progress bar; each finished question is appended (resumable: ids
already done are skipped). ``accelerate launch -m gate.pipeline …`` splits the questions over processes, every model
of a process on its own device, and merges their parts into ``predictions.jsonl`` in input order. Writes
``metrics.json``, ``metrics.md`` and ``accuracy_vs_retrieval.png`` (the gate's threshold swept over one scoring
pass, with the baselines). Its arguments and their checks: gate/pipeline/arguments.py. A question row without ``id``
or ``question`` is an error naming its line; a question without answers (nor ``answer_eval``: an InfoSeek test file
converted for inference) is scored wrong and their number is said first (``without_answers`` in metrics.json), except
where the benchmark's rule cannot score one (E-VQA's; InfoSeek's for a typed question): refused before any model loads.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from common.cli import parse
from common.files import (
    check_unique_ids,
    pyplot,
    read_json,
    read_jsonl,
    save_figure,
    write_json_atomic,
    write_text_atomic,
)
from common.job_parts import JobParts
from common.llm import request_failed
from common.placement import job_device, process_state
from gate.pipeline.arguments import PipelineArgs, check_same_config, validate
from gate.pipeline.context import section_text
from gate.pipeline.end_to_end import (
    format_table,
    hop_accuracy,
    infoseek_figures,
    infoseek_untyped,
    is_gold_section,
    split_accuracy,
    stage_latency,
    summarize,
    threshold_curve,
)
from gate.pipeline.metrics import refuses_unanswered
from gate.pipeline.stages import Stages
from gate.scoring import threshold_grid
from retrieval.kb import QUESTION_KEYS, has_gold
from rl.model import usable_batch

# ---------------------------------------------------------------- one batch, in the order of WikiSeeker's Figure 2


class Clock:
    """Seconds per stage for one batch; per-question latency = batch seconds / questions in the stage."""

    def __init__(self, bars: dict | None = None):
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.bars = bars or {}

    def time(self, stage: str, n: int, fn, *a, **kw):
        t = time.perf_counter()
        result = fn(*a, **kw)
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t
        self.counts[stage] = self.counts.get(stage, 0) + n
        if stage in self.bars:
            self.bars[stage].update(n)
        return result

    def time_rows(self, stage: str, fn, rows: list[int], *columns) -> dict:
        """``fn`` over the items ``rows`` of each of ``columns``, timed as ``stage``: {row: its result}; ``fn`` is not
        called when ``rows`` is empty."""
        if not rows:
            return {}
        return dict(zip(rows, self.time(stage, len(rows), fn, *[[column[i] for i in rows] for column in columns])))

    def per_question(self) -> dict[str, float]:
        return {s: self.seconds[s] / max(1, self.counts[s]) for s in self.seconds}


def answered(answer: str | None, failed: str | None = None) -> dict:
    """An answer, or why there is none: a missing or empty one is recorded as None with the reason, whichever stage
    gave it (scored as an empty prediction, as the official scorers would score one)."""
    if answer is not None and str(answer).strip():
        return {"answer": answer}
    return {"answer": None, "failed": failed or ("empty answer" if answer is not None else "no answer")}


def stage_names(consistency: bool) -> list[str]:
    """The pipeline's timed stages in order (progress bars, latency, benchmarks/pipeline.py)."""
    return (
        ["gate", "answer alone", "refine", "retrieve", "rerank"]
        + ["consistency"] * consistency
        + ["section", "inspect", "generate"]
    )


def context_of(mct: dict | None, chosen: dict, picked: list[dict]) -> tuple[list[dict], str]:
    """The sections the generator's context comes from, and the context: the chosen section, or by the MCT strategy
    the listed sections (filter) or the gate's summary of them (merge); rerank only changed the chosen article."""
    if mct is None or mct["fallback"] or mct["strategy"] == "rerank":
        return [chosen], section_text(chosen)
    if mct["summary"] is not None:
        return picked, mct["summary"]
    return picked, "\n\n".join(section_text(e) for e in picked)


def rag_path(st: Stages, batch: list[dict], images, clock: Clock) -> list[dict]:
    """refine → retrieve → rerank → inspect → generate for a batch; one result dict per question."""
    n = len(batch)
    if not n:
        return []
    questions = [r["question"] for r in batch]
    queries = (
        clock.time("refine", n, st.refiner.refine, images, questions, batch_size=n)
        if st.refiner is not None
        else questions
    )
    text_emb, hits, ranks = clock.time("retrieve", n, st.retrieve, images, queries, [r.get("entity_id") for r in batch])
    ranked = clock.time("rerank", n, st.rerank.first_stage, images, questions, hits)
    mct = (
        clock.time(
            "consistency", n, st.consistency, images, questions, [[section_text(e) for e in es] for es in ranked]
        )
        if st.consistency
        else [None] * n
    )
    picked = [[es[j] for j in m["docs"]] if m else es[:1] for es, m in zip(ranked, mct)]
    chosen = clock.time(
        "section", n, st.rerank.within, images, questions, text_emb, [p[0]["entity_id"] for p in picked]
    )
    shown, contexts = map(list, zip(*[context_of(m, c, p) for m, c, p in zip(mct, chosen, picked)]))
    verdicts = clock.time("inspect", n, st.inspect, images, questions, contexts) if st.inspect else [None] * n
    # with baselines, the generator also answers where the Inspector failed the section: the pipeline without the
    # Inspector (WikiSeeker's ablation) comes from the same run
    to_generate = [i for i in range(n) if verdicts[i] is None or verdicts[i]["pass"] or st.args.baselines]
    generated = clock.time_rows("generate", st.generate, to_generate, images, questions, contexts)
    results = []
    for i, r in enumerate(batch):
        if verdicts[i] is None or verdicts[i]["pass"]:
            answer, reason = generated[i]
        else:
            answer = verdicts[i]["answer"]
            reason = None if answer else "the Inspector failed the section and gave no parseable answer"
        results.append(
            {
                "query": queries[i],
                "retrieved": [h.entity_id for h in hits[i]],
                "gold_rank": ranks[i],
                # what the Inspector and generator were shown: the chosen section, or MCT's listed ones (filter, merge)
                "section": shown[i][0]["entry_id"] if shown[i] == [chosen[i]] else [e["entry_id"] for e in shown[i]],
                "section_right": any(
                    is_gold_section(e["entity_id"], e.get("section"), r.get("entity_id"), r.get("evidence_section_id"))
                    for e in shown[i]
                ),
                **({"consistency": mct[i]} if mct[i] is not None else {}),
                "inspector": verdicts[i],
                **answered(answer, reason),
            }
        )
        if verdicts[i] is not None and i in generated:  # the generator's answer with this section, Inspector or not
            results[-1]["without_inspector"] = answered(*generated[i])
    return results


def run_batch(st: Stages, batch: list[dict], images, bars: dict | None = None) -> list[dict]:
    """The gate decides; the VLM answers alone and/or the RAG path answers (both with baselines); the judge scores."""
    args, n = st.args, len(batch)
    clock = Clock(bars)
    questions = [r["question"] for r in batch]
    if st.gate is not None:
        scores = clock.time("gate", n, st.gate, images, questions)
        retrieve = [bool(x >= st.gate.threshold) for x in scores]
    else:
        scores, retrieve = [None] * n, [args.gate == "always"] * n
    alone_idx = [i for i in range(n) if args.baselines or not retrieve[i]]
    rag_idx = [i for i in range(n) if args.baselines or retrieve[i]]
    alone = clock.time_rows("answer alone", st.answer, alone_idx, images, questions)
    rag = dict(zip(rag_idx, rag_path(st, [batch[i] for i in rag_idx], [images[i] for i in rag_idx], clock)))
    alone = {i: answered(a) for i, a in alone.items()}
    st.judge(
        [(batch[i], a) for i, a in alone.items()]
        + [(batch[i], x) for i, x in rag.items()]
        + [(batch[i], x["without_inspector"]) for i, x in rag.items() if "without_inspector" in x]
    )
    per_question = clock.per_question()
    out = []
    for i, r in enumerate(batch):
        a = alone.get(i)
        chosen = rag.get(i) if retrieve[i] else a
        went = {"gate"} | ({"answer alone"} if i in alone else set())
        if i in rag:
            verdict = rag[i]["inspector"]
            went |= {"refine", "retrieve", "rerank", "consistency", "section", "inspect"} | (
                {"generate"} if not verdict or verdict["pass"] else set()
            )
        latency = {s: v for s, v in per_question.items() if s in went}  # summed over questions = stage seconds
        out.append(
            {
                "id": r["id"],
                "split": r.get("split"),
                "question": r["question"],
                "answers": r.get("answers"),
                "entity_id": r.get("entity_id"),
                "question_type": r.get("question_type"),
                "gate": {"score": None if scores[i] is None else float(scores[i]), "retrieve": retrieve[i]},
                "alone": a,
                "rag": rag.get(i),
                "answer": chosen["answer"],
                "correct": chosen["correct"],
                "latency": latency,
            }
        )
    return out


def unfinished(record: dict) -> bool:
    """A prediction the next run makes again: its image was missing, or an endpoint request failed after its retries
    (``failed`` says so: the server may be back). An empty answer the model gave is an answer, kept."""
    paths = [record.get("alone"), record.get("rag"), (record.get("rag") or {}).get("without_inspector")]
    return "skipped" in record or any(request_failed((p or {}).get("failed")) for p in paths)


def count_unanswered(rows: list[dict], metric: str, source, log=print) -> set[str]:
    """The ids of the questions that have nothing to score an answer against, said in one line: each is a miss in
    accuracy (an InfoSeek test file, converted for inference, has no answers; its predictions are still wanted).
    Where the benchmark's rule would refuse such a question once the models had answered it, a ValueError naming them
    now."""
    lacking = [r for r in rows if not has_gold(r)]
    refused = [str(r["id"]) for r in lacking if refuses_unanswered(metric, r)]
    if refused:
        raise ValueError(
            f"{source}: {len(refused)} question(s) have no answers (nor answer_eval), which the {metric} rule cannot "
            f"score (first: {', '.join(refused[:3])}{' …' if len(refused) > 3 else ''})"
        )
    if lacking:
        log(
            f"{len(lacking)} of {len(rows)} question(s) in {source} have no answers (nor answer_eval): every answer to "
            "them is scored wrong, a miss in accuracy (unless it is skipped)"
        )
    return {str(r["id"]) for r in lacking}


def run(args: PipelineArgs, log=print, stages: Stages | None = None, state=None) -> dict | None:
    """Answer every question not yet in ``predictions.jsonl`` and report. With an accelerate ``state`` of N processes
    each answers every N-th batch on its own device and process 0 merges the parts in input order and reports (the
    others return None): the same predictions as one process (common.job_parts)."""
    validate(args)
    rows = list(read_jsonl(args.queries, QUESTION_KEYS))[: args.limit]
    check_unique_ids(rows, args.queries)
    unanswered = count_unanswered(rows, args.metric, args.queries, log)
    root = Path(args.images_root or Path(args.queries).parent)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    check_same_config(out, args)
    target = out / "predictions.jsonl"
    parts = JobParts(target, state)
    batches = parts.start(rows, args.batch_size, redo=unfinished)
    log(f"pipeline, {parts.status}")
    if batches:
        stages = stages or Stages(args, job_device(args.device, state))  # every model loads (or fails) first
        log("placement: " + "; ".join(f"{k}: {v}" for k, v in stages.placement.items()))
        if parts.rank == 0:  # where the stages of the latest run that answered ran: metrics.json reports it
            write_json_atomic(out / PLACEMENT_FILE, stages.placement)
        names = stage_names(stages.consistency is not None)
        bars = {s: tqdm(total=parts.mine, desc=f"{s:>12}", position=i, unit="q") for i, s in enumerate(names)}
        for batch in batches:
            present, images, problems = usable_batch(batch, root)
            skipped = [{"id": r["id"], "skipped": problems[r["id"]]} for r in batch if r["id"] in problems]
            parts.append(skipped + (run_batch(stages, present, images, bars) if present else []))
        for bar in bars.values():
            bar.close()
    if not parts.finish(rows):
        return None
    ids = {str(r["id"]) for r in rows}
    by_id: dict[str, dict] = {}
    for r in read_jsonl(target):  # each question once (a line repeated by hand would count twice), the first kept
        if str(r["id"]) in ids:
            by_id.setdefault(str(r["id"]), r)
    records = list(by_id.values())
    again = sum(unfinished(r) for r in records)
    if again:
        log(
            f"{again} of {len(records)} question(s) unfinished (an image missing or unusable, or a request that "
            f"failed after its retries): run again with the same --out to do those again"
        )
    return report(records, out, args, log, without_answers=unanswered)


PLACEMENT_FILE = "placement.json"  # each stage's device and dtype, as the latest run that answered placed them


def report(records: list[dict], out: Path, args: PipelineArgs, log=print, without_answers=frozenset()) -> dict:
    complete = [r for r in records if "skipped" not in r]
    both = bool(complete) and all(r["alone"] is not None and r["rag"] is not None for r in complete)
    metrics = summarize(records) if both else _summarize_chosen(records)
    # the scored questions that were scored wrong for want of answers (``without_answers``: their ids)
    metrics["without_answers"] = sum(str(r["id"]) in without_answers for r in complete)
    gate_scores = [s for r in complete if (s := r["gate"]["score"]) is not None and np.isfinite(s)]
    if both and gate_scores:
        metrics["threshold_curve"] = threshold_curve(records, threshold_grid(gate_scores))
    if (out / PLACEMENT_FILE).is_file():
        metrics["placement"] = read_json(out / PLACEMENT_FILE)
    write_json_atomic(out / "metrics.json", metrics)
    system = f"pipeline (gate: {gate_name(args.gate)})"
    table = format_table(metrics, system) if "accuracy" in metrics else "no answered questions"
    write_text_atomic(out / "metrics.md", table + "\n")
    if both:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(5.5, 4))
        if "threshold_curve" in metrics:
            c = metrics["threshold_curve"]
            ax.plot([p["retrieval_ratio"] for p in c], [p["accuracy"] for p in c], marker=".", label="gate thresholds")
        for name, b in metrics["baselines"].items():
            ax.scatter([b["retrieval_ratio"]], [b["accuracy"]], label=name, zorder=3)
        ax.scatter([metrics["retrieval_ratio"]], [metrics["accuracy"]], marker="*", s=150, label="this run", zorder=4)
        ax.set_xlabel("retrieval ratio")
        ax.set_ylabel("accuracy")
        ax.legend(fontsize=7)
        save_figure(fig, out / "accuracy_vs_retrieval.png")
    log(table)
    log(json.dumps({k: v for k, v in metrics.items() if k not in ("baselines", "threshold_curve")}, indent=1))
    return metrics


def gate_name(gate: str) -> str:
    """always / never, or the trained gate's variant and folder."""
    info = Path(gate) / "gate.json"
    if gate in ("always", "never") or not info.is_file():
        return gate
    return f"{read_json(info)['variant']}, {gate}"


def _summarize_chosen(records: list[dict]) -> dict:
    """Without baselines: the chosen answers' accuracy, retrieval ratio and the benchmarks' own figures (per split,
    E-VQA's single-hop, InfoSeek's official scores), as with them."""
    done = [r for r in records if "skipped" not in r]
    if not done:
        return {"n": 0, "skipped": len(records)}
    correct = np.array([bool(r["correct"]) for r in done])
    return {
        "n": len(done),
        "skipped": len(records) - len(done),
        "accuracy": float(correct.mean()),
        "accuracy_by_split": split_accuracy(done, correct),
        "accuracy_by_hops": hop_accuracy(done, correct),
        "infoseek": infoseek_figures(done, correct, [r.get("answer") is not None for r in done]),
        "infoseek_untyped": infoseek_untyped(done),
        "retrieval_ratio": float(np.mean([r["gate"]["retrieve"] for r in done])),
        "baselines": {},
        "latency_s": stage_latency(done),
    }


def main(argv=None) -> None:
    (args,) = parse((PipelineArgs,), argv, description=__doc__)
    run(args, state=process_state(args.device, args.dist_timeout_minutes))


if __name__ == "__main__":
    from common.cli import run as run_cli

    run_cli(main)
