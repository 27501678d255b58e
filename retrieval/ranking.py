"""Ranking over unique entities — the math every index path shares, free of models and files.

A row is concat[v̂, t̂]; a query is normalize(concat[α·v̂_q, (1−α)·t̂_q]), so a row's inner product with the query ranks
by α·cos_image + (1−α)·cos_text. Many rows share one entity: an entity scores as its best row, and ranks are 1-based
over unique entities, tied entities sharing a rank. ``deepening_search`` turns FAISS's top-k rows into the top
entities; retrieval.exact ranks every row exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from retrieval.encoders import l2_normalize
from retrieval.faiss_build import set_parameter


class Hit(NamedTuple):
    entity_id: str
    entry_id: str
    score: float  # α·cos_image + (1−α)·cos_text of the entity's best row


def check_alpha(alpha: float) -> float:
    """α as a float in [0, 1]; a boolean (YAML's ``alpha: true``) is refused, as ``check_k`` refuses one."""
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not (0.0 <= float(alpha) <= 1.0):
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    return float(alpha)


def check_k(k: int, name: str = "k") -> int:
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k <= 0:
        raise ValueError(f"{name} must be a positive integer, got {k!r}")
    return int(k)


def query_vectors(image_emb: np.ndarray, text_emb: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """normalize(concat[α·v̂, (1−α)·t̂]) and the factor that turns an inner product back into α·cos_i + (1−α)·cos_t."""
    alpha = check_alpha(alpha)
    v = l2_normalize(image_emb) * alpha
    t = l2_normalize(text_emb) * (1.0 - alpha)
    q = np.concatenate([v, t], axis=1).astype(np.float32)
    norms = np.linalg.norm(q, axis=1, keepdims=True)
    return q / np.maximum(norms, 1e-12), norms[:, 0]


@dataclass
class Ranked:
    """Per query: unique entity indices in rank order, their best row and its score."""

    entities: np.ndarray
    rows: np.ndarray
    scores: np.ndarray


def ranks_of(ranked: list[Ranked], gold) -> list[int | None]:
    """Each gold entity's rank: 1 + the entities ranked with a strictly higher score (tied entities share a rank, as
    the exact ranker counts them; FAISS orders ties arbitrarily); None when it is not among ``ranked``."""
    out = []
    for rk, g in zip(ranked, gold):
        pos = np.flatnonzero(rk.entities == g)
        out.append(int(np.count_nonzero(rk.scores[: pos[0]] > rk.scores[pos[0]])) + 1 if len(pos) else None)
    return out


def deepening_search(
    index,
    q: np.ndarray,
    norms: np.ndarray,
    depth: int,
    k_max: int,
    row_entity: np.ndarray,
    num_entities: int,
    rows_per_entity: int,
    ef_search: int | None = None,
) -> tuple[list[Ranked], list[int]]:
    """FAISS top-k with k growing ×4 until each query has ``depth`` entities (or all there are), the index gives no
    more rows than it was asked for (an approximate one: all it reaches), or k reaches ``k_max`` → (ranked, the queries
    that stopped at ``k_max`` < every row, short of entities). ``row_entity``: each row's entity index (of
    ``num_entities``);
    ``rows_per_entity``: the most rows one entity has (the first k asks for ``depth`` × up to 4 of them);
    ``ef_search``: HNSW's search depth, raised to k on each search (HNSW returns at most about efSearch rows)."""
    want = min(depth, num_entities)
    out: list[Ranked | None] = [None] * len(q)
    pending, short = np.arange(len(q)), []
    k_rows = min(k_max, depth * min(rows_per_entity, 4))
    while len(pending):
        if ef_search:
            set_parameter(index, "efSearch", max(ef_search, k_rows))
        scores, rows = index.search(q[pending], k_rows)
        still = []
        for j, qi in enumerate(pending):
            valid = rows[j] >= 0
            r, s = rows[j][valid], scores[j][valid]
            ents = row_entity[r]
            _, first = np.unique(ents, return_index=True)
            first = np.sort(first)
            exhausted = len(r) < k_rows  # an approximate index gave all it reaches (IVF: within nprobe lists)
            # the last row returned ties with the depth-th entity: rows past it may tie too, and share its rank
            tie_cut = len(first) >= depth > 0 and len(r) and s[-1] == s[first[depth - 1]]
            if (len(first) < want or tie_cut) and not exhausted:
                if k_rows < k_max:
                    still.append(qi)
                    continue
                if k_max < index.ntotal and len(first) < want:
                    short.append(int(qi))
            if len(first) > depth:  # entities tied with the depth-th share its rank (as the exact ranker counts them)
                tied = s[first[depth:]] == s[first[depth - 1]]
                first = first[: depth + int(np.cumprod(tied).sum())]
            out[qi] = Ranked(ents[first], r[first], s[first] * norms[qi])
        pending = np.asarray(still, dtype=int)
        k_rows = min(k_max, k_rows * 4)
    return out, short
