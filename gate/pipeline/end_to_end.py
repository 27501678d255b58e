"""End-to-end KB-VQA metrics from per-question pipeline records, and the gate baselines — pure functions.

A record (one line of predictions.jsonl) carries both answers the pipeline can give — ``alone`` (the VLM without
retrieval) and ``rag`` (refine → retrieve → rerank → inspect → generate) — with their correctness, the gate's score
and decision. So one run gives the gate's system and every baseline of the knowledge-boundary papers on the same
questions: No RAG, All RAG, a random gate at the same retrieval ratio (mean of 5 seeds) and the oracle gate
(retrieve exactly where the VLM alone was wrong).
"""

from __future__ import annotations

import numpy as np

from gate.pipeline.metrics import harmonic_mean
from gate.pipeline.metrics_evqa import EVQA_QUESTION_TYPES, evqa_report
from gate.pipeline.metrics_infoseek import infoseek_report, infoseek_split, is_infoseek_type

UNSEEN_SPLITS = ("unseen_question", "unseen_entity")


def is_gold_section(entity, section, gold_entity, gold_section=None) -> bool:
    """The section is the evidence: the gold entity's article and, when the data names the evidence section
    (E-VQA's ``evidence_section_id``) and the section's index is known, that very section."""
    if str(entity) != str(gold_entity):
        return False
    if gold_section is None or section is None or isinstance(gold_section, list):
        return True
    return int(section) == int(gold_section)


def system_correct(records: list[dict], retrieve) -> np.ndarray:
    """Correctness when the questions flagged in ``retrieve`` take the RAG answer and the others the VLM's own."""
    alone = np.array([bool(r["alone"]["correct"]) for r in records])
    rag = np.array([bool(r["rag"]["correct"]) for r in records])
    return np.where(np.asarray(retrieve, dtype=bool), rag, alone)


def baselines(records: list[dict], ratio: float, seeds: int = 5) -> dict[str, dict]:
    """No RAG, All RAG, random gate at ``ratio`` (mean over seeds), oracle gate: accuracy and retrieval ratio."""
    n = len(records)
    if n == 0:
        return {}
    alone_ok = np.array([bool(r["alone"]["correct"]) for r in records])
    out = {
        "No RAG": {"accuracy": float(alone_ok.mean()), "retrieval_ratio": 0.0},
        "All RAG": {"accuracy": float(system_correct(records, np.ones(n)).mean()), "retrieval_ratio": 1.0},
    }
    k = int(round(ratio * n))
    accs = []
    for seed in range(seeds):
        pick = np.zeros(n, dtype=bool)
        pick[np.random.default_rng(seed).permutation(n)[:k]] = True
        accs.append(system_correct(records, pick).mean())
    out["random gate"] = {"accuracy": float(np.mean(accs)), "retrieval_ratio": k / n}
    oracle = ~alone_ok
    out["oracle gate"] = {
        "accuracy": float(system_correct(records, oracle).mean()),
        "retrieval_ratio": float(oracle.mean()),
    }
    return out


def split_accuracy(records: list[dict], correct: np.ndarray) -> dict[str, float]:
    """Accuracy per ``split`` (InfoSeek's ``val_unseen_question`` counted as ``unseen_question``, …) over every
    question, one without an answer wrong; with both unseen splits, their harmonic mean as ``hm`` — only when every
    record has a question type. Fractions, unrounded: ``infoseek_figures`` gives the official InfoSeek scores."""
    by: dict[str, list[bool]] = {}
    for r, ok in zip(records, correct):
        split = str(r.get("split") or "all")
        split = next((s for s in UNSEEN_SPLITS if split.endswith(s)), split)
        by.setdefault(split, []).append(bool(ok))
    out = {k: float(np.mean(v)) for k, v in sorted(by.items())}
    if all(s in out for s in UNSEEN_SPLITS) and all(is_infoseek_type(r.get("question_type")) for r in records):
        out["hm"] = harmonic_mean(*(out[s] for s in UNSEEN_SPLITS))
    return out


