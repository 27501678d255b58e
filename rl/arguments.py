"""rl/train_grpo.py's arguments: RefinerArguments beside TRL's GRPOConfig and ModelConfig, parsed by TRL's parser from
YAML and flags, and every check that needs no file, made before anything loads.

``world`` names a module (the embedded default's ``toy.embedded_default``) whose ``Arguments`` dataclass joins the
parse and whose ``prepare`` / ``report`` run before the model loads and after training: how the toy world reaches the
entry point without it importing anything of the toy world.
"""

from __future__ import annotations

import importlib
import math
import sys
from dataclasses import dataclass, field, fields, make_dataclass
from datetime import timedelta
from pathlib import Path

from common.cli import config_flag, parse, read_config, require_file
from common.placement import per_device_batch
from retrieval.encoder_names import check_image_encoder_name, check_text_encoder_name
from retrieval.index import require_index
from retrieval.ranking import check_alpha, check_k
from rewards.format import INVALID_REWARD, MAX_QUERY_TOKENS, VALID_REWARD
from rewards.rank import DEFAULT_MISS, DEFAULT_TIERS, max_depth, parse_tiers
from rl.image_budget import PAPER_MAX_PIXELS, PAPER_MIN_PIXELS, check_budget
from rl.model import check_model_flags
from rl.prompts import check_prompt

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "grpo" / "toy.yaml"  # the embedded default
# the paper's reward and image budget are stated once, in rewards/ and rl/image_budget.py: these defaults are them, and
# the real GRPO configs (configs/grpo/{evqa,infoseek}.yaml) leave them to these defaults
PAPER_TIERS = ",".join(f"{lo}-{hi}:{reward:g}" for lo, hi, reward in DEFAULT_TIERS)  # "1-5:4,6-10:3.5,…"


@dataclass
class RefinerArguments:
    index: str = field(default=None, metadata={"help": "index directory (retrieval.build_index output)"})
    alpha: float = field(default=0.63, metadata={"help": "image weight α of the query"})
    train_file: str = field(default=None, metadata={"help": "question JSONL for RL (rl.data output)"})
    eval_file: str = field(default=None, metadata={"help": "held-out question JSONL scored during training"})
    eval_limit: int = field(default=None, metadata={"help": "use only the first N eval questions"})
    images_root: str = field(default=None, metadata={"help": "image folder (default: each question file's folder)"})
    prompt: str = field(
        default="wikiseeker", metadata={"help": "refiner prompt: wikiseeker | toy | a .yaml file (rl/prompts.py)"}
    )
    depth: int = field(
        default=max_depth(DEFAULT_TIERS),
        metadata={"help": "rank depth of the retrieval reward: at least the last tier's end (the default)"},
    )
    reward_tiers: str = field(
        default=PAPER_TIERS, metadata={"help": "rank tiers lo-hi:reward (the paper's by default)"}
    )
    miss_reward: float = field(default=DEFAULT_MISS, metadata={"help": "retrieval reward beyond the last tier"})
    unparseable_retrieval_reward: float = field(
        default=DEFAULT_MISS,
        metadata={"help": "retrieval reward of a completion that does not parse (the miss reward's default)"},
    )
    format_valid_reward: float = field(default=VALID_REWARD, metadata={"help": "format reward when the format holds"})
    format_invalid_reward: float = field(default=INVALID_REWARD, metadata={"help": "format reward otherwise"})
    max_query_tokens: int = field(default=MAX_QUERY_TOKENS, metadata={"help": "longer queries count as invalid format"})
    freeze_vision_tower: bool = field(default=True, metadata={"help": "train no vision-tower parameter"})
    log_table_steps: int = field(default=50, metadata={"help": "completions table every N steps (0 = never)"})
    min_pixels: int = field(
        default=PAPER_MIN_PIXELS,
        metadata={"help": "image budget: fewest pixels an image is resized to (training, vLLM, export, refine)"},
    )
    max_pixels: int = field(
        default=PAPER_MAX_PIXELS,
        metadata={
            "help": "image budget: most pixels an image is resized to (Qwen2.5-VL: ≤ max_pixels/28² image tokens)"
        },
    )
    completions_per_step: int = field(
        default=0,
        metadata={
            "help": "completions per optimizer step over all processes: sets per_device_train_batch_size to this ÷ "
            "(processes × gradient_accumulation_steps), so one process and several run the same recipe "
            "(0 = per_device_train_batch_size as given)"
        },
    )
    world: str = field(
        default=None,
        metadata={
            "help": "a module that builds what the run needs before the model loads "
            "(prepare) and reports after training (report): "
            "toy.embedded_default for the embedded default's toy world"
        },
    )
    completions_log: bool = field(
        default=False,
        metadata={"help": "append every completion this rank scores to completions.rank<R>.jsonl in the output dir"},
    )


