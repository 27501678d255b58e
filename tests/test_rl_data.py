"""RL data stratification, toy-world helpers, and the shipped GRPO configs."""

import json
from pathlib import Path

import pytest
from PIL import Image

from common.files import check_unique_ids
from rl.data import NOT_IN_INDEX, RLDataArgs, build_rl_data, question_dataset
from rl.strata import bucket_of, held_out_sample, parse_strata, stratified_sample
from toy.refiner import COLOUR_SHIFT, attribute_stats, learning_row, warm_start_rows

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_parse_strata():
    s = parse_strata("1-5:500,6-10:1000,11-20:1000,21-200:2500,miss:2000")
    assert s[0] == ("1-5", 1, 5, 500) and s[-1] == ("miss", None, None, 2000)
    assert parse_strata("1-1:3,2-200:4") == [("1-1", 1, 1, 3), ("2-200", 2, 200, 4)]  # one rank is a bucket
    for bad in [
        "1-5",
        "a-b:3",
        "5-1:3",
        "0-5:3",
        "1-5:-1",
        "1-5:3,4-8:3",
        "1-5:3,5-8:3",
        "1-5:2,miss:3,miss:3",
        "1-5:2,1-5:1",
    ]:
        with pytest.raises(ValueError, match="--strata"):
            parse_strata(bad)


@pytest.mark.parametrize(
    "rank,bucket", [(1, "1-5"), (5, "1-5"), (6, "6-10"), (200, "21-200"), (None, "miss"), (201, None)]
)
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
    whole = stratified_sample([3, 1, 4, 1, 5, 2], parse_strata("1-5:6"), seed=0)[0]
    assert whole == [0, 1, 2, 3, 4, 5]  # a bucket taken whole holds each question once


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def shared_encoders(monkeypatch, encoders):
    """MultimodalIndex.load reuses the session's tiny encoders."""
    import retrieval.index as ri

    real = ri.MultimodalIndex.load
    monkeypatch.setattr(ri.MultimodalIndex, "load", lambda p, **k: real(p, *encoders))


def test_build_rl_data_skips_unknown_entities_and_bad_images(tiny_world, tiny_index_dir, tmp_path, shared_encoders):
    rows = [json.loads(x) for x in open(tiny_world / "train.jsonl", encoding="utf-8")][:6]
    rows[1]["entity_id"] = "E9999"
    rows[2]["image"] = "images/gone.png"
    (tmp_path / "broken.png").write_bytes(b"not a png")
    rows[3]["image"] = str(tmp_path / "broken.png")
    Image.new("RGB", (1000, 4), "red").save(tmp_path / "strip.png")  # the index reads it; the refiner's processor not
    rows[4]["image"] = str(tmp_path / "strip.png")
    out = tmp_path / "o.jsonl"
    lines = []
    summary = build_rl_data(
        RLDataArgs(
            queries=str(write_rows(tmp_path / "q.jsonl", rows)),
            index=str(tiny_index_dir),
            alpha=0.5,
            strata="1-1000:100,miss:100",
            out=str(out),
            depth=1000,
            images_root=str(tiny_world),
        ),
        log=lines.append,
    )
    skipped = {r["id"]: r for r in map(json.loads, open(f"{out}.skipped.jsonl", encoding="utf-8"))}
    assert set(skipped) == {rows[i]["id"] for i in (1, 2, 3, 4)}
    assert skipped[rows[1]["id"]] == {
        "id": rows[1]["id"],
        "entity_id": "E9999",
        "image": rows[1]["image"],
        "reason": NOT_IN_INDEX,
    }
    assert (
        skipped[rows[2]["id"]]["reason"].startswith("image file missing: ")
        and "gone.png" in skipped[rows[2]["id"]]["reason"]
    )
    assert skipped[rows[3]["id"]]["reason"].startswith("image unreadable: ")
    assert "aspect ratio past 200:1" in skipped[rows[4]["id"]]["reason"]  # it was sampled, then dropped in training
    written = [json.loads(x) for x in open(out, encoding="utf-8")]
    assert [r["id"] for r in written] == [rows[i]["id"] for i in (0, 5)]
    assert all(isinstance(r["baseline_rank"], int) for r in written)
    assert summary["skipped"] == 4 and summary["sampled"] == 2 and summary["questions"] == 6
    assert any("left out 4 of 6" in line and "1 with the gold entity not in the index" in line for line in lines)


