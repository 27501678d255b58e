"""Canonical records: image checks. (The upstream converters: test_convert_questions.py, test_convert_kb.py.)"""

import pytest


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
