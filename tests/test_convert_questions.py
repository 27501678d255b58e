"""Question converters on the real InfoSeek rows in tests/data/realdata (real rows, their sources in SOURCES.md) and on
E-VQA CSV fixtures written from the
upstream documentation (columns, `|` / `&&` separators, id shapes, a 2-hop row, a multi-answer row)."""

import csv
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.files import read_jsonl
from retrieval.upstream.convert import ConvertArgs, convert
from retrieval.upstream.questions import (
    ImageFinder,
    evqa_image_candidates,
    evqa_questions,
    infoseek_image_candidates,
    infoseek_questions,
    parse_subdirs,
    read_id2name,
    section_index,
)

REAL = Path(__file__).resolve().parent / "data" / "realdata"  # real rows, their sources in SOURCES.md
EVQA_COLUMNS = [
    "question",
    "answer",
    "dataset_image_ids",
    "dataset_name",
    "dataset_category_id",
    "question_type",
    "wikipedia_url",
    "wikipedia_title",
    "evidence",
    "evidence_section_id",
    "evidence_section_title",
    "encyclopedic_vqa_split",
    "question_original",
    "wikipedia_url_used_in_train",
]
LANDMARK = "8b3e4a5c6d7e8f90"


def quiet(*a):
    pass


def touch(root: Path, rel: str):
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(b"x")


def evqa_row(**kw):
    base = dict(
        question="Where is it found?",
        answer="Europe|European continent",
        dataset_image_ids="1234|5678",
        dataset_name="inaturalist",
        dataset_category_id="77",
        question_type="templated",
        wikipedia_url="https://en.wikipedia.org/wiki/X",
        wikipedia_title="X",
        evidence="It lives in Europe.",
        evidence_section_id="3",
        evidence_section_title="Distribution",
        encyclopedic_vqa_split="test",
        question_original="",
        wikipedia_url_used_in_train="False",
    )
    return {**base, **kw}


def write_csv(path, rows, columns=EVQA_COLUMNS):
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)


def evqa_files(tmp_path):
    """An images root laid out like the upstream downloads, and a CSV mixing both datasets."""
    root = tmp_path / "images"
    touch(root, f"landmarks/8/b/3/{LANDMARK}.jpg")
    touch(root, "inaturalist/1234.JPEG")  # .JPEG occurs
    touch(root, "inaturalist/2222.jpg")
    write_csv(
        tmp_path / "test.csv",
        [
            evqa_row(),  # 0 kept → E-VQA_0
            evqa_row(
                question="Hop?",
                question_type="2_hop",
                evidence_section_id="2|5",  # 1 2-hop, not counted
                wikipedia_url="https://en.wikipedia.org/wiki/A|https://en.wikipedia.org/wiki/B",
            ),
            evqa_row(
                question="Which two?",
                answer="red && blue|blue&&red",
                question_type="multi_answer",
                dataset_name="landmarks",
                dataset_image_ids=LANDMARK,
            ),  # 2 kept → E-VQA_1
            evqa_row(
                question="Gone?", dataset_image_ids="9999", question_type="automatic"
            ),  # 3 no file → E-VQA_2 skipped
            evqa_row(question="Second image", dataset_image_ids="2222|1234"),  # 4 → E-VQA_3
        ],
    )
    return root


