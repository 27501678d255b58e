"""The toy world: deterministic, well-formed, and calibrated so that stating attributes helps retrieval."""

import hashlib
import json

import numpy as np
import pytest

from toy.calibration import bucket_histogram, median_rank
from toy.drawing import ATTRIBUTES
from toy.world import ToyWorldArgs, build, generate, make_entities, sections, world_args


def digest(folder):
    h = hashlib.sha256()
    for name in ["kb.jsonl", "train.jsonl", "val.jsonl", "test.jsonl", "entities.jsonl"]:
        h.update((folder / name).read_bytes())
    for p in sorted((folder / "images").iterdir())[:20]:
        h.update(p.read_bytes())
    return h.hexdigest()


def test_generation_is_deterministic(tmp_path):
    for name in "ab":
        generate(
            ToyWorldArgs(out=str(tmp_path / name), entities=12, train_images=1, test_images=1), log=lambda *a: None
        )
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    generate(
        ToyWorldArgs(out=str(tmp_path / "c"), entities=12, train_images=1, test_images=1, seed=1), log=lambda *a: None
    )
    assert digest(tmp_path / "a") != digest(tmp_path / "c")


def test_world_records_are_well_formed(tiny_world):
    entities = {e["entity_id"]: e for e in map(json.loads, open(tiny_world / "entities.jsonl", encoding="utf-8"))}
    assert len(entities) == 24
    assert len({(e["colour"], e["shape"], e["pattern"]) for e in entities.values()}) == 24  # unique identities
    assert len({e["name"] for e in entities.values()}) == 24
    train = [json.loads(x) for x in open(tiny_world / "train.jsonl", encoding="utf-8")]
    test = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")]
    val = [json.loads(x) for x in open(tiny_world / "val.jsonl", encoding="utf-8")]
    assert len(val) == 24 and len(test) == 48
    assert not {q["image"] for q in train} & {q["image"] for q in test + val}  # held-out image variants
    for q in train + test:
        e = entities[q["entity_id"]]
        assert (tiny_world / q["image"]).is_file()
        assert q["attributes"] == {a: e[a] for a in ATTRIBUTES}
        assert e["name"] not in q["question"] and not any(e[a] in q["question"] for a in ATTRIBUTES)
        assert q["answers"] and q["answers"][0] == e[q["question_type"]]
    for r in map(json.loads, open(tiny_world / "kb.jsonl", encoding="utf-8")):
        e = entities[r["entity_id"]]
        assert all(e[a] in r["text"] for a in ATTRIBUTES) and e["name"] in r["text"]


def test_sections_state_attributes_plainly():
    e = make_entities(1, 0)[0]
    texts = [t for _, t in sections(e)]
    assert all(f"a {e['colour']} {e['pattern']} {e['shape']}" in t for t in texts)
    assert any(e["habitat"] in t for t in texts) and any(e["diet"] in t for t in texts)


def test_too_many_entities_is_refused():
    with pytest.raises(ValueError, match="--entities"):
        make_entities(1000, 0)


def test_bucket_histogram_and_median():
    hist = bucket_histogram([1, 5, 6, 15, 30, 200, 201, None])
    assert hist == pytest.approx({"1-5": 2 / 8, "6-10": 1 / 8, "11-20": 1 / 8, "21-200": 2 / 8, "miss": 2 / 8})
    assert median_rank([1, None, 3], depth=200) == 3 and median_rank([None, None], 10) == 11


def test_default_world_calibration_holds(tmp_path):
    """The default world with the tiny image encoder and real MiniLM has the properties a refiner needs."""
    rep = build(ToyWorldArgs(out=str(tmp_path / "w"), train_images=0), log=lambda *a: None)
    assert rep["entities"] == 180 and rep["questions"] == 360
    assert all(rep["checks"].values()), rep["checks"]
    med = rep["median_rank_by_correct_attributes"]
    assert med[3] <= 2 and med[0] >= 20
    assert rep["original_buckets"]["1-5"] < 0.3  # the vague question alone rarely finds the entity
    assert np.isclose(sum(rep["original_buckets"].values()), 1.0)
    assert json.loads((tmp_path / "w" / "calibration.json").read_text())["checks"] == rep["checks"]


def test_the_embedded_default_keeps_a_world_already_generated(tmp_path, tiny_world):
    """rl/train_grpo.py --toy_world DIR builds with world_args: the settings of the world in DIR, the defaults for a
    folder without one, and the defaults again for a world from an older generator (which is then regenerated)."""
    kept = world_args(str(tiny_world), alpha=0.4)
    recorded = json.loads((tiny_world / "world.json").read_text())["settings"]
    assert (kept.entities, kept.train_images, kept.test_images, kept.alpha) == (24, 2, 2, 0.4)
    assert {k: getattr(kept, k) for k in recorded if k != "version"} == {
        k: v for k, v in recorded.items() if k != "version"
    }
    assert world_args(str(tmp_path / "none"), alpha=0.3) == ToyWorldArgs(out=str(tmp_path / "none"), alpha=0.3)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "world.json").write_text(json.dumps({"settings": {**recorded, "version": -1}}))
    assert world_args(str(tmp_path / "old"), alpha=0.3).entities == 180
