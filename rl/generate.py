"""Batched generation with a VLM and its processor (greedy by default): refined queries, and any stage's replies
(``vlm_generator``: one loader for the HF and vLLM backends)."""

from __future__ import annotations

import os

import torch
from tqdm import tqdm

from rl.model import load_model
from rl.prompts import prompt_messages

# sampling that changes nothing (TRL's GRPOConfig defaults, tests/test_export.py checks): every decoding setting is
# passed explicitly, so none comes from a model's generation_config.json (Qwen2.5-VL's sets a repetition penalty and a
# top-k) and the HF and vLLM backends decode alike
NEUTRAL = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0)


def sampling_settings(recorded: dict | None = None) -> dict:
    """A run's sampling settings (temperature, top_p, top_k, min_p, repetition_penalty): what ``recorded`` holds,
    NEUTRAL for the rest; top_k "off" is 0 for both backends (-1, vLLM's and TRL's other spelling, is refused by
    transformers)."""
    settings = {k: (recorded or {}).get(k, v) for k, v in NEUTRAL.items()}
    if settings["top_k"] is None or settings["top_k"] < 0:  # vLLM's (and TRL's) "off" is -1; transformers refuses it
        settings["top_k"] = 0
    return settings


def hf_decoding(do_sample: bool, sampling: dict | None = None) -> dict:
    """``generate`` keyword arguments: greedy keeps only the repetition penalty; sampling takes every setting."""
    s = sampling_settings(sampling)
    if not do_sample:
        return dict(
            do_sample=False, temperature=None, top_p=None, top_k=None, repetition_penalty=s["repetition_penalty"]
        )
    return dict(do_sample=True, **s)


def generate_completions(
    model,
    processor,
    images: list,
    questions: list[str],
    prompt: str | dict = "wikiseeker",
    batch_size: int = 32,
    max_new_tokens: int = 64,
    do_sample: bool = False,
    sampling: dict | None = None,
    progress: bool = False,
    reply_prefix: str = "",
) -> list[str]:
    """One completion per (image, question), in input order; ``images=None``: the same model without images (the
    prompt has no image block). ``sampling``: ``sampling_settings``' keys (the rest neutral). ``reply_prefix``: the
    start of every reply, written for the model (the completions returned go on from it)."""
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
            + reply_prefix
            for q in qs
        ]
        batch = processor(text=texts, images=ims, return_tensors="pt", padding=True).to(model.device)
        with torch.no_grad():
            ids = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                **hf_decoding(do_sample, sampling),
                pad_token_id=processor.tokenizer.pad_token_id,
            )
        out += processor.batch_decode(ids[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def load_vllm(path: str, flag: str = "--backend", image_budget: dict | None = None):
    """A vLLM engine for an image-text model (its processor given the same pixel budget as training), or a clear error
    when vLLM is not installed. One engine per job: under a launcher of N processes each engine would start on the
    first GPU it sees (vLLM's one-process executor ignores LOCAL_RANK), so N > 1 is refused."""
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if processes > 1:
        raise ValueError(
            f"{flag} vllm runs one engine per job, but this is one of {processes} launched processes (each engine "
            f"would start on the same GPU): run the job as one process ({flag} vllm uses the GPUs it is given; "
            f"CUDA_VISIBLE_DEVICES picks them), or use {flag} hf under accelerate launch"
        )
    try:
        from vllm import LLM
    except ImportError:
        raise ValueError(
            f"{flag} vllm needs vLLM, which is not installed (pip install vllm); or use {flag} hf"
        ) from None
    kwargs = {"mm_processor_kwargs": dict(image_budget)} if image_budget else {}
    # one image a prompt, no video (vLLM's default allows 999 videos, which its start-up memory profiling counts)
    return LLM(model=str(path), limit_mm_per_prompt={"image": 1, "video": 0}, **kwargs)


def generate_vllm(
    llm,
    processor,
    images: list,
    questions: list[str],
    prompt: str | dict,
    max_new_tokens: int,
    do_sample: bool = False,
    sampling: dict | None = None,
) -> list[str]:
    """The same prompts and decoding as generate_completions, through a vLLM engine (one completion per input).
    When sampling, each request gets its own seed (``SamplingParams.seed``), drawn from torch's generator: a
    ``torch.manual_seed`` before the call then makes a rerun draw the same samples with vLLM as with hf (the engine
    does not read torch's generator), and the copies of one prompt (R answers to a question) still differ."""
    import torch
    from vllm import SamplingParams

    run = sampling_settings(sampling)
    s = run if do_sample else {**NEUTRAL, "temperature": 0.0}
    penalty = run["repetition_penalty"]  # kept when greedy, as generate_completions keeps it
    seeds = torch.randint(0, 2**31 - 1, (len(questions),)).tolist() if do_sample else [None] * len(questions)
    params = [
        SamplingParams(
            max_tokens=max_new_tokens,
            temperature=s["temperature"],
            top_p=s["top_p"],
            top_k=s["top_k"],
            min_p=s["min_p"] or 0.0,
            repetition_penalty=penalty,
            seed=seed,
        )
        for seed in seeds
    ]
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
            llm,
            processor,
            images,
            texts,
            prompt,
            max_new_tokens,
            do_sample=sample,
            sampling={"temperature": temperature},
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
            sampling={"temperature": temperature},
        )

    return generate
