"""Encoders: tiny ones are deterministic and offline, outputs are normalised float32, bad names are refused."""

import re

import numpy as np
import pytest
from PIL import Image

from retrieval.encoder_names import check_image_encoder_name, check_text_encoder_name
from retrieval.encoders import image_encoder, l2_normalize, text_encoder


@pytest.mark.parametrize(
    "x,expected",
    [
        ([3.0, 4.0], [0.6, 0.8]),  # one vector, a list
        ([0.003, -0.004], [0.6, -0.8]),  # a short one
        (np.array([[3.0, 4.0], [0.0, -2.0]]), [[0.6, 0.8], [0.0, -1.0]]),  # float64 rows
        (np.zeros((2, 3), np.float32), np.zeros((2, 3))),  # a zero vector stays zero, never NaN
        (np.ones((2, 1, 4)), np.full((2, 1, 4), 0.5)),  # along the last axis
    ],
)
def test_l2_normalize_is_float32_along_the_last_axis(x, expected):
    out = l2_normalize(x)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, expected, atol=1e-7)


def test_tiny_image_encoder_is_deterministic_and_normalised(encoders):
    imgs = [Image.new("RGB", (40, 30), c) for c in [(250, 0, 0), (245, 10, 5), (0, 0, 250)]]
    a = encoders[0].encode(imgs)
    b = image_encoder("tiny", device="cpu", batch_size=2).encode(imgs)  # fresh build, other batching
    assert a.dtype == np.float32 and a.shape == (3, encoders[0].dim)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1, atol=1e-5)
    np.testing.assert_allclose(a, b, atol=1e-5)
    # similar colours are closer than different ones
    assert a[0] @ a[1] > a[0] @ a[2]
    assert encoders[0].encode([]).shape == (0, encoders[0].dim) and encoders[0].encode([]).dtype == np.float32


def test_tiny_text_encoder_is_deterministic_and_normalised(encoders):
    texts = ["a red star", "a red star with stripes", "zzz"]
    a = encoders[1].encode(texts)
    b = text_encoder("tiny", device="cpu").encode(texts)
    assert a.dtype == np.float32 and a.shape == (3, encoders[1].dim)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1, atol=1e-5)
    np.testing.assert_allclose(a, b, atol=1e-5)
    assert encoders[1].encode([]).shape == (0, encoders[1].dim)


def test_each_distinct_text_is_encoded_once_and_repeats_get_its_row(encoders, monkeypatch):
    """A GRPO group's completions often repeat one query: sentence-transformers receives each distinct text once, in
    first-seen order, and every repeat gets that text's row — the rows a call with no repeats gives."""
    enc = encoders[1]
    texts = ["a red star", "zzz", "a red star", "blue circle", "zzz", "a red star"]
    received, real = [], enc.model.encode
    monkeypatch.setattr(enc.model, "encode", lambda sentences, **k: received.append(sentences) or real(sentences, **k))
    out = enc.encode(texts, is_query=True)
    assert received == [["a red star", "zzz", "blue circle"]]
    alone = {t: enc.encode([t])[0] for t in set(texts)}
    assert out.shape == (6, enc.dim)
    for t, row in zip(texts, out):
        np.testing.assert_allclose(row, alone[t], atol=1e-5)


def test_minilm_relates_attribute_words():
    enc = text_encoder("minilm", device="cpu")
    e = enc.encode(
        [
            "Where does this creature live? red star striped",
            "The Zorvak is a red striped star.",
            "The Melidra is a blue plain circle.",
        ]
    )
    assert enc.dim == 384 and e[0] @ e[1] > e[0] @ e[2] + 0.1


def test_query_prompt_applies_to_queries_only():
    enc = text_encoder("tiny", device="cpu", query_prompt="query: ")
    q, d = enc.encode(["red star"], is_query=True), enc.encode(["red star"])
    np.testing.assert_allclose(q, enc.encode(["query: red star"]), atol=1e-5)
    assert not np.allclose(q, d)


@pytest.mark.parametrize(
    "setting,prompts,instruction",
    [
        (None, {"query": "q: "}, None),
        ("", {"query": "q: "}, None),
        ("none", {"query": "q: "}, None),
        ("auto", {"query": "q: "}, "q: "),
        ("auto", {"query": ""}, None),
        ("auto", None, None),
        ("Find: ", {"query": "q: "}, "Find: "),
    ],
)
def test_a_query_instruction_setting_means_none_the_models_own_or_itself(setting, prompts, instruction):
    from retrieval.encoders import query_instruction_of, resolve_query_prompt

    assert resolve_query_prompt(setting, prompts) == instruction
    if setting != "auto":  # needs no model
        assert query_instruction_of("no-such-model", setting) == instruction