def test_build_rl_data_writes_an_empty_skip_list_and_refuses_when_nothing_is_usable(
    tiny_world, tiny_index_dir, tmp_path, shared_encoders
):
    rows = [json.loads(x) for x in open(tiny_world / "train.jsonl", encoding="utf-8")][:2]
    args = dict(index=str(tiny_index_dir), alpha=0.5, images_root=str(tiny_world), out=str(tmp_path / "o.jsonl"))
    lines = []
    build_rl_data(RLDataArgs(queries=str(write_rows(tmp_path / "q.jsonl", rows)), **args), log=lines.append)
    assert (tmp_path / "o.jsonl.skipped.jsonl").read_text() == ""
    assert not any("left out" in line for line in lines)  # nothing to say
    bad = [{**r, "entity_id": "E9999"} for r in rows]
    with pytest.raises(ValueError, match="no question is usable"):
        build_rl_data(RLDataArgs(queries=str(write_rows(tmp_path / "bad.jsonl", bad)), **args), log=lambda *a: None)
    assert len((tmp_path / "o.jsonl.skipped.jsonl").read_text().splitlines()) == 2


def test_build_rl_data_refuses_duplicate_ids(tiny_world, tiny_index_dir, tmp_path):
    rows = [json.loads(x) for x in open(tiny_world / "train.jsonl", encoding="utf-8")][:3]
    rows[2]["id"] = rows[0]["id"]
    queries = write_rows(tmp_path / "q.jsonl", rows)
    with pytest.raises(ValueError, match=f"q.jsonl: 1 id value.*: {rows[0]['id']} "):
        build_rl_data(
            RLDataArgs(
                queries=str(queries),
                index=str(tiny_index_dir),
                alpha=0.5,
                out=str(tmp_path / "o.jsonl"),
                images_root=str(tiny_world),
            ),
            log=lambda *a: None,
        )
    assert not (tmp_path / "o.jsonl").exists()


def test_check_unique_ids_names_the_first_ten_duplicates_and_the_source():
    check_unique_ids([{"id": "a"}, {"id": "b"}], "q.jsonl")
    rows = [{"id": f"q{i}"} for i in range(12)] * 2 + [{"id": "z"}]
    with pytest.raises(ValueError, match=r"^q.jsonl: 12 id value\(s\) occur more than once: q0, q1, .*q9 …") as e:
        check_unique_ids(rows, "q.jsonl")
    assert "q10" not in str(e.value) and ", z" not in str(e.value)
    with pytest.raises(ValueError, match="entry_id value"):
        check_unique_ids([{"entry_id": 1}, {"entry_id": "1"}], "kb.jsonl", key="entry_id")


def test_build_rl_data_writes_buckets(tiny_world, tiny_index_dir, tmp_path, shared_encoders):
    out, lines = tmp_path / "rl.jsonl", []
    summary = build_rl_data(
        RLDataArgs(
            queries=str(tiny_world / "train.jsonl"),
            index=str(tiny_index_dir),
            alpha=0.5,
            strata="1-5:3,6-24:100",
            out=str(out),
            seed=1,
        ),
        log=lines.append,
    )
    rows = [json.loads(x) for x in open(out, encoding="utf-8")]
    assert json.loads((tmp_path / "rl.jsonl.buckets.json").read_text(encoding="utf-8")) == summary
    b = summary["buckets"]
    assert b["1-5"]["available"] > 3 and b["6-24"]["available"] < 100  # one bucket filled, one short
    start = lines.index("     1-5:      3 of      3")  # then the image embeddings' own lines
    assert lines[start : start + 3] == [
        "     1-5:      3 of      3",
        f"    6-24: {b['6-24']['taken']:6d} of    100   (only {b['6-24']['available']} available)",
        f"wrote {len(rows)} questions to {out}",
    ]
    assert (
        summary["sampled"]
        == len(rows)
        == min(3, summary["buckets"]["1-5"]["available"]) + summary["buckets"]["6-24"]["available"]
    )
    assert all(r["baseline_rank"] is not None and 1 <= r["baseline_rank"] <= 24 for r in rows)
    assert (tmp_path / "rl.jsonl.buckets.png").stat().st_size > 1000


