"""The W&B run written offline: the completions table rows, and the images as media files with captions that say
what the refiner did (wandb 0.31 writes table image cells offline as the string "Image", so images go to a panel);
and a real GRPO run's log read back record by record with wandb's own protobuf classes: the reward components and
hit@k per step, the completions table and its images.

wandb 0.31 ships no Python reader for its ``.wandb`` run log (``wandb.sdk.internal.datastore`` is gone); the file is
a LevelDB-style log (7-byte ``:W&B`` header, 32 KiB blocks of checksummed chunks) of ``wandb_internal_pb2.Record``
messages, which ``wandb_records`` below splits back into records."""

import glob
import json
import os
import struct
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from rl.monitor import RefinerMonitor, TimedReward, caption, image_label


def finished_writing(wandb) -> None:
    """Wait until wandb's service process has written and closed the run's files.

    ``run.finish()`` returns once the service has handled the run's exit record, not once its writer has flushed the
    ``.wandb`` log: read right after it, on a busy machine, the log held only its 7-byte header. ``wandb.teardown()``
    shuts the service process down and waits for it to exit (``ServiceConnection.teardown`` → ``proc.join()``), after
    which every file it wrote is complete. The next ``wandb.init`` starts a new service."""
    wandb.teardown()


@pytest.mark.parametrize(
    "key,label",
    [
        ("path:/data/toyworld/images/E0154_train0.png", "E0154_train0.png"),
        ("path:relative/x.jpg", "x.jpg"),
        ("pixels:0123456789abcdef0123456789abcdef", "pixels:0123456789ab"),
        ("E1.png", "E1.png"),
        ("path:", "path:"),
    ],
)
def test_image_label_is_short(key, label):
    assert image_label(key) == label


def test_caption_names_query_rank_and_reward():
    row = {"image_key": "E1.png", "query": "red cross", "gold_title": "Holhol", "rank": 3, "total_reward": 4.5}
    assert caption(row) == "E1.png: red cross | gold Holhol rank 3 | reward 4.50"
    assert "not in the top depth" in caption({**row, "rank": None}) and "(unparseable)" in caption(
        {**row, "query": None}
    )


