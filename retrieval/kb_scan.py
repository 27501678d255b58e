"""One streaming pass over a KB JSONL: where each row starts, which rows can be indexed, and which embedded texts are
the same (so each distinct section text is encoded once per build).

Memory is a few arrays of fixed width per row (about 40 bytes a row: the byte offset, a 16-byte hash of the embedded
text, a 16-byte hash of the entry id), never the rows themselves; rows are read back by seeking to their offsets.
Pure in the sense that matters: the same file and template give the same scan on every process.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.files import json_record
from retrieval.kb import entry_text

_PAIR = np.dtype([("hi", "<u8"), ("lo", "<u8")])  # a 16-byte digest, sortable by np.unique


def digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def row_problem(rec: dict) -> str | None:
    """Why a KB row cannot become an index row before its image is read (None when it can)."""
    if rec.get("entity_id") in (None, ""):
        return "no entity_id"
    if not str(rec.get("text") or "").strip():
        return "empty text"
    return None


@dataclass
class KBScan:
    """``offsets[r]``: byte offset of row r's line; ``text_id[r]``: index of row r's embedded text among the distinct
    texts in order of first appearance (−1 for a row that cannot be indexed: ``problems[r]`` says why);
    ``text_rows[u]``: the first row whose embedded text is distinct text u."""

    path: Path
    offsets: np.ndarray
    text_id: np.ndarray
    text_rows: np.ndarray
    problems: dict[int, str]

    @property
    def rows(self) -> int:
        return len(self.offsets)

    @property
    def texts(self) -> int:
        return len(self.text_rows)

    def read(self, rows) -> list[dict]:
        """The records of these rows (any order; each read by seeking to its offset)."""
        return read_rows(self.path, self.offsets, rows)


def read_rows(path: str | Path, offsets: np.ndarray, rows) -> list[dict]:
    """Rows read as the scan read them (``json_record``: a lone surrogate escape taken as U+FFFD, which no tokenizer
    or UTF-8 file refuses)."""
    out = []
    with open(path, "rb") as f:
        for r in rows:
            f.seek(int(offsets[r]))
            out.append(json_record(f.readline(), path, f"row {int(r) + 1}"))
    return out


def scan_kb(path: str | Path, template: str) -> KBScan:
    """Scan the KB once. A row without an entry_id or a duplicate entry_id is an error naming it (and both rows)."""
    path = Path(path)
    offsets, text_keys, id_keys, problems = array("q"), bytearray(), bytearray(), {}  # fixed width per row
    with open(path, "rb") as f:
        pos = 0
        for lineno, line in enumerate(f, 1):
            start, pos = pos, pos + len(line)
            if not line.strip():
                continue
            rec = json_record(line, path, lineno)
            if rec.get("entry_id") is None:
                raise ValueError(f"{path}:{lineno}: a KB row without an entry_id")  # line, as json_record says
            row = len(offsets)
            offsets.append(start)
            id_keys += digest(str(rec["entry_id"]))
            problem = row_problem(rec)
            if problem is not None:
                problems[row] = problem
                text_keys += bytes(16)
            else:
                text_keys += digest(entry_text(rec, template))
    n = len(offsets)
    offsets = np.frombuffer(offsets, dtype=np.int64) if n else np.zeros(0, dtype=np.int64)
    _check_unique_ids(path, offsets, np.frombuffer(id_keys, dtype=_PAIR))
    del id_keys
    keys = np.frombuffer(text_keys, dtype=_PAIR)
    valid = np.ones(n, dtype=bool)
    valid[list(problems)] = False
    text_id = np.full(n, -1, dtype=np.int64)
    if valid.any():
        rows = np.flatnonzero(valid)
        _, first, inverse = np.unique(keys[rows], return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")  # distinct texts in order of first appearance
        position = np.empty_like(order)
        position[order] = np.arange(len(order))
        text_id[rows] = position[inverse.reshape(-1)]
        text_rows = rows[first[order]]
    else:
        text_rows = np.zeros(0, dtype=np.int64)
    return KBScan(path, offsets, text_id, text_rows.astype(np.int64), problems)


def _check_unique_ids(path: Path, offsets: np.ndarray, keys: np.ndarray) -> None:
    _, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    repeated = np.flatnonzero(counts[inverse] > 1)
    if not len(repeated):
        return
    rows = np.flatnonzero(inverse == inverse[repeated[0]])[:2]  # the first repeated id's first two rows
    entry_id = read_rows(path, offsets, rows[:1])[0]["entry_id"]
    raise ValueError(f"{path}: duplicate entry_id {str(entry_id)!r} (rows {rows[0] + 1} and {rows[1] + 1})")
