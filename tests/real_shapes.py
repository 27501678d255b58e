"""Real-width stand-ins for the paper's models, built offline from their published configs (configs/models/).

Every width is the real one (Qwen2.5-VL-3B-Instruct: text 2048 × 11008, 16/2 heads, vision 1280 × 3420, patch 14,
merge 2; Qwen3-Embedding-0.6B: 1024 × 3072, 16/8 heads, head_dim 128); only the depth is cut (a few layers) and the
vocabulary is a local byte-level BPE (``toy.tiny_vlm.build_tokenizer``), so the shapes, dtypes and image-token counts
of the real code path are exercised on a CPU without downloading any weights. Weights are random.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from toy.models import build_once

MODELS_DIR = Path(__file__).resolve().parent.parent / "configs" / "models"
VLM_3B = MODELS_DIR / "qwen2.5-vl-3b-instruct"
EMBEDDING_06B = MODELS_DIR / "qwen3-embedding-0.6b"


def real_vlm_config():
    """Qwen2_5_VLConfig of Qwen2.5-VL-3B-Instruct (the published config.json, legacy flat layout)."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig.from_pretrained(str(VLM_3B))


def real_image_processor(**overrides):
    """Qwen2VLImageProcessor with the published preprocessor_config.json values (pixel range, patch, merge, CLIP
    mean/std), ``overrides`` applied on top."""
    from transformers import Qwen2VLImageProcessor

    cfg = json.loads((VLM_3B / "preprocessor_config.json").read_text())
    kwargs = {
        k: cfg[k]
        for k in (
            "min_pixels",
            "max_pixels",
            "patch_size",
            "temporal_patch_size",
            "merge_size",
            "image_mean",
            "image_std",
        )
    }
    return Qwen2VLImageProcessor(**{**kwargs, **overrides})


def build_real_width_vlm(
    out: str | Path,
    corpus: list[str],
    text_layers: int = 1,
    vision_depth: int = 2,
    seed: int = 0,
    dtype: str = "bfloat16",
    vocab_size: int = 1024,
) -> Path:
    """Qwen2.5-VL-3B-Instruct's config cut to ``text_layers`` decoder layers and ``vision_depth`` vision blocks (the
    last one full-attention, as blocks 7/15/23/31 are in the real tower), vocabulary and special-token ids from a
    local tokenizer; written with the real processor settings (model in ``dtype``, as the hub checkpoint)."""
    import torch
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from toy.tiny_vlm import CHAT_TEMPLATE, build_tokenizer

    tokenizer = build_tokenizer(corpus, vocab_size)
    ids = {
        t: tokenizer.convert_tokens_to_ids(t)
        for t in ("<|endoftext|>", "<|im_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    }
    real = json.loads((VLM_3B / "config.json").read_text())
    real.update(
        num_hidden_layers=text_layers,
        max_window_layers=text_layers,
        vocab_size=len(tokenizer),
        bos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    real["vision_config"] = dict(real["vision_config"], depth=vision_depth, fullatt_block_indexes=[vision_depth - 1])
    config = Qwen2_5_VLConfig(**real)
    processor = Qwen2_5_VLProcessor(
        image_processor=real_image_processor(),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )

    def write(folder: Path) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForImageTextToText.from_config(config)
        model.generation_config.eos_token_id = ids["<|im_end|>"]
        model.generation_config.pad_token_id = ids["<|endoftext|>"]
        model.to(getattr(torch, dtype)).save_pretrained(folder)
        processor.save_pretrained(folder)

    return build_once(Path(out), "config.json", write)


def build_real_width_embedder(
    out: str | Path, corpus: list[str], layers: int = 2, seed: int = 0, vocab_size: int = 1024
) -> Path:
    """A sentence-transformers folder shaped like Qwen3-Embedding-0.6B: its Qwen3 config cut to ``layers`` layers,
    modules Transformer → Pooling(lasttoken) → Normalize, the published query prompt, a local byte-level BPE that
    pads on the left and appends ``<|endoftext|>`` to every text (as the real tokenizer's post-processor does), read
    as plain text like the hub folder (no chat template applied)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from tokenizers import processors
    from transformers import Qwen3Config, Qwen3Model

    from toy.tiny_vlm import build_tokenizer

    tokenizer = build_tokenizer(corpus, vocab_size)
    eos = "<|endoftext|>"
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A:0 {eos}:0",
        pair=f"$A:0 {eos}:0 $B:1 {eos}:1",
        special_tokens=[(eos, tokenizer.convert_tokens_to_ids(eos))],
    )
    tokenizer.padding_side = "left"
    st_config = json.loads((EMBEDDING_06B / "config_sentence_transformers.json").read_text())
    real = json.loads((EMBEDDING_06B / "config.json").read_text())
    eos_id = tokenizer.convert_tokens_to_ids(eos)
    real.update(
        num_hidden_layers=layers,
        max_window_layers=layers,
        vocab_size=len(tokenizer),
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    config = Qwen3Config(**real)

    def write(folder: Path) -> None:
        with tempfile.TemporaryDirectory() as hf, torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            Qwen3Model(config).save_pretrained(hf)
            tokenizer.save_pretrained(hf)
            word = Transformer(hf, max_seq_length=512)
            pool = Pooling(word.get_embedding_dimension(), pooling_mode="lasttoken")
            SentenceTransformer(
                modules=[word, pool, Normalize()],
                device="cpu",
                prompts={k: v for k, v in st_config["prompts"].items() if v},
            ).save(str(folder))
        # The hub folder was saved by a sentence-transformers older than 6, whose sentence_bert_config.json has no
        # modality_config: version 6 then reads plain text, never the tokenizer's chat template. Written the same
        # way here (version 6 would otherwise render every text through this tokenizer's chat template).
        (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))

    return build_once(Path(out), "config.json", write)
