"""Every job that splits over launched processes starts its process group with ``--dist_timeout_minutes`` (default 24
hours): torch's own default is 10 minutes on NCCL, and a process with nothing left to do (a resumed run's remainder)
waits at the final barrier for as long as the others load their models and work. Each CLI's ``main`` runs as rank 0
of 2 up to ``init_process_group``, which a recording stand-in replaces. And the jobs that cannot split refuse to be
launched on several processes, before any work."""

from datetime import timedelta

import pytest

import gate.pipeline.run
import gate.train.build_data
import retrieval.build_index
import rl.baselines
import rl.data
import rl.image_embeddings
import rl.refine
from common.placement import DIST_TIMEOUT_MINUTES


class Started(Exception):
    pass


@pytest.fixture()
def rank_0_of_2(monkeypatch):
    """Rank 0 of a two-process launch; returns the keyword arguments of every init_process_group call."""
    import torch
    from accelerate.state import AcceleratorState

    calls = []

    def init_process_group(**kwargs):
        calls.append(kwargs)
        raise Started

    env = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    threads = str(torch.get_num_threads())  # set: else accelerate sets torch's threads for a CPU group's rank
    for name, value in (env | {"MASTER_PORT": "29998", "OMP_NUM_THREADS": threads}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield calls
    AcceleratorState._reset_state(reset_partial_state=True)


JOBS = {  # each job's main, and the arguments it needs to get as far as its process group (world, index)
    "gate.pipeline": (gate.pipeline.run.main, lambda w, i: []),
    "gate.train.build_data (sample)": (gate.train.build_data.main, lambda w, i: ["--stage", "sample"]),
    "rl.baselines": (rl.baselines.main, lambda w, i: []),
    "rl.data": (rl.data.main, lambda w, i: []),
    "rl.image_embeddings": (
        rl.image_embeddings.main,
        lambda w, i: ["--queries", str(w / "train.jsonl"), "--index", str(i)],
    ),
    "rl.refine": (rl.refine.main, lambda w, i: []),
    "retrieval.build_index": (
        retrieval.build_index.main,
        lambda w, i: ["--kb", str(w / "kb.jsonl"), "--out", str(w / "unused-index")],
    ),
}


@pytest.mark.parametrize("job", list(JOBS))
@pytest.mark.parametrize("flag,minutes", [([], DIST_TIMEOUT_MINUTES), (["--dist_timeout_minutes", "77"], 77)])
def test_the_process_group_starts_with_the_jobs_timeout(job, flag, minutes, rank_0_of_2, tiny_world, tiny_index_dir):
    main, argv = JOBS[job]
    with pytest.raises(Started):
        main(argv(tiny_world, tiny_index_dir) + flag)
    assert len(rank_0_of_2) == 1 and rank_0_of_2[0]["world_size"] == 2
    assert rank_0_of_2[0]["timeout"] == timedelta(minutes=minutes)


@pytest.mark.parametrize("stage", ["judge", "retrieve", "label", "render", "expand"])
def test_a_one_process_gate_data_stage_is_refused_under_a_launcher(stage, rank_0_of_2, tmp_path):
    with pytest.raises(ValueError, match=f"--stage {stage} runs in one process"):
        gate.train.build_data.main(["--stage", stage, "--out", str(tmp_path)])
    assert rank_0_of_2 == [] and list(tmp_path.iterdir()) == []  # refused before any group or file


def test_vllm_is_refused_on_a_launched_process_before_it_loads(monkeypatch):
    """Each launched process's vLLM engine would start on the same GPU; refused before vLLM is imported."""
    import builtins

    from rl.generate import load_vllm

    monkeypatch.setenv("WORLD_SIZE", "4")
    real_import = builtins.__import__
    monkeypatch.setattr(
        builtins,
        "__import__",
        lambda name, *a, **k: (
            (_ for _ in ()).throw(AssertionError("vllm imported")) if name == "vllm" else real_import(name, *a, **k)
        ),
    )
    with pytest.raises(ValueError, match="this is one of 4 launched processes"):
        load_vllm("some/model")
