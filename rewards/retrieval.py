"""The retrieval reward: rank of the gold entity for each refined query, mapped through the rank tiers.

One call receives TRL's whole generation slice on this rank (every dataset column repeated per generation). It
parses every completion, encodes all valid queries in one batch, takes the query-image embeddings from a cache keyed
by the image itself — its ``image_path`` column, else a hash of its pixels; never a question id or a position, which
can collide across splits — and ranks every query in one pass (exact entity ranks on a Flat index). Query texts are
cached too: a group of generations often repeats a query, and only unseen texts are encoded (in one batch).

Metrics go through TRL's ``log_metric`` one value per completion (hit@k, parse, …) or per hit (its rank): TRL ≥ 1.16
sums (value, count) pairs over the union of names on all ranks, so every logged figure is the exact mean over all
completions of the step on all ranks, including a rank that had no hit.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from common.files import append_jsonl
from retrieval.index import MultimodalIndex
from retrieval.ranking import check_alpha, check_k
from rewards.format import MAX_QUERY_TOKENS, completion_text, parse_query, query_tokens
from rewards.rank import DEFAULT_MISS, DEFAULT_TIERS, rank_reward, validate_tiers

HIT_KS = (1, 5, 10, 20, 200)


class RetrievalReward:
    """TRL reward function scoring refined queries by the rank of the gold entity in a multimodal index."""

    __name__ = "retrieval_reward"

    def __init__(
        self,
        index: MultimodalIndex,
        alpha: float,
        depth: int = 200,
        tiers=None,
        miss: float = DEFAULT_MISS,
        unparseable: float | None = None,
        max_query_tokens: int | None = MAX_QUERY_TOKENS,
        question_field: str = "question",
        completions_log=None,
    ):
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
        self.image_cache: dict[str, np.ndarray] = {}  # image key (path or pixel hash) → embedding
        self.text_cache: dict[str, np.ndarray] = {}
        self.text_cache_size = 200_000
        # the latest training call's per-completion details and images by image key (the monitor's tables: an
        # evaluation's completions, scored between two training steps, do not replace them)
        self.last: list[dict] = []
        self.images: dict[str, object] = {}
        self.completions_log = completions_log  # a JSONL file every scored completion is appended to, or None
        self.trainer = None  # set by follow(): its model's training flag tells evaluation calls apart
        self.totals: dict[str, dict[str, list[float]]] = {}  # mode → metric → [sum, count] since the last take

    def follow(self, trainer) -> None:
        """Tell training calls from evaluation calls by ``trainer.model.training`` (read at each call: the trainer
        may wrap or replace its model after construction)."""
        self.trainer = trainer

    def mode(self) -> str:
        return "eval" if self.trainer is not None and not self.trainer.model.training else "train"

    # ------------------------------------------------------------------ image embeddings

    def image_embeddings(self, keys: list[str], images: list) -> np.ndarray:
        """Embeddings for these images (by image key), encoding (in one batch) only those not cached."""
        missing = {}
        for key, img in zip(keys, images):
            if key not in self.image_cache and key not in missing:
                if img is None:
                    raise ValueError(f"image {key!r} is not in the cache and no image was passed to encode")
                missing[key] = img
        if missing:
            emb = self.index.encode_images(list(missing.values()))
            self.image_cache.update(zip(missing, emb))
        return np.stack([self.image_cache[k] for k in keys])

    def text_embeddings(self, texts: list[str]) -> np.ndarray:
        """Embeddings of query texts; the unseen ones are encoded in one batch and cached."""
        new = list(dict.fromkeys(t for t in texts if t not in self.text_cache))
        if new:
            if len(self.text_cache) + len(new) > self.text_cache_size:  # full: keep only this call's texts
                kept = {t: self.text_cache[t] for t in texts if t in self.text_cache}
                self.text_cache.clear()
                self.text_cache.update(kept)
            self.text_cache.update(zip(new, self.index.encode_texts(new)))
        return np.stack([self.text_cache[t] for t in texts])

    # ------------------------------------------------------------------ the reward

    def score(self, queries: list[str | None], entity_ids: list[str], keys: list[str], images: list) -> list:
        """Rank of the gold entity for each query (None for a miss or an unparseable query)."""
        valid = [i for i, q in enumerate(queries) if q is not None]
        ranks: list[int | None] = [None] * len(queries)
        if valid:
            img = self.image_embeddings([keys[i] for i in valid], [images[i] for i in valid])
            txt = self.text_embeddings([queries[i] for i in valid])
            found = self.index.entity_ranks(
                img, txt, [entity_ids[i] for i in valid], alpha=self.alpha, depth=self.depth
            )
            for i, r in zip(valid, found):
                ranks[i] = r
        return ranks

    def __call__(
        self,
        prompts=None,
        completions=None,
        entity_id=None,
        id=None,
        image=None,
        image_path=None,
        log_metric=None,
        **kwargs,
    ) -> list[float]:
        completions = completions or []
        n = len(completions)
        if entity_id is None or len(entity_id) != n:
            raise ValueError("the retrieval reward needs an 'entity_id' column with one value per completion")
        images = image if image is not None else kwargs.get("images")
        if images is not None and len(images) == n and isinstance(images[0], (list, tuple)):
            images = [x[0] if x else None for x in images]
        if image_path is None and images is None:
            raise ValueError("the retrieval reward needs an 'image' or 'image_path' column per completion")
        images = images if images is not None else [None] * n
        keys = image_keys(image_path, images)
        ids = [str(x) for x in id] if id is not None else keys
        queries = [parse_query(completion_text(c), self.max_query_tokens) for c in completions]
        ranks = self.score(queries, [str(e) for e in entity_id], keys, images)
        rewards = [
            self.unparseable if q is None else rank_reward(r, self.tiers, self.miss) for q, r in zip(queries, ranks)
        ]
        rewards = [r if math.isfinite(r) else self.miss for r in rewards]
        questions = kwargs.get(self.question_field)
        mode = self.mode()
        scored = [
            dict(
                query=q,
                rank=r,
                reward=w,
                entity_id=str(e),
                id=i,
                image_key=k,
                question=None if questions is None else questions[j],
            )
            for j, (q, r, w, e, i, k) in enumerate(zip(queries, ranks, rewards, entity_id, ids, keys))
        ]
        if mode == "train":
            self.last, self.images = scored, dict(zip(keys, images))
        if self.completions_log is not None:
            # the step as log_history numbers it: a training step's completions are scored while global_step is
            # still the one before; an evaluation runs after the step it is logged under
            state = kwargs.get("trainer_state")
            step = None if state is None else state.global_step + (mode == "train")
            append_jsonl(
                self.completions_log,
                [{"step": step, "mode": mode, **{k: v for k, v in r.items() if k != "question"}} for r in scored],
            )
        totals = self.totals.setdefault(mode, {})
        for name, values in completion_metrics(queries, ranks, questions).items():
            total = totals.setdefault(name, [0.0, 0])
            total[0] += sum(values)
            total[1] += len(values)
            for value in values if log_metric is not None else ():
                log_metric(name, value)
        return rewards

    def take_totals(self, mode: str) -> dict[str, list[float]]:
        """{metric: [sum, count]} over this process's completions in ``mode`` since the last take (then reset)."""
        return self.totals.pop(mode, {})


