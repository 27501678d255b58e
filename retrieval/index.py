"""The multimodal FAISS index: rows are concat[v̂, t̂]; a query is normalize(concat[α·v̂_q, (1−α)·t̂_q]).

So a row's inner product with the query ranks by α·cos_image + (1−α)·cos_text, and α is chosen at query time.
Ranks are over unique entities (many rows share one entity), 1-based; ``None`` means deeper than ``depth``.

Index directory:
    index.faiss     FAISS index (inner product)
    rows.parquet    row → entry_id, entity_id, title
    manifest.json   encoder names, dims, row count, KB fingerprint, factory, library versions
    skipped.jsonl   KB rows left out of the build, with the reason
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from common.files import file_fingerprint, read_json
from common.placement import (
    configure_threads,
    dtype_name,
    index_to_device,
    log,
    outside_zero3_init,
    resolve_device,
)
from retrieval.encoders import ImageEncoder, TextEncoder, image_encoder, l2_normalize, resolve_query_prompt
from retrieval.exact import ExactRanker, StoredRows, flat_storage
from retrieval.faiss_build import read_faiss, set_parameter
from retrieval.image_data import encode_image_files
from retrieval.ranking import Hit, Ranked, check_alpha, check_k, deepening_search, query_vectors, ranks_of

INDEX_FILE = "index.faiss"
ROWS_FILE = "rows.parquet"
MANIFEST_FILE = "manifest.json"
SKIPPED_FILE = "skipped.jsonl"
FAISS_GPU_MAX_K = 2048  # FAISS on a GPU refuses k above this
RANK_METHODS = ("auto", "exact", "search")


class MultimodalIndex:
    def __init__(
        self,
        faiss_index,
        entry_ids: list[str],
        entity_ids: list[str],
        manifest: dict,
        image_encoder=None,
        text_encoder=None,
        device: str | None = None,
        path: Path | None = None,
        titles: list[str] | None = None,
        rank_method: str = "auto",
        search_device: str = "cpu",
    ):
        if rank_method not in RANK_METHODS:
            raise ValueError(f"rank_method must be one of {', '.join(RANK_METHODS)}, got {rank_method!r}")
        self.faiss = faiss_index
        self.search_device = search_device  # where self.faiss lives: "cpu" or "cuda:N"
        self.rank_method = rank_method
        self._exact = None
        self.entry_ids = entry_ids
        self.entity_names, self.row_entity = np.unique(np.asarray(entity_ids, dtype=object), return_inverse=True)
        self.entity_titles = dict(zip(entity_ids, titles)) if titles is not None else {}
        self.entity_index = {e: i for i, e in enumerate(self.entity_names)}
        self.manifest = manifest
        self.path = path
        self.device = resolve_device(device)
        self.image_dim = int(manifest["image_dim"])
        self.text_dim = int(manifest["text_dim"])
        self._image_encoder = image_encoder
        self._text_encoder = text_encoder
        self.max_rows_per_entity = int(np.bincount(self.row_entity).max()) if len(self.row_entity) else 1
        self.ef_search = None  # HNSW's search depth, when the index has one (load)

    # ---------------------------------------------------------------- loading

    @classmethod
    def load(
        cls,
        path,
        image_encoder=None,
        text_encoder=None,
        device: str | None = None,
        query_instruction: str | None = None,
        nprobe: int = 32,
        ef_search: int = 256,
        rank_method: str = "auto",
        search_device: str | None = None,
        threads: int | None = None,
    ) -> MultimodalIndex:
        """Load an index directory for this process (the policy of common.placement, logged in one line).

        ``device``: where this process's replica and encoders live ("cpu", "cuda:N"; None → ``cuda:LOCAL_RANK``
        when CUDA is available, else cpu). ``search_device``: where the FAISS index for top-k search lives (default:
        ``device``; the trainer keeps it on the CPU, memory-mapped, since its reward ranks on the exact replica).
        ``nprobe`` (IVF) and ``ef_search`` (HNSW, raised to the rows each search asks for) set how far an
        approximate index searches. ``rank_method``: "exact" (Flat indexes: matmul + segment max over all rows),
        "search" (FAISS top-k with a growing depth), "auto" (exact on a GPU, search on a CPU where FAISS Flat is
        faster for the same ranks within depth — benchmarks/reward_scale.py).
        Encoders default to the manifest's and are built on first use, with the manifest's text length, image
        processor and query instruction (so the reward, evaluation and the pipeline encode a query alike); a name
        different from the manifest's is an error that states both. ``query_instruction`` overrides the manifest's
        (``none``: no instruction; ``auto``: the manifest's, i.e. the model's own prompt as the build resolved it).
        """
        import pyarrow.parquet as pq

        from common.faiss_lib import faiss

        path = Path(path)
        manifest_path = path / MANIFEST_FILE
        if not manifest_path.exists():
            raise FileNotFoundError(f"{path} is not a finished index directory: {manifest_path} is missing")
        manifest = read_json(manifest_path)
        for side, given in (("image", image_encoder), ("text", text_encoder)):
            name = getattr(given, "name", given)
            if name is not None and name != manifest[f"{side}_encoder"]:
                raise ValueError(
                    f"index {path} was built with {side} encoder {manifest[f'{side}_encoder']!r}, "
                    f"but {name!r} was requested"
                )
        # "auto" is the model's own prompt, which the build resolved into the manifest
        instruction = (
            manifest.get("query_instruction")
            if query_instruction in (None, "auto")
            else resolve_query_prompt(query_instruction, {})
        )
        if text_encoder is not None and not isinstance(text_encoder, str):
            for what, theirs, ours in (
                ("query instruction", text_encoder.query_prompt, instruction),
                (
                    "max_seq_length",
                    text_encoder.max_seq_length,
                    manifest.get("text_max_seq_length", text_encoder.max_seq_length),
                ),
            ):
                if theirs != ours:
                    raise ValueError(
                        f"index {path} encodes queries with {what} {ours!r}, but the text encoder given has {theirs!r}"
                    )
        index = read_faiss(path / INDEX_FILE)
        ivf = faiss.try_extract_index_ivf(index) if hasattr(faiss, "try_extract_index_ivf") else None
        if ivf is not None:
            ivf.nprobe = min(nprobe, ivf.nlist)
        device = resolve_device(device)
        threads = configure_threads(threads)
        cpu_index = index
        index, search_device = index_to_device(index, resolve_device(search_device or device))
        rows = pq.read_table(path / ROWS_FILE).to_pydict()
        if len(rows["entry_id"]) != index.ntotal:
            raise ValueError(
                f"{path}: {ROWS_FILE} has {len(rows['entry_id'])} rows but the FAISS index has "
                f"{index.ntotal}; rebuild the index"
            )
        self = cls(
            index,
            rows["entry_id"],
            rows["entity_id"],
            manifest,
            image_encoder=image_encoder if not isinstance(image_encoder, str) else None,
            text_encoder=text_encoder if not isinstance(text_encoder, str) else None,
            device=device,
            path=path,
            titles=rows.get("title"),
            rank_method=rank_method,
            search_device=search_device,
        )
        self.query_instruction = instruction
        self._faiss_cpu = cpu_index
        self.ef_search = ef_search if set_parameter(index, "efSearch", ef_search) else None  # HNSW
        log.info(
            "index %s: %d rows × %d dims, %d entities; FAISS %s on %s (%s), exact ranks: %s on %s; "
            "%d FAISS/torch threads",
            path,
            len(self),
            index.d,
            self.num_entities,
            type(index).__name__,
            search_device,
            "memory-mapped" if search_device == "cpu" else "fp16 replica",
            "yes" if self.uses_exact_ranks else "no (approximate index: search with a growing depth)",
            device,
            threads,
        )
        return self

    @property
    def image_encoder(self) -> ImageEncoder:
        if self._image_encoder is None:
            with outside_zero3_init():
                self._image_encoder = image_encoder(
                    self.manifest["image_encoder"],
                    device=self.device,
                    image_processor=self.manifest.get("image_processor"),
                    trust_remote_code=self.manifest.get("trust_remote_code", False),
                )
        return self._image_encoder

    @property
    def text_encoder(self) -> TextEncoder:
        if self._text_encoder is None:
            with outside_zero3_init():
                self._text_encoder = TextEncoder(
                    self.manifest["text_encoder"],
                    device=self.device,
                    query_prompt=getattr(self, "query_instruction", None),
                    trust_remote_code=self.manifest.get("trust_remote_code", False),
                    max_seq_length=self.manifest.get("text_max_seq_length"),
                )
        return self._text_encoder

    def __len__(self) -> int:
        return self.faiss.ntotal

    @property
    def num_entities(self) -> int:
        return len(self.entity_names)

    def has_entity(self, entity_id: str) -> bool:
        return entity_id in self.entity_index

    @property
    def uses_exact_ranks(self) -> bool:
        if self.rank_method == "search":
            return False
        exact_possible = flat_storage(self._cpu_faiss()) is not None
        if self.rank_method == "auto" and self.device == "cpu":
            # same ranks within depth; FAISS Flat is faster on a CPU (benchmarks/reward_scale.py: 2.5 s vs 3.1 s per
            # 160-query step at 1 M × 2,048 rows on 2 cores), the exact ranker on a GPU (no k cap there)
            return False
        if self.rank_method == "exact" and not exact_possible:
            raise ValueError(
                f"rank_method 'exact' needs a Flat / SQfp16 / SQbf16 index; {self.path} is "
                f"{self.manifest.get('factory', type(self.faiss).__name__)}"
            )
        return exact_possible

    def _cpu_faiss(self):
        """The index as loaded on the CPU (memory-mapped when possible), wherever the search copy lives; an index
        given on a GPU is copied back once and kept (the exact ranker's CPU view shares its memory)."""
        cpu = getattr(self, "_faiss_cpu", None)
        if cpu is not None:
            return cpu
        if self.search_device == "cpu":
            return self.faiss
        from common.faiss_lib import faiss

        self._faiss_cpu = faiss.index_gpu_to_cpu(self.faiss)
        return self._faiss_cpu

    @property
    def exact(self):
        """The exact ranker's replica of the rows on this process's device (built on first use)."""
        if self._exact is None:
            self._exact = ExactRanker.from_faiss(self._cpu_faiss(), self.row_entity, self.num_entities, self.device)
            log.info(
                "exact ranks: %d rows replicated on %s (%s, %.2f GB)",
                len(self),
                self.device,
                dtype_name(self._exact.rows.dtype),
                self._exact.nbytes / 1e9,
            )
        return self._exact

    # ---------------------------------------------------------------- encoding

    def encode_images(self, images) -> np.ndarray:
        return self.image_encoder.encode(list(images))

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        """Query texts (with the index's query instruction, if any)."""
        return self.text_encoder.encode(list(texts), is_query=True)

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        """KB-side texts (sections), encoded as the build encoded its rows: never with the query instruction."""
        return self.text_encoder.encode(list(texts), is_query=False)

    def encode_image_files(self, paths: Sequence, workers: int = 0, log=None) -> tuple[np.ndarray, dict[int, str]]:
        """Embeddings of image files with this index's image encoder (retrieval.image_data.encode_image_files):
        (embeddings of the decodable ones in order, {position: why not})."""
        return encode_image_files(self.image_encoder, paths, workers, self.device, log)

    def _as_image_emb(self, images) -> np.ndarray:
        if isinstance(images, np.ndarray):
            if images.ndim != 2 or images.shape[1] != self.image_dim:
                raise ValueError(f"image embeddings must have shape (n, {self.image_dim}), got {images.shape}")
            return l2_normalize(images)
        return self.encode_images(images)

    def _as_text_emb(self, texts) -> np.ndarray:
        if isinstance(texts, np.ndarray):
            if texts.ndim != 2 or texts.shape[1] != self.text_dim:
                raise ValueError(f"text embeddings must have shape (n, {self.text_dim}), got {texts.shape}")
            return l2_normalize(texts)
        return self.encode_texts(texts)

    # ---------------------------------------------------------------- ranking

    def rank(self, image_emb: np.ndarray, text_emb: np.ndarray, alpha: float, depth: int) -> list[Ranked]:
        """Top ``depth`` unique entities per query, searching more rows until each query has enough. FAISS on a GPU
        stops at k = 2048 rows: a query that needs more is searched again on the CPU copy, which has no cap."""
        depth = check_k(depth, "depth")
        if len(image_emb) != len(text_emb):
            raise ValueError(f"got {len(image_emb)} images but {len(text_emb)} texts")
        q, norms = query_vectors(image_emb, text_emb, alpha)
        n_total = self.faiss.ntotal
        k_max = n_total if self.search_device == "cpu" else min(n_total, FAISS_GPU_MAX_K)
        entities = (self.row_entity, self.num_entities, self.max_rows_per_entity, self.ef_search)
        out, short = deepening_search(self.faiss, q, norms, depth, k_max, *entities)
        if short:
            again, _ = deepening_search(self._cpu_faiss(), q[short], norms[short], depth, n_total, *entities)
            for qi, ranked in zip(short, again):
                out[qi] = ranked
        return out

    def search(self, images, texts, alpha: float, k: int) -> list[list[Hit]]:
        """Top-k entities per query (their best row), by α·cos_image + (1−α)·cos_text, descending.

        ``images``: PIL images or an (n, image_dim) array of precomputed embeddings; ``texts``: strings or embeddings.
        """
        alpha, k = check_alpha(alpha), check_k(k)
        return [self._hits(rk, k) for rk in self.rank(self._as_image_emb(images), self._as_text_emb(texts), alpha, k)]

    def search_and_rank(
        self, images, texts, entity_ids: Sequence[str], alpha: float, k: int, depth: int = 200
    ) -> tuple[list[list[Hit]], list[int | None]]:
        """``search(…, k)`` and ``entity_ranks(…, depth)`` from one ranking pass (at depth max(k, depth))."""
        alpha, k, depth = check_alpha(alpha), check_k(k), check_k(depth, "depth")
        image_emb, text_emb = self._as_image_emb(images), self._as_text_emb(texts)
        gold = self._gold(entity_ids, len(image_emb))
        ranked = self.rank(image_emb, text_emb, alpha, max(k, depth))
        ranks = ranks_of(ranked, gold)
        return [self._hits(rk, k) for rk in ranked], [r if r is not None and r <= depth else None for r in ranks]

    def top_entities(self, images, texts, alpha: float, k: int) -> list[list[str]]:
        """The ``k`` best entity ids per query. Where the reward ranks exactly (a GPU), from the exact ranker's
        per-entity scores on this device — no scan of the memory-mapped FAISS index on the CPU; elsewhere FAISS's
        top-k (``search``)."""
        alpha, k = check_alpha(alpha), check_k(k)
        if not self.uses_exact_ranks:
            return [[h.entity_id for h in hits] for hits in self.search(images, texts, alpha, k)]
        import torch

        q, _ = query_vectors(self._as_image_emb(images), self._as_text_emb(texts), alpha)
        scores = self.exact.entity_scores(torch.as_tensor(q, device=self.exact.device))
        top = scores.topk(min(k, self.num_entities), dim=1).indices.cpu().numpy()
        return [[str(self.entity_names[e]) for e in row] for row in top]

    def _gold(self, entity_ids: Sequence[str], queries: int) -> list[int]:
        """Each query's gold entity index (−1 for an entity with no row); a count other than the queries' is an error
        (``zip`` would rank the shorter of the two)."""
        if len(entity_ids) != queries:
            raise ValueError(f"got {queries} queries but {len(entity_ids)} gold entity ids")
        return [self.entity_index.get(e, -1) for e in entity_ids]

    def _hits(self, ranked: Ranked, k: int) -> list[Hit]:
        return [
            Hit(str(self.entity_names[e]), self.entry_ids[r], float(s))
            for e, r, s in zip(ranked.entities[:k], ranked.rows[:k], ranked.scores[:k])
        ]

    @property
    def is_approximate(self) -> bool:
        """True for an index whose search is approximate (HNSW, IVF, …), False for Flat / SQfp16 / SQbf16."""
        return flat_storage(self._cpu_faiss()) is None

    def reference_ranks(
        self, image_emb: np.ndarray, text_emb: np.ndarray, entity_ids: Sequence[str], alpha: float
    ) -> list[int | None]:
        """Exact gold-entity ranks over every stored vector (a Flat search over the same rows), for checking an
        approximate index; rows are decoded chunk by chunk on the CPU."""
        q, _ = query_vectors(image_emb, text_emb, check_alpha(alpha))
        ranker = ExactRanker(StoredRows(self._cpu_faiss()), self.row_entity, self.num_entities)
        return ranker.ranks(q, self._gold(entity_ids, len(q)))

    def entity_ranks(
        self, images, texts, entity_ids: Sequence[str], alpha: float, depth: int = 200
    ) -> list[int | None]:
        """1-based rank of each gold entity among unique entities; ``None`` when deeper than ``depth``."""
        alpha, depth = check_alpha(alpha), check_k(depth, "depth")
        image_emb, text_emb = self._as_image_emb(images), self._as_text_emb(texts)
        gold = self._gold(entity_ids, len(image_emb))
        if self.uses_exact_ranks:
            q, _ = query_vectors(image_emb, text_emb, alpha)
            return [r if r is not None and r <= depth else None for r in self.exact.ranks(q, gold)]
        return ranks_of(self.rank(image_emb, text_emb, alpha, depth), gold)


def require_index(value, flag: str = "index") -> dict:
    """The manifest of a finished index directory, else a ValueError naming the flag."""
    manifest = Path(value or "") / MANIFEST_FILE
    if not value or not manifest.is_file():
        raise ValueError(f"--{flag}: {value!r} is not a finished index directory (no {MANIFEST_FILE})")
    return read_json(manifest)


def index_fingerprint(value) -> dict:
    """What a resumable job over an index folder records of it, cheap to take: its manifest's content and its FAISS
    file's size (an index built again at the same path, of another KB or other encoders, changes them)."""
    folder = Path(value)
    files = [folder / name for name in (MANIFEST_FILE, INDEX_FILE) if (folder / name).is_file()]
    return {f.name: file_fingerprint(f) if f.suffix == ".json" else f.stat().st_size for f in files}