def test_question_dataset_has_the_columns_trl_and_the_rewards_read(tiny_world):
    ds = question_dataset(tiny_world / "test.jsonl", prompt="toy", limit=5)
    assert len(ds) == 5 and {"prompt", "image", "id", "entity_id", "question", "image_path"} <= set(ds.column_names)
    row = ds[0]
    first = json.loads(open(tiny_world / "test.jsonl", encoding="utf-8").readline())
    assert row["image"].size == (56, 56) and row["prompt"][-1] == {"role": "user", "content": row["question"]}
    assert row["image_path"] == str((tiny_world / first["image"]).resolve()) and Path(row["image_path"]).is_absolute()


def test_question_dataset_leaves_out_bad_images_and_lists_them(tiny_world, tmp_path):
    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")][:4]
    rows[1]["image"] = "images/gone.png"
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    rows[2]["image"] = str(tmp_path / "broken.png")
    queries = write_rows(tmp_path / "q.jsonl", rows)
    lines = []
    ds = question_dataset(
        queries, images_root=tiny_world, prompt="toy", bad_images_dir=tmp_path / "run", log=lines.append
    )
    assert ds["id"] == [rows[0]["id"], rows[3]["id"]]
    bad = [json.loads(x) for x in open(tmp_path / "run" / "q.bad_images.jsonl", encoding="utf-8")]
    assert [(b["id"], b["image"]) for b in bad] == [
        (rows[1]["id"], "images/gone.png"),
        (rows[2]["id"], rows[2]["image"]),
    ]
    assert bad[0]["reason"].startswith("image file missing") and bad[1]["reason"].startswith("image unreadable")
    assert len(lines) == 1 and "left out 2 question(s)" in lines[0] and "q.bad_images.jsonl" in lines[0]
    lines.clear()
    assert len(question_dataset(queries, images_root=tiny_world, prompt="toy", limit=1, log=lines.append)) == 1
    assert lines == [] and not (tmp_path / "q.bad_images.jsonl").exists()  # stopped before the bad ones; no file


def test_an_image_the_processor_would_refuse_for_its_aspect_ratio_is_left_out(tiny_world, tmp_path):
    """Qwen2.5-VL's processor refuses a long side over 200× the short one (transformers' smart_resize): such an
    image (a banner, a strip) decodes fine, so it must be listed when the data loads, not crash the training step
    that samples it."""
    from PIL import Image

    from rl.image_budget import MAX_ASPECT_RATIO

    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")][:3]
    for name, size in (("strip.png", (2010, 10)), ("wide.png", (2000, 10))):
        Image.new("RGB", size, "white").save(tmp_path / name)
    rows[1]["image"], rows[2]["image"] = str(tmp_path / "strip.png"), str(tmp_path / "wide.png")
    ds = question_dataset(
        write_rows(tmp_path / "q.jsonl", rows), images_root=tiny_world, prompt="toy", bad_images_dir=tmp_path / "run"
    )
    assert ds["id"] == [rows[0]["id"], rows[2]["id"]]  # 2000:10 is exactly 200:1, which the processor takes
    (bad,) = [json.loads(x) for x in open(tmp_path / "run" / "q.bad_images.jsonl", encoding="utf-8")]
    assert bad["id"] == rows[1]["id"] and f"past {MAX_ASPECT_RATIO}:1" in bad["reason"]


def test_an_image_past_pils_limit_reaches_the_policy_downscaled(tiny_world, tmp_path, monkeypatch):
    """datasets decodes an Image column with a plain PIL.Image.open, which refuses more than twice PIL's limit: such a
    question would pass every check and stop training at the step that samples it. It goes in downscaled, as the
    index and the reward read it."""
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5_000)  # PIL refuses more than twice this: 10,000 pixels
    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")][:2]
    Image.new("RGB", (200, 100), (200, 30, 30)).save(tmp_path / "big.png")  # 20,000 pixels
    rows[0]["image"] = str(tmp_path / "big.png")
    ds = question_dataset(write_rows(tmp_path / "q.jsonl", rows), images_root=tiny_world, prompt="toy")
    big, small = ds["image"]  # decoded by datasets, as TRL reads them
    assert big.width * big.height <= 5_000 and abs(big.width / big.height - 2) < 0.1
    assert big.getpixel((10, 10))[0] > 150 and small.size == Image.open(tiny_world / rows[1]["image"]).size
    assert ds["image_path"][0] == str(tmp_path / "big.png")  # the reward still reads the file (load_image downscales)


