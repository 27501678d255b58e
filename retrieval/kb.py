"""Canonical knowledge-base and question records, and converters from the upstream formats.

KB entry (one per ⟨image, section⟩ pair):
    {"entry_id", "entity_id", "title", "section_title", "text", "image"}    image: path relative to an images root
Question:
    {"id", "image", "question", "entity_id", "answers": [...], optional "answer_eval", "question_type", "split",
     "upstream_id"}

Converters from the upstream files live in ``retrieval.upstream.questions`` and ``retrieval.upstream.kb``;
``retrieval.upstream.convert`` is the CLI. A 2-hop E-VQA question's ``entity_id`` is a list (one URL per hop).
"""

from __future__ import annotations

import io
import math
import threading
from pathlib import Path

from PIL import ExifTags, Image, ImageOps

QUESTION_KEYS = ("id", "question")  # what every job over a question file reads: the id its results go by, the question
GOLD_KEYS = (*QUESTION_KEYS, "entity_id")  # and, where retrieval is scored, the gold entity it ranks


def kb_entry(entry_id, entity_id, title, section_title, text, image, section: int | None = None) -> dict:
    """One index row; ``section`` is the upstream section index when the converter knows it (the article store's)."""
    rec = dict(
        entry_id=str(entry_id),
        entity_id=str(entity_id),
        title=title,
        section_title=section_title,
        text=text,
        image=image,
    )
    if section is not None:
        rec["section"] = int(section)
    return rec


def question_record(id, image, question, entity_id, answers, **extra) -> dict:
    if entity_id is not None:
        entity_id = [str(e) for e in entity_id] if isinstance(entity_id, list) else str(entity_id)
    rec = dict(id=str(id), image=image, question=question, entity_id=entity_id, answers=list(answers))
    rec.update({k: v for k, v in extra.items() if v is not None})
    return rec


def has_gold(rec: dict) -> bool:
    """Whether a question has anything to judge its answers against (gold answers, or InfoSeek's answer_eval)."""
    return bool(rec.get("answers")) or bool(rec.get("answer_eval"))  # an empty answer_eval holds nothing


def entry_text(entry: dict, template: str = "{title}. {section_title}. {text}") -> str:
    """The text that gets embedded for a KB entry."""
    return template.format(
        title=entry.get("title") or "", section_title=entry.get("section_title") or "", text=entry.get("text") or ""
    ).strip()


def check_images(rows: list[dict], root: str | Path, source: str | Path) -> None:
    """Raise a ValueError naming the image files that are missing for these question rows (ids and paths)."""
    root = Path(root)
    missing = [(r.get("id"), root / str(r.get("image"))) for r in rows if not (root / str(r.get("image"))).is_file()]
    if missing:
        shown = ", ".join(f"{qid} → {path}" for qid, path in missing[:5]) + (" …" if len(missing) > 5 else "")
        raise ValueError(f"{len(missing)} question(s) in {source} have no image file: {shown}")


# Local image files larger than PIL's decompression-bomb limit (2 × Image.MAX_IMAGE_PIXELS, ~179 MP: Wikipedia has
# scans and panoramas that big) are decoded downscaled instead of refused, up to this many pixels (~537 MP). A JPEG is
# decoded at 1/2 … 1/8 scale (cheap); other formats are decoded whole, then reduced (up to ~1.6 GB while it lasts).
LARGE_IMAGE_PIXELS = 1 << 29
_PIXEL_LIMIT = threading.Lock()


def upright(im):
    """The image turned as its EXIF Orientation tag says, as the datasets library decodes an ``Image`` column (and so
    as TRL hands a question's image to the policy in training); unchanged without the tag. Every path that opens an
    image file goes through it, so the index, the reward, evaluation and inference see one picture."""
    if im.getexif().get(ExifTags.Base.Orientation) is None:
        return im
    return ImageOps.exif_transpose(im)


def to_rgb(im):
    """An RGB copy of ``im`` with any transparency (an alpha band, a palette's transparent colour) composited onto
    white, as transformers' ``convert_to_rgb`` (the image processors') and the VLM's training see it. PIL's
    ``convert("RGB")`` keeps whatever colour lies under the alpha, black for most files, so every black-on-transparent
    logo, flag or signature (Wikimedia's SVG renderings) became one black square with one embedding."""
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        im = im.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", im.size, (255, 255, 255, 255)), im).convert("RGB")
    return im.convert("RGB")


def load_image(path: str | Path):
    """(RGB PIL image, None) when the file decodes, else (None, why not: missing, unreadable or corrupt). Upright
    (``upright``), transparency on white (``to_rgb``). An image past PIL's pixel limit comes back downscaled to within
    ``Image.MAX_IMAGE_PIXELS`` (aspect kept)."""
    path = Path(path)
    if not path.is_file():
        return None, f"image file missing: {path}"
    try:
        with Image.open(path) as im:
            return to_rgb(upright(im)), None
    except Image.DecompressionBombError:
        return _load_large(path)
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, …
        return None, f"image unreadable: {path} ({type(e).__name__}: {e})"


def downscaled_jpeg(path: str | Path) -> bytes:
    """An image past PIL's pixel limit as training's image column holds it (rl.data.image_column_value):
    ``load_image``'s downscaled picture as a quality-95 JPEG; a ValueError naming why when it does not load."""
    image, why = load_image(path)
    if image is None:
        raise ValueError(why)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def _load_large(path: Path):
    """An image past PIL's limit: its header read without PIL's check (for this call only), refused past
    ``LARGE_IMAGE_PIXELS``, else decoded at a reduced scale (JPEG draft) and reduced until it is within
    ``Image.MAX_IMAGE_PIXELS``."""
    target = Image.MAX_IMAGE_PIXELS or LARGE_IMAGE_PIXELS
    try:
        with _PIXEL_LIMIT:
            limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None  # the size is checked just below
            try:
                im = Image.open(path)
            finally:
                Image.MAX_IMAGE_PIXELS = limit
        with im:
            w, h = im.size
            if w * h > LARGE_IMAGE_PIXELS:
                return None, (
                    f"image unreadable: {path} ({w}×{h} = {w * h} pixels, more than the {LARGE_IMAGE_PIXELS} "
                    "this loader decodes)"
                )
            factor = math.sqrt(w * h / target)
            im.draft("RGB", (math.ceil(w / factor), math.ceil(h / factor)))  # JPEG: decoded at a smaller scale
            im.load()
            im = upright(im)
            if im.mode not in ("RGB", "L", "RGBA"):
                im = to_rgb(im)
            if im.width * im.height > target:
                im = im.reduce(math.ceil(math.sqrt(im.width * im.height / target)))
            while im.width * im.height > target:  # reduce rounds sizes up
                im = im.reduce(2)
            return to_rgb(im), None
    except Exception as e:
        return None, f"image unreadable: {path} ({type(e).__name__}: {e})"