def early_settings(argv: list[str]):
    """What must be known before the full parse: the process group's settings (``use_cpu``, ``ddp_timeout``) and the
    batch recipe (``completions_per_step``, ``gradient_accumulation_steps``), read from ``--config`` and the flags
    with their defaults from RefinerArguments and GRPOConfig; every other flag is left for the full parse. The full
    parse builds a GRPOConfig, which checks its generation batch against ``num_generations`` at once, so the
    per-device batch that ``completions_per_step`` implies must be among the flags by then."""
    from trl import GRPOConfig

    wanted = {"use_cpu": bool, "ddp_timeout": int, "gradient_accumulation_steps": int, "completions_per_step": int}
    defaults = {f.name: f.default for cls in (RefinerArguments, GRPOConfig) for f in fields(cls) if f.name in wanted}
    Early = make_dataclass(
        "EarlySettings", [(name, kind, field(default=defaults[name])) for name, kind in wanted.items()]
    )
    early, _ = parse((Early,), argv, known_only=True)
    return early


def with_completions_per_step(argv: list[str], early, processes: int) -> list[str]:
    """``argv`` with the per-device batch ``completions_per_step`` implies for this many processes (unchanged when
    it is 0); an explicit ``--per_device_train_batch_size`` that disagrees is an error naming both. ``early``:
    ``early_settings(argv)``."""
    if not early.completions_per_step:
        return argv
    for name in ("completions_per_step", "gradient_accumulation_steps"):  # YAML values reach here unconverted
        value = getattr(early, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be a whole number, got {value!r}")
    n = per_device_batch(
        early.completions_per_step, processes, early.gradient_accumulation_steps, "completions_per_step"
    )
    flag = "--per_device_train_batch_size"
    given = [
        a.split("=", 1)[1] if a.startswith(flag + "=") else argv[i + 1]
        for i, a in enumerate(argv)
        if a.startswith(flag + "=") or (a == flag and i + 1 < len(argv))
    ]
    if given and int(given[-1]) != n:
        raise ValueError(
            f"completions_per_step {early.completions_per_step} over {processes} processes means "
            f"{flag} {n}, but {flag} {given[-1]} was given: set one of them (--completions_per_step 0 "
            f"to use {flag} as given)"
        )
    return [*argv, flag, str(n)]


def validate(args: RefinerArguments, training_args, model_args, num_processes: int) -> str:
    """Settings that need no files: fail before anything loads, naming the setting. Returns the batch geometry."""
    check_alpha(args.alpha)
    check_budget(args.min_pixels, args.max_pixels)
    check_k(args.depth, "depth")
    check_prompt(args.prompt)
    tiers = parse_tiers(args.reward_tiers, args.miss_reward)
    if args.depth < max_depth(tiers):  # ranks past depth come back as misses: the table's deep tiers would pay none
        raise ValueError(
            f"--reward_tiers reaches rank {max_depth(tiers)}, deeper than --depth {args.depth}: ranks between would "
            f"earn the miss reward; set --depth {max_depth(tiers)}"
        )
    if not model_args.model_name_or_path:
        raise ValueError("--model_name_or_path is required")
    check_model_flags(model_args)
    for name in ("format_valid_reward", "format_invalid_reward", "unparseable_retrieval_reward", "miss_reward"):
        if not math.isfinite(getattr(args, name)):
            raise ValueError(f"--{name} must be a finite number, got {getattr(args, name)}")
    for name, value in (
        ("max_query_tokens", args.max_query_tokens),
        ("per_device_train_batch_size", training_args.per_device_train_batch_size),
        ("gradient_accumulation_steps", training_args.gradient_accumulation_steps),
        ("eval_limit", 1 if args.eval_limit is None else args.eval_limit),
    ):
        if value <= 0:
            raise ValueError(f"--{name} must be positive, got {value}")
    for name in ("chat_template_kwargs", "vllm_structured_outputs_regex"):
        if getattr(training_args, name, None):
            raise ValueError(
                f"{name} {getattr(training_args, name)!r}: TRL applies it to every training prompt or rollout, but "
                "the export and rl.refine do not carry it, so the refiner would be prompted or decode otherwise "
                "than it was trained"
            )
    if getattr(training_args, "generation_kwargs", None):
        raise ValueError(
            f"generation_kwargs {training_args.generation_kwargs}: TRL applies them to training samples on top of the "
            "sampling settings, but the run record, the export and rl.refine carry only temperature, top_p, top_k, "
            "min_p, repetition_penalty and max_completion_length: set those instead, so the exported refiner "
            "samples as it was trained"
        )
    check_best_metric(training_args)
    save_steps = training_args.save_steps
    strategy = getattr(training_args.save_strategy, "value", training_args.save_strategy)
    if strategy == "steps" and save_steps and save_steps >= 1:  # below 1: a share of the run's steps
        check_generation_phase(training_args, int(save_steps), "save_steps")
    per_device, accumulation = training_args.per_device_train_batch_size, training_args.gradient_accumulation_steps
    generations, per_generation = training_args.num_generations, training_args.steps_per_generation or accumulation
    per_step = per_device * accumulation * num_processes
    generated = per_device * num_processes * per_generation  # TRL's generation_batch_size, whole groups only
    if generated % generations:
        raise ValueError(
            f"batch geometry: per_device_train_batch_size ({per_device}) × processes ({num_processes}) × "
            f"steps_per_generation ({per_generation}) = {generated} completions generated at a time is not a "
            f"multiple of num_generations ({generations})"
        )
    geometry = (
        f"{per_step} completions per optimizer step ({num_processes} processes × {per_device} × {accumulation} "
        "accumulation)"
    )
    if generated == per_step:
        return f"batch geometry: {per_step // generations} prompts × {generations} generations = {geometry}"
    return (
        f"batch geometry: {geometry}; generated {generated // generations} prompts × {generations} generations = "
        f"{generated} completions at a time (steps_per_generation {per_generation})"
    )


LOWER_IS_BETTER = ("loss", "miss_rate", "mean_hit_rank")  # metrics a checkpoint is better for having less of


def check_best_metric(training_args) -> None:
    """Refuse a best-checkpoint choice that picks the wrong one: by GRPO's eval loss (transformers' default when
    ``metric_for_best_model`` is unset), which does not measure retrieval, or in the wrong direction
    (``greater_is_better`` defaults to True for every metric whose name does not end in loss: the most misses)."""
    metric = training_args.metric_for_best_model
    if not training_args.load_best_model_at_end and metric is None:
        return
    if metric is None or metric.removeprefix("eval_") == "loss":
        raise ValueError(
            "load_best_model_at_end would keep the checkpoint with the lowest GRPO eval loss, which does not measure "
            "the queries: set metric_for_best_model (the configs: retrieval/hit@1, greater_is_better true)"
        )
    lower = metric.removeprefix("eval_").split("/")[-1] in LOWER_IS_BETTER
    if training_args.greater_is_better == lower:
        raise ValueError(
            f"metric_for_best_model {metric} with greater_is_better {training_args.greater_is_better}: the best "
            f"checkpoint would be the one with the {'most' if lower else 'least'} of it; set greater_is_better "
            f"{str(not lower).lower()}"
        )


def check_generation_phase(training_args, step: int | None, what: str) -> None:
    """Refuse a checkpoint step inside one of TRL's generations. TRL generates every steps_per_generation ×
    num_iterations micro-batches and keeps the samples between; a resumed trainer starts with none, so from a step
    inside a generation it generates that batch again and stays out of phase with the uninterrupted run to its end."""
    accumulation = training_args.gradient_accumulation_steps
    period = (training_args.steps_per_generation or accumulation) * training_args.num_iterations
    if step is not None and (step * accumulation) % period:
        every = period // math.gcd(period, accumulation)
        raise ValueError(
            f"{what}: step {step} ({step * accumulation} micro-batches at gradient_accumulation_steps {accumulation}) "
            f"falls inside one of TRL's generations (one every {period} micro-batches: steps_per_generation × "
            f"num_iterations), so a run resumed from it would not train as the uninterrupted one: checkpoint every "
            f"multiple of {every} steps"
        )


def whole_eval_rounds(questions: int, per_device_eval_batch_size: int, processes: int, generations: int) -> int:
    """How many eval questions fill whole evaluation rounds. TRL's eval sampler repeats each question ``generations``
    times with no batch size, and over several processes accelerate (``even_batches``) fills a short last round with
    the first questions again, so held-out means would count those twice; the questions past the last whole round are
    left out. One process takes a short last batch as it is: every question is kept."""
    if processes == 1:
        return questions
    per_round = per_device_eval_batch_size * processes // generations
    if per_round == 0:
        raise ValueError(
            f"per_device_eval_batch_size ({per_device_eval_batch_size}) × processes ({processes}) holds fewer than "
            f"one question's num_generations ({generations}): raise per_device_eval_batch_size to "
            f"{generations // math.gcd(generations, processes)}"
        )
    return questions // per_round * per_round


def validate_files(args: RefinerArguments) -> None:
    manifest = require_index(args.index)
    check_image_encoder_name(manifest["image_encoder"])
    check_text_encoder_name(manifest["text_encoder"])
    require_file(args.train_file, "train_file")
    if args.eval_file:
        require_file(args.eval_file, "eval_file")


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` as argparse reads it: ``--flag value`` or ``--flag=value`` (the last one given)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def world_module(argv: list[str]):
    """The module named by ``--world`` or by the ``world`` entry of the ``--config`` file (None when neither names
    one): read before the parse, since its Arguments join it."""
    name = flag_value(argv, "--world")
    config_path = flag_value(argv, "--config")
    if name is None and config_path is not None:
        name = read_config(config_path).get("world")
    if not name:
        return None
    try:
        world = importlib.import_module(name)
    except ModuleNotFoundError as e:
        raise ValueError(f"--world: no module {name!r} ({e})") from None
    missing = [f for f in ("Arguments", "prepare", "report") if not hasattr(world, f)]
    if missing:
        raise ValueError(f"--world {name}: the module lacks {', '.join(missing)} (see toy/embedded_default.py)")
    return world


def parse_arguments(argv=None, description: str | None = None):
    """(args, training_args, model_args, world, world_args, state) from the command line; with no ``--config`` the
    embedded default's. The first accelerate state of the process is made here: under torchrun on CPUs it must know
    use_cpu, or every process believes it is alone; every collective waits at most ddp_timeout seconds."""
    from accelerate import PartialState
    from trl import GRPOConfig, ModelConfig

    argv = config_flag(list(sys.argv[1:] if argv is None else argv))
    embedded_default = "--config" not in argv
    if embedded_default:
        argv = ["--config", str(DEFAULT_CONFIG), *argv]
    world = world_module(argv)
    types = (RefinerArguments, GRPOConfig, ModelConfig, *((world.Arguments,) if world else ()))
    if "-h" in argv or "--help" in argv:  # every field's help, before anything starts (the early parse knows four)
        parse(types, argv, description=description)
    early = early_settings(argv)
    # before GRPOConfig is built: its device setup would start the process group without ddp_timeout on CPUs
    state = PartialState(cpu=early.use_cpu, timeout=timedelta(seconds=early.ddp_timeout))
    argv = with_completions_per_step(argv, early, state.num_processes)
    args, training_args, model_args, *world_args = parse(types, argv)
    if embedded_default and state.is_main_process:
        print(
            f"no --config given: running the embedded default ({DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parents[2])})"
        )
    return args, training_args, model_args, world, (world_args or [None])[0], state
