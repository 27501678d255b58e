"""Exact gold-entity ranks over every row of a Flat index, in plain torch (the same code on CPU and GPU).

For a block of queries Q: scores S = Q·Rᵀ over all rows R (in row chunks, float32 arithmetic), the best row per
entity by a segment maximum (``scatter_reduce`` amax over the row → entity map), and

    rank(gold) = 1 + number of entities whose best row scores strictly above the gold entity's best row.

No top-k, no depth loop, no FAISS k cap (FAISS on a GPU refuses k > 2048). Ties go to the gold entity, the
optimistic end of today's rank bounds. Rows come from the FAISS index itself: on the CPU a zero-copy view of the
(memory-mapped) codes, on a GPU one fp16 (or bf16) replica on this process's device.
"""

from __future__ import annotations

import numpy as np
import torch

# FAISS index classes whose codes are the rows themselves (fp32, fp16 or bf16), by storage dtype
STORAGE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def flat_storage(index) -> str | None:
    """``fp32`` / ``fp16`` / ``bf16`` when ``index`` stores its rows uncompressed (Flat, SQfp16, SQbf16), else None."""
    from common.faiss_lib import faiss

    typed = faiss.downcast_index(index)  # a view of ``index``, which owns it: ``index`` stays referenced here
    if isinstance(typed, faiss.IndexFlat):
        return "fp32"
    if isinstance(typed, faiss.IndexScalarQuantizer):
        qtypes = {faiss.ScalarQuantizer.QT_fp16: "fp16"}
        if hasattr(faiss.ScalarQuantizer, "QT_bf16"):
            qtypes[faiss.ScalarQuantizer.QT_bf16] = "bf16"
        return qtypes.get(typed.sq.qtype)
    return None


def rows_view(index) -> torch.Tensor:
    """The rows of a Flat / SQfp16 / SQbf16 FAISS index as an (n, d) CPU tensor sharing the index's memory (so a
    memory-mapped index stays shared through the page cache). Keep ``index`` alive while the view is used."""
    from common.faiss_lib import faiss

    storage = flat_storage(index)
    if storage is None:
        raise ValueError(
            f"exact ranks need a Flat, SQfp16 or SQbf16 index, not {type(faiss.downcast_index(index)).__name__}"
        )
    typed = faiss.downcast_index(index)  # as in flat_storage: ``index`` owns it
    n, d = typed.ntotal, typed.d
    if n == 0:
        return torch.zeros((0, d), dtype=STORAGE[storage])
    if storage == "fp32":
        flat = faiss.rev_swig_ptr(typed.get_xb(), n * d)
        return torch.from_numpy(flat).view(n, d)
    raw = faiss.rev_swig_ptr(typed.codes.data(), n * typed.code_size)  # uint8
    return torch.from_numpy(raw.view(np.int16)).view(STORAGE[storage]).view(n, d)


class StoredRows:
    """The rows of any FAISS index as stored (an HNSW or IVF index's vectors, decoded), chunk by chunk, never all at
    once: what ``ExactRanker`` needs of its ``rows``, so approximate search can be checked against an exact search
    over the same vectors (retrieval.evaluate)."""

    def __init__(self, index):
        from common.faiss_lib import faiss

        ivf = faiss.try_extract_index_ivf(index) if hasattr(faiss, "try_extract_index_ivf") else None
        if ivf is not None:
            ivf.make_direct_map()  # IVF reconstruction by row id
        self.index = index
        self.shape = (index.ntotal, index.d)
        self.device = torch.device("cpu")

    def __len__(self) -> int:
        return self.index.ntotal

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop = rows.start or 0, min(rows.stop, self.index.ntotal)
        return torch.from_numpy(self.index.reconstruct_n(start, stop - start))


class ExactRanker:
    """Exact entity ranks for queries against ``rows`` (n × d) whose entities are ``row_entity`` (n ints)."""

    def __init__(
        self,
        rows: torch.Tensor,
        row_entity: np.ndarray,
        num_entities: int,
        chunk_rows: int = 131_072,
        block_bytes: int = 256 << 20,
    ):
        self.rows = rows
        self.device = rows.device
        self.row_entity = torch.as_tensor(np.asarray(row_entity, dtype=np.int64), device=self.device)
        if len(self.row_entity) != len(rows):
            raise ValueError(f"{len(rows)} rows but {len(self.row_entity)} row → entity ids")
        self.num_entities = int(num_entities)
        self.chunk_rows = int(chunk_rows)
        # queries per block, so each float32 table a block makes stays within block_bytes: the best score per entity
        # (queries × entities) and one row chunk's scores (queries × chunk rows)
        widest = max(self.num_entities, min(len(rows), self.chunk_rows), 1)
        self.block_queries = max(1, int(block_bytes) // (4 * widest))

    @classmethod
    def from_faiss(
        cls, index, row_entity: np.ndarray, num_entities: int, device: str = "cpu", copy_chunk: int = 65_536, **kw
    ) -> ExactRanker:
        """Rows of a Flat FAISS index: a zero-copy view on ``cpu``; one replica on ``cuda:N`` (fp16 for fp32 rows,
        else the index's own 16-bit dtype), copied in chunks so no full-size temporary is made."""
        view = rows_view(index)
        if device == "cpu":
            return cls(view, row_entity, num_entities, **kw)
        dtype = torch.float16 if view.dtype == torch.float32 else view.dtype
        rows = torch.empty(view.shape, dtype=dtype, device=device)
        for s in range(0, len(view), copy_chunk):
            rows[s : s + copy_chunk].copy_(view[s : s + copy_chunk].to(dtype))
        return cls(rows, row_entity, num_entities, **kw)

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def entity_scores(self, queries: torch.Tensor) -> torch.Tensor:
        """(b, num_entities) float32: each entity's best row score for each query (−inf for an entity with no row)."""
        best = torch.full((len(queries), self.num_entities), -torch.inf, dtype=torch.float32, device=self.device)
        for s in range(0, len(self.rows), self.chunk_rows):
            chunk = self.rows[s : s + self.chunk_rows]
            scores = queries @ chunk.to(torch.float32).T
            ents = self.row_entity[s : s + self.chunk_rows].expand(len(queries), -1)
            best.scatter_reduce_(1, ents, scores, reduce="amax")
        return best

    def ranks(self, queries: np.ndarray, gold: list[int]) -> list[int | None]:
        """1-based rank of each gold entity index among all entities (exact, no depth); None for gold = −1."""
        q = torch.as_tensor(np.ascontiguousarray(queries, dtype=np.float32), device=self.device)
        if q.ndim != 2 or q.shape[1] != self.rows.shape[1]:
            raise ValueError(f"queries must have shape (n, {self.rows.shape[1]}), got {tuple(q.shape)}")
        if len(gold) != len(q):
            raise ValueError(f"{len(q)} queries but {len(gold)} gold entities")
        g = torch.as_tensor(np.asarray(gold, dtype=np.int64), device=self.device)
        out: list[int | None] = []
        for s in range(0, len(q), self.block_queries):
            qb, gb = q[s : s + self.block_queries], g[s : s + self.block_queries]
            best = self.entity_scores(qb)
            known = gb >= 0
            gold_best = best.gather(1, gb.clamp(min=0)[:, None])
            above = (best > gold_best).sum(dim=1) + 1
            out += [int(r) if k else None for r, k in zip(above.tolist(), known.tolist())]
        return out