def test_question_dataset_refuses_when_no_image_is_usable(tmp_path):
    queries = write_rows(
        tmp_path / "q.jsonl", [{"id": "q1", "image": "nope.png", "question": "?", "entity_id": "E1", "answers": []}]
    )
    with pytest.raises(ValueError, match=r"q.jsonl holds no question with a usable image \(1 bad\)"):
        question_dataset(queries, log=lambda *a: None)


def test_question_dataset_refuses_duplicate_ids(tiny_world, tmp_path):
    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")][:3]
    rows[1]["id"] = rows[2]["id"] = "dup"
    with pytest.raises(ValueError, match=r"q.jsonl: 1 id value\(s\) occur more than once: dup "):
        question_dataset(write_rows(tmp_path / "q.jsonl", rows), images_root=tiny_world)


def test_a_zero_count_bucket_takes_nothing():
    strata = parse_strata("1-5:0,6-10:2,miss:1")
    assert strata[0] == ("1-5", 1, 5, 0)
    chosen, report = stratified_sample([1, 2, 7, 8, 9, None], strata, seed=0)
    assert report["1-5"] == {"available": 2, "wanted": 0, "taken": 0}
    assert not {0, 1} & set(chosen) and len(chosen) == 3 and 5 in chosen


@pytest.mark.parametrize(
    "name,queries,alpha,strata",
    [
        ("infoseek", "data/infoseek/train.jsonl", 0.63, "1-5:0,6-10:500,11-20:1000,21-200:2500,miss:3000"),
        ("evqa", "data/evqa/train.jsonl", 0.59, "1-5:500,6-10:1000,11-20:1000,21-200:2500,miss:2000"),
    ],
)
def test_rl_data_configs_carry_the_papers_strata(name, queries, alpha, strata):
    from common.cli import parse

    (args,) = parse((RLDataArgs,), ["--config", str(CONFIGS / "grpo" / f"rl_data_{name}.yaml")])
    assert (args.queries, args.alpha, args.strata, args.seed) == (queries, alpha, strata, 0)
    assert args.index == f"indexes/{name}" and args.out == f"data/{name}/rl_train.jsonl"
    assert sum(count for *_, count in parse_strata(args.strata)) == 7000


@pytest.mark.parametrize(
    "query,expected",
    [
        ("Where? red star striped", (3, 0, 3)),
        ("Where? orange star striped", (2, 1, 3)),
        ("Where? red", (1, 0, 1)),
        ("Where does it live?", (0, 0, 0)),
        (None, (0, 0, 0)),
        ("RED Star, striped", (3, 0, 3)),
    ],
)
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
    train = [json.loads(x) for x in open(tiny_world / "train.jsonl", encoding="utf-8")]
    shifted = sum(COLOUR_SHIFT[q["attributes"]["colour"]] in r["completion"][0]["content"] for q, r in zip(train, rows))
    assert 0.25 * len(rows) < shifted < 0.75 * len(rows)
    assert rows == warm_start_rows(tiny_world, shift_fraction=0.5, seed=0)
    assert all(
        q["attributes"]["colour"] in r["completion"][0]["content"]
        for q, r in zip(train, warm_start_rows(tiny_world, shift_fraction=0.0, seed=0))
    )


@pytest.mark.parametrize("name,alpha", [("infoseek", 0.63), ("evqa", 0.59)])
def test_paper_configs_parse_and_match_the_paper(name, alpha):
    from trl import GRPOConfig, ModelConfig

    from common.cli import parse
    from rl.arguments import RefinerArguments, validate

    args, training, model = parse(
        (RefinerArguments, GRPOConfig, ModelConfig),
        ["--config", str(CONFIGS / "grpo" / f"{name}.yaml"), "--use_cpu", "true", "--bf16", "false"],
    )
    assert args.alpha == alpha and training.num_generations == 5 and training.temperature == 0.7
    assert training.learning_rate == 1e-6 and training.max_steps == 600 and args.freeze_vision_tower
    assert model.model_name_or_path == "Qwen/Qwen2.5-VL-3B-Instruct"
    assert "32 prompts × 5 generations = 160 completions per optimizer step" in validate(
        args, training, model, num_processes=8
    )  # 20 × 1 × 8 = 160 = 32 prompts × 5
    assert training.per_device_train_batch_size * 8 // training.num_generations == 32


