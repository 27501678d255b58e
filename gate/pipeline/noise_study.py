"""The context-noise study behind decoupled generation (WikiSeeker's signal-to-noise table): how answer accuracy of a
VLM with the image, the same VLM without it and a text LLM changes with the share of relevant sections in the context.

    python -m gate.pipeline.noise_study --queries q.jsonl --kb kb.jsonl --out DIR --metric infoseek|evqa \
        --generators "VLM=vlm:PATH,VLM text-only=vlm-text:PATH,LLM=llm:PATH" [--levels 0,0.1,...,0.9,oracle]

For each question whose gold entity has a section containing a gold answer (its *relevant* sections; the others are
left out and counted), a context of ``n_sections`` sections is built per level: round(level × n) relevant ones (cycled
when the entity has fewer), the rest sections of other entities drawn with a seed, shuffled; ``oracle`` is the one
best relevant section alone (the evidence section when the question names it). Each generator answers every
(question, level) with the generator prompt (``--generator_prompt``: a built-in name or a YAML file), answers are
scored by the benchmark's official rule (gate.pipeline.metrics.official_correct), and the table — generators as rows,
levels
as columns, accuracy in % — is printed and written to ``DIR/noise_table.md`` and ``DIR/noise.json``. Answers are
appended to ``DIR/answers.jsonl`` per batch: an interrupted study goes on where it stopped.

Generators: ``vlm:PATH`` (image + context), ``vlm-text:PATH`` (the same VLM, no image), ``llm:PATH`` (a text LLM),
``endpoint:MODEL@URL`` (an OpenAI-compatible chat endpoint, text only; key from --key_env).
"""

from __future__ import annotations

import random
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from common.cli import parse, require_file
from common.files import (
    append_jsonl,
    input_settings,
    read_jsonl,
    repair_jsonl,
    weights_fingerprint,
    write_json_atomic,
    write_text_atomic,
)
from common.job_parts import JobParts
from common.llm import endpoint_generator, request_failed, text_generator
from common.placement import resolve_device
from common.prompts import wording
from gate.pipeline.bem import BEMScorer
from gate.pipeline.context import load_questions, section_text, vlm_answerer
from gate.pipeline.metrics import official_correct
from gate.pipeline.stages import generator_prompt
from retrieval.answers import answer_in_passage
from retrieval.kb import GOLD_KEYS
from rl.model import open_vlm_image

KINDS = ("vlm", "vlm-text", "llm", "endpoint")
DEFAULT_LEVELS = "0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,oracle"


@dataclass
class NoiseArgs:
    queries: str = field(default=None, metadata={"help": "question JSONL (gold entity_id and answers)"})
    kb: str = field(default=None, metadata={"help": "KB JSONL whose rows are sections (entity_id, title, text)"})
    out: str = field(default=None, metadata={"help": "output folder"})
    images_root: str = field(default=None, metadata={"help": "default: the queries file's folder"})
    generators: str = field(
        default=None, metadata={"help": "name=kind:path list; kinds: vlm, vlm-text, llm, endpoint (MODEL@URL)"}
    )
    levels: str = field(default=DEFAULT_LEVELS, metadata={"help": "shares of relevant sections, and/or oracle"})
    n_sections: int = field(default=10, metadata={"help": "sections per context (oracle: one)"})
    metric: str = field(default="infoseek", metadata={"help": "official rule: infoseek | evqa"})
    generator_prompt: str = field(default="infoseek", metadata={"help": "infoseek | evqa | toy | a .yaml file"})
    max_new_tokens: int = field(default=32, metadata={"help": "answer length"})
    batch_size: int = field(default=16, metadata={"help": "questions per generation batch"})
    limit: int = field(default=None, metadata={"help": "the first N usable questions only"})
    seed: int = field(default=0, metadata={"help": "distractor draw and order"})
    key_env: str = field(default="OPENAI_API_KEY", metadata={"help": "endpoint: environment variable with the key"})
    device: str = field(default=None, metadata={"help": "cpu / cuda / cuda:N (default: this process's own)"})
    bem: str = field(default="kortukov/answer-equivalence-bem", metadata={"help": "evqa: BEM model, or none"})


