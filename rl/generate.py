"""Batched generation with a VLM and its processor (greedy by default): refined queries, and any stage's replies
(``vlm_generator``: one loader for the HF and vLLM backends)."""

from __future__ import annotations

import torch
from tqdm import tqdm

from rl.model import load_model
from rl.prompts import prompt_messages


def generate_completions(
    model,
    processor,
    images: list,
    questions: list[str],
    prompt: str | dict = "wikiseeker",
    batch_size: int = 32,
    max_new_tokens: int = 64,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    progress: bool = False,
) -> list[str]:
    """One completion per (image, question), in input order; ``images=None``: the same model without images (the
    prompt has no image block)."""
    out: list[str] = []
    starts = range(0, len(questions), batch_size)
    model.eval()
    for start in tqdm(starts, desc="generating", disable=not progress):
        qs = questions[start : start + batch_size]
        ims = None if images is None else images[start : start + batch_size]
        texts = [
            processor.apply_chat_template(
                prompt_messages(q, prompt, with_image_block=ims is not None), add_generation_prompt=True, tokenize=False
            )
            for q in qs
        ]
        batch = processor(text=texts, images=ims, return_tensors="pt", padding=True).to(model.device)
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if do_sample else dict(do_sample=False)
        with torch.no_grad():
            ids = model.generate(
                **batch, max_new_tokens=max_new_tokens, **sampling, pad_token_id=processor.tokenizer.pad_token_id
            )
        out += processor.batch_decode(ids[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def load_vllm(path: str, flag: str = "--backend", image_budget: dict | None = None):
    """A vLLM engine for an image-text model (its processor given the same pixel budget as training), or a clear error
    when vLLM is not installed."""
    try:
        from vllm import LLM
    except ImportError:
        raise ValueError(
            f"{flag} vllm needs vLLM, which is not installed (pip install vllm); or use {flag} hf"
        ) from None
    kwargs = {"mm_processor_kwargs": dict(image_budget)} if image_budget else {}
    return LLM(model=str(path), limit_mm_per_prompt={"image": 1}, **kwargs)


def generate_vllm(
    llm,
    processor,
    images: list,
    questions: list[str],
    prompt: str | dict,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> list[str]:
    """The same prompts as generate_completions, through a vLLM engine (one completion per input)."""
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=max_new_tokens, temperature=temperature if do_sample else 0.0, top_p=top_p if do_sample else 1.0
    )
    prompts = [
        {
            "prompt": processor.apply_chat_template(
                prompt_messages(q, prompt, with_image_block=True), add_generation_prompt=True, tokenize=False
            ),
            "multi_modal_data": {"image": img},
        }
        for img, q in zip(images, questions)
    ]
    return [o.outputs[0].text for o in llm.generate(prompts, params)]


def vlm_generator(
    model_path: str,
    prompt: dict,
    max_new_tokens: int,
    backend: str = "hf",
    device: str = "cpu",
    dtype: str | None = None,
    batch_size: int | None = None,
    temperature: float = 1.0,
):
    """``generate(images, texts, sample=False)`` → one reply per input from any AutoModelForImageTextToText VLM
    (``backend="hf"``, on ``device`` in ``dtype``) or a vLLM engine (``"vllm"``, when vLLM is installed), with
    ``prompt`` ({system, user_template}); the query baselines, the gates' answerer and the pipeline's VLM stages."""
    if backend == "vllm":
        from transformers import AutoProcessor

        llm, processor = load_vllm(model_path), AutoProcessor.from_pretrained(model_path)
        return lambda images, texts, sample=False: generate_vllm(
            llm, processor, images, texts, prompt, max_new_tokens, do_sample=sample, temperature=temperature
        )
    if backend != "hf":
        raise ValueError(f"--backend must be hf or vllm, got {backend!r}")
    model, processor = load_model(model_path, dtype=dtype, device=device)

    def generate(images, texts, sample=False):
        return generate_completions(
            model,
            processor,
            images,
            texts,
            prompt=prompt,
            batch_size=batch_size or max(len(texts), 1),
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            temperature=temperature,
        )

    return generate
