"""A procedurally generated, deterministic KB-VQA world for the embedded default and the tests.

    python -m toy.world --out DIR [--entities 180] [--seed 0] [--alpha 0.3]

Each entity is a made-up creature with a name, a habitat and a diet, and a visual identity made of three
attributes from small closed sets (colour × shape × white pattern) that a tiny vision model reads quickly and the
real MiniLM text encoder understands as words. Images are 56 px drawings with jittered position, size, colour,
noise and a distractor blob. KB sections say the attributes in plain words. Questions are vague ("Where does this
creature live?") on held-out image variants; they carry the gold entity, answers and gold attributes.

Writes DIR/{kb,train,val,test,entities}.jsonl, DIR/images/, DIR/index/ (built with the chosen encoders) and
DIR/calibration.json: where original questions rank (the paper's reward tiers), and how much stating the
attributes helps — the properties a refiner needs to be able to learn from retrieval reward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from common.cli import parse
from common.files import file_fingerprint, read_json, write_json_atomic, write_jsonl_atomic
from retrieval.build_index import BuildArgs, build_index
from retrieval.encoder_names import check_image_encoder_name, check_text_encoder_name
from retrieval.index import MultimodalIndex
from retrieval.ranking import check_alpha
from retrieval.upstream.articles import store_from_kb_rows, store_path_for
from toy.calibration import calibrate, format_report
from toy.drawing import ATTRIBUTES, COLOURS, PATTERNS, SHAPES, render

HABITATS = [
    "mossy caves",
    "salt marshes",
    "pine forests",
    "coral reefs",
    "desert dunes",
    "river deltas",
    "mountain cliffs",
    "bamboo groves",
    "frozen tundra",
    "volcanic slopes",
    "mangrove swamps",
    "open grasslands",
]
DIETS = ["beetles", "seaweed", "berries", "small fish", "tree bark", "mushrooms", "nectar", "seeds", "snails", "algae"]
SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "zu",
    "ren",
    "tal",
    "vor",
    "shi",
    "bel",
    "dro",
    "fen",
    "gil",
    "nax",
    "pim",
    "qua",
    "sol",
    "tev",
    "ul",
    "wyn",
    "yor",
    "bri",
    "cas",
    "dun",
    "eth",
    "hol",
    "jor",
    "kel",
    "mur",
    "ost",
    "rag",
]
QUESTIONS = {
    "habitat": "Where does this creature live?",
    "diet": "What does this creature eat?",
    "name": "What is this creature called?",
}
WORLD_VERSION = 3  # bump when the drawing (toy/drawing.py) or wording changes, so existing worlds are regenerated


@dataclass
class ToyWorldArgs:
    out: str = field(default="outputs/toyworld", metadata={"help": "folder to write the world into"})
    entities: int = field(
        default=180, metadata={"help": f"number of entities (≤ {len(COLOURS) * len(SHAPES) * len(PATTERNS)})"}
    )
    seed: int = field(default=0, metadata={"help": "world seed"})
    kb_images: int = field(default=2, metadata={"help": "KB images per entity"})
    train_images: int = field(default=20, metadata={"help": "train question images per entity"})
    val_images: int = field(
        default=1, metadata={"help": "validation question images per entity (checkpoint selection)"}
    )
    test_images: int = field(default=2, metadata={"help": "held-out test question images per entity"})
    noise: float = field(default=8.0, metadata={"help": "pixel noise σ"})
    alpha: float = field(default=0.3, metadata={"help": "α used to calibrate the world (the embedded default's α)"})
    image_encoder: str = field(default="tiny", metadata={"help": "image encoder for the world's index"})
    text_encoder: str = field(default="minilm", metadata={"help": "text encoder for the world's index"})
    depth: int = field(default=200, metadata={"help": "rank depth for the calibration"})
    skip_index: bool = field(default=False, metadata={"help": "only write the data, build no index"})


# --------------------------------------------------------------------------- entities and text


def make_entities(n: int, seed: int) -> list[dict]:
    combos = [(c, s, p) for c in COLOURS for s in SHAPES for p in PATTERNS]
    if not 1 <= n <= len(combos):
        raise ValueError(f"--entities must be between 1 and {len(combos)} (one per attribute combination), got {n}")
    rng = np.random.default_rng(seed)
    chosen = [combos[i] for i in rng.permutation(len(combos))[:n]]
    names: set[str] = set()
    entities = []
    for i, (colour, shape, pattern) in enumerate(chosen):
        while True:
            name = "".join(rng.choice(SYLLABLES, size=int(rng.integers(2, 4)))).capitalize()
            if name not in names:
                names.add(name)
                break
        entities.append(
            dict(
                entity_id=f"E{i:04d}",
                name=name,
                colour=colour,
                shape=shape,
                pattern=pattern,
                habitat=str(rng.choice(HABITATS)),
                diet=str(rng.choice(DIETS)),
                category="creature",
            )
        )
    return entities


def describe(e: dict) -> str:
    return f"The {e['name']} is a {e['colour']} {e['pattern']} {e['shape']}."


def sections(e: dict) -> list[tuple[str, str]]:
    head = describe(e)
    return [
        ("Habitat", f"{head} This {e['colour']} {e['shape']} creature lives in the {e['habitat']}."),
        ("Diet", f"{head} This {e['colour']} {e['shape']} creature eats {e['diet']}."),
    ]


def answers_for(e: dict, qtype: str) -> list[str]:
    return [e[qtype]]


def attribute_words(attrs: dict, keys=ATTRIBUTES) -> str:
    """The attribute words in a fixed order, e.g. 'red star striped'."""
    return " ".join(attrs[k] for k in keys)


# --------------------------------------------------------------------------- world files


def generate(args: ToyWorldArgs, log=print) -> dict:
    """Write the world's data files (idempotent: an existing world with the same settings is kept)."""
    out = Path(args.out)
    settings = {
        k: getattr(args, k)
        for k in ("entities", "seed", "kb_images", "train_images", "val_images", "test_images", "noise")
    }
    settings["version"] = WORLD_VERSION
    world_file = out / "world.json"
    done = read_json(world_file) if world_file.exists() else {}
    if done.get("settings") == settings:
        log(f"toy world in {out} already generated")
        return done

    t0 = time.perf_counter()
    entities = make_entities(args.entities, args.seed)
    world_file.unlink(missing_ok=True)  # an older world's mark goes first: a run killed below leaves no world done
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed + 1)
    kb, questions = [], {"train": [], "val": [], "test": []}
    qtypes = list(QUESTIONS)
    for e in tqdm(entities, desc="toy world", unit="entity"):
        eid = e["entity_id"]
        for j in range(args.kb_images):
            image = f"images/{eid}_kb{j}.png"
            render(e, rng, args.noise).save(out / image)
            for k, (title, text) in enumerate(sections(e)):
                kb.append(
                    dict(
                        entry_id=f"{eid}-img{j}-sec{k}",
                        entity_id=eid,
                        title=e["name"],
                        section_title=title,
                        text=text,
                        image=image,
                    )
                )
        for split, n in (("train", args.train_images), ("val", args.val_images), ("test", args.test_images)):
            for j in range(n):
                image = f"images/{eid}_{split}{j}.png"
                render(e, rng, args.noise).save(out / image)
                qtype = qtypes[int(rng.integers(len(qtypes)))]
                questions[split].append(
                    dict(
                        id=f"{eid}-{split}{j}",
                        image=image,
                        question=QUESTIONS[qtype],
                        entity_id=eid,
                        answers=answers_for(e, qtype),
                        question_type=qtype,
                        split=split,
                        attributes={a: e[a] for a in ATTRIBUTES},
                    )
                )
    write_jsonl_atomic(out / "entities.jsonl", entities)
    write_jsonl_atomic(out / "kb.jsonl", kb)
    store_from_kb_rows(kb, store_path_for(out / "kb.jsonl"))  # the same canonical path as a converted KB
    for split, rows in questions.items():
        write_jsonl_atomic(out / f"{split}.jsonl", rows)
    world = {
        "settings": settings,
        "entities": len(entities),
        "kb_rows": len(kb),
        **{f"{split}_questions": len(rows) for split, rows in questions.items()},
    }
    write_json_atomic(world_file, world)  # last: marks the world complete
    world["generated_now"] = True
    log(
        f"toy world: {len(entities)} entities, {len(kb)} KB rows, {len(questions['train'])} train / "
        f"{len(questions['val'])} val / {len(questions['test'])} test questions in {out} "
        f"({time.perf_counter() - t0:.0f} s)"
    )
    return world


