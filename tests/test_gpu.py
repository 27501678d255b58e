"""What only a GPU can show, marked ``gpu``: collected everywhere, skipped with the reason where there is no CUDA, run
on a machine with one by ``pytest -m gpu`` (after ``pip install -e '.[gpu,dev]'``; vLLM's test also needs
``.[vllm]``). Asked for by ``-m gpu``, they require what they test: no GPU is a usage error (conftest.py), and
faiss-gpu or DeepSpeed that do not import, or a FAISS without GPUs, fail instead of skipping. Each uses the tiny
offline models of conftest.py, on ``cuda:0``:

- the exact ranker's fp16 replica on the GPU gives the CPU's ranks for the same vectors;
- FAISS placement on one GPU (faiss-gpu): ``MultimodalIndex.load`` puts one fp16 replica on this process's GPU and
  keeps the memory-mapped CPU index beside it; never more than 2,048 rows a search;
- two bf16 GRPO steps of the tiny refiner (fp32 master weights under bf16 autocast): text weights move, the vision
  tower does not;
- GRPO under DeepSpeed ZeRO-3 on one GPU: it finishes, and ``final/`` reloads whole;
- colocated vLLM, for real: the prompt it receives for an image holds one image placeholder (vLLM expands it itself;
  rl/vllm_prompts.py, tested on the CPU with a recording stand-in in tests/test_vllm_prompts.py).
"""

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.test_exact_ranks import FakeFaissIndex, brute_force_bounds, make
from tests.test_multiprocess import free_port, is_vision, reloaded

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent


def needed(request, module: str):
    """``module`` imported; asked for by ``-m gpu``, an import that fails is the test's failure, else a skip."""
    from tests.machine import gpu_asked

    if gpu_asked(request.config.getoption("-m")):
        return importlib.import_module(module)
    return pytest.importorskip(module)


def test_exact_ranks_on_the_gpu_replica_equal_the_cpu_ranks():
    from retrieval.exact import ExactRanker
    from retrieval.faiss_build import build_faiss_index
    from tests.test_exact_ranks import brute_force_bounds, make, queries

    index, rows, ents = make([2, 3, 1] * 2000, di=32, dt=48, seed=21)  # 12,000 rows, 6,000 entities
    # rows exactly representable in fp16: the GPU's fp16 replica and the CPU's fp32 view hold the same numbers
    rows = torch.from_numpy(rows).half().float().numpy()
    flat = build_faiss_index(rows, "Flat")
    q = queries(64, di=32, dt=48, seed=22)
    gold = list(np.random.default_rng(23).integers(0, index.num_entities, 64))
    cpu = ExactRanker.from_faiss(flat, index.row_entity, index.num_entities, device="cpu").ranks(q, gold)
    gpu_ranker = ExactRanker.from_faiss(flat, index.row_entity, index.num_entities, device="cuda:0")
    assert gpu_ranker.rows.device.type == "cuda" and gpu_ranker.rows.dtype == torch.float16
    assert torch.equal(gpu_ranker.rows.cpu().float(), torch.from_numpy(rows))
    gpu = gpu_ranker.ranks(q, gold)
    for qi, g, a, b in zip(q, gold, cpu, gpu):
        lo, hi = brute_force_bounds(rows, ents, qi, index.entity_names[g], eps=1e-5)
        assert lo <= a <= hi and lo <= b <= hi  # summation order may only move a rank within near-ties
    assert sum(a == b for a, b in zip(cpu, gpu)) >= 60, list(zip(cpu, gpu))


def test_faiss_puts_one_fp16_replica_on_this_gpu_and_caps_k(request, tiny_index_dir):
    from tests.machine import gpu_asked

    faiss = needed(request, "common.faiss_lib").faiss
    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
        why = f"FAISS {faiss.__version__} has no GPU support or sees no GPU: pip install faiss-gpu (the gpu extra)"
        pytest.fail(why) if gpu_asked(request.config.getoption("-m")) else pytest.skip(why)
    from common import placement
    from retrieval.index import MultimodalIndex

    # the production load: one replica on the GPU, the CPU index kept beside it
    on_gpu = MultimodalIndex.load(tiny_index_dir, device="cuda:0", rank_method="search")
    on_cpu = MultimodalIndex.load(tiny_index_dir, device="cpu", rank_method="search")
    assert on_gpu.search_device == "cuda:0" and "Gpu" in type(on_gpu.faiss).__name__
    assert "Gpu" not in type(on_gpu._faiss_cpu).__name__ and on_gpu._faiss_cpu.ntotal == on_gpu.faiss.ntotal
    assert on_cpu.search_device == "cpu" and "Gpu" not in type(on_cpu.faiss).__name__
    rows = on_cpu.faiss.reconstruct_n(0, on_cpu.faiss.ntotal)
    rng = np.random.default_rng(1)
    v = rng.normal(size=(6, on_cpu.image_dim)).astype(np.float32)
    t = rng.normal(size=(6, on_cpu.text_dim)).astype(np.float32)
    gold = [str(e) for e in on_cpu.entity_names[:6]]
    from retrieval.ranking import query_vectors

    q, _ = query_vectors(v, t, 0.5)
    entities = [str(on_cpu.entity_names[i]) for i in on_cpu.row_entity]
    for qi, g, r in zip(q, gold, on_gpu.entity_ranks(v, t, gold, alpha=0.5, depth=50)):
        lo, hi = brute_force_bounds(rows, entities, qi, g, eps=2e-3)  # fp16 storage on the GPU
        assert r is None and lo > 50 or r is not None and lo <= r <= hi, (g, r, lo, hi)
    # the k cap: one entity owns 3,000 rows, more than one GPU search may return
    index, rows, ents = make([3000] + [1] * 300, seed=2, rank_method="search")  # one entity owns 3,000 rows
    gpu_index, where = placement.index_to_device(index.faiss, "cuda:0")
    assert where == "cuda:0" and "Gpu" in type(gpu_index).__name__ and gpu_index.ntotal == len(rows)
    index._faiss_cpu = index.faiss  # the CPU copy load() keeps beside the GPU one: queries short of depth use it
    index.faiss, index.search_device = FakeFaissIndex(gpu_index), "cuda:0"  # records every k, refuses k > 2048
    rng = np.random.default_rng(0)
    v, t = rng.normal(size=(8, 6)).astype(np.float32), rng.normal(size=(8, 10)).astype(np.float32)
    gold = ["ent00001", "ent00007", "ent00150", "ent00299"] * 2
    ranks = index.entity_ranks(v, t, gold, alpha=0.5, depth=200)
    q, _ = query_vectors(v, t, 0.5)
    assert max(index.faiss.ks) == 2048  # the one big entity fills the first searches: the depth loop hit the cap
    for qi, g, r in zip(q, gold, ranks):
        lo, hi = brute_force_bounds(rows, ents, qi, g, eps=2e-3)  # fp16 storage on the GPU
        assert r is None and lo > 200 or r is not None and lo <= r <= hi, (g, r, lo, hi)


