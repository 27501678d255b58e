"""Every gate variant as data: its prompt, what it is trained to output, and how that output is read back.

A variant's labels come from ``gate.train.labels`` (via ``gate.train.build_data``); here a label becomes a completion
string
(``completion``) and a completion or first-token probability becomes a decision again (``parse_completion``,
``gate.scoring``). Binary variants have two verbalisers, positive first: the positive one means "search" for the
boundary gates, "relevant" for ``srt`` and "pass" for the Inspector. ``prefix`` is the part of the completion that
comes before the verbaliser (the Inspector's JSON opening), so first-token scoring reads the token after it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from common.prompts import json_objects, load_prompt

BOUNDARY_SYSTEM = (
    "You are given an image and a question about it. Decide whether you need to search an external knowledge base "
    'to answer the question correctly, or whether you already know the answer. Reply with "true" if a search is '
    'needed and "false" if it is not.'
)
SOFT_BOUNDARY_SYSTEM = (
    "You are given an image and a question about it. Rate how much you need to search an external knowledge base to "
    "answer the question correctly, from 1 (you certainly know the answer) to 5 (you certainly need to search). "
    "Reply with the digit only."
)
KBM_SYSTEM = (
    'You are given an image and a question about it. Reply "known" if you can answer it reliably from what you '
    'know, and "unknown" if you need to retrieve knowledge first.'
)
RET_SYSTEM = "Decide whether answering the question about the image needs retrieval. Reply Ret or NoRet."
SRT_SYSTEM = (
    "Decide whether the document helps answer the question about the image. Reply Rel if it is relevant "
    "and NoRel if it is not."
)
MCT_SYSTEM = (
    "You are given an image, a question and numbered documents. List the numbers of the documents that are "
    "relevant to the question and consistent with the image and each other, most relevant first, and "
    'summarise what they say, as JSON {"consistent": [...], "summary": "..."}.'
)
INSPECTOR_SYSTEM = (
    "You are an inspector for a knowledge-based visual question answering system. You are given an image, a question "
    "and a section retrieved from an encyclopedia. Check whether the section is about the entity in the image and "
    'contains the answer to the question. If it does, reply {"pass": "true"}. If it does not, reply '
    '{"pass": "false", "answer": "<your own answer>"}.'
)
ANSWER_SYSTEM = "Answer the question about the image with a short phrase."

QUESTION = "{question}"
WITH_CONTEXT = "Context: {context}\nQuestion: {question}"

VARIANTS = {
    "hkb": dict(system=BOUNDARY_SYSTEM, user=QUESTION, label="search", verbalisers=("true", "false")),
    "skb": dict(
        system=SOFT_BOUNDARY_SYSTEM, user=QUESTION, label="search_score", verbalisers=("1", "2", "3", "4", "5")
    ),
    "kbm-acc": dict(system=KBM_SYSTEM, user=QUESTION, label="search", verbalisers=("unknown", "known")),
    "kbm-cert": dict(system=KBM_SYSTEM, user=QUESTION, label="search", verbalisers=("unknown", "known")),
    "ret": dict(system=RET_SYSTEM, user=QUESTION, label="search", verbalisers=("Ret", "NoRet")),
    "srt": dict(system=SRT_SYSTEM, user=WITH_CONTEXT, label="relevant", verbalisers=("Rel", "NoRel")),
    "mct": dict(system=MCT_SYSTEM, user=WITH_CONTEXT, label="consistent", verbalisers=()),
    "inspector": dict(
        system=INSPECTOR_SYSTEM, user=WITH_CONTEXT, label="pass", verbalisers=("true", "false"), prefix='{"pass": "'
    ),
    "answer": dict(system=ANSWER_SYSTEM, user=QUESTION, label="answer", verbalisers=()),
}
BINARY = tuple(v for v, s in VARIANTS.items() if len(s["verbalisers"]) == 2)


def load_gate_prompt(path: str, variant: str) -> dict:
    """A variant's prompt from a YAML file (rl.prompts.load_prompt), its user template holding the placeholders the
    variant fills ({question}, and {context} for the variants that read a section)."""
    needs = ("{question}", "{context}") if "{context}" in check_variant(variant)["user"] else ("{question}",)
    return load_prompt(path, {}, needs, "--gate_prompt")  # a no-context variant refuses {context}: it would be empty


def prompt_file_for(folder, variant: str):
    """Where render writes the prompt a variant's rows were rendered with (read by train_sft into gate.json)."""
    return Path(folder) / f"{variant}.prompt.json"


def check_variant(name: str) -> dict:
    if name not in VARIANTS:
        raise ValueError(f"unknown gate variant {name!r}: choose one of {', '.join(VARIANTS)}")
    return VARIANTS[name]


