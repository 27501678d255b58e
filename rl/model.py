"""Loading the refiner VLM: any AutoModelForImageTextToText path or name, dtype from config, frozen vision tower."""

from __future__ import annotations

import io
import logging
import re
import warnings
from pathlib import Path

import torch
from PIL import Image

from common.files import read_json
from common.placement import dtype_name, outside_zero3_init, resolve_dtype
from retrieval.kb import downscaled_jpeg, to_rgb, upright
from rl.image_budget import aspect_problem


def quiet_checkpointing_deprecation() -> None:
    """PEFT 0.21 (wrapping or loading a LoRA model) and TRL 1.16 (at every generation) read
    ``model.is_gradient_checkpointing``, deprecated in transformers 5.23: a FutureWarning about the libraries' own
    code, not the run. The jobs that train or load LoRA (rl.train_grpo, gate.train.sft, rl.export) silence it."""
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def vision_tower(model):
    """The vision encoder module of a (possibly PEFT-wrapped) VLM."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for getter in (lambda m: m.model.visual, lambda m: m.visual, lambda m: m.get_encoder(modality="image")):
        try:
            tower = getter(base)
        except (AttributeError, TypeError):
            continue
        if isinstance(tower, torch.nn.Module):
            return tower
    raise ValueError(f"cannot find the vision tower of {type(base).__name__}")


def numel(p) -> int:
    """A parameter's full size, also under DeepSpeed ZeRO-3 (whose partitioned parameters have numel() 0)."""
    return int(getattr(p, "ds_numel", p.numel()))


def freeze_vision_tower(model) -> int:
    """Freeze the vision tower; returns how many parameters were frozen."""
    tower = vision_tower(model)
    tower.requires_grad_(False)
    return sum(numel(p) for p in tower.parameters())


def trainable_parameters(module) -> int:
    return sum(numel(p) for p in module.parameters() if p.requires_grad)


def trainable_names(module) -> list[str]:
    """Names of parameters with requires_grad: the frozen-tower check (sizes are 0 under ZeRO-3, flags are not)."""
    return [n for n, p in module.named_parameters() if p.requires_grad]


ZERO3_DTYPES = {"bf16": "bfloat16", "fp16": "float16", None: "float32"}  # DeepSpeed's zero.Init, by mixed precision


