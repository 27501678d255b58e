"""Knowledge-base converters for the upstream files (docs/upstream.md is the specification).

- E-VQA ``encyclopedic_kb_wiki.json`` (2M articles keyed by Wikipedia URL) and EchoSight's InfoSeek 100K KB in the same
  format, streamed with ijson (memory flat in the number of articles); mKG-RAG's JSONL variant (one ``{url: entry}``
  a line) too.
- OVEN's ``Wiki6M_ver_1_0.jsonl.gz`` (entity = Wikidata QID; summary and content as sections).
- Every input is read as the downloads pack it (``open_upstream``): plain, gzipped, or the one data file of a ``.zip``.
- Images: an explicit url → path map, a folder of ``md5(url).<ext>`` files, WikiSeeker/OMGM's title-keyed image CSVs,
  or (Wiki6M) UniIR's ``<QID[:4]>/<QID>.jpg`` layout (what OVEN's ``all_wikipedia_images.tar`` holds). SVG files
  (PIL cannot decode them) never become index rows: they are listed as skipped.
- Entity keys: a QID → URL map, built from Wiki6M titles or read from a file, so InfoSeek's QID questions meet a
  URL-keyed KB.

Each article yields ``(article, rows)``: the article with every section (for the article store) and the index rows
⟨image, section⟩ (canonical KB entries carrying their ``section`` index). Anything not converted goes to ``skip``.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import urllib.parse
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from common.files import json_record, read_json, without_lone_surrogates
from retrieval.kb import kb_entry

# --------------------------------------------------------------------------- reading

GZIP_MAGIC = b"\x1f\x8b"
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")  # a member first; an empty archive is its end record alone
DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".tsv")
SVG_SUFFIXES = (".svg", ".svgz")


@contextmanager
def open_upstream(path: str | Path, text: bool = True):
    """``(stream, name)`` for an upstream file as the downloads pack it: plain, gzipped (``Wiki6M_ver_1_0.jsonl.gz``;
    recognised by its magic bytes, whatever its name) or a ``.zip`` holding one data file (``encyclopedic_kb_wiki.zip``,
    EchoSight's ``infoseek_100k_wiki.zip``), read in place. ``name`` is the data file's own name (``.gz`` removed, the
    zip member's name), which tells JSON from JSONL."""
    path = Path(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic[:2] == GZIP_MAGIC:
        raw, name = gzip.open(path, "rb"), path.name.removesuffix(".gz")
    elif magic in ZIP_MAGICS:
        archive = zipfile.ZipFile(path)
        members = [
            m
            for m in archive.infolist()
            if not m.is_dir() and not m.filename.startswith("__MACOSX/") and not Path(m.filename).name.startswith(".")
        ]
        data = [m for m in members if m.filename.lower().endswith(DATA_SUFFIXES)]
        if len(data) != 1:
            archive.close()
            listed = ", ".join(m.filename for m in members[:10]) or "nothing"
            raise ValueError(
                f"{path}: expected a zip archive holding one .json/.jsonl/.csv file, found {listed}; "
                "unzip it and pass the data file"
            )
        raw, name = archive.open(data[0]), Path(data[0].filename).name
    else:
        raw, name = open(path, "rb"), path.name
    stream = (
        io.TextIOWrapper(raw, encoding="utf-8-sig", newline="" if name.endswith((".csv", ".tsv")) else None)
        if text
        else raw
    )
    try:
        yield stream, name
    except (EOFError, gzip.BadGzipFile, zipfile.BadZipFile, zlib.error) as e:
        raise ValueError(
            f"{path}: the download is truncated or corrupt ({type(e).__name__}: {e}); fetch it again"
        ) from None
    finally:
        stream.close()
        if magic in ZIP_MAGICS:
            archive.close()


def read_upstream_jsonl(path: str | Path) -> Iterator[dict]:
    """Stream the records of a JSONL file, plain, gzipped or zipped; a bad line is an error naming file and line."""
    with open_upstream(path) as (f, _):
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield json_record(line, path, lineno)


def iter_evqa_kb(path: str | Path) -> Iterator[tuple[str, dict]]:
    """(url, article) pairs of an E-VQA-format KB, streamed (plain, gzipped or zipped): a JSON object read with
    ijson, or JSONL lines each holding ``{url: article}`` (mKG-RAG)."""
    with open_upstream(path, text=False) as (f, name):
        if name.endswith(".jsonl"):
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    obj = json_record(line, path, lineno)
                    yield from obj.items()
            return
        first = f.read(1024)
        if first.lstrip()[:1] != b"{":
            raise ValueError(f"{path}: expected a JSON object keyed by Wikipedia URL (E-VQA KB format)")
        import ijson

        count = 0
        try:
            for url, article in ijson.kvitems(_Prefixed(first, f), "", use_float=True):
                yield url, without_lone_surrogates(article)
                count += 1
        except UnicodeDecodeError as e:  # yajl2_c on an escaped lone low surrogate (a lone high one it reads as "?")
            raise ValueError(
                f"{path}: text that is not UTF-8 after article {count} ({e.reason}: a lone surrogate escape?); "
                "ijson's C parser cannot read it; IJSON_BACKEND=python reads it (slower), as U+FFFD"
            ) from None


class _Prefixed(io.RawIOBase):
    """A binary stream: ``head`` (already read) then the rest of ``stream`` (no seeking back in gzip/zip members)."""

    def __init__(self, head: bytes, stream):
        self.head, self.stream = head, stream

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        if self.head:
            n = min(len(buf), len(self.head))
            buf[:n], self.head = self.head[:n], self.head[n:]
            return n
        data = self.stream.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            out, self.head = self.head + self.stream.read(), b""
            return out
        return super().read(size)


# --------------------------------------------------------------------------- images


def url_hash(url: str) -> str:
    """Name of an image file in a folder keyed by URL hash (md5 hex of the URL)."""
    return hashlib.md5(url.encode("utf-8")).hexdigest()


def svg_problem(path: str | None) -> str | None:
    """Why a KB image file cannot be indexed before it is read: an SVG (flags, maps, coats of arms), which PIL cannot
    decode; None otherwise."""
    if path is not None and str(path).lower().endswith(SVG_SUFFIXES):
        return (
            f"SVG image {path}: PIL cannot decode it; run retrieval.upstream.fetch_images again (it fetches "
            "Wikimedia's PNG "
            "rendering of an SVG, or rasterises it with cairosvg when that is installed)"
        )
    return None


def image_resolver(mapping: dict[str, str] | None = None, folder: str | Path | None = None) -> Callable:
    """URL → local image path (or None): from an explicit mapping, else ``folder/<md5(url)>.<any ext>`` (a raster
    file before an SVG of the same URL left by an older fetch)."""
    by_hash: dict[str, str] = {}
    if folder is not None:
        for p in sorted(Path(folder).iterdir(), key=lambda p: svg_problem(p.name) is not None):
            if not p.name.startswith("."):
                by_hash.setdefault(p.stem, p.name)

    def resolve(url: str) -> str | None:
        if mapping and url in mapping:
            return mapping[url]
        return by_hash.get(url_hash(url))

    return resolve


def title_images(
    csv_paths: Iterable[str | Path], images_root: str | Path, skip: Callable[[dict], None], per_title: int = 10
) -> dict[str, list[str]]:
    """WikiSeeker/OMGM image CSVs (column 0 article title, column 2 image path relative to ``images_root``, header
    row) → {title: paths}: at most ``per_title`` distinct paths a title whose files exist (as their loaders keep
    them). Each row left out otherwise (no file, an SVG, past ``per_title``, too few columns) goes to ``skip``."""
    out: dict[str, list[str]] = {}
    root = Path(images_root)
    for p in csv_paths:
        with open_upstream(p) as (f, _):
            reader = csv.reader(f)
            next(reader, None)
            for n, row in enumerate(reader, 2):
                where = {"csv": str(p), "row": n}
                if len(row) < 3:
                    skip({**where, "reason": f"fewer than 3 columns ({len(row)})"})
                    continue
                title, image = row[0], row[2]
                paths = out.setdefault(title, [])
                if image in paths:
                    continue
                why = (
                    ("no file under " + str(root))
                    if not (root / image).is_file()
                    else svg_problem(image)
                    or (
                        f"more than {per_title} images for this title (the first {per_title} are kept, as OMGM does)"
                        if len(paths) >= per_title
                        else None
                    )
                )
                if why:
                    skip({**where, "title": title, "image": image, "reason": why})
                    continue
                paths.append(image)
    return out


# --------------------------------------------------------------------------- E-VQA format


def evqa_article(
    url: str,
    art: dict,
    resolve_image: Callable[[str], str | None] | None,
    skip: Callable[[dict], None],
    titled: dict[str, list[str]] | None = None,
) -> tuple[dict, list[dict]]:
    """One E-VQA KB article → (article with every section, index rows).

    With ``resolve_image`` each of ``image_urls`` is paired with its ``image_section_indices`` section (the first
    section when that index is missing, out of range or empty); an image with no local file is skipped. With
    ``titled`` (title-keyed image CSVs) the article's images are paired with its first section.
    """
    if not isinstance(art, dict):
        raise ValueError(f"E-VQA KB: the entry for {url!r} is {type(art).__name__}, not an article object")
    entity = art.get("url") or url  # its own url first, as EchoSight's loader reads it (the ids its retrieval returns)
    title = art.get("title") or ""
    titles, texts = (art.get(k) or [] for k in ("section_titles", "section_texts"))
    titles, texts = ([x] if isinstance(x, str) else list(x) for x in (titles, texts))  # one section as a bare string
    sections = [(i, titles[i] if i < len(titles) else "", t or "") for i, t in enumerate(texts)]
    article = {"entity_id": entity, "title": title, "url": entity, "sections": sections}
    rows = []
    if titled is not None:
        images = titled.get(title, [])
        if not images:
            skip(
                {
                    "entity_id": entity,
                    "title": title,
                    "reason": "no image for this title in the image CSVs (the "
                    "article is in the store, with no index row)",
                }
            )
        for j, image in enumerate(images):
            rows.append(
                kb_entry(
                    f"{entity}#image{j}",
                    entity,
                    title,
                    sections[0][1] if sections else "",
                    sections[0][2] if sections else "",
                    image,
                    section=0,
                )
            )
        return article, rows
    indices = art.get("image_section_indices") or []
    for j, image_url in enumerate(art.get("image_urls") or []):
        entry_id = f"{entity}#image{j}"
        path = resolve_image(image_url)
        if path is None:
            skip({"entry_id": entry_id, "reason": f"no local file for image {image_url}"})
            continue
        if svg_problem(path):
            skip({"entry_id": entry_id, "reason": svg_problem(path)})
            continue
        s = indices[j] if j < len(indices) else None
        if not isinstance(s, int) or not (0 <= s < len(texts)) or not str(texts[s] or "").strip():
            s = 0
        if not sections:
            skip({"entry_id": entry_id, "reason": "article has no section text"})
            continue
        rows.append(kb_entry(entry_id, entity, title, sections[s][1], sections[s][2], path, section=s))
    return article, rows


# --------------------------------------------------------------------------- OVEN Wiki6M


def wiki6m_url(title: str) -> str:
    """The English Wikipedia URL of a Wiki6M title (spaces → underscores)."""
    return "https://en.wikipedia.org/wiki/" + title.replace(" ", "_")


def wiki6m_article(
    row: dict, find_image: Callable[[dict], tuple[str | None, str | None]], skip: Callable[[dict], None]
) -> tuple[dict, list[dict]]:
    """One Wiki6M row → (article: the summary as section 0 — the content when the summary is empty — and the content
    as section 1 when it differs; one index row when the entity has an image, paired with section 0, whose text it
    embeds)."""
    qid, title = str(row.get("wikidata_id") or ""), row.get("wikipedia_title") or ""
    if not qid:
        raise ValueError(f"Wiki6M row without wikidata_id: {str(row)[:120]}")
    summary, content = row.get("wikipedia_summary") or "", row.get("wikipedia_content") or ""
    lead = summary or content
    sections = [(0, title, lead)] + ([(1, "content", content)] if content and content != lead else [])
    article = {"entity_id": qid, "title": title, "url": wiki6m_url(title) if title else None, "sections": sections}
    if not lead.strip():
        skip(
            {
                "entry_id": f"{qid}#image0",
                "reason": "no text: wikipedia_summary and wikipedia_content are empty "
                "(the article is in the store, with no index row)",
            }
        )
        return article, []
    image, why = find_image(row)
    if image is None:
        skip({"entry_id": f"{qid}#image0", "reason": why})
        return article, []
    return article, [kb_entry(f"{qid}#image0", qid, title, title, lead, image, section=0)]


def wiki6m_image_finder(images_root: str | Path | None, resolve_url: Callable[[str], str | None] | None) -> Callable:
    """row → (path, None) | (None, why): the url map / md5 folder for ``wikipedia_image_url`` first, then UniIR's
    ``<QID[:4]>/<QID>.jpg`` layout under ``images_root``."""
    root = Path(images_root) if images_root else None

    def find(row: dict):
        url, qid = row.get("wikipedia_image_url"), str(row.get("wikidata_id"))
        svg = None
        if url and resolve_url is not None:
            path = resolve_url(url)
            svg = svg_problem(path)
            if path is not None and svg is None:
                return path, None
        tried = [f"{qid[:4]}/{qid}.jpg", f"{qid[:4]}/{qid}.JPEG"]
        if root is not None:
            for rel in tried:
                if (root / rel).is_file():
                    return rel, None
        return None, ("no image url and " if not url else f"{svg} and " if svg else f"no local file for {url} and ") + (
            f"none of {', '.join(tried)} under {root}" if root else "no --images_root to look in"
        )

    return find


# --------------------------------------------------------------------------- entity keys


def canonical_url(url: str) -> str:
    """A Wikipedia URL reduced for matching: no scheme, lowercase host, percent-decoded, spaces as underscores."""
    s = urllib.parse.unquote(str(url).strip())
    s = s.split("://", 1)[-1]
    host, _, path = s.partition("/")
    host = host.lower().removeprefix("www.").replace("en.m.wikipedia", "en.wikipedia")
    return f"{host}/{path.replace(' ', '_')}"


def read_entity_map(path: str | Path) -> dict[str, str]:
    """QID → URL map: a JSON object, or a CSV/TSV with two columns (a header row is skipped when its first cell is
    not a QID)."""
    path = Path(path)
    if path.suffix == ".json":
        data = read_json(path)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object mapping QIDs to URLs")
        return {str(k): str(v) for k, v in data.items()}
    out = {}
    with open(path, encoding="utf-8", newline="") as f:
        for row in csv.reader(f, delimiter="\t" if path.suffix == ".tsv" else ","):
            if len(row) >= 2 and row[0].startswith("Q") and row[0][1:].isdigit():
                out[row[0]] = row[1]
    if not out:
        raise ValueError(f"{path}: no QID,URL rows found")
    return out


def qid_map_from_wiki6m(rows: Iterable[dict]) -> Iterator[tuple[str, str]]:
    """(QID, Wikipedia URL) for every Wiki6M row with a title."""
    for r in rows:
        if r.get("wikidata_id") and r.get("wikipedia_title"):
            yield str(r["wikidata_id"]), wiki6m_url(r["wikipedia_title"])


def qid_map_from_echosight(csv_rows: Iterable[dict], withkb: dict[str, dict]) -> Iterator[tuple[str, str]]:
    """(QID, URL) by joining EchoSight's InfoSeek CSV (``data_id`` → ``wikipedia_url``, a key of its 100K KB) with
    InfoSeek's ``*_withkb.jsonl`` (``data_id`` → ``entity_id``); each QID once."""
    seen = set()
    for r in csv_rows:
        known = withkb.get(str(r.get("data_id") or ""))
        if known and r.get("wikipedia_url") and known["entity_id"] not in seen:
            seen.add(known["entity_id"])
            yield str(known["entity_id"]), str(r["wikipedia_url"]).split("|")[0].strip()


def remap_entity(entity, mapping: dict[str, str], kb_keys: dict[str, str] | None = None):
    """A question's entity through the QID → URL map; with ``kb_keys`` ({canonical_url: KB key}) the URL becomes the
    KB's own spelling of it. Lists (2-hop) map element-wise; an unmapped id is returned unchanged."""
    if isinstance(entity, list):
        return [remap_entity(e, mapping, kb_keys) for e in entity]
    if entity is None:
        return None
    url = mapping.get(str(entity), str(entity))
    return kb_keys.get(canonical_url(url), url) if kb_keys is not None else url