def test_a_generation_batch_of_several_steps_is_whole_groups_not_whole_steps():
    """TRL asks whole prompt groups of its generation batch (per device × processes × steps_per_generation), not of
    each optimizer step: 2 per device on 8 processes is 16 completions a step, generated 80 at a time."""
    from trl import GRPOConfig, ModelConfig

    from common.cli import parse
    from rl.arguments import RefinerArguments, validate

    flags = ["--use_cpu", "true", "--bf16", "false", "--per_device_train_batch_size", "2"]
    flags += ["--steps_per_generation", "5"]
    args, training, model = parse(
        (RefinerArguments, GRPOConfig, ModelConfig), ["--config", str(CONFIGS / "grpo" / "evqa.yaml"), *flags]
    )
    assert validate(args, training, model, num_processes=8) == (
        "batch geometry: 16 completions per optimizer step (8 processes × 2 × 1 accumulation); generated 16 prompts "
        "× 5 generations = 80 completions at a time (steps_per_generation 5)"
    )


def test_held_out_sample_takes_the_rest_seeded_and_none_about_a_sampled_image():
    assert held_out_sample(10, [1, 2, 3], 20, 0) == [0, 4, 5, 6, 7, 8, 9]  # all the rest when fewer than asked
    assert held_out_sample(10, [1, 2, 3], 0, 0) == []
    picked = held_out_sample(100, [], 5, 0)
    assert len(picked) == 5 and picked == sorted(picked) == held_out_sample(100, [], 5, 0) != held_out_sample(
        100, [], 5, 1
    )
    assert not {7, 8} & set(held_out_sample(10, [7, 8], 7, 3))  # none of the chosen, whatever the draw
    # a question about an image the RL sample trains on is not held out (it shared 3 of 9 images with 3 per image)
    images = ["a", "a", "b", "c", "c", "d", "b"]
    assert held_out_sample(7, [0, 3], 20, 0, images) == [2, 5, 6]
    assert held_out_sample(7, [0, 3], 20, 0) == [1, 2, 4, 5, 6]


def test_held_out_questions_are_never_in_the_rl_sample(tiny_world, tiny_index_dir, tmp_path, shared_encoders):
    """--eval_out: questions for checkpoint selection that the RL sample does not hold, with their ranks and stored
    image embeddings (InfoSeek reports on its val split, so checkpoints are chosen on these instead)."""
    from rl.image_embeddings import load_store

    out, held = tmp_path / "rl.jsonl", tmp_path / "rl_eval.jsonl"
    args = dict(queries=str(tiny_world / "train.jsonl"), index=str(tiny_index_dir), alpha=0.5, seed=1)
    summary = build_rl_data(
        RLDataArgs(**args, strata="1-5:5,6-24:5,miss:5", out=str(out), eval_out=str(held), eval_questions=12),
        log=lambda *a: None,
    )
    train = {r["id"] for r in map(json.loads, open(out, encoding="utf-8"))}
    rows = [json.loads(x) for x in open(held, encoding="utf-8")]
    assert summary["questions"] - summary["skipped"] - summary["sampled"] > 12  # more left than asked for
    assert len(rows) == summary["held_out"] == 12 and not train & {r["id"] for r in rows}
    assert all("baseline_rank" in r for r in rows)
    manifest = json.loads((tiny_index_dir / "manifest.json").read_text())
    assert {r["image"] for r in rows} == set(load_store(held, manifest))  # each file's own images, no others
    train_images = {r["image"] for r in map(json.loads, open(out, encoding="utf-8"))}
    assert train_images == set(load_store(out, manifest))
    assert not train_images & {r["image"] for r in rows}
    said = []  # fewer left than asked for: said, not only counted
    more = dict(strata="1-5:5,6-24:5,miss:5", out=str(tmp_path / "rl2.jsonl"), eval_out=str(held), eval_questions=999)
    left = build_rl_data(RLDataArgs(**args, **more), log=said.append)["held_out"]
    assert f"wrote {left} held-out questions (of 999 asked: no more left), none of them in" in "\n".join(said)
    with pytest.raises(ValueError, match="--eval_out needs"):
        build_rl_data(RLDataArgs(**args, out=str(out), eval_out=str(out)), log=lambda *a: None)


