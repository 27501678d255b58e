"""Small file helpers: JSONL streaming and atomic writes (temp file in the same folder + rename)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


@functools.cache
def _umask() -> int:
    """The process's umask, read once (reading it means setting it, which is not thread-safe)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(path: str | Path, suffix: str = ""):
    """Yield a temporary path next to ``path``; rename it onto ``path`` only if the block succeeds. The file gets
    the permissions an ordinary ``open`` would give it (mkstemp's are owner-only: a teammate, or a server running as
    another user, could not read an index or predictions written on a shared file system)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix or ".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        _fsync(tmp)  # the bytes on disk before the name points at them: a crash never leaves an empty file there
        os.replace(tmp, path)
        _fsync(path.parent)  # and the rename itself
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _fsync(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_folder(folder: str | Path, replace: bool = True):
    """Yield a fresh temporary folder next to ``folder`` (``.<name>.tmp-<unique>``); when the block succeeds, rename
    it onto ``folder``: over an existing one with ``replace`` (moved aside first, deleted after), else keeping the one
    another process renamed there first. A crash leaves no half-written or half-deleted folder at ``folder``. The
    names are unique, not the process id: a crashed run's leftover under a reused id made the rename aside fail after
    the work was done, and the new folder was deleted."""
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp-{_unique()}")
    tmp.mkdir(parents=True)  # the usual permissions (tempfile.mkdtemp's are the owner's only)
    try:
        yield tmp
        if replace:
            replace_folder(tmp, folder)
        else:
            try:
                os.replace(tmp, folder)
            except OSError:  # a non-empty folder is there: another process finished first
                if not folder.is_dir():
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _unique() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def replace_folder(new: str | Path, folder: str | Path) -> None:
    """Rename the finished folder ``new`` onto ``folder``, its sibling: an existing ``folder`` is moved aside first
    and deleted after, so ``folder`` is never half the one and half the other (``atomic_folder``'s last step, for a
    folder several processes wrote into under one name)."""
    folder = Path(folder)
    old = folder.with_name(f".{folder.name}.old-{_unique()}")
    try:
        if folder.exists():
            os.replace(folder, old)
        os.replace(new, folder)
    finally:
        shutil.rmtree(old, ignore_errors=True)


def wait_for_path(path: str | Path, timeout_s: float, what: str) -> Path:
    """``path`` once it exists (another process writes it); past ``timeout_s``, a TimeoutError naming ``what``."""
    path, deadline = Path(path), time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f} s: waiting for {what}")
        time.sleep(0.1)
    return path


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def json_text(obj, indent: int | None = None) -> str:
    """``obj`` as JSON, non-ASCII characters as they are; a string holding a lone UTF-16 surrogate (JSON read from
    elsewhere can hold half a pair), which no UTF-8 file can hold, makes it all escaped instead. Readers
    (``json_record``) take such an escape back as U+FFFD."""
    text = json.dumps(obj, indent=indent, ensure_ascii=False)
    return json.dumps(obj, indent=indent) if LONE_SURROGATE.search(text) else text


def write_json_atomic(path: str | Path, obj) -> None:
    write_text_atomic(path, json_text(obj, indent=2) + "\n")


def read_json(path: str | Path):
    """A JSON file (a manifest, a record, a trainer state), read as UTF-8 whatever the locale."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def write_jsonl_atomic(path: str | Path, records: Iterable[dict]) -> int:
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json_text(rec) + "\n")
            n += 1
    return n


def without_lone_surrogates(value):
    """``value`` (JSON data) with every lone UTF-16 surrogate, which no UTF-8 file can hold, as U+FFFD. JSON may
    escape half a pair (``"\\ud83d"``: a text cut mid-emoji); a whole pair decodes to one character and is kept."""
    if isinstance(value, str):
        return LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {without_lone_surrogates(k): without_lone_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_lone_surrogates(v) for v in value]
    return value


def json_record(line: str | bytes, path, lineno: int) -> dict:
    """One JSONL line as a dict (a lone surrogate escape read as U+FFFD: ``without_lone_surrogates``); anything else
    raises ValueError naming the file and line number."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
    escape = b"\\u" if isinstance(line, bytes) else "\\u"
    return without_lone_surrogates(rec) if escape in line else rec  # a surrogate only ever comes as an escape


def read_jsonl(path: str | Path, required: Sequence[str] = (), what: str | None = None) -> Iterator[dict]:
    """Stream records; a malformed line, or a record without one of the ``required`` fields (absent or null), raises
    ValueError naming the file, the line number and the field (``what``, when given, is said after it: what the file
    should have been)."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield require_fields(json_record(line, path, lineno), required, f"{path}:{lineno}", what)


