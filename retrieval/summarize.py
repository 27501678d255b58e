"""Long KB sections summarised before embedding (WikiSeeker, Figure 12): optional; truncation stays the default.

    python -m retrieval.summarize --kb kb.jsonl --out kb.summaries.jsonl --text_encoder Qwen/Qwen3-Embedding-0.6B \
        --max_tokens 512 (--summarizer_url URL --summarizer_model M | --summarizer MODEL) [--summary_prompt F]
    python -m retrieval.build_index --config … --summaries kb.summaries.jsonl

A section whose embedded text (the build's ``text_template``) is longer than ``max_tokens`` tokens of the text
encoder's tokenizer is summarised once — sections are keyed by a hash of their text, so a section shared by many
images is summarised once — and each summary is appended to ``--out`` as ``{text_sha, summary, tokens}`` (resumable:
hashes already there are skipped). A failed or empty summary is not written (that section stays truncated in the
build) and is counted. ``build_index --summaries`` then embeds the summary in place of the section's text; the
manifest records the file and how many texts used a summary. The article store and the pipeline keep the full text.

The shipped prompt is our own wording; ``--summary_prompt`` takes the published one (a YAML file with ``system``
and ``user_template`` holding ``{text}``; ``{title}`` and ``{section_title}`` are filled too).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from common.cli import parse, require_file
from common.files import append_jsonl, read_jsonl, repair_jsonl, write_json_atomic
from common.job_parts import JobParts
from common.llm import replier
from common.prompts import load_prompt, wording
from retrieval.encoders import TextEncoder
from retrieval.kb import entry_text
from retrieval.ranking import check_k

SUMMARY_PROMPT = {
    "name": "section_summary",
    "system": "You condense encyclopedia sections for a search index. Summarise the section in a few sentences, "
    "keeping every name, date, number and distinguishing fact a reader might search for. Reply with the "
    "summary only.",
    "user_template": "Article: {title}\nSection: {section_title}\n\n{text}",
}


def text_sha(text: str) -> str:
    """The key of a section's text (its ``text`` field, whatever the template)."""
    return hashlib.sha256(str(text or "").encode("utf-8")).hexdigest()


def load_summaries(path: str | Path) -> dict[str, str]:
    """{text_sha: summary} from a summaries JSONL."""
    return {r["text_sha"]: r["summary"] for r in read_jsonl(path)}


def summarized(rec: dict, summaries: dict[str, str]) -> dict:
    """The KB row with its text replaced by its summary when there is one (the row itself otherwise)."""
    summary = summaries.get(text_sha(rec.get("text"))) if summaries else None
    return {**rec, "text": summary} if summary else rec


def long_sections(kb: Path, template: str, count_tokens, max_tokens: int) -> tuple[list[dict], int]:
    """(one row per distinct section text whose embedded text exceeds ``max_tokens``, distinct texts seen)."""
    seen, long = set(), []
    for rec in read_jsonl(kb):
        key = text_sha(rec.get("text"))
        if key in seen or not rec.get("text"):
            continue
        seen.add(key)
        tokens = count_tokens(entry_text(rec, template))
        if tokens > max_tokens:
            long.append({**rec, "text_sha": key, "tokens": tokens})
    return long, len(seen)


@dataclass
class SummarizeArgs:
    kb: str = field(default=None, metadata={"help": "KB JSONL"})
    out: str = field(default=None, metadata={"help": "summaries JSONL (appended; resumable)"})
    text_encoder: str = field(default=None, metadata={"help": "the index's text encoder (its tokenizer counts)"})
    max_tokens: int = field(
        default=512, metadata={"help": "summarise sections longer than this (the build's text_max_seq_length)"}
    )
    text_template: str = field(default="{title}. {section_title}. {text}", metadata={"help": "as in the build"})
    summarizer: str = field(default=None, metadata={"help": "a local text LLM (path or name)"})
    summarizer_url: str = field(default=None, metadata={"help": "OpenAI-compatible base URL"})
    summarizer_model: str = field(default=None, metadata={"help": "the endpoint's model name"})
    key_env: str = field(default="OPENAI_API_KEY", metadata={"help": "environment variable holding the key"})
    summary_prompt: str = field(default=None, metadata={"help": "YAML prompt file ({text}; default: ours)"})
    max_new_tokens: int = field(default=256, metadata={"help": "summary length"})
    batch_size: int = field(default=16, metadata={"help": "sections per batch"})
    device: str = field(default=None, metadata={"help": "local summariser's device (default: cpu)"})