def test_evqa_csv_per_dataset_image_rules_ids_and_upstream_names(tmp_path, caplog):
    root = evqa_files(tmp_path)
    n = convert(
        ConvertArgs(
            format="evqa-questions",
            input=str(tmp_path / "test.csv"),
            split="test",
            images_root=str(root),
            out=str(tmp_path / "q.jsonl"),
        ),
        log=quiet,
    )
    rows = {r["question"]: r for r in read_jsonl(tmp_path / "q.jsonl")}
    assert n == 3 and set(rows) == {"Where is it found?", "Which two?", "Second image"}
    first = rows["Where is it found?"]
    assert first["id"] == "evqa-test-0" and first["upstream_id"] == "E-VQA_0"
    assert first["image"] == "inaturalist/1234.JPEG" and first["answers"] == ["Europe", "European continent"]
    assert first["entity_id"] == "https://en.wikipedia.org/wiki/X" and first["evidence_section_id"] == 3
    assert "answer_parts" not in first  # only a row whose answer has `&&` parts carries them
    multi = rows["Which two?"]
    assert multi["image"] == f"landmarks/8/b/3/{LANDMARK}.jpg" and multi["upstream_id"] == "E-VQA_1"
    assert multi["answer_parts"] == [["red", "blue"], ["blue", "red"]] and multi["id"] == "evqa-test-2"
    # E-VQA_{k} counts kept-type rows as EchoSight/WikiSeeker load them: the skipped row 3 still takes E-VQA_2
    assert rows["Second image"]["upstream_id"] == "E-VQA_3" and rows["Second image"]["image"] == "inaturalist/2222.jpg"
    skipped = list(read_jsonl(tmp_path / "q.jsonl.skipped.jsonl"))
    assert [(s["row"], s.get("image_id")) for s in skipped] == [(1, None), (3, "9999")]  # the 2-hop row is listed too
    assert "2_hop" in skipped[0]["reason"]
    assert "inaturalist/9999.jpg" in skipped[1]["reason"] and "inaturalist/9999.JPEG" in skipped[1]["reason"]
    assert "images_root" not in caplog.text  # the files were checked


def test_evqa_two_hop_gives_lists_never_joined_strings(tmp_path):
    root = evqa_files(tmp_path)
    convert(
        ConvertArgs(
            format="evqa-questions",
            input=str(tmp_path / "test.csv"),
            split="test",
            images_root=str(root),
            include_two_hop=True,
            out=str(tmp_path / "q.jsonl"),
        ),
        log=quiet,
    )
    hop = next(r for r in read_jsonl(tmp_path / "q.jsonl") if r["question_type"] == "2_hop")
    assert hop["entity_id"] == ["https://en.wikipedia.org/wiki/A", "https://en.wikipedia.org/wiki/B"]
    assert hop["evidence_section_id"] == [2, 5] and "upstream_id" not in hop and hop["id"] == "evqa-test-1"


def test_a_csv_saved_with_a_byte_order_mark_converts(tmp_path):
    """Spreadsheet tools save CSV with a UTF-8 byte order mark: the first column is still "question", not
    "\\ufeffquestion" (which read as a missing column)."""
    plain, bom = tmp_path / "plain.csv", tmp_path / "bom.csv"
    write_csv(plain, [evqa_row()])
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    out = {}
    for path in (plain, bom):
        args = ConvertArgs(
            format="evqa-questions", input=str(path), split="val", out=str(tmp_path / f"{path.stem}.jsonl")
        )
        convert(args, log=quiet)
        out[path.stem] = list(read_jsonl(tmp_path / f"{path.stem}.jsonl"))
    assert out["bom"] == out["plain"] and out["plain"]


def test_evqa_inaturalist_through_echosight_id2name(tmp_path):
    root = tmp_path / "images"
    touch(root, "inaturalist/val/04312_Plantae_x/abc.jpg")
    (tmp_path / "id2name.json").write_text(json.dumps({"1234": "val/04312_Plantae_x/abc.jpg"}))
    write_csv(tmp_path / "t.csv", [evqa_row(), evqa_row(dataset_image_ids="5555")])
    n = convert(
        ConvertArgs(
            format="evqa-questions",
            input=str(tmp_path / "t.csv"),
            split="val",
            images_root=str(root),
            inat_id2name=str(tmp_path / "id2name.json"),
            out=str(tmp_path / "q.jsonl"),
        ),
        log=quiet,
    )
    assert n == 1 and next(read_jsonl(tmp_path / "q.jsonl"))["image"] == "inaturalist/val/04312_Plantae_x/abc.jpg"
    assert "map" in next(read_jsonl(tmp_path / "q.jsonl.skipped.jsonl"))["reason"]


