"""Images read and preprocessed by a torch DataLoader with worker processes, so an encoder never waits on PIL.

Two datasets: ``KBImageRows`` (index build: each worker reads its KB rows by byte offset, decodes the image and applies
the encoder's preprocessing) and ``ImageFiles`` (evaluation: a list of image paths). An item that cannot be decoded
comes back as a failure with the reason (``retrieval.kb.load_image``'s wording); it never stops the loader.
``timed`` iterates a loader and measures how long the consumer waited for each batch; ``encode_image_files`` runs an
image encoder over a list of files that way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from common.files import json_record
from retrieval.kb import load_image


def pixels(path: Path | None, preprocess: Callable):
    """(tensor, None) for a decodable image, else (None, why not)."""
    if path is None:
        return None, "no image path"
    img, problem = load_image(path)
    if img is None:
        return None, problem
    try:
        return preprocess(img), None
    except Exception as e:  # a decodable file the encoder's transform cannot take (e.g. a 0-pixel image)
        return None, f"image unreadable: {path} (preprocessing: {type(e).__name__}: {e})"


class ImageFiles(Dataset):
    """Item i: ``{"i": i, "pixels": tensor | None, "problem": str | None}`` for ``paths[i]``."""

    def __init__(self, paths: Sequence[Path], preprocess: Callable):
        self.paths, self.preprocess = list(paths), preprocess

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict:
        x, problem = pixels(self.paths[i], self.preprocess)
        return {"i": i, "pixels": x, "problem": problem}


class KBImageRows(Dataset):
    """Item = a KB row number: the row's ids and title, and its image preprocessed (or why not). The KB file is
    opened once per worker; rows are read by seeking to ``offsets[row]``."""

    def __init__(self, kb: Path, offsets: np.ndarray, root: Path, preprocess: Callable):
        self.kb, self.offsets, self.root, self.preprocess = Path(kb), offsets, Path(root), preprocess
        self._fh = None

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, row: int) -> dict:
        if self._fh is None:
            self._fh = open(self.kb, "rb")
        self._fh.seek(int(self.offsets[row]))
        rec = json_record(self._fh.readline(), self.kb, f"row {int(row) + 1}")  # as the scan read it
        rel = rec.get("image")
        x, problem = pixels(self.root / rel if rel else None, self.preprocess)
        return {
            "i": int(row),
            "pixels": x,
            "problem": problem,
            "entry_id": str(rec["entry_id"]),
            "entity_id": str(rec.get("entity_id")),
            "title": str(rec.get("title") or ""),
        }


def collate(items: list[dict]) -> dict:
    """A batch: the decodable items' pixels stacked, their fields as lists; failures listed with their reason."""
    ok = [it for it in items if it["pixels"] is not None]
    batch = {k: [it[k] for it in ok] for k in items[0] if k not in ("pixels", "problem")}
    batch["pixels"] = torch.stack([it["pixels"] for it in ok]) if ok else None
    batch["failed"] = [it for it in items if it["pixels"] is None]
    for it in batch["failed"]:
        it.pop("pixels")
    return batch


# How long the encoder waits for the workers' next decoded batch: a batch takes seconds, even of 20-megapixel photos;
# a worker that hung (a decoder that never returns, a file system that stopped answering) would hold the job for ever.
DECODE_TIMEOUT_S = 1800


def loader(
    dataset: Dataset,
    batches: list[list[int]],
    workers: int,
    pin_memory: bool = False,
    timeout_s: int = DECODE_TIMEOUT_S,
) -> DataLoader:
    """Batches in the given order (``batches``: lists of item indices), decoded by ``workers`` processes (each batch
    waited for at most ``timeout_s``: ``timed`` then raises a TimeoutError naming the wait)."""
    return DataLoader(
        dataset,
        batch_sampler=batches,
        num_workers=workers,
        collate_fn=collate,
        pin_memory=pin_memory,
        prefetch_factor=4 if workers else None,
        timeout=timeout_s if workers else 0,  # in the main process (no workers) nothing is waited for
    )


def batches_of(indices: Sequence[int], size: int) -> list[list[int]]:
    indices = [int(i) for i in indices]
    return [indices[s : s + size] for s in range(0, len(indices), size)]


class Waits:
    """Seconds the consumer spent waiting for batches (``waited``) against the whole loop (``total``)."""

    def __init__(self):
        self.waited = 0.0
        self.start = time.perf_counter()

    @property
    def total(self) -> float:
        return time.perf_counter() - self.start

    @property
    def share(self) -> float:
        return self.waited / self.total if self.total > 0 else 0.0


def timed(batches, waits: Waits) -> Iterator[dict]:
    """``batches`` as they come, the wait for each added to ``waits``; a DataLoader's expired wait for its workers
    (``loader``'s ``timeout_s``) is a TimeoutError saying what was waited for."""
    it = iter(batches)
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return
        except RuntimeError as e:
            if not str(e).startswith("DataLoader timed out"):
                raise
            workers = getattr(batches, "num_workers", "the")
            raise TimeoutError(
                f"no batch of decoded images from {workers} DataLoader worker{'s' if workers != 1 else ''} within "
                f"{getattr(batches, 'timeout', '?')} s: an image whose decoding never ends, or a file system that "
                "stopped answering"
            ) from e
        waits.waited += time.perf_counter() - t0
        yield batch


def encode_image_files(enc, paths: Sequence, workers: int, device: str, log=None) -> tuple[np.ndarray, dict[int, str]]:
    """Embeddings of image files, decoded and preprocessed by ``workers`` DataLoader processes in batches (never
    every image in memory at once) and encoded by ``enc`` (an image encoder on ``device``). Returns (embeddings of the
    decodable ones in order, {position: why not})."""
    data = loader(
        ImageFiles(paths, enc.preprocess),
        batches_of(range(len(paths)), enc.batch_size),
        workers,
        pin_memory=str(device).startswith("cuda"),
    )
    out, failed, waits = [], {}, Waits()
    with tqdm(total=len(paths), desc="encoding query images", unit="img", disable=len(paths) < 256) as bar:
        for batch in timed(data, waits):
            if batch["pixels"] is not None:
                out.append(enc.encode_pixels(batch["pixels"]))
            failed.update((it["i"], it["problem"]) for it in batch["failed"])
            bar.update(len(batch["i"]) + len(batch["failed"]))
    if log is not None:
        log(
            f"query images: {len(paths) - len(failed)} encoded, {workers} decoding workers, the encoder waited "
            f"for data {100 * waits.share:.0f}% of {waits.total:.1f}s"
        )
    return (np.concatenate(out) if out else np.zeros((0, enc.dim), np.float32)), failed
