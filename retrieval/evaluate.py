"""Retrieval evaluation: Recall@K over unique entities and pseudo-recall@K.

    python -m retrieval.evaluate --index DIR --queries q.jsonl --alpha A [--images_root DIR] [--k 1,5,10,20]
        [--text_field question] [--compare FIELD] [--alpha_sweep 0:1:0.05] [--out DIR]

Query images are decoded by DataLoader workers and encoded in batches (never all in memory at once). For an
approximate index (HNSW, IVF) every table also shows R@K of an exact search over the same stored vectors ("Flat
reference") and how often both give the gold entity the same rank.

Recall@K: the gold entity is among the top K unique entities (K at most ``--depth``). Pseudo-recall@K: an answer
appears, as whole words after normalisation (``&&`` parts all present; retrieval.answers), in the text of the best
section of one of the top K entities. ``--compare FIELD`` evaluates more text fields on the same images side by side,
with a histogram of how far the gold entity moved per question (``rank_change*.png``; ``rank_change`` in
metrics.json): from the original ``question`` to the other field when one of the two is ``question``, else from
``--text_field`` to the compared field. ``--alpha_sweep lo:hi:step`` evaluates many α from one set of embeddings and
writes a CSV and a plot of R@K against α. A run removes what an earlier run left in ``--out`` (the other mode's files,
other fields' histograms) once its own files are written. A question row without ``id`` or ``entity_id`` is an error
naming its line, before the index loads; a question without answers counts as a PR@K miss, and their number is
logged (``without_answers`` in metrics.json; no PR@K when none has answers). Question rows whose image is missing
or unreadable, whose text field is empty, or that are 2-hop are reported and excluded, with the counts shown. A
question whose gold entity has no row in the index (its article had no usable image, …) stays in and counts as a
miss, as in the reference evaluation; the count is logged and written as ``gold_not_in_index``.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.cli import parse, require_file
from common.files import atomic_path, read_jsonl, write_json_atomic, write_text_atomic
from common.placement import decode_workers
from retrieval.answers import answer_in_passage
from retrieval.eval_report import format_table, rank_change_files, write_csv, write_rank_change, write_sweep
from retrieval.index import MultimodalIndex, require_index
from retrieval.ranking import check_alpha, check_k, ranks_of


@dataclass
class EvalArgs:
    index: str = field(default=None, metadata={"help": "index directory"})
    queries: str = field(default=None, metadata={"help": "question JSONL"})
    alpha: float = field(default=None, metadata={"help": "image weight α in [0, 1]"})
    images_root: str = field(
        default=None, metadata={"help": "folder image paths resolve against (default: the queries file's folder)"}
    )
    k: str = field(default="1,5,10,20", metadata={"help": "comma-separated K values"})
    text_field: str = field(default="question", metadata={"help": "record field used as the text query"})
    compare: str = field(
        default=None,
        metadata={
            "help": "more text fields (comma-separated) to evaluate side by "
            "side, each a row: refined_query,query_caption,…"
        },
    )
    alpha_sweep: str = field(default=None, metadata={"help": "lo:hi:step, e.g. 0:1:0.05"})
    depth: int = field(default=200, metadata={"help": "rank depth (ranks beyond it count as misses)"})
    kb: str = field(
        default=None, metadata={"help": "KB JSONL for pseudo-recall (default: the one the index was built from)"}
    )
    out: str = field(default=None, metadata={"help": "output folder (default: outputs/eval/<queries name>)"})
    device: str = field(default=None, metadata={"help": "cuda / cuda:N / cpu (default: this process's own)"})
    workers: int = field(
        default=None,
        metadata={
            "help": "DataLoader processes decoding query images (default: usable cores ÷ processes on this node; 0: in "
            "the main process)"
        },
    )


# --------------------------------------------------------------------------- pure metric functions


def parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--k must be comma-separated positive integers, got {text!r}") from None
    if not ks:
        raise ValueError("--k: no K values given")
    for k in ks:
        check_k(k, "--k: each K")
    return ks


def parse_sweep(text: str) -> list[float]:
    try:
        lo, hi, step = (float(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--alpha_sweep must look like lo:hi:step (e.g. 0:1:0.05), got {text!r}") from None
    if step <= 0 or lo > hi:
        raise ValueError(f"--alpha_sweep {text!r}: need lo ≤ hi and step > 0")
    alphas = [round(lo + i * step, 10) for i in range(int(np.floor((hi - lo) / step + 1e-9)) + 1)]  # never past hi
    for a in alphas:
        check_alpha(a)
    return alphas


def compare_fields(text: str | None, text_field: str) -> list[str]:
    """``--compare a,b,c`` → [a, b, c]: distinct, none equal to ``--text_field``."""
    fields = [f.strip() for f in str(text or "").split(",") if f.strip()]
    for f in fields:
        if f == text_field or fields.count(f) > 1:
            raise ValueError(f"--compare: field {f!r} is given twice (or is --text_field)")
    rank_change_files(fields)  # refused now, before the index loads, if two would write one histogram
    return fields


def recall_at(ranks: list[int | None], ks: list[int]) -> dict[str, float]:
    n = max(len(ranks), 1)
    return {f"R@{k}": 100.0 * sum(1 for r in ranks if r is not None and r <= k) / n for k in ks}


def pseudo_recall_at(hit_texts: list[list[str]], answers: list[list[str]], ks: list[int]) -> dict[str, float]:
    """hit_texts[i] = section texts of query i's ranked entities (best row each)."""
    n = max(len(hit_texts), 1)
    out = {}
    for k in ks:
        out[f"PR@{k}"] = (
            100.0
            * sum(1 for texts, ans in zip(hit_texts, answers) if any(answer_in_passage(ans, t) for t in texts[:k]))
            / n
        )
    return out


