"""The refiner's prompt: the one place its wording lives (exported with the model), and prompt files.

Prompts are data keyed by plain names: ``wikiseeker`` is the paper's refiner prompt (the real configs); ``toy`` is a
short prompt with the same contract for the tiny embedded-default model, whose context is small. Every stage that
takes a prompt name also takes a YAML file instead (``load_prompt``): ``system`` and ``user_template`` strings, the
template holding the stage's placeholders — how a researcher supplies a paper's published wording. The shipped
wording is our own; a replacement must keep the output format the stage parses (the refiner's
``<answer>{"query": …}</answer>``, the query baselines' JSON, the generator's short answer).
"""

from __future__ import annotations

from common.prompts import load_prompt

SYSTEM_PROMPTS = {
    "wikiseeker": (
        "You are an expert in encyclopedic knowledge and in writing search queries for an encyclopedic knowledge "
        "base. You are given an image and a question about it. Rewrite the question into a retrieval query that "
        "finds the Wikipedia article and section answering it. Retain the original query, and expand it with what "
        "you see in the image (the entity's visual features) and with relevant world knowledge. First reason "
        'inside <think> </think>, then give the final query as a JSON object {"query": "..."} inside '
        "<answer> </answer>."
    ),
    "toy": 'Refine the question into a search query. Think in <think></think>, answer JSON {"query": ...} in '
    "<answer></answer>.",
}
USER_TEMPLATE = "{question}"


REFINER_PROMPTS = {name: {"system": system, "user_template": USER_TEMPLATE} for name, system in SYSTEM_PROMPTS.items()}


def check_prompt(name: str) -> str:
    load_prompt(name, REFINER_PROMPTS)
    return name


def prompt_messages(question: str, prompt: str | dict = "wikiseeker", with_image_block: bool = False) -> list[dict]:
    """Conversational prompt from a prompt name or an exported spec (``prompt_spec``). For TRL datasets
    (``with_image_block=False``) contents are strings and TRL inserts the image block before the user text itself;
    plain generation with a processor needs the block explicitly."""
    spec = prompt if isinstance(prompt, dict) else prompt_spec(prompt)
    system, user = spec["system"], spec["user_template"].format(question=question)
    if not with_image_block:
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return [
        {"role": "system", "content": [{"type": "text", "text": system}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": user}]},
    ]


def prompt_spec(prompt: str) -> dict:
    """What an exported refiner needs to rebuild its prompt (written into refiner.json): a built-in prompt by name, or
    a prompt file's contents."""
    return load_prompt(prompt, REFINER_PROMPTS)