def chosen_answered(records: list[dict], retrieve) -> np.ndarray:
    """Whether the answer the system gave (RAG where ``retrieve``, else the VLM's own) exists: the pipeline records a
    missing or empty one as ``answer: None`` (with why, under ``failed``)."""
    return np.array(
        [
            (r["rag"] if go else r["alone"]).get("answer", "") is not None
            for r, go in zip(records, np.asarray(retrieve, dtype=bool))
        ],
        dtype=bool,
    )


def infoseek_figures(records: list[dict], correct, answered) -> dict | None:
    """InfoSeek's official scores in % (gate.pipeline.metrics_infoseek.infoseek_report) when every record has an
    InfoSeek question type and a split, over every question: one the system gave no answer for is in the results file
    as an empty prediction, which the official scorer scores like any other (``official_correct`` decided it so);
    ``no_answer`` counts those per split. None otherwise."""
    if not records or not all(map(scorable_by_infoseek, records)):
        return None
    rows = [{"id": r.get("id"), "data_split": r["split"], "question_type": r["question_type"]} for r in records]
    out = infoseek_report(rows, [bool(ok) for ok in correct])
    del out["all_questions"], out["no_prediction"]  # every question has a prediction: both equal the official row
    out["no_answer"] = {s: 0 for s in out["n"]}
    for r, has in zip(records, answered):
        out["no_answer"][infoseek_split(r["split"])] += not has
    return out


def scorable_by_infoseek(record: dict) -> bool:
    """Whether InfoSeek's official scorer can score a question: it has an InfoSeek question type and a split."""
    return is_infoseek_type(record.get("question_type")) and bool(record.get("split"))


def infoseek_untyped(records: list[dict]) -> list[str]:
    """The ids of InfoSeek questions (some record has an InfoSeek type) the official scorer cannot score (its
    ``qid2qtype[qid]``), for which ``infoseek_figures`` leaves out every official figure."""
    if not any(is_infoseek_type(r.get("question_type")) for r in records):
        return []
    return [str(r.get("id")) for r in records if not scorable_by_infoseek(r)]


def hop_accuracy(records: list[dict], correct: np.ndarray) -> dict[str, float] | None:
    """E-VQA's report: single-hop (every question type but 2_hop), two-hop and overall accuracy; None without types."""
    if not any(r.get("question_type") in EVQA_QUESTION_TYPES for r in records):
        return None
    report = evqa_report([{"question_type": r.get("question_type")} for r in records], [bool(c) for c in correct])
    return {k: None if report[k] is None else report[k] / 100.0 for k in ("single_hop", "two_hop", "overall")}


def inspector_confusion(records: list[dict]) -> dict[str, int] | None:
    """Inspector routing against the oracle (was the selected section the gold entity's): counts of
    pass/fail × right/wrong section, over questions that went through the Inspector, and the routing accuracy
    (PASS on a right section or FAIL on a wrong one)."""
    seen = [r for r in records if r["rag"].get("inspector") is not None]
    if not seen:
        return None
    out = {"pass_right": 0, "pass_wrong": 0, "fail_right": 0, "fail_wrong": 0}
    for r in seen:
        key = ("pass" if r["rag"]["inspector"]["pass"] else "fail") + (
            "_right" if r["rag"]["section_right"] else "_wrong"
        )
        out[key] += 1
    out["routing_accuracy"] = (out["pass_right"] + out["fail_wrong"]) / len(seen)
    return out


def without_inspector(records: list[dict], retrieve) -> dict | None:
    """The same run without the Inspector (the generator answers with the selected section every time): the gated
    system, All RAG and the oracle gate — when every record carries that answer (the pipeline's baselines)."""
    if not records or not all("without_inspector" in r["rag"] for r in records):
        return None
    plain = [dict(r, rag=r["rag"]["without_inspector"]) for r in records]
    alone_ok = np.array([bool(r["alone"]["correct"]) for r in records])
    return {
        "accuracy": float(system_correct(plain, retrieve).mean()),
        "All RAG": float(system_correct(plain, np.ones(len(plain))).mean()),
        "oracle gate": float(system_correct(plain, ~alone_ok).mean()),
    }