def master_dtype(
    requested: str | None,
    use_peft: bool,
    zero_stage: int | None,
    mixed_precision: str | None = None,
    device: str = "cpu",
    use_vllm: bool = False,
) -> tuple[str | None, str]:
    """The dtype to load trainable weights in, and what the run's precision is, in one line.

    ``zero_stage``: DeepSpeed's ZeRO stage (0–3), None without DeepSpeed; ``mixed_precision``: "bf16", "fp16" or None;
    ``device``: where the weights load (``auto`` / None is bf16 on a GPU, common.placement.resolve_dtype).
    - Full fine-tuning with 16-bit weights and no fp32 master copy cannot move them at the paper's lr 1e-6 (bf16 keeps
      8 significant bits: an update 1e-6 × a weight of 0.02 rounds away): weights then load in fp32 and the forward
      runs under 16-bit autocast. Under DeepSpeed with mixed precision, DeepSpeed keeps the fp32 master copies.
    - ZeRO-3 (with ``zero3_init_flag``, as our configs set it): DeepSpeed's partitioned init casts every parameter to
      its own dtype — bf16 / fp16 with that mixed precision, else fp32 — whatever dtype was asked for.
    - LoRA trains adapters beside the frozen weights: PEFT upcasts them to fp32, except under ZeRO-3, where TRL 1.16
      passes ``autocast_adapter_dtype=False`` (mixed-dtype parameters break ZeRO-3's all-gather): they take the
      weights' dtype. DeepSpeed ZeRO-1/2 with mixed precision casts every parameter, adapters included, to its dtype.
    - LoRA with vLLM (``use_vllm``): at every weight sync TRL merges the adapters into the frozen weights, reads them
      and unmerges (PEFT's ``w += Δ`` then ``w -= Δ``), which 16-bit weights do not survive: each round trip rounds
      some of them, and the drift builds up over the run's hundreds of syncs; the trained adapters then belong to
      other weights than the ones export merges them into. So the frozen weights load in fp32 (16-bit compute through
      autocast), as for full fine-tuning; under ZeRO-3 the merge is made on gathered copies and dropped; DeepSpeed
      ZeRO-1/2 with mixed precision would cast them back to 16 bits, and is refused."""
    ds = f"DeepSpeed ZeRO-{zero_stage}" if zero_stage is not None else None
    ds_masters = ds is not None and mixed_precision is not None
    if zero_stage == 3:
        dtype = ZERO3_DTYPES[mixed_precision]
        why = f"ZeRO-3's partitioned init casts every parameter to {dtype}" + (
            f", not the {requested} asked for" if requested not in (None, "auto", dtype) else ""
        )
        masters = "; DeepSpeed keeps fp32 master copies (mixed precision)" if ds_masters else ""
        if use_peft:
            return dtype, (
                f"weights in {dtype}, frozen ({why}); LoRA adapters in {dtype} (TRL: "
                f"autocast_adapter_dtype=False under ZeRO-3){masters}"
            )
        return dtype, f"weights in {dtype} ({why}){masters}"
    sixteen_bit = requested in ("bfloat16", "bf16", "float16", "fp16") or (
        requested in (None, "auto") and str(device).startswith("cuda")
    )
    if use_peft and use_vllm and ds_masters:
        raise ValueError(
            f"LoRA (--use_peft) with vLLM under {ds} with {mixed_precision} mixed precision: at every weight sync TRL "
            f"merges the adapters into the frozen weights and unmerges them, which {mixed_precision} weights do not "
            "survive (each round trip rounds some of them; the drift builds up over the run). Use ZeRO-3 "
            "(configs/accelerate/zero3.yaml: the merge is made on gathered copies and dropped) or no DeepSpeed "
            "(ddp.yaml / 1gpu.yaml: the frozen weights load in fp32)"
        )
    if sixteen_bit and use_peft and use_vllm:
        asked = requested if requested not in (None, "auto") else "auto (bfloat16 on a GPU)"
        return "float32", (
            f"weights in float32, frozen (dtype {asked} asked for: LoRA with vLLM merges the adapters into them and "
            "unmerges them at every weight sync, which 16-bit weights do not survive exactly), 16-bit compute through "
            "autocast; LoRA adapters in float32"
        )
    if sixteen_bit and not use_peft and not ds_masters:
        where = "outside DeepSpeed" if ds is None else f"under {ds} without mixed precision"
        asked = requested if requested not in (None, "auto") else "auto (bfloat16 on a GPU)"
        return "float32", (
            f"full fine-tuning {where}: fp32 master weights (dtype {asked} asked for; 16-bit "
            "weights would not take lr-1e-6 updates), 16-bit compute through autocast"
        )
    name = requested or "auto"
    masters = f"; {ds} keeps fp32 master copies (mixed precision)" if ds_masters else f"; {ds}" if ds else ""
    if use_peft:
        adapters = (
            f"LoRA adapters cast to {mixed_precision} by DeepSpeed"
            if ds_masters
            else "LoRA adapters in float32 (PEFT's autocast_adapter_dtype)"
        )
        return requested, f"weights in {name}, frozen; {adapters}{masters}"
    return requested, f"weights in {name}{masters or ' (as configured)'}"


def check_model_flags(model_args) -> None:
    """Refuse TRL ``ModelConfig`` settings our model loading does not apply (``load_model``): quantised loading and a
    hub revision were parsed, then silently ignored."""
    if getattr(model_args, "load_in_4bit", False) or getattr(model_args, "load_in_8bit", False):
        raise ValueError(
            "load_in_4bit / load_in_8bit: quantised loading (QLoRA) is not supported here; the weights would load "
            "unquantised. Use LoRA (--use_peft) in bf16, or DeepSpeed ZeRO-3"
        )
    if getattr(model_args, "model_revision", None) not in (None, "main"):
        raise ValueError(
            f"model_revision {model_args.model_revision!r} is not applied here: download that revision into a folder "
            "and give it as --model_name_or_path"
        )


