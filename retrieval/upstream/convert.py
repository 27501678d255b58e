"""Convert the upstream KB-VQA files into canonical question / KB JSONL and the article store.

Questions (``--kb`` reports gold entities the KB lacks before any index is built; ``--entity_map`` turns QIDs into
the KB's URLs):
    python -m retrieval.upstream.convert --format evqa-questions --input test.csv --split test --images_root IMAGES \
        --image_dirs landmarks=landmarks,inaturalist=inaturalist [--inat_id2name test_id2name.json] \
        --out questions.jsonl [--include_two_hop] [--all_images] [--kb kb.jsonl]
    (EchoSight's InfoSeek CSV in E-VQA columns converts with the same format; its rows keep their data_id.)
    python -m retrieval.upstream.convert --format infoseek --input infoseek_val.jsonl --withkb
    infoseek_val_withkb.jsonl \
        --qtype infoseek_val_qtype.jsonl --images_root IMAGES --image_layout oven|flat --out questions.jsonl \
        [--require_entity false] [--entity_map qid2url.tsv] [--kb kb.jsonl]
KBs (index rows to ``--out``, every section of every article to ``--articles``, default ``<out>`` with
``.articles.sqlite``):
    python -m retrieval.upstream.convert --format evqa-kb --input encyclopedic_kb_wiki.zip --out kb.jsonl \
        (--image_map url2path.json | --image_dir DIR_OF_<md5(url)>.jpg |
         --image_csv "wiki_image_url_part_*.csv" --images_root WIKI_IMAGES)
    python -m retrieval.upstream.convert --format wiki6m --input Wiki6M_ver_1_0.jsonl.gz --images_root IMAGES --out
    kb.jsonl
    python -m retrieval.upstream.convert --format articles --input kb.jsonl --out kb.articles.sqlite
    python -m retrieval.upstream.convert --format qid-map --input Wiki6M_ver_1_0.jsonl.gz --out qid2url.tsv
    python -m retrieval.upstream.convert --format qid-map --input infoseek_test_filtered.csv --withkb
    infoseek_val_withkb.jsonl \
        --out qid2url.tsv          (EchoSight's CSV joined with the withkb file: the URLs of its 100K KB)

Inputs are read as the downloads pack them: plain, gzipped (``.jsonl.gz``) or the one data file of a ``.zip``.
Every row not converted is listed with its reason in ``<out>.skipped.jsonl``; nothing is dropped silently.
"""

from __future__ import annotations

import glob
import json
import logging
import re
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from common.cli import parse
from common.files import atomic_path, write_jsonl_atomic
from retrieval.upstream.articles import ArticleStore, ArticleWriter, store_from_kb_rows, store_path_for
from retrieval.upstream.kb import (
    canonical_url,
    evqa_article,
    image_resolver,
    iter_evqa_kb,
    open_upstream,
    qid_map_from_echosight,
    qid_map_from_wiki6m,
    read_entity_map,
    read_upstream_jsonl,
    remap_entity,
    title_images,
    wiki6m_article,
    wiki6m_image_finder,
)
from retrieval.upstream.questions import (
    ImageFinder,
    evqa_questions,
    infoseek_questions,
    parse_subdirs,
    read_csv_rows,
    read_id2name,
    rows_by_id,
)

log = logging.getLogger("refine_rl.convert")
QUESTION_FORMATS = ("evqa-questions", "infoseek-csv", "infoseek")
KB_FORMATS = ("evqa-kb", "wiki6m")
FORMATS = QUESTION_FORMATS + KB_FORMATS + ("articles", "qid-map")