def test_evqa_ids_unique_across_splits_and_all_images():
    find = ImageFinder(None)
    rows = [evqa_row(), evqa_row()]
    ids = [r["id"] for s in ("train", "val", "test") for r in evqa_questions(rows, find, quiet, split=s)]
    assert len(ids) == len(set(ids)) == 6
    per_image = list(evqa_questions(rows[:1], find, quiet, split="train", all_images=True))
    assert [r["id"] for r in per_image] == ["evqa-train-0-0", "evqa-train-0-1"]
    assert {r["upstream_id"] for r in per_image} == {"E-VQA_0"}
    for split in ("my split", "", None):
        with pytest.raises(ValueError, match="split must name"):
            list(evqa_questions(rows, find, quiet, split=split))


def test_echosight_infoseek_csv_keeps_its_data_id(tmp_path):
    root = tmp_path / "images"
    touch(root, "infoseek/oven_05050169.JPEG")
    write_csv(
        tmp_path / "infoseek_test_filtered.csv",
        [
            evqa_row(
                data_id="infoseek_val_00000007",
                dataset_name="infoseek",
                question_type="infoseek",
                dataset_image_ids="oven_05050169",
                answer="France",
                wikipedia_url="https://en.wikipedia.org/wiki/Paris",
            )
        ],
        EVQA_COLUMNS + ["data_id"],
    )
    convert(
        ConvertArgs(
            format="infoseek-csv",
            input=str(tmp_path / "infoseek_test_filtered.csv"),
            split="val",
            images_root=str(root),
            out=str(tmp_path / "q.jsonl"),
        ),
        log=quiet,
    )
    (q,) = read_jsonl(tmp_path / "q.jsonl")
    assert q["id"] == q["upstream_id"] == "infoseek_val_00000007" and q["image"] == "infoseek/oven_05050169.JPEG"


def test_unknown_dataset_or_question_type_is_listed_not_raised(tmp_path, caplog):
    write_csv(tmp_path / "t.csv", [evqa_row(dataset_name="imagenet"), evqa_row(question_type="weird"), evqa_row()])
    with caplog.at_level("WARNING", logger="refine_rl.convert"):
        n = convert(
            ConvertArgs(
                format="evqa-questions", input=str(tmp_path / "t.csv"), split="val", out=str(tmp_path / "q.jsonl")
            ),
            log=quiet,
        )
    reasons = [s["reason"] for s in read_jsonl(tmp_path / "q.jsonl.skipped.jsonl")]
    assert n == 1 and any("imagenet" in r for r in reasons) and any("weird" in r for r in reasons)
    assert "no --images_root: image files are not checked" in caplog.text


# --------------------------------------------------------------------------- InfoSeek: the real rows


def infoseek_images(tmp_path, rows, layout):
    root = tmp_path / "images"
    for r in rows:
        touch(root, infoseek_image_candidates(r["image_id"], layout)[0])
    return root


def test_a_short_infoseek_image_id_never_becomes_an_absolute_path():
    """OVEN's layout takes the folder from the id's [-8:-6]: an id too short for it has no folder, not "/id.jpg"
    (which joined to the images root would look at the file system's root)."""
    assert infoseek_image_candidates("oven_1", "oven")[0] == "oven_1.jpg"
    assert infoseek_image_candidates("oven_04990048", "oven")[0] == "04/oven_04990048.jpg"


def test_a_numeric_infoseek_answer_is_one_answer(tmp_path):
    """InfoSeek's "answer" is a list of strings; a bare value (a number, as a hand-made file may hold) is one answer,
    not an error about iterating an int."""
    rows = list(read_jsonl(REAL / "infoseek_val_sample.jsonl"))
    rows[0]["answer"] = 1889
    src = tmp_path / "val.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    convert(
        ConvertArgs(
            format="infoseek",
            input=str(src),
            withkb=str(REAL / "infoseek_val_withkb_sample.jsonl"),
            qtype=str(REAL / "infoseek_val_qtype_sample.jsonl"),
            images_root=str(infoseek_images(tmp_path, rows, "oven")),
            out=str(tmp_path / "q.jsonl"),
        ),
        log=quiet,
    )
    (q,) = read_jsonl(tmp_path / "q.jsonl")
    assert q["answers"] == [1889]


