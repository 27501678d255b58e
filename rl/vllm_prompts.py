"""The prompt colocated vLLM samples from is the prompt the policy is trained on: one image placeholder per image.

TRL 1.16 tokenizes each rollout prompt with the processor, so an image is already expanded into N ``<|image_pad|>``
ids (N = the image's grid ÷ merge², e.g. 16 for the toy refiner's 112-px images, up to 1,024 under the paper's
budget), and hands those ids together with the raw image to ``LLM.generate`` (``trl/generation/vllm_generation.py``,
colocate mode). vLLM treats a token prompt as not yet expanded and replaces the first pad by N (its Qwen2-VL prompt
replacement targets a single pad): 2N−1 pads and shifted M-RoPE positions, so vLLM samples from a corrupted context
— no error, since the length stays under ``vllm_max_model_length`` — while the trainer scores the
completions against the correct prompt (TRL keeps its own prompt ids and discards vLLM's). Known upstream (TRL issue
#6294, fix PRs #6718/#6719; vLLM PR #57796).

``one_placeholder_per_image`` collapses each run of pads back to one pad, which vLLM expands itself from the image it
receives; ``collapse_vllm_prompts`` wraps a colocated ``LLM.generate`` so every prompt with images is sent that way.
The trainer's own prompt ids are untouched. The pure function is tested with hypothesis; the wrapper at TRL's own
call site with vLLM's ``LLM`` replaced by a recording stand-in (tests/test_vllm_prompts.py).

``probe_vllm_prompt`` checks the result at start-up, whatever TRL or vLLM version is installed: one probe image
through TRL's own ``vllm_generation.generate`` (colocate or server), and the prompt vLLM reports having sampled from
must have the trainer's length and image-token runs, or training is refused. Server mode needs no wrapper in TRL
1.16: the server processes the images on their own and TRL places their features at the trainer's own runs of image
tokens (``VLLMGeneration._place_features``, which checks the number of runs, never their lengths). There the prompt
TRL reports is its own, echoed back (``VLLMClient._generate_from_features``), so the probe also asks the server how
many tokens its processor made of the probe image (``VLLMClient.image_features``, the server's own render): a server
started on another folder (the raw model, another pixel budget) would bind its image features to runs of another
length, and training is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rl.image_budget import image_token_count, probe_image


def one_placeholder_per_image(ids: Sequence[int], pad: int) -> list[int]:
    """``ids`` with each run of consecutive ``pad`` ids replaced by a single ``pad``."""
    out: list[int] = []
    for token in ids:
        if token == pad and out and out[-1] == pad:
            continue
        out.append(int(token))
    return out


def image_runs(ids: Sequence[int], pad: int) -> list[int]:
    """The length of each run of consecutive ``pad`` ids, in order (one run per image)."""
    runs: list[int] = []
    previous = None
    for token in ids:
        if token == pad:
            if previous == pad:
                runs[-1] += 1
            else:
                runs.append(1)
        previous = token
    return runs


def collapse_vllm_prompts(generate: Callable, pad: int) -> Callable:
    """``LLM.generate`` that receives, for every prompt that carries images (``multi_modal_data``), one pad per image
    instead of the processor's expansion; text-only prompts and everything else pass unchanged."""

    def generate_with_one_placeholder_per_image(prompts, *args, **kwargs):
        sent = []
        for prompt in prompts:
            if isinstance(prompt, dict) and prompt.get("multi_modal_data") and "prompt_token_ids" in prompt:
                prompt = {**prompt, "prompt_token_ids": one_placeholder_per_image(prompt["prompt_token_ids"], pad)}
            sent.append(prompt)
        return generate(sent, *args, **kwargs)

    generate_with_one_placeholder_per_image.wrapped = generate
    return generate_with_one_placeholder_per_image


def fix_colocated_vllm_prompts(trainer, image_token_id: int) -> bool:
    """Wrap the trainer's colocated vLLM engine (``trainer.vllm_generation.llm``) so it receives one placeholder per
    image. Returns whether there was one to wrap (False for server mode or without vLLM)."""
    generation = getattr(trainer, "vllm_generation", None)
    llm = getattr(generation, "llm", None) if getattr(generation, "mode", None) == "colocate" else None
    if llm is None:
        return False
    if not hasattr(llm.generate, "wrapped"):
        llm.generate = collapse_vllm_prompts(llm.generate, image_token_id)
    return True


def probe_vllm_prompt(trainer, processor, budget: dict | None) -> dict | None:
    """Every process: a probe image larger than the budget, tokenized by the trainer's processor as TRL tokenizes a
    rollout prompt, generated from through TRL's own ``vllm_generation.generate``; the prompt token ids vLLM reports
    must equal the trainer's in length and in their runs of image tokens. Returns what was compared (None without
    vLLM); raises RuntimeError on a mismatch, before any training step."""
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None:
        return None
    image = probe_image(budget)
    ids = [int(t) for t in image_token_count(processor, image)[2]["input_ids"][0]]
    pad = processor.tokenizer.convert_tokens_to_ids(getattr(processor, "image_token", "<|image_pad|>"))
    sampled_from = [int(t) for t in generation.generate(prompts=[ids], images=[[image]], num_generations=1)[0][0]]
    ours, theirs = image_runs(ids, pad), image_runs(sampled_from, pad)
    if len(sampled_from) != len(ids) or ours != theirs:
        raise RuntimeError(
            f"vLLM ({generation.mode}) samples from another prompt than the trainer scores: for a "
            f"{image.size} probe image its prompt has {len(sampled_from)} tokens with image-token "
            f"runs {theirs}, the trainer's {len(ids)} with {ours} (TRL issue #6294: check the TRL and "
            f"vLLM versions against the pins in pyproject.toml)"
        )
    if generation.mode == "server":
        served = server_image_tokens(generation, image)
        if served != ours:
            raise RuntimeError(
                f"the vLLM server makes {served} image tokens of a {image.size} probe image, the trainer {ours}: "
                "its features would be bound to the trainer's image tokens (TRL places them by position, not by "
                "length); start the server on the folder this run wrote (the log's `trl vllm-serve --model …` line)"
            )
    return {"probe_size": list(image.size), "prompt_tokens": len(ids), "image_tokens": ours}


def server_image_tokens(generation, image) -> list[int]:
    """Every process: how many tokens the vLLM server's own processor makes of ``image`` (its placeholder lengths from
    TRL's ``VLLMClient.image_features``), asked by the main process, which alone holds the client, and broadcast."""
    from accelerate.utils import broadcast_object_list

    answer = [None]
    if generation.accelerator.is_main_process:
        (features,) = generation.vllm_client.image_features([[image]])
        answer = [[int(p["length"]) for p in features["mm_placeholders"]["image"]]]
    broadcast_object_list(answer, from_process=0)
    return answer[0]
