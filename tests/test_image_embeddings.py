"""Question-image embeddings stored once (rl.image_embeddings) and rl.data's resumable baseline retrieval; the
trainer without an image encoder when every image has a stored embedding."""

import json
import shutil

import numpy as np
import pytest

from common.files import read_jsonl, write_jsonl_atomic
from rl.image_embeddings import embed_images, load_store, store_dir

QUIET = dict(log=lambda *a: None)


@pytest.fixture()
def index(tiny_index_dir, encoders):
    from retrieval.index import MultimodalIndex

    return MultimodalIndex.load(tiny_index_dir, *encoders)


class Interrupted(Exception):
    pass


def interrupt_after(index, monkeypatch, calls: int) -> list:
    """``index.encode_image_files`` that raises on call ``calls + 1`` (a crash mid-job); returns the batch sizes it
    encoded."""
    real, seen = type(index).encode_image_files.__get__(index), []

    def encode(paths, *a, **k):
        if len(seen) == calls:
            raise Interrupted
        seen.append(len(paths))
        return real(paths, *a, **k)

    monkeypatch.setattr(index, "encode_image_files", encode)
    return seen


def test_stored_embeddings_are_the_encoders_and_an_interrupted_job_resumes(tiny_world, index, tmp_path, monkeypatch):
    from PIL import Image

    rows = list(read_jsonl(tiny_world / "train.jsonl"))[:10]
    queries = tmp_path / "q.jsonl"
    write_jsonl_atomic(queries, rows)
    images = [r["image"] for r in rows]
    seen = interrupt_after(index, monkeypatch, 2)
    with pytest.raises(Interrupted):
        embed_images(queries, images, tiny_world, index, batch_size=3, **QUIET)
    assert seen == [3, 3] and load_store(queries, index.manifest) == {}  # no store until the job is whole
    seen = interrupt_after(index, monkeypatch, 99)
    folder = embed_images(queries, images, tiny_world, index, batch_size=3, **QUIET)
    assert seen == [3, 1]  # only the 4 images the interrupted job had not done
    stored = load_store(queries, index.manifest)
    assert set(stored) == set(images) and folder == store_dir(queries, index.manifest)
    assert not (folder / "work.jsonl").exists() and json.loads((folder / "manifest.json").read_text())["count"] == 10
    direct = index.encode_images([Image.open(tiny_world / i) for i in images])
    np.testing.assert_allclose(np.stack([stored[i] for i in images]), direct, atol=1e-5)
    interrupt_after(index, monkeypatch, 0)
    embed_images(queries, images, tiny_world, index, **QUIET)  # everything stored: nothing encoded, nothing raised
    (tmp_path / "broken.png").write_bytes(b"not a png")
    interrupt_after(index, monkeypatch, 99)
    embed_images(queries, [*images, str(tmp_path / "broken.png")], tiny_world, index, **QUIET)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["count"] == 10 and list(manifest["unreadable"]) == [str(tmp_path / "broken.png")]
    assert set(load_store(queries, index.manifest)) == set(images)  # the ten kept, the broken one listed
    interrupt_after(index, monkeypatch, 0)  # listed unreadable: not tried again (no encoder built for it)
    embed_images(queries, [*images, str(tmp_path / "broken.png")], tiny_world, index, **QUIET)
    shutil.copy(tiny_world / images[0], tmp_path / "broken.png")  # mended
    seen = interrupt_after(index, monkeypatch, 99)
    embed_images(queries, [*images, str(tmp_path / "broken.png")], tiny_world, index, retry_unreadable=True, **QUIET)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert seen == [1] and manifest["count"] == 11 and manifest["unreadable"] == {}
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["manifest.json", manifest["embeddings_file"], manifest["images_file"]]  # the earlier stores' files gone
    )


