"""What ``retrieval.evaluate`` writes and prints: the metrics table (metrics.md and the log), metrics.csv, the
rank-change histograms of ``--compare`` (one per compared field) and the α sweep's CSV, table and plot."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import numpy as np

from common.files import atomic_path, pyplot, save_figure


def format_table(results: dict[str, dict], ks: list[int], label: str = "field") -> str:
    cols = [f"R@{k}" for k in ks] + [f"PR@{k}" for k in ks]
    cols = [c for c in cols if any(c in m for m in results.values())]
    head = f"| {label} | n | " + " | ".join(cols) + " |"
    sep = "|" + "---|" * (len(cols) + 2)
    body = [
        f"| {name} | {m['n']} | " + " | ".join(f"{m[c]:.1f}" if c in m else "—" for c in cols) + " |"
        for name, m in results.items()
    ]
    return "\n".join([head, sep, *body])


def rank_change_files(fields: list[str]) -> dict[str, str]:
    """{compared field: its rank-change histogram}: ``rank_change.png`` for one field, ``rank_change_<field>.png`` for
    several (a character a file name should not hold as ``_``); two fields with one file are refused."""
    names = {
        f: "rank_change.png" if len(fields) == 1 else f"rank_change_{re.sub(r'[^A-Za-z0-9_.+-]', '_', f)}.png"
        for f in fields
    }
    for f in fields:
        same = [g for g in fields if names[g] == names[f]]
        if len(same) > 1:
            raise ValueError(f"--compare: fields {same} would both write {names[f]}; rename one of them")
    return names


def rank_changes(before: list[int | None], after: list[int | None], depth: int) -> list[int]:
    """Per question, how many places the gold entity moved up (a miss counts as rank depth + 1)."""
    return [(depth + 1 if b is None else b) - (depth + 1 if a is None else a) for b, a in zip(before, after)]


def write_csv(path: Path, metrics: dict[str, dict]) -> None:
    keys = list(dict.fromkeys(k for m in metrics.values() for k in m))
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["field", *keys])
        w.writerows([f, *(round(m[k], 4) if k in m else "" for k in keys)] for f, m in metrics.items())


def write_rank_change(path: Path, before, after, depth: int, before_name: str, after_name: str) -> dict:
    """Histogram of per-question rank change from ``before_name`` to ``after_name``; returns its summary."""
    changes = rank_changes(before, after, depth)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(changes, bins=41, color="#3b75af")
    ax.axvline(0, color="k", lw=0.8)
    ax.set_xlabel(f"rank improvement ({before_name} rank − {after_name} rank)")
    ax.set_ylabel("questions")
    fig.tight_layout()
    save_figure(fig, path)
    n = max(len(changes), 1)
    return {
        "improved": sum(c > 0 for c in changes) / n,
        "unchanged": sum(c == 0 for c in changes) / n,
        "worse": sum(c < 0 for c in changes) / n,
        "median": float(np.median(changes)) if changes else 0.0,
    }


def write_sweep(out: Path, alphas, fields, ks, results, log) -> None:
    plt = pyplot()

    keys = [f"R@{k}" for k in ks]
    with atomic_path(out / "alpha_sweep.csv") as tmp, open(tmp, "w", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["alpha", "field", *keys])
        for a in alphas:
            for f in fields:
                w.writerow([a, f, *(f"{results[a][f]['metrics'][k]:.2f}" for k in keys)])
    lines = ["| α | field | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 2)]
    lines += [
        f"| {a:g} | {f} | " + " | ".join(f"{results[a][f]['metrics'][k]:.1f}" for k in keys) + " |"
        for a in alphas
        for f in fields
    ]
    log("\n".join(lines))
    fig, ax = plt.subplots(figsize=(6, 4))
    for f in fields:
        for k in keys:
            ax.plot(
                alphas,
                [results[a][f]["metrics"][k] for a in alphas],
                marker="o",
                ms=3,
                label=f"{k} ({f})" if len(fields) > 1 else k,
            )
    ax.set_xlabel("α (image weight)")
    ax.set_ylabel("recall (%)")
    ax.set_title("Recall@K against α")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out / "alpha_sweep.png", dpi=120)