def test_strata_deeper_than_the_depth_are_refused_before_any_retrieval(tmp_path, tiny_world, tiny_index_dir):
    """Ranks past --depth come back as misses, so a 21-200 bucket at depth 100 would silently miss its ranks 101-200."""
    args = RLDataArgs(
        queries=str(tiny_world / "train.jsonl"), index=str(tiny_index_dir), alpha=0.5, out=str(tmp_path / "rl.jsonl")
    )
    args.strata, args.depth = "1-5:1,21-200:1", 100
    with pytest.raises(ValueError, match="reaches rank 200, deeper than --depth 100"):
        build_rl_data(args, log=lambda *a: None)
    assert not (tmp_path / "rl.jsonl.baseline.jsonl").exists()


@pytest.mark.parametrize("mode", ["CMYK", "F", "I"])
def test_a_question_image_in_a_mode_no_png_holds_reaches_a_vllm_server_as_rgb(tiny_world, tmp_path, mode):
    """TRL's vLLM client sends each question image to a server as PNG (``pil_to_base64``): a CMYK JPEG in the
    training file ended the run at the step that sampled it. It goes in as the RGB pixels the processor, colocated
    vLLM and the reward's image embeddings all see (``load_image``)."""
    import numpy as np
    from PIL import Image
    from trl.generation.vllm_client import to_openai_messages

    from retrieval.kb import load_image

    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")][:2]
    source = Image.open(tiny_world / rows[0]["image"]).convert(mode)
    name = "odd.jpg" if mode == "CMYK" else "odd.tif"  # a CMYK JPEG; a TIFF of 32-bit floats or integers
    source.save(tmp_path / name)
    assert Image.open(tmp_path / name).mode == mode
    rows[0]["image"] = str(tmp_path / name)
    ds = question_dataset(write_rows(tmp_path / "q.jsonl", rows), images_root=tiny_world, prompt="toy")
    odd, plain = ds["image"]  # decoded by datasets, as TRL hands them on
    assert odd.mode == "RGB" and np.array_equal(np.asarray(odd), np.asarray(load_image(tmp_path / name)[0]))
    assert ds["image_path"][0] == str(tmp_path / name)  # the reward still reads the file itself
    for im in (odd, plain):  # TRL's own conversion for the server, which raised OSError for the mode
        messages = [{"role": "user", "content": [{"type": "image", "image": im}, {"type": "text", "text": "?"}]}]
        (sent,) = to_openai_messages(messages)
        assert sent["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")


def test_question_dataset_takes_the_path_as_a_string(tiny_world, tmp_path):
    """rl.train_grpo passes --train_file as the string it was given."""
    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")][:2]
    rows[1]["image"] = "images/gone.png"
    queries = str(write_rows(tmp_path / "q.jsonl", rows))
    lines = []
    ds = question_dataset(queries, images_root=tiny_world, prompt="toy", bad_images_dir=tmp_path, log=lines.append)
    assert ds["id"] == [rows[0]["id"]] and (tmp_path / "q.bad_images.jsonl").exists()
    listed = tmp_path / "q.bad_images.jsonl"
    assert lines == [f"{queries}: left out 1 question(s) whose image is missing or unreadable, listed in {listed}"]


def test_a_plain_question_image_is_held_by_its_path_not_copied_into_the_dataset(tiny_world, tmp_path):
    """Only an image no PNG holds, or one past PIL's limit, goes in as bytes: every question image held in memory
    would grow the dataset by the whole image folder."""
    from datasets import Image as ImageColumn

    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")][:1]
    Image.open(tiny_world / rows[0]["image"]).convert("L").save(tmp_path / "grey.png")
    rows.append({**rows[0], "id": "grey", "image": str(tmp_path / "grey.png")})
    ds = question_dataset(write_rows(tmp_path / "q.jsonl", rows), images_root=tiny_world, prompt="toy")
    stored = ds.cast_column("image", ImageColumn(decode=False))["image"]
    assert stored == [
        {"path": str((tiny_world / rows[0]["image"]).resolve()), "bytes": None},
        {"path": str(tmp_path / "grey.png"), "bytes": None},
    ]
    assert ds[1]["image"].mode == "L"  # the file's own pixels; the processor converts them as it does any image


