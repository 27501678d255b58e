"""The paper's models at their real widths, offline: Qwen2.5-VL-3B-Instruct and Qwen3-Embedding-0.6B built from their
published configs (configs/models/) with every width kept and only the depth cut, random weights and a local
tokenizer. They check what the tiny models cannot: the real processor's pixel range against the image budget, a GRPO
run through rl.train_grpo at hidden 2048 / vision 1280, and the retrieval reward over a 1024 + 1024-d index with a
Qwen3-Embedding-shaped text encoder and its query instruction. In fp32 where the dtype is not the point; the GRPO run
in the real configs' bf16 is a ``slow`` test (``pytest -m slow``)."""

import json
import math
import time

import numpy as np
import pytest
import torch
from PIL import Image

import rl.train_grpo as tg
from rl.image_budget import (
    PAPER_MAX_PIXELS,
    PAPER_MIN_PIXELS,
    apply_image_budget,
    check_image_tokens,
    image_token_count,
    max_image_tokens,
)
from tests.real_shapes import EMBEDDING_06B, VLM_3B, build_real_width_embedder, build_real_width_vlm
from tests.test_train_grpo import weights

REAL_VLM = json.loads((VLM_3B / "config.json").read_text())
REAL_PREPROCESSOR = json.loads((VLM_3B / "preprocessor_config.json").read_text())
REAL_EMBEDDING = json.loads((EMBEDDING_06B / "config.json").read_text())
QUERY_INSTRUCTION = json.loads((EMBEDDING_06B / "config_sentence_transformers.json").read_text())["prompts"]["query"]
# The GRPO test's budget: at most 64 image tokens per image instead of the paper's 1024. Same code path (processor
# resize, image-token expansion, vision tower, loss); on this 2-core machine the two steps take ~8 s at 64 and ~44 s at
# 1024 (972 image tokens per prompt × 4 completions through a 2048-wide model). The paper's budget itself is checked
# on the processor and the vision tower below.
TEST_BUDGET = {"min_pixels": PAPER_MIN_PIXELS, "max_pixels": 64 * 28 * 28}
PAPER_BUDGET = {"min_pixels": PAPER_MIN_PIXELS, "max_pixels": PAPER_MAX_PIXELS}


# --------------------------------------------------------------------------- the refiner: Qwen2.5-VL-3B widths


def test_published_config_files_parse_to_the_real_values():
    """transformers reads the hub's files (the 3B's legacy flat layout included) into the values the tests rely on."""
    from transformers import Qwen3Config

    from tests.real_shapes import real_image_processor, real_vlm_config

    vlm = real_vlm_config()
    t, v = vlm.text_config, vlm.vision_config
    assert (
        t.hidden_size,
        t.intermediate_size,
        t.num_attention_heads,
        t.num_key_value_heads,
        t.num_hidden_layers,
        t.vocab_size,
        t.rms_norm_eps,
    ) == (2048, 11008, 16, 2, 36, 151936, 1e-6)
    assert t.rope_parameters["rope_theta"] == 1e6 and t.rope_parameters["mrope_section"] == [16, 24, 24]
    assert sum(t.rope_parameters["mrope_section"]) == t.hidden_size // t.num_attention_heads // 2
    assert vlm.tie_word_embeddings is True
    assert (
        v.depth,
        v.hidden_size,
        v.intermediate_size,
        v.num_heads,
        v.out_hidden_size,
        v.patch_size,
        v.spatial_merge_size,
        v.temporal_patch_size,
        v.window_size,
        v.fullatt_block_indexes,
    ) == (32, 1280, 3420, 16, 2048, 14, 2, 2, 112, [7, 15, 23, 31])
    assert (vlm.image_token_id, vlm.video_token_id, vlm.vision_start_token_id, vlm.vision_end_token_id) == (
        151655,
        151656,
        151652,
        151653,
    )
    ip = real_image_processor()
    assert dict(ip.size) == {"shortest_edge": 3136, "longest_edge": 12845056}
    assert (ip.patch_size, ip.merge_size, ip.temporal_patch_size) == (14, 2, 2)
    emb = Qwen3Config.from_pretrained(str(EMBEDDING_06B))
    assert (
        emb.hidden_size,
        emb.num_hidden_layers,
        emb.num_attention_heads,
        emb.num_key_value_heads,
        emb.head_dim,
        emb.intermediate_size,
        emb.max_position_embeddings,
        emb.vocab_size,
    ) == (1024, 28, 16, 8, 128, 3072, 32768, 151669)
    assert emb.rope_parameters["rope_theta"] == 1e6 and emb.tie_word_embeddings is True
    assert QUERY_INSTRUCTION == (
        "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
    )


