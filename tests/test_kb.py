"""Converters on small files written in the exact upstream formats."""

import csv
import json

import pytest

from retrieval.convert import ConvertArgs, convert
from retrieval.kb import evqa_kb_entries, evqa_questions, image_resolver, infoseek_questions, url_hash

EVQA_KB = {
    "https://en.wikipedia.org/wiki/Zorvak": {
        "title": "Zorvak", "url": "https://en.wikipedia.org/wiki/Zorvak",
        "section_titles": ["Zorvak", "Habitat", "Diet"],
        "section_texts": ["The Zorvak is a red star.", "It lives in caves.", ""],
        "image_urls": ["http://img/a.jpg", "http://img/b.jpg", "http://img/c.jpg", "http://img/d.jpg",
                       "http://img/missing.jpg"],
        "image_reference_descriptions": ["", "", "", "", ""],
        "image_section_indices": [1, None, 2, 7],  # d.jpg: out of range; missing.jpg: no index at all
    }
}


def test_evqa_kb_pairs_images_with_sections():
    mapping = {u: f"kb/{u[-5]}.jpg" for u in ["http://img/a.jpg", "http://img/b.jpg", "http://img/c.jpg",
                                              "http://img/d.jpg"]}
    skipped = []
    rows = list(evqa_kb_entries(EVQA_KB, image_resolver(mapping), skipped))
    by_image = {r["image"]: r for r in rows}
    assert len(rows) == 4 and len({r["entry_id"] for r in rows}) == 4
    assert by_image["kb/a.jpg"]["section_title"] == "Habitat" and by_image["kb/a.jpg"]["text"] == "It lives in caves."
    for img in ["kb/b.jpg", "kb/c.jpg", "kb/d.jpg"]:  # missing index, empty section, out of range → first section
        assert by_image[img]["section_title"] == "Zorvak"
        assert by_image[img]["text"] == "The Zorvak is a red star."
    assert all(r["entity_id"] == "https://en.wikipedia.org/wiki/Zorvak" and r["title"] == "Zorvak" for r in rows)
    assert skipped == [{"entry_id": "https://en.wikipedia.org/wiki/Zorvak#image4",
                        "reason": "no local file for image http://img/missing.jpg"}]


def test_evqa_kb_cli_with_hash_folder(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for u in ["http://img/a.jpg", "http://img/c.jpg"]:
        (folder / f"{url_hash(u)}.jpg").write_bytes(b"x")
    (tmp_path / "kb.json").write_text(json.dumps(EVQA_KB))
    n = convert(ConvertArgs(format="evqa-kb", input=str(tmp_path / "kb.json"), image_dir=str(folder),
                            out=str(tmp_path / "kb.jsonl")), log=lambda *a: None)
    rows = [json.loads(x) for x in open(tmp_path / "kb.jsonl")]
    assert n == 2 and {r["image"] for r in rows} == {f"{url_hash('http://img/a.jpg')}.jpg",
                                                     f"{url_hash('http://img/c.jpg')}.jpg"}
    assert sum(1 for _ in open(tmp_path / "kb.jsonl.skipped.jsonl")) == 3


def test_infoseek_merges_withkb(tmp_path):
    rows = [
        {"data_id": "infoseek_val_00001", "image_id": "oven_05050169", "question": "What country is this in?",
         "answer": ["France"], "answer_eval": ["France", "French Republic"], "data_split": "val_unseen_entity"},
        {"data_id": "infoseek_val_00002", "image_id": "oven_01", "question": "When was this built?",
         "answer": ["1889"], "answer_eval": [{"wikidata": 1889, "range": [1887, 1891]}],
         "data_split": "val_unseen_question"},
        {"data_id": "infoseek_val_00003", "image_id": "oven_02", "question": "?", "answer": ["x"],
         "answer_eval": ["x"], "data_split": "val_unseen_question"},
    ]
    withkb = [{"data_id": "infoseek_val_00001", "entity_id": "Q90"}, {"data_id": "infoseek_val_00002",
                                                                       "entity_id": "Q243"}]
    skipped = []
    out = list(infoseek_questions(rows, withkb, "{image_id}.jpg", skipped))
    assert [q["entity_id"] for q in out] == ["Q90", "Q243"]
    assert out[0] == {"id": "infoseek_val_00001", "image": "oven_05050169.jpg", "question": "What country is this in?",
                      "entity_id": "Q90", "answers": ["France"], "answer_eval": ["France", "French Republic"],
                      "split": "val_unseen_entity"}
    assert out[1]["answer_eval"][0]["range"] == [1887, 1891]
    assert skipped == [{"id": "infoseek_val_00003", "reason": "no entity_id in the withkb file"}]


EVQA_CSV_HEADER = ["question", "answer", "dataset_image_ids", "encyclopedic_vqa_split", "question_type",
                   "question_original", "evidence_section_id", "wikipedia_url", "wikipedia_title", "dataset_name"]


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=EVQA_CSV_HEADER)
        w.writeheader()
        w.writerows(rows)


