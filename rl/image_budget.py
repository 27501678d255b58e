"""One pixel budget for every place the refiner sees an image: the training processor, vLLM rollouts, ``rl.refine``,
the export (``refiner.json``) and ``vllm serve``.

Qwen2-VL-family processors resize an image so that its area lies in [min_pixels, max_pixels] (both rounded to the
patch·merge grid), then emit one ``<|image_pad|>`` token per merged patch: at most max_pixels / (patch·merge)² image
tokens. Unset, ``max_pixels`` is 12.8 M pixels: a large OVEN / GLDv2 photo becomes up to ~16k tokens, repeated for every
generation of a group. vLLM runs its own processor from the model folder, so the same numbers must reach it
(``mm_processor_kwargs``), or its prompt and the trainer's forward pass disagree on the number of image tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from common.cli import parse
from common.files import atomic_folder
from common.placement import local_world_size

PAPER_MAX_PIXELS = 1024 * 28 * 28  # ≤ 1024 image tokens for Qwen2.5-VL (patch 14, merge 2)
PAPER_MIN_PIXELS = 4 * 28 * 28
MAX_ASPECT_RATIO = 200  # transformers' Qwen2-VL smart_resize refuses an image whose long side exceeds 200× its short


def aspect_problem(size: tuple[int, int]) -> str | None:
    """Why the Qwen2-VL processor refuses an image of this (width, height), or None."""
    w, h = size
    if max(w, h) > MAX_ASPECT_RATIO * min(w, h):
        return f"image {w}×{h} px: the Qwen2.5-VL processor refuses an aspect ratio past {MAX_ASPECT_RATIO}:1"
    return None


def check_budget(min_pixels: int | None, max_pixels: int | None) -> dict | None:
    """``{"min_pixels", "max_pixels"}`` or None when neither is set; refuses nonsense, naming the setting."""
    if min_pixels is None and max_pixels is None:
        return None
    for name, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if v is None or isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"--{name} must be a positive integer (pixels) when an image budget is set, got {v!r}")
    if min_pixels > max_pixels:
        raise ValueError(f"--min_pixels ({min_pixels}) is larger than --max_pixels ({max_pixels})")
    return {"min_pixels": int(min_pixels), "max_pixels": int(max_pixels)}


def _grid(image_processor) -> tuple[int, int]:
    return int(getattr(image_processor, "patch_size", 14)), int(getattr(image_processor, "merge_size", 2))


def max_image_tokens(budget: dict, image_processor) -> int:
    """max_pixels ÷ (patch·merge)²: the image tokens an image the processor scales down to ``budget`` can take (what
    the start-up probe checks). Not a bound for every shape: the processor rounds each side to a whole merged patch
    (28 px) and never below one, so an extreme aspect ratio (150×50 at max_pixels 12,544: 21 tokens, not 16) or a
    min_pixels that rounds up can exceed it."""
    patch, merge = _grid(image_processor)
    return max(1, math.floor(budget["max_pixels"] / (patch * merge) ** 2))


def apply_image_budget(processor, budget: dict | None):
    """Set the budget on a processor's image processor (in place; returns the processor). ``None`` leaves it."""
    if budget is None:
        return processor
    ip = getattr(processor, "image_processor", None)
    size = getattr(ip, "size", None)
    if ip is None or size is None or "longest_edge" not in dict(size):
        raise ValueError(
            f"an image budget (min_pixels / max_pixels) needs a Qwen2-VL-style image processor with a "
            f"pixel range; {type(ip).__name__} has none"
        )
    ip.size = {"shortest_edge": budget["min_pixels"], "longest_edge": budget["max_pixels"]}
    for name in ("min_pixels", "max_pixels"):  # older processors keep copies as attributes
        if hasattr(ip, name):
            setattr(ip, name, budget[name])
    return processor