def split_tower(state: dict) -> tuple[list[str], list[str]]:
    vision = [k for k in state if is_vision(k)]
    return vision, [k for k in state if k not in vision]


def test_two_bf16_grpo_steps_on_one_gpu(config, tiny_refiner, tmp_path, capsys):
    import rl.train_grpo as tg

    result = tg.main(config(use_cpu=False, bf16=True, dtype="bfloat16", learning_rate=1e-3))
    said = capsys.readouterr().out
    assert "rank 0/1 on cuda" in said and "mixed precision: bf16" in said  # bf16 autocast over fp32 masters
    assert "full fine-tuning outside DeepSpeed: fp32 master weights (dtype bfloat16 asked for" in said
    before, after = reloaded(tiny_refiner), reloaded(tmp_path / "run" / "final")
    vision, text = split_tower(before)
    assert vision and all(torch.equal(before[k], after[k]) for k in vision)
    assert any(not torch.equal(before[k], after[k]) for k in text)
    assert len([h for h in result["log_history"] if "reward" in h]) == 2


def test_zero3_grpo_on_one_gpu(request, config, tiny_refiner, tmp_path):
    needed(request, "deepspeed")
    cfg_flag, cfg_path = config(use_cpu=False, bf16=True, dtype="bfloat16")
    accelerate = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "num_machines": 1,
        "num_processes": 1,
        "mixed_precision": "bf16",
        "deepspeed_config": {
            "zero_stage": 3,
            "zero3_init_flag": True,
            "zero3_save_16bit_model": True,
            "offload_optimizer_device": "none",
            "offload_param_device": "none",
        },
    }
    (tmp_path / "zero3-1gpu.yaml").write_text(yaml.safe_dump(accelerate))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(tmp_path / "zero3-1gpu.yaml"),
            "--main_process_port",
            str(free_port()),
            str(ROOT / "rl" / "train_grpo.py"),
            cfg_flag,
            cfg_path,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "(DeepSpeed ZeRO-3 over nccl" in proc.stdout + proc.stderr
    before, after = reloaded(tiny_refiner), reloaded(tmp_path / "run" / "final")  # gathered 16-bit weights
    assert before.keys() == after.keys()
    vision, text = split_tower(before)
    assert all(after[k].shape == before[k].shape for k in before)  # whole tensors, not ZeRO-3 placeholders
    # ZeRO-3's partitioned init rounds every weight to bf16, as .bfloat16() does: frozen ones come back exactly that;
    # two Adam steps at lr 1e-3 move a weight by ~1e-3 at most, which shows after the same rounding, not at atol 1e-2
    bf16 = {k: before[k].bfloat16() for k in before}
    assert all(torch.equal(bf16[k], after[k].bfloat16()) for k in vision)
    assert any(not torch.equal(bf16[k], after[k].bfloat16()) for k in text)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (pip install -e '.[vllm]')")
def test_colocated_vllm_receives_one_placeholder_per_image(config, tiny_refiner, monkeypatch):
    import vllm

    import rl.train_grpo as tg

    seen = []
    generate = vllm.LLM.generate

    def record(self, prompts, *a, **k):
        seen.extend(prompts)
        return generate(self, prompts, *a, **k)

    monkeypatch.setattr(vllm.LLM, "generate", record)
    from transformers import AutoProcessor

    pad = AutoProcessor.from_pretrained(str(tiny_refiner)).tokenizer.convert_tokens_to_ids("<|image_pad|>")
    tg.main(
        config(
            use_cpu=False,
            bf16=True,
            dtype="bfloat16",
            max_steps=1,
            use_vllm=True,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=0.2,
            vllm_max_model_length=512,
        )
    )
    assert seen
    for prompt in seen:
        images = prompt.get("multi_modal_data", {}).get("image")
        n_images = len(images) if isinstance(images, list) else int(images is not None)
        ids = prompt.get("prompt_token_ids")
        count = ids.count(pad) if ids is not None else prompt["prompt"].count("<|image_pad|>")
        assert n_images == 1 and count == n_images, (count, n_images)