def consistency_report(records: list[dict]) -> dict | None:
    """The MCT stage over the questions that went through it: its strategy, how often its output named no valid
    section (the first stage's choice stood), and how many sections it listed on average."""
    seen = [r["rag"]["consistency"] for r in records if (r.get("rag") or {}).get("consistency")]
    if not seen:
        return None
    return {
        "strategy": seen[0]["strategy"],
        "n": len(seen),
        "fallback_ratio": float(np.mean([m["fallback"] for m in seen])),
        "mean_listed": float(np.mean([len(m["listed"] or []) for m in seen])),
    }


def stage_latency(done: list[dict]) -> dict:
    """Seconds per question of each stage, over the questions that went through it (with baselines every question
    goes through both paths; without, a question only through its own), the same in every kind of run."""
    stages = sorted({s for r in done for s in r.get("latency", {})})
    return {s: float(np.mean([r["latency"][s] for r in done if s in r.get("latency", {})])) for s in stages}


def summarize(records: list[dict]) -> dict:
    """metrics.json: the system's accuracy, token accuracy, retrieval ratio, per split, latency per stage, the
    Inspector's confusion matrix and the baselines."""
    done = [r for r in records if "skipped" not in r]
    if not done:
        return {"n": 0, "skipped": len(records)}
    retrieve = np.array([bool(r["gate"]["retrieve"]) for r in done])
    correct = system_correct(done, retrieve)
    token = np.where(retrieve, [r["rag"]["token_accuracy"] for r in done], [r["alone"]["token_accuracy"] for r in done])
    latency = stage_latency(done)
    failed = sum(bool(r["rag"].get("failed")) or bool(r["alone"].get("failed")) for r in done)
    section_right = [r["rag"]["section_right"] for r in done if r["rag"].get("section_right") is not None]
    return {
        "n": len(done),
        "skipped": len(records) - len(done),
        "failed": failed,
        "accuracy": float(correct.mean()),
        "token_accuracy": float(np.mean(token)),
        "retrieval_ratio": float(retrieve.mean()),
        "accuracy_by_split": split_accuracy(done, correct),
        "accuracy_by_hops": hop_accuracy(done, correct),
        "infoseek": infoseek_figures(done, correct, chosen_answered(done, retrieve)),
        "infoseek_untyped": infoseek_untyped(done),
        "section_right": float(np.mean(section_right)) if section_right else None,
        "inspector_confusion": inspector_confusion(done),
        "without_inspector": without_inspector(done, retrieve),
        "consistency": consistency_report(done),
        "latency_s": latency,
        "baselines": with_official_scores(baselines(done, float(retrieve.mean())), done),
    }


def with_official_scores(rows: dict[str, dict], done: list[dict]) -> dict[str, dict]:
    """The baselines with InfoSeek's official scores (``infoseek``) where the data has them, as the system has its
    own: pooled accuracy is not the table's figure (the unseen-question and unseen-entity splits differ in size).
    No RAG, All RAG and the oracle gate; the random gate's is a mean over draws, left as accuracy."""
    alone_ok = np.array([bool(r["alone"]["correct"]) for r in done])
    for name, retrieve in (
        ("No RAG", np.zeros(len(done))),
        ("All RAG", np.ones(len(done))),
        ("oracle gate", ~alone_ok),
    ):
        figures = infoseek_figures(done, system_correct(done, retrieve), chosen_answered(done, retrieve))
        if figures is None:  # not InfoSeek questions
            return rows
        if name in rows:
            rows[name]["infoseek"] = figures
    return rows


