"""Prompt files and model replies, for every stage that prompts a model (refiner, generator, query baselines, answer
expansion, section summaries, gates): a built-in prompt by name or a YAML file with ``system`` and ``user_template``,
its placeholders checked; and the JSON objects in a reply."""

from __future__ import annotations

import json
import re
import string
from pathlib import Path

import yaml


def is_prompt_file(value) -> bool:
    return isinstance(value, str) and value.endswith((".yaml", ".yml"))


def load_prompt(
    value: str,
    builtin: dict[str, dict],
    placeholders: tuple[str, ...] = ("{question}",),
    flag: str = "--prompt",
    allowed: tuple[str, ...] = (),
) -> dict:
    """{name, system, user_template} for a built-in prompt name or a YAML prompt file (checked: both strings present,
    every placeholder in the template, and no other field than those and ``allowed`` — the template is filled with
    ``str.format``, so a stray ``{Title}`` or a literal JSON ``{"key": …}`` would fail at the first batch)."""
    if not is_prompt_file(value):
        if value not in builtin:
            raise ValueError(
                f"{flag}: unknown prompt {value!r}: choose one of {', '.join(builtin)}, or give a "
                f".yaml file with system and user_template"
            )
        return {"name": value, **builtin[value]}
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"{flag}: prompt file {path} does not exist")
    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {path}: not a YAML file ({e})") from None
    if not isinstance(spec, dict) or not all(isinstance(spec.get(k), str) for k in ("system", "user_template")):
        raise ValueError(f"{flag} {path}: needs string fields 'system' and 'user_template'")
    fills = {p.strip("{}") for p in placeholders} | set(allowed)
    literal = "write a literal brace as {{ or }}"
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(spec["user_template"]) if name is not None}
    except ValueError as e:
        raise ValueError(f"{flag} {path}: user_template is not a format string ({e}): {literal}") from None
    missing = [x for x in placeholders if x.strip("{}") not in fields]  # {{question}} is a literal, not a placeholder
    if missing:
        raise ValueError(f"{flag} {path}: user_template lacks {', '.join(missing)}")
    unknown = sorted(fields - fills)
    if unknown:
        raise ValueError(
            f"{flag} {path}: user_template holds {{{unknown[0]}}}, which nothing fills (it may use "
            f"{', '.join('{' + f + '}' for f in sorted(fills))}): {literal}"
        )
    return {"name": str(path), "system": spec["system"], "user_template": spec["user_template"]}


def wording(prompt: dict) -> dict:
    """A prompt's words (system, user template), as a job records them among the settings a resume must match: a
    prompt file edited mid-job is other settings."""
    return {k: prompt.get(k) for k in ("system", "user_template")}


def json_objects(text):
    """Every JSON object (dict) that parses at a ``{`` of a model's reply, in order: how the stages that answer in
    JSON (query baselines, answer expansion, the Inspector and mct gates) find theirs amid other text, code fences or a
    reply that repeats itself. Nesting deeper than the decoder's recursion limit is no object."""
    text, decoder = str(text or ""), json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            obj = decoder.raw_decode(text, match.start())[0]
        except (json.JSONDecodeError, RecursionError):
            continue
        if isinstance(obj, dict):
            yield obj
