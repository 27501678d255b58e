"""Convert upstream KB-VQA data into canonical KB / question JSONL.

    python -m retrieval.convert --format evqa-kb --input encyclopedic_kb_wiki.json --out kb.jsonl \
        [--image_map url_to_file.json | --image_dir DIR_OF_<md5(url)>.jpg]
    python -m retrieval.convert --format infoseek --input infoseek_val.jsonl --withkb infoseek_val_withkb.jsonl \
        --out questions.jsonl [--image_pattern "{image_id}.jpg"]
    python -m retrieval.convert --format evqa-questions --input test.csv --split test --out questions.jsonl \
        [--image_pattern "{dataset_name}/{image_id}.jpg"] [--include_two_hop] [--all_images]

Rows that cannot be converted (an image with no local file, a question without an entity) are listed in
``<out>.skipped.jsonl`` and counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from retrieval.files import read_jsonl, write_jsonl_atomic
from retrieval.kb import evqa_kb_entries, evqa_questions, image_resolver, infoseek_questions, read_csv_rows

FORMATS = ("evqa-kb", "infoseek", "evqa-questions")


@dataclass
class ConvertArgs:
    format: str = field(default=None, metadata={"help": "one of " + ", ".join(FORMATS)})
    input: str = field(default=None, metadata={"help": "upstream file"})
    out: str = field(default=None, metadata={"help": "canonical JSONL to write"})
    withkb: str = field(default=None, metadata={"help": "infoseek: the *_withkb.jsonl file carrying entity_id"})
    image_map: str = field(default=None, metadata={"help": "evqa-kb: JSON mapping image URL → local path"})
    image_dir: str = field(default=None, metadata={"help": "evqa-kb: folder of images named <md5(url)>.<ext>"})
    image_pattern: str = field(default=None, metadata={"help": "questions: image path pattern over the row's fields"})
    include_two_hop: bool = field(default=False, metadata={"help": "evqa-questions: keep 2-hop questions"})
    all_images: bool = field(default=False, metadata={"help": "evqa-questions: one record per image, not per question"})
    split: str = field(default=None, metadata={"help": "evqa-questions: the CSV's split (train, val, test); "
                                                        "question ids are evqa-<split>-<row>"})


def convert(args: ConvertArgs, log=print) -> int:
    if args.format not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {args.format!r}")
    for name in ("input", "withkb", "image_map", "image_dir"):
        value = getattr(args, name)
        if value is not None and not Path(value).exists():
            raise ValueError(f"--{name}: {value} does not exist")
    if not args.input or not args.out:
        raise ValueError("--input and --out are required")
    skipped: list[dict] = []
    if args.format == "evqa-kb":
        if not args.image_map and not args.image_dir:
            raise ValueError("evqa-kb needs --image_map or --image_dir to find the image files")
        kb = json.loads(Path(args.input).read_text())
        if not isinstance(kb, dict):
            raise ValueError(f"{args.input}: expected a JSON object keyed by Wikipedia URL")
        mapping = json.loads(Path(args.image_map).read_text()) if args.image_map else None
        records = evqa_kb_entries(kb, image_resolver(mapping, args.image_dir), skipped)
    elif args.format == "infoseek":
        if not args.withkb:
            raise ValueError("infoseek needs --withkb (the *_withkb.jsonl file with entity ids)")
        records = infoseek_questions(read_jsonl(args.input), read_jsonl(args.withkb),
                                     args.image_pattern or "{image_id}.jpg", skipped)
    else:
        if not args.split:
            raise ValueError("evqa-questions needs --split (train, val or test): question ids carry it")
        records = evqa_questions(read_csv_rows(args.input), args.image_pattern or "{dataset_name}/{image_id}.jpg",
                                 include_two_hop=args.include_two_hop, all_images=args.all_images, split=args.split)
    n = write_jsonl_atomic(args.out, records)
    if skipped:
        write_jsonl_atomic(f"{args.out}.skipped.jsonl", skipped)
    log(f"wrote {n} records to {args.out}" + (f"; {len(skipped)} skipped, listed in {args.out}.skipped.jsonl"
                                              if skipped else ""))
    return n


def main(argv=None) -> None:
    from retrieval.cli import parse

    (args,) = parse((ConvertArgs,), argv, description=__doc__)
    convert(args)


if __name__ == "__main__":
    from retrieval.cli import run

    run(main)