def spec(name: str, verbalisers=None, prompt: dict | None = None) -> dict:
    """The variant's spec, with the verbalisers optionally replaced (a model whose tokenizer splits the defaults) and
    its prompt optionally replaced (``prompt``: {system, user_template}, e.g. a paper's published wording from a file:
    ``gate_prompt``)."""
    s = dict(check_variant(name), name=name, prefix=VARIANTS[name].get("prefix", ""))
    if prompt:
        s["system"], s["user"] = prompt["system"], prompt["user_template"]
    if verbalisers:
        verbalisers = tuple(verbalisers)
        words = {tuple(str(v).split()) for v in verbalisers}  # how a completion is read back: word by word
        if len(verbalisers) != len(s["verbalisers"]) or len(words) != len(verbalisers) or () in words:
            raise ValueError(
                f"variant {name} needs {len(s['verbalisers'])} verbalisers, each with a non-space character and "
                f"distinct once spaces are left aside, got {verbalisers}"
            )
        s["verbalisers"] = verbalisers
    return s


def user_text(s: dict, question: str, context: str | None = None) -> str:
    """The user turn; the answer variant takes an optional context (answers with a retrieved section)."""
    if s["name"] == "answer" and context is not None:
        return WITH_CONTEXT.format(question=question, context=context)
    if "{context}" in s["user"] and context is None:
        raise ValueError(f"variant {s['name']} needs a context (retrieved section)")
    return s["user"].format(question=question, context=context or "")


def messages(s: dict, question: str, context: str | None = None, with_image_block: bool = False) -> list[dict]:
    """Conversational prompt; strings for TRL datasets (TRL adds the image block), explicit blocks for generation."""
    user = user_text(s, question, context)
    if not with_image_block:
        return [{"role": "system", "content": s["system"]}, {"role": "user", "content": user}]
    return [
        {"role": "system", "content": [{"type": "text", "text": s["system"]}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": user}]},
    ]


def numbered_documents(texts) -> str:
    """mct's context: the documents numbered from 1, one per line."""
    return "\n".join(f"[{j + 1}] {t}" for j, t in enumerate(texts))


def completion(s: dict, label) -> str:
    """The target text for a label: binary → the verbaliser; skb → the rounded digit; Inspector → its JSON;
    mct → JSON of the consistent document numbers (a list, or {"consistent", "summary"}); answer → the answer."""
    name, verbs = s["name"], s["verbalisers"]
    if name == "skb":
        return verbs[min(4, max(0, math.floor(float(label) + 0.5) - 1))]  # halves up: round() takes 2.5 to 2
    if name == "inspector":
        passed = label.get("pass") == "true"
        body = {"pass": verbs[0]} if passed else {"pass": verbs[1], "answer": label.get("answer", "")}
        return json.dumps(body, ensure_ascii=False)
    if name == "mct":
        label = label if isinstance(label, dict) else {"consistent": label}
        body = {"consistent": [int(i) for i in label["consistent"]]}
        if label.get("summary"):
            body["summary"] = str(label["summary"])
        return json.dumps(body, ensure_ascii=False)
    if name == "answer":
        return str(label)
    if not isinstance(label, bool):
        raise ValueError(f"variant {name}: binary label must be a bool, got {label!r}")
    return verbs[0] if label else verbs[1]


def verbaliser_index(verbs, text: str) -> int | None:
    """Which verbaliser ``text`` starts with, word by word (a multi-word one such as "no search", or one given with
    a tokenizer's leading space, reads back as written); the longest when several do; None when none does."""
    words, best = text.split(), None
    for i, v in enumerate(verbs):
        vw = str(v).split()
        if vw and words[: len(vw)] == vw and (best is None or len(vw) > len(str(verbs[best]).split())):
            best = i
    return best


def parse_completion(s: dict, text: str):
    """The decision in a generated completion: bool for binary variants (True = the positive verbaliser), a float for
    skb, {"pass": bool, "answer": str|None} for the Inspector, {"consistent": list[int], "summary": str|None} for mct,
    the text for answer; None when the
    text cannot be read."""
    name, verbs, text = s["name"], s["verbalisers"], (text or "").strip()
    if name == "answer":
        return text
    if name == "skb":
        if tuple(verbs) != VARIANTS["skb"]["verbalisers"]:  # --verbalisers: the word's place, 1–5
            i = verbaliser_index(verbs, text)
            return None if i is None else float(i + 1)
        m = re.match(r"\s*([1-5](?:\.\d+)?)", text)
        return float(m.group(1)) if m else None
    if name in ("inspector", "mct"):  # the first object in the reply that reads as the variant's answer
        for obj in json_objects(text):
            if name == "mct":
                ids, summary = obj.get("consistent"), obj.get("summary")
                if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                    return {"consistent": ids, "summary": summary if isinstance(summary, str) else None}
            elif obj.get("pass") in verbs:
                answer = obj.get("answer")
                return {"pass": obj["pass"] == verbs[0], "answer": answer if isinstance(answer, str) else None}
        return None
    i = verbaliser_index(verbs, text)
    return None if i is None else i == 0