def require_fields(rec: dict, required: Sequence[str], where: str, what: str | None = None) -> dict:
    """``rec`` when it holds every ``required`` field, none null; else a ValueError ``<where> lacks "<field>"``."""
    for key in required:
        if rec.get(key) is None:
            said = "lacks" if key not in rec else "has null for"
            raise ValueError(f'{where} {said} "{key}"' + (f": {what}" if what else ""))
    return rec


def append_jsonl(path: str | Path, records: list[dict]) -> None:
    """Append records and flush: a resumable job's finished work survives an interruption (``completed_ids``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.writelines(json_text(r) + "\n" for r in records)
        fh.flush()


def jsonl_lines(path: str | Path) -> list[bytes]:
    """A JSONL file's lines as bytes, newlines kept: split on newlines only (a record may hold U+2028 or U+0085,
    which ``str.splitlines`` would split on) and decoded by whoever reads one (a line cut inside a character is then
    one bad line, not an unreadable file)."""
    return Path(path).read_bytes().splitlines(keepends=True)


def readable_records(path: str | Path) -> list[dict]:
    """The records of a JSONL file whose lines are JSON objects; any other line (one a kill cut short) is passed over:
    for logs and work files, which nobody takes as input."""
    records = []
    for line in jsonl_lines(path):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return records


def repair_jsonl(path: str | Path, key: str | None = None) -> list[dict]:
    """The records of a JSONL file an interrupted job appended to: a last line cut short by a crash is dropped
    (atomically), and a whole last record without its newline gets one, so the next append starts a line of its own.
    Any other line that is not a JSON object (with ``key``, when given) is an error naming it."""
    path = Path(path)
    if not path.exists():
        return []
    lines = jsonl_lines(path)
    records = []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or (key is not None and key not in rec):
                raise TypeError
            records.append(rec)
        except (ValueError, TypeError):
            if i != len(lines) - 1:
                what = f"a JSON record with {'an' if key == 'id' else 'a'} {key}" if key else "a JSON record"
                raise ValueError(f"{path}: line {i + 1} is not {what}; fix or remove the file") from None
            with atomic_path(path) as tmp:
                tmp.write_bytes(b"".join(lines[:-1]))
            return records
    if lines and not lines[-1].endswith(b"\n"):
        with atomic_path(path) as tmp:
            tmp.write_bytes(b"".join(lines) + b"\n")
    return records


def completed_ids(out: Path) -> set[str]:
    """Ids already written to ``out`` (``repair_jsonl``: a last line cut short by a crash is dropped first)."""
    return {str(rec["id"]) for rec in repair_jsonl(out, key="id")}


def file_fingerprint(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def input_settings(queries, images_root) -> dict:
    """What a resumable job over a queries file records of its input: the file's content (a file made again, by
    another refiner or another draw, is another input) and the folder its images resolve against."""
    return {"queries": file_fingerprint(queries), "images_root": str(Path(images_root).resolve())}


def weights_fingerprint(folder: str | Path) -> str | None:
    """The identity of the weights in a model folder, cheap to take: each weights file's name, size and modification
    time, hashed (a re-export replaces the files; a copy that keeps the times keeps it). None without such files."""
    files = sorted(f for f in Path(folder).glob("*") if f.suffix in (".safetensors", ".bin", ".pt") and f.is_file())
    if not files:
        return None
    stamp = [(f.name, st.st_size, st.st_mtime_ns) for f, st in ((f, f.stat()) for f in files)]
    return hashlib.blake2b(json.dumps(stamp).encode(), digest_size=12).hexdigest()


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (no screen here or on clusters)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: int = 120) -> None:
    """Write a figure as PNG atomically and close it (written or not: pyplot keeps every open figure)."""
    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=dpi, format="png")
    finally:
        pyplot().close(fig)


def check_unique_ids(rows: Iterable[dict], source: str | Path, key: str = "id", shown: int = 10) -> None:
    """Raise a ValueError naming the duplicated ``key`` values (the first ``shown``) and ``source``."""
    seen: set[str] = set()
    dupes: dict[str, None] = {}  # ordered set: first duplicates first
    for rec in rows:
        value = str(rec.get(key))
        if value in seen:
            dupes[value] = None
        seen.add(value)
    if dupes:
        names = ", ".join(list(dupes)[:shown]) + (" …" if len(dupes) > shown else "")
        raise ValueError(f"{source}: {len(dupes)} {key} value(s) occur more than once: {names} ({key}s must be unique)")