@pytest.mark.parametrize("layout", ["oven", "flat"])
def test_real_infoseek_val_rows_with_qtype_and_withkb(tmp_path, layout):
    rows = list(read_jsonl(REAL / "infoseek_val_sample.jsonl"))
    root = infoseek_images(tmp_path, rows, layout)
    n = convert(
        ConvertArgs(
            format="infoseek",
            input=str(REAL / "infoseek_val_sample.jsonl"),
            withkb=str(REAL / "infoseek_val_withkb_sample.jsonl"),
            qtype=str(REAL / "infoseek_val_qtype_sample.jsonl"),
            images_root=str(root),
            image_layout=layout,
            out=str(tmp_path / "q.jsonl"),
        ),
        log=quiet,
    )
    (q,) = read_jsonl(tmp_path / "q.jsonl")  # only infoseek_val_00000000 has its withkb row in the sample
    assert n == 1 and q["id"] == "infoseek_val_00000000" and q["question_type"] == "String"
    assert q["entity_id"].startswith("Q") and q["split"] == "val_unseen_question"
    assert q["answer_eval"] == rows[0]["answer_eval"] and q["answers"] == rows[0]["answer"]
    assert q["image"] == ("04/oven_04990048.jpg" if layout == "oven" else "oven_04990048.jpg")
    skipped = list(read_jsonl(tmp_path / "q.jsonl.skipped.jsonl"))
    assert len(skipped) == len(rows) - 1 and all("withkb" in s["reason"] for s in skipped)


def test_real_infoseek_rows_for_inference_without_entities(tmp_path):
    rows = list(read_jsonl(REAL / "infoseek_val_sample.jsonl")) + list(read_jsonl(REAL / "infoseek_test_sample.jsonl"))
    root = infoseek_images(tmp_path, rows, "oven")
    for name in ("infoseek_val_sample.jsonl", "infoseek_test_sample.jsonl"):
        out = tmp_path / f"{name}.out.jsonl"
        n = convert(
            ConvertArgs(
                format="infoseek",
                input=str(REAL / name),
                qtype=str(REAL / "infoseek_val_qtype_sample.jsonl"),
                images_root=str(root),
                require_entity=False,
                out=str(out),
            ),
            log=quiet,
        )
        assert n == sum(1 for _ in read_jsonl(REAL / name)) and not Path(f"{out}.skipped.jsonl").exists()
    (test_q,) = read_jsonl(tmp_path / "infoseek_test_sample.jsonl.out.jsonl")
    assert test_q["entity_id"] is None and test_q["answers"] == [] and test_q["image"] == "05/oven_05494604.jpg"
    val = list(read_jsonl(tmp_path / "infoseek_val_sample.jsonl.out.jsonl"))
    assert {q["question_type"] for q in val} == {"String", "Time"}  # every val row got its type from the qtype file
    multi = [q for q in val if len(q["answers"]) > 1]
    assert multi, "the real sample has rows with several answers"