def image_token_count(processor, image) -> tuple[int, tuple[int, int, int], dict]:
    """Image tokens the processor puts in the prompt for ``image``, its (t, h, w) patch grid, and the batch."""
    pad = getattr(processor, "image_token", "<|image_pad|>")
    pad_id = processor.tokenizer.convert_tokens_to_ids(pad)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    batch = processor(text=[text], images=[image], return_tensors="pt")
    grid = tuple(int(x) for x in batch["image_grid_thw"][0])
    return int((batch["input_ids"][0] == pad_id).sum()), grid, batch


def probe_image(budget: dict | None, scale: float = 2.0):
    """A grey image larger than the budget (or 1024² without one), to check that the budget holds."""
    side = int(math.sqrt(budget["max_pixels"]) * scale) if budget else 1024
    return Image.new("RGB", (side + 37, side), (120, 130, 140))


def check_image_tokens(model, processor, budget: dict | None, run_vision: bool = True) -> dict:
    """Start-up check that the processor and the model agree on image tokens, and that the budget holds.

    Patch, merge and temporal sizes of the processor must equal the model's vision config; the number of
    ``<|image_pad|>`` tokens for a probe image larger than the budget must equal grid/merge² (what the model's vision
    tower returns, checked by a forward pass when ``run_vision``: skip it under ZeRO-3, whose parameters are
    partitioned) and stay within max_pixels/(patch·merge)². Returns what it measured; raises ValueError otherwise.
    """
    import torch

    ip = processor.image_processor
    vc = getattr(model.config, "vision_config", None)
    if vc is None:
        raise ValueError(f"{type(model).__name__} has no vision_config: not an image-text model")
    pairs = {
        "patch_size": ("patch_size", "patch_size"),
        "merge_size": ("merge_size", "spatial_merge_size"),
        "temporal_patch_size": ("temporal_patch_size", "temporal_patch_size"),
    }
    for label, (p_name, m_name) in pairs.items():
        p, m = getattr(ip, p_name, None), getattr(vc, m_name, None)
        if p is not None and m is not None and int(p) != int(m):
            raise ValueError(f"image processor and model disagree on {label}: processor {p}, model {m}")
    image = probe_image(budget)
    tokens, grid, batch = image_token_count(processor, image)
    merge = int(getattr(vc, "spatial_merge_size", 2))
    expected = grid[0] * grid[1] * grid[2] // merge**2
    if tokens != expected:
        raise ValueError(
            f"the processor put {tokens} image tokens for a {image.size} probe image but the model's "
            f"vision tower returns grid {grid} / merge {merge}² = {expected} (image-token expansion "
            "mismatch)"
        )
    out = {"probe_size": list(image.size), "image_tokens": tokens, "grid_thw": list(grid)}
    if budget is not None:
        cap = max_image_tokens(budget, ip)
        if tokens > cap:
            raise ValueError(
                f"image budget not applied: a {image.size} probe image became {tokens} image tokens, "
                f"more than max_pixels {budget['max_pixels']} allows ({cap})"
            )
        out["max_image_tokens"] = cap
    if run_vision:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        with torch.no_grad():
            dtype = next(base.parameters()).dtype
            feats = base.get_image_features(
                batch["pixel_values"].to(base.device, dtype), batch["image_grid_thw"].to(base.device)
            )
        feats = getattr(feats, "pooler_output", feats)
        n = sum(len(f) for f in feats) if isinstance(feats, (list, tuple)) else int(feats.shape[0])
        if n != tokens:
            raise ValueError(
                f"the model's vision tower returned {n} image embeddings for the probe image, the "
                f"processor put {tokens} image tokens"
            )
        out["vision_tokens"] = n
    return out


