"""Index build: manifest, skipped rows, duplicate ids, resume after a kill, manifest mismatch."""

import json
import re
import shutil

import numpy as np
import pytest

import retrieval.build_index as bi
from retrieval.build_index import BuildArgs, build_index
from retrieval.index import MultimodalIndex

QUIET = dict(log=lambda *a: None)


def args_for(world, out, **kw):
    settings = {"image_encoder": "tiny", "text_encoder": "tiny", "device": "cpu", "shard_size": 16, **kw}
    return BuildArgs(kb=str(world / "kb.jsonl"), out=str(out), **settings)


def vectors(index_dir):
    from common.faiss_lib import faiss

    index = faiss.read_index(str(index_dir / "index.faiss"))
    return index.reconstruct_n(0, index.ntotal)


def test_manifest_and_rows(tiny_index_dir, tiny_world):
    m = json.loads((tiny_index_dir / "manifest.json").read_text())
    kb_rows = sum(1 for _ in open(tiny_world / "kb.jsonl", encoding="utf-8"))
    assert m["rows"] == kb_rows and m["entities"] == 24 and m["skipped"] == 0
    assert m["image_encoder"] == "tiny" and m["text_encoder"] == "tiny" and m["factory"] == "Flat"
    assert m["dim"] == m["image_dim"] + m["text_dim"]
    assert m["kb_fingerprint"].startswith("sha256:") and "faiss" in m["versions"]
    assert "alpha" not in m  # α is a query-time knob
    rows = vectors(tiny_index_dir)
    # each half of a row is L2-normalised
    np.testing.assert_allclose(np.linalg.norm(rows[:, : m["image_dim"]], axis=1), 1, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(rows[:, m["image_dim"] :], axis=1), 1, atol=1e-5)
    assert not (tiny_index_dir / "build").exists()


def test_bad_rows_are_skipped_and_listed(tiny_world, tmp_path, encoders):
    kb = [json.loads(x) for x in open(tiny_world / "kb.jsonl", encoding="utf-8")][:12]
    (tmp_path / "broken.png").write_bytes(b"not a png")
    kb[1]["image"] = "images/nope.png"
    kb[2]["text"] = "   "
    kb[3]["entity_id"] = None
    kb[4]["image"] = str(tmp_path / "broken.png")
    (tmp_path / "kb.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kb))
    out = tmp_path / "idx"
    m = build_index(
        BuildArgs(
            kb=str(tmp_path / "kb.jsonl"),
            images_root=str(tiny_world),
            out=str(out),
            image_encoder="tiny",
            text_encoder="tiny",
            shard_size=5,
        ),
        encoders=encoders,
        **QUIET,
    )
    skipped = {r["entry_id"]: r["reason"] for r in map(json.loads, open(out / "skipped.jsonl", encoding="utf-8"))}
    assert m["rows"] == 8 and m["skipped"] == 4
    assert "image file missing" in skipped[kb[1]["entry_id"]]
    assert skipped[kb[2]["entry_id"]] == "empty text"
    assert skipped[kb[3]["entry_id"]] == "no entity_id"
    assert "image unreadable" in skipped[kb[4]["entry_id"]]


def test_duplicate_entry_id_fails_before_encoding(tiny_world, tmp_path, monkeypatch):
    lines = open(tiny_world / "kb.jsonl", encoding="utf-8").read().splitlines()[:6]
    (tmp_path / "kb.jsonl").write_text("\n".join(lines + [lines[2]]) + "\n")
    dup = json.loads(lines[2])["entry_id"]
    monkeypatch.setattr(bi, "image_encoder", lambda *a, **k: pytest.fail("an encoder was loaded"))
    with pytest.raises(ValueError, match=f"duplicate entry_id '{dup}'"):
        build_index(
            BuildArgs(
                kb=str(tmp_path / "kb.jsonl"),
                images_root=str(tiny_world),
                out=str(tmp_path / "o"),
                image_encoder="tiny",
                text_encoder="tiny",
            ),
            **QUIET,
        )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "factory,dim,ok",
    [
        ("Flat", None, True),
        ("IVF4096,PQ48", None, True),  # 48 does not divide the 1,024-dim probe; it divides the paper's 2,304
        ("OPQ96,IVF256,PQ96", None, True),
        ("HNSW32,PQ56", None, True),
        ("IVF4096,PQ48", 2304, True),
        ("IVF4096,PQ48", 1024, False),  # the rows' own width, once known: only it counts
        ("PQ11", None, False),  # no usual width takes it
        ("PQ256", None, True),  # 1,024 dims only
        ("Flatt", None, False),
        ("IVF,PQ", None, False),
    ],
)
def test_a_factory_is_refused_only_where_faiss_cannot_build_it(factory, dim, ok):
    """Before the rows' width is known, a factory FAISS builds at some width is not refused (PQ48 was, at a 1,024-dim
    probe, though it builds at 1,280 + 1,024)."""
    from retrieval.faiss_build import check_factory

    if ok:
        assert check_factory(factory, dim) == factory
    else:
        first = dim or 1024  # FAISS's error at the first width tried is the one named
        with pytest.raises(
            ValueError, match=f"invalid FAISS factory string '{re.escape(factory)}' for dimension {first}"
        ):
            check_factory(factory, dim)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("factory", "NotAFactory", "factory"),
        ("image_encoder", "no-such-clip", "unknown image encoder"),
        ("text_encoder", "nonsense", "unknown text encoder"),
        ("shard_size", 0, "shard_size"),
        (
            "text_template",
            "{title}: {entity_id}",
            r"--text_template .* may use \{title\}, \{section_title\} and \{text\}",
        ),
    ],
)
def test_invalid_settings_fail_before_models_load(tiny_world, tmp_path, monkeypatch, field, value, match):
    monkeypatch.setattr(bi, "image_encoder", lambda *a, **k: pytest.fail("an encoder was loaded"))
    with pytest.raises(ValueError, match=match):
        build_index(args_for(tiny_world, tmp_path / "o", **{field: value}), **QUIET)


