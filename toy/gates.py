"""The toy world's gate data: questions some of which a small VLM can answer alone, and a tiny VLM to train.

    python -m toy.gates --world outputs/toyworld --out outputs/gate [--vision_from outputs/refiner]

In the toy world, what a creature looks like is in the image (its colour, shape and pattern) but where it lives,
what it eats and what it is called are only in the knowledge base. The gate questions mix both on the same held-out
images: the world's own habitat/diet/name questions, and one attribute question per image ("What colour is this
creature?"). A tiny VLM (the "answerer") is taught the attribute questions and to read answers out of a retrieved
section, never the facts themselves — so it knows the attributes it can see (as well as its eyes allow: shape is the
hardest), and must search for the rest. That is the knowledge boundary the gates learn.

Writes OUT/questions.jsonl (train + test gate questions, with ``split``; the test ones also in
OUT/questions.test.jsonl, the pipeline's toy queries), OUT/answer.{train,test}.jsonl (the
answerer's SFT rows: attribute questions, and knowledge questions with the gold section as context) and
OUT/toy-vlm/ (a tiny Qwen2.5-VL whose tokenizer has every gate verbaliser as one token, with the vision tower of
``--vision_from`` when given).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.cli import parse, require_file
from common.files import read_jsonl, write_jsonl_atomic
from gate.pipeline.context import section_text
from gate.train.render import class_balance, format_balance, render_rows
from gate.variants import VARIANTS
from toy.refiner import tokenizer_corpus
from toy.tiny_vlm import build_tiny_vlm

ATTRIBUTE_QUESTIONS = {
    "colour": "What colour is this creature?",
    "shape": "What shape is this creature?",
    "pattern": "What pattern does this creature have?",
}


@dataclass
class GateToyArgs:
    world: str = field(default="outputs/toyworld", metadata={"help": "toy world folder (toy.world)"})
    out: str = field(default="outputs/gate", metadata={"help": "output folder"})
    train_images: int = field(default=600, metadata={"help": "train-split images to ask about (2 questions each)"})
    test_images: int = field(default=360, metadata={"help": "test-split images to ask about (2 questions each)"})
    vision_from: str = field(default=None, metadata={"help": "tiny VLM folder whose vision tower is copied in"})
    seed: int = field(default=0, metadata={"help": "seed for choosing images"})


def gate_questions(world_rows: list[dict], n: int, seed: int) -> list[dict]:
    """For ``n`` seeded world questions: the question itself (knowledge) and one attribute question on its image
    (attributes in turn), each with its gold answers."""
    rng = np.random.default_rng(seed)
    chosen = [world_rows[i] for i in sorted(rng.permutation(len(world_rows))[:n])]
    out = []
    for i, r in enumerate(chosen):
        out.append({**r, "kind": "knowledge"})
        attr = list(ATTRIBUTE_QUESTIONS)[i % len(ATTRIBUTE_QUESTIONS)]
        out.append(
            {
                **r,
                "id": f"{r['id']}-{attr}",
                "question": ATTRIBUTE_QUESTIONS[attr],
                "answers": [r["attributes"][attr]],
                "question_type": attr,
                "kind": "attribute",
            }
        )
    return out


def answerer_rows(questions: list[dict], world: Path, sections: dict[str, dict[str, dict]]) -> list[dict]:
    """The answerer's labelled rows: attribute questions as they are, knowledge questions with the gold entity's
    section as context (the one that answers them)."""
    rows = []
    for q in questions:
        rec = {**q, "image_path": str((world / q["image"]).resolve())}
        if q["kind"] == "knowledge":
            by_title = sections[q["entity_id"]]
            rec["context"] = section_text(
                by_title.get("Diet" if q["question_type"] == "diet" else "Habitat") or next(iter(by_title.values()))
            )
        rows.append(rec)
    return rows


def toy_vlm_corpus(world: Path) -> list[str]:
    texts = tokenizer_corpus(world) + [s["system"] for s in VARIANTS.values()]
    return texts + list(ATTRIBUTE_QUESTIONS.values()) * 20 + ["Context: Question:"] * 20


def build_toy_vlm(out: Path, world: Path, vision_from=None) -> Path:
    """A tiny Qwen2.5-VL whose tokenizer knows the world's words and has every gate verbaliser as one token."""
    verbalisers = sorted({v for s in VARIANTS.values() for v in s["verbalisers"]})
    return build_tiny_vlm(out, toy_vlm_corpus(world), extra_tokens=verbalisers, vision_from=vision_from)


def build(args: GateToyArgs, log=print) -> dict:
    world, out = Path(args.world), Path(args.out)
    for name in ("train.jsonl", "test.jsonl", "kb.jsonl"):
        require_file(world / name, "world")
    if args.vision_from and not (Path(args.vision_from) / "config.json").is_file():
        raise ValueError(f"--vision_from: {args.vision_from} has no config.json")
    sections: dict[str, dict[str, dict]] = {}
    for e in read_jsonl(world / "kb.jsonl"):
        sections.setdefault(e["entity_id"], {}).setdefault(e["section_title"], e)
    questions = []
    for split, n in (("train", args.train_images), ("test", args.test_images)):
        qs = gate_questions(list(read_jsonl(world / f"{split}.jsonl")), n, args.seed)
        questions += qs
        rows = render_rows("answer", answerer_rows(qs, world, sections))
        write_jsonl_atomic(out / f"answer.{split}.jsonl", rows)
        log(f"answerer {split}: {len(rows)} rows; {format_balance(class_balance(rows))}")
    write_jsonl_atomic(out / "questions.jsonl", questions)
    write_jsonl_atomic(out / "questions.test.jsonl", [q for q in questions if q["split"] == "test"])
    vlm = build_toy_vlm(out / "toy-vlm", world, args.vision_from)
    log(f"{len(questions)} gate questions → {out / 'questions.jsonl'}; toy VLM → {vlm}")
    return {"questions": len(questions), "vlm": str(vlm)}


def main(argv=None) -> None:
    (args,) = parse((GateToyArgs,), argv, description=__doc__)
    build(args)


if __name__ == "__main__":
    from common.cli import run

    run(main)
