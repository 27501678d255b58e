"""The W&B completions log written offline: the table rows, and the images as media files with captions that say
what the refiner did (wandb 0.31 writes table image cells offline as the string "Image", so images go to a panel)."""

import glob
import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from rl.monitor import RefinerMonitor, TimedReward, caption


def test_caption_names_query_rank_and_reward():
    row = {"image_key": "E1.png", "query": "red cross", "gold_title": "Holhol", "rank": 3, "total_reward": 4.5}
    assert caption(row) == "E1.png: red cross | gold Holhol rank 3 | reward 4.50"
    assert "not in the top depth" in caption({**row, "rank": None}) and "(unparseable)" in caption({**row, "query": None})


def test_offline_run_holds_table_rows_and_captioned_images(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rng = np.random.default_rng(0)
    last = [{"image_key": f"img{i}.png", "query": f"green cross {i}", "question": "What is it?", "entity_id": f"E{i}",
             "reward": 4.0 - i, "rank": i + 1} for i in range(3)] + \
        [{"image_key": "img3.png", "query": None, "question": "What?", "entity_id": "E3", "reward": -2.5, "rank": None}]
    retrieval = SimpleNamespace(
        last=last, image_cache={}, depth=200, alpha=0.3,
        images={r["image_key"]: Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)) for r in last},
        index=SimpleNamespace(entity_titles={f"E{i}": f"Title{i}" for i in range(4)}))
    fmt = TimedReward(lambda *a, **k: [1.0, 1.0, 1.0, -4.0])
    fmt.last = [1.0, 1.0, 1.0, -4.0]
    monitor = RefinerMonitor(retrieval, fmt, [fmt], table_steps=1, output_dir=str(tmp_path))
    run = wandb.init(project="t", dir=str(tmp_path))
    monitor.log_table(step=7)
    wandb.log({"reward": 1.0})
    run.finish()
    (run_dir,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    media = Path(run_dir) / "files" / "media"
    (table_file,) = (media / "table").glob("completions_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"][:2] == ["step", "image_key"] and len(table["data"]) == 4
    assert [row[1] for row in table["data"]] == [r["image_key"] for r in last] and "Image" not in table["data"][0]
    assert table["data"][0][-1] == pytest.approx(5.0) and table["data"][3][5] == -1  # reward 4 + 1; no rank
    pngs = list((media / "images").glob("completion_images_*.png"))
    assert len(pngs) == 4 and all(os.path.getsize(p) > 0 for p in pngs)
    history = Path(glob.glob(f"{run_dir}/run-*.wandb")[0]).read_bytes()
    assert b"img1.png: green cross 1 | gold Title1 rank 2 | reward 4.00" in history  # the caption, in the run log
    assert json.loads(open(tmp_path / "samples.jsonl").readline())["step"] == 7