def summarizer(args: SummarizeArgs, prompt: dict):
    """texts (formatted user turns) → summaries (None for a failed one)."""
    return replier(
        prompt["system"],
        args.max_new_tokens,
        args.summarizer_url,
        args.summarizer_model,
        args.key_env,
        args.summarizer,
        device=args.device or "cpu",
    )


def summarize_kb(args: SummarizeArgs, log=print, summarize=None, count_tokens=None) -> dict:
    """Summarise every long section not yet in ``args.out``; returns the counts (also written to
    ``<out>.counts.json``)."""
    require_file(args.kb, "kb")
    if not args.out:
        raise ValueError("--out is required")
    for name in ("max_tokens", "max_new_tokens", "batch_size"):  # a batch size below 1 summarised nothing, silently
        check_k(getattr(args, name), f"--{name}")
    if summarize is None and not (args.summarizer_url and args.summarizer_model) and not args.summarizer:
        raise ValueError("give --summarizer_url and --summarizer_model (an endpoint) or --summarizer (a local model)")
    prompt = (
        load_prompt(args.summary_prompt, {}, ("{text}",), "--summary_prompt", allowed=("title", "section_title"))
        if args.summary_prompt
        else SUMMARY_PROMPT
    )
    out = Path(args.out)
    JobParts(out).same_settings(  # before the KB scan: summaries of another prompt, model or limit are not mixed in
        {
            "prompt": wording(prompt),
            # the one replier uses: the endpoint when a URL is given, else the local model
            "summarizer": f"{args.summarizer_model}@{args.summarizer_url}" if args.summarizer_url else args.summarizer,
            "max_tokens": args.max_tokens,
            "text_template": args.text_template,
            "max_new_tokens": args.max_new_tokens,
        }
    )
    if count_tokens is None:
        tokenizer = TextEncoder(args.text_encoder, device="cpu").model.tokenizer
        count_tokens = lambda text: len(tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"])  # noqa: E731
    long, distinct = long_sections(Path(args.kb), args.text_template, count_tokens, args.max_tokens)
    done = {r["text_sha"] for r in repair_jsonl(out, key="text_sha")}  # a last line a crash cut short: dropped
    todo = [r for r in long if r["text_sha"] not in done]
    if todo:
        summarize = summarize or summarizer(args, prompt)
    failed = 0
    for start in tqdm(range(0, len(todo), args.batch_size), desc="summarising sections", disable=not todo):
        batch = todo[start : start + args.batch_size]
        users = [
            prompt["user_template"].format(
                title=r.get("title") or "", section_title=r.get("section_title") or "", text=r["text"]
            )
            for r in batch
        ]
        replies = summarize(users)
        rows = [  # tokens: the section's; summary_tokens: what the build embeds in its place
            {
                "text_sha": r["text_sha"],
                "summary": s.strip(),
                "tokens": r["tokens"],
                "summary_tokens": count_tokens(entry_text({**r, "text": s.strip()}, args.text_template)),
            }
            for r, s in zip(batch, replies)
            if s and s.strip()
        ]
        failed += len(batch) - len(rows)
        append_jsonl(out, rows)
    written = list(read_jsonl(out)) if out.exists() else []
    counts = {
        "distinct_texts": distinct,
        "over_max_tokens": len(long),
        "max_tokens": args.max_tokens,
        "summaries": len(written),
        "summaries_still_over": sum(r.get("summary_tokens", 0) > args.max_tokens for r in written),
        "failed_now": failed,
        "prompt": prompt["name"],
    }
    write_json_atomic(f"{out}.counts.json", counts)
    log(
        f"summaries: {counts['over_max_tokens']} of {distinct} distinct sections exceed {args.max_tokens} tokens; "
        f"{counts['summaries']} summarised in {out}"
        + (
            f"; {counts['summaries_still_over']} summaries are still longer (the build truncates them)"
            if counts["summaries_still_over"]
            else ""
        )
        + (f"; {failed} failed now (truncated in the build; run again to retry)" if failed else "")
    )
    return counts


def main(argv=None) -> None:
    (args,) = parse((SummarizeArgs,), argv, description=__doc__)
    summarize_kb(args)


if __name__ == "__main__":
    from common.cli import run

    run(main)
