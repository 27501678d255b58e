"""A tiny Qwen2.5-VL-architecture VLM built offline: byte-level BPE tokenizer trained on local text, a Qwen2.5-VL
processor and a randomly initialised model small enough to train on a CPU in minutes.

It goes through exactly the code path of a real model (AutoModelForImageTextToText / AutoProcessor from a folder).
"""

from __future__ import annotations

from pathlib import Path

from common.files import atomic_folder
from rl.model import vision_tower

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
FORMAT_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TINY_CONFIG = dict(
    text=dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
    ),
    vision=dict(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[1],
    ),
)


def build_tokenizer(corpus: list[str], vocab_size: int = 1024, extra_tokens=()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens(FORMAT_TOKENS + list(extra_tokens))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
    )


def build_processor(tokenizer, image_pixels: int = 112 * 112):
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(min_pixels=image_pixels, max_pixels=max(image_pixels, 112 * 112))
    return Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_vlm(
    out: str | Path,
    corpus: list[str],
    seed: int = 0,
    vocab_size: int = 1024,
    image_pixels: int = 112 * 112,
    extra_tokens=(),
    vision_from: str | Path | None = None,
) -> Path:
    """Write a tiny Qwen2.5-VL (model + processor + tokenizer) to ``out`` atomically; returns ``out``.

    ``image_pixels``: images are resized to at least this many pixels (56 px toy images → 112 px: 8×8 patches of
    14 px, 16 image tokens after the 2×2 merge), enough for a tiny ViT to tell shapes and patterns apart.
    ``extra_tokens``: words that must be single tokens (a gate's verbalisers). ``vision_from``: a tiny VLM folder whose
    trained vision tower (same architecture) is copied in, so the new model starts out seeing."""
    import torch
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

    out = Path(out)
    if (out / "config.json").exists():
        return out
    tokenizer = build_tokenizer(corpus, vocab_size, extra_tokens)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        TINY_CONFIG["text"],
        vocab_size=len(tokenizer),
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(TINY_CONFIG["vision"], out_hidden_size=text["hidden_size"])
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
    if vision_from is not None:
        donor = AutoModelForImageTextToText.from_pretrained(str(vision_from))
        vision_tower(model).load_state_dict(vision_tower(donor).state_dict())
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    with atomic_folder(out) as tmp:
        model.save_pretrained(tmp)
        build_processor(tokenizer, image_pixels).save_pretrained(tmp)
    return out