def test_a_crash_while_the_store_is_rewritten_leaves_the_old_store_whole(tiny_world, index, tmp_path, monkeypatch):
    import rl.image_embeddings as ie

    rows = list(read_jsonl(tiny_world / "train.jsonl"))[:6]
    images = [r["image"] for r in rows]
    queries = tmp_path / "q.jsonl"
    write_jsonl_atomic(queries, rows)
    embed_images(queries, images[:5], tiny_world, index, **QUIET)
    before = load_store(queries, index.manifest)

    def killed(path, *a, **k):
        raise Interrupted  # after the new data files, before the manifest that names them

    monkeypatch.setattr(ie, "write_json_atomic", killed)
    with pytest.raises(Interrupted):
        embed_images(queries, images, tiny_world, index, **QUIET)
    monkeypatch.undo()
    after = load_store(queries, index.manifest)
    assert set(after) == set(images[:5]) and all(np.array_equal(before[i], after[i]) for i in before)
    seen = interrupt_after(index, monkeypatch, 99)
    embed_images(queries, images, tiny_world, index, **QUIET)
    assert seen == [] and set(load_store(queries, index.manifest)) == set(images)  # the new image from the work file


def test_a_work_file_a_crash_left_beside_a_whole_store_is_removed(tiny_world, index, tmp_path, monkeypatch):
    """Killed after the store's manifest was written, before the work file went: every later run found nothing to
    do and returned, leaving the work file (every embedding again, in base64) for good."""
    rows = list(read_jsonl(tiny_world / "train.jsonl"))[:4]
    queries = tmp_path / "q.jsonl"
    write_jsonl_atomic(queries, rows)
    folder = embed_images(queries, [r["image"] for r in rows], tiny_world, index, **QUIET)
    (folder / "work.jsonl").write_text('{"id": "' + rows[1]["image"] + '", "problem": "left by a crash"}\n{"id": "cu')
    (folder / "work.jsonl.part0").write_text("")
    interrupt_after(index, monkeypatch, 0)  # nothing to encode
    embed_images(queries, [r["image"] for r in rows], tiny_world, index, **QUIET)
    assert not (folder / "work.jsonl").exists() and not list(folder.glob("work.jsonl.part*"))
    assert set(load_store(queries, index.manifest)) == {r["image"] for r in rows}
    # an interrupted run that wanted other images too: its work is kept for it to go on from
    (folder / "work.jsonl.part0").write_text(
        '{"id": "' + rows[0]["image"] + '", "problem": "x"}\n{"id": "new.png", "pr'
    )
    (folder / "work.jsonl.part1").write_text('{"id": "another.png", "problem": "not read"}\n')
    embed_images(queries, [r["image"] for r in rows], tiny_world, index, **QUIET)
    assert (folder / "work.jsonl.part1").exists() and (folder / "work.jsonl.part0").exists()


def test_the_job_loads_the_index_for_its_image_encoder_only(tiny_world, tiny_index_dir, index, tmp_path, monkeypatch):
    """``python -m rl.image_embeddings`` never searches: the FAISS index stays memory-mapped on the CPU (no fp16
    replica beside the image encoder on each GPU), whatever device the encoder runs on."""
    import retrieval.index as ri
    from rl.image_embeddings import main

    rows = list(read_jsonl(tiny_world / "train.jsonl"))[:2]
    write_jsonl_atomic(tmp_path / "q.jsonl", rows)
    loads = []
    monkeypatch.setattr(ri.MultimodalIndex, "load", lambda *a, **k: loads.append(k) or index)
    main(["--queries", str(tmp_path / "q.jsonl"), "--index", str(tiny_index_dir), "--images_root", str(tiny_world)])
    assert [k.get("search_device") for k in loads] == ["cpu"]
    assert set(load_store(tmp_path / "q.jsonl", index.manifest)) == {r["image"] for r in rows}


def test_a_resumed_job_tries_again_what_the_interrupted_one_could_not_read(tiny_world, index, tmp_path, monkeypatch):
    rows = list(read_jsonl(tiny_world / "train.jsonl"))[:2]
    late = str(tmp_path / "late.png")  # not there yet when the first run reaches it
    images = [late, *(r["image"] for r in rows)]
    queries = tmp_path / "q.jsonl"
    write_jsonl_atomic(queries, rows)
    seen = interrupt_after(index, monkeypatch, 1)
    with pytest.raises(Interrupted):
        embed_images(queries, images, tiny_world, index, batch_size=1, **QUIET)
    shutil.copy(tiny_world / rows[0]["image"], late)
    seen = interrupt_after(index, monkeypatch, 99)
    folder = embed_images(queries, images, tiny_world, index, batch_size=1, **QUIET)
    assert seen == [1, 1, 1] and set(load_store(queries, index.manifest)) == set(images)
    assert json.loads((folder / "manifest.json").read_text())["unreadable"] == {}


