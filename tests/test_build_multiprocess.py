"""The index build as two CPU processes over gloo (torchrun; `accelerate launch --cpu` would start only one): the
same index as one process (same rows in the same order, same vectors), and resumable after a kill with a different
process count in either direction."""

import json
from pathlib import Path

import numpy as np
import pytest

from retrieval.build_index import BuildArgs, build_index
from tests.test_build import die_after, rows_table, vectors
from tests.test_multiprocess import two_processes

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = dict(image_encoder="tiny", text_encoder="tiny", shard_size=12, batch_size=5, device="cpu")


def torchrun(script: Path, out: Path, kb: Path, images_root: Path, die_after_shards: int | None = None):
    argv = ["--kb", str(kb), "--images_root", str(images_root), "--out", str(out), "--workers", "1"]
    argv += [x for k, v in SETTINGS.items() for x in (f"--{k}", str(v))]
    env = {} if die_after_shards is None else {"DIE_AFTER": str(die_after_shards)}
    return two_processes([str(script), *argv], cwd=out.parent, **env)


@pytest.fixture(scope="module")
def kb_and_reference(tiny_world, tmp_path_factory, encoders):
    """The toy KB with a corrupt image and a row without text; its one-process index."""
    tmp = tmp_path_factory.mktemp("mp-build")
    kb = [json.loads(x) for x in open(tiny_world / "kb.jsonl")]
    (tmp / "broken.png").write_bytes(b"not a png")
    kb[7]["image"] = str(tmp / "broken.png")
    kb[30]["text"] = ""
    (tmp / "kb.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kb))
    reference = tmp / "reference"
    build_index(
        BuildArgs(kb=str(tmp / "kb.jsonl"), images_root=str(tiny_world), out=str(reference), **SETTINGS),
        encoders=encoders,
        log=lambda *a: None,
    )
    return tmp / "kb.jsonl", reference


def same_index(out: Path, reference: Path) -> None:
    assert (out / "manifest.json").exists() and not (out / "build").exists()
    assert rows_table(out) == rows_table(reference)
    np.testing.assert_allclose(vectors(out), vectors(reference), atol=1e-5)
    assert open(out / "skipped.jsonl").read() == open(reference / "skipped.jsonl").read()


def test_a_one_process_build_killed_resumes_on_two_as_the_one_process_index(
    kb_and_reference, tiny_world, tmp_path, encoders, monkeypatch
):
    """Two processes finish what one process started: both take shards, process 0 assembles, and the index is the
    one-process index (rows, order, vectors, skip list)."""
    kb, reference = kb_and_reference
    out = tmp_path / "idx"
    with monkeypatch.context() as m:
        die_after(m, 3)
        with pytest.raises(KeyboardInterrupt):
            build_index(
                BuildArgs(kb=str(kb), images_root=str(tiny_world), out=str(out), **SETTINGS),
                encoders=encoders,
                log=lambda *a: None,
            )
    assert len(list((out / "build").glob("*-*.json"))) == 3
    proc = torchrun(ROOT / "retrieval" / "build_index.py", out, kb, tiny_world)
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stdout + proc.stderr
    assert "resuming the partial build" in log
    assert "process 0/2 on cpu" in log and "process 1/2 on cpu" in log
    assert "process 1: my shards are done; process 0 assembles the index" in log
    same_index(out, reference)
    m = json.loads((out / "manifest.json").read_text())
    assert m["skipped"] == 2 and m["texts_encoded"] < m["text_rows"] + 1


def test_a_two_process_build_killed_resumes_on_one(kb_and_reference, tiny_world, tmp_path, encoders):
    kb, reference = kb_and_reference
    out = tmp_path / "idx"
    proc = torchrun(ROOT / "tests" / "scripts" / "build_and_die.py", out, kb, tiny_world, die_after_shards=2)
    assert proc.returncode != 0 and "killed after 2 shards" in proc.stderr
    done = len(list((out / "build").glob("*-*.json")))
    assert 2 <= done <= 4 and not (out / "manifest.json").exists()
    resumed = []
    log = resumed.append
    build_index(
        BuildArgs(kb=str(kb), images_root=str(tiny_world), out=str(out), **SETTINGS), encoders=encoders, log=log
    )
    assert any("resuming the partial build" in line for line in resumed)
    same_index(out, reference)
