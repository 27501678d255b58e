"""Crash-sensitive writes and waits outside the files other tests own: a job killed mid-write leaves nothing a rerun
takes for finished work, and a wait on another process or a server ends, naming what it waited for."""

import hashlib

import pytest

import toy.world
from toy.world import ToyWorldArgs, generate


def world_digest(folder):
    h = hashlib.sha256()
    for name in ["kb.jsonl", "train.jsonl", "val.jsonl", "test.jsonl", "entities.jsonl"]:
        h.update((folder / name).read_bytes())
    for p in sorted((folder / "images").iterdir()):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def test_a_world_regenerated_and_killed_midway_is_not_taken_for_the_old_one(tmp_path, monkeypatch):
    """A toy world regenerated in place under other settings kept the old ``world.json`` (its finished mark) until
    the end: killed after the new KB was written, the folder held the new world's files under the old world's mark,
    and a rerun with the old settings said "already generated" and kept the mix."""
    quiet = lambda *a: None  # noqa: E731
    small = dict(entities=6, kb_images=1, train_images=1, val_images=1, test_images=1)
    generate(ToyWorldArgs(out=str(tmp_path / "fresh"), **small), log=quiet)
    out = tmp_path / "world"
    generate(ToyWorldArgs(out=str(out), **small), log=quiet)

    def killed(*a, **k):
        raise KeyboardInterrupt  # the kill, after the new KB rows and images are on disk

    with monkeypatch.context() as m:
        m.setattr(toy.world, "store_from_kb_rows", killed)
        with pytest.raises(KeyboardInterrupt):
            generate(ToyWorldArgs(out=str(out), **small, seed=1), log=quiet)
    said = []
    world = generate(ToyWorldArgs(out=str(out), **small), log=said.append)
    assert world.get("generated_now") and said[-1] != f"toy world in {out} already generated"
    assert world_digest(out) == world_digest(tmp_path / "fresh")
