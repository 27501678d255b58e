"""Model cards (``README.md``) for the models we train and export: pure rendering (dicts in, markdown out) and one
atomic write at the edge.

A card is YAML front matter (``base_model``, ``library_name``, ``pipeline_tag``, ``tags``) and markdown sections.
The refiner's card is rl.model_card's, a gate's is gate.train.model_card's; both replace the placeholder card TRL's
trainer (and PEFT's ``save_pretrained``) write, so they must be written after the last save.
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from common.files import write_text_atomic

CARD_FILE = "README.md"
LIBRARY = "transformers"
PIPELINE_TAG = "image-text-to-text"


def front_matter(base_model: str | None, tags: list[str]) -> str:
    """The YAML block between ``---`` lines; a missing base model is left out rather than written as null."""
    meta = {"base_model": str(base_model)} if base_model else {}
    meta |= {"library_name": LIBRARY, "pipeline_tag": PIPELINE_TAG, "tags": [str(t) for t in tags]}
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, width=1000) + "---\n"


def render_card(base_model: str | None, tags: list[str], title: str, sections: list[tuple[str, str]]) -> str:
    """Front matter, a ``#`` title, then each (heading, body) as a ``##`` section; empty bodies are left out."""
    parts = [front_matter(base_model, tags), f"# {title}\n"]
    parts += [f"## {heading}\n\n{body.strip()}\n" for heading, body in sections if body and body.strip()]
    return "\n".join(parts)


def format_rate(value) -> str:
    """A learning rate as a card shows it: in full precision (``format_value``'s four decimals make 1e-6 a 0)."""
    return "—" if value is None else f"{float(value):g}"


def format_value(value) -> str:
    """A figure as a card shows it: floats to at most four decimals (trailing zeros dropped), None as a dash."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        text = f"{value:.4f}".rstrip("0").rstrip(".")
        return "0" if text in ("-0", "") else text
    return str(value).replace("|", "\\|").replace("\n", " ")


def flatten(metrics: dict, prefix: str = "") -> dict:
    """Nested figures (``{"accuracy_by_class": {"yes": 0.5}}``) as one level: ``accuracy_by_class/yes``."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            out |= flatten(value, f"{prefix}{key}/")
        else:
            out[f"{prefix}{key}"] = value
    return out


def figures_table(metrics: dict | None, missing: str) -> str:
    """A two-column markdown table of the figures, in the order given; ``missing`` (a plain sentence) when there are
    none."""
    rows = flatten(metrics or {})
    if not rows:
        return missing
    return "| figure | value |\n|---|---|\n" + "".join(
        f"| {format_value(k)} | {format_value(v)} |\n" for k, v in rows.items()
    )


def code_block(text: str, lang: str = "") -> str:
    return f"```{lang}\n{text.rstrip()}\n```"


def write_card(folder: str | Path, text: str) -> Path:
    """``folder/README.md``, written atomically (temporary file + rename): over whatever card was there."""
    path = Path(folder) / CARD_FILE
    write_text_atomic(path, text)
    return path
