"""Knowledge-base converters for the upstream files (docs/UPSTREAM.md is the specification).

- E-VQA ``encyclopedic_kb_wiki.json`` (2M articles keyed by Wikipedia URL) and EchoSight's InfoSeek 100K KB in the same
  format, streamed with ijson (memory flat in the number of articles); mKG-RAG's JSONL variant (one ``{url: entry}``
  a line) too.
- OVEN's ``Wiki6M_ver_1_0.jsonl`` (entity = Wikidata QID; summary and content as sections).
- Images: an explicit url → path map, a folder of ``md5(url).<ext>`` files, WikiSeeker/OMGM's title-keyed image CSVs,
  or (Wiki6M) UniIR's ``<QID[:4]>/<QID>.jpg`` layout.
- Entity keys: a QID → URL map, built from Wiki6M titles or read from a file, so InfoSeek's QID questions meet a
  URL-keyed KB.

Each article yields ``(article, rows)``: the article with every section (for the article store) and the index rows
⟨image, section⟩ (canonical KB entries carrying their ``section`` index). Anything not converted goes to ``skip``.
"""

from __future__ import annotations

import csv
import hashlib
import json
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from retrieval.kb import kb_entry

# --------------------------------------------------------------------------- reading


def iter_evqa_kb(path: str | Path) -> Iterator[tuple[str, dict]]:
    """(url, article) pairs of an E-VQA-format KB, streamed: a JSON object read with ijson, or JSONL lines each
    holding ``{url: article}``."""
    path = Path(path)
    if path.suffix == ".jsonl":
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    obj = json.loads(line)
                    if not isinstance(obj, dict):
                        raise ValueError(f"{path}:{lineno}: expected an object {{url: article}}")
                    yield from obj.items()
        return
    import ijson

    with open(path, "rb") as f:
        first = f.read(1024).lstrip()[:1]
        if first != b"{":
            raise ValueError(f"{path}: expected a JSON object keyed by Wikipedia URL (E-VQA KB format)")
        f.seek(0)
        yield from ijson.kvitems(f, "", use_float=True)


# --------------------------------------------------------------------------- images


def url_hash(url: str) -> str:
    """Name of an image file in a folder keyed by URL hash (md5 hex of the URL)."""
    return hashlib.md5(url.encode("utf-8")).hexdigest()


def image_resolver(mapping: dict[str, str] | None = None, folder: str | Path | None = None) -> Callable:
    """URL → local image path (or None): from an explicit mapping, else ``folder/<md5(url)>.<any ext>``."""
    by_hash: dict[str, str] = {}
    if folder is not None:
        for p in Path(folder).iterdir():
            by_hash.setdefault(p.stem, p.name)

    def resolve(url: str) -> str | None:
        if mapping and url in mapping:
            return mapping[url]
        return by_hash.get(url_hash(url))

    return resolve


def title_images(csv_paths: Iterable[str | Path], images_root: str | Path | None = None,
                 per_title: int = 10) -> dict[str, list[str]]:
    """WikiSeeker/OMGM image CSVs (column 0 article title, column 2 image path, header row) → {title: paths}, at most
    ``per_title`` distinct paths a title, files missing under ``images_root`` left out (as their loaders do)."""
    out: dict[str, list[str]] = {}
    root = Path(images_root) if images_root else None
    for p in csv_paths:
        with open(p, newline="") as f:
            reader = csv.reader(f)
            next(reader, None)
            for row in reader:
                if len(row) < 3:
                    continue
                title, image = row[0], row[2]
                paths = out.setdefault(title, [])
                if len(paths) >= per_title or image in paths or (root is not None and not (root / image).is_file()):
                    continue
                paths.append(image)
    return out


# --------------------------------------------------------------------------- E-VQA format


def evqa_article(url: str, art: dict, resolve_image: Callable[[str], str | None] | None,
                 skip: Callable[[dict], None], titled: dict[str, list[str]] | None = None) -> tuple[dict, list[dict]]:
    """One E-VQA KB article → (article with every section, index rows).

    With ``resolve_image`` each of ``image_urls`` is paired with its ``image_section_indices`` section (the first
    section when that index is missing, out of range or empty); an image with no local file is skipped. With
    ``titled`` (title-keyed image CSVs) the article's images are paired with its first section.
    """
    entity = art.get("url") or url
    title = art.get("title") or ""
    titles, texts = list(art.get("section_titles") or []), list(art.get("section_texts") or [])
    sections = [(i, titles[i] if i < len(titles) else "", t or "") for i, t in enumerate(texts)]
    article = {"entity_id": entity, "title": title, "url": entity, "sections": sections}
    rows = []
    if titled is not None:
        for j, image in enumerate(titled.get(title, [])):
            rows.append(kb_entry(f"{entity}#image{j}", entity, title, sections[0][1] if sections else "",
                                 sections[0][2] if sections else "", image, section=0))
        return article, rows
    indices = art.get("image_section_indices") or []
    for j, image_url in enumerate(art.get("image_urls") or []):
        entry_id = f"{entity}#image{j}"
        path = resolve_image(image_url)
        if path is None:
            skip({"entry_id": entry_id, "reason": f"no local file for image {image_url}"})
            continue
        s = indices[j] if j < len(indices) else None
        if not isinstance(s, int) or not (0 <= s < len(texts)) or not str(texts[s]).strip():
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


def wiki6m_article(row: dict, find_image: Callable[[dict], tuple[str | None, str | None]],
                   skip: Callable[[dict], None]) -> tuple[dict, list[dict]]:
    """One Wiki6M row → (article: summary as section 0, content as section 1; one index row when the entity has an
    image, paired with the summary)."""
    qid, title = str(row.get("wikidata_id") or ""), row.get("wikipedia_title") or ""
    if not qid:
        raise ValueError(f"Wiki6M row without wikidata_id: {str(row)[:120]}")
    summary, content = row.get("wikipedia_summary") or "", row.get("wikipedia_content") or ""
    sections = [(0, title, summary)] + ([(1, "content", content)] if content and content != summary else [])
    article = {"entity_id": qid, "title": title, "url": wiki6m_url(title) if title else None, "sections": sections}
    image, why = find_image(row)
    if image is None:
        skip({"entry_id": f"{qid}#image0", "reason": why})
        return article, []
    return article, [kb_entry(f"{qid}#image0", qid, title, title, summary or content, image, section=0)]


def wiki6m_image_finder(images_root: str | Path | None, resolve_url: Callable[[str], str | None] | None) -> Callable:
    """row → (path, None) | (None, why): the url map / md5 folder for ``wikipedia_image_url`` first, then UniIR's
    ``<QID[:4]>/<QID>.jpg`` layout under ``images_root``."""
    root = Path(images_root) if images_root else None

    def find(row: dict):
        url, qid = row.get("wikipedia_image_url"), str(row.get("wikidata_id"))
        if url and resolve_url is not None:
            path = resolve_url(url)
            if path is not None:
                return path, None
        tried = [f"{qid[:4]}/{qid}.jpg", f"{qid[:4]}/{qid}.JPEG"]
        if root is not None:
            for rel in tried:
                if (root / rel).is_file():
                    return rel, None
        return None, ("no image url and " if not url else f"no local file for {url} and ") + \
            (f"none of {', '.join(tried)} under {root}" if root else "no --images_root to look in")

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
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object mapping QIDs to URLs")
        return {str(k): str(v) for k, v in data.items()}
    out = {}
    with open(path, newline="") as f:
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
