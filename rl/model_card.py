"""The refiner's model card: what a GRPO run's ``final/`` folder, its output dir and an exported folder say about the
model, in place of TRL's placeholder card.

``refiner_card`` is pure: the run record (rl.run_record), the held-out figures and a few facts in, markdown out.
``write_run_cards`` is the edge rl/train_grpo.py calls once the final model is saved (TRL writes its own card into
the output dir at every checkpoint save, PEFT into an adapter's folder, so ours must come last); rl/export.py writes
the card of an export into its temporary folder before the rename.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from common.files import read_json
from common.model_card import code_block, figures_table, format_rate, format_value, render_card, write_card
from rewards.format import INVALID_REWARD, MAX_QUERY_TOKENS, PARSER_VERSION, VALID_REWARD
from rewards.rank import DEFAULT_MISS, DEFAULT_TIERS, max_depth, parse_tiers
from rl.run_record import RUN_RECORD

TAGS = ["refine-rl", "query-refinement", "multimodal-retrieval", "grpo", "trl"]
OUTPUT_FORMAT = '<think>…</think><answer>{"query": "…"}</answer>'
SERVE_DTYPE = "bfloat16"  # rl.export's default --dtype bf16
NO_FIGURES = (
    "No held-out figures: the run scored no held-out questions (it had no `eval_file`, or no evaluation "
    "ran before this checkpoint)."
)


def shell_word(folder) -> str:
    """A folder as one shell word (a path with a space stays one argument); a ``$VARIABLE`` placeholder as is."""
    return str(folder) if str(folder).startswith("$") else shlex.quote(str(folder))


def vllm_serve_command(folder, dtype: str, budget: dict | None) -> str:
    """The ``vllm serve`` command for an exported folder, with the training image budget."""
    cmd = f"vllm serve {shell_word(folder)} --served-model-name refiner --dtype {dtype}"
    cmd += " --limit-mm-per-prompt '{\"image\": 1}'"
    if budget:
        cmd += f" --mm-processor-kwargs '{json.dumps(budget)}'"
    return cmd


def refine_command(folder) -> str:
    return f"python -m rl.refine --model {shell_word(folder)} --queries questions.jsonl --out refined.jsonl"


def held_out(log_history: list[dict], step: int | None = None) -> dict:
    """The latest held-out (``eval_*``) figures of a trainer's log history at or before ``step``, with their step;
    {} when there are none."""
    evals = [
        h for h in log_history if any(k.startswith("eval_") for k in h) and (step is None or h.get("step", 0) <= step)
    ]
    return {k: v for k, v in evals[-1].items() if k.startswith("eval_") or k == "step"} if evals else {}


def ordered_figures(metrics: dict) -> dict:
    """The held-out figures a card shows, without the ``eval_`` prefix: the reward, then retrieval (hit@k by k), the
    reward terms, completion lengths; the trainer's bookkeeping (runtime, loss, clipping, token counts) left out."""
    groups = [
        lambda k: k in ("reward", "reward_std"),
        lambda k: k.startswith("retrieval/"),
        lambda k: k.startswith("rewards/"),
        lambda k: k in ("completions/mean_length", "completions/clipped_ratio"),
    ]
    figures = {k.removeprefix("eval_"): v for k, v in metrics.items() if k.startswith("eval_")}

    def order(name: str) -> tuple:
        group = next(i for i, shown in enumerate(groups) if shown(name))
        return group, [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]

    return {k: figures[k] for k in sorted((k for k in figures if any(shown(k) for shown in groups)), key=order)}


def _tiers(args: dict) -> tuple:
    miss = args.get("miss_reward", DEFAULT_MISS)
    return parse_tiers(args["reward_tiers"], miss) if args.get("reward_tiers") else DEFAULT_TIERS


def combination(optimisation: dict) -> str:
    """How TRL combined the two rewards into the one GRPO compares (format first, as the trainer passes them)."""
    weights = optimisation.get("reward_weights") or [1.0, 1.0]
    if optimisation.get("multi_objective_aggregation") == "normalize_then_sum":
        return (
            f"the sum of two rewards, each first normalised within the question's group of completions, weighted "
            f"{format_value(float(weights[0]))} (format) and {format_value(float(weights[1]))} (retrieval)"
        )
    if list(map(float, weights)) == [1.0, 1.0]:
        return "the sum of two rewards"
    return (
        f"a weighted sum of two rewards: {format_value(float(weights[0]))} × format + "
        f"{format_value(float(weights[1]))} × retrieval"
    )