# --------------------------------------------------------------------------- pure parts


def parse_levels(text: str) -> list[str]:
    """``"0,0.5,oracle"`` → ["0", "0.5", "oracle"] (shares in [0, 1], each once)."""
    out = []
    for part in (p.strip() for p in str(text).split(",")):
        if part != "oracle":
            try:
                ok = 0.0 <= float(part) <= 1.0
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"--levels: {part!r} is neither a share in [0, 1] nor 'oracle'")
        if part in out:
            raise ValueError(f"--levels: {part!r} is given twice")
        out.append(part)
    return out


def parse_generators(text: str) -> dict[str, tuple[str, str]]:
    """``"VLM=vlm:/m,LLM=llm:/l"`` → {name: (kind, target)}."""
    out = {}
    for part in (p.strip() for p in str(text or "").split(",") if p.strip()):
        name, _, spec = part.partition("=")
        kind, _, target = spec.partition(":")
        if not name.strip() or kind not in KINDS or not target:
            raise ValueError(
                f"--generators: {part!r} must look like name=kind:path with kind one of {', '.join(KINDS)}"
            )
        if name.strip() in out:  # the later one would replace the earlier without a word
            raise ValueError(f"--generators: the name {name.strip()!r} is given twice")
        out[name.strip()] = (kind, target)
    if not out:
        raise ValueError("--generators: give at least one name=kind:path")
    return out


def noisy_context(
    relevant: list[str],
    pool: list[tuple[str, str]],
    entity: str,
    level: str,
    n: int,
    seed: int,
    entity_in_pool: int | None = None,
) -> list[str]:
    """The sections of one context: ``oracle`` → the first relevant section alone; a share → round(share × n)
    relevant sections (cycled) and n minus that many distractors — sections of ``pool`` ((entity, text) pairs) of
    another entity than ``entity``, drawn without replacement — shuffled with ``seed``. ``entity_in_pool``: how many
    pool sections are ``entity``'s (counted here when not given; the study counts once per question)."""
    if not relevant:
        raise ValueError("a context needs at least one relevant section")
    if level == "oracle":
        return [relevant[0]]
    k = round(float(level) * n)
    if entity_in_pool is None:
        entity_in_pool = sum(e == entity for e, _ in pool)
    if n - k > len(pool) - entity_in_pool:
        raise ValueError(f"{n - k} distractor sections wanted, {len(pool) - entity_in_pool} available")
    rng = random.Random(seed)
    # enough draws that, with every one of the entity's own sections among them, n − k others remain
    drawn = rng.sample(range(len(pool)), min(len(pool), n - k + entity_in_pool))
    others = [pool[i][1] for i in drawn if pool[i][0] != entity][: n - k]
    sections = [relevant[j % len(relevant)] for j in range(k)] + others
    rng.shuffle(sections)
    return sections


def relevant_sections(question: dict, sections: list[dict]) -> list[str]:
    """The gold entity's sections that contain a gold answer, the question's evidence section first, each once (the
    KB has a row per ⟨image, section⟩: a section with three images is three rows)."""
    answers = [str(a) for a in question.get("answers") or []]
    evidence = question.get("evidence_section_id")
    hits = [s for s in sections if answers and answer_in_passage(answers, s.get("text", ""))]
    hits.sort(key=lambda s: s.get("section") != evidence if evidence is not None else 0)
    return list(dict.fromkeys(section_text(s) for s in hits))


def accuracy_table(results: dict[str, dict[str, float]], levels: list[str]) -> str:
    """Markdown: a row per generator, a column per level, accuracy in %."""
    head = "| generator | " + " | ".join("oracle" if lv == "oracle" else f"{float(lv):g}" for lv in levels) + " |"
    rows = [
        f"| {name} | " + " | ".join(f"{100 * acc[lv]:.1f}" if lv in acc else "—" for lv in levels) + " |"
        for name, acc in results.items()
    ]
    return "\n".join([head, "|" + "---|" * (len(levels) + 1), *rows])


# --------------------------------------------------------------------------- the study


