"""The refiner's prompt: the one place its wording lives (exported with the model), and prompt files.

Prompts are data keyed by plain names: ``wikiseeker`` is the paper's refiner prompt (the real configs); ``toy`` is a
short prompt with the same contract for the tiny embedded-default model, whose context is small. Every stage that
takes a prompt name also takes a YAML file instead (``load_prompt``): ``system`` and ``user_template`` strings, the
template holding the stage's placeholders — how a researcher supplies a paper's published wording. The shipped
wording is our own; a replacement must keep the output format the stage parses (the refiner's
``<answer>{"query": …}</answer>``, the query baselines' JSON, the generator's short answer).
"""

from __future__ import annotations

from pathlib import Path

SYSTEM_PROMPTS = {
    "wikiseeker": (
        "You are an expert in encyclopedic knowledge and in writing search queries for an encyclopedic knowledge "
        "base. You are given an image and a question about it. Rewrite the question into a retrieval query that "
        "finds the Wikipedia article and section answering it. Retain the original query, and expand it with what "
        "you see in the image (the entity's visual features) and with relevant world knowledge. First reason "
        "inside <think> </think>, then give the final query as a JSON object {\"query\": \"...\"} inside "
        "<answer> </answer>."
    ),
    "toy": "Refine the question into a search query. Think in <think></think>, answer JSON {\"query\": ...} in "
           "<answer></answer>.",
}
USER_TEMPLATE = "{question}"


def is_prompt_file(value) -> bool:
    return isinstance(value, str) and value.endswith((".yaml", ".yml"))


def load_prompt(value: str, builtin: dict[str, dict], placeholders: tuple[str, ...] = ("{question}",),
                flag: str = "--prompt") -> dict:
    """{name, system, user_template} for a built-in prompt name or a YAML prompt file (checked: both strings present,
    every placeholder in the template)."""
    if not is_prompt_file(value):
        if value not in builtin:
            raise ValueError(f"{flag}: unknown prompt {value!r}: choose one of {', '.join(builtin)}, or give a "
                             f".yaml file with system and user_template")
        return {"name": value, **builtin[value]}
    import yaml

    path = Path(value)
    if not path.is_file():
        raise ValueError(f"{flag}: prompt file {path} does not exist")
    spec = yaml.safe_load(path.read_text())
    if not isinstance(spec, dict) or not all(isinstance(spec.get(k), str) for k in ("system", "user_template")):
        raise ValueError(f"{flag} {path}: needs string fields 'system' and 'user_template'")
    missing = [x for x in placeholders if x not in spec["user_template"]]
    if missing:
        raise ValueError(f"{flag} {path}: user_template lacks {', '.join(missing)}")
    return {"name": str(path), "system": spec["system"], "user_template": spec["user_template"]}


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
    return [{"role": "system", "content": [{"type": "text", "text": system}]},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": user}]}]


def prompt_spec(prompt: str) -> dict:
    """What an exported refiner needs to rebuild its prompt (written into refiner.json): a built-in prompt by name, or
    a prompt file's contents."""
    return load_prompt(prompt, REFINER_PROMPTS)


def json_objects(text):
    """Every JSON object (dict) that parses at a ``{`` of a model's reply, in order: how the stages that answer in
    JSON (query baselines, answer expansion) find theirs amid other text or code fences."""
    import json
    import re

    text, decoder = str(text or ""), json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            obj = decoder.raw_decode(text, match.start())[0]
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            yield obj
