"""RL data stratification, toy-world helpers, and the shipped GRPO configs."""

import json
from pathlib import Path

import pytest

from rl.data import RLDataArgs, bucket_of, build_rl_data, parse_strata, question_dataset, stratified_sample
from rl.toy import COLOUR_SHIFT, attribute_stats, learning_row, warm_start_rows

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_parse_strata():
    s = parse_strata("1-5:500,6-10:1000,11-20:1000,21-200:2500,miss:2000")
    assert s[0] == ("1-5", 1, 5, 500) and s[-1] == ("miss", None, None, 2000)
    for bad in ["1-5", "a-b:3", "5-1:3", "1-5:-1", "1-5:3,4-8:3"]:
        with pytest.raises(ValueError, match="--strata"):
            parse_strata(bad)


@pytest.mark.parametrize("rank,bucket", [(1, "1-5"), (5, "1-5"), (6, "6-10"), (200, "21-200"), (None, "miss"),
                                         (201, None)])
def test_bucket_of(rank, bucket):
    assert bucket_of(rank, parse_strata("1-5:1,6-10:1,11-20:1,21-200:1,miss:1")) == bucket


def test_stratified_sample_fills_what_it_can_and_is_seeded():
    ranks = [1, 2, 3, 7, 8, None, None, None, 50, 300]
    strata = parse_strata("1-5:2,6-10:5,miss:1,21-200:1")
    chosen, report = stratified_sample(ranks, strata, seed=0)
    assert report["6-10"] == {"available": 2, "wanted": 5, "taken": 2}
    assert report["1-5"]["taken"] == 2 and report["miss"]["taken"] == 1 and report["21-200"]["taken"] == 1
    assert len(chosen) == 6 and chosen == sorted(chosen) and 9 not in chosen  # rank 300 is in no bucket
    assert stratified_sample(ranks, strata, seed=0)[0] == chosen


def test_build_rl_data_refuses_unknown_entities(tiny_world, tiny_index_dir, tmp_path):
    rows = [json.loads(x) for x in open(tiny_world / "train.jsonl")][:4]
    rows[1]["entity_id"] = "E9999"
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="not in the index: .*-train"):
        build_rl_data(RLDataArgs(queries=str(tmp_path / "q.jsonl"), index=str(tiny_index_dir), alpha=0.5,
                                 out=str(tmp_path / "o.jsonl"), images_root=str(tiny_world)), log=lambda *a: None)
    assert not (tmp_path / "o.jsonl").exists()


def test_build_rl_data_writes_buckets(tiny_world, tiny_index_dir, tmp_path, monkeypatch, encoders):
    import retrieval.index as ri

    real = ri.MultimodalIndex.load
    monkeypatch.setattr(ri.MultimodalIndex, "load", lambda p, **k: real(p, *encoders))
    out = tmp_path / "rl.jsonl"
    summary = build_rl_data(RLDataArgs(queries=str(tiny_world / "train.jsonl"), index=str(tiny_index_dir), alpha=0.5,
                                       strata="1-5:3,6-24:100", out=str(out), seed=1), log=lambda *a: None)
    rows = [json.loads(x) for x in open(out)]
    assert summary["sampled"] == len(rows) == min(3, summary["buckets"]["1-5"]["available"]) + \
        summary["buckets"]["6-24"]["available"]
    assert all(r["baseline_rank"] is not None and 1 <= r["baseline_rank"] <= 24 for r in rows)
    assert (tmp_path / "rl.jsonl.buckets.png").stat().st_size > 1000


def test_question_dataset_has_the_columns_trl_and_the_rewards_read(tiny_world):
    ds = question_dataset(tiny_world / "test.jsonl", prompt="toy", limit=5)
    assert len(ds) == 5 and {"prompt", "image", "id", "entity_id", "question"} <= set(ds.column_names)
    row = ds[0]
    assert row["image"].size == (56, 56) and row["prompt"][-1] == {"role": "user", "content": row["question"]}


def test_question_dataset_names_a_missing_image(tmp_path):
    (tmp_path / "q.jsonl").write_text(json.dumps({"id": "q1", "image": "nope.png", "question": "?",
                                                  "entity_id": "E1", "answers": []}) + "\n")
    with pytest.raises(ValueError, match="'q1' has no image file"):
        question_dataset(tmp_path / "q.jsonl")


@pytest.mark.parametrize("query,expected", [
    ("Where? red star striped", (3, 0, 3)),
    ("Where? orange star striped", (2, 1, 3)),
    ("Where? red", (1, 0, 1)),
    ("Where does it live?", (0, 0, 0)),
    (None, (0, 0, 0)),
    ("RED Star, striped", (3, 0, 3)),
])
def test_attribute_stats(query, expected):
    assert attribute_stats(query, {"colour": "red", "shape": "star", "pattern": "striped"}) == expected


def test_learning_row():
    gold = [{"colour": "red", "shape": "star", "pattern": "striped"}] * 2
    row = learning_row([1, None], ["q red star striped", "q blue"], gold)
    assert row["R@1"] == 50 and row["R@10"] == 50
    assert row["attribute_accuracy"] == pytest.approx(50.0) and row["wrong_attribute_words"] == pytest.approx(25.0)
    assert row["attribute_words_per_query"] == 2 and row["parse_rate"] == 100
    assert (row["colour_accuracy"], row["shape_accuracy"], row["pattern_accuracy"]) == (50, 50, 50)


def test_warm_start_shift_is_seeded_and_partial(tiny_world):
    rows = warm_start_rows(tiny_world, shift_fraction=0.5, seed=0)
    train = [json.loads(x) for x in open(tiny_world / "train.jsonl")]
    shifted = sum(COLOUR_SHIFT[q["attributes"]["colour"]] in r["completion"][0]["content"]
                  for q, r in zip(train, rows))
    assert 0.25 * len(rows) < shifted < 0.75 * len(rows)
    assert rows == warm_start_rows(tiny_world, shift_fraction=0.5, seed=0)
    assert all(q["attributes"]["colour"] in r["completion"][0]["content"]
               for q, r in zip(train, warm_start_rows(tiny_world, shift_fraction=0.0, seed=0)))


@pytest.mark.parametrize("name,alpha", [("infoseek", 0.63), ("evqa", 0.59)])
def test_paper_configs_parse_and_match_the_paper(name, alpha):
    from trl import GRPOConfig, ModelConfig

    from retrieval.cli import parse
    from rl.train_grpo import RefinerArguments, validate

    args, training, model = parse((RefinerArguments, GRPOConfig, ModelConfig),
                                  ["--config", str(CONFIGS / "grpo" / f"{name}.yaml"), "--use_cpu", "true",
                                   "--bf16", "false"])
    assert args.alpha == alpha and training.num_generations == 5 and training.temperature == 0.7
    assert training.learning_rate == 1e-6 and training.max_steps == 600 and args.freeze_vision_tower
    assert model.model_name_or_path == "Qwen/Qwen2.5-VL-3B-Instruct"
    validate(args, training, model, num_processes=8)  # 20 × 1 × 8 = 160 = 32 prompts × 5
    assert training.per_device_train_batch_size * 8 // training.num_generations == 32