def test_numeric_answer_eval_object_is_kept_as_is(tmp_path):
    rows = [
        r
        for r in read_jsonl(REAL / "infoseek_train_rows_as_rewritten_by_notebook.jsonl")
        if r["question_type"] == "Numerical"
    ][:2]
    raw = [
        {k: r[k] for k in ("data_id", "image_id", "question", "answer", "answer_eval")} | {"data_split": "train"}
        for r in rows
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in raw))
    (tmp_path / "withkb.jsonl").write_text(
        "".join(
            json.dumps({"data_id": r["data_id"], "entity_id": r["entity_id"], "entity_text": r["entity_text"]}) + "\n"
            for r in rows
        )
    )
    convert(
        ConvertArgs(
            format="infoseek",
            input=str(tmp_path / "train.jsonl"),
            withkb=str(tmp_path / "withkb.jsonl"),
            out=str(tmp_path / "q.jsonl"),
        ),
        log=quiet,
    )
    out = list(read_jsonl(tmp_path / "q.jsonl"))
    assert [q["answer_eval"] for q in out] == [r["answer_eval"] for r in rows]
    assert isinstance(out[0]["answer_eval"][0], dict) and set(out[0]["answer_eval"][0]) == {"wikidata", "range"}
    assert out[0]["entity_text"] == rows[0]["entity_text"]


def test_infoseek_rows_convert_without_a_withkb_or_qtype_map():
    """Called without the withkb / qtype maps, rows keep what they carry themselves (test rows: no entity)."""
    rows = list(read_jsonl(REAL / "infoseek_test_sample.jsonl"))
    out = list(infoseek_questions(rows, ImageFinder(None), quiet, require_entity=False))
    assert [q["id"] for q in out] == [r["data_id"] for r in rows] and all(q["entity_id"] is None for q in out)


@pytest.mark.parametrize("field", ["data_id", "image_id", "question"])
def test_an_infoseek_row_without_an_id_image_or_question_is_listed(field):
    rows = list(read_jsonl(REAL / "infoseek_val_sample.jsonl"))[:3]
    rows[0][field] = ""
    del rows[1][field]
    skipped = []
    out = list(infoseek_questions(rows, ImageFinder(None), skipped.append, require_entity=False))
    assert [q["id"] for q in out] == [rows[2]["data_id"]]
    ids = [r.get("data_id") or None for r in rows[:2]]
    assert skipped == [{"id": i, "reason": "row lacks data_id, image_id or question"} for i in ids]


def test_an_infoseek_row_whose_image_is_not_there_is_listed(tmp_path):
    rows = list(read_jsonl(REAL / "infoseek_val_sample.jsonl"))[:2]
    root = infoseek_images(tmp_path, rows[1:], "oven")
    skipped = []
    out = list(infoseek_questions(rows, ImageFinder(root), skipped.append, require_entity=False))
    assert [q["id"] for q in out] == [rows[1]["data_id"]]
    assert [(s["id"], s["image_id"]) for s in skipped] == [(rows[0]["data_id"], rows[0]["image_id"])]
    assert "no image file under" in skipped[0]["reason"]