def test_a_store_of_another_encoder_is_refused(tiny_world, index, tmp_path):
    rows = list(read_jsonl(tiny_world / "train.jsonl"))[:2]
    write_jsonl_atomic(tmp_path / "q.jsonl", rows)
    folder = embed_images(tmp_path / "q.jsonl", [r["image"] for r in rows], tiny_world, index, **QUIET)
    other = {**index.manifest, "image_processor": "another"}
    assert load_store(tmp_path / "q.jsonl", other) == {}  # another encoder's store is another folder
    shutil.copytree(folder, store_dir(tmp_path / "q.jsonl", other))
    with pytest.raises(ValueError, match="but the index uses"):
        load_store(tmp_path / "q.jsonl", other)


def test_rl_data_resumes_its_baseline_retrieval_and_stores_the_sampled_images(
    tiny_world, tiny_index_dir, index, tmp_path, monkeypatch
):
    import retrieval.index as ri
    from rl.data import RLDataArgs, build_rl_data

    monkeypatch.setattr(ri.MultimodalIndex, "load", lambda *a, **k: index)
    args = dict(
        queries=str(tiny_world / "train.jsonl"),
        index=str(tiny_index_dir),
        alpha=0.5,
        seed=1,
        strata="1-5:3,6-24:100",
        batch_size=10,
        images_root=str(tiny_world),
    )
    build_rl_data(RLDataArgs(**args, out=str(tmp_path / "ref.jsonl")), **QUIET)  # uninterrupted
    out = tmp_path / "o.jsonl"
    seen = interrupt_after(index, monkeypatch, 2)
    with pytest.raises(Interrupted):
        build_rl_data(RLDataArgs(**args, out=str(out)), **QUIET)
    assert len(list(read_jsonl(f"{out}.baseline.jsonl.part0"))) == 20 and not out.exists()  # its part file
    with pytest.raises(ValueError, match=r"other settings \(alpha: 0.5 then, 0.7 now\)"):
        build_rl_data(RLDataArgs(**{**args, "alpha": 0.7}, out=str(out)), **QUIET)
    seen = interrupt_after(index, monkeypatch, 99)
    build_rl_data(RLDataArgs(**args, out=str(out)), **QUIET)
    assert seen[:3] == [10, 10, 8]  # 48 questions in batches of 10: the 28 the interrupted run had not ranked
    assert out.read_text() == (tmp_path / "ref.jsonl").read_text()
    assert not list(tmp_path.glob("o.jsonl.baseline*"))
    sampled = list(read_jsonl(out))
    assert set(load_store(out, index.manifest)) == {r["image"] for r in sampled}  # what the trainer will read


def test_the_trainer_builds_no_image_encoder_when_every_image_is_stored(
    config, tiny_world, tiny_index_dir, index, tmp_path, monkeypatch, capsys
):
    """Two one-step runs from the same seed: with every train and eval image stored, the image encoder factory is
    never called (it would raise) and the rewards are those of the run that encoded the images itself."""
    import retrieval.index as ri
    import rl.train_grpo as tg

    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    shutil.copy(tiny_world / "train.jsonl", train)
    write_jsonl_atomic(val, list(read_jsonl(tiny_world / "val.jsonl"))[:4])
    run = dict(
        train_file=str(train),
        eval_file=str(val),
        images_root=str(tiny_world),
        max_steps=1,
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=8,
    )
    encoded = tg.main(config(**run, output_dir=str(tmp_path / "encoded")))
    assert "the image encoder (tiny) is built on every process" in capsys.readouterr().out
    for queries in (train, val):
        embed_images(queries, [r["image"] for r in read_jsonl(queries)], tiny_world, index, **QUIET)

    def no_image_encoder(*a, **k):
        raise AssertionError("the image encoder was built")

    monkeypatch.setattr(ri, "image_encoder", no_image_encoder)
    stored = tg.main(config(**run, output_dir=str(tmp_path / "stored")))
    said = capsys.readouterr().out
    assert "all 52 train/eval images stored" in said and "the image encoder is not built" in said
    keys = ["rewards/retrieval_reward/mean", "retrieval/hit@1", "eval_retrieval/hit@1", "eval_reward"]
    for a, b in zip(encoded["log_history"], stored["log_history"]):
        for k in keys:
            if k in a:
                assert b[k] == pytest.approx(a[k], abs=1e-6), k
    assert sum(k in h for h in stored["log_history"] for k in keys) == 4


