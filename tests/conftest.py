"""Shared fixtures: offline settings and a tiny toy world + index, built once per test session.

Two markers (pyproject.toml): ``gpu`` tests need CUDA: collected everywhere, skipped with the reason where there is no
GPU, run with ``pytest -m gpu``, which fails instead of skipping when torch sees no GPU (a GPU machine whose driver is
older than torch's CUDA would otherwise pass with every test skipped). ``slow`` tests (a real-width bf16 step) are
skipped unless selected with ``pytest -m slow``, so ``make test`` stays fast on the slowest machine of this kind.
"""

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import yaml  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402

# Hypothesis's default 200 ms deadline per example is a fixed timeout: on a busy or slow machine of this kind an
# example may take longer and fail for it. Every @given test runs without one; the other defaults stay.
hypothesis_settings.register_profile("refine-rl", deadline=None)
hypothesis_settings.load_profile("refine-rl")

from tests.upstream_site import serve_in_background  # noqa: E402


def pytest_collection_modifyitems(config, items):
    import torch

    from tests.machine import gpu_asked

    chosen = config.getoption("-m") or ""
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none here): run `pytest -m gpu` on a machine with one")
    not_asked = pytest.mark.skip(reason="slow: run with `pytest -m slow` (docs/testing.md)")
    if gpu_asked(chosen) and any("gpu" in item.keywords for item in items) and not torch.cuda.is_available():
        raise pytest.UsageError(
            f"-m gpu: torch {torch.__version__} sees no CUDA GPU (built for CUDA {torch.version.cuda or 'none'}). "
            "On a GPU machine: nvidia-smi must list the GPU with a driver that supports that CUDA version, else "
            "install the torch build for the driver's CUDA (docs/testing.md)"
        )
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "slow" in item.keywords and "slow" not in chosen:
            item.add_marker(not_asked)


@pytest.hookimpl(trylast=True)  # after the durations and the short summary: next to pytest's last line
def pytest_terminal_summary(terminalreporter):
    from tests.machine import this_machine

    terminalreporter.write_line(f"machine: {this_machine()}")  # the suite's wall time depends on it: docs/testing.md


def pytest_sessionfinish(session, exitstatus):
    from common.cli import freeze_for_exit

    freeze_for_exit()  # as common.cli.run does: no last collections over millions of objects at exit (seconds here)


@pytest.fixture(scope="session", autouse=True)
def _cache(tmp_path_factory):
    if "REFINE_RL_CACHE" not in os.environ:
        os.environ["REFINE_RL_CACHE"] = str(tmp_path_factory.mktemp("cache"))


DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def restorable_env() -> dict:
    """The variables a test's job may set for good: the distributed ones, and every WANDB_* (``rl.monitor.setup_wandb``
    sets WANDB_MODE, WANDB_DIR and WANDB_CACHE_DIR, the last two inside that test's own temporary folder)."""
    return {
        name: os.environ.get(name) for name in {*DISTRIBUTED_ENV, *(n for n in os.environ if n.startswith("WANDB_"))}
    }


@pytest.fixture(autouse=True)
def _one_process_after_each_test():
    """Every test leaves the test process as it found it: TRL's colocated-vLLM setup writes RANK, WORLD_SIZE and
    MASTER_* into os.environ for good, and the next trainer's PartialState then starts a real one-process group in
    this process (a later test that records the group's start would see none); a W&B run's setup leaves its WANDB_*
    behind. Restored after each test."""
    before = restorable_env()
    yield
    for name in {*before, *restorable_env()}:
        if before.get(name) is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before[name]
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="session")
def encoders():
    from retrieval.encoders import image_encoder, text_encoder

    return image_encoder("tiny", device="cpu"), text_encoder("tiny", device="cpu")


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory):
    """24 entities, 2 KB images, 2 train + 2 test questions each; no index."""
    from toy.world import ToyWorldArgs, generate

    out = tmp_path_factory.mktemp("world")
    generate(ToyWorldArgs(out=str(out), entities=24, train_images=2, test_images=2), log=lambda *a: None)
    return out


