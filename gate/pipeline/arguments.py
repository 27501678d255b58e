"""gate.pipeline's arguments, and every check made before a model loads: inputs that exist, each stage's model
named and present, and a resumed output folder that holds predictions from these same settings only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.cli import check_choices, require_file
from common.files import file_fingerprint, read_json, weights_fingerprint, write_json_atomic
from common.job_parts import JobParts, changed_keys
from common.placement import dist_timeout_field
from gate.pipeline.consistency import STRATEGIES
from gate.pipeline.metrics import METRICS
from gate.pipeline.stages import generator_prompt, parse_stage_gpus
from gate.scoring import check_gate_threshold
from retrieval.index import index_fingerprint, require_index
from retrieval.ranking import check_alpha


@dataclass
class PipelineArgs:
    queries: str = field(default=None, metadata={"help": "question JSONL"})
    out: str = field(default=None, metadata={"help": "output folder (predictions.jsonl appended; resumable)"})
    images_root: str = field(default=None, metadata={"help": "default: the queries file's folder"})
    gate: str = field(default="always", metadata={"help": "always | never | trained boundary gate folder"})
    gate_threshold: float = field(
        default=None,
        metadata={
            "help": "scoring threshold γ on the gate's probability (default 0.5; the KBM label threshold τ is a "
            "separate build_data setting), or for skb t on its expected digit 1–5 (default 3; search at or above "
            "t; its held-out truth, target 6 − mean > t, is hkb's label at ε = 6 − t)"
        },
    )
    answerer: str = field(default=None, metadata={"help": "the VLM that answers without retrieval"})
    refiner: str = field(default="none", metadata={"help": "exported refiner folder, or none"})
    index: str = field(default=None, metadata={"help": "index directory"})
    kb: str = field(default=None, metadata={"help": "KB JSONL (default: the one the index was built from)"})
    articles: str = field(
        default=None,
        metadata={
            "help": "article store (default: <kb>.articles.sqlite beside the KB, built from the KB rows when missing)"
        },
    )
    alpha: float = field(default=None, metadata={"help": "α (default: the refiner's index α)"})
    k: int = field(default=5, metadata={"help": "entities (sections) retrieved per question"})
    reranker: str = field(
        default="none",
        metadata={
            "help": "first stage over the top-k sections (β1): none | vlm:<VLM> (zero-shot, first-token P(Yes)) | "
            "gate:<srt dir> | a CrossEncoder (text) | tiny"
        },
    )
    reranker_verbalisers: str = field(
        default="Yes,No", metadata={"help": "vlm: reranker: the positive and negative first tokens"}
    )
    text_reranker: str = field(
        default="none",
        metadata={
            "help": "within the chosen article (β2): none (text similarity alone) | a CrossEncoder such as "
            "BAAI/bge-reranker-v2-m3 | tiny"
        },
    )
    beta1: float = field(
        default=0.6,
        metadata={"help": "section stage: β1·retrieval + (1−β1)·reranker (WikiSeeker: 0.6 E-VQA, 0.8 InfoSeek)"},
    )
    beta2: float = field(
        default=0.2,
        metadata={"help": "within the chosen article: (1−β2)·text similarity + β2·text reranker (WikiSeeker: 0.2)"},
    )
    consistency: str = field(
        default="none",
        metadata={"help": "none | trained mct gate folder (MMKB-RAG's MCT over the first-stage top-k sections)"},
    )
    consistency_strategy: str = field(
        default="filter",
        metadata={
            "help": "what the generator gets from the mct gate: filter (the listed sections) | merge (its summary) | "
            "rerank (the first listed section's article)",
            "choices": STRATEGIES,
        },
    )
    consistency_max_new_tokens: int = field(
        default=None, metadata={"help": "mct gate output length (default: its longest training target + 16 tokens)"}
    )
    inspector: str = field(default="none", metadata={"help": "none | trained inspector gate folder"})
    inspector_threshold: float = field(default=0.5, metadata={"help": "PASS when P(pass) ≥ this"})
    generator: str = field(default=None, metadata={"help": "model path/name, or endpoint (generator_url)"})
    generator_url: str = field(default=None, metadata={"help": "OpenAI-compatible base URL (generator: endpoint)"})
    generator_model: str = field(default=None, metadata={"help": "model name at the endpoint"})
    generator_key_env: str = field(default="OPENAI_API_KEY", metadata={"help": "env var holding the endpoint key"})
    generator_retries: int = field(default=3, metadata={"help": "endpoint attempts per question"})
    generator_backoff: float = field(default=1.0, metadata={"help": "endpoint backoff seconds (× attempt)"})
    generator_prompt: str = field(
        default="infoseek", metadata={"help": "infoseek | evqa | toy | a .yaml prompt file ({context}, {question})"}
    )
    generator_image: bool = field(default=False, metadata={"help": "a VLM generator also sees the image"})
    max_new_tokens: int = field(default=24, metadata={"help": "answer length"})
    batch_size: int = field(default=32, metadata={"help": "questions per batch"})
    metric: str = field(
        default="infoseek",
        metadata={
            "help": "the benchmark's official answer rule: infoseek (per question type; String/Time exact, Numerical "
            "ranges) or evqa (exact match, multi-answer IoU, then BEM)",
            "choices": METRICS,
        },
    )
    bem: str = field(
        default="kortukov/answer-equivalence-bem",
        metadata={"help": "metric evqa: the BEM model (transformers), or none for exact match only"},
    )
    bem_device: str = field(default=None, metadata={"help": "device for BEM (default: this process's own)"})
    device: str = field(
        default=None,
        metadata={
            "help": "device of every stage's model: cuda:N / cpu (default: this process's own, cuda:LOCAL_RANK or cpu)"
        },
    )
    dtype: str = field(
        default="auto",
        metadata={"help": "weights of every stage's model: auto (bf16 on a GPU, fp32 on the CPU), bf16, fp16, fp32"},
    )
    gpus_per_process: int = field(
        default=1,
        metadata={
            "help": "GPUs each process spreads its stages over: process r takes cuda:r×k … r×k+k−1 (launch "
            "GPUs ÷ k processes); the paper's stages do not fit one 80 GB GPU"
        },
    )
    stage_gpus: str = field(
        default=None,
        metadata={
            "help": "stage:GPU offset within the process's GPUs, comma-separated (stages: gate, answerer, refiner, "
            "index, reranker, consistency, inspector, generator, bem; unnamed: 0), e.g. gate:0,inspector:1"
        },
    )
    baselines: bool = field(default=True, metadata={"help": "run both paths for every question (baselines)"})
    limit: int = field(default=None, metadata={"help": "only the first N questions"})
    dist_timeout_minutes: int = dist_timeout_field()


def validate(args: PipelineArgs) -> None:
    """Every input checked before any model loads; each stage's model named when it is missing."""
    check_choices(args)
    require_file(args.queries, "queries")
    if not args.out:
        raise ValueError("--out is required")
    if args.batch_size <= 0 or args.k <= 0:
        raise ValueError("--batch_size and --k must be positive")
    if args.alpha is not None:  # it was checked when the index first ranked, after every model had loaded
        check_alpha(args.alpha)
    for name in ("beta1", "beta2"):  # weights of a convex combination (docs/gates-and-pipeline.md)
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise ValueError(f"--{name} must lie in [0, 1], got {getattr(args, name)}")
    generator_prompt(args.generator_prompt)  # a name, or a prompt file that exists and holds its placeholders
    parse_stage_gpus(args.stage_gpus, args.gpus_per_process)
    needs_rag = args.gate != "never" or args.baselines
    needs_alone = args.gate != "always" or args.baselines
    if needs_alone and not args.answerer:
        raise ValueError("--answerer (the VLM that answers without retrieval) is required")
    if needs_rag:
        require_index(args.index)
        if not args.generator:  # it answers every question the Inspector passes (all of them without one)
            raise ValueError("--generator is required (it answers from the section the Inspector passes)")
    for stage, value in (
        ("gate", args.gate),
        ("answerer", args.answerer),
        ("refiner", args.refiner),
        ("consistency", args.consistency),
        ("inspector", args.inspector),
        ("generator", args.generator),
        ("reranker", args.reranker.split(":", 1)[1] if args.reranker.startswith(("gate:", "vlm:")) else None),
    ):
        if value in (None, "none", "always", "never", "endpoint") or not _looks_local(value):
            continue
        if not (Path(value) / "config.json").is_file():
            raise ValueError(f"--{stage}: {value} is not a model folder (no config.json)")
    check_gate_threshold(args.gate, args.gate_threshold, "--gate_threshold")  # skb's 1–5, a probability otherwise
    if args.generator_retries < 1:
        raise ValueError(f"--generator_retries must be at least 1 (attempts per answer), got {args.generator_retries}")
    if args.generator == "endpoint" and not (args.generator_url and args.generator_model):
        raise ValueError("--generator endpoint needs --generator_url and --generator_model")