def reward_section(args: dict, optimisation: dict | None = None) -> str:
    valid = args.get("format_valid_reward", VALID_REWARD)
    invalid = args.get("format_invalid_reward", INVALID_REWARD)
    max_tokens = args.get("max_query_tokens", MAX_QUERY_TOKENS)
    tiers = _tiers(args)
    depth = args.get("depth", max_depth(tiers))  # RefinerArguments' default: the tiers' deepest rank
    miss = args.get("miss_reward", DEFAULT_MISS)
    unparseable = args.get("unparseable_retrieval_reward", miss)
    table = "| gold entity's rank | reward |\n|---|---|\n" + "".join(
        f"| {lo}–{hi} | {format_value(float(r))} |\n" for lo, hi, r in tiers
    )
    return (
        f"Each sampled completion earns {combination(optimisation or {})} (GRPO compares the completions of one "
        "question):\n\n"
        f"- **Format**: {format_value(float(valid))} when the output has the format above and its query is at most "
        f"{max_tokens} tokens, {format_value(float(invalid))} otherwise.\n"
        "- **Retrieval (rank tiers)**: the query, with the question's image, searches the index; the reward depends "
        f"on the rank of the question's gold entity among the index's entities (1 = first), searched to depth "
        f"{depth}:\n\n{table}\n"
        + (
            f"A gold entity ranked deeper than {tiers[-1][1]}, or not found within depth {depth}, is a miss: "
            if tiers[-1][1] < depth
            else f"A gold entity not found within depth {depth} is a miss: "
        )
        + f"{format_value(float(miss))}. A completion whose query cannot be parsed gets "
        f"{format_value(float(unparseable))}."
    )


def index_section(index: dict) -> str:
    alpha = index.get("alpha")
    return (
        f"- Path: `{format_value(index.get('path'))}`\n"
        f"- Image encoder: `{format_value(index.get('image_encoder'))}`\n"
        f"- Text encoder: `{format_value(index.get('text_encoder'))}`\n"
        f"- α (image weight of a query): {format_value(alpha)}\n\n"
        "A query is the normalised concatenation of α × the image embedding and (1 − α) × the query text's "
        "embedding, so an entity's score is α · cos(image) + (1 − α) · cos(text). The refiner was trained for "
        "this index and α: its queries are worth most with the same encoders and α."
    )


def usage_section(record: dict, folder, export: dict | None) -> str:
    budget = record.get("image_budget")
    if export is not None:
        return (
            "Serve it with vLLM (OpenAI-compatible API; the image budget is the one it was trained with):\n\n"
            + code_block(vllm_serve_command(folder, export["dtype"], budget), "bash")
            + "\n\nIts `generation_config.json` holds the sampling of training, which vLLM takes as a request's "
            "defaults: send `temperature: 0` for the greedy queries `rl.refine` writes (and its figures measure)."
            + "\n\nOr refine a question file (JSONL of `id`, `image`, `question`; `--backend vllm` to generate "
            "with vLLM):\n\n"
            + code_block(refine_command(folder), "bash")
            + f'\n\nFrom Python: `rl.refine.Refiner.load("{folder}").refine(images, questions)`.'
        )
    return (
        "Export it first (merges a LoRA adapter, writes `refiner.json` with the prompt, parser and index, and "
        "checks that a fresh load generates a parseable query), then serve the export:\n\n"
        + code_block(
            "\n".join(
                [
                    "SERVE_DIR=refiner-export  # a new folder",
                    f"python -m rl.export --checkpoint {folder} --out $SERVE_DIR",
                    vllm_serve_command("$SERVE_DIR", SERVE_DTYPE, budget),
                    refine_command("$SERVE_DIR"),
                ]
            ),
            "bash",
        )
    )