def evqa_row(**kw):
    base = dict(question="Where is it found?", answer="Europe|European continent", dataset_image_ids="111|222",
                encyclopedic_vqa_split="test", question_type="templated", question_original="", evidence_section_id="3",
                wikipedia_url="https://en.wikipedia.org/wiki/X", wikipedia_title="X", dataset_name="inaturalist")
    return {**base, **kw}


@pytest.mark.parametrize("two_hop,all_images,expected", [(False, False, 2), (True, False, 3), (False, True, 4)])
def test_evqa_questions(tmp_path, two_hop, all_images, expected):
    write_csv(tmp_path / "q.csv", [
        evqa_row(),
        evqa_row(question="Which two?", answer="red && blue|blue && red", question_type="multi_answer"),
        evqa_row(question="Hop?", question_type="2_hop"),
    ])
    n = convert(ConvertArgs(format="evqa-questions", input=str(tmp_path / "q.csv"), out=str(tmp_path / "q.jsonl"),
                            include_two_hop=two_hop, all_images=all_images, split="val"), log=lambda *a: None)
    rows = [json.loads(x) for x in open(tmp_path / "q.jsonl")]
    assert n == len(rows) == expected
    first = rows[0]
    assert first["id"] == ("evqa-val-0-0" if all_images else "evqa-val-0") and first["upstream_id"] == "E-VQA_0"
    assert [r["upstream_id"] for r in rows][-1] == ("E-VQA_2" if two_hop else "E-VQA_1")  # the CSV row, 2-hop or not
    assert first["answers"] == ["Europe", "European continent"] and first["image"] == "inaturalist/111.jpg"
    assert first["entity_id"] == "https://en.wikipedia.org/wiki/X" and first["split"] == "test"
    multi = next(r for r in rows if r["question_type"] == "multi_answer")
    assert multi["answer_parts"] == [["red", "blue"], ["blue", "red"]]
    assert ("2_hop" in {r["question_type"] for r in rows}) == two_hop


def test_evqa_pure_function_keeps_order_and_ids():
    rows = list(evqa_questions([evqa_row(question=f"q{i}") for i in range(3)], split="train"))
    assert [r["question"] for r in rows] == ["q0", "q1", "q2"] and len({r["id"] for r in rows}) == 3


def test_evqa_ids_are_unique_across_splits_and_keep_the_upstream_row_name():
    csv_rows = [evqa_row(question="Hop?", question_type="2_hop"), evqa_row(), evqa_row()]
    by_split = {s: list(evqa_questions(csv_rows, split=s)) for s in ("train", "val", "test")}
    assert [r["id"] for r in by_split["train"]] == ["evqa-train-1", "evqa-train-2"]
    assert [r["upstream_id"] for r in by_split["test"]] == ["E-VQA_1", "E-VQA_2"]  # row index counts 2-hop rows
    ids = [r["id"] for rows in by_split.values() for r in rows]
    assert len(ids) == len(set(ids)) == 6
    for bad in ("", " ", "my split", None):
        with pytest.raises(ValueError, match="split must name"):
            list(evqa_questions(csv_rows, split=bad))


def test_evqa_questions_cli_needs_a_split(tmp_path):
    write_csv(tmp_path / "q.csv", [evqa_row()])
    with pytest.raises(ValueError, match="--split"):
        convert(ConvertArgs(format="evqa-questions", input=str(tmp_path / "q.csv"), out=str(tmp_path / "q.jsonl")))
    assert not (tmp_path / "q.jsonl").exists()


@pytest.mark.parametrize("args,match", [
    (dict(format="nope", input="x", out="y"), "--format"),
    (dict(format="infoseek", input="/does/not/exist", out="y"), "--input"),
])
def test_convert_refuses_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        convert(ConvertArgs(**args))


def test_infoseek_without_withkb_is_refused(tmp_path):
    (tmp_path / "q.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="--withkb"):
        convert(ConvertArgs(format="infoseek", input=str(tmp_path / "q.jsonl"), out=str(tmp_path / "o.jsonl")))


def test_check_images_names_the_missing_files(tmp_path):
    from retrieval.kb import check_images

    (tmp_path / "ok.png").write_bytes(b"x")
    rows = [{"id": "a", "image": "ok.png"}, {"id": "b", "image": "gone.png"}]
    with pytest.raises(ValueError, match=r"1 question\(s\) in q.jsonl have no image file: b → .*gone.png"):
        check_images(rows, tmp_path, "q.jsonl")
    check_images(rows[:1], tmp_path, "q.jsonl")


def test_image_problem_names_missing_and_corrupt_images(tmp_path):
    from PIL import Image

    from retrieval.kb import image_problem, load_image

    Image.new("L", (4, 3)).save(tmp_path / "ok.png")
    (tmp_path / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    image, reason = load_image(tmp_path / "ok.png")
    assert reason is None and image.mode == "RGB" and image.size == (4, 3)
    assert image_problem(tmp_path / "gone.png") == f"image file missing: {tmp_path / 'gone.png'}"
    assert image_problem(tmp_path / "bad.jpg").startswith(f"image unreadable: {tmp_path / 'bad.jpg'} (")
