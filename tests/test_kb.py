"""Canonical records: image checks. (The upstream converters: test_convert_questions.py, test_convert_kb.py.)"""

import pytest


def test_check_images_names_the_missing_files(tmp_path):
    from retrieval.kb import check_images

    (tmp_path / "ok.png").write_bytes(b"x")
    rows = [{"id": "a", "image": "ok.png"}, {"id": "b", "image": "gone.png"}]
    with pytest.raises(ValueError, match=r"1 question\(s\) in q.jsonl have no image file: b → .*gone.png$"):
        check_images(rows, str(tmp_path), "q.jsonl")  # a root given as a string, as the CLIs pass it
    check_images(rows[:1], tmp_path, "q.jsonl")
    gone = [{"id": str(i), "image": f"gone{i}.png"} for i in range(6)]
    with pytest.raises(ValueError) as e:
        check_images(gone[:5], tmp_path, "q.jsonl")
    assert str(e.value).count(" → ") == 5 and not str(e.value).endswith("…")
    with pytest.raises(ValueError, match=r"^6 question\(s\) .*gone4.png …$") as e:  # the first five named
        check_images(gone, tmp_path, "q.jsonl")
    assert str(e.value).count(" → ") == 5


@pytest.mark.parametrize(
    "entry,text",
    [
        ({"title": "Paris", "section_title": "History", "text": "Founded."}, "Paris. History. Founded."),
        ({"title": "Paris", "section_title": None, "text": "Founded."}, "Paris. . Founded."),  # null: empty, not "None"
        ({"title": None, "text": "Founded."}, ". . Founded."),
        ({"title": "Paris", "section_title": "Paris", "text": None}, "Paris. Paris."),
    ],
)
def test_entry_text_is_title_section_and_text_with_nulls_empty(entry, text):
    from retrieval.kb import entry_text

    assert entry_text(entry) == text
    assert entry_text(entry, "{text}|{title}") == "|".join(entry.get(k) or "" for k in ("text", "title"))


@pytest.mark.parametrize(
    "record,gold",
    [({"answers": ["x"]}, True), ({"answer_eval": ["x"]}, True), ({"answers": [], "answer_eval": []}, False)],
)
def test_has_gold_is_an_answer_or_an_answer_eval(record, gold):
    from retrieval.kb import has_gold

    assert has_gold(record) is gold


@pytest.mark.parametrize(
    "entity,stored",
    [("Q90", "Q90"), (90, "90"), (["Q1", 2], ["Q1", "2"]), (None, None)],  # 2-hop: one per hop; test rows: none
)
def test_a_question_record_keeps_ids_as_strings(entity, stored):
    from retrieval.kb import question_record

    rec = question_record(7, "a.jpg", "Where?", entity, ("x",), question_type="String", answer_eval=None)
    assert rec == {"id": "7", "image": "a.jpg", "question": "Where?", "entity_id": stored, "answers": ["x"]} | {
        "question_type": "String"
    }


def test_a_kb_entry_carries_its_section_only_when_known():
    from retrieval.kb import kb_entry

    assert "section" not in kb_entry(1, 2, "T", "S", "text", "a.jpg")
    assert kb_entry(1, 2, "T", "S", "text", "a.jpg", section=0) == dict(
        entry_id="1", entity_id="2", title="T", section_title="S", text="text", image="a.jpg", section=0
    )


def test_load_image_names_missing_and_corrupt_images(tmp_path):
    from PIL import Image

    from retrieval.kb import load_image

    Image.new("L", (4, 3)).save(tmp_path / "ok.png")
    (tmp_path / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    image, reason = load_image(tmp_path / "ok.png")
    assert reason is None and image.mode == "RGB" and image.size == (4, 3)
    assert load_image(tmp_path / "gone.png")[1] == f"image file missing: {tmp_path / 'gone.png'}"
    assert load_image(str(tmp_path / "ok.png"))[0].size == (4, 3)  # a path as a string (the datasets' columns)
    assert load_image(tmp_path / "bad.jpg")[1].startswith(f"image unreadable: {tmp_path / 'bad.jpg'} (")


@pytest.mark.parametrize(
    "fmt,mode,size,decoded",
    [
        ("PNG", "RGB", (80, 60), (80, 60)),  # under PIL's decompression-bomb limit: as before, full size
        ("PNG", "RGB", (230, 200), (58, 50)),  # over it: decoded, then reduced by ceil(sqrt(46,000 / 5,000)) = 4
        ("PNG", "RGB", (101, 197), (26, 50)),  # reduce(2) rounds up to 51×99 = 5,049 pixels: halved once more
        ("PNG", "RGB", (200, 100), (100, 50)),  # reduced by 2 to exactly 5,000 pixels: within, not halved again
        ("PNG", "P", (300, 140), (100, 47)),  # a palette image: to RGB before it is reduced (PIL reduces no P)
        ("PNG", "RGB", (500, 400), (72, 58)),  # exactly this module's bound: still decoded
        ("JPEG", "RGB", (300, 140), (75, 35)),  # a JPEG: decoded at 1/2 scale (draft), 150×70, then reduced by 2
        ("JPEG", "RGB", (330, 250), (42, 32)),  # … at 1/4 scale, 83×63, then reduced by 2
        ("JPEG", "RGB", (143, 140), (48, 47)),  # 72×70 at 1/2 scale would round up past the limit: whole, by 3
        ("JPEG", "RGB", (140, 143), (47, 48)),  # … turned
        ("JPEG", "CMYK", (300, 140), (75, 35)),  # a CMYK JPEG comes back RGB
        ("PNG", "RGB", (1000, 800), None),  # over this module's bound too: refused with the reason
    ],
)
def test_kb_images_over_the_pixel_limit_decode_downscaled(tmp_path, monkeypatch, fmt, mode, size, decoded):
    """The exact size every encoder sees for an image past PIL's limit (down to within ``Image.MAX_IMAGE_PIXELS``),
    in its colour, as RGB, whatever the file's mode."""
    import numpy as np
    from PIL import Image

    import retrieval.kb as kb

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5_000)  # PIL refuses more than twice this: 10,000 pixels
    monkeypatch.setattr(kb, "LARGE_IMAGE_PIXELS", 200_000)  # the bound for images decoded past PIL's limit
    path = tmp_path / f"big.{fmt.lower()}"
    colour = (10, 120, 200)
    with monkeypatch.context() as m:
        m.setattr(Image, "MAX_IMAGE_PIXELS", None)
        if mode == "P":
            im = Image.new("P", size, 0)
            im.putpalette(colour)
        else:
            im = Image.new("RGB", size, colour).convert(mode)
        im.save(path, format=fmt)
    image, reason = kb.load_image(path)
    if decoded is None:
        assert image is None and "800000 pixels" in reason and "200000" in reason
        return
    assert reason is None and image.mode == "RGB" and image.size == decoded
    assert size[0] * size[1] <= 2 * 5_000 or decoded[0] * decoded[1] <= 5_000  # within PIL's limit once downscaled
    tolerance = 0 if fmt == "PNG" else 8  # JPEG's lossy colour
    assert np.abs(np.asarray(image, dtype=np.int16) - np.array(colour)).max() <= tolerance
    assert Image.MAX_IMAGE_PIXELS == 5_000  # PIL's own limit restored