def refiner_card(
    record: dict, metrics: dict | None, *, name: str, step: int | None, folder, export: dict | None = None
) -> str:
    """The card of a refiner: a run's (``export`` None) or an export's (``export``: {"dtype", "source"}).
    ``metrics``: held-out ``eval_*`` figures (with their ``step``), {} or None when there are none."""
    args = record.get("refiner_args") or {}
    prompt = record.get("prompt") or {}
    gen = record.get("generation") or {}
    budget = record.get("image_budget") or {}
    base = record.get("base_model")
    model = [
        f"- Base model: `{format_value(base)}`",
        "- Training: GRPO (TRL's GRPOTrainer, `rl/train_grpo.py`) against the reward below",
        f"- Training step: {format_value(step)}",
        f"- Training precision: {format_value(record.get('precision'))}",
    ]
    opt = record.get("optimisation")
    if opt:
        model += [
            f"- GRPO: {format_value(opt.get('num_generations'))} completions per question, learning rate "
            f"{format_rate(opt.get('learning_rate'))}, β (KL) "
            f"{format_value(opt.get('beta'))}, loss `{opt.get('loss_type')}`, rewards scaled by "
            f"`{opt.get('scale_rewards')}`, max steps {format_value(opt.get('max_steps'))}"
        ]
    if export is not None:
        model += [
            f"- Exported from `{format_value(export.get('source'))}` in {format_value(export.get('dtype'))}, "
            "then reloaded and checked to generate a parseable query before it was written"
        ]
    if budget:
        model += [
            f"- Image budget: {format_value(budget.get('min_pixels'))}–{format_value(budget.get('max_pixels'))} "
            "pixels per image (the same in training, export and serving)"
        ]
    task = (
        "Given an image and a question about it, the model writes a search query for a multimodal knowledge "
        "base: the query, together with the image, should retrieve the entity the question is about.\n\n"
        f"- Input: one image and the question, in the model's chat format, with the prompt "
        f"`{format_value(prompt.get('name'))}` (`rl/prompts.py`): the system prompt and user turn below.\n"
        f"- Output: `{OUTPUT_FORMAT}`: its reasoning, then JSON holding the query (parser version "
        f"{PARSER_VERSION}, `rewards/format.py`). Where the output does not parse, `rl.refine` keeps the original "
        "question.\n"
        f"- Sampling in training: temperature {format_value(gen.get('temperature'))}, top-p "
        f"{format_value(gen.get('top_p'))}, at most {format_value(gen.get('max_new_tokens'))} new tokens.\n\n"
        "System prompt:\n\n"
        + code_block(str(prompt.get("system") or "(none recorded)"))
        + "\n\nUser turn (`{question}` filled in):\n\n"
        + code_block(str(prompt.get("user_template") or "(none recorded)"))
    )
    figures = ordered_figures(metrics or {})
    where = args.get("eval_file")
    limit = args.get("eval_limit")
    evaluation = (
        (
            f"Held-out questions: {f'`{where}`' if where else '(file not recorded)'}"
            f"{f' (the first {limit})' if limit else ''}, scored with the "
            f"training reward; figures from the evaluation at step {format_value((metrics or {}).get('step'))}"
            " (hit@k: share of completions whose gold entity ranks in the top k).\n\n"
            + figures_table(figures, NO_FIGURES)
        )
        if figures
        else NO_FIGURES
    )
    sections = [
        ("Model", "\n".join(model)),
        ("Task", task),
        ("Reward", reward_section(args, record.get("optimisation"))),
        ("Index", index_section(record.get("index") or {})),
        ("Held-out evaluation", evaluation),
        ("Use", usage_section(record, folder, export)),
    ]
    kind = "exported query refiner" if export is not None else "query refiner"
    return render_card(base, TAGS, f"{name}: {kind} trained with GRPO", sections)


def last_step(log_history: list[dict]) -> int | None:
    steps = [h["step"] for h in log_history if isinstance(h.get("step"), int)]
    return max(steps) if steps else None


def write_run_cards(output_dir, log_history: list[dict], best_step: int | None = None) -> str:
    """Our card over TRL's in a run's ``final/`` folder and its output dir (main process, after the final save).
    ``best_step``: the step whose weights ``final/`` holds when the trainer loaded the best checkpoint at the end
    (``load_best_model_at_end``): the card names it and that step's evaluation, not the last ones."""
    output_dir = Path(output_dir)
    record = read_json(output_dir / RUN_RECORD)
    text = refiner_card(
        record,
        held_out(log_history, best_step),
        name=output_dir.resolve().name,
        step=best_step if best_step is not None else last_step(log_history),
        folder=(output_dir / "final").resolve(),
    )
    for folder in (output_dir / "final", output_dir):
        write_card(folder, text)
    return text
