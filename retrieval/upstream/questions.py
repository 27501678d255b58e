"""Question converters for the upstream benchmark files (docs/upstream.md is the specification).

- E-VQA ``train/val/test.csv`` (google-research encyclopedic_vqa), and EchoSight's InfoSeek CSV in the same columns
  (``dataset_name`` = ``infoseek``, ``data_id`` kept as the id).
- InfoSeek ``infoseek_{split}.jsonl`` + ``*_withkb.jsonl`` (entity QIDs) + ``infoseek_val_qtype.jsonl``.

Converters are generators of canonical question records (``retrieval.kb.question_record``); every row they cannot
convert goes to ``skip(record)`` with a reason. Image paths are relative to an images root; ``ImageFinder`` picks
the first candidate file that exists there (``.jpg`` / ``.JPEG``, nested or flat layouts).
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from retrieval.kb import question_record
from retrieval.upstream.kb import open_upstream

log = logging.getLogger("refine_rl.convert")

# the question types the reference systems (EchoSight, WikiSeeker) keep; their E-VQA_{i} counts these rows only
KEPT_EVQA_TYPES = ("automatic", "templated", "multi_answer", "infoseek")
EXTENSIONS = (".jpg", ".JPEG")


# --------------------------------------------------------------------------- image rules (pure)


def evqa_image_candidates(image_id: str, dataset_name: str, inat_id2name: dict | None = None) -> list[str]:
    """Relative paths an E-VQA image may have, in order of preference, inside its dataset's folder.

    landmarks (GLDv2): ``<id[0]>/<id[1]>/<id[2]>/<id>.jpg`` (GLDv2's own layout, EchoSight), then a flat ``<id>.jpg``
    (OMGM); inaturalist: the ``*_id2name.json`` file name (EchoSight) when a map is given, else a flat ``<id>.jpg``
    (OMGM / WikiSeeker renaming); infoseek: flat.
    """
    if dataset_name == "landmarks":
        if len(image_id) < 3:
            return []
        return [f"{image_id[0]}/{image_id[1]}/{image_id[2]}/{image_id}{ext}" for ext in EXTENSIONS] + [
            f"{image_id}{ext}" for ext in EXTENSIONS
        ]
    if dataset_name == "inaturalist" and inat_id2name is not None:
        name = inat_id2name.get(image_id)
        return [name] if name else []
    if dataset_name in ("inaturalist", "infoseek"):
        return [f"{image_id}{ext}" for ext in EXTENSIONS]
    raise ValueError(f"unknown E-VQA dataset_name {dataset_name!r} (expected landmarks, inaturalist or infoseek)")


def infoseek_image_candidates(image_id: str, layout: str = "oven") -> list[str]:
    """OVEN's layout ``<image_id[-8:-6]>/<image_id>.jpg`` or one flat folder; ``.jpg`` then ``.JPEG``."""
    if layout == "oven":
        return ["/".join(filter(None, [image_id[-8:-6], f"{image_id}{ext}"])) for ext in EXTENSIONS]  # never "/x.jpg"
    if layout == "flat":
        return [f"{image_id}{ext}" for ext in EXTENSIONS]
    raise ValueError(f"--image_layout must be oven or flat, got {layout!r}")


class ImageFinder:
    """Candidates → the first that exists under ``root`` (relative path), or None. Without a root nothing is
    checked and the first candidate is taken (the caller says so in its log)."""

    def __init__(self, root: str | Path | None, subdirs: dict[str, str] | None = None):
        self.root = Path(root) if root else None
        self.subdirs = subdirs or {}

    def __call__(self, candidates: list[str], dataset: str = "") -> tuple[str | None, str | None]:
        sub = self.subdirs.get(dataset, "")
        paths = [f"{sub}/{c}" if sub else c for c in candidates]
        if not paths:
            return None, f"no image name for this id in the {dataset or 'image'} map"
        if self.root is None:
            return paths[0], None
        for p in paths:
            if (self.root / p).is_file():
                return p, None
        return None, "no image file under {}: tried {}".format(self.root, ", ".join(paths))


def parse_subdirs(text: str | None) -> dict[str, str]:
    """``"landmarks=gldv2,inaturalist=inat"`` → {dataset_name: folder under the images root}."""
    out = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, sep, folder = part.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--image_dirs: expected name=folder pairs separated by commas, got {part!r}")
        out[name.strip()] = folder.strip().strip("/")
    return out


# --------------------------------------------------------------------------- E-VQA CSV (and EchoSight's InfoSeek CSV)


def _bars(text) -> list[str]:
    return [x.strip() for x in str(text or "").split("|") if x.strip()]


def section_index(text: str) -> int | None:
    """An ``evidence_section_id`` value as an integer: ``3``, or ``3.0`` as pandas writes an integer column with
    gaps; None for anything else (the caller says so)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() and value >= 0 else None


def evqa_questions(
    rows: Iterable[dict],
    find_image: Callable,
    skip: Callable[[dict], None],
    *,
    split: str,
    include_two_hop: bool = False,
    all_images: bool = False,
    inat_id2name: dict | None = None,
    id_prefix: str = "evqa",
) -> Iterator[dict]:
    """E-VQA CSV rows (one CSV = one ``split``) → question records.

    Ids are ``{id_prefix}-{split}-{i}`` with i the CSV row (``…-{j}`` per image with ``all_images``), unique across
    the train/val/test files. ``upstream_id`` is the reference code's name: ``E-VQA_{k}`` with k counted over the
    rows of the kept types (automatic, templated, multi_answer, as EchoSight and WikiSeeker load them), or the
    ``data_id`` of an EchoSight InfoSeek row (which is also its id). ``answer``: ``|`` alternatives, ``&&`` parts
    (``answer_parts``). 2-hop rows are left out unless ``include_two_hop``; then ``entity_id`` and
    ``evidence_section_id`` are lists (one per hop), never joined strings. A section id that is not an integer
    (``3.0`` is: pandas writes those) is dropped with a warning naming the row.
    """
    if not split or not str(split).strip() or any(c.isspace() for c in str(split)):
        raise ValueError(f"evqa_questions: split must name the CSV's split (train, val, test), got {split!r}")
    kept = 0
    for i, r in enumerate(rows):
        qtype = str(r.get("question_type") or "").strip()
        two_hop = qtype == "2_hop"
        upstream = None
        if qtype in KEPT_EVQA_TYPES:
            upstream = r.get("data_id") or f"E-VQA_{kept}"
            kept += 1
        elif not two_hop:
            skip({"row": i, "reason": f"unknown question_type {qtype!r}"})
            continue
        if two_hop and not include_two_hop:
            skip({"row": i, "reason": "2_hop question, left out as the papers do (--include_two_hop keeps it)"})
            continue
        urls, sections = _bars(r.get("wikipedia_url")), _bars(r.get("evidence_section_id"))
        if not urls:
            skip({"row": i, "reason": "no wikipedia_url"})
            continue
        entity = urls if two_hop else urls[0]
        indices = [section_index(s) for s in sections]
        if any(x is None for x in indices):
            log.warning(
                "row %d: evidence_section_id %r is not an integer section index; kept without it",
                i,
                r.get("evidence_section_id"),
            )
        section = indices if two_hop else (indices[0] if indices else None)
        alternatives = _bars(r.get("answer"))
        parts = [[p.strip() for p in a.split("&&") if p.strip()] for a in alternatives]
        dataset = str(r.get("dataset_name") or "").strip()
        image_ids = _bars(r.get("dataset_image_ids"))
        if not image_ids:
            skip({"row": i, "reason": "no dataset_image_ids"})
            continue
        is_infoseek = dataset == "infoseek" and r.get("data_id")
        base_id = str(r["data_id"]) if is_infoseek else f"{id_prefix}-{split}-{i}"
        for j, image_id in enumerate(image_ids if all_images else image_ids[:1]):
            qid = f"{base_id}-{j}" if all_images else base_id
            try:
                candidates = evqa_image_candidates(image_id, dataset, inat_id2name)
            except ValueError as e:
                skip({"id": qid, "row": i, "reason": str(e)})
                continue
            image, why = find_image(candidates, dataset)
            if image is None:
                skip({"id": qid, "row": i, "image_id": image_id, "reason": why})
                continue
            yield question_record(
                qid,
                image,
                r["question"],
                entity,
                alternatives,
                answer_parts=parts if any(len(p) > 1 for p in parts) else None,
                question_type=qtype or None,
                split=r.get("encyclopedic_vqa_split") or split,
                evidence_section_id=section,
                upstream_id=upstream,
                dataset_name=dataset or None,
            )


def read_csv_rows(path: str | Path) -> Iterator[dict]:
    """The rows of a CSV by column name (plain, gzipped or zipped)."""
    with open_upstream(path) as (f, _):
        yield from csv.DictReader(f)


def read_id2name(path: str | Path) -> dict[str, str]:
    """EchoSight's iNaturalist ``*_id2name.json``: {image id: file name}."""
    with open_upstream(path) as (f, _):
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object mapping iNaturalist image ids to file names")
    return {str(k): str(v) for k, v in data.items()}


# --------------------------------------------------------------------------- InfoSeek


def infoseek_questions(
    rows: Iterable[dict],
    find_image: Callable,
    skip: Callable[[dict], None],
    *,
    withkb: dict[str, dict] | None = None,
    qtype_of: dict[str, str] | None = None,
    layout: str = "oven",
    require_entity: bool = True,
) -> Iterator[dict]:
    """InfoSeek rows (+ entity ids from ``*_withkb.jsonl``, + ``question_type`` from the qtype file) → questions.

    ``answer`` and ``answer_eval`` are kept as they are (a numeric ``answer_eval`` holds ``{"wikidata", "range"}``).
    Test rows (no answer, no entity) convert with ``require_entity=False`` (inference); with it, a row whose
    entity is unknown is skipped.
    """
    withkb, qtype_of = withkb or {}, qtype_of or {}
    for r in rows:
        data_id = str(r.get("data_id") or "")
        if not data_id or not r.get("image_id") or not r.get("question"):
            skip({"id": data_id or None, "reason": "row lacks data_id, image_id or question"})
            continue
        known = withkb.get(data_id, {})
        entity = known.get("entity_id", r.get("entity_id"))
        if entity is None and require_entity:
            skip(
                {
                    "id": data_id,
                    "reason": "no entity_id (not in the withkb file); "
                    "convert with --require_entity false for inference",
                }
            )
            continue
        image, why = find_image(infoseek_image_candidates(str(r["image_id"]), layout), "")
        if image is None:
            skip({"id": data_id, "image_id": r["image_id"], "reason": why})
            continue
        answers = r.get("answer")
        answers = [] if answers is None else list(answers) if isinstance(answers, (list, tuple)) else [answers]
        yield question_record(
            data_id,
            image,
            r["question"],
            entity,
            answers,
            answer_eval=r.get("answer_eval"),
            question_type=qtype_of.get(data_id, r.get("question_type")),
            split=r.get("data_split"),
            upstream_id=data_id,
            entity_text=known.get("entity_text"),
        )


def rows_by_id(rows: Iterable[dict], needed: str, source: str) -> dict[str, dict]:
    """{data_id: row} from a JSONL (the withkb or qtype file); a row without ``data_id`` or ``needed`` is an error
    naming the file and row."""
    out = {}
    for n, r in enumerate(rows, 1):
        if "data_id" not in r or needed not in r:
            raise ValueError(f"{source}: row {n} has no 'data_id' / {needed!r} field")
        out[str(r["data_id"])] = r
    return out