def test_downscaled_jpeg_is_load_images_picture_at_quality_95_or_names_why_not(tmp_path, monkeypatch):
    """Training's image column holds an image past PIL's limit as these bytes (rl.data.image_column_value): the
    picture ``load_image`` gives the index and the reward, as a quality-95 JPEG; a file that does not load is named."""
    import io

    from PIL import Image

    import retrieval.kb as kb

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5_000)
    path = tmp_path / "big.png"
    with monkeypatch.context() as m:
        m.setattr(Image, "MAX_IMAGE_PIXELS", None)
        Image.new("RGB", (230, 200), (10, 120, 200)).save(path)
    expected = io.BytesIO()
    kb.load_image(path)[0].save(expected, format="JPEG", quality=95)
    data = kb.downscaled_jpeg(str(path))
    assert data == expected.getvalue()
    assert Image.open(io.BytesIO(data)).size == (58, 50)
    with pytest.raises(ValueError, match="image file missing: .*gone.png"):
        kb.downscaled_jpeg(tmp_path / "gone.png")
    (tmp_path / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    with pytest.raises(ValueError, match="image unreadable: .*bad.jpg"):
        kb.downscaled_jpeg(tmp_path / "bad.jpg")


@pytest.mark.parametrize("orientation,size", [(None, (40, 24)), (1, (40, 24)), (3, (40, 24)), (6, (24, 40))])
def test_every_path_opens_an_image_upright_as_the_policy_sees_it_in_training(tmp_path, monkeypatch, orientation, size):
    """The datasets library turns an image by its EXIF Orientation when it decodes the training column that TRL hands
    the policy; the index, the reward's fallback, evaluation (``load_image``) and inference (``open_vlm_image``) see
    the same picture. Also past PIL's pixel limit (the downscaling path)."""
    import numpy as np
    from datasets import Dataset
    from datasets import Image as ImageFeature
    from PIL import Image

    import retrieval.kb as kb
    from rl.model import open_vlm_image

    path = tmp_path / "photo.jpg"
    pixels = np.zeros((24, 40, 3), np.uint8)
    pixels[:, :10] = (250, 20, 20)  # a red band on the stored left edge: where it ends up shows the turn
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    Image.fromarray(pixels).save(path, quality=95, exif=exif)
    trained = Dataset.from_list([{"image": str(path)}]).cast_column("image", ImageFeature())[0]["image"]
    assert trained.size == size
    expected = np.asarray(trained.convert("RGB"), dtype=np.int16)
    for opened in (kb.load_image(path)[0], open_vlm_image(path)):
        assert opened.size == size and np.abs(np.asarray(opened, dtype=np.int16) - expected).max() == 0
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 200)  # past PIL's limit (twice this): the downscaling path
    small = kb.load_image(path)[0]
    assert (small.width < small.height) == (size[0] < size[1])


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P-transparent", "P", "RGB", "L", "CMYK", "I;16"])
def test_to_rgb_is_transformers_convert_to_rgb(mode, tmp_path):
    """Every image path (index, reward, evaluation, the VLM at inference) goes through ``to_rgb``: transparency onto
    white, as transformers' image processors and the VLM's training see it."""
    import numpy as np
    from PIL import Image
    from transformers.image_transforms import convert_to_rgb

    from retrieval.kb import to_rgb

    rng = np.random.default_rng(0)
    rgba = Image.fromarray(rng.integers(0, 256, (12, 10, 4), dtype=np.uint8), "RGBA")
    if mode == "P-transparent":
        im = rgba.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
        im.info["transparency"] = 3
    elif mode == "I;16":
        im = Image.fromarray(rng.integers(0, 65536, (12, 10), dtype=np.uint16))
    else:
        im = rgba.convert(mode)
    im.save(tmp_path / "x.png" if mode != "CMYK" else tmp_path / "x.jpg")
    opened = Image.open(tmp_path / ("x.png" if mode != "CMYK" else "x.jpg"))
    assert np.array_equal(np.asarray(to_rgb(opened)), convert_to_rgb(opened, return_numpy=True))