def _looks_local(value: str) -> bool:
    return value.startswith((".", "/", "~")) or Path(value).exists() or value.count("/") != 1


RESUME_FREE = (  # how the run goes, not what it answers: a resume may change them
    "out",
    "batch_size",
    "limit",
    "generator_retries",
    "generator_backoff",
    "dist_timeout_minutes",
    "gpus_per_process",
    "stage_gpus",
)


def check_same_config(out: Path, args: PipelineArgs) -> None:
    """A folder resumes only the run that started it: predictions from other settings are never mixed in. Beside the
    settings, what they name: the queries file's content (made again at the same path, its answers are others), and
    the weights in every model folder named (a gate, refiner or generator exported again into the same folder)."""
    current = {k: v for k, v in asdict(args).items() if k not in RESUME_FREE}
    current["queries_content"] = file_fingerprint(args.queries)
    named = {
        k: v.split(":", 1)[1] if k.endswith("reranker") and isinstance(v, str) and ":" in v else v
        for k, v in current.items()
    }
    folders = {k: v for k, v in sorted(named.items()) if isinstance(v, str) and Path(v).is_dir()}  # gate:DIR too
    current["weights"] = {k: f for k, v in folders.items() if (f := weights_fingerprint(v))}
    if args.index and Path(args.index).is_dir():  # an index built again at the same path: its manifest and vectors
        current["index_files"] = index_fingerprint(args.index)
    if args.generator_prompt and Path(args.generator_prompt).is_file():  # a prompt file edited at the same path
        current["generator_prompt_content"] = file_fingerprint(args.generator_prompt)
    path = out / "pipeline_config.json"
    if path.is_file():
        before = read_json(path)
        changed = changed_keys(before, current)
        if "weights" in changed:  # which model folder's weights: a model exported again into the same folder
            old, new = before.get("weights") or {}, current["weights"]
            models = changed_keys(old, new)
            changed = [f"weights of {', '.join(models)}" if k == "weights" else k for k in changed]
        if changed and JobParts(out / "predictions.jsonl").started():  # merged, or parts an interruption left
            raise ValueError(
                f"--out {out} holds predictions made with other settings ({', '.join(changed)}); "
                "use another --out, or delete it to start over"
            )
    write_json_atomic(path, current)