@dataclass
class ConvertArgs:
    format: str = field(default=None, metadata={"help": "one of " + ", ".join(FORMATS)})
    input: str = field(default=None, metadata={"help": "upstream file"})
    out: str = field(default=None, metadata={"help": "file to write (JSONL; .sqlite for articles; .tsv for qid-map)"})
    images_root: str = field(
        default=None,
        metadata={"help": "folder the image paths are relative to; files are checked there (without it, none are)"},
    )
    # questions
    split: str = field(
        default=None,
        metadata={"help": "evqa-questions: the CSV's split (train, val, test); question ids are evqa-<split>-<row>"},
    )
    image_dirs: str = field(
        default="landmarks=landmarks,inaturalist=inaturalist,infoseek=infoseek",
        metadata={"help": "evqa-questions: dataset_name=folder under --images_root, comma-separated"},
    )
    inat_id2name: str = field(
        default=None,
        metadata={
            "help": "evqa-questions: EchoSight's iNaturalist *_id2name.json "
            "(else iNat images are a flat <id>.jpg folder)"
        },
    )
    include_two_hop: bool = field(default=False, metadata={"help": "evqa-questions: keep 2-hop questions"})
    all_images: bool = field(default=False, metadata={"help": "evqa-questions: one record per image, not per question"})
    withkb: str = field(default=None, metadata={"help": "infoseek: the *_withkb.jsonl file carrying entity_id"})
    qtype: str = field(
        default=None, metadata={"help": "infoseek: infoseek_val_qtype.jsonl (question_type per data_id)"}
    )
    image_layout: str = field(default="oven", metadata={"help": "infoseek: oven (<id[-8:-6]>/<id>.jpg) or flat"})
    require_entity: bool = field(
        default=True, metadata={"help": "infoseek: skip rows without an entity (false for test rows, inference only)"}
    )
    entity_map: str = field(
        default=None, metadata={"help": "questions: QID → URL map (.json, .csv, .tsv) applied to entity ids"}
    )
    kb: str = field(
        default=None, metadata={"help": "questions: a KB JSONL or article store to check gold entities against"}
    )
    # KBs
    articles: str = field(
        default=None, metadata={"help": "KB formats: the article store to write (default <out> with .articles.sqlite)"}
    )
    image_map: str = field(
        default=None, metadata={"help": "KB formats: JSON mapping image URL → path under images_root"}
    )
    image_dir: str = field(default=None, metadata={"help": "KB formats: folder of images named <md5(url)>.<ext>"})
    image_csv: str = field(default=None, metadata={"help": "evqa-kb: WikiSeeker/OMGM title-keyed image CSVs (a glob)"})


def validate(args: ConvertArgs) -> None:
    if args.format not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {args.format!r}")
    if not args.input or not args.out:
        raise ValueError("--input and --out are required")
    for name in (
        "input",
        "withkb",
        "qtype",
        "image_map",
        "image_dir",
        "images_root",
        "inat_id2name",
        "entity_map",
        "kb",
    ):
        value = getattr(args, name)
        if value is not None and not Path(value).exists():
            raise ValueError(f"--{name}: {value} does not exist")
    if args.format in ("evqa-questions", "infoseek-csv") and not args.split:
        raise ValueError(f"{args.format} needs --split (train, val or test): question ids carry it")
    if args.format == "infoseek" and args.require_entity and not args.withkb:
        raise ValueError(
            "infoseek needs --withkb (the *_withkb.jsonl file with entity ids), or --require_entity false "
            "to convert rows without entities for inference"
        )
    if args.format == "evqa-kb" and sum(x is not None for x in (args.image_map, args.image_dir, args.image_csv)) != 1:
        raise ValueError("evqa-kb needs exactly one of --image_map, --image_dir, --image_csv to find the image files")
    if args.image_csv and not glob.glob(args.image_csv):
        raise ValueError(f"--image_csv: no file matches {args.image_csv}")
    if args.image_csv and not args.images_root:
        raise ValueError(
            "--image_csv needs --images_root: the CSVs' image paths are relative to it, and only files "
            "that exist there become index rows (as OMGM's and WikiSeeker's loaders keep them)"
        )
    if args.image_layout not in ("oven", "flat"):
        raise ValueError(f"--image_layout must be oven or flat, got {args.image_layout!r}")
    parse_subdirs(args.image_dirs)


# where a skip reason's own details start: a parenthesis, a colon, a quoted value, or a path or URL
REASON_DETAILS = re.compile(r"\s\(|:\s|\s['\"]|\s\S*/")


def reason_kind(reason: str) -> str:
    """A skip reason without its details (the file, URL, value or hint), for the summary's counts."""
    return REASON_DETAILS.split(reason, maxsplit=1)[0].strip() or reason