def zero_stage(training_args) -> int | None:
    """DeepSpeed's ZeRO stage for a run, None without DeepSpeed: from ``--deepspeed`` (a JSON config) or accelerate's
    DeepSpeed plugin (``accelerate launch`` with a ``distributed_type: DEEPSPEED`` config), which transformers'
    TrainingArguments both turn into ``deepspeed_plugin``."""
    plugin = getattr(training_args, "deepspeed_plugin", None)
    return None if plugin is None else int(plugin.zero_stage)


def load_model(
    name_or_path: str,
    dtype: str | None = None,
    device: str = "cpu",
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
):
    """Model and processor from a folder or hub name (``trust_remote_code`` only when asked)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    kwargs = {"dtype": resolve_dtype(dtype, device), "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForImageTextToText.from_pretrained(name_or_path, **kwargs)
    from transformers.integrations import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():  # under ZeRO-3 the parameters are partitioned; DeepSpeed places them
        model.to(torch.device(device))
    logging.getLogger("refine_rl.model").info("%s on %s in %s", name_or_path, device, dtype_name(kwargs["dtype"]))
    processor = AutoProcessor.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    processor.tokenizer.padding_side = "left"
    return model, processor


def load_trained(folder, dtype: str | None = None, device: str = "cpu", base: str | None = None):
    """What ``trainer.save_model`` wrote (full weights, or a LoRA adapter merged into ``base`` or the base it names),
    loaded whole on this process only: outside DeepSpeed ZeRO-3's partitioned init, so one process can evaluate or
    re-save it without the others (a ZeRO-3 engine's own model is partitioned; using it on one rank would wait for
    ever on the others). Returns (model, processor)."""
    folder = Path(folder)
    adapter = folder / "adapter_config.json"
    with outside_zero3_init():
        if not adapter.exists():
            return load_model(str(folder), dtype, device)
        from peft import PeftModel
        from transformers import AutoProcessor

        base = base or read_json(adapter).get("base_model_name_or_path")
        model, processor = load_model(base, dtype, device)
        model = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    if (folder / "tokenizer_config.json").exists():
        processor = AutoProcessor.from_pretrained(str(folder))
        processor.tokenizer.padding_side = "left"
    return model, processor


def open_vlm_image(path):
    """An image file as a transformers image processor sees it in training, where TRL hands it the image the datasets
    library decoded: upright by its EXIF Orientation (``retrieval.kb.upright``), transparency composited onto white
    (``retrieval.kb.to_rgb``, as transformers' ``convert_to_rgb``). PIL's ``convert("RGB")`` drops the alpha and keeps
    whatever colour lies under it, so a transparent PNG would look otherwise at inference."""
    try:
        with Image.open(path) as opened:
            opened.load()
            return to_rgb(upright(opened))
    except Image.DecompressionBombError:  # past PIL's pixel limit: downscaled, as training's image column holds it
        with Image.open(io.BytesIO(downscaled_jpeg(path))) as opened:
            return to_rgb(opened)


def vlm_image_or_reason(path) -> tuple[Image.Image | None, str | None]:
    """(``open_vlm_image``'s image, None), or (None, why) for a file that is missing or does not decode, or an image
    the Qwen2-VL processor refuses (``rl.image_budget.aspect_problem``). The jobs over question files record such a
    question with the reason and go on (one bad image stopped them at the same batch on every run)."""
    path = Path(path)
    if not path.is_file():
        return None, f"image file missing: {path}"
    try:
        image = open_vlm_image(path)
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, …
        return None, f"image unreadable: {path} ({type(e).__name__}: {e})"
    why = aspect_problem(image.size)
    return (None, why) if why else (image, None)


def usable_batch(rows: list[dict], root: Path) -> tuple[list[dict], list, dict]:
    """A batch of question rows split by their images (``vlm_image_or_reason``, each ``root / row["image"]``): the
    rows whose image a VLM can take, those images in order, and {row id: why} for the others."""
    good, images, problems = [], [], {}
    for r in rows:
        image, why = vlm_image_or_reason(Path(root) / str(r.get("image")))
        if why:
            problems[r["id"]] = why
        else:
            good.append(r)
            images.append(image)
    return good, images, problems


def lora_config(model, model_args, freeze_vision_tower: bool = True, say=print):
    """TRL's LoRA config from ``model_args`` (None without ``use_peft``) for a VLM. With no ``lora_target_modules``
    and no PEFT default for the model's type (Qwen2.5-VL has none in PEFT 0.21, which then refuses the config inside
    the trainer, after every model has loaded), the adapters go on every linear layer (PEFT's ``all-linear``: the
    output layer excluded). The frozen vision tower is never a target."""
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    from trl import get_peft_config

    config = get_peft_config(model_args)
    if config is None:
        return None
    model_type = getattr(model.config, "model_type", None)
    unnamed = config.target_modules is None and not getattr(config, "target_parameters", None)
    if unnamed and model_type not in TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING:
        config.target_modules = "all-linear"
        say(f"LoRA targets: none given and PEFT has no default for {model_type}: every linear layer (all-linear)")
    return exclude_vision_tower(model, config) if freeze_vision_tower else config


def exclude_vision_tower(model, peft_config):
    """LoRA never targets the (frozen) vision tower, even when its layers share names with the language model's
    (Qwen2.5-VL's vision MLPs have gate_proj / up_proj / down_proj too)."""
    if peft_config is None:
        return None

    tower = vision_tower(model)
    name = next(n for n, m in model.named_modules() if m is tower)
    pattern = rf"{re.escape(name)}(\..*)?"
    existing = peft_config.exclude_modules
    if existing:
        pattern = "|".join([pattern] + ([existing] if isinstance(existing, str) else [re.escape(e) for e in existing]))
    peft_config.exclude_modules = pattern
    return peft_config


GB = 1e9


def ddp_full_finetune_bytes(
    total: int,
    trained: int,
    vllm_bytes: float = 0.0,
    index_bytes: float = 0.0,
    encoder_bytes: float = 0.0,
    processes: int = 2,
    vllm_sleeps: bool = False,
) -> dict[str, float]:
    """Bytes one GPU holds for full fine-tuning without DeepSpeed (every rank a whole replica, fp32 masters), by item;
    activations are not counted, so the sum is a lower bound. ``total`` / ``trained``: parameter counts. DDP's
    gradient buckets only with more than one process; a colocated vLLM that sleeps while the policy trains (TRL's
    ``vllm_enable_sleep_mode``, level 2) shares the memory the gradients take then: only its excess is counted."""
    gradients = 4.0 * trained
    parts = {
        "weights, fp32": 4.0 * total,
        "gradients, fp32": gradients,
        "DDP's gradient buckets (a second copy)": gradients if processes > 1 else 0.0,
        "Adam m and v, fp32": 8.0 * trained,
    }
    if vllm_sleeps:
        parts["colocated vLLM, beyond the gradients (asleep while they exist)"] = max(0.0, vllm_bytes - gradients)
    else:
        parts["colocated vLLM"] = float(vllm_bytes)
    return parts | {"index replica": float(index_bytes), "reward encoders": float(encoder_bytes)}


def check_fits(parts: dict[str, float], device_bytes: float, what: str) -> float:
    """Refuse, itemised, when ``parts`` (a lower bound: activations come on top) exceed the device's memory; returns
    the sum."""
    need = sum(parts.values())
    if need > device_bytes:
        items = "; ".join(f"{k} {v / GB:.1f}" for k, v in parts.items() if v)
        raise ValueError(
            f"{what} cannot fit on this GPU: at least {need / GB:.1f} GB before activations ({items}) "
            f"against {device_bytes / GB:.1f} GB. Use DeepSpeed (configs/accelerate/zero2.yaml or "
            f"zero3.yaml), or LoRA (--use_peft)"
        )
    return need


def restore_base_path(trained, model, model_path: str) -> None:
    """The model's own path in its config and in every LoRA adapter's ``base_model_name_or_path``, where it had been
    pointed at ``vllm-model/`` for TRL's vLLM (a folder of links into this run): an adapter naming that folder could
    not be merged on another machine."""
    model.name_or_path = model.config._name_or_path = model_path
    for config in (getattr(trained, "peft_config", None) or {}).values():
        config.base_model_name_or_path = model_path