def load_generator(kind: str, target: str, args: NoiseArgs, prompt: dict, device: str):
    """generate(images, questions, contexts) → (answer or None, why it failed or None) per question: an endpoint's
    request that failed after its retries has a reason, an empty answer from a model does not."""
    if kind == "endpoint":
        model, _, url = target.partition("@")
        generate = endpoint_generator(url, model, prompt, args.key_env, args.max_new_tokens)
    elif kind == "llm":
        generate = text_generator(target, prompt, args.max_new_tokens, device=device)
    else:
        vlm = vlm_answerer(target, args.max_new_tokens, system=prompt["system"], device=device)

        def generate(images, questions, contexts):
            texts = [prompt["user_template"].format(question=q, context=c) for q, c in zip(questions, contexts)]
            answers = vlm(images if kind == "vlm" else None, texts, False)
            return [(a.strip() or None, None) for a in answers]

    return generate


def generator_source(kind: str, target: str) -> str:
    """What a generator's answers are the answers of: its kind and model (an endpoint's model name: its URL may
    change) and, for a local model folder, its weights (a model exported again into the same folder answers anew)."""
    if kind == "endpoint":
        return f"endpoint:{target.partition('@')[0]}"
    weights = weights_fingerprint(target)  # None for a hub name or a folder without weights
    return f"{kind}:{target}" + (f" (weights {weights})" if weights else "")


def check_same_generators(written: list[dict], sources: dict[str, str], path: Path) -> None:
    """Refuse to add to the answers a generator's name already holds (``written``, answers.jsonl's rows) another
    generator's: its table row would mix two models. A name new to the folder, or rows written before sources were
    recorded, pass."""
    earlier: dict[str, str] = {}
    for r in written:
        if r.get("source") is not None:
            earlier.setdefault(r["generator"], r["source"])
    changed = [n for n, s in sources.items() if earlier.get(n, s) != s]
    if changed:
        said = "; ".join(f"{n!r}: {earlier[n]} then, {sources[n]} now" for n in changed)
        raise ValueError(
            f"{path} holds answers of other generators under the same names ({said}): give the new one another "
            "name, use another --out, or delete those answers"
        )


def study_rows(args: NoiseArgs, log) -> tuple[list[dict], list[tuple[str, str]], int]:
    """(questions with their relevant sections, the distractor pool of (entity, section text) — a seeded reservoir
    of at most 20,000 KB sections, shared by every question — and how many questions were left out)."""
    questions, _ = load_questions(args.queries, args.images_root, GOLD_KEYS)
    gold = {str(q["entity_id"]) for q in questions}
    by_entity: dict[str, list[dict]] = {}
    reservoir: list[dict] = []
    rng, seen = random.Random(args.seed), 0
    for row in read_jsonl(args.kb):
        if str(row.get("entity_id")) in gold:
            by_entity.setdefault(str(row["entity_id"]), []).append(row)
        seen += 1
        if len(reservoir) < 20_000:
            reservoir.append(row)
        elif (j := rng.randrange(seen)) < len(reservoir):
            reservoir[j] = row
    pool = list(dict.fromkeys((str(r.get("entity_id")), section_text(r)) for r in reservoir))  # a section once
    in_pool = Counter(e for e, _ in pool)
    rows, left_out = [], 0
    for q in questions:
        relevant = relevant_sections(q, by_entity.get(str(q["entity_id"]), []))
        if not relevant:
            left_out += 1
            continue
        rows.append({**q, "relevant": relevant, "entity_in_pool": in_pool[str(q["entity_id"])]})
        if args.limit and len(rows) >= args.limit:
            break
    if left_out:
        log(f"noise study: {left_out} question(s) left out: no section of the gold entity contains a gold answer")
    return rows, pool, left_out