@pytest.mark.parametrize("flag,lacks", [("withkb", "entity_id"), ("withkb", "data_id"), ("qtype", "question_type")])
def test_a_withkb_or_qtype_row_without_its_field_is_named(tmp_path, flag, lacks):
    source = REAL / f"infoseek_val_{flag}_sample.jsonl"
    rows = list(read_jsonl(source))[:2]
    del rows[1][lacks]
    (tmp_path / source.name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = dict(withkb=str(REAL / "infoseek_val_withkb_sample.jsonl")) | {flag: str(tmp_path / source.name)}
    needed = "entity_id" if flag == "withkb" else "question_type"
    with pytest.raises(ValueError, match=f"{source.name}: row 2 has no 'data_id' / '{needed}' field"):
        convert(
            ConvertArgs(
                format="infoseek", input=str(REAL / "infoseek_val_sample.jsonl"), out=str(tmp_path / "q"), **args
            )
        )


def test_an_id2name_file_that_is_not_a_map_is_named(tmp_path):
    (tmp_path / "val_id2name.json").write_text('["val/x/a.jpg"]')
    with pytest.raises(ValueError, match="val_id2name.json: expected a JSON object mapping iNaturalist image ids"):
        read_id2name(tmp_path / "val_id2name.json")


def test_real_train_rows_with_the_train_withkb(tmp_path):
    n = convert(
        ConvertArgs(
            format="infoseek",
            input=str(REAL / "infoseek_train_sample.jsonl"),
            withkb=str(REAL / "infoseek_train_withkb_sample.jsonl"),
            out=str(tmp_path / "q.jsonl"),
        ),
        log=quiet,
    )
    first = next(read_jsonl(tmp_path / "q.jsonl"))
    assert n >= 1 and first["id"] == "infoseek_train_00000000" and first["entity_id"] == "Q33602"


def test_infoseek_without_withkb_needs_require_entity_false(tmp_path):
    with pytest.raises(ValueError, match="--withkb.*--require_entity false"):
        convert(ConvertArgs(format="infoseek", input=str(REAL / "infoseek_test_sample.jsonl"), out=str(tmp_path / "o")))


@pytest.mark.parametrize(
    "args,match",
    [
        (dict(format="nope", input="x", out="y"), "--format"),
        (dict(format="infoseek", out="y"), "--input and --out are required"),
        (dict(format="infoseek", input=__file__), "--input and --out are required"),
        (dict(format="infoseek", input="/does/not/exist", out="y"), "--input"),
        (dict(format="evqa-questions", input=__file__, out="y"), "--split"),
        (
            dict(format="infoseek", input=__file__, out="y", require_entity=False, image_layout="nested"),
            "--image_layout",
        ),
        (dict(format="evqa-questions", input=__file__, out="y", split="val", image_dirs="landmarks"), "--image_dirs"),
    ],
)
def test_convert_refuses_bad_arguments(args, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the relative --out "y": were a check to let it through, nothing lands in the repo
    with pytest.raises(ValueError, match=match):
        convert(ConvertArgs(**args))
    assert list(tmp_path.iterdir()) == []  # refused before anything is written


@given(st.from_regex(r"[0-9a-f]{16}", fullmatch=True))
def test_landmark_candidates_nest_by_the_first_three_characters(image_id):
    jpg = evqa_image_candidates(image_id, "landmarks")[0]
    assert jpg == "/".join(image_id[:3]) + f"/{image_id}.jpg"


@given(st.from_regex(r"oven_[0-9]{8}", fullmatch=True))
def test_oven_candidates_use_the_id_slice(image_id):
    nested = infoseek_image_candidates(image_id, "oven")[0]
    assert nested.split("/") == [image_id[-8:-6], f"{image_id}.jpg"]


# --------------------------------------------------------------------------- upstream issues: one table each


@pytest.mark.parametrize(
    "include_two_hop,written,skipped_rows",
    [
        (False, 5, [1, 2]),  # the 2-hop row is left out as the papers do, and listed
        (True, 6, [2]),
    ],
)
def test_every_row_left_out_is_listed_two_hop_included(tmp_path, include_two_hop, written, skipped_rows):
    root = tmp_path / "images"
    for i in ("1", "3", "4", "5", "6", "7"):
        touch(root, f"inaturalist/{i}.jpg")
    write_csv(
        tmp_path / "val.csv",
        [
            evqa_row(dataset_image_ids="1"),
            evqa_row(
                question_type="2_hop",
                dataset_image_ids="7",
                evidence_section_id="2|5",
                wikipedia_url="https://en.wikipedia.org/wiki/A|https://en.wikipedia.org/wiki/B",
            ),
            evqa_row(dataset_image_ids="2", question_type="automatic"),  # no image file
            evqa_row(dataset_image_ids="3", question_type="multi_answer", answer="a && b"),
            evqa_row(dataset_image_ids="4"),
            evqa_row(dataset_image_ids="5", question_type="automatic"),
            evqa_row(dataset_image_ids="6"),
        ],
    )
    messages = []
    n = convert(
        ConvertArgs(
            format="evqa-questions",
            input=str(tmp_path / "val.csv"),
            split="val",
            images_root=str(root),
            include_two_hop=include_two_hop,
            out=str(tmp_path / "q.jsonl"),
        ),
        log=messages.append,
    )
    skipped = list(read_jsonl(tmp_path / "q.jsonl.skipped.jsonl"))
    assert n == written and sorted(s["row"] for s in skipped) == skipped_rows
    assert f"wrote {written} records" in messages[0] and f"{len(skipped_rows)} skipped" in messages[0]
    if not include_two_hop:
        (hop,) = [s for s in skipped if s["row"] == 1]
        assert "2_hop" in hop["reason"] and "--include_two_hop" in hop["reason"]


@pytest.mark.parametrize(
    "layout,path",
    [
        ("GLDv2 nested (EchoSight)", f"landmarks/8/b/3/{LANDMARK}.jpg"),
        ("flat <id>.jpg (OMGM)", f"landmarks/{LANDMARK}.jpg"),
    ],
)
def test_landmark_images_nested_or_flat(tmp_path, layout, path):
    root = tmp_path / "images"
    touch(root, path)
    write_csv(tmp_path / "test.csv", [evqa_row(dataset_name="landmarks", dataset_image_ids=LANDMARK)])
    n = convert(
        ConvertArgs(
            format="evqa-questions",
            input=str(tmp_path / "test.csv"),
            split="test",
            images_root=str(root),
            out=str(tmp_path / "q.jsonl"),
        ),
        log=quiet,
    )
    assert n == 1 and next(read_jsonl(tmp_path / "q.jsonl"))["image"] == path


@pytest.mark.parametrize(
    "qtype,value,section,warns",
    [
        ("templated", "3", 3, False),
        ("templated", "3.0", 3, False),  # what pandas writes for an integer column with gaps
        ("templated", " 3 ", 3, False),
        ("templated", "", None, False),
        ("2_hop", "2|5", [2, 5], False),
        ("2_hop", "2.0|5.0", [2, 5], False),
        ("templated", "Distribution", None, True),  # not an index: the row is kept without one, the log names it
        ("2_hop", "2|x", [2, None], True),
    ],
)
def test_evidence_section_id_written_as_a_float_keeps_its_section(tmp_path, caplog, qtype, value, section, warns):
    url = (
        "https://en.wikipedia.org/wiki/A|https://en.wikipedia.org/wiki/B"
        if qtype == "2_hop"
        else "https://en.wikipedia.org/wiki/A"
    )
    rows = [evqa_row(question_type=qtype, evidence_section_id=value, wikipedia_url=url)]
    with caplog.at_level("WARNING", logger="refine_rl.convert"):
        (q,) = evqa_questions(rows, ImageFinder(None), quiet, split="val", include_two_hop=True)
    assert q.get("evidence_section_id") == section
    assert ("row 0: evidence_section_id" in caplog.text) == warns


@pytest.mark.parametrize(
    "text,index",
    [("3", 3), ("3.0", 3), (" 0 ", 0), ("0.0", 0), ("3.5", None), ("-1", None), ("nan", None), ("Habitat", None)],
)
def test_section_index_is_a_whole_non_negative_number_or_none(text, index):
    assert section_index(text) == index


@pytest.mark.parametrize(
    "text,subdirs",
    [
        (None, {}),
        ("", {}),
        ("landmarks=gldv2, inaturalist = inat/ ,", {"landmarks": "gldv2", "inaturalist": "inat"}),
        ("landmarks=", {"landmarks": ""}),  # the dataset's images straight under the root
        ("landmarks", ValueError),
        ("=gldv2", ValueError),
    ],
)
def test_image_dirs_parse_into_a_folder_per_dataset(text, subdirs):
    if subdirs is ValueError:
        with pytest.raises(ValueError, match="--image_dirs: expected name=folder pairs"):
            parse_subdirs(text)
    else:
        assert parse_subdirs(text) == subdirs


@pytest.mark.parametrize(
    "image_id,dataset,id2name,candidates",
    [
        ("abc", "landmarks", None, ["a/b/c/abc.jpg", "a/b/c/abc.JPEG", "abc.jpg", "abc.JPEG"]),
        ("ab", "landmarks", None, []),  # too short for GLDv2's nesting: no name, the row is listed
        ("1234", "inaturalist", {"1234": "val/x/a.jpg"}, ["val/x/a.jpg"]),
        ("1234", "inaturalist", {"9": "val/x/a.jpg"}, []),
        ("1234", "inaturalist", None, ["1234.jpg", "1234.JPEG"]),
        ("oven_1", "infoseek", {"oven_1": "elsewhere.jpg"}, ["oven_1.jpg", "oven_1.JPEG"]),  # the iNat map is iNat's
        ("x", "imagenet", None, ValueError),
    ],
)
def test_evqa_image_candidates_per_dataset(image_id, dataset, id2name, candidates):
    if candidates is ValueError:
        with pytest.raises(ValueError, match="unknown E-VQA dataset_name 'imagenet'"):
            evqa_image_candidates(image_id, dataset, id2name)
    else:
        assert evqa_image_candidates(image_id, dataset, id2name) == candidates


def test_infoseek_image_layout_must_be_oven_or_flat():
    assert infoseek_image_candidates("oven_04990048", "flat") == ["oven_04990048.jpg", "oven_04990048.JPEG"]
    with pytest.raises(ValueError, match="--image_layout must be oven or flat, got 'nested'"):
        infoseek_image_candidates("oven_04990048", "nested")


def test_without_an_images_root_the_first_candidate_is_taken():
    assert ImageFinder(None)(["a.jpg", "a.JPEG"], "inaturalist") == ("a.jpg", None)
    assert ImageFinder(None, {"inaturalist": "inat"})(["a.jpg"], "inaturalist") == ("inat/a.jpg", None)
    assert ImageFinder(None)([], "inaturalist") == (None, "no image name for this id in the inaturalist map")


@pytest.mark.parametrize(
    "row,reason",
    [
        (evqa_row(wikipedia_url=""), "no wikipedia_url"),
        (evqa_row(dataset_image_ids=" | "), "no dataset_image_ids"),
    ],
)
def test_a_row_without_an_entity_or_an_image_id_is_listed(row, reason):
    skipped = []
    assert list(evqa_questions([evqa_row(), row], ImageFinder(None), skipped.append, split="val")) != []
    assert skipped == [{"row": 1, "reason": reason}]


@pytest.mark.parametrize(
    "dataset,data_id,qid",
    [
        ("infoseek", "infoseek_val_00000007", "infoseek_val_00000007"),  # EchoSight's InfoSeek CSV keeps its id
        ("infoseek", "", "evqa-val-0"),
        ("inaturalist", "infoseek_val_00000007", "evqa-val-0"),  # only an InfoSeek row is named by its data_id
    ],
)
def test_a_row_is_named_by_its_data_id_only_when_it_is_an_infoseek_row(dataset, data_id, qid):
    row = evqa_row(dataset_name=dataset, dataset_image_ids="oven_05050169", data_id=data_id)
    (q,) = evqa_questions([row], ImageFinder(None), quiet, split="val")
    assert q["id"] == qid and q["dataset_name"] == dataset


@pytest.mark.parametrize("row_split,split", [("test", "test"), ("", "val")])
def test_a_row_keeps_its_own_encyclopedic_vqa_split(row_split, split):
    (q,) = evqa_questions([evqa_row(encyclopedic_vqa_split=row_split)], ImageFinder(None), quiet, split="val")
    assert q["split"] == split and q["id"] == "evqa-val-0"  # the id names the file's split


@pytest.mark.parametrize(
    "answer,answers,parts",
    [
        ("Europe|European continent", ["Europe", "European continent"], None),
        ("red && blue|purple", ["red && blue", "purple"], [["red", "blue"], ["purple"]]),
        (None, [], None),  # a short CSV row (no answer cell): no answers, not the string "None"
    ],
)
def test_answer_alternatives_and_parts(answer, answers, parts):
    (q,) = evqa_questions([evqa_row(answer=answer)], ImageFinder(None), quiet, split="val")
    assert q["answers"] == answers and q.get("answer_parts") == parts
