"""Canonical knowledge-base and question records, and converters from the upstream formats.

KB entry (one per ⟨image, section⟩ pair):
    {"entry_id", "entity_id", "title", "section_title", "text", "image"}    image: path relative to an images root
Question:
    {"id", "image", "question", "entity_id", "answers": [...], optional "answer_eval", "question_type", "split",
     "upstream_id"}

Converters from the upstream files live in ``retrieval.upstream_questions`` and ``retrieval.upstream_kb``;
``retrieval.convert`` is the CLI. A 2-hop E-VQA question's ``entity_id`` is a list (one URL per hop).
"""

from __future__ import annotations

from pathlib import Path

KB_FIELDS = ("entry_id", "entity_id", "title", "section_title", "text", "image")
QUESTION_FIELDS = ("id", "image", "question", "entity_id", "answers")


def kb_entry(entry_id, entity_id, title, section_title, text, image, section: int | None = None) -> dict:
    """One index row; ``section`` is the upstream section index when the converter knows it (the article store's)."""
    rec = dict(entry_id=str(entry_id), entity_id=str(entity_id), title=title, section_title=section_title,
               text=text, image=image)
    if section is not None:
        rec["section"] = int(section)
    return rec


def question_record(id, image, question, entity_id, answers, **extra) -> dict:
    if entity_id is not None:
        entity_id = [str(e) for e in entity_id] if isinstance(entity_id, list) else str(entity_id)
    rec = dict(id=str(id), image=image, question=question, entity_id=entity_id, answers=list(answers))
    rec.update({k: v for k, v in extra.items() if v is not None})
    return rec


def entry_text(entry: dict, template: str = "{title}. {section_title}. {text}") -> str:
    """The text that gets embedded for a KB entry."""
    return template.format(title=entry.get("title") or "", section_title=entry.get("section_title") or "",
                           text=entry.get("text") or "").strip()


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
