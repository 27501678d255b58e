"""The toy world's tiny models, every one built offline from a seed: the ``tiny`` image encoder (an open_clip ViT from
toy/model_configs), the ``tiny`` text encoder (a character-level BERT as a sentence-transformers model) and the
``tiny`` cross-encoder. pyproject.toml registers them under that name as entry points (``refine_rl.image_encoders``,
``refine_rl.text_encoders``, ``refine_rl.cross_encoders``), which the production factories look up
(retrieval.encoders.registered)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from retrieval.encoders import cache_dir

CONFIG_DIR = Path(__file__).parent / "model_configs"
TINY_CLIP = "refine-rl-tiny-clip"
TINY_SEED = 0


@contextmanager
def _without_random_init_warning():
    """open_clip warns on the root logger that a model built without pretrained weights is random."""

    def keep(record) -> bool:
        return "No pretrained weights loaded" not in record.getMessage()

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)


def tiny_image_encoder():
    """The ``tiny`` image encoder (entry point refine_rl.image_encoders): a seeded random open_clip ViT →
    (model, preprocess)."""
    import open_clip
    import torch

    open_clip.add_model_config(CONFIG_DIR / f"{TINY_CLIP}.json")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        with _without_random_init_warning():  # random, seeded: the toy encoder's design (logged by the encoder)
            model, _, preprocess = open_clip.create_model_and_transforms(TINY_CLIP, pretrained=None)
    return model, preprocess


TINY_TEXT_CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    max_position_embeddings=256,
    type_vocab_size=2,
)


def tiny_vocab() -> list[str]:
    """A character-level WordPiece vocabulary: covers any ASCII text, deterministic."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = [chr(c) for c in range(33, 127)]
    return specials + chars + ["##" + c for c in chars]


def build_tiny_text_model(folder: Path) -> Path:
    """Write a seeded random tiny sentence-transformers model to ``folder`` (atomically); return it."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder = Path(folder)
    if (folder / "modules.json").exists():
        return folder
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(tiny_vocab())}, do_lower_case=True)
    config = BertConfig(vocab_size=len(tiny_vocab()), **TINY_TEXT_CONFIG)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        bert = BertModel(config)
    hf_dir = tmp / "hf"
    bert.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    word = Transformer(str(hf_dir), max_seq_length=128)
    pool = Pooling(word.get_embedding_dimension(), pooling_mode="mean")
    SentenceTransformer(modules=[word, pool], device="cpu").save(str(tmp / "st"))
    try:
        os.replace(tmp / "st", folder)
    except OSError:  # another process finished first
        pass
    shutil.rmtree(tmp, ignore_errors=True)
    return folder


def tiny_text_encoder() -> Path:
    """The ``tiny`` text encoder (entry point refine_rl.text_encoders): built once into the cache."""
    key = hashlib.sha256(json.dumps([TINY_TEXT_CONFIG, tiny_vocab(), TINY_SEED]).encode()).hexdigest()[:12]
    return build_tiny_text_model(cache_dir() / f"tiny-text-{key}")


def build_tiny_cross_encoder(folder: Path) -> Path:
    """A seeded random tiny BERT cross-encoder (one relevance logit) with the tiny text encoder's vocabulary."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(tiny_vocab())}, do_lower_case=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = BertForSequenceClassification(
            BertConfig(vocab_size=len(tiny_vocab()), num_labels=1, **TINY_TEXT_CONFIG)
        )
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, folder)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def tiny_cross_encoder() -> Path:
    """The ``tiny`` cross-encoder (entry point refine_rl.cross_encoders): built once into the cache."""
    return build_tiny_cross_encoder(cache_dir() / "tiny-cross-encoder")