@pytest.mark.parametrize(
    "layout,said",
    [
        ("the world", "--out {out} holds --kb {out}/kb.jsonl: --overwrite would delete it"),  # KB, images, questions
        ("images inside", "--out {out} holds --images_root {out}/images: --overwrite would delete it"),
        (
            "notes",
            "--out {out} holds files but no index (manifest.json, build/, index.faiss or rows.parquet)",
        ),
        ("a file", "--out {out} is a file, not an index folder"),
        ("absent", None),
        ("empty", None),
        ("an index", None),
        ("a partial build", None),
        ("a delete cut short", None),  # only a shard left: an index folder still, not one refused for good
        (
            "a project",  # a build/ folder of its own: not a partial build
            "--out {out} holds files but no index (manifest.json, build/, index.faiss or rows.parquet)",
        ),
    ],
)
def test_overwrite_deletes_only_an_index_folder(tiny_world, tmp_path, monkeypatch, layout, said):
    """--overwrite deleted whatever folder --out named: the toy world's folder as --out took its KB, images and
    questions with it."""
    monkeypatch.setattr(bi, "image_encoder", lambda *a, **k: pytest.fail("an encoder was loaded"))
    out, kb, images_root = tmp_path / "out", tiny_world / "kb.jsonl", None
    if layout == "the world":
        shutil.copytree(tiny_world, out, ignore=shutil.ignore_patterns("images", "index"))
        (out / "images").mkdir()
        kb = out / "kb.jsonl"
    elif layout == "images inside":
        (out / "images").mkdir(parents=True)
        images_root = out / "images"
    elif layout == "a file":
        out.write_text("a report\n")
    elif layout != "absent":
        out.mkdir()
        written = {
            "notes": "notes.txt",
            "an index": "manifest.json",
            "a partial build": "build/state.json",
            "a delete cut short": "build/text-000007.npy",
            "a project": "build/lib/setup.py",
        }
        if layout in written:
            (out / written[layout]).parent.mkdir(parents=True, exist_ok=True)
            (out / written[layout]).write_text("{}")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    args = BuildArgs(
        **{
            **vars(args_for(tiny_world, out, overwrite=True)),
            "kb": str(kb),
            "images_root": images_root and str(images_root),
        }
    )
    if said is None:
        bi.validate(args)
    else:
        with pytest.raises(ValueError, match=f"^{re.escape(said.format(out=out))}"):
            build_index(args, **QUIET)
        assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before  # nothing deleted


def rows_table(index_dir):
    import pyarrow.parquet as pq

    return pq.read_table(index_dir / "rows.parquet").to_pydict()


def die_after(monkeypatch, n: int, at: str = "save"):
    """Interrupt the build after ``n`` shards are saved (``at="assemble"``: when the index is assembled)."""
    import retrieval.build_shards as bs

    real = bs.save_shard
    saved = []

    def dying(*a, **k):
        if len(saved) == n:
            raise KeyboardInterrupt(f"killed after {n} shards")
        saved.append(a[1:3])
        return real(*a, **k)

    monkeypatch.setattr(bs, "save_shard", dying)
    if at == "assemble":
        monkeypatch.setattr(bi, "assemble", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt("killed")))
    return saved


