"""Images read for the encoders (retrieval.image_data): batches in order, failures kept with their reason, the
embeddings of the decodable ones in order, and the consumer's waits."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from retrieval.image_data import Waits, batches_of, collate, encode_image_files, timed


@pytest.mark.parametrize(
    "indices,size,batches",
    [([], 3, []), (range(5), 2, [[0, 1], [2, 3], [4]]), ([7, 3, 9], 3, [[7, 3, 9]]), (np.arange(2), 5, [[0, 1]])],
)
def test_batches_keep_the_order_given(indices, size, batches):
    got = batches_of(indices, size)
    assert got == batches and all(type(i) is int for b in got for i in b)


def test_a_batch_stacks_the_decodable_and_lists_the_failures_with_their_reason():
    items = [
        {"i": 0, "pixels": torch.zeros(2), "problem": None, "entry_id": "a"},
        {"i": 1, "pixels": None, "problem": "image file missing: x.png", "entry_id": "b"},
        {"i": 2, "pixels": torch.ones(2), "problem": None, "entry_id": "c"},
    ]
    batch = collate(items)
    assert batch["i"] == [0, 2] and batch["entry_id"] == ["a", "c"] and "problem" not in batch
    assert torch.equal(batch["pixels"], torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    assert batch["failed"] == [{"i": 1, "problem": "image file missing: x.png", "entry_id": "b"}]
    none = collate([{"i": 1, "pixels": None, "problem": "image unreadable", "entry_id": "b"}])
    assert none["pixels"] is None and none["i"] == [] and [f["i"] for f in none["failed"]] == [1]


def test_image_files_are_encoded_in_order_and_the_undecodable_named(tmp_path):
    """Embeddings of the decodable files in their order (here each image's red level, batches of 2), and each other
    one's position with why (``retrieval.kb.load_image``'s wording)."""
    paths = []
    for red in (10, 20, 30, 40):
        Image.new("RGB", (4, 4), (red, 0, 0)).save(tmp_path / f"{red}.png")
        paths.append(tmp_path / f"{red}.png")
    (tmp_path / "bad.png").write_bytes(b"not a png")
    paths[1:1] = [tmp_path / "missing.png"]
    paths.append(tmp_path / "bad.png")
    enc = SimpleNamespace(
        preprocess=lambda img: torch.tensor([float(img.getpixel((0, 0))[0])]),
        encode_pixels=lambda x: x.numpy() * 2,
        batch_size=2,
        dim=1,
    )
    said = []
    emb, failed = encode_image_files(enc, paths, workers=0, device="cpu", log=said.append)
    np.testing.assert_array_equal(emb[:, 0], [20, 40, 60, 80])
    assert sorted(failed) == [1, 5] and failed[1].startswith("image file missing") and "unreadable" in failed[5]
    assert said and said[0].startswith("query images: 4 encoded, 0 decoding workers")
    emb, failed = encode_image_files(enc, paths[1:2], workers=0, device="cpu")
    assert emb.shape == (0, 1) and emb.dtype == np.float32 and list(failed) == [0]


def test_timed_yields_every_batch_and_counts_the_waits_for_them(monkeypatch):
    """On a clock that moves one second a reading: each batch waited one second; another error is raised as it is."""
    clock = iter(range(10, 100))
    monkeypatch.setattr("retrieval.image_data.time.perf_counter", lambda: float(next(clock)))
    waits = Waits()  # reads 10
    assert list(timed(iter(["a", "b"]), waits)) == ["a", "b"]  # reads 11, 12 | 13, 14 | 15 (the end)
    assert waits.waited == 2.0 and waits.total == 6.0 and 0 < waits.share < 1

    def failing():
        yield "a"
        raise RuntimeError("a decoder broke")

    with pytest.raises(RuntimeError, match="a decoder broke"):  # not a DataLoader timeout: raised as it is
        list(timed(failing(), Waits()))