@pytest.fixture(scope="session")
def small_default_world(tmp_path_factory):
    """The embedded default's kind of world (its generator, MiniLM text, α 0.3) with its index, smaller: 48 entities
    with 4 train images and 1 test image each instead of 180 with 20 and 2, so runs of the embedded default on it take
    seconds, not minutes (test_toyworld.py checks the full default world)."""
    from toy.world import ToyWorldArgs, build

    out = tmp_path_factory.mktemp("default") / "toyworld"
    build(ToyWorldArgs(out=str(out), alpha=0.3, entities=48, train_images=4, test_images=1), log=lambda *a: None)
    return out


@pytest.fixture(scope="session")
def tiny_index_dir(tiny_world, encoders):
    from retrieval.build_index import BuildArgs, build_index

    out = tiny_world / "index"
    build_index(
        BuildArgs(
            kb=str(tiny_world / "kb.jsonl"),
            out=str(out),
            image_encoder="tiny",
            text_encoder="tiny",
            device="cpu",
            shard_size=32,
        ),
        log=lambda *a: None,
        encoders=encoders,
    )
    return out


@pytest.fixture(scope="session")
def tiny_index(tiny_index_dir, encoders):
    from retrieval.index import MultimodalIndex

    return MultimodalIndex.load(tiny_index_dir, image_encoder=encoders[0], text_encoder=encoders[1])


@pytest.fixture(scope="session")
def tiny_vlm(tiny_world, tmp_path_factory):
    """The tiny Qwen2.5-VL untrained (seconds to build): for tests that need a model folder and its processor, not a
    model that writes queries."""
    from toy.refiner import tokenizer_corpus
    from toy.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm") / "base", tokenizer_corpus(tiny_world))


@pytest.fixture(scope="session")
def tiny_refiner(tiny_vlm, tiny_world, tmp_path_factory):
    """A tiny Qwen2.5-VL with a short supervised warm start: most of its samples parse, not all."""
    from toy.refiner import run_warm_start

    root = tmp_path_factory.mktemp("refiner")
    return run_warm_start(
        tiny_vlm,
        tiny_world,
        root / "warm",
        steps=150,
        batch_size=8,
        learning_rate=2e-3,
        shift_fraction=0.0,
        seed=0,
        log=lambda *a: None,
    )


@pytest.fixture()
def config(tiny_world, tiny_index_dir, tiny_refiner, tmp_path):
    def make(**overrides):
        cfg = dict(
            index=str(tiny_index_dir),
            train_file=str(tiny_world / "train.jsonl"),
            alpha=0.5,
            prompt="toy",
            model_name_or_path=str(tiny_refiner),
            output_dir=str(tmp_path / "run"),
            use_cpu=True,
            bf16=False,
            activation_checkpointing=False,
            seed=0,
            num_generations=4,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=1,
            max_steps=2,
            learning_rate=1e-3,
            temperature=1.0,
            max_completion_length=40,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            log_table_steps=1,
            dataloader_num_workers=0,
            disable_tqdm=True,
            min_pixels=112 * 112,
            max_pixels=112 * 112,
        )
        cfg.update(overrides)
        path = tmp_path / f"cfg-{len(list(tmp_path.glob('cfg-*')))}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return ["--config", str(path)]

    return make


@pytest.fixture(scope="session")
def tiny_gate_vlm(tiny_world, tiny_refiner, tmp_path_factory):
    """A tiny VLM whose tokenizer has every gate verbaliser as one token, seeing through the refiner's vision tower."""
    from toy.gates import build_toy_vlm

    return build_toy_vlm(tmp_path_factory.mktemp("gate") / "toy-vlm", tiny_world, vision_from=tiny_refiner)