@contextmanager
def skip_log(out: str):
    """A ``skip(record)`` callable streaming to ``<out>.skipped.jsonl`` (written atomically; removed when empty)."""
    path = Path(f"{out}.skipped.jsonl")
    counts: Counter = Counter()
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:

        def skip(rec: dict):
            counts[reason_kind(rec["reason"])] += 1
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")

        yield skip, counts
    if not sum(counts.values()):
        path.unlink()


class KBEntities:
    """Membership of entity ids in a KB's index rows: a KB JSONL (ids held in a set) or an article store (queried)."""

    def __init__(self, path: str):
        self.path = path
        if path.endswith(".sqlite"):
            self.store, self.ids = ArticleStore(path), None
        else:
            self.store, self.ids = None, {str(r["entity_id"]) for r in read_upstream_jsonl(path)}

    def __contains__(self, entity) -> bool:
        if self.ids is not None:
            return str(entity) in self.ids
        return (
            self.store.db.execute("SELECT 1 FROM entries WHERE entity_id=? LIMIT 1", (str(entity),)).fetchone()
            is not None
        )

    def canonical_keys(self) -> dict[str, str]:
        keys = (
            self.ids
            if self.ids is not None
            else (r[0] for r in self.store.db.execute("SELECT DISTINCT entity_id FROM entries"))
        )
        return {canonical_url(k): k for k in keys}


def convert_questions(args: ConvertArgs, skip) -> list[dict]:
    find = ImageFinder(args.images_root, parse_subdirs(args.image_dirs))
    if not args.images_root:
        log.warning("no --images_root: image files are not checked, the first candidate path is written")
    if args.format == "infoseek":
        withkb = rows_by_id(read_upstream_jsonl(args.withkb), "entity_id", args.withkb) if args.withkb else {}
        qtype = rows_by_id(read_upstream_jsonl(args.qtype), "question_type", args.qtype) if args.qtype else {}
        rows = infoseek_questions(
            read_upstream_jsonl(args.input),
            find,
            skip,
            withkb=withkb,
            layout=args.image_layout,
            qtype_of={k: v["question_type"] for k, v in qtype.items()},
            require_entity=args.require_entity,
        )
    else:
        id2name = read_id2name(args.inat_id2name) if args.inat_id2name else None
        rows = evqa_questions(
            read_csv_rows(args.input),
            find,
            skip,
            split=args.split,
            include_two_hop=args.include_two_hop,
            all_images=args.all_images,
            inat_id2name=id2name,
        )
    records = list(tqdm(rows, desc=f"{args.format} questions", unit="q"))
    kb = KBEntities(args.kb) if args.kb else None
    if args.entity_map:
        mapping = read_entity_map(args.entity_map)
        keys = kb.canonical_keys() if kb is not None else None
        for r in records:
            r["entity_id"] = remap_entity(r["entity_id"], mapping, keys)
    if kb is not None:
        report_absent(records, kb, args.out)
    return records


def report_absent(records: list[dict], kb: KBEntities, out: str) -> list[dict]:
    """List questions whose gold entity (every hop) has no row in the KB to ``<out>.absent.jsonl`` and say how many."""
    absent = []
    for r in records:
        golds = r["entity_id"] if isinstance(r["entity_id"], list) else [r["entity_id"]]
        missing = [g for g in golds if g is not None and g not in kb]
        if missing:
            absent.append({"id": r["id"], "entity_id": missing})
    path = Path(f"{out}.absent.jsonl")
    if absent:
        write_jsonl_atomic(path, absent)
    elif path.exists():
        path.unlink()
    entities = {e for a in absent for e in a["entity_id"]}
    print(
        f"KB check against {kb.path}: {len(absent)} of {len(records)} questions have a gold entity the KB has no "
        f"row for ({len(entities)} distinct entities)" + (f", listed in {path}" if absent else "")
    )
    return absent