@pytest.fixture(scope="module")
def real_vlm(tiny_world, tmp_path_factory):
    """Qwen2.5-VL-3B-Instruct cut to 1 text layer and 2 vision blocks (≈156M parameters), saved in bf16."""
    from toy.refiner import tokenizer_corpus

    return build_real_width_vlm(tmp_path_factory.mktemp("real-vlm") / "qwen2.5-vl-3b-cut", tokenizer_corpus(tiny_world))


@pytest.fixture(scope="module")
def real_vlm_loaded(real_vlm):
    from rl.model import load_model

    return load_model(str(real_vlm), "float32")  # the widths and the budget are the point here, not the dtype


def test_built_model_has_every_real_width(real_vlm, real_vlm_loaded):
    model, processor = real_vlm_loaded
    text, vision = model.config.text_config, model.config.vision_config
    rv = REAL_VLM["vision_config"]
    assert (
        (text.hidden_size, text.intermediate_size, text.num_attention_heads, text.num_key_value_heads)
        == (
            REAL_VLM["hidden_size"],
            REAL_VLM["intermediate_size"],
            REAL_VLM["num_attention_heads"],
            REAL_VLM["num_key_value_heads"],
        )
        == (2048, 11008, 16, 2)
    )
    assert text.rms_norm_eps == REAL_VLM["rms_norm_eps"] and text.rope_parameters["rope_theta"] == 1e6
    assert text.rope_parameters["mrope_section"] == REAL_VLM["rope_scaling"]["mrope_section"] == [16, 24, 24]
    assert model.config.tie_word_embeddings is True
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "out_hidden_size",
        "patch_size",
        "spatial_merge_size",
        "temporal_patch_size",
        "window_size",
    ):
        assert getattr(vision, name) == rv[name], name
    assert (text.num_hidden_layers, vision.depth, vision.fullatt_block_indexes) == (1, 2, [1])  # only depth is cut
    # the tensors themselves (not just the config): GQA 16 query / 2 KV heads of 128, the merger 4·1280 → 2048
    sd = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shape = lambda suffix: next(s for k, s in sd.items() if k.endswith(suffix))  # noqa: E731
    assert shape("layers.0.self_attn.q_proj.weight") == (2048, 2048)
    assert shape("layers.0.self_attn.k_proj.weight") == (256, 2048)
    assert shape("layers.0.mlp.gate_proj.weight") == (11008, 2048)
    assert shape("blocks.1.mlp.gate_proj.weight") == (3420, 1280)
    assert shape("blocks.0.attn.qkv.weight") == (3 * 1280, 1280)
    assert shape("patch_embed.proj.weight") == (1280, 3, 2, 14, 14)
    assert shape("merger.mlp.2.weight") == (2048, 4 * 1280)
    # vocabulary and special tokens are the local tokenizer's
    tok = processor.tokenizer
    assert text.vocab_size == len(tok) and model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert model.config.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert model.config.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    # the processor is the real one: pixel range, patch / merge / temporal sizes, CLIP mean and std
    ip = processor.image_processor
    assert (
        dict(ip.size)
        == {"shortest_edge": REAL_PREPROCESSOR["min_pixels"], "longest_edge": REAL_PREPROCESSOR["max_pixels"]}
        == {"shortest_edge": 3136, "longest_edge": 12845056}
    )
    assert (ip.patch_size, ip.merge_size, ip.temporal_patch_size) == (14, 2, 2)
    assert (
        list(ip.image_mean) == REAL_PREPROCESSOR["image_mean"] and list(ip.image_std) == REAL_PREPROCESSOR["image_std"]
    )
    assert json.loads((real_vlm / "config.json").read_text())["dtype"] == "bfloat16"