def test_image_column_value_names_why_an_image_in_a_mode_no_png_holds_does_not_load(tmp_path):
    """A CMYK JPEG whose header reads but whose data is cut short: a ValueError saying so, not an AttributeError."""
    import io

    import numpy as np

    from rl.data import image_column_value

    pixels = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").convert("CMYK").save(buffer, "JPEG")
    (tmp_path / "cut.jpg").write_bytes(buffer.getvalue()[:-2000])
    assert Image.open(tmp_path / "cut.jpg").mode == "CMYK"
    with pytest.raises(ValueError, match=r"^image unreadable: .*cut\.jpg .*truncated"):
        image_column_value(str(tmp_path / "cut.jpg"))


class EntitiesOf:
    def __init__(self, *known):
        self.known = set(known)

    def has_entity(self, entity_id):
        return entity_id in self.known


@pytest.mark.parametrize(
    "absent,shown",
    [
        (["E1"], "E1"),
        ([f"E{i}" for i in range(1, 6)], "E1, E2, E3, E4, E5"),
        ([f"E{i}" for i in range(1, 7)], "E1, E2, E3, E4, E5 …"),
    ],
)
def test_warn_absent_entities_counts_each_entity_once_and_shows_five(capsys, absent, shown):
    from rl.data import warn_absent_entities

    data = {"entity_id": ["K1", *absent, *absent, "K2"]}  # two questions about each
    warn_absent_entities(EntitiesOf("K1", "K2"), data, "train_file")
    assert capsys.readouterr().out == (
        f"warning: train_file: {len(absent)} gold entities are not in the index (their questions always miss): "
        f"{shown}; python -m rl.data drops such questions\n"
    )
    warn_absent_entities(EntitiesOf("K1", "K2", *absent), data, "train_file")
    assert capsys.readouterr().out == ""