def test_a_models_default_prompt_never_slips_in():
    """No query instruction means none, even for a model whose config names a default prompt
    (sentence-transformers applies ``default_prompt_name`` to any text encoded with ``prompt=None``)."""
    enc = text_encoder("tiny", device="cpu")
    plain = enc.encode(["red star"], is_query=True)
    enc.model.prompts, enc.model.default_prompt_name = {"query": "query: "}, "query"
    assert enc.query_prompt is None
    for is_query in (True, False):
        np.testing.assert_allclose(enc.encode(["red star"], is_query=is_query), plain, atol=1e-6)


@pytest.mark.parametrize(
    "name,error",
    [
        ("", "image encoder name must be a non-empty string, got ''"),
        ("no-such-model", "unknown image encoder 'no-such-model': expected a registered name"),
        ("EVA02-E-14-plus@no-such-tag", "open_clip has no pretrained tag 'no-such-tag' for EVA02-E-14-plus"),
        ("local-dir:/does/not/exist", "image encoder 'local-dir:/does/not/exist': folder /does/not/exist does not"),
    ],
)
def test_bad_image_encoder_names(name, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        check_image_encoder_name(name)


@pytest.mark.parametrize("name", ["tiny", "EVA02-E-14-plus@laion2b_s9b_b144k", "EVA02-B-16", "hf-hub:timm/x"])
def test_good_image_encoder_names(name):
    assert check_image_encoder_name(name) == name


@pytest.mark.parametrize(
    "name,ok",
    [
        ("tiny", True),
        ("minilm", True),
        ("Qwen/Qwen3-Embedding-0.6B", True),
        ("nonsense", False),
        ("", False),
        ("a/b/c", False),
    ],
)
def test_text_encoder_names(name, ok):
    if ok:
        assert check_text_encoder_name(name) == name
    else:
        with pytest.raises(ValueError, match="text encoder"):
            check_text_encoder_name(name)


@pytest.mark.parametrize(
    "prompts,refused",
    [
        ({"query": "query: ", "document": "passage: "}, True),
        ({"query": "query: ", "passage": "passage: "}, True),
        ({"query": "Instruct: find\nQuery:", "document": ""}, False),  # Qwen3-Embedding's own prompts
        ({}, False),
        (None, False),  # a model without prompts
        ({"corpus": "doc: "}, True),
    ],
)
def test_a_model_that_prompts_its_documents_is_refused(prompts, refused):
    """sentence-transformers' encode_document puts the first of the document / passage / corpus prompts before every
    document; KB rows never get one here, so such a model is refused when it loads."""
    from retrieval.encoders import check_no_document_prompt

    if refused:
        with pytest.raises(ValueError, match="text encoder e5: .*prompt before documents"):
            check_no_document_prompt("e5", prompts)
    else:
        check_no_document_prompt("e5", prompts)


def test_a_saved_model_with_a_document_prompt_fails_to_load(tmp_path):
    from sentence_transformers import SentenceTransformer

    from retrieval.encoders import minilm_path

    SentenceTransformer(str(minilm_path()), prompts={"query": "query: ", "document": "passage: "}).save(
        str(tmp_path / "e5-like")
    )
    with pytest.raises(ValueError, match="prompt before documents"):
        text_encoder(str(tmp_path / "e5-like"), device="cpu")


def test_a_coca_tower_embeds_as_open_clip_encode_image(tmp_path):
    """CoCa's vision tower returns (pooled, tokens); the embedding is the pooled part, as CoCa's encode_image."""
    import json

    import open_clip
    import torch

    config = {  # open_clip's coca_ViT-B-32.json, every width cut to a few units
        "embed_dim": 16,
        "vision_cfg": {
            "image_size": 32,
            "layers": 1,
            "width": 32,
            "patch_size": 16,
            "head_width": 16,
            "attentional_pool": True,
            "attn_pooler_heads": 2,
            "output_tokens": True,
        },
        "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 16, "heads": 2, "layers": 1, "embed_cls": True},
        "multimodal_cfg": {"context_length": 8, "vocab_size": 64, "width": 16, "heads": 2, "layers": 1},
        "custom_text": True,
    }
    (tmp_path / "coca_test_tiny.json").write_text(json.dumps(config))
    open_clip.add_model_config(tmp_path / "coca_test_tiny.json")
    encoder = image_encoder("coca_test_tiny", device="cpu", batch_size=2)
    assert encoder.dim == 16
    images = [Image.new("RGB", (40, 30), c) for c in ("red", "blue", "green")]
    got = encoder.encode(images)

    torch.manual_seed(0)
    model, _, preprocess = open_clip.create_model_and_transforms("coca_test_tiny", pretrained=None)
    model.visual.load_state_dict(encoder.model.state_dict())
    with torch.no_grad():
        expected = model.eval().encode_image(torch.stack([preprocess(i) for i in images]), normalize=True)
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-5)
