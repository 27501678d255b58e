"""The article store: every section of every KB article (with or without an image) on disk, beside the index.

One SQLite file (the standard library's; memory-mapped reads, nothing loaded into Python dicts), three tables:

    articles(entity_id PRIMARY KEY, title, url)
    sections(entity_id, idx, section_title, text)      PRIMARY KEY (entity_id, idx)   idx = the upstream section index
    entries(entry_id PRIMARY KEY, entity_id, idx, image)                              the index rows ⟨image, section⟩

Random access by entity (``sections``, ``article``) and by index row (``entry``). The writer streams into a temporary
file and renames it into place when every article is in (a killed conversion leaves no half-written store).
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable
from pathlib import Path

from common.files import atomic_path, read_jsonl

SCHEMA = """
CREATE TABLE articles (entity_id TEXT PRIMARY KEY, title TEXT, url TEXT) WITHOUT ROWID;
CREATE TABLE sections (entity_id TEXT NOT NULL, idx INTEGER NOT NULL, section_title TEXT, text TEXT,
                       PRIMARY KEY (entity_id, idx)) WITHOUT ROWID;
CREATE TABLE entries (entry_id TEXT PRIMARY KEY, entity_id TEXT NOT NULL, idx INTEGER NOT NULL, image TEXT)
                      WITHOUT ROWID;