class FakeIndex:
    """What embed_images uses of an index: its manifest and ``encode_image_files``, here a vector per file name read
    from the file itself (``unreadable`` files fail), each call recorded."""

    def __init__(self, encoder="fake-clip", processor="proc-a", dim=3):
        self.manifest = {"image_encoder": encoder, "image_processor": processor, "image_dim": dim}
        self.calls = []

    def encode_image_files(self, paths, workers=0):
        self.calls.append([p.name for p in paths])
        texts = [p.read_text() for p in paths]
        failed = {j: f"{paths[j].name}: unreadable" for j, t in enumerate(texts) if t == "unreadable"}
        vectors = [[float(ord(c)) for c in t[:3]] for j, t in enumerate(texts) if j not in failed]
        return np.asarray(vectors, dtype=np.float32).reshape(-1, self.manifest["image_dim"]), failed


def fake_images(root, **contents):
    for name, text in contents.items():
        (root / f"{name}.png").write_text(text)
    return [f"{name}.png" for name in contents]


def test_the_store_keeps_what_it_holds_lists_the_unreadable_and_tries_them_again_only_when_asked(tmp_path):
    from rl.image_embeddings import MANIFEST_FILE, WORK_FILE, store_manifest

    index, queries = FakeIndex(), tmp_path / "q.jsonl"
    names = fake_images(tmp_path, a="abc", b="bcd", c="unreadable")
    folder = embed_images(queries, [*names, "a.png"], tmp_path, index, batch_size=2, **QUIET)
    assert folder == store_dir(queries, index.manifest) and folder.parent.name == "q.jsonl.image-embeddings"
    assert index.calls == [["a.png", "b.png"], ["c.png"]]  # each image once, in batches
    stored = load_store(queries, index.manifest)
    assert sorted(stored) == ["a.png", "b.png"] and stored["b.png"].tolist() == [98.0, 99.0, 100.0]
    meta = store_manifest(queries, index.manifest)
    assert meta["unreadable"] == {"c.png": "c.png: unreadable"} and meta["count"] == 2 and meta["dim"] == 3
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [MANIFEST_FILE, meta["embeddings_file"], meta["images_file"]]
    )
    assert not (folder / WORK_FILE).exists()

    names += fake_images(tmp_path, d="def")
    said = []
    embed_images(queries, names, tmp_path, index, batch_size=2, log=said.append)
    assert index.calls[2:] == [["d.png"]]  # neither what the store holds nor what it lists as unreadable
    assert sorted(load_store(queries, index.manifest)) == ["a.png", "b.png", "d.png"]
    meta = store_manifest(queries, index.manifest)  # the old data files went once the new manifest named others
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [MANIFEST_FILE, meta["embeddings_file"], meta["images_file"]]
    )
    embed_images(queries, names, tmp_path, index, log=said.append)
    assert len(index.calls) == 3
    assert "all 3 readable images already in" in said[-1] and "1 listed unreadable there, not tried again" in said[-1]

    fake_images(tmp_path, c="cde")  # mended
    embed_images(queries, names, tmp_path, index, retry_unreadable=True, **QUIET)
    assert index.calls[3:] == [["c.png"]]
    assert sorted(load_store(queries, index.manifest)) == ["a.png", "b.png", "c.png", "d.png"]
    assert store_manifest(queries, index.manifest)["unreadable"] == {}


