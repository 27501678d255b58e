"""The FAISS index itself: checked factory strings, an inner-product index built chunk by chunk (trained on a sample
when the factory needs training), and read back memory-mapped. retrieval/index.py wraps one with its rows, manifest
and encoders; retrieval/build_index.py writes it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Widths an index build's factory is checked at before the encoders give the rows' own (a width FAISS takes there
# would do): 1,024, and 13,440 = 2⁷·3·5·7, which the usual product-quantiser Ms divide (8, 16, 24, 32, 48, 56, 64, 96,
# 112, 128: PQ48 cannot split 1,024 dims, and builds at the paper's 1,280 + 1,024).
PROBE_WIDTHS = (1024, 13440)


def check_factory(factory: str, dim: int | None = None) -> str:
    """Refuse a FAISS factory string that FAISS cannot build at ``dim`` or, before the rows' width is known (``dim``
    None: an index build's settings), at any of ``PROBE_WIDTHS``: a misspelt factory fails before a model loads, and
    the assembly checks the rows' own width (its encoded shards kept for another --factory)."""
    from common.faiss_lib import faiss

    first = None
    for width in (dim,) if dim else PROBE_WIDTHS:
        try:
            faiss.index_factory(width, factory, faiss.METRIC_INNER_PRODUCT)
            return factory
        except Exception as e:  # faiss raises RuntimeError with a C++ message
            first = first or f"for dimension {width}: {str(e).strip().splitlines()[-1]}"
    raise ValueError(f"unknown or invalid FAISS factory string {factory!r} {first}")


def build_faiss_index(rows: np.ndarray, factory: str):
    """Build an inner-product FAISS index over ``rows`` (trained on them when the factory needs training)."""
    return build_faiss_index_from_chunks(lambda: iter([rows]), factory, rows.shape[1])


def build_faiss_index_from_chunks(
    chunks, factory: str, dim: int, max_train_rows: int = 262_144, total_rows: int | None = None
):
    """Build an inner-product FAISS index chunk by chunk, so only the index itself is held in memory.

    ``chunks()`` returns a fresh iterator of float32 arrays. A factory that needs training is trained on at most
    ``max_train_rows`` rows spread evenly over all of them (every ``ceil(total / max_train_rows)``-th row, a second
    pass over the chunks; ``total_rows`` saves counting them): a KB comes grouped by article, and centroids trained
    on its first rows alone would cover only the articles that come first."""
    from common.faiss_lib import faiss

    index = faiss.index_factory(dim, check_factory(factory, dim), faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:
        total = total_rows if total_rows is not None else sum(len(chunk) for chunk in chunks())
        step = max(1, -(-total // max_train_rows))
        sample, start = [], 0
        for chunk in chunks():
            sample.append(np.asarray(chunk[(-start) % step :: step]))
            start += len(chunk)
        train = np.ascontiguousarray(np.concatenate(sample), dtype=np.float32)
        try:
            index.train(train)
        except RuntimeError as e:
            raise ValueError(
                f"FAISS factory {factory!r} could not be trained on {len(train)} rows: "
                f"{str(e).strip().splitlines()[-1]}"
            ) from None
        del train, sample
    for chunk in chunks():
        if len(chunk):
            index.add(np.ascontiguousarray(chunk, dtype=np.float32))
    return index


def read_faiss(path: Path):
    """A FAISS index file, memory-mapped when its type allows (the rows stay on disk until searched)."""
    from common.faiss_lib import faiss

    flag = getattr(faiss, "IO_FLAG_MMAP_IFC", getattr(faiss, "IO_FLAG_MMAP", 0))
    try:
        return faiss.read_index(str(path), flag)
    except RuntimeError:  # index types that cannot be memory-mapped
        return faiss.read_index(str(path))


def set_parameter(index, name: str, value) -> bool:
    """Set a search parameter (``nprobe``, ``efSearch``, …) wherever FAISS finds it inside ``index`` (through
    pre-transforms, refinement and ID maps: FAISS's ParameterSpace); False when no index inside has it."""
    from common.faiss_lib import faiss

    try:
        faiss.ParameterSpace().set_index_parameter(index, name, value)
    except RuntimeError:
        return False
    return True