@pytest.mark.parametrize("killed_after", [0, 1, 3, "assemble"])
def test_resume_after_kill_gives_the_same_index(
    tiny_world, tiny_index_dir, tmp_path, encoders, monkeypatch, killed_after
):
    """Killed before any shard, after a text shard, among the image shards, or while assembling: the resumed build
    encodes only what is missing and equals the uninterrupted one (tiny_index_dir, another shard size)."""
    out = tmp_path / "idx"
    n = 10**6 if killed_after == "assemble" else killed_after
    with monkeypatch.context() as m:
        die_after(m, n, at="assemble" if killed_after == "assemble" else "save")
        with pytest.raises(KeyboardInterrupt):
            build_index(args_for(tiny_world, out, shard_size=20), encoders=encoders, **QUIET)
    assert not (out / "manifest.json").exists()
    done = {p.stem for p in (out / "build").glob("*-*.json")}
    resumed = die_after(monkeypatch, 10**6)
    build_index(args_for(tiny_world, out, shard_size=20), encoders=encoders, **QUIET)
    assert not done & {f"{kind}-{i:06d}" for kind, i in resumed}  # finished shards were not encoded again
    assert len(done) + len(resumed) == len(
        bi.work_items(bi.scan_kb(tiny_world / "kb.jsonl", "{title}. {section_title}. {text}"), 20)
    )
    np.testing.assert_allclose(vectors(out), vectors(tiny_index_dir), atol=1e-5)
    assert rows_table(out) == rows_table(tiny_index_dir)


def test_partial_build_with_other_settings_is_refused(tiny_world, tmp_path, encoders, monkeypatch):
    out = tmp_path / "idx"
    with monkeypatch.context() as m:  # a build that resumed by mistake must fail this test, not stop the session
        die_after(m, 0)
        with pytest.raises(KeyboardInterrupt):
            build_index(args_for(tiny_world, out, shard_size=32), encoders=encoders, **QUIET)
    with pytest.raises(ValueError, match="shard_size"):
        build_index(args_for(tiny_world, out, shard_size=16), encoders=encoders, **QUIET)


def test_a_partial_build_resumes_under_another_factory(tiny_world, tmp_path, encoders, monkeypatch):
    """No shard depends on the FAISS factory: a factory that only fails at the rows' real width (PQ256: 1,024 probe
    dims divide by 256, the tiny rows' 128 do not) stops the build at assembly with every shard kept, and a run with
    another factory assembles from them without encoding anything again."""
    out = tmp_path / "idx"
    with pytest.raises(ValueError, match="PQ256.*dimension 128.*shards are kept.*another --factory"):
        build_index(args_for(tiny_world, out, factory="PQ256"), encoders=encoders, **QUIET)
    assert not (out / "manifest.json").exists() and any((out / "build").glob("image-*.json"))
    encoded = die_after(monkeypatch, 10**6)
    m = build_index(args_for(tiny_world, out, factory="HNSW16,Flat"), encoders=encoders, **QUIET)
    assert encoded == [] and m["factory"] == "HNSW16,Flat" and m["rows"] > 0


def test_a_partial_build_from_other_images_is_refused(tiny_world, tmp_path, encoders, monkeypatch):
    out, copy = tmp_path / "idx", tmp_path / "copy"
    shutil.copytree(tiny_world / "images", copy / "images")
    with monkeypatch.context() as m:
        die_after(m, 2)
        with pytest.raises(KeyboardInterrupt):
            build_index(args_for(tiny_world, out), encoders=encoders, **QUIET)
    with pytest.raises(ValueError, match="partial build with different images_root"):
        build_index(args_for(tiny_world, out, images_root=str(copy)), encoders=encoders, **QUIET)


def test_a_partial_build_resumes_only_on_the_kind_of_device_it_began_on(tiny_world, tmp_path, encoders, monkeypatch):
    """The encoders' precision follows the device (fp16 / bf16 on a GPU, fp32 on the CPU): a partial CPU build resumed
    on a GPU would mix both in one index, so it is refused before any encoder loads; a finished index is reused on
    any device."""
    import retrieval.build_index as bi

    out = tmp_path / "idx"
    with monkeypatch.context() as m:
        die_after(m, 2)
        with pytest.raises(KeyboardInterrupt):
            build_index(args_for(tiny_world, out), encoders=encoders, **QUIET)
    with monkeypatch.context() as m:
        m.setattr(bi, "job_device", lambda *a: "cuda:0")
        with pytest.raises(ValueError, match="partial build with different encode_device"):
            build_index(args_for(tiny_world, out), encoders=encoders, **QUIET)
    build_index(args_for(tiny_world, out), encoders=encoders, **QUIET)  # on the CPU again: resumed, finished
    with monkeypatch.context() as m:
        m.setattr(bi, "job_device", lambda *a: "cuda:0")
        said = []
        build_index(args_for(tiny_world, out), encoders=encoders, log=said.append)
    assert any("nothing to do" in line for line in said)


