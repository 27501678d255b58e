"""The retrieval reward: rank of the gold entity for each refined query, mapped through the rank tiers.

One call receives TRL's whole generation slice (every dataset column repeated per generation). It parses every
completion, encodes all valid queries in one batch, takes the query-image embeddings from a cache keyed by the
question ``id`` (each image is encoded once per run), and ranks every query in one index search. Query texts are
cached too: a group of generations often repeats a query, and only unseen texts are encoded (in one batch).
"""

from __future__ import annotations

import math

import numpy as np

from retrieval.index import MultimodalIndex, check_alpha, check_k
from rewards.format import MAX_QUERY_TOKENS, completion_text, parse_query, query_tokens
from rewards.rank import DEFAULT_MISS, DEFAULT_TIERS, rank_reward, validate_tiers

HIT_KS = (1, 5, 10, 20, 200)


class RetrievalReward:
    """TRL reward function scoring refined queries by the rank of the gold entity in a multimodal index."""

    __name__ = "retrieval_reward"

    def __init__(self, index: MultimodalIndex, alpha: float, depth: int = 200, tiers=None,
                 miss: float = DEFAULT_MISS, unparseable: float | None = None,
                 max_query_tokens: int | None = MAX_QUERY_TOKENS, question_field: str = "question"):
        self.index = index
        self.alpha = check_alpha(alpha)
        self.depth = check_k(depth, "depth")
        self.miss = float(miss)
        self.tiers = validate_tiers(DEFAULT_TIERS if tiers is None else tiers, self.miss)
        self.unparseable = self.miss if unparseable is None else float(unparseable)
        if not math.isfinite(self.unparseable):
            raise ValueError(f"the unparseable-completion reward must be finite, got {unparseable}")
        self.max_query_tokens = max_query_tokens
        self.question_field = question_field
        self.image_cache: dict[str, np.ndarray] = {}
        self.text_cache: dict[str, np.ndarray] = {}
        self.text_cache_size = 200_000
        self.last: list[dict] = []  # the latest call's per-completion details (for tables)
        self.images: dict[str, object] = {}  # the latest call's images by question id (for tables)

    # ------------------------------------------------------------------ image embeddings

    def image_embeddings(self, ids: list[str], images: list) -> np.ndarray:
        """Embeddings for the images of these question ids, encoding (in one batch) only those not cached."""
        missing = {}
        for qid, img in zip(ids, images):
            if qid not in self.image_cache and qid not in missing:
                if img is None:
                    raise ValueError(f"question {qid!r} has no image to encode")
                missing[qid] = img
        if missing:
            emb = self.index.encode_images(list(missing.values()))
            self.image_cache.update(zip(missing, emb))
        return np.stack([self.image_cache[q] for q in ids])

    def text_embeddings(self, texts: list[str]) -> np.ndarray:
        """Embeddings of query texts; the unseen ones are encoded in one batch and cached."""
        new = list(dict.fromkeys(t for t in texts if t not in self.text_cache))
        if new:
            if len(self.text_cache) + len(new) > self.text_cache_size:
                self.text_cache.clear()
            self.text_cache.update(zip(new, self.index.encode_texts(new)))
        return np.stack([self.text_cache[t] for t in texts])

    # ------------------------------------------------------------------ the reward

    def score(self, queries: list[str | None], entity_ids: list[str], ids: list[str], images: list) -> list:
        """Rank of the gold entity for each query (None for a miss or an unparseable query)."""
        valid = [i for i, q in enumerate(queries) if q is not None]
        ranks: list[int | None] = [None] * len(queries)
        if valid:
            img = self.image_embeddings([ids[i] for i in valid], [images[i] for i in valid])
            txt = self.text_embeddings([queries[i] for i in valid])
            found = self.index.entity_ranks(img, txt, [entity_ids[i] for i in valid], alpha=self.alpha,
                                            depth=self.depth)
            for i, r in zip(valid, found):
                ranks[i] = r
        return ranks

    def __call__(self, prompts=None, completions=None, entity_id=None, id=None, image=None, log_metric=None,
                 **kwargs) -> list[float]:
        completions = completions or []
        n = len(completions)
        if entity_id is None or len(entity_id) != n:
            raise ValueError("the retrieval reward needs an 'entity_id' column with one value per completion")
        images = image if image is not None else kwargs.get("images")
        if images is not None and len(images) == n and isinstance(images[0], (list, tuple)):
            images = [x[0] if x else None for x in images]
        ids = [str(x) for x in (id if id is not None else range(n))]
        if id is None and images is None:
            raise ValueError("the retrieval reward needs an 'image' (or 'id' with a warm cache) per completion")
        images = images if images is not None else [None] * n
        queries = [parse_query(completion_text(c), self.max_query_tokens) for c in completions]
        ranks = self.score(queries, [str(e) for e in entity_id], ids, images)
        rewards = [self.unparseable if q is None else rank_reward(r, self.tiers, self.miss)
                   for q, r in zip(queries, ranks)]
        rewards = [r if math.isfinite(r) else self.miss for r in rewards]
        questions = kwargs.get(self.question_field)
        self.last = [dict(query=q, rank=r, reward=w, entity_id=str(e), id=i,
                          question=None if questions is None else questions[j])
                     for j, (q, r, w, e, i) in enumerate(zip(queries, ranks, rewards, entity_id, ids))]
        self.images = dict(zip(ids, images))
        if log_metric is not None:
            for name, value in batch_metrics(queries, ranks, questions).items():
                log_metric(name, value)
        return rewards


def batch_metrics(queries: list[str | None], ranks: list[int | None], questions: list[str] | None = None,
                  ks=HIT_KS) -> dict[str, float]:
    """hit@k, miss rate, mean rank of hits, parse rate, mean query length, rate of queries equal to the question."""
    n = max(len(queries), 1)
    hits = [r for r in ranks if r is not None]
    out = {f"retrieval/hit@{k}": sum(1 for r in hits if r <= k) / n for k in ks}
    out["retrieval/miss_rate"] = 1 - len(hits) / n
    if hits:
        out["retrieval/mean_hit_rank"] = float(np.mean(hits))
    parsed = [q for q in queries if q is not None]
    out["retrieval/parse_rate"] = len(parsed) / n
    if parsed:
        out["retrieval/query_tokens"] = float(np.mean([query_tokens(q) for q in parsed]))
    if questions is not None:
        same = sum(1 for q, orig in zip(queries, questions) if q is not None and q.strip() == str(orig).strip())
        out["retrieval/same_as_question"] = same / n
    return out