def test_an_image_past_pils_limit_is_kept_or_left_out_as_training_will_read_it(
    tiny_world, tiny_index_dir, tmp_path, shared_encoders, monkeypatch
):
    """Training decodes an image past PIL's limit downscaled (``load_image``) and checks that picture's aspect
    (``verify_images``): the RL file keeps exactly the questions training will keep, ranked."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5_000)  # PIL refuses more than twice this: 10,000 pixels
    rows = [json.loads(x) for x in open(tiny_world / "train.jsonl", encoding="utf-8")][:3]
    Image.new("RGB", (200, 100), "red").save(tmp_path / "big.png")  # 20,000 pixels, 2:1
    Image.new("RGB", (4000, 10), "red").save(tmp_path / "thin.png")  # 40,000 pixels, 400:1 (333:1 downscaled)
    rows[0]["image"], rows[1]["image"] = str(tmp_path / "big.png"), str(tmp_path / "thin.png")
    queries = write_rows(tmp_path / "q.jsonl", rows)
    out = tmp_path / "o.jsonl"
    args = RLDataArgs(
        queries=str(queries),
        index=str(tiny_index_dir),
        alpha=0.5,
        strata="1-1000:100,miss:100",
        depth=1000,
        out=str(out),
        images_root=str(tiny_world),
        embed_images=False,
    )
    build_rl_data(args, log=lambda *a: None)
    written = [json.loads(x)["id"] for x in open(out, encoding="utf-8")]
    (skipped,) = map(json.loads, open(f"{out}.skipped.jsonl", encoding="utf-8"))
    assert written == [rows[0]["id"], rows[2]["id"]]
    assert skipped["id"] == rows[1]["id"] and "aspect ratio past 200:1" in skipped["reason"]
    ds = question_dataset(out, images_root=tiny_world, prompt="toy", log=lambda *a: None)
    assert ds["id"] == written  # training leaves none of them out


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(queries="none.jsonl"), r"^--queries: file 'none.jsonl' does not exist"),
        (dict(index="no_index"), r"^--index: 'no_index' is not a finished index directory"),
        (dict(alpha=None), r"^--alpha is required"),
        (dict(alpha=1.5), r"^alpha must be in \[0, 1\], got 1.5"),
        (dict(out=None), r"^--out is required"),
        (dict(eval_out="held.jsonl", eval_questions=0), r"^--eval_out needs --eval_questions > 0"),
        (dict(eval_out="held.jsonl", eval_questions=-1), r"^--eval_out needs --eval_questions > 0"),
        (dict(strata="miss:3", depth=0), r"^--depth must be a positive integer, got 0"),
    ],
)
def test_build_rl_data_refuses_bad_arguments_before_any_retrieval(
    tiny_world, tiny_index_dir, tmp_path, monkeypatch, change, message
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "q.jsonl").write_text((tiny_world / "train.jsonl").read_text(encoding="utf-8"), encoding="utf-8")
    args = dict(queries="q.jsonl", index=str(tiny_index_dir), alpha=0.5, out="o.jsonl", images_root=str(tiny_world))
    with pytest.raises(ValueError, match=message):
        build_rl_data(RLDataArgs(**{**args, **change}), log=lambda *a: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.jsonl"]  # nothing recorded, nothing written


def test_build_rl_data_resumes_its_baseline_and_refuses_one_made_with_other_settings(
    tiny_world, tiny_index_dir, tmp_path, shared_encoders
):
    """An interrupted run goes on from ``<out>.baseline.jsonl``; records made with another α are refused, not mixed
    in. A 2-hop question (a list of gold entities) is listed with its own reason, and one held-out question is
    asked and given."""
    rows = [json.loads(x) for x in open(tiny_world / "train.jsonl", encoding="utf-8")][:4]
    rows[3]["entity_id"] = [rows[0]["entity_id"], rows[1]["entity_id"]]
    queries, out = write_rows(tmp_path / "q.jsonl", rows), tmp_path / "o.jsonl"
    settings = {"queries": str(queries.resolve()), "index": str(tiny_index_dir.resolve()), "alpha": 0.5}
    settings["depth"] = 1000
    baseline = tmp_path / "o.jsonl.baseline.jsonl"
    recorded = tmp_path / "o.jsonl.baseline.settings.json"
    args = dict(queries=str(queries), index=str(tiny_index_dir), strata="1-699:0,700-1000:9", depth=1000, out=str(out))
    args.update(images_root=str(tiny_world), embed_images=False, eval_out=str(tmp_path / "held.jsonl"))
    for alpha, rank in ((0.5, 777), (0.3, 1)):
        recorded.write_text(json.dumps({**settings, "alpha": alpha}), encoding="utf-8")
        baseline.write_text(json.dumps({"id": rows[0]["id"], "rank": rank}) + "\n", encoding="utf-8")
        lines = []
        if alpha != 0.5:
            with pytest.raises(ValueError, match=r"other settings \(alpha: 0.3 then, 0.5 now\)"):
                build_rl_data(RLDataArgs(alpha=0.5, **args), log=lines.append)
            continue
        summary = build_rl_data(RLDataArgs(alpha=0.5, eval_questions=1, **args), log=lines.append)
        assert "baseline retrieval, process 0/1: 1 of 3 done" in "\n".join(lines)
        written = {r["id"]: r["baseline_rank"] for r in map(json.loads, open(out, encoding="utf-8"))}
        held = {r["id"]: r["baseline_rank"] for r in map(json.loads, open(tmp_path / "held.jsonl", encoding="utf-8"))}
        assert written == {rows[0]["id"]: 777}  # its rank taken from the file, not ranked again (24 entities)
        assert summary["held_out"] == 1 and set(held) <= {rows[1]["id"], rows[2]["id"]}
        (skipped,) = map(json.loads, open(f"{out}.skipped.jsonl", encoding="utf-8"))
        assert skipped["id"] == rows[3]["id"] and skipped["reason"].startswith("2-hop question")
        assert not baseline.exists() and not recorded.exists()  # removed once the file is written
        assert not (tmp_path / "o.jsonl.image-embeddings").exists()  # --embed_images false