def test_a_store_that_does_not_fit_its_manifest_or_the_index_is_refused(tmp_path):
    from rl.image_embeddings import MANIFEST_FILE

    index, queries = FakeIndex(), tmp_path / "q.jsonl"
    embed_images(queries, fake_images(tmp_path, a="abc", b="bcd"), tmp_path, index, **QUIET)
    assert load_store(queries, FakeIndex(processor="proc-b").manifest) == {}  # another processor: another folder
    with pytest.raises(ValueError, match=r"expected \(2, 4\) for its manifest and the index; delete the folder"):
        load_store(queries, FakeIndex(dim=4).manifest | {"image_encoder": "fake-clip"})
    manifest = store_dir(queries, index.manifest) / MANIFEST_FILE
    manifest.write_text(json.dumps(json.loads(manifest.read_text()) | {"count": 3}))
    with pytest.raises(ValueError, match=r"have shape \(2, 3\), expected \(3, 3\)"):
        load_store(queries, index.manifest)
    manifest.write_text(json.dumps(json.loads(manifest.read_text()) | {"image_encoder": "other-clip"}))
    with pytest.raises(ValueError, match="embeddings of 'other-clip' / 'proc-a', but the index uses 'fake-clip'"):
        load_store(queries, index.manifest)


def test_stored_embeddings_fill_the_rewards_cache_under_its_keys(tmp_path):
    from types import SimpleNamespace

    from rl.image_embeddings import image_path_of, preload_reward_cache, stored_image_embeddings

    index = FakeIndex()
    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    embed_images(train, fake_images(tmp_path, a="abc", b="bcd"), tmp_path, index, **QUIET)
    embed_images(evals, fake_images(tmp_path, e="efg"), tmp_path, index, **QUIET)
    path = {n: image_path_of({"image": f"{n}.png"}, tmp_path) for n in "abcef"}
    assert path["a"] == str((tmp_path / "a.png").resolve())
    cache = {f"path:{path['b']}": "kept"}  # already cached: not replaced
    assert (
        preload_reward_cache(cache, train, [path["a"], path["b"], path["c"], path["a"]], tmp_path, index.manifest) == 3
    )
    assert cache[f"path:{path['a']}"].tolist() == [97.0, 98.0, 99.0] and cache[f"path:{path['b']}"] == "kept"
    reward = SimpleNamespace(image_cache={})
    args = SimpleNamespace(train_file=str(train), eval_file=str(evals), images_root=str(tmp_path))
    train_data, eval_data = {"image_path": [path["a"], path["c"]]}, {"image_path": [path["e"], path["f"]]}

    class Data(dict):  # a data set's column and length
        def __len__(self):
            return len(self["image_path"])

    assert stored_image_embeddings(reward, index, args, Data(train_data), Data(eval_data)) == (2, 4)
    assert stored_image_embeddings(reward, index, args, Data(train_data), None) == (1, 2)
    assert sorted(reward.image_cache) == sorted(f"path:{path[n]}" for n in "abe")


def test_an_interrupted_job_tries_its_failures_again_and_a_leftover_work_file_goes(tmp_path):
    from rl.image_embeddings import WORK_FILE

    index, queries = FakeIndex(), tmp_path / "q.jsonl"
    names = fake_images(tmp_path, a="unreadable", b="bcd", c="cde")
    real = index.encode_image_files

    def dying(paths, workers=0):
        if len(index.calls) == 1:
            raise Interrupted
        return real(paths, workers)

    index.encode_image_files = dying
    with pytest.raises(Interrupted):
        embed_images(queries, names, tmp_path, index, batch_size=2, **QUIET)
    folder = store_dir(queries, index.manifest)
    assert [r.get("problem") for r in read_jsonl(folder / f"{WORK_FILE}.part0")] == ["a.png: unreadable", None]
    fake_images(tmp_path, a="abc")  # mended before the resume: an interrupted run's failure is tried again
    index.encode_image_files = real
    embed_images(queries, names, tmp_path, index, batch_size=2, **QUIET)
    assert index.calls[1:] == [["a.png", "c.png"]] and sorted(load_store(queries, index.manifest)) == names

    work = folder / WORK_FILE  # a run killed after it wrote the store, before it removed its work file
    write_jsonl_atomic(work, [{"id": "a.png", "embedding": "x"}])
    embed_images(queries, names, tmp_path, index, **QUIET)
    assert not work.exists() and len(index.calls) == 2
    write_jsonl_atomic(work, [{"id": "z.png", "embedding": "x"}])  # wanted other images too: resumed from, kept
    embed_images(queries, names, tmp_path, index, **QUIET)
    assert work.exists()