@pytest.fixture(scope="session")
def tiny_bem(tmp_path_factory):
    """A tiny BertForSequenceClassification whose logits the test sets: the classifier reads nothing (zero weights)
    and its bias makes softmax[1] = sigmoid(bias[1] − bias[0])."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    folder = tmp_path_factory.mktemp("bem") / "tiny-bem"
    words = [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
        "the",
        "menger",
        "family",
        "baker",
        "william",
        "and",
        "mary",
        "where",
        "does",
        "this",
        "hotel",
        "derive",
        "its",
        "name",
        "from",
        "?",
    ]
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}, do_lower_case=True)
    torch.manual_seed(0)
    model = BertForSequenceClassification(
        BertConfig(
            vocab_size=len(words),
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            num_labels=2,
        )
    )
    with torch.no_grad():
        model.classifier.weight.zero_()
        model.classifier.bias.copy_(torch.tensor([0.0, 1.0]))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class Stub:
    """A local OpenAI-compatible endpoint replying from a script, recording what it was sent."""

    def __init__(self, replies, status: int = 200):
        self.replies, self.requests, self.status = list(replies), [], status
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append({"body": body, "auth": self.headers.get("Authorization")})
                reply = stub.replies.pop(0) if stub.replies else "no score here"
                data = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
                self.send_response(stub.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                # a reply of None: the connection drops mid-body (the client reads an incomplete response)
                self.wfile.write(data[:10] if reply is None else data)
                self.close_connection = reply is None

            def log_message(self, *a):
                pass

        self.server = serve_in_background(HTTPServer(("127.0.0.1", 0), Handler))
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"

    def close(self):
        self.server.shutdown()


@pytest.fixture()
def stub():
    """Start local OpenAI-compatible stub endpoints: stub(replies) → Stub (``status`` 200 unless set)."""
    made = []

    def make(replies, status: int = 200):
        made.append(Stub(replies, status))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.fixture(scope="session")
def tiny_text_llm(tiny_gate_vlm, tmp_path_factory):
    """A tiny random causal LM (Qwen2 architecture) with the toy tokenizer and its chat template."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("llm")
    tok = AutoTokenizer.from_pretrained(str(tiny_gate_vlm))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        )
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def torchrun_jobs(small_default_world, tiny_refiner, tiny_world, tiny_index_dir, tiny_gate_vlm, tmp_path_factory):
    """Jobs of two processes under torchrun that need no launch of their own, one after the other in one launch
    (tests/test_multiprocess.py: ``launch_jobs``; each start of two processes costs ~11 s here, whatever the job): the
    embedded default, seed 0 again (tests/test_embedded_default.py), then the four inference jobs
    (tests/test_inference_multiprocess.py). ``{name: (the job's folder, its log)}``."""
    from tests.test_embedded_default import default_config
    from tests.test_inference_multiprocess import inference_configs
    from tests.test_multiprocess import launch_jobs

    tmp = tmp_path_factory.mktemp("torchrun")
    jobs = {
        "embedded_default": ("rl.train_grpo", default_config(tmp / "embedded_default", small_default_world, 0)),
        **inference_configs(
            tmp,
            tiny_refiner=tiny_refiner,
            tiny_world=tiny_world,
            tiny_index_dir=tiny_index_dir,
            tiny_gate_vlm=tiny_gate_vlm,
        ),
    }
    logs = launch_jobs(jobs, tmp)
    return {name: (tmp / name, logs[name]) for name in jobs}


@pytest.fixture(scope="session")
def zero3_jobs(small_default_world, tiny_world, tiny_index_dir, tiny_refiner, tiny_gate_vlm, tmp_path_factory):
    """The suite's DeepSpeed ZeRO-3 jobs (tests/test_deepspeed.py: ``zero3_configs``), one after the other in one
    launch of two processes as a user launches them (configs/accelerate/zero3-cpu2.yaml), the embedded default first.
    ``{name: (the job's folder, its log)}``."""
    from tests.test_deepspeed import zero3_configs
    from tests.test_multiprocess import ZERO, launch_jobs

    tmp = tmp_path_factory.mktemp("zero3")
    jobs = zero3_configs(tmp, small_default_world, tiny_world, tiny_index_dir, tiny_refiner, tiny_gate_vlm)
    logs = launch_jobs(jobs, tmp, ZERO[3])
    return {name: (tmp / name, logs[name]) for name in jobs}