def model_files(name_or_path: str) -> Path:
    """The local folder of a model: the path itself, or its snapshot in the Hugging Face cache (already downloaded
    by from_pretrained; nothing is fetched here)."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name_or_path, local_files_only=True))


def is_model_file(name: str) -> bool:
    """Config and weights (what vllm-model links), not processor, tokenizer or template files."""
    weights = name.endswith((".safetensors", ".safetensors.index.json")) or (
        name.startswith("pytorch_model") and name.endswith((".bin", ".bin.index.json"))
    )
    return name in ("config.json", "generation_config.json") or weights


def vllm_model_folder(name_or_path: str, processor, out: str | Path) -> Path:
    """A folder vLLM can load the policy from with the training image budget: the model's config and weights linked
    (no copy of the weights), every processor, tokenizer and chat-template file written by ``processor`` (budget
    included) and none of the source's (a hub folder's ``preprocessor_config.json`` or ``chat_template.json`` beside
    ours would make the result depend on which file a loader reads first). TRL's colocated vLLM
    builds ``LLM(model=model.name_or_path)`` and runs its own image processor on the raw images, while the prompt
    token ids come from the trainer's processor: both must expand an image to the same number of tokens.
    Written to a temporary sibling and renamed (a crash leaves no half folder)."""
    src, out = model_files(name_or_path), Path(out)
    with atomic_folder(out) as tmp:
        processor.save_pretrained(tmp)
        for f in src.iterdir():
            if f.is_file() and is_model_file(f.name) and not (tmp / f.name).exists():
                (tmp / f.name).symlink_to(f.resolve())
    return out


def check_same_image_tokens(processor, folder: str | Path, budget: dict | None) -> int:
    """The processor vLLM will load from ``folder`` expands a probe image to as many tokens as the trainer's."""
    from transformers import AutoProcessor

    image = probe_image(budget)
    ours = image_token_count(processor, image)[0]
    theirs = image_token_count(AutoProcessor.from_pretrained(str(folder)), image)[0]
    if ours != theirs:
        raise ValueError(
            f"the processor in {folder} (what vLLM loads) expands a {image.size} image to {theirs} image "
            f"tokens, the trainer's processor to {ours}: their pixel budgets differ"
        )
    return ours


def vllm_model_dir(output_dir: Path, process_index: int, num_processes: int, local_processes: int) -> Path:
    """``<output_dir>/vllm-model``; with several nodes, one folder per node (``vllm-model-node<k>``), so nodes that
    share a file system never replace a folder another node's vLLM is reading."""
    nodes = max(1, num_processes // max(1, local_processes))
    return output_dir / ("vllm-model" if nodes == 1 else f"vllm-model-node{process_index // local_processes}")


def write_vllm_model(state, model_path: str, processor, output_dir: Path) -> Path:
    """The folder TRL's vLLM loads on this node (rl.image_budget.vllm_model_folder), written by the node's local main
    process while the node's other processes wait: each node's vLLM reads a folder on that node's disk."""
    folder = vllm_model_dir(output_dir, state.process_index, state.num_processes, local_world_size())
    with state.local_main_process_first():
        if state.is_local_main_process:
            vllm_model_folder(model_path, processor, folder)
    return folder


@dataclass
class FolderArgs:
    model: str = field(default=None, metadata={"help": "the policy: a model folder or hub name (cached)"})
    out: str = field(default=None, metadata={"help": "folder to write (the trainer writes <output_dir>/vllm-model)"})
    min_pixels: int = field(default=PAPER_MIN_PIXELS, metadata={"help": "image budget: fewest pixels"})
    max_pixels: int = field(default=PAPER_MAX_PIXELS, metadata={"help": "image budget: most pixels"})


def main(argv=None) -> None:
    """python -m rl.image_budget --model M --out DIR [--min_pixels N --max_pixels N]: the model folder for
    `trl vllm-serve --model DIR`, with the training pixel budget in its processor."""
    from transformers import AutoProcessor

    (args,) = parse((FolderArgs,), argv, description=main.__doc__)
    if not args.model or not args.out:
        raise ValueError("--model and --out are required")
    budget = check_budget(args.min_pixels, args.max_pixels)
    processor = apply_image_budget(AutoProcessor.from_pretrained(args.model), budget)
    folder = vllm_model_folder(args.model, processor, args.out)
    print(f"wrote {folder} (image budget {budget}); serve it with: trl vllm-serve --model {folder}")


if __name__ == "__main__":
    from common.cli import run

    run(main)