def test_a_resumed_build_takes_this_runs_query_instruction(tiny_world, tmp_path, monkeypatch):
    """KB rows never carry the query instruction: text shards encoded under one setting and assembled under another
    give the manifest the new one (it used to keep the first run's, which every later load applied to queries)."""
    out = tmp_path / "idx"
    with monkeypatch.context() as m:
        die_after(m, 3)
        with pytest.raises(KeyboardInterrupt):
            build_index(args_for(tiny_world, out, query_instruction="Find the creature: "), **QUIET)
    first = [json.loads(p.read_text()) for p in (out / "build").glob("text-*.json")]
    assert first and all(t["query_instruction"] == "Find the creature: " for t in first)
    manifest = build_index(args_for(tiny_world, out, query_instruction="none"), **QUIET)
    assert manifest["query_instruction"] is None and manifest["query_instruction_setting"] == "none"


def test_finished_index_is_reused(tiny_world, tiny_index_dir, encoders, monkeypatch):
    monkeypatch.setattr(bi, "encode_text_shard", lambda *a, **k: pytest.fail("re-encoded a finished index"))
    monkeypatch.setattr(bi, "encode_image_shards", lambda *a, **k: pytest.fail("re-encoded a finished index"))
    m = build_index(args_for(tiny_world, tiny_index_dir, shard_size=32), encoders=encoders, **QUIET)
    assert m["rows"] > 0


def test_load_with_other_encoder_names_both(tiny_index_dir):
    with pytest.raises(ValueError, match="built with text encoder 'tiny', but 'minilm' was requested"):
        MultimodalIndex.load(tiny_index_dir, text_encoder="minilm")
    with pytest.raises(ValueError, match="built with image encoder 'tiny', but 'ViT-B-32' was requested"):
        MultimodalIndex.load(tiny_index_dir, image_encoder="ViT-B-32")


def test_hnsw_and_ivf_factories_build(tiny_world, tiny_index_dir, tmp_path, encoders):
    for factory in ["HNSW16,Flat", "IVF4,Flat"]:
        out = tmp_path / factory.replace(",", "_")
        shutil.copytree(tiny_index_dir, out)
        (out / "manifest.json").unlink()
        m = build_index(
            args_for(tiny_world, out, factory=factory, shard_size=32, overwrite=True), encoders=encoders, **QUIET
        )
        idx = MultimodalIndex.load(out, *encoders)
        assert m["factory"] == factory and len(idx) == m["rows"]


def test_search_finds_the_entity_of_a_kb_image(tiny_index, tiny_world):
    """Querying with a KB row's own image and text ranks its entity first at every α."""
    from PIL import Image

    rec = json.loads(open(tiny_world / "kb.jsonl", encoding="utf-8").readline())
    from retrieval.kb import entry_text

    img = Image.open(tiny_world / rec["image"])
    for alpha in (0.0, 0.5, 1.0):
        hits = tiny_index.search([img], [entry_text(rec)], alpha=alpha, k=5)[0]
        assert hits[0].entity_id == rec["entity_id"]
        assert hits[0].score == pytest.approx(1.0, abs=1e-4) or alpha == 1.0


@pytest.mark.parametrize(
    "late,step",
    [
        (1, "each process checked --out {out} before process 0 deletes it"),
        (2, "process 0 deleted --out {out}"),
        (3, r"each process listed the shards to do in {out}/build"),
        (4, r"each process encoded its shards into {out}/build"),
    ],
)
def test_an_expired_barrier_of_the_build_names_its_step(tiny_world, tmp_path, encoders, late, step):
    """Each barrier of a multi-process build, past the process group's timeout, says what this process waited for
    and in which folder (process 1 of 2 here, a stand-in state whose ``late``-th barrier expires); each said "after
    this step"."""
    from tests.test_job_parts import OthersLate

    out = tmp_path / "idx"
    args = args_for(tiny_world, out, overwrite=True)
    with pytest.raises(TimeoutError, match=f"after {step.format(out=out)} within the collective timeout"):
        build_index(args, encoders=encoders, state=OthersLate(late), **QUIET)


class HangingImages:
    """A dataset whose every item holds its worker (a decoder that never returns, a file system that stopped
    answering) for 2 s, past the test's 1 s bound: a worker that never returned would cost DataLoader's own 5 s wait
    before it ends the worker."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        import threading

        threading.Event().wait(2)


def test_a_decoding_worker_that_never_answers_is_a_timeout_naming_the_wait():
    """The encoder waited for DataLoader workers' decoded batches without a timeout: a worker that hung kept the build
    (or an embedding job) waiting for ever. The wait is bounded (``DECODE_TIMEOUT_S``; 1 s here) and named."""
    from retrieval.image_data import Waits, loader, timed

    data = loader(HangingImages(), [[0], [1]], workers=1, timeout_s=1)
    with pytest.raises(TimeoutError, match=r"no batch of decoded images from 1 DataLoader worker within 1 s"):
        next(timed(data, Waits()))