def run_study(args: NoiseArgs, log=print, generators: dict | None = None) -> dict:
    """Every (generator, level, question) not yet answered, then the scored table. ``generators`` ({name: generate})
    replaces loading them from ``args.generators`` (tests)."""
    require_file(args.queries, "queries")
    require_file(args.kb, "kb")
    if not args.out:
        raise ValueError("--out is required")
    if args.metric not in ("infoseek", "evqa"):
        raise ValueError(f"--metric must be infoseek or evqa, got {args.metric!r}")
    levels = parse_levels(args.levels)
    specs = parse_generators(args.generators) if generators is None else {n: None for n in generators}
    prompt = generator_prompt(args.generator_prompt)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    answers_path = out / "answers.jsonl"
    JobParts(answers_path).same_settings(  # answers to other contexts are not mixed in (generators may be added)
        {
            **input_settings(args.queries, args.images_root or Path(args.queries).parent),
            "kb": str(args.kb),
            "n_sections": args.n_sections,
            "seed": args.seed,
            "prompt": wording(prompt),
            "max_new_tokens": args.max_new_tokens,
        }
    )
    sources = {name: generator_source(*spec) for name, spec in specs.items() if spec is not None}
    written = repair_jsonl(answers_path, key="id")  # a last line cut short by a crash dropped
    check_same_generators(written, sources, answers_path)
    rows, pool, left_out = study_rows(args, log)  # the KB read once the settings are known to match
    done = {str(r["id"]) for r in written}
    device = resolve_device(args.device)
    failed = 0
    for name, spec in specs.items():
        todo = [(lv, q) for lv in levels for q in rows if f"{name}|{lv}|{q['id']}" not in done]
        if not todo:
            continue
        generate = generators[name] if generators is not None else load_generator(*spec, args, prompt, device)
        for start in tqdm(range(0, len(todo), args.batch_size), desc=f"noise study: {name}"):
            batch = todo[start : start + args.batch_size]
            contexts = [
                "\n\n".join(
                    noisy_context(
                        q["relevant"],
                        pool,
                        str(q["entity_id"]),
                        lv,
                        args.n_sections,
                        args.seed + zlib.crc32(f"{lv}|{q['id']}".encode()),
                        q["entity_in_pool"],
                    )
                )
                for lv, q in batch
            ]
            images = [open_vlm_image(q["image_path"]) for _, q in batch]
            answers = generate(images, [q["question"] for _, q in batch], contexts)
            failed += sum(request_failed(why) for _, why in answers)
            append_jsonl(  # a failed request is not written: the next run asks again
                answers_path,
                [
                    {
                        "id": f"{name}|{lv}|{q['id']}",
                        "generator": name,
                        "source": sources.get(name),
                        "level": lv,
                        "question_id": str(q["id"]),
                        "answer": a,
                    }
                    for (lv, q), (a, why) in zip(batch, answers)
                    if not request_failed(why)  # an empty answer is the model's answer: written (None)
                ],
            )
    if failed:
        raise RuntimeError(
            f"noise study: {failed} generator requests failed after their retries and were not written to "
            f"{answers_path}: run it again to ask for them (the answers written are kept)"
        )
    return score(args, rows, levels, list(specs), answers_path, left_out, log)


def score(
    args: NoiseArgs, rows: list[dict], levels: list[str], names: list[str], answers_path: Path, left_out: int, log
) -> dict:
    bem = None
    if args.metric == "evqa" and args.bem != "none":
        bem = BEMScorer(args.bem, device=resolve_device(args.device), batch_size=args.batch_size)
    answers = {r["id"]: r["answer"] for r in read_jsonl(answers_path)}
    results: dict[str, dict[str, float]] = {}
    for name in names:
        for lv in levels:
            predictions = [answers.get(f"{name}|{lv}|{q['id']}") for q in rows]
            correct = official_correct(args.metric, rows, predictions, bem)
            results.setdefault(name, {})[lv] = sum(correct) / max(len(rows), 1)
    table = accuracy_table(results, levels)
    log(
        f"answer accuracy (%) by share of relevant sections in a {args.n_sections}-section context, "
        f"{len(rows)} questions ({args.metric} rule):\n{table}"
    )
    out = Path(args.out)
    write_text_atomic(out / "noise_table.md", table + "\n")
    summary = {
        "questions": len(rows),
        "left_out": left_out,
        "n_sections": args.n_sections,
        "metric": args.metric,
        "levels": levels,
        "accuracy": results,
    }
    write_json_atomic(out / "noise.json", summary)
    return summary


def main(argv=None) -> None:
    (args,) = parse((NoiseArgs,), argv, description=__doc__)
    run_study(args)


if __name__ == "__main__":
    from common.cli import run

    run(main)
