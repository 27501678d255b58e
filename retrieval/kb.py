"""Canonical knowledge-base and question records, and converters from the upstream formats.

KB entry (one per ⟨image, section⟩ pair):
    {"entry_id", "entity_id", "title", "section_title", "text", "image"}    image: path relative to an images root
Question:
    {"id", "image", "question", "entity_id", "answers": [...], optional "answer_eval", "question_type", "split",
     "upstream_id"}

Converters are pure functions from parsed upstream rows to canonical records; ``retrieval.convert`` is the CLI.
"""

from __future__ import annotations

import csv
import hashlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

KB_FIELDS = ("entry_id", "entity_id", "title", "section_title", "text", "image")
QUESTION_FIELDS = ("id", "image", "question", "entity_id", "answers")


def kb_entry(entry_id, entity_id, title, section_title, text, image) -> dict:
    return dict(entry_id=str(entry_id), entity_id=str(entity_id), title=title, section_title=section_title,
                text=text, image=image)


def question_record(id, image, question, entity_id, answers, **extra) -> dict:
    rec = dict(id=str(id), image=image, question=question, entity_id=None if entity_id is None else str(entity_id),
               answers=list(answers))
    rec.update({k: v for k, v in extra.items() if v is not None})
    return rec


def entry_text(entry: dict, template: str = "{title}. {section_title}. {text}") -> str:
    """The text that gets embedded for a KB entry."""
    return template.format(title=entry.get("title") or "", section_title=entry.get("section_title") or "",
                           text=entry.get("text") or "").strip()


# --------------------------------------------------------------------------- Encyclopedic-VQA / EchoSight KB


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


def evqa_kb_entries(kb: dict, resolve_image: Callable[[str], str | None], skipped: list | None = None) -> Iterator[dict]:
    """Encyclopedic-VQA / EchoSight KB JSON (dict keyed by URL) → KB entries, one per ⟨image, section⟩.

    An image whose section index is missing, out of range or whose section is empty is paired with the article's
    first section. An image with no local file is skipped (and appended to ``skipped`` with the reason).
    """
    for url, art in kb.items():
        titles = art.get("section_titles") or []
        texts = art.get("section_texts") or []
        indices = art.get("image_section_indices") or []
        for j, image_url in enumerate(art.get("image_urls") or []):
            entry_id = f"{url}#image{j}"
            path = resolve_image(image_url)
            if path is None:
                if skipped is not None:
                    skipped.append({"entry_id": entry_id, "reason": f"no local file for image {image_url}"})
                continue
            s = indices[j] if j < len(indices) else None
            if not isinstance(s, int) or not (0 <= s < len(texts)) or not str(texts[s]).strip():
                s = 0
            text = texts[s] if s < len(texts) else ""
            yield kb_entry(entry_id, art.get("url") or url, art.get("title", ""),
                           titles[s] if s < len(titles) else "", text, path)


# --------------------------------------------------------------------------- InfoSeek


def infoseek_questions(rows: Iterable[dict], withkb: Iterable[dict], image_pattern: str = "{image_id}.jpg",
                       skipped: list | None = None) -> Iterator[dict]:
    """InfoSeek question rows + ``*_withkb.jsonl`` rows (which carry ``entity_id``) → question records."""
    entity_of = {str(r["data_id"]): r.get("entity_id") for r in withkb}
    for r in rows:
        data_id = str(r["data_id"])
        entity = entity_of.get(data_id, r.get("entity_id"))
        if entity is None:
            if skipped is not None:
                skipped.append({"id": data_id, "reason": "no entity_id in the withkb file"})
            continue
        answers = r.get("answer") or []
        if isinstance(answers, str):
            answers = [answers]
        yield question_record(data_id, image_pattern.format(**r), r["question"], entity, answers,
                              answer_eval=r.get("answer_eval"), question_type=r.get("question_type"),
                              split=r.get("data_split"))


# --------------------------------------------------------------------------- Encyclopedic-VQA questions (CSV)


def evqa_questions(rows: Iterable[dict], image_pattern: str = "{dataset_name}/{image_id}.jpg",
                   include_two_hop: bool = False, all_images: bool = False, id_prefix: str = "evqa", *,
                   split: str) -> Iterator[dict]:
    """E-VQA CSV rows (one CSV = one ``split``) → question records.

    Ids are ``{id_prefix}-{split}-{i}`` (``…-{j}`` per image with ``all_images``), i the CSV row index, so the
    train, val and test files never collide; ``upstream_id`` keeps the reference code's ``E-VQA_{i}``.
    ``answer`` alternatives are separated by ``|``; parts of a multi-answer by ``&&`` (kept in ``answer_parts``).
    2-hop rows are excluded unless ``include_two_hop``. One record per question (first image) unless ``all_images``.
    """
    if not split or not str(split).strip() or any(c.isspace() for c in str(split)):
        raise ValueError(f"evqa_questions: split must name the CSV's split (train, val, test), got {split!r}")
    for i, r in enumerate(rows):
        qtype = r.get("question_type", "")
        if qtype == "2_hop" and not include_two_hop:
            continue
        alternatives = [a.strip() for a in str(r.get("answer", "")).split("|") if a.strip()]
        parts = [[p.strip() for p in a.split("&&") if p.strip()] for a in alternatives]
        image_ids = [x.strip() for x in str(r.get("dataset_image_ids", "")).split("|") if x.strip()]
        if not all_images:
            image_ids = image_ids[:1]
        for j, image_id in enumerate(image_ids):
            fields = {**r, "image_id": image_id}
            qid = f"{id_prefix}-{split}-{i}" if not all_images else f"{id_prefix}-{split}-{i}-{j}"
            yield question_record(
                qid, image_pattern.format(**fields), r["question"], r.get("wikipedia_url"),
                alternatives,
                answer_parts=parts if any(len(p) > 1 for p in parts) else None,
                question_type=qtype or None, split=r.get("encyclopedic_vqa_split") or r.get("split") or split,
                evidence_section_id=r.get("evidence_section_id") or None, upstream_id=f"E-VQA_{i}",
            )


def read_csv_rows(path: str | Path) -> Iterator[dict]:
    with open(path, newline="") as f:
        yield from csv.DictReader(f)


def check_images(rows: list[dict], root: str | Path, source: str | Path) -> None:
    """Raise a ValueError naming the image files that are missing for these question rows (ids and paths)."""
    root = Path(root)
    missing = [(r.get("id"), root / str(r.get("image"))) for r in rows if not (root / str(r.get("image"))).is_file()]
    if missing:
        shown = ", ".join(f"{qid} → {path}" for qid, path in missing[:5]) + (" …" if len(missing) > 5 else "")
        raise ValueError(f"{len(missing)} question(s) in {source} have no image file: {shown}")


def load_image(path: str | Path):
    """(RGB PIL image, None) when the file decodes, else (None, why not: missing, unreadable or corrupt)."""
    from PIL import Image

    path = Path(path)
    if not path.is_file():
        return None, f"image file missing: {path}"
    try:
        with Image.open(path) as im:
            return im.convert("RGB"), None
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError, …
        return None, f"image unreadable: {path} ({type(e).__name__}: {e})"


def image_problem(path: str | Path) -> str | None:
    """Why the image at ``path`` cannot be used, or None when it decodes."""
    return load_image(path)[1]