def test_offline_run_holds_table_rows_and_captioned_images(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rng = np.random.default_rng(0)
    last = [
        {
            "image_key": f"img{i}.png",
            "query": f"green cross {i}",
            "question": "What is it?",
            "entity_id": f"E{i}",
            "reward": 4.0 - i,
            "rank": i + 1,
        }
        for i in range(3)
    ] + [{"image_key": "img3.png", "query": None, "question": "What?", "entity_id": "E3", "reward": -2.5, "rank": None}]
    retrieval = SimpleNamespace(
        last=last,
        image_cache={},
        depth=200,
        alpha=0.3,
        images={r["image_key"]: Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)) for r in last},
        index=SimpleNamespace(entity_titles={f"E{i}": f"Title{i}" for i in range(4)}),
    )
    fmt = TimedReward(lambda *a, **k: [1.0, 1.0, 1.0, -4.0])
    fmt.last = [1.0, 1.0, 1.0, -4.0]
    monitor = RefinerMonitor(retrieval, fmt, [fmt], table_steps=1, output_dir=str(tmp_path))
    run = wandb.init(project="t", dir=str(tmp_path))
    not_to_wandb = SimpleNamespace(report_to=["none"], reward_weights=None)  # a run open, but not this job's
    monitor.on_step_end(not_to_wandb, SimpleNamespace(global_step=6, is_world_process_zero=True), None)
    monitor.log_table(step=7)
    wandb.log({"reward": 1.0})
    run.finish()
    finished_writing(wandb)
    (run_dir,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    media = Path(run_dir) / "files" / "media"
    (table_file,) = (media / "table").glob("refined_queries_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"][:2] == ["step", "image"] and len(table["data"]) == 4
    assert [row[1] for row in table["data"]] == [r["image_key"] for r in last] and "Image" not in table["data"][0]
    assert table["data"][0][-1] == pytest.approx(5.0) and table["data"][3][5] == -1  # reward 4 + 1; no rank
    pngs = list((media / "images").glob("completion_images_*.png"))
    assert len(pngs) == 4 and all(os.path.getsize(p) > 0 for p in pngs)
    history = Path(glob.glob(f"{run_dir}/run-*.wandb")[0]).read_bytes()
    assert b"img1.png: green cross 1 | gold Title1 rank 2 | reward 4.00" in history  # the caption, in the run log
    assert sorted({json.loads(line)["step"] for line in open(tmp_path / "samples.jsonl", encoding="utf-8")}) == [
        6,
        7,
    ]  # both steps


# --------------------------------------------------------------------------- a real run, read back


def wandb_records(path: Path):
    """Every ``Record`` in a ``.wandb`` run log, in order, parsed with wandb's own protobuf classes."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = Path(path).read_bytes(), 32768
    assert data[:4] == b":W&B", "not a W&B run log"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):  # full record, or its first chunk
            pending = chunk
        elif kind in (3, 4):  # middle or last chunk
            pending += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def test_a_grpo_run_logged_offline_reads_back(config, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    import rl.train_grpo as tg

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    result = tg.main(config(report_to="wandb", log_table_steps=1, max_steps=2, logging_steps=1))
    assert wandb.run is not None and wandb.run.offline
    run_dir = Path(wandb.run.dir).parent
    wandb.finish()  # what the process's exit does after a real run
    finished_writing(wandb)
    (log,) = run_dir.glob("run-*.wandb")
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in wandb_records(Path(log))
        if r.WhichOneof("record_type") == "history"
    ]
    by_step = {h["train/global_step"]: h for h in history if "train/retrieval/hit@1" in h}
    logged = {h["step"]: h for h in result["log_history"] if "retrieval/hit@1" in h}
    assert set(by_step) == set(logged) == {1, 2}
    for step, h in by_step.items():  # what W&B holds is what the trainer logged
        for key in (
            "rewards/format_reward/mean",
            "rewards/retrieval_reward/mean",
            "retrieval/hit@1",
            "retrieval/hit@10",
            "retrieval/parse_rate",
            "reward",
        ):
            assert h[f"train/{key}"] == pytest.approx(logged[step][key], abs=1e-6), (step, key)
    tables = [h for h in history if "refined_queries/path" in h]
    assert len(tables) == 2  # one table per step (log_table_steps 1)
    run_files = run_dir / "files"
    table = json.loads((run_files / tables[-1]["refined_queries/path"]).read_text())
    assert (
        table["columns"][:3] == ["step", "image", "question"]
        and len(table["data"]) == tables[-1]["refined_queries/nrows"]
    )
    assert all(row[1].endswith(".png") and not row[1].startswith("path:") for row in table["data"])
    images = tables[-1]
    assert images["completion_images/count"] == len(table["data"]) and images["completion_images/_type"].startswith(
        "images"
    )
    for cap, row in zip(images["completion_images/captions"], table["data"]):
        assert cap.startswith(f"{row[1]}: ") and " | gold " in cap and " | reward " in cap
    for name in set(images["completion_images/filenames"]):
        assert (run_files / name).stat().st_size > 0


@pytest.mark.parametrize(
    "netrc_entry,key_in_env,mode",
    [
        (None, False, "offline"),
        ("machine api.wandb.ai\n  login user\n  password " + "a" * 40 + "\n", False, None),
        ("machine other.example.com\n  login user\n  password " + "a" * 40 + "\n", False, "offline"),
        (None, True, None),
        (None, "WANDB_IDENTITY_TOKEN_FILE", None),  # a workload identity's token file also signs in
    ],
)
def test_wandb_is_online_for_a_user_who_logged_in(tmp_path, monkeypatch, netrc_entry, key_in_env, mode):
    """`wandb login` writes ~/.netrc: such a user logs online without a key in the environment; nobody else is sent
    online (WANDB_MODE offline), and WANDB_MODE set by the user is kept."""
    from rl.monitor import setup_wandb

    for var in (
        "WANDB_MODE",
        "WANDB_API_KEY",
        "WANDB_IDENTITY_TOKEN_FILE",
        "WANDB_BASE_URL",
        "WANDB_DIR",
        "WANDB_CACHE_DIR",
    ):
        monkeypatch.delenv(var, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text(netrc_entry or "")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    if key_in_env:
        monkeypatch.setenv(key_in_env if isinstance(key_in_env, str) else "WANDB_API_KEY", "b" * 40)
    for not_wandb in (None, ["none"], ["tensorboard"]):  # a run not reporting to W&B: nothing set
        setup_wandb(str(tmp_path / "run"), not_wandb)
        assert not {"WANDB_MODE", "WANDB_DIR", "WANDB_CACHE_DIR"} & set(os.environ)
    setup_wandb(str(tmp_path / "run"), ["wandb"])
    assert os.environ.get("WANDB_MODE") == mode
    assert os.environ["WANDB_DIR"] == str((tmp_path / "run").resolve()) and (tmp_path / "run").is_dir()
    monkeypatch.setenv("WANDB_MODE", "disabled")
    setup_wandb(str(tmp_path / "run"), ["wandb"])
    assert os.environ["WANDB_MODE"] == "disabled"


def test_a_timed_reward_totals_each_mode_under_its_name():
    """What the exact means of ``rewards/<name>/mean`` are made of: (sum, count) per mode, the mode read from the
    followed trainer's model, TRL's None (not scored) left out, each taken once; no seconds before any call (they go
    to metrics.json's ``eval_reward_seconds``); ``last``, for the completions table, from training steps only."""
    model = SimpleNamespace(training=True)

    def format_reward(**kwargs):
        return [1.0, None, -4.0] if model.training else [2.0]

    timed = TimedReward(format_reward)
    assert timed.__name__ == "format_reward" and timed.seconds == timed.seconds_outside_steps == 0.0
    timed.follow(SimpleNamespace(model=model))
    timed()
    timed.in_step = True
    timed()
    timed.in_step = False
    model.training = False
    assert timed() == [2.0]
    assert timed.last == [1.0, None, -4.0]  # the table's: the latest training step's rewards, not an evaluation's
    assert timed.take_totals("train") == {"rewards/format_reward/mean": [-6.0, 4]}
    assert timed.take_totals("eval") == {"rewards/format_reward/mean": [2.0, 1]}
    assert timed.take_totals("train") == {}  # taken: the next log starts afresh


def test_the_reward_time_share_counts_training_steps_only(tmp_path):
    """The Trainer evaluates after ``on_step_end``, with the same reward objects: evaluation's reward time goes to
    ``seconds_outside_steps``, not into the share of training-step time."""
    timed = TimedReward(lambda **k: [float(sum(range(20_000)))])
    monitor = RefinerMonitor(SimpleNamespace(), timed, [timed], table_steps=0, output_dir=str(tmp_path))
    state = SimpleNamespace(global_step=1, is_world_process_zero=True)
    timed()  # an evaluation before the first step
    assert timed.seconds == 0 and timed.seconds_outside_steps > 0
    monitor.on_step_begin(None, state, None)
    before = time.perf_counter()
    timed()
    spent = time.perf_counter() - before
    monitor.on_step_end(None, state, None)
    inside, outside = timed.seconds, timed.seconds_outside_steps
    assert 0 < inside <= spent and monitor.reward_seconds() == inside  # the call's own seconds, no more
    timed()  # the evaluation after the step
    assert timed.seconds == inside and timed.seconds_outside_steps > outside


def stand_in_retrieval(searched: list):
    """A retrieval reward's last completions and what the table reads of its index (top entities recorded)."""

    def top_entities(images, queries, alpha, k):
        searched.append((images.tolist(), queries, alpha, k))
        return [["E2", "E9", "E1"] for _ in queries]

    rec = dict(question="What?", entity_id="E1", reward=2.0, rank=3)
    last = [
        {**rec, "image_key": "path:/i/a.png", "query": "a kite"},
        {**rec, "image_key": "path:/i/b.png", "query": None, "reward": -2.5, "rank": None},  # unparseable
        {**rec, "image_key": "path:/i/c.png", "query": "no embedding"},  # its image never cached
        {**rec, "image_key": "path:/i/a.png", "query": "a hawk", "entity_id": "E7"},
        {**rec, "image_key": "path:/i/a.png", "query": "past max_rows"},
    ]
    return SimpleNamespace(
        last=last,
        image_cache={"path:/i/a.png": np.array([1.0, 0.0]), "path:/i/b.png": np.array([0.0, 1.0])},
        alpha=0.3,
        index=SimpleNamespace(entity_titles={"E1": "Eagle", "E2": "Kite"}, top_entities=top_entities),
    )


def test_table_rows_hold_the_top3_the_gold_title_and_the_total_trl_trains_on(tmp_path):
    """RefinerMonitor.rows with stand-ins: the first ``max_rows`` completions; top-3 titles from one batched search of
    the parsed queries whose image embedding is cached (with the reward's α), an entity without a title by its id;
    the total weighted as TRL weighs the two rewards; no total where the format reward is missing."""
    searched = []
    retrieval = stand_in_retrieval(searched)
    fmt = TimedReward(lambda **k: [])
    fmt.last = [1.0, -4.0, 1.0]  # shorter than the table: the last row has none
    monitor = RefinerMonitor(retrieval, fmt, [fmt], table_steps=1, output_dir=str(tmp_path), max_rows=4)
    monitor.reward_weights = (0.5, 2.0)
    rows = monitor.rows()
    assert searched == [([[1.0, 0.0], [1.0, 0.0]], ["a kite", "a hawk"], 0.3, 3)]
    assert [r["top3"] for r in rows] == [["Kite", "E9", "Eagle"], [], [], ["Kite", "E9", "Eagle"]]
    assert [r["gold_title"] for r in rows] == ["Eagle", "Eagle", "Eagle", "E7"]
    assert [r["format_reward"] for r in rows] == [1.0, -4.0, 1.0, None]
    assert [r["retrieval_reward"] for r in rows] == [2.0, -2.5, 2.0, 2.0]
    assert [r["total_reward"] for r in rows] == [pytest.approx(4.5), pytest.approx(-7.0), pytest.approx(4.5), None]


def test_the_summary_line_shows_each_metric_first_to_last():
    from rl.monitor import summary_line

    assert summary_line("grpo", 3, 12.4, {}, {}) == "grpo: 3 steps in 12 s"
    first, last = {"reward": 1.0, "hit@1": 0.25}, {"reward": 2.5, "hit@1": 0.25}
    assert summary_line("grpo", 3, 12.6, first, last) == "grpo: 3 steps in 13 s; reward 1 → 2.5, hit@1 0.25"


def test_the_table_is_written_every_table_steps_by_process_0_with_the_runs_weights(tmp_path):
    fmt = TimedReward(lambda **k: [])
    fmt.last = [1.0, -4.0, 1.0, 1.0, 1.0]
    monitor = RefinerMonitor(stand_in_retrieval([]), fmt, [fmt], table_steps=2, output_dir=str(tmp_path))
    args = SimpleNamespace(report_to=["none"], reward_weights=[0.5, 2.0])
    for step, zero in ((1, True), (2, True), (3, True), (4, False), (6, True)):
        monitor.on_step_begin(args, SimpleNamespace(global_step=step), None)
        monitor.on_step_end(args, SimpleNamespace(global_step=step, is_world_process_zero=zero), None)
    written = [json.loads(line) for line in open(tmp_path / "samples.jsonl", encoding="utf-8")]
    assert [r["step"] for r in written] == [2] * 5 + [6] * 5  # step 4 was another process's
    assert written[0]["total_reward"] == pytest.approx(0.5 * 1.0 + 2.0 * 2.0)
    assert monitor.step_seconds > 0
    RefinerMonitor(stand_in_retrieval([]), fmt, [fmt], table_steps=0, output_dir=str(tmp_path / "never")).on_step_end(
        args, SimpleNamespace(global_step=2, is_world_process_zero=True), None
    )
    assert not (tmp_path / "never").exists()