# --------------------------------------------------------------------------- data


REQUIRED = ("id", "entity_id")  # ranks.jsonl is keyed by id; R@K ranks the gold entity


def load_questions(path: Path, fields: list[str], images_root: Path):
    """Keep the rows we can evaluate; return (rows, excluded): excluded = {reason: count}. A row without an ``id`` or
    a gold ``entity_id`` is an error naming its line. A row whose gold entity has no index row stays in: such an
    entity is never retrieved, so it counts as a miss in every R@K, as in the reference evaluation (EchoSight's
    ``eval_recall`` over every question), rather than being left out of the denominator."""
    rows, excluded = [], {}

    def drop(reason):
        excluded[reason] = excluded.get(reason, 0) + 1

    for rec in read_jsonl(path, REQUIRED, "retrieval.evaluate needs each question's id and gold entity"):
        image = rec.get("image")  # a number or a list is no path: missing, as "" (the root) is
        if not isinstance(image, str) or not (images_root / image).is_file():
            drop("image missing")
        elif isinstance(rec.get("entity_id"), list):
            drop("2-hop question (one gold entity per hop; Recall@K ranks one)")
        elif any(not isinstance(rec.get(f), str) or not rec[f].strip() for f in fields):
            drop(f"empty or missing text field ({', '.join(fields)})")
        else:
            rows.append(rec)
    return rows, excluded


def load_entry_texts(kb_path: Path, entry_ids: set[str]) -> dict[str, str]:
    return {str(r["entry_id"]): str(r.get("text", "")) for r in read_jsonl(kb_path) if str(r["entry_id"]) in entry_ids}


# --------------------------------------------------------------------------- evaluation


def evaluate_ranked(
    index: MultimodalIndex,
    ranked: list,
    rows: list[dict],
    ks: list[int],
    depth: int,
    entry_texts: dict[str, str] | None,
) -> dict:
    """Metrics of one ranking (``index.rank`` output) of ``rows``."""
    ranks = ranks_of(ranked, [index.entity_index.get(str(r["entity_id"]), -1) for r in rows])
    ranks = [r if r is not None and r <= depth else None for r in ranks]
    metrics = recall_at(ranks, ks)
    if entry_texts is not None:
        hit_texts = [[entry_texts.get(index.entry_ids[row], "") for row in rk.rows[: max(ks)]] for rk in ranked]
        metrics.update(pseudo_recall_at(hit_texts, [r.get("answers") or [] for r in rows], ks))
    metrics["n"] = len(rows)
    return {"metrics": metrics, "ranks": ranks}


ORIGINAL = "question"  # the field a rank change is measured from when it is one of the two
OUTPUT_FILES = ("metrics.md", "metrics.csv", "metrics.json", "ranks.jsonl", "alpha_sweep.csv", "alpha_sweep.png")


