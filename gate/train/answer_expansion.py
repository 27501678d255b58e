"""The Inspector's FAIL targets as sentences (WikiSeeker, Appendix C): the short gold answer expanded by an auxiliary
LLM, the short answer kept inside it.

    python -m gate.train.build_data --stage expand --out DIR (--expander_url URL --expander_model M | --expander MODEL)
        [--expansion_prompt my_prompt.yaml]

Reads ``labels-inspector.jsonl``; for each FAIL example not yet in ``expanded-inspector.jsonl`` (resumable, batched)
asks the model, with the question and the short answer, for a JSON object ``{"expanded_answer": "..."}``. A sentence
that does not contain the short answer (as whole words after normalisation, retrieval.answers) or an answer that does
not parse keeps the short answer, and the row says why; the stage prints how many. ``--stage render --variant
inspector --inspector_expanded`` then uses the sentences as the FAIL completions.

The shipped prompt is our own wording; ``--expansion_prompt`` takes the published one (a YAML file with ``system``
and ``user_template`` holding ``{question}`` and ``{answer}``).
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from common.files import append_jsonl, read_jsonl, repair_jsonl
from common.job_parts import JobParts
from common.llm import replier
from common.placement import resolve_device
from common.prompts import json_objects, load_prompt, wording
from retrieval.answers import answer_in_passage

EXPANSION_PROMPT = {
    "name": "answer_expansion",
    "system": "You turn the short answer to a question into one complete, descriptive sentence that answers the "
    "question. Keep the short answer word for word inside the sentence. Reply with one JSON object only: "
    '{"expanded_answer": "..."}.',
    "user_template": "Question: {question}\nShort answer: {answer}",
}
EXPANDED_FILE = "expanded-inspector.jsonl"


def parse_expansion(text) -> str | None:
    """The ``expanded_answer`` string of the first JSON object in ``text`` that has one, stripped; else None."""
    for obj in json_objects(text):
        if isinstance(obj.get("expanded_answer"), str) and obj["expanded_answer"].strip():
            return obj["expanded_answer"].strip()
    return None


def expansion_target(short: str, reply) -> dict:
    """{target, expanded (bool), reason}: the sentence when it parses and holds the short answer, else the short
    answer with the reason."""
    sentence = parse_expansion(reply)
    if sentence is None:
        return {"target": short, "expanded": False, "reason": "the reply holds no expanded_answer"}
    if not answer_in_passage(short, sentence):
        return {"target": short, "expanded": False, "reason": "the sentence does not contain the short answer"}
    return {"target": sentence, "expanded": True, "reason": None}


def expander(args, prompt: dict):
    """(questions, short answers) → replies (None for a failed request), from an endpoint or a local text LLM."""
    reply = replier(
        prompt["system"],
        args.expansion_max_new_tokens,
        args.expander_url,
        args.expander_model,
        args.judge_key_env,
        args.expander,
        device=resolve_device(args.device),  # this process's own (a GPU's), as every other gate-data model
        dtype=None if args.dtype == "auto" else args.dtype,
    )
    return lambda questions, answers: reply(
        [prompt["user_template"].format(question=q, answer=a) for q, a in zip(questions, answers)]
    )


def stage_expand(args, out: Path, log=print, expand=None) -> int:
    """Expand every FAIL example's answer not yet expanded; returns how many were written now."""
    source = out / "labels-inspector.jsonl"
    if not source.is_file():
        raise ValueError(f"expand: {source} does not exist (run --stage label --variant inspector first)")
    if expand is None and not (args.expander_url and args.expander_model) and not args.expander:
        raise ValueError(
            "expand: give --expander_url and --expander_model (an OpenAI-compatible endpoint) or "
            "--expander (a local model)"
        )
    prompt = (
        load_prompt(args.expansion_prompt, {}, ("{question}", "{answer}"), "--expansion_prompt")
        if args.expansion_prompt
        else EXPANSION_PROMPT
    )
    target = out / EXPANDED_FILE
    JobParts(target).same_settings(  # sentences from another prompt or model are not mixed in
        {
            "prompt": wording(prompt),
            # the one replier uses: the endpoint when a URL is given, else the local model
            "expander": f"{args.expander_model}@{args.expander_url}" if args.expander_url else args.expander,
            "max_new_tokens": args.expansion_max_new_tokens,
        }
    )
    # expanded for the short answer the label holds now: a question relabelled since (another answer) is asked again,
    # its new row read after the old one (expanded_targets keeps the last)
    done = {str(r["id"]): r.get("answer") for r in repair_jsonl(target, key="id")}
    todo = [
        r
        for r in read_jsonl(source)
        if not r["pass"] and done.get(str(r["id"]), object()) != str(r["inspector"].get("answer", ""))
    ]
    if todo:
        expand = expand or expander(args, prompt)
    kept_short = failed = written = 0
    for start in tqdm(range(0, len(todo), args.batch_size), desc="expanding answers", disable=not todo):
        batch = todo[start : start + args.batch_size]
        shorts = [str(r["inspector"].get("answer", "")) for r in batch]
        replies = expand([r["question"] for r in batch], shorts)
        rows = [  # a request that failed (None after its retries) is not written: the next run asks again
            {"id": str(r["id"]), "answer": short, "reply": reply, **expansion_target(short, reply)}
            for r, short, reply in zip(batch, shorts, replies)
            if reply is not None
        ]
        failed += len(batch) - len(rows)
        kept_short += sum(not x["expanded"] for x in rows)
        written += len(rows)
        append_jsonl(target, rows)
    log(
        f"expand: {written} FAIL answers done now ({len(done)} before): {written - kept_short} expanded into a "
        f"sentence, {kept_short} kept the short answer (no parsable sentence, or one without the short answer: the "
        f"reason is in {target.name})"
        + (f"; {failed} requests failed and were not written: run --stage expand again to retry them" if failed else "")
    )
    return written


def expanded_targets(out: Path) -> dict[str, tuple[str, str]]:
    """{example id: (the short answer it was expanded from, FAIL target)} from ``expanded-inspector.jsonl`` (a
    question expanded again after a relabel: the last row)."""
    path = out / EXPANDED_FILE
    return {str(r["id"]): (r.get("answer"), r["target"]) for r in read_jsonl(path)} if path.is_file() else {}
