"""Index build at scale, on one process: each distinct section text encoded once, DataLoader decoding, the hf:
image encoder (a tiny transformers CLIP saved locally), the text encoder's length and query instruction recorded in
the manifest and applied at query time — by the reward and by retrieval.evaluate alike — never to KB rows."""

import json
import re

import numpy as np
import pytest
from PIL import Image

import retrieval.build_index as bi
from retrieval.build_index import BuildArgs, build_index
from retrieval.index import MultimodalIndex
from retrieval.kb import entry_text
from retrieval.kb_scan import scan_kb

QUIET = dict(log=lambda *a: None)
TEMPLATE = "{title}. {section_title}. {text}"


def vectors(index_dir):
    from common.faiss_lib import faiss

    index = faiss.read_index(str(index_dir / "index.faiss"))
    return index.reconstruct_n(0, index.ntotal)


@pytest.fixture(scope="module")
def shared_sections_kb(tiny_world, tmp_path_factory):
    """Each section of the toy KB paired with three images (as E-VQA pairs every image of an article with a
    section), rows of one article adjacent, plus a row repeating another article's text under its own id."""
    tmp = tmp_path_factory.mktemp("shared")
    kb = [json.loads(x) for x in open(tiny_world / "kb.jsonl", encoding="utf-8")][:24]
    images = sorted({r["image"] for r in kb})
    rows = []
    for n, rec in enumerate(kb):
        for j in range(3):
            rows.append(dict(rec, entry_id=f"{rec['entry_id']}#{j}", image=images[(n + j) % len(images)]))
    rows.append(dict(kb[0], entry_id="copy-of-first", entity_id="other-entity", image=images[-1]))
    (tmp / "kb.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp / "kb.jsonl", rows


def test_scan_finds_each_distinct_text_once(shared_sections_kb):
    path, rows = shared_sections_kb
    scan = scan_kb(path, TEMPLATE)
    texts = [entry_text(r, TEMPLATE) for r in rows]
    assert scan.rows == len(rows) and scan.texts == len(set(texts))
    assert [texts[r] for r in scan.text_rows] == list(dict.fromkeys(texts))  # order of first appearance
    assert all(texts[scan.text_rows[scan.text_id[r]]] == texts[r] for r in range(len(rows)))


def test_kb_rows_are_read_back_as_the_scan_read_them(tmp_path):
    """A KB row holding a lone surrogate escape (JSON from elsewhere can hold half a pair): the scan takes it as U+FFFD
    (``json_record``); the text shard and the image rows read it back with plain ``json.loads``, so the build stopped
    at the tokenizer (``TypeError: TextEncodeInput must be …``) and rows.parquet could not hold its title."""
    from retrieval.image_data import KBImageRows

    row = {"entry_id": "e1", "entity_id": "Q1", "title": "T\ud800", "section_title": "", "text": "a \udc00 b"}
    path = tmp_path / "kb.jsonl"
    path.write_text('{"entry_id": "e0", "entity_id": "Q0", "text": "x"}\n\n' + json.dumps(row) + "\n")
    scan = scan_kb(path, TEMPLATE)
    assert scan.rows == 2 and scan.texts == 2  # the blank line is no row
    read = scan.read([1])[0]
    assert (read["title"], read["text"]) == ("T\ufffd", "a \ufffd b")
    assert entry_text(read, TEMPLATE).encode("utf-8")  # what the text shard tokenizes: valid UTF-8
    rows = KBImageRows(path, scan.offsets, tmp_path, preprocess=None)
    assert rows[0]["title"] == ""  # a row without a title: no "None" in rows.parquet
    item = rows[1]
    assert (item["entry_id"], item["entity_id"], item["title"], item["problem"]) == (
        "e1",
        "Q1",
        "T\ufffd",
        "no image path",
    )


def row(entry_id, entity_id="Q1", text="t", **kw):
    return json.dumps({"entry_id": entry_id, "entity_id": entity_id, "title": "T", "text": text, **kw})


@pytest.mark.parametrize(
    "lines,problems,text_id",
    [
        ([], {}, []),
        ([row("a"), row("b"), row("c", text="u")], {}, [0, 0, 1]),
        (
            [row("a", entity_id=None), row("b", entity_id=""), row("c", text=" \t")],
            {0: "no entity_id", 1: "no entity_id", 2: "empty text"},
            [-1, -1, -1],
        ),  # fmt: skip
        (
            [row("a", text="u"), row("b", entity_id=None), "", row("c", text="u"), row("d")],
            {1: "no entity_id"},
            [0, -1, 0, 1],
        ),  # fmt: skip
        ([row(7), row("8", text=None, section_title="s")], {1: "empty text"}, [0, -1]),
    ],
)
def test_scan_numbers_distinct_texts_in_order_and_lists_rows_that_cannot_be_indexed(tmp_path, lines, problems, text_id):
    path = tmp_path / "kb.jsonl"
    path.write_bytes("".join(x + "\r\n" for x in lines).encode())
    scan = scan_kb(path, TEMPLATE)
    records = [json.loads(x) for x in lines if x]
    assert scan.problems == problems and scan.text_id.tolist() == text_id and scan.rows == len(records)
    assert scan.read(range(scan.rows)) == records  # each row found again at its offset
    assert scan.text_rows.tolist() == [text_id.index(u) for u in range(max(text_id, default=-1) + 1)]


@pytest.mark.parametrize(
    "lines,said",
    [
        ([row("a"), "", json.dumps({"entity_id": "Q1", "text": "t"})], "kb.jsonl:3: a KB row without an entry_id"),
        ([row("a"), row("b"), row("a", text="other")], "duplicate entry_id 'a' (rows 1 and 3)"),
        ([row(7), row("b"), row("7")], "duplicate entry_id '7' (rows 1 and 3)"),  # one id in rows.parquet
        ([row(x) for x in "abbacc"], "duplicate entry_id 'a' (rows 1 and 4)"),  # the first row repeated, named
        ([row("a"), "[1, 2]"], "kb.jsonl:2: expected a JSON object, got list"),
    ],
)
def test_scan_refuses_rows_it_cannot_tell_apart_naming_them(tmp_path, lines, said):
    path = tmp_path / "kb.jsonl"
    path.write_text("".join(x + "\n" for x in lines))
    with pytest.raises(ValueError, match=re.escape(said)):
        scan_kb(path, TEMPLATE)


def test_section_dedup_equals_encoding_every_row(shared_sections_kb, tiny_world, tmp_path, encoders, monkeypatch):
    path, rows = shared_sections_kb
    img_enc, txt_enc = encoders
    encoded = []
    real = txt_enc.encode
    monkeypatch.setattr(txt_enc, "encode", lambda texts, **k: encoded.extend(texts) or real(texts, **k))
    out = tmp_path / "idx"
    m = build_index(
        BuildArgs(
            kb=str(path),
            images_root=str(tiny_world),
            out=str(out),
            image_encoder="tiny",
            text_encoder="tiny",
            shard_size=16,
            workers=0,
        ),
        encoders=encoders,
        **QUIET,
    )
    distinct = len({entry_text(r, TEMPLATE) for r in rows})
    assert len(encoded) == distinct == m["texts_encoded"] < len(rows) == m["text_rows"]
    # the same vectors as encoding every row on its own
    monkeypatch.undo()
    each = np.concatenate(
        [
            img_enc.encode([Image.open(tiny_world / r["image"]) for r in rows]),
            txt_enc.encode([entry_text(r, TEMPLATE) for r in rows]),
        ],
        axis=1,
    )
    np.testing.assert_allclose(vectors(out), each, atol=1e-5)


@pytest.mark.parametrize("workers", [0, 2])
def test_decoding_workers_skip_a_corrupt_image(tiny_world, tmp_path, encoders, workers):
    kb = [json.loads(x) for x in open(tiny_world / "kb.jsonl", encoding="utf-8")][:10]
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8\xff not really a jpeg")
    kb[3]["image"] = str(tmp_path / "broken.jpg")
    kb[6]["image"] = "images/nope.png"
    (tmp_path / "kb.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kb))
    out = tmp_path / f"idx{workers}"
    m = build_index(
        BuildArgs(
            kb=str(tmp_path / "kb.jsonl"),
            images_root=str(tiny_world),
            out=str(out),
            image_encoder="tiny",
            text_encoder="tiny",
            shard_size=4,
            batch_size=3,
            workers=workers,
        ),
        encoders=encoders,
        **QUIET,
    )
    skipped = [json.loads(x) for x in open(out / "skipped.jsonl", encoding="utf-8")]
    assert m["rows"] == 8 and [s["entry_id"] for s in skipped] == [kb[3]["entry_id"], kb[6]["entry_id"]]
    assert "image unreadable" in skipped[0]["reason"] and "image file missing" in skipped[1]["reason"]
    import pyarrow.parquet as pq

    kept = [r["entry_id"] for i, r in enumerate(kb) if i not in (3, 6)]
    assert pq.read_table(out / "rows.parquet").column("entry_id").to_pylist() == kept
    img = encoders[0].encode([Image.open(tiny_world / kb[i]["image"]) for i in (0, 4, 9)])
    np.testing.assert_allclose(vectors(out)[[0, 3, 7], : encoders[0].dim], img, atol=1e-5)


# --------------------------------------------------------------------------- hf: image encoders


@pytest.fixture(scope="module")
def tiny_hf_clip(tmp_path_factory):
    """A tiny random transformers CLIPModel (vision + text towers) and its image processor, saved locally."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    folder = tmp_path_factory.mktemp("hf-clip") / "tiny-clip"
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        projection_dim=24,
    )
    text = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        vocab_size=99,
        max_position_embeddings=16,
        projection_dim=24,
    )
    torch.manual_seed(0)
    CLIPModel(CLIPConfig(vision_config=vision, text_config=text, projection_dim=24)).save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


def test_hf_image_encoder_is_the_pooled_projected_image_tower(tiny_hf_clip):
    import torch
    from transformers import CLIPImageProcessor, CLIPModel

    from retrieval.encoders import image_encoder

    enc = image_encoder(f"hf:{tiny_hf_clip}", device="cpu", batch_size=2)
    assert enc.dim == 24 and not any("text" in n for n, _ in enc.model.named_parameters())
    images = [Image.new("RGB", (50, 40), c) for c in [(250, 0, 0), (0, 200, 30), (10, 10, 240)]]
    full = CLIPModel.from_pretrained(tiny_hf_clip).eval()
    pixels = CLIPImageProcessor.from_pretrained(tiny_hf_clip)(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = full.get_image_features(pixel_values=pixels).pooler_output.numpy()
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(enc.encode(images), expected, atol=1e-5)


def test_a_transparent_image_is_embedded_as_the_image_processor_sees_it(tiny_hf_clip, tmp_path):
    """The model card's image processor composites transparency onto white; PIL's convert("RGB") before it kept the
    black under the alpha, so two black-on-transparent drawings (a circle, a bar) were one black square, one vector."""
    import torch
    from PIL import ImageDraw
    from transformers import CLIPImageProcessor, CLIPModel

    from retrieval.encoders import image_encoder

    drawings = []
    for shape in ("circle", "bar"):
        im = Image.new("RGBA", (64, 64), (0, 0, 0, 0))
        draw = ImageDraw.Draw(im)
        if shape == "circle":
            draw.ellipse((8, 8, 56, 56), fill=(0, 0, 0, 255))
        else:
            draw.rectangle((28, 0, 36, 64), fill=(0, 0, 0, 255))
        im.save(tmp_path / f"{shape}.png")
        drawings.append(Image.open(tmp_path / f"{shape}.png"))
    enc = image_encoder(f"hf:{tiny_hf_clip}", device="cpu", batch_size=2)
    ours = enc.encode(drawings)
    full = CLIPModel.from_pretrained(tiny_hf_clip).eval()
    pixels = CLIPImageProcessor.from_pretrained(tiny_hf_clip)(images=drawings, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = full.get_image_features(pixel_values=pixels).pooler_output.numpy()
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(ours, expected, atol=1e-5)
    assert ours[0] @ ours[1] < 0.9999  # two drawings, two vectors


def test_hf_remote_code_runs_only_when_asked(tiny_hf_clip, tmp_path):
    """A checkpoint whose config names its own code (as EVA-CLIP-8B's does) is refused without trust_remote_code;
    nothing of that code is imported."""
    import shutil

    from retrieval.encoders import image_encoder

    folder = tmp_path / "remote"
    shutil.copytree(tiny_hf_clip, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "configuration_evaclip.EvaCLIPConfig",
        "AutoModel": "modeling_evaclip.EvaCLIPModel",
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_evaclip.py").write_text("raise RuntimeError('remote code ran')\n")
    with pytest.raises(ValueError, match="trust_remote_code: true"):
        image_encoder(f"hf:{folder}", device="cpu")


def test_an_index_built_with_an_hf_encoder_answers_queries(tiny_hf_clip, tiny_world, tmp_path, encoders):
    kb = [json.loads(x) for x in open(tiny_world / "kb.jsonl", encoding="utf-8")][:12]
    (tmp_path / "kb.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kb))
    out = tmp_path / "idx"
    m = build_index(
        BuildArgs(
            kb=str(tmp_path / "kb.jsonl"),
            images_root=str(tiny_world),
            out=str(out),
            image_encoder=f"hf:{tiny_hf_clip}",
            text_encoder="tiny",
            shard_size=8,
            workers=1,
        ),
        **QUIET,
    )
    assert m["image_dim"] == 24 and m["image_processor"] == str(tiny_hf_clip)
    assert m["encoded_on"] == {"image": ["cpu float32"], "text": ["cpu float32"]}
    index = MultimodalIndex.load(out, device="cpu")
    rec = kb[5]
    hits = index.search([Image.open(tiny_world / rec["image"])], [entry_text(rec, TEMPLATE)], alpha=0.5, k=3)[0]
    assert hits[0].entity_id == rec["entity_id"] and hits[0].score == pytest.approx(1.0, abs=1e-4)


def test_image_processor_needs_an_hf_encoder(tiny_world, tmp_path):
    with pytest.raises(ValueError, match="image_processor applies to hf: image encoders only"):
        build_index(
            BuildArgs(
                kb=str(tiny_world / "kb.jsonl"),
                out=str(tmp_path / "o"),
                image_encoder="tiny",
                text_encoder="tiny",
                image_processor="openai/clip-vit-large-patch14",
            ),
            **QUIET,
        )


# --------------------------------------------------------------------------- text length and query instruction

INSTRUCTION = "Instruct: Given a question about an image, retrieve the encyclopedia section that answers it\nQuery:"


@pytest.fixture(scope="module")
def instructed_index(tiny_world, tmp_path_factory):
    out = tmp_path_factory.mktemp("instructed") / "idx"
    build_index(
        BuildArgs(
            kb=str(tiny_world / "kb.jsonl"),
            out=str(out),
            image_encoder="tiny",
            text_encoder="tiny",
            shard_size=32,
            text_max_seq_length=24,
            query_instruction=INSTRUCTION,
            device="cpu",
        ),
        **QUIET,
    )
    return out


def test_manifest_records_length_and_instruction(instructed_index, tiny_world):
    m = json.loads((instructed_index / "manifest.json").read_text())
    assert m["text_max_seq_length"] == 24 and m["query_instruction"] == INSTRUCTION
    longest = max(len(entry_text(json.loads(x), TEMPLATE)) for x in open(tiny_world / "kb.jsonl", encoding="utf-8"))
    assert longest > 24 and 0 < m["texts_truncated"] <= m["texts_encoded"]  # the tiny tokenizer is per character


def test_reward_and_evaluate_encode_a_query_alike_and_rows_never_carry_the_instruction(instructed_index, tiny_world):
    from retrieval.encoders import text_encoder
    from rewards import RetrievalReward

    queries = ["what does this creature eat? red star", "where does it live"]
    # as rl/train_grpo.py loads it for the reward, and as retrieval.evaluate loads it: two separate loads
    reward = RetrievalReward(MultimodalIndex.load(instructed_index, device="cpu", search_device="cpu"), alpha=0.5)
    evaluated = MultimodalIndex.load(instructed_index, device="cpu").encode_texts(queries)
    np.testing.assert_allclose(reward.text_embeddings(queries), evaluated, atol=1e-6)
    plain = text_encoder("tiny", device="cpu", max_seq_length=24)
    np.testing.assert_allclose(evaluated, plain.encode([INSTRUCTION + q for q in queries]), atol=1e-5)
    assert not np.allclose(evaluated, plain.encode(queries), atol=1e-3)
    # KB rows: the text half equals the row's text encoded without the instruction, truncated to 24 tokens
    rec = json.loads(open(tiny_world / "kb.jsonl", encoding="utf-8").readline())
    row_text = vectors(instructed_index)[0, -plain.dim :]
    np.testing.assert_allclose(row_text, plain.encode([entry_text(rec, TEMPLATE)])[0], atol=1e-5)
    assert not np.allclose(row_text, plain.encode([INSTRUCTION + entry_text(rec, TEMPLATE)])[0], atol=1e-3)
    untruncated = text_encoder("tiny", device="cpu", max_seq_length=128).encode([entry_text(rec, TEMPLATE)])[0]
    assert not np.allclose(row_text, untruncated, atol=1e-3)


def test_a_text_encoder_with_another_instruction_is_refused(instructed_index, encoders):
    with pytest.raises(ValueError, match="query instruction"):
        MultimodalIndex.load(instructed_index, text_encoder=encoders[1])


def test_changing_the_instruction_rewrites_the_manifest_only(instructed_index, tmp_path, tiny_world, monkeypatch):
    import shutil

    out = tmp_path / "idx"
    shutil.copytree(instructed_index, out)
    monkeypatch.setattr(bi, "encode_text_shard", lambda *a, **k: pytest.fail("re-encoded"))
    m = build_index(
        BuildArgs(
            kb=str(tiny_world / "kb.jsonl"),
            out=str(out),
            image_encoder="tiny",
            text_encoder="tiny",
            shard_size=32,
            text_max_seq_length=24,
            query_instruction="none",
        ),
        **QUIET,
    )
    assert m["query_instruction"] is None and MultimodalIndex.load(out).query_instruction is None
    np.testing.assert_array_equal(vectors(out), vectors(instructed_index))


def test_query_instruction_at_load_auto_none_or_text(instructed_index):
    assert MultimodalIndex.load(instructed_index, query_instruction="auto").query_instruction == INSTRUCTION
    assert MultimodalIndex.load(instructed_index, query_instruction="none").query_instruction is None
    assert MultimodalIndex.load(instructed_index, query_instruction="Query: ").query_instruction == "Query: "