def build(args: ToyWorldArgs, log=print) -> dict:
    """Generate the world, build its index and calibrate it; returns the calibration report (or {})."""
    check_alpha(args.alpha)
    check_image_encoder_name(args.image_encoder)
    check_text_encoder_name(args.text_encoder)
    out = Path(args.out)
    fresh = generate(args, log=log).get("generated_now", False)
    if args.skip_index:
        return {}
    index_dir = out / "index"
    build_index(
        BuildArgs(
            kb=str(out / "kb.jsonl"),
            out=str(index_dir),
            images_root=str(out),
            image_encoder=args.image_encoder,
            text_encoder=args.text_encoder,
            factory="Flat",
            device="cpu",
            overwrite=fresh or _index_stale(index_dir, args),
        ),
        log=log,
    )
    built = read_json(index_dir / "manifest.json")["created"]
    previous = out / "calibration.json"
    if previous.exists():
        report = read_json(previous)
        if (report.get("index_created"), report.get("alpha"), report.get("depth")) == (built, args.alpha, args.depth):
            report["median_rank_by_correct_attributes"] = {
                int(k): v for k, v in report["median_rank_by_correct_attributes"].items()
            }
            log(format_report(report))
            return report
    index = MultimodalIndex.load(index_dir, device="cpu")
    report = calibrate(index, out, args.alpha, args.depth, args.seed)
    report["index_created"] = built
    write_json_atomic(out / "calibration.json", report)
    log(format_report(report))
    return report


def world_args(out: str, alpha: float) -> ToyWorldArgs:
    """The settings of the world already generated in ``out`` (kept as it is), or the defaults for a folder with none
    (or with a world from an older generator, which is regenerated)."""
    world_file = Path(out) / "world.json"
    settings = read_json(world_file).get("settings", {}) if world_file.exists() else {}
    if settings.get("version") != WORLD_VERSION:
        return ToyWorldArgs(out=str(out), alpha=alpha)
    return ToyWorldArgs(out=str(out), alpha=alpha, **{k: v for k, v in settings.items() if k != "version"})


def _index_stale(index_dir: Path, args: ToyWorldArgs) -> bool:
    """An index from other encoders (or a regenerated world) is rebuilt rather than refused."""
    manifest = index_dir / "manifest.json"
    if not manifest.exists():
        return False
    m = read_json(manifest)
    return (m.get("image_encoder"), m.get("text_encoder"), m.get("kb_fingerprint")) != (
        args.image_encoder,
        args.text_encoder,
        file_fingerprint(index_dir.parent / "kb.jsonl"),
    )


def main(argv=None) -> None:
    (args,) = parse((ToyWorldArgs,), argv, description=__doc__)
    build(args)


if __name__ == "__main__":
    from common.cli import run

    run(main)
