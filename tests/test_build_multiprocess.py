"""The index build as two CPU processes over gloo (torchrun; `accelerate launch --cpu` would start only one): the
same index as one process (same rows in the same order, same vectors), and resumable after a kill with a different
process count in either direction."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from retrieval.build_index import BuildArgs, build_index
from tests.test_build import die_after, rows_table, vectors
from tests.test_multiprocess import two_processes

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = dict(image_encoder="tiny", text_encoder="tiny", shard_size=12, batch_size=5, device="cpu")


def build_argv(kb: Path, images_root: Path, out: Path) -> list[str]:
    argv = ["--kb", str(kb), "--images_root", str(images_root), "--out", str(out), "--workers", "1"]
    return argv + [x for k, v in SETTINGS.items() for x in (f"--{k}", str(v))]


@pytest.fixture(scope="module")
def kb_and_reference(tiny_world, tmp_path_factory, encoders):
    """The toy KB with a corrupt image and a row without text; its one-process index."""
    tmp = tmp_path_factory.mktemp("mp-build")
    kb = [json.loads(x) for x in open(tiny_world / "kb.jsonl", encoding="utf-8")]
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
    assert (
        open(out / "skipped.jsonl", encoding="utf-8").read()
        == open(reference / "skipped.jsonl", encoding="utf-8").read()
    )


@pytest.fixture(scope="module")
def two_process_builds(kb_and_reference, tiny_world, tmp_path_factory, encoders):
    """One launch of two processes for both directions (tests/scripts/build_and_die.py): it finishes the build that
    one process began and was killed in after 3 shards (``one_then_two``), then starts another build and is killed
    after 2 shards of it (``two_then_one``). Each build's folder, and its log: both processes' own logs of it, read
    from each process's file (in one shared pipe, the two builds' lines would interleave)."""
    kb, _ = kb_and_reference
    tmp = tmp_path_factory.mktemp("killed-builds")
    out = {name: tmp / name / "idx" for name in ("one_then_two", "two_then_one")}
    with pytest.MonkeyPatch.context() as m:
        die_after(m, 3)
        with pytest.raises(KeyboardInterrupt):
            build_index(
                BuildArgs(kb=str(kb), images_root=str(tiny_world), out=str(out["one_then_two"]), **SETTINGS),
                encoders=encoders,
                log=lambda *a: None,
            )
    assert len(list((out["one_then_two"] / "build").glob("*-*.json"))) == 3
    argv = [
        *build_argv(kb, tiny_world, out["one_then_two"]),
        "--then",
        *build_argv(kb, tiny_world, out["two_then_one"]),
    ]
    proc = two_processes(
        [str(ROOT / "tests" / "scripts" / "build_and_die.py"), str(tmp), *argv], cwd=tmp, DIE_AFTER="2"
    )
    logs = {name: "".join(p.read_text() for p in sorted(tmp.glob(f"{i}.rank*.log"))) for i, name in enumerate(out)}
    assert proc.returncode != 0 and "killed after 2 shards" in logs["two_then_one"], proc.stderr[-4000:] + str(logs)
    return out, logs


def test_a_one_process_build_killed_resumes_on_two_as_the_one_process_index(two_process_builds, kb_and_reference):
    """Two processes finish what one process started: both take shards, process 0 assembles, and the index is the
    one-process index (rows, order, vectors, skip list)."""
    out, log = two_process_builds[0]["one_then_two"], two_process_builds[1]["one_then_two"]
    assert "resuming the partial build" in log
    assert "process 0/2 on cpu" in log and "process 1/2 on cpu" in log
    assert "process 1: my shards are done; process 0 assembles the index" in log
    same_index(out, kb_and_reference[1])
    m = json.loads((out / "manifest.json").read_text())
    assert m["skipped"] == 2 and m["texts_encoded"] < m["text_rows"] + 1


def test_a_two_process_build_killed_resumes_on_one(
    two_process_builds, kb_and_reference, tiny_world, encoders, tmp_path
):
    kb, reference = kb_and_reference
    killed, log = two_process_builds[0]["two_then_one"], two_process_builds[1]["two_then_one"]
    assert "resuming" not in log and "process 1/2 on cpu" in log  # a new build, killed on both processes
    done = sorted(p.name for p in (killed / "build").glob("*-*.json"))
    assert 2 <= len(done) <= 4 and not (killed / "manifest.json").exists()
    out = tmp_path / "idx"  # finished in a copy: the module's killed build stays as the launch left it
    shutil.copytree(killed, out)
    resumed = []
    build_index(
        BuildArgs(kb=str(kb), images_root=str(tiny_world), out=str(out), **SETTINGS),
        encoders=encoders,
        log=resumed.append,
    )
    # one process took up the shards the two processes had not finished
    assert any(f"resuming the partial build in {out / 'build'}: {len(done)} of " in line for line in resumed)
    assert "process 0/1 on cpu" in "\n".join(resumed)
    same_index(out, reference)
    assert sorted(p.name for p in (killed / "build").glob("*-*.json")) == done  # the original left as it was
    assert not (killed / "manifest.json").exists()