def run(args: EvalArgs, log=print) -> dict:
    # ---- validate everything before any model loads
    require_index(args.index)
    require_file(args.queries, "queries")
    ks = parse_ks(args.k)
    check_k(args.depth, "depth")
    if max(ks) > args.depth:  # ranks past the depth are misses: R@K would be R@depth under K's name
        raise ValueError(f"--k {max(ks)} is deeper than --depth {args.depth}: give --depth {max(ks)} or a smaller K")
    if args.alpha_sweep:
        alphas = parse_sweep(args.alpha_sweep)
    elif args.alpha is None:
        raise ValueError("--alpha is required (or give --alpha_sweep)")
    else:
        alphas = [check_alpha(args.alpha)]
    compared = compare_fields(args.compare, args.text_field)
    fields = [args.text_field, *compared]
    queries = Path(args.queries)
    images_root = Path(args.images_root or queries.parent)
    if not images_root.is_dir():
        raise ValueError(f"--images_root: folder {images_root} does not exist")
    out = Path(args.out or Path("outputs/eval") / queries.stem)
    rows, excluded = load_questions(queries, fields, images_root)
    for reason, count in excluded.items():
        log(f"excluded {count} question(s): {reason}")
    if not rows:
        raise ValueError(f"no question in {queries} can be evaluated ({excluded})")

    index = MultimodalIndex.load(args.index, device=args.device)
    kb_path = Path(args.kb or index.manifest.get("kb_path", ""))
    workers = decode_workers(args.workers)
    image_emb, unreadable = index.encode_image_files([images_root / r["image"] for r in rows], workers, log=log)
    if unreadable:
        for i in sorted(unreadable)[:5]:
            log(f"excluded: {unreadable[i]}")
        excluded["image unreadable"] = len(unreadable)
        rows = [r for i, r in enumerate(rows) if i not in unreadable]
        if not rows:
            raise ValueError(f"no question in {queries} has a readable image ({excluded})")
    absent = sum(not index.has_entity(str(r.get("entity_id"))) for r in rows)  # of the questions still in
    if absent:
        log(f"{absent} of {len(rows)} question(s) have a gold entity with no row in the index: counted as misses")
    text_embs = {f: index.encode_texts([r[f] for r in rows]) for f in fields}
    ranked = {a: {f: index.rank(image_emb, text_embs[f], a, args.depth) for f in fields} for a in alphas}
    entry_texts = None
    unanswered = sum(not r.get("answers") for r in rows)
    if unanswered == len(rows):
        log(f"pseudo-recall skipped: no question in {queries} has answers")
    elif kb_path.is_file():  # pseudo-recall reads the sections ranked in the top max(K)
        if unanswered:
            log(
                f"pseudo-recall: {unanswered} of {len(rows)} question(s) have no answers: each counts as a miss in PR@K"
            )
        needed = {
            index.entry_ids[r] for per in ranked.values() for rk in per.values() for x in rk for r in x.rows[: max(ks)]
        }
        entry_texts = load_entry_texts(kb_path, needed)
    else:
        log(f"pseudo-recall skipped: KB file {kb_path} not found (pass --kb)")
    results = {
        a: {f: evaluate_ranked(index, ranked[a][f], rows, ks, args.depth, entry_texts) for f in fields} for a in alphas
    }
    if index.is_approximate:  # the same vectors searched exactly: what the approximate structure costs
        gold = [str(r["entity_id"]) for r in rows]
        for a in alphas:
            for f in fields:
                exact = [
                    r if r is not None and r <= args.depth else None
                    for r in index.reference_ranks(image_emb, text_embs[f], gold, a)
                ]
                results[a][f"{f} (Flat reference)"] = {
                    "metrics": {**recall_at(exact, ks), "n": len(rows)},
                    "ranks": exact,
                }
                same = sum(x == y for x, y in zip(exact, results[a][f]["ranks"])) / len(rows)
                results[a][f]["metrics"]["same_rank_as_flat"] = 100.0 * same
                log(
                    f"α = {a}, {f}: {index.manifest.get('factory')} gives the gold entity the same rank as an "
                    f"exact search over the same vectors for {100 * same:.1f}% of questions"
                )
    summary = {
        "index": str(args.index),
        "queries": str(queries),
        "excluded": excluded,
        "gold_not_in_index": absent,
        "without_answers": unanswered,
        "ks": ks,
        "results": {str(a): {f: r["metrics"] for f, r in per.items()} for a, per in results.items()},
    }
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".evaluate-", dir=out) as staging:  # out is left as it was on a failure
        new = Path(staging)
        if len(alphas) == 1:
            table = format_table({f: r["metrics"] for f, r in results[alphas[0]].items()}, ks)
            log(f"α = {alphas[0]}\n{table}")
            write_text_atomic(new / "metrics.md", f"α = {alphas[0]}\n\n{table}\n")
            per_question = [
                {"id": row["id"], **{f"rank_{f}": results[alphas[0]][f]["ranks"][i] for f in fields}}
                for i, row in enumerate(rows)
            ]
            with atomic_path(new / "ranks.jsonl") as tmp, open(tmp, "w", encoding="utf-8") as fh:
                fh.writelines(json.dumps(p) + "\n" for p in per_question)
            write_csv(new / "metrics.csv", {f: r["metrics"] for f, r in results[alphas[0]].items()})
            per = results[alphas[0]]
            for f, name in rank_change_files(compared).items():  # one histogram per compared field
                before, after = (f, args.text_field) if f == ORIGINAL else (args.text_field, f)
                summary.setdefault("rank_change", {})[f] = write_rank_change(
                    new / name, per[before]["ranks"], per[after]["ranks"], args.depth, before, after
                )
        else:
            write_sweep(new, alphas, list(results[alphas[0]]), ks, results, log)
        write_json_atomic(new / "metrics.json", summary)
        replace_outputs(new, out)
    log(f"wrote {out}/metrics.json")
    return summary


def replace_outputs(new: Path, out: Path) -> None:
    """This run's files (in ``new``) moved into ``out``; then what an earlier run left there and this one did not
    write (another mode's files, other fields' histograms) is removed."""
    written = {p.name for p in new.iterdir()}
    for name in sorted(written - {"metrics.json"}) + ["metrics.json"]:  # the summary last
        os.replace(new / name, out / name)
    for stale in [out / name for name in OUTPUT_FILES] + list(out.glob("rank_change*.png")):
        if stale.name not in written:
            stale.unlink(missing_ok=True)


def main(argv=None) -> None:
    (args,) = parse((EvalArgs,), argv, description=__doc__)
    run(args)


if __name__ == "__main__":
    from common.cli import run as run_cli

    run_cli(main)