def convert_kb(args: ConvertArgs, skip) -> int:
    """Stream an upstream KB into index rows (``--out``) and the article store (``--articles``)."""
    articles_path = args.articles or store_path_for(args.out)
    mapping = read_json_object(args.image_map, "image_map") if args.image_map else None
    if args.format == "evqa-kb":
        resolve = image_resolver(mapping, args.image_dir) if not args.image_csv else None
        titled = title_images(sorted(glob.glob(args.image_csv)), args.images_root, skip) if args.image_csv else None
        pairs = (evqa_article(url, art, resolve, skip, titled) for url, art in iter_evqa_kb(args.input))
    else:
        resolve = image_resolver(mapping, args.image_dir) if (mapping or args.image_dir) else None
        find = wiki6m_image_finder(args.images_root, resolve)
        pairs = (wiki6m_article(row, find, skip) for row in read_upstream_jsonl(args.input))
    n = 0
    # the store is finished (its last rows, its index, the rename) before the rows go in place: a KB JSONL is never
    # there without its whole store, which the pipeline would otherwise rebuild from the rows alone
    with atomic_path(args.out) as tmp, ArticleWriter(articles_path) as store, open(tmp, "w", encoding="utf-8") as f:
        for article, rows in tqdm(pairs, desc=f"{args.format} articles", unit="article"):
            store.add_article(article["entity_id"], article["title"], article["url"], article["sections"])
            for row in rows:
                store.add_entry(row["entry_id"], row["entity_id"], row["section"], row["image"])
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                n += 1
    c = store.counts
    print(
        f"article store {articles_path}: {c['articles']} articles, {c['sections']} sections, {c['entries']} index rows"
    )
    return n


def read_json_object(path: str, flag: str) -> dict:
    with open_upstream(path) as (f, _):
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"--{flag}: {path} is not a JSON object")
    return data


def is_csv(path: str) -> bool:
    return Path(path).name.lower().removesuffix(".gz").endswith(".csv")


def convert_qid_map(args: ConvertArgs, log) -> int:
    """QID → URL pairs to a TSV; an input that yields none is an error naming why, and nothing is written."""
    if is_csv(args.input):
        if not args.withkb:
            raise ValueError("qid-map from an EchoSight CSV needs --withkb (the InfoSeek *_withkb.jsonl file)")
        pairs = qid_map_from_echosight(
            read_csv_rows(args.input), rows_by_id(read_upstream_jsonl(args.withkb), "entity_id", args.withkb)
        )
        none = (
            f"no data_id of {args.input} is in {args.withkb} with a wikipedia_url to map to: pass the withkb file "
            "of the same split (infoseek_train_filtered.csv ↔ infoseek_train_withkb.jsonl, "
            "infoseek_test_filtered.csv ↔ infoseek_val_withkb.jsonl)"
        )
    else:
        pairs = qid_map_from_wiki6m(read_upstream_jsonl(args.input))
        none = f"no row of {args.input} has both wikidata_id and wikipedia_title (is it Wiki6M?)"
    n = 0
    with atomic_path(args.out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for qid, url in tqdm(pairs, desc="qid-map", unit="pair"):
            f.write(f"{qid}\t{url}\n")
            n += 1
        if n == 0:
            raise ValueError(f"qid-map: {none}; nothing written to {args.out}")
    log(f"wrote {n} QID → URL pairs to {args.out}")
    return n


def convert(args: ConvertArgs, log=print) -> int:
    validate(args)
    if args.format == "articles":
        counts = store_from_kb_rows(read_upstream_jsonl(args.input), args.out)
        log(
            f"wrote {args.out}: {counts['articles']} articles, {counts['sections']} sections, "
            f"{counts['entries']} index rows"
        )
        return counts["entries"]
    if args.format == "qid-map":
        return convert_qid_map(args, log)
    with skip_log(args.out) as (skip, counts):
        if args.format in KB_FORMATS:
            n = convert_kb(args, skip)
        else:
            n = write_jsonl_atomic(args.out, convert_questions(args, skip))
    skipped = sum(counts.values())
    why = "; ".join(f"{k}: {v}" for k, v in counts.most_common(5))
    log(
        f"wrote {n} records to {args.out}"
        + (f"; {skipped} skipped ({why}), listed in {args.out}.skipped.jsonl" if skipped else "; nothing skipped")
    )
    return n


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    (args,) = parse((ConvertArgs,), argv, description=__doc__)
    convert(args)


if __name__ == "__main__":
    from common.cli import run

    run(main)