def image_keys(paths: list | None, images: list) -> list[str]:
    """The cache key of each completion's image: its path when the dataset has an ``image_path`` column, else a hash
    of its pixels (the same picture gives the same key wherever it comes from)."""
    if paths is not None:
        return [f"path:{p}" for p in paths]
    seen: dict[int, str] = {}  # TRL repeats a prompt's image per generation: hash each object once
    keys = []
    for img in images:
        if img is None:
            raise ValueError("a completion has neither an image nor an image_path")
        if id(img) not in seen:
            h = hashlib.blake2b(img.tobytes(), digest_size=16)
            h.update(f"{img.mode}{img.size}".encode())
            if img.palette is not None:  # a palette image's bytes are indices: its colours are in the palette
                h.update(img.palette.tobytes())
            seen[id(img)] = f"pixels:{h.hexdigest()}"
        keys.append(seen[id(img)])
    return keys


def completion_metrics(
    queries: list[str | None], ranks: list[int | None], questions: list[str] | None = None, ks=HIT_KS
) -> dict[str, list[float]]:
    """Per-completion values whose mean is each metric: hit@k and miss (1/0 per completion), the rank of each hit,
    parse (1/0), the length of each parsed query, same-as-question (1/0). A name with no value is left out."""
    hits = [r for r in ranks if r is not None]
    out = {f"retrieval/hit@{k}": [float(r is not None and r <= k) for r in ranks] for k in ks}
    out["retrieval/miss_rate"] = [float(r is None) for r in ranks]
    out["retrieval/mean_hit_rank"] = [float(r) for r in hits]
    out["retrieval/parse_rate"] = [float(q is not None) for q in queries]
    out["retrieval/query_tokens"] = [float(query_tokens(q)) for q in queries if q is not None]
    if questions is not None:
        out["retrieval/same_as_question"] = [
            float(q is not None and q.strip() == str(orig).strip()) for q, orig in zip(queries, questions)
        ]
    return {name: values for name, values in out.items() if values}


def batch_metrics(
    queries: list[str | None], ranks: list[int | None], questions: list[str] | None = None, ks=HIT_KS
) -> dict[str, float]:
    """hit@k, miss rate, mean rank of hits, parse rate, mean query length, rate of queries equal to the question:
    the means of ``completion_metrics``."""
    return {name: float(np.mean(values)) for name, values in completion_metrics(queries, ranks, questions, ks).items()}
