"""Crash-sensitive writes and waits outside the files other tests own: a job killed mid-write leaves nothing a rerun
takes for finished work, and a wait on another process or a server ends, naming what it waited for."""

import hashlib
import json
import socket
import threading
from contextlib import contextmanager
from pathlib import Path

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


class SavingTrainer:
    """A trainer's final save as the Trainer makes it, file by file into the folder given; ``cut``: killed after
    the first file (the weights of a model in two shards)."""

    def __init__(self, step: int, cut: bool = False):
        from transformers import TrainerState

        self.state, self.cut = TrainerState(global_step=step), cut

    def save_model(self, folder):
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model-00001-of-00002.safetensors").write_text(f"step {self.state.global_step}")
        if self.cut:
            raise KeyboardInterrupt
        (folder / "model-00002-of-00002.safetensors").write_text(f"step {self.state.global_step}")


class Processor:
    def save_pretrained(self, folder):
        (Path(folder) / "preprocessor_config.json").write_text("{}")


def folder_files(folder):
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


def test_a_final_save_cut_short_leaves_the_earlier_final_whole(tmp_path):
    """GRPO's ``final/`` was saved in place: a run killed mid-save over an earlier run's ``final/`` (the same run
    again) left the new first weights shard beside the old second one and the old ``trainer_state.json``, which
    rl.export takes for the step of those weights. It is saved beside ``final/`` and renamed onto it whole."""
    from common.placement import Processes
    from rl.trainer_parts import save_final

    save_final(SavingTrainer(4), Processor(), tmp_path, Processes(), False)
    before = folder_files(tmp_path / "final")
    assert json.loads(before["trainer_state.json"])["global_step"] == 4
    with pytest.raises(KeyboardInterrupt):
        save_final(SavingTrainer(8, cut=True), Processor(), tmp_path, Processes(), False)
    assert folder_files(tmp_path / "final") == before
    save_final(SavingTrainer(8), Processor(), tmp_path, Processes(), False)  # the rerun
    after = folder_files(tmp_path / "final")
    assert json.loads(after["trainer_state.json"])["global_step"] == 8
    assert {k: v for k, v in after.items() if k.endswith(".safetensors")} == {
        f"model-0000{i}-of-00002.safetensors": "step 8" for i in (1, 2)
    }
    assert [p.name for p in tmp_path.iterdir()] == ["final"]  # no staging folder left by the rerun


@contextmanager
def trickling_server(body: bytes, content_type: str):
    """A local HTTP server that answers one request with ``body``, one byte every 0.2 s; yields (its address, the
    offsets of the bytes sent so far)."""
    listener = socket.create_server(("127.0.0.1", 0))
    sent = []

    def trickle():
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            head = f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
            conn.sendall(head.encode())
            try:
                for i in range(len(body)):
                    conn.sendall(body[i : i + 1])
                    sent.append(i)
                    threading.Event().wait(0.2)
            except OSError:  # the client gave up and closed the connection
                pass

    threading.Thread(target=trickle, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", sent
    finally:
        listener.close()


def test_an_image_trickled_past_the_timeout_is_a_transient_failure(tmp_path):
    """``fetch_images --timeout`` ("seconds per request") bounded each read of the body only: an image sent a byte
    every 0.2 s held its download thread for as long as the server went on. The whole body now has the timeout; the
    URL is listed as a transient failure (tried again by the next run) and no file is written."""
    from retrieval.upstream.fetch_images import TRANSIENT, fetch_one

    body = b"\x89PNG\r\n\x1a\n" + bytes(32)
    with trickling_server(body, "image/png") as (site, sent):
        why = fetch_one(f"{site}/a.png", tmp_path, 1.0, "Test Runner (tests@example.org)", max_retries=0)
    assert why == f"{TRANSIENT}TimeoutError: no whole reply within 1.0 s"
    assert len(sent) < len(body) and list(tmp_path.iterdir()) == []
