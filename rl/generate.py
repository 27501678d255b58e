"""Batched generation of refined queries with a VLM and its processor (greedy by default)."""

from __future__ import annotations

import torch

from rl.prompts import prompt_messages


def generate_completions(model, processor, images: list, questions: list[str], prompt: str | dict = "wikiseeker",
                         batch_size: int = 32, max_new_tokens: int = 64, do_sample: bool = False,
                         temperature: float = 1.0, top_p: float = 1.0, progress: bool = False) -> list[str]:
    """One completion per (image, question), in input order."""
    from tqdm import tqdm

    out: list[str] = []
    starts = range(0, len(questions), batch_size)
    model.eval()
    for start in tqdm(starts, desc="generating", disable=not progress):
        qs, ims = questions[start:start + batch_size], images[start:start + batch_size]
        texts = [processor.apply_chat_template(prompt_messages(q, prompt, with_image_block=True),
                                               add_generation_prompt=True, tokenize=False) for q in qs]
        batch = processor(text=texts, images=ims, return_tensors="pt", padding=True).to(model.device)
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if do_sample else dict(do_sample=False)
        with torch.no_grad():
            ids = model.generate(**batch, max_new_tokens=max_new_tokens, **sampling,
                                 pad_token_id=processor.tokenizer.pad_token_id)
        out += processor.batch_decode(ids[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return out
