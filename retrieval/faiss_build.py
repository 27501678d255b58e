"""The FAISS index itself: checked factory strings, an inner-product index built chunk by chunk (trained on a sample
when the factory needs training), and read back memory-mapped. retrieval/index.py wraps one with its rows, manifest
and encoders; retrieval/build_index.py writes it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def check_factory(factory: str, dim: int = 1024) -> str:
    """Refuse a FAISS factory string that FAISS cannot build at ``dim`` (an index build's settings are checked at a
    1,024-dim probe before the encoders give the rows' width; the build checks again at that width)."""
    from common.faiss_lib import faiss

    try:
        faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except Exception as e:  # faiss raises RuntimeError with a C++ message
        raise ValueError(
            f"unknown or invalid FAISS factory string {factory!r} for dimension {dim}: "
            f"{str(e).strip().splitlines()[-1]}"
        ) from None
    return factory


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