"""
SUFFIX = ".articles.sqlite"


def store_path_for(kb_path: str | Path) -> Path:
    """Where the store of a KB JSONL lives by default: ``kb.jsonl`` → ``kb.articles.sqlite``."""
    kb_path = Path(kb_path)
    return kb_path.with_name(kb_path.name.removesuffix(".jsonl") + SUFFIX)


class ArticleWriter:
    """``with ArticleWriter(path) as w: w.add_article(...); w.add_entry(...)`` — batched inserts, one commit, rename."""

    def __init__(self, path: str | Path, batch: int = 10_000):
        self.path, self.batch = Path(path), batch
        self._pending: dict[str, list] = {"articles": [], "sections": [], "entries": []}
        self.counts = {"articles": 0, "sections": 0, "entries": 0}

    def __enter__(self):
        self._atomic = atomic_path(self.path, suffix=".sqlite-tmp")
        tmp = self._atomic.__enter__()
        self.db = sqlite3.connect(tmp)
        self.db.executescript("PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF;" + SCHEMA)
        return self

    def add_article(self, entity_id: str, title: str, url: str | None, sections: Iterable[tuple[int, str, str]]):
        """``sections``: (upstream index, section title, text) — every section, empty or not."""
        self._queue("articles", (str(entity_id), title or "", url))
        for idx, section_title, text in sections:
            self._queue("sections", (str(entity_id), int(idx), section_title or "", text or ""))

    def add_entry(self, entry_id: str, entity_id: str, idx: int, image: str | None):
        self._queue("entries", (str(entry_id), str(entity_id), int(idx), image))

    def _queue(self, table: str, row: tuple):
        self._pending[table].append(row)
        self.counts[table] += 1
        if len(self._pending[table]) >= self.batch:
            self._flush(table)

    def _flush(self, table: str):
        rows, self._pending[table] = self._pending[table], []
        if rows:
            marks = ",".join("?" * len(rows[0]))
            try:
                self.db.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)
            except sqlite3.IntegrityError as e:
                key = "entity_id" if table == "articles" else "(entity_id, idx)" if table == "sections" else "entry_id"
                raise ValueError(f"article store: a duplicate {key} in {table} ({e}); the KB repeats a key") from None

    def __exit__(self, exc_type, exc, tb):
        failed = None
        if exc_type is None:
            try:
                for table in self._pending:
                    self._flush(table)
                self.db.execute("CREATE INDEX entries_by_entity ON entries (entity_id)")
                self.db.commit()
            except BaseException as e:  # the last rows' duplicate key, a full disk: the temporary goes all the same
                failed = e
        self.db.close()
        if failed is None:
            return self._atomic.__exit__(exc_type, exc, tb)
        self._atomic.__exit__(type(failed), failed, failed.__traceback__)
        raise failed


class ArticleStore:
    """Read-only random access to a store written by ``ArticleWriter``; safe to open in every process."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(
                f"article store {self.path} does not exist; build it with `python -m retrieval.upstream.convert "
                f"--format articles --input <kb.jsonl> --out {self.path}` or a KB converter's --articles"
            )
        self.db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
        self.db.execute(f"PRAGMA mmap_size={min(1 << 30, os.path.getsize(self.path))}")

    def __len__(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM articles").fetchone()[0]

    def __contains__(self, entity_id) -> bool:
        return self.db.execute("SELECT 1 FROM articles WHERE entity_id=?", (str(entity_id),)).fetchone() is not None

    def article(self, entity_id) -> dict | None:
        row = self.db.execute("SELECT title, url FROM articles WHERE entity_id=?", (str(entity_id),)).fetchone()
        if row is None:
            return None
        return {"entity_id": str(entity_id), "title": row[0], "url": row[1], "sections": self.sections(entity_id)}

    def sections(self, entity_id, skip_titles: Iterable[str] = ()) -> list[dict]:
        """Every section of an article in upstream order, as KB-entry-like dicts (``entry_id`` = entity#s<idx>);
        sections whose title contains one of ``skip_titles`` (case-insensitive, as EchoSight skips "external links"
        and "references": "Notes and references" goes too) are left out."""
        skip = [t.lower() for t in skip_titles if t]
        rows = self.db.execute(
            "SELECT s.idx, s.section_title, s.text, a.title FROM sections s JOIN articles a "
            "USING (entity_id) WHERE s.entity_id=? ORDER BY s.idx",
            (str(entity_id),),
        ).fetchall()
        return [
            {
                "entry_id": f"{entity_id}#s{idx}",
                "entity_id": str(entity_id),
                "title": title,
                "section": idx,
                "section_title": st,
                "text": text,
            }
            for idx, st, text, title in rows
            if not any(word in st.lower() for word in skip)
        ]

    def entry(self, entry_id) -> dict | None:
        """An index row as a KB entry (``entry_id``, ``entity_id``, ``title``, ``section_title``, ``text``, ``image``,
        ``section``), or None when the store does not hold it."""
        row = self.db.execute(
            "SELECT e.entity_id, e.idx, e.image, s.section_title, s.text, a.title FROM entries e "
            "JOIN sections s ON s.entity_id=e.entity_id AND s.idx=e.idx JOIN articles a ON a.entity_id=e.entity_id "
            "WHERE e.entry_id=?",
            (str(entry_id),),
        ).fetchone()
        if row is None:
            return None
        entity, idx, image, st, text, title = row
        return {
            "entry_id": str(entry_id),
            "entity_id": entity,
            "title": title,
            "section_title": st,
            "text": text,
            "image": image,
            "section": idx,
        }

    def counts(self) -> dict[str, int]:
        return {
            t: self.db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("articles", "sections", "entries")
        }


def store_from_kb_rows(rows: Iterable[dict], out: str | Path) -> dict[str, int]:
    """A store from canonical KB entries (the toy world, or any KB JSONL without an upstream article file):
    sections are the distinct (section_title, text) pairs of each entity, numbered in first-seen order (the first
    index not taken), or the entries' own ``section`` index when they carry one (two sections of equal text keep
    their own indices). Rows must be grouped by entity (converters write them so)."""
    with ArticleWriter(out) as w:
        current, title, sections, seen = None, "", [], {}
        done: set[str] = set()

        def finish():
            if current is not None:
                w.add_article(current, title, None, sections)
                done.add(current)

        for e in rows:
            entity = str(e["entity_id"])
            if entity != current:
                if entity in done:
                    raise ValueError(f"KB rows of entity {entity!r} are not contiguous; sort the KB by entity_id")
                finish()
                current, title, sections, seen = entity, e.get("title") or "", [], {}
            own = int(e["section"]) if e.get("section") is not None else None
            key = (own, e.get("section_title") or "", e.get("text") or "")  # an entry's own index is part of it
            if key not in seen:
                used = set(seen.values())
                idx = own if own is not None else next(i for i in range(len(seen) + 1) if i not in used)
                seen[key] = idx
                sections.append((idx, *key[1:]))
            w.add_entry(e["entry_id"], entity, seen[key], e.get("image"))
        finish()
    return dict(w.counts)


def open_store(kb_path: str | Path, articles: str | Path | None = None, log=print) -> ArticleStore:
    """The article store of a KB: ``articles`` when given, else the one beside the KB JSONL, built from the KB rows
    (streamed) the first time it is missing (a KB converted without an upstream article file, e.g. the toy world)."""
    path = Path(articles) if articles else store_path_for(kb_path)
    if not path.is_file():
        if articles:
            raise ValueError(f"--articles: {path} does not exist")

        counts = store_from_kb_rows(read_jsonl(kb_path), path)
        log(
            f"article store {path} built from {kb_path}: {counts['articles']} articles, {counts['sections']} sections "
            "(only the sections the KB rows hold; convert the upstream KB for every section of every article)"
        )
    return ArticleStore(path)