def threshold_curve(records: list[dict], thresholds) -> list[dict]:
    """Accuracy and retrieval ratio of the gate at each threshold on its score (retrieve when score ≥ threshold)."""
    done = [r for r in records if "skipped" not in r and r["gate"].get("score") is not None]
    scores = np.array([r["gate"]["score"] for r in done])
    out = []
    for t in thresholds:
        retrieve = scores >= t
        out.append(
            {
                "threshold": float(t),
                "retrieval_ratio": float(retrieve.mean()) if len(done) else 0.0,
                "accuracy": float(system_correct(done, retrieve).mean()) if len(done) else 0.0,
            }
        )
    return out


def format_table(metrics: dict, system: str = "gated pipeline") -> str:
    """Markdown: the system and its baselines, accuracy and retrieval ratio in %."""
    lines = [
        "| system | accuracy | retrieval ratio |",
        "|---|---|---|",
        f"| {system} | {100 * metrics['accuracy']:.1f} | {100 * metrics['retrieval_ratio']:.1f} |",
    ]
    for name, b in metrics.get("baselines", {}).items():
        lines.append(f"| {name} | {100 * b['accuracy']:.1f} | {100 * b['retrieval_ratio']:.1f} |")
    plain = metrics.get("without_inspector")
    if plain:
        lines.append(
            f"| {system}, without the Inspector | {100 * plain['accuracy']:.1f} | "
            f"{100 * metrics['retrieval_ratio']:.1f} |"
        )
        lines.append(f"| All RAG, without the Inspector | {100 * plain['All RAG']:.1f} | 100.0 |")
        oracle = metrics.get("baselines", {}).get("oracle gate")
        if oracle:
            lines.append(
                f"| oracle gate, without the Inspector | {100 * plain['oracle gate']:.1f} | "
                f"{100 * oracle['retrieval_ratio']:.1f} |"
            )
    info = metrics.get("infoseek")
    if info:
        empty = sum(info["no_answer"].values())
        every = "every question with its image" if metrics.get("skipped") else "every question"
        n = info.get("n", {})
        lines += [
            "",
            f"| InfoSeek, official scorer (%) | unseen question ({n.get('unseen_question', '?')} questions) | "
            f"unseen entity ({n.get('unseen_entity', '?')} questions) | final |",
            "|---|---|---|---|",
            f"| {system} ({every}; without an answer, an empty prediction: {empty}) | "
            f"{info['unseen_question']:.2f} | {info['unseen_entity']:.2f} | {info['final']:.2f} |",
        ]
        for name, b in metrics.get("baselines", {}).items():
            if b.get("infoseek"):
                s = b["infoseek"]
                lines.append(f"| {name} | {s['unseen_question']:.2f} | {s['unseen_entity']:.2f} | {s['final']:.2f} |")
    untyped = metrics.get("infoseek_untyped")
    if untyped:
        lines += [
            "",
            f"InfoSeek's official scores are left out: {len(untyped)} question(s) have no InfoSeek question type or "
            f"split (first: {', '.join(untyped[:3])}), which its scorer cannot score: convert the questions with "
            "--qtype (retrieval.upstream.convert)",
        ]
    if info and 0 in info.get("n", {}).values():
        lines += [
            "",
            "A split with no question scores 0, as the official scorer's safe_division gives it, and so does final "
            "(their harmonic mean): Table 3's figures need questions of both splits",
        ]
    if metrics.get("skipped"):
        lines += ["", f"{metrics['skipped']} question(s) skipped (image missing or unusable) are in no figure above"]
    mct = metrics.get("consistency")
    if mct:
        lines += [
            "",
            f"MCT ({mct['strategy']}): {mct['mean_listed']:.2f} sections listed on average; "
            f"{100 * mct['fallback_ratio']:.1f} % fell back to the first stage's choice",
        ]
    confusion = metrics.get("inspector_confusion")
    if confusion:
        lines += [
            "",
            "| Inspector | right section | wrong section |",
            "|---|---|---|",
            f"| PASS | {confusion['pass_right']} | {confusion['pass_wrong']} |",
            f"| FAIL | {confusion['fail_right']} | {confusion['fail_wrong']} |",
            "",
            f"Inspector routing accuracy: {100 * confusion['routing_accuracy']:.1f} %",
        ]
    return "\n".join(lines)