def test_paper_budget_caps_a_large_photo_that_the_real_default_would_not(real_vlm, real_vlm_loaded):
    from transformers import AutoProcessor

    model, _ = real_vlm_loaded
    photo = Image.new("RGB", (3000, 2000), (90, 120, 150))
    default = AutoProcessor.from_pretrained(str(real_vlm))  # the real preprocessor_config: max_pixels 12845056
    n_default, grid_default, _ = image_token_count(default, photo)
    budgeted = apply_image_budget(AutoProcessor.from_pretrained(str(real_vlm)), PAPER_BUDGET)
    n_paper, grid_paper, _ = image_token_count(budgeted, photo)
    print(
        f"\n3000×2000 photo: {n_default} image tokens with the real default pixel range (grid {grid_default}), "
        f"{n_paper} with the paper's budget (grid {grid_paper})"
    )
    assert n_default == (1988 // 28) * (2996 // 28) == 7597  # 2000×3000 rounded to the 28-px grid, no downscale
    assert max_image_tokens(PAPER_BUDGET, budgeted.image_processor) == 1024
    assert 900 < n_paper <= 1024
    t = time.perf_counter()
    probe = check_image_tokens(model, budgeted, PAPER_BUDGET, run_vision=True)  # a 1024-token probe through the tower
    print(f"check_image_tokens at the paper budget: {probe} ({time.perf_counter() - t:.1f}s)")
    assert probe["vision_tokens"] == probe["image_tokens"] <= 1024


def write_big_image_questions(tiny_world, out, n=4, size=(1120, 840)):
    """The first ``n`` toy-world train questions with their images upscaled beyond the paper's budget (940,800 px
    > 1024·28²); entity ids unchanged, so they stay in the tiny index."""
    rows = [json.loads(x) for x in open(tiny_world / "train.jsonl", encoding="utf-8")][:n]
    (out / "images").mkdir(parents=True, exist_ok=True)
    for r in rows:
        big = Image.open(tiny_world / r["image"]).convert("RGB").resize(size, Image.BICUBIC)
        r["image"] = f"images/{r['id']}.png"
        big.save(out / r["image"])
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out / "train.jsonl"


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_two_grpo_steps_at_real_width_stay_within_the_image_budget(
    config, real_vlm, tiny_world, tmp_path, monkeypatch, dtype
):
    """At real width, in fp32 (seconds) or in the real configs' bf16 (``-m slow``: on a CPU without bf16 instructions
    torch runs bf16 through slow fallbacks, half an hour on the slowest machine of this kind)."""
    from transformers import AutoProcessor

    import rewards.retrieval
    import rl.model

    start = time.perf_counter()
    train = write_big_image_questions(tiny_world, tmp_path / "data")
    first_image = Image.open(tmp_path / "data" / json.loads(train.read_text().splitlines()[0])["image"])
    expected = image_token_count(
        apply_image_budget(AutoProcessor.from_pretrained(str(real_vlm)), TEST_BUDGET), first_image
    )[0]
    seen, image_token = [], {}

    def record(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            per_row = (ids == image_token["id"]).sum(dim=1)
            if int(per_row.max()) > 0:  # cached decoding steps carry no prompt
                seen.append(per_row.tolist())

    real_load = rl.model.load_model

    def load_and_watch(*a, **k):
        model, processor = real_load(*a, **k)
        image_token["id"] = model.config.image_token_id
        model.register_forward_pre_hook(record, with_kwargs=True)
        return model, processor

    monkeypatch.setattr("rl.trainer_parts.load_model", load_and_watch)
    # a random model never writes the <think>/<answer> format, so every completion would score the same and GRPO's
    # advantage (reward − group mean) would be zero: no update. The retrieval reward reads the raw completion as the
    # query instead, ranked by its text alone (α = 0) with one reward step per rank (24 entities), so the random
    # texts of a group score differently and the update is not zero.
    monkeypatch.setattr(rewards.retrieval, "parse_query", lambda text, max_tokens=None: text.strip() or None)
    tiers = ",".join(f"{r}-{r}:{(24 - r) / 6:.4f}" for r in range(1, 25))
    result = tg.main(
        config(
            model_name_or_path=str(real_vlm),
            prompt="wikiseeker",
            train_file=str(train),
            images_root=str(train.parent),
            dtype=dtype,
            bf16=dtype == "bfloat16",
            num_generations=2,
            per_device_train_batch_size=2,
            max_completion_length=8,
            max_steps=2,
            learning_rate=1e-6,
            lr_scheduler_type="constant",
            reward_tiers=tiers,
            alpha=0.0,
            **TEST_BUDGET,
        )
    )
    wall = time.perf_counter() - start
    cap = max_image_tokens(TEST_BUDGET, AutoProcessor.from_pretrained(str(real_vlm)).image_processor)
    rows = [n for forward in seen for n in forward]
    print(
        f"\nGRPO at real width, 2 steps × 1 prompt × 2 generations: {len(seen)} forward passes with images, "
        f"{sorted(set(rows))} image tokens per row (budget cap {cap}); wall {wall:.1f}s"
    )
    assert cap == 64 and len(seen) >= 4 and all(0 < n <= cap for n in rows)  # per step: generation + loss forward
    assert set(rows) == {expected}  # 1120×840 → the budget's grid, in generation and in the loss forward alike
    logs = [h for h in result["log_history"] if "reward" in h]
    assert len(logs) == 2 and any(h["grad_norm"] > 0 for h in logs), logs
    before, after = weights(real_vlm), weights(tmp_path / "run" / "final")
    vision = [k for k in before if ".visual." in k or k.startswith("visual.")]
    text = [k for k in before if k not in vision]
    assert all(v.dtype == torch.float32 for v in after.values())  # fp32 master weights (under dtype bfloat16 too)
    assert vision and all(torch.equal(before[k].float(), after[k]) for k in vision)  # frozen tower
    assert any(not torch.equal(before[k].float(), after[k]) for k in text)  # lr 1e-6 moved the text model


# --------------------------------------------------------------------------- the text side: Qwen3-Embedding widths


@pytest.fixture(scope="module")
def real_embedder(tiny_world, tmp_path_factory):
    from toy.refiner import tokenizer_corpus

    return build_real_width_embedder(
        tmp_path_factory.mktemp("real-emb") / "qwen3-embedding-cut", tokenizer_corpus(tiny_world)
    )


@pytest.fixture(scope="module")
def real_text_encoder(real_embedder):
    from retrieval.encoders import text_encoder

    return text_encoder(str(real_embedder), device="cpu", query_prompt=QUERY_INSTRUCTION)


def test_embedder_has_real_widths_and_the_instruction_reaches_queries_only(real_embedder, real_text_encoder):
    enc = real_text_encoder
    cfg = enc.model[0].auto_model.config
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
    ):
        assert getattr(cfg, name) == REAL_EMBEDDING[name], name
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (1024, 16, 8, 128)
    assert cfg.num_hidden_layers == 2 and enc.dim == 1024
    assert json.loads((real_embedder / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "lasttoken"
    assert [m["type"].rsplit(".", 1)[-1] for m in json.loads((real_embedder / "modules.json").read_text())] == [
        "Transformer",
        "Pooling",
        "Normalize",
    ]
    tok = enc.model.tokenizer
    batch = tok(["a red dotted star", "a"], padding=True)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.padding_side == "left" and batch["attention_mask"][1][0] == 0  # left padding
    assert all(ids[-1] == eos for ids in batch["input_ids"])  # <|endoftext|> appended, as Qwen3-Embedding does

    texts = ["What is this creature called?", "The Holhol is a green striped diamond. It lives in bamboo groves."]
    queries, rows = enc.encode(texts, is_query=True), enc.encode(texts, is_query=False)
    assert queries.shape == rows.shape == (2, 1024) and queries.dtype == np.float32
    assert np.allclose(np.linalg.norm(queries, axis=1), 1, atol=1e-5)
    assert np.allclose(np.linalg.norm(rows, axis=1), 1, atol=1e-5)
    st = enc.model
    with_prompt = st.encode(texts, prompt=QUERY_INSTRUCTION, normalize_embeddings=True)
    without = st.encode(texts, normalize_embeddings=True)
    assert np.allclose(queries, with_prompt, atol=1e-5) and np.allclose(rows, without, atol=1e-5)
    assert (queries * rows).sum(1).max() < 0.999  # the instruction changes the query vectors


class PixelProjection:
    """Image-encoder stand-in at EVA-CLIP's width: a fixed random projection of 16×16 RGB pixels to 1024-d."""

    name, dim = "pixel-projection-1024", 1024

    def __init__(self, seed=0):
        self.weight = np.random.default_rng(seed).normal(size=(16 * 16 * 3, self.dim)).astype(np.float32)

    def encode(self, images):
        x = np.stack(
            [np.asarray(im.convert("RGB").resize((16, 16)), dtype=np.float32).ravel() / 255 - 0.5 for im in images]
        )
        v = x @ self.weight
        return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def test_retrieval_reward_at_1024_plus_1024_matches_a_numpy_brute_force(real_text_encoder):
    """3,000 KB rows of 300 entities (KB text encoded without the instruction); the reward, called as TRL calls
    it, ranks each refined query (encoded with the instruction) exactly as a numpy brute force does."""
    from retrieval.encoders import l2_normalize
    from retrieval.faiss_build import build_faiss_index
    from retrieval.index import MultimodalIndex
    from rewards import RetrievalReward, format_completion, rank_reward
    from toy.drawing import COLOURS, PATTERNS, SHAPES

    rng = np.random.default_rng(0)
    enc, images_enc, alpha, n_ent, per_ent, g = real_text_encoder, PixelProjection(), 0.63, 300, 10, 4
    colours = list(COLOURS)
    desc = [
        f"The E{e:03d} is a {colours[e % len(colours)]} {PATTERNS[e // 8 % 4]} {SHAPES[e // 32 % 6]}."
        for e in range(n_ent)
    ]
    # pictures in 12 colour groups (like the toy world's colours): the image narrows the search to a group, the text
    # has to do the rest, so ranks spread over the tiers
    base = rng.integers(40, 216, size=(12, 1, 1, 3))

    def noisy(e):
        return Image.fromarray(np.clip(base[e % 12] + rng.normal(0, 24, size=(16, 16, 3)), 0, 255).astype(np.uint8))

    pictures = [noisy(e) for e in range(n_ent)]
    kb_text = np.repeat(enc.encode(desc, is_query=False), per_ent, axis=0)
    kb_image = np.repeat(images_enc.encode(pictures), per_ent, axis=0)
    rows = np.concatenate(
        [
            l2_normalize(kb_image + 0.01 * rng.normal(size=kb_image.shape)),
            l2_normalize(kb_text + 0.01 * rng.normal(size=kb_text.shape)),
        ],
        1,
    ).astype(np.float32)
    entity_ids = [f"ent{e:03d}" for e in range(n_ent) for _ in range(per_ent)]
    manifest = {"image_dim": 1024, "text_dim": 1024, "image_encoder": images_enc.name, "text_encoder": enc.name}
    index = MultimodalIndex(
        build_faiss_index(rows, "Flat"),
        [f"row{i}" for i in range(len(rows))],
        entity_ids,
        manifest,
        image_encoder=images_enc,
        text_encoder=enc,
        device="cpu",
        rank_method="exact",
    )
    assert index.uses_exact_ranks and len(index) == 3000 and rows.shape[1] == 2048

    gold = [int(e) for e in rng.choice(n_ent, size=6, replace=False)]
    questions = [
        {"id": f"q{i}", "entity_id": f"ent{e:03d}", "question": "What is this creature called?"}
        for i, e in enumerate(gold)
    ]
    images = [noisy(e) for e in gold]  # another photo of the entity: its colour group, fresh noise
    queries = []
    for i, e in enumerate(gold):
        other = gold[(i + 1) % len(gold)]
        queries += [desc[e], f"What is this creature called? {desc[other]}", "nonsense words", None]
    completions = [format_completion(q) if q else "no format here" for q in queries]
    reward = RetrievalReward(index, alpha=alpha)
    rep = lambda xs: [x for x in xs for _ in range(g)]  # noqa: E731  TRL repeats each column per generation
    out = reward(
        prompts=rep([[{"role": "user", "content": q["question"]}] for q in questions]),
        completions=[[{"role": "assistant", "content": c}] for c in completions],
        completion_ids=[[1, 2]] * len(completions),
        id=rep([q["id"] for q in questions]),
        entity_id=rep([q["entity_id"] for q in questions]),
        question=rep([q["question"] for q in questions]),
        image=rep(images),
        trainer_state=None,
        log_extra=lambda *a: None,
        log_metric=lambda *a: None,
    )

    # the brute force: its own query vectors (sentence-transformers with the instruction, the projection), its own
    # α-weighted concatenation, the best row per entity, rank = 1 + entities strictly better (ties within 1e-5)
    parsed = [q for q in queries if q is not None]
    text_q = dict(zip(parsed, enc.model.encode(parsed, prompt=QUERY_INSTRUCTION, normalize_embeddings=True)))
    for q in parsed:
        assert np.allclose(reward.text_cache[q], text_q[q], atol=1e-5)  # the reward's queries got the instruction
    image_q = images_enc.encode(images)
    ent_of_row = np.repeat(np.arange(n_ent), per_ent)
    ranks = []
    for j, q in enumerate(queries):
        if q is None:
            assert out[j] == -2.5
            ranks.append("unparsed")
            continue
        v = np.concatenate([alpha * image_q[j // g], (1 - alpha) * text_q[q]])
        v /= np.linalg.norm(v)
        best = np.full(n_ent, -np.inf)
        np.maximum.at(best, ent_of_row, rows @ v)
        mine = best[gold[j // g]]
        lo, hi = int((best > mine + 1e-5).sum()) + 1, int((best >= mine - 1e-5).sum())
        ranks.append((lo, hi))
        allowed = {rank_reward(r if r <= 200 else None) for r in range(lo, hi + 1)}
        assert out[j] in allowed, (j, q, out[j], lo, hi)
    print(f"\nbrute-force ranks (lo, hi) per completion: {ranks}\nrewards: {out}")
    assert all(math.isfinite(x) for x in out)
    assert len({x for x, q in zip(out, queries) if q is not None}) > 1  # the ranks spread over several tiers


def test_truncated_sections_keep_the_token_qwen3_embedding_pools(real_embedder):
    """A section longer than max_seq_length is cut by the tokenizer with <|endoftext|> still last: last-token pooling
    reads the end-of-text state of the kept prefix, as the model expects (not a token from mid-section)."""
    from retrieval.encoders import text_encoder

    enc = text_encoder(str(real_embedder), device="cpu", max_seq_length=12)
    tok = enc.model.tokenizer
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    long = "The Holhol is a green striped diamond. " * 20
    features = enc.model.tokenize([long, "a red star"])
    ids, mask = features["input_ids"], features["attention_mask"]
    assert ids.shape[1] == 12 and ids[0, -1] == eos and ids[1, -1] == eos and mask[1, 0] == 0
    full = tok(long)["input_ids"]
    assert len(full) > 12 and ids[0, :-1].tolist() == full[:11]  # the first 11 tokens of the section, then <eos>
    np.testing.assert_allclose(
        enc.encode([long]),
        text_encoder(str(real_embedder), device="cpu", max_seq_length=12).encode([long + " more"]),
        atol=1e-5,
    )
