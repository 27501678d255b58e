"""The toy world's tiny models, every one built offline from a seed: the ``tiny`` image encoder (an open_clip ViT from
toy/model_configs), the ``tiny`` text encoder (a character-level BERT as a sentence-transformers model) and the
``tiny`` cross-encoder. pyproject.toml registers them under that name as entry points (``refine_rl.image_encoders``,
``refine_rl.text_encoders``, ``refine_rl.cross_encoders``), which the production factories look up
(retrieval.encoder_names.registered)."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from contextlib import contextmanager
from pathlib import Path

from common.files import atomic_folder, wait_for_path
from retrieval.encoder_names import cache_dir

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


BUILD_WAIT_S = 600  # how long another process waits for process 0's build of a tiny model


def build_once(folder: Path, marker: str, write) -> Path:
    """``folder`` (done when it holds ``marker``), written by ``write(tmp)`` into a temporary folder renamed into place.
    Under torch.distributed only process 0 writes — transformers' ``save_pretrained`` writes nothing on the other
    ranks — and the others wait for its folder (at most BUILD_WAIT_S; the cache must be on a file system every
    process sees)."""
    import torch.distributed as dist

    folder = Path(folder)
    if (folder / marker).exists():
        return folder
    if dist.is_available() and dist.is_initialized() and dist.get_rank() > 0:
        return wait_for_path(folder / marker, BUILD_WAIT_S, f"process 0 to build {folder.name}").parent
    with atomic_folder(folder, replace=False) as tmp:
        write(tmp)
    return folder


def build_tiny_text_model(folder: Path) -> Path:
    """A seeded random tiny sentence-transformers model in ``folder`` (built once, atomically); return it."""

    def write(tmp: Path) -> None:
        import torch
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
        from transformers import BertConfig, BertModel, BertTokenizerFast

        tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(tiny_vocab())}, do_lower_case=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(TINY_SEED)
            bert = BertModel(BertConfig(vocab_size=len(tiny_vocab()), **TINY_TEXT_CONFIG))
        bert.save_pretrained(tmp / "hf")
        tokenizer.save_pretrained(tmp / "hf")
        word = Transformer(str(tmp / "hf"), max_seq_length=128)
        pool = Pooling(word.get_embedding_dimension(), pooling_mode="mean")
        SentenceTransformer(modules=[word, pool], device="cpu").save(str(tmp))  # its own copy of the weights
        shutil.rmtree(tmp / "hf")

    return build_once(folder, "modules.json", write)


def tiny_text_encoder() -> Path:
    """The ``tiny`` text encoder (entry point refine_rl.text_encoders): built once into the cache."""
    key = hashlib.sha256(json.dumps([TINY_TEXT_CONFIG, tiny_vocab(), TINY_SEED]).encode()).hexdigest()[:12]
    return build_tiny_text_model(cache_dir() / f"tiny-text-{key}")


def build_tiny_cross_encoder(folder: Path) -> Path:
    """A seeded random tiny BERT cross-encoder (one relevance logit) with the tiny text encoder's vocabulary."""

    def write(tmp: Path) -> None:
        import torch
        from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

        tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(tiny_vocab())}, do_lower_case=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(TINY_SEED)
            model = BertForSequenceClassification(
                BertConfig(vocab_size=len(tiny_vocab()), num_labels=1, **TINY_TEXT_CONFIG)
            )
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return build_once(folder, "config.json", write)


def tiny_cross_encoder() -> Path:
    """The ``tiny`` cross-encoder (entry point refine_rl.cross_encoders): built once into the cache."""
    return build_tiny_cross_encoder(cache_dir() / "tiny-cross-encoder")
