"""Exact gold-entity ranks (matmul + segment max) against a numpy brute force, the FAISS k cap on a GPU, and the
per-process placement policy (one device, never all GPUs; HNSW stays on the CPU; encoders outside ZeRO-3 init)."""

import json
import logging
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common import placement
from retrieval.encoders import l2_normalize
from retrieval.exact import ExactRanker, StoredRows, flat_storage, rows_view
from retrieval.faiss_build import build_faiss_index
from retrieval.index import FAISS_GPU_MAX_K, MultimodalIndex
from retrieval.ranking import query_vectors


def make(counts, di=6, dt=10, seed=0, factory="Flat", rank_method="exact"):
    rng = np.random.default_rng(seed)
    entity_ids = [f"ent{e:05d}" for e, c in enumerate(counts) for _ in range(c)]
    v = l2_normalize(rng.normal(size=(len(entity_ids), di)))
    t = l2_normalize(rng.normal(size=(len(entity_ids), dt)))
    rows = np.concatenate([v, t], 1).astype(np.float32)
    manifest = {"image_dim": di, "text_dim": dt, "image_encoder": "x", "text_encoder": "y"}
    index = MultimodalIndex(
        build_faiss_index(rows, factory),
        [f"row{i}" for i in range(len(rows))],
        entity_ids,
        manifest,
        device="cpu",
        rank_method=rank_method,
    )
    return index, rows, entity_ids


def brute_force_bounds(rows, entity_ids, q, gold, eps=1e-5):
    """(strictly better + 1, tied-or-better) by numpy, for one query vector."""
    scores = rows @ q
    best = {}
    for e, s in zip(entity_ids, scores):
        best[e] = max(best.get(e, -np.inf), float(s))
    g = best[gold]
    return (sum(s > g + eps for s in best.values()) + 1, sum(s >= g - eps for s in best.values()))


def queries(n, di=6, dt=10, seed=1, alpha=0.4):
    rng = np.random.default_rng(seed)
    return query_vectors(rng.normal(size=(n, di)), rng.normal(size=(n, dt)), alpha)[0]


def test_one_entity_owns_more_rows_than_the_gpu_k_cap_allows_at_depth():
    """3,000 rows for one entity (≫ 2048 / depth 200); the exact ranks equal the brute force for every query."""
    counts = [3000] + [1] * 300 + [3] * 100
    index, rows, ents = make(counts, seed=3)
    q = queries(40, seed=4)
    gold = [ents[int(i)] for i in np.random.default_rng(5).integers(0, len(ents), 40)]
    assert index.uses_exact_ranks and index.exact is index.exact  # one replica, made on first use
    ranks = index.exact.ranks(q, [index.entity_index[g] for g in gold])
    for qi, g, r in zip(q, gold, ranks):
        lo, hi = brute_force_bounds(rows, ents, qi, g)
        assert lo <= r <= hi


def test_auto_ranks_exactly_on_a_gpu_and_with_faiss_on_a_cpu():
    """benchmarks/reward_scale.py: the same ranks, FAISS Flat faster on a CPU; no k cap with the exact ranker on a
    GPU."""
    index, *_ = make([1, 2, 3] * 10, rank_method="auto")
    assert not index.uses_exact_ranks
    index.device = "cuda:0"
    assert index.uses_exact_ranks
    hnsw, *_ = make([1, 2] * 20, factory="HNSW8,Flat", rank_method="auto")
    hnsw.device = "cuda:0"
    assert not hnsw.uses_exact_ranks
    assert hnsw.is_approximate and not index.is_approximate
    with pytest.raises(ValueError, match="rank_method must be one of auto, exact, search, got 'fast'"):
        make([1, 2], rank_method="fast")
    with pytest.raises(ValueError, match="exact' needs a Flat"):
        make([1, 2] * 20, factory="HNSW8,Flat", rank_method="exact")[0].uses_exact_ranks  # noqa: B018


def test_exact_and_search_agree_within_depth_on_the_cpu():
    index, rows, ents = make([1, 2, 5, 40] * 30, seed=7)
    search, *_ = make([1, 2, 5, 40] * 30, seed=7, rank_method="search")
    rng = np.random.default_rng(8)
    v, t = rng.normal(size=(25, 6)).astype(np.float32), rng.normal(size=(25, 10)).astype(np.float32)
    gold = [ents[int(i)] for i in rng.integers(0, len(ents), 25)]
    assert index.uses_exact_ranks and not search.uses_exact_ranks
    assert index.entity_ranks(v, t, gold, alpha=0.6, depth=50) == search.entity_ranks(v, t, gold, alpha=0.6, depth=50)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), alpha=st.floats(0, 1), chunk=st.integers(1, 50), block=st.integers(4, 400))
def test_exact_ranks_do_not_depend_on_chunking(seed, alpha, chunk, block):
    """Row chunks and query blocks change how the work is cut, never the ranks."""
    counts = np.random.default_rng(seed).integers(1, 6, size=30)
    index, rows, ents = make(counts, seed=seed % 5)
    q = queries(7, seed=seed, alpha=alpha)
    gold = list(np.random.default_rng(seed + 1).integers(0, index.num_entities, 7)) + [-1]
    q = np.concatenate([q, q[:1]])
    whole = ExactRanker(torch.from_numpy(rows), index.row_entity, index.num_entities).ranks(q, gold)
    cut = ExactRanker(
        torch.from_numpy(rows),
        index.row_entity,
        index.num_entities,
        chunk_rows=chunk,
        block_bytes=block * 4 * index.num_entities // 30,
    ).ranks(q, gold)
    assert whole == cut and whole[-1] is None  # an unknown gold entity has no rank
    for qi, g, r in zip(q, gold[:-1], whole):
        lo, hi = brute_force_bounds(rows, ents, qi, index.entity_names[g])
        assert lo <= r <= hi


def test_ties_go_to_the_gold_entity():
    """Two entities with identical rows: both rank 1 (strictly-above count), as the old bounds allow."""
    index, rows, ents = make([1, 1, 1], seed=0)
    rows[1] = rows[0]
    ranker = ExactRanker(torch.from_numpy(rows), index.row_entity, 3)
    assert ranker.ranks(np.repeat(rows[:1], 2, 0), [0, 1]) == [1, 1]


def test_entities_tied_at_the_depth_share_its_rank_on_every_path():
    """Two entities with identical rows tie for rank 2 at depth 2 (duplicate KB entries do this): the exact ranker
    counts strictly better entities, so both get 2; the search paths must not cut the list at `depth` entities
    first (one of them came back a miss), nor stop their search inside the tie."""
    e = np.eye(2, dtype=np.float32)
    rows = np.concatenate([e[[0, 1, 1]], e[[0, 1, 1]]], 1)  # A, then B and C identical
    manifest = {"image_dim": 2, "text_dim": 2, "image_encoder": "x", "text_encoder": "y"}
    q = np.array([[1.0, 0.9]] * 2, np.float32)
    got = {}
    for method in ("exact", "search"):
        index = MultimodalIndex(build_faiss_index(rows, "Flat"), ["r0", "r1", "r2"], ["A", "B", "C"], manifest,
                                device="cpu", rank_method=method)  # fmt: skip
        got[method, "entity_ranks"] = index.entity_ranks(q, q, ["B", "C"], 0.5, depth=2)
        got[method, "search_and_rank"] = index.search_and_rank(q, q, ["B", "C"], 0.5, k=1, depth=2)[1]
        assert index.entity_ranks(q, q, ["B", "C"], 0.5, depth=1) == [None, None]
    assert set(map(tuple, got.values())) == {(2, 2)}, got


def test_entities_tied_for_the_top_share_rank_1_at_depth_1():
    """At depth 1 the first search asks for one row: a second entity with the same row ties with it, so the search
    goes deeper (``tie_cut`` holds at depth 1 too) and both rank 1, as the exact ranker counts them."""
    e = np.eye(2, dtype=np.float32)
    rows = np.concatenate([e[[0, 1, 1]], e[[0, 1, 1]]], 1)  # A, then B and C identical
    manifest = {"image_dim": 2, "text_dim": 2, "image_encoder": "x", "text_encoder": "y"}
    q = np.array([[0.9, 1.0]] * 2, np.float32)  # B and C best, A next
    for method in ("exact", "search"):
        index = MultimodalIndex(build_faiss_index(rows, "Flat"), ["r0", "r1", "r2"], ["A", "B", "C"], manifest,
                                device="cpu", rank_method=method)  # fmt: skip
        assert index.entity_ranks(q, q, ["B", "C"], 0.5, depth=1) == [1, 1], method
        assert index.search_and_rank(q, q, ["B", "C"], 0.5, k=1, depth=1)[1] == [1, 1], method
        assert index.entity_ranks(q, q, ["A", "A"], 0.5, depth=1) == [None, None], method


@pytest.mark.parametrize(
    "factory,storage", [("Flat", "fp32"), ("SQfp16", "fp16"), ("SQbf16", "bf16"), ("HNSW8,Flat", None)]
)
def test_rows_view_shares_the_index_memory(factory, storage, tmp_path):
    from common.faiss_lib import faiss

    rows = l2_normalize(np.random.default_rng(0).normal(size=(300, 16)))
    index = build_faiss_index(rows, factory)
    faiss.write_index(index, str(tmp_path / "i.faiss"))
    mapped = faiss.read_index(str(tmp_path / "i.faiss"), faiss.IO_FLAG_MMAP_IFC) if storage else index
    assert flat_storage(mapped) == storage
    if storage is None:
        with pytest.raises(ValueError, match="exact ranks need a Flat"):
            rows_view(mapped)
        return
    view = rows_view(mapped)
    np.testing.assert_allclose(view.float().numpy(), rows, atol={"fp32": 0, "fp16": 1e-3, "bf16": 1e-2}[storage])
    assert view.dtype == {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[storage]
    # an empty index, given as a temporary: downcast_index's view outlived the only reference to the index it views
    # (rebinding the argument freed it: the view read d = 1,950,923,562 from freed memory)
    empty = rows_view(faiss.index_factory(16, factory, faiss.METRIC_INNER_PRODUCT))
    assert empty.shape == (0, 16) and empty.dtype == view.dtype


def test_a_16_bit_replica_ranks_like_fp32_up_to_near_ties():
    """What a GPU replica holds (fp16 rows), run here on the CPU by the same code."""
    index, rows, ents = make([2, 3, 1] * 60, seed=11)
    q = queries(30, seed=12)
    gold = list(np.random.default_rng(13).integers(0, index.num_entities, 30))
    half = ExactRanker(torch.from_numpy(rows).half(), index.row_entity, index.num_entities).ranks(q, gold)
    for qi, g, r in zip(q, gold, half):
        lo, hi = brute_force_bounds(rows, ents, qi, index.entity_names[g], eps=2e-3)
        assert lo <= r <= hi


def test_a_block_of_queries_keeps_each_float32_table_within_block_bytes(monkeypatch):
    """A block's best scores per entity (queries × entities) and one row chunk's scores (queries × chunk rows) each
    fit in ``block_bytes``. Blocks were sized by the entities alone: 10 entities of 100 rows, 500-row chunks and
    40 kB made one block of all 100 queries, a 200 kB score table (an approximate index's Flat reference over every
    question with 10 k entities of 30 rows made 3.5 GB ones at the default 256 MiB)."""
    rng = np.random.default_rng(0)
    rows = torch.from_numpy(l2_normalize(rng.normal(size=(1000, 16))))
    row_entity = np.arange(1000) // 100
    q, gold = l2_normalize(rng.normal(size=(100, 16))), list(rng.integers(0, 10, 100))
    sizes, scores = [], ExactRanker.entity_scores
    monkeypatch.setattr(ExactRanker, "entity_scores", lambda self, qb: sizes.append(len(qb)) or scores(self, qb))
    blocked = ExactRanker(rows, row_entity, 10, chunk_rows=500, block_bytes=40_000).ranks(q, gold)
    assert max(sizes) * 500 * 4 <= 40_000 and sum(sizes) == 100
    assert blocked == ExactRanker(rows, row_entity, 10).ranks(q, gold)


@pytest.mark.parametrize("method", ["exact", "search"])
@pytest.mark.parametrize("given", [1, 5])
def test_gold_entities_must_be_one_per_query(method, given):
    """3 queries with 1 or 5 gold entities were ranked as far as ``zip`` went: 1 rank back, or 3 with two gold
    entities dropped, and no error."""
    index, rows, ents = make([1, 2, 3] * 5, rank_method=method)
    q = queries(3)
    calls = {
        "entity_ranks": lambda g: index.entity_ranks(q[:, :6], q[:, 6:], g, alpha=0.4),
        "search_and_rank": lambda g: index.search_and_rank(q[:, :6], q[:, 6:], g, alpha=0.4, k=2),
        "reference_ranks": lambda g: index.reference_ranks(q[:, :6], q[:, 6:], g, alpha=0.4),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=f"got 3 queries but {given} gold entity ids"):
            call(ents[:given])
        got = call(ents[:3])
        assert len(got[1] if name == "search_and_rank" else got) == 3


def test_the_exact_ranker_refuses_rows_queries_and_gold_that_do_not_fit():
    rows = torch.zeros((5, 4))
    with pytest.raises(ValueError, match="5 rows but 4 row → entity ids"):
        ExactRanker(rows, np.zeros(4, int), 1)
    ranker = ExactRanker(rows, np.zeros(5, int), 1)
    for bad in (np.zeros((2, 3)), np.zeros(4), np.zeros((1, 2, 4))):
        with pytest.raises(ValueError, match=r"queries must have shape \(n, 4\), got"):
            ranker.ranks(bad, [0, 0])
    with pytest.raises(ValueError, match="2 queries but 1 gold entities"):
        ranker.ranks(np.zeros((2, 4)), [0])
    assert ranker.ranks(np.zeros((2, 4)), [0, -1]) == [1, None]


@pytest.mark.parametrize("factory", ["IVF4,Flat", "HNSW8,Flat"])
def test_an_approximate_indexs_stored_rows_read_in_chunks_rank_as_the_rows_themselves(factory):
    """The Flat reference of an approximate index (``reference_ranks``) decodes its rows chunk by chunk; these
    factories store rows exactly, so 7-row chunks rank as the original rows held whole."""
    index, rows, ents = make([1, 2, 3] * 30, factory=factory, rank_method="search")
    q = queries(9, seed=5)
    gold = list(np.random.default_rng(6).integers(0, index.num_entities, 9))
    stored = StoredRows(index.faiss)
    assert len(stored) == len(rows) and stored.shape == rows.shape
    np.testing.assert_array_equal(stored[7:14].numpy(), rows[7:14])
    np.testing.assert_array_equal(stored[175:200].numpy(), rows[175:])  # a last chunk past the end is cut there
    whole = ExactRanker(torch.from_numpy(rows), index.row_entity, index.num_entities).ranks(q, gold)
    assert ExactRanker(stored, index.row_entity, index.num_entities, chunk_rows=7).ranks(q, gold) == whole


@pytest.mark.parametrize(
    "factory,dtype", [("Flat", torch.float16), ("SQfp16", torch.float16), ("SQbf16", torch.bfloat16)]
)
def test_a_device_replica_is_a_16_bit_copy_made_chunk_by_chunk(factory, dtype):
    """What ``from_faiss`` makes for ``cuda:N`` (fp16 for fp32 rows, else the index's own 16 bits, copied 7 rows at a
    time here), run on a CPU device other than "cpu", which gets the zero-copy view instead."""
    rows = l2_normalize(np.random.default_rng(0).normal(size=(50, 8)))
    index = build_faiss_index(rows, factory)
    view = rows_view(index)
    replica = ExactRanker.from_faiss(index, np.arange(50) // 2, 25, device="cpu:0", copy_chunk=7).rows
    assert replica.dtype == dtype and torch.equal(replica, view.to(dtype))
    assert replica.data_ptr() != view.data_ptr()
    assert ExactRanker.from_faiss(index, np.arange(50) // 2, 25, device="cpu").rows.data_ptr() == view.data_ptr()


class FakeFaissIndex:
    """Wraps a CPU index, records the k of every search."""

    def __init__(self, inner):
        self.inner, self.ks, self.ntotal, self.d = inner, [], inner.ntotal, inner.d

    def search(self, q, k):
        self.ks.append(k)
        assert k <= 2048, f"FAISS-GPU refuses k = {k}"  # faiss/gpu/utils/DeviceDefs.cuh: GPU_MAX_SELECTION_K
        return self.inner.search(q, k)


def on_a_gpu(index):
    """``index`` as load() leaves it on a GPU: FAISS's copy there (here a CPU index that refuses k > 2048, recording
    every k) and the memory-mapped CPU copy beside it."""
    index._faiss_cpu = index.faiss
    index.faiss, index.search_device = FakeFaissIndex(index.faiss), "cuda:0"
    return index


def test_search_on_a_gpu_index_never_asks_for_more_than_2048_rows():
    counts = [3000] + [1] * 300
    index, rows, ents = make(counts, seed=2, rank_method="search")
    on_a_gpu(index)
    rng = np.random.default_rng(0)
    v, t = rng.normal(size=(5, 6)).astype(np.float32), rng.normal(size=(5, 10)).astype(np.float32)
    ranks = index.entity_ranks(v, t, ["ent00001"] * 5, alpha=0.5, depth=200)
    assert max(index.faiss.ks) == FAISS_GPU_MAX_K and len(ranks) == 5


def test_an_index_given_on_a_gpu_is_copied_back_once_and_kept(monkeypatch):
    """Built without ``load`` (no memory-mapped CPU copy beside it), a GPU index was copied back to the CPU at every
    ``uses_exact_ranks`` / ``is_approximate`` (every reward call), and the exact ranker's zero-copy view on the CPU
    pointed into a copy nobody kept."""
    from common.faiss_lib import faiss

    index, rows, ents = make([1, 2, 3] * 20)
    copies = []
    monkeypatch.setattr(
        faiss, "index_gpu_to_cpu", lambda gpu: copies.append(faiss.clone_index(gpu.inner)) or copies[-1], raising=False
    )
    index.faiss, index.search_device = FakeFaissIndex(index.faiss), "cuda:0"
    assert index.uses_exact_ranks and not index.is_approximate and len(copies) == 1
    q = queries(6, seed=2)
    gold = list(range(6))
    assert index.exact.ranks(q, gold) == ExactRanker(torch.from_numpy(rows), index.row_entity, 60).ranks(q, gold)
    assert len(copies) == 1 and index._cpu_faiss() is copies[0]  # the one the exact ranker's view reads


def test_ranks_past_the_gpu_k_cap_come_from_the_cpu_copy():
    """20 rows per entity: 200 entities need ~4,000 rows, past FAISS-GPU's 2048. The queries that hit the cap are
    searched again on the CPU copy, so every rank within depth is the exact one (at the cap, about half of them came
    back as misses)."""
    rng = np.random.default_rng(4)
    ents = [f"ent{e:05d}" for e in range(300) for _ in range(20)]
    centre = rng.normal(size=(300, 16))  # an entity's 20 rows lie close together: the top rows bunch by entity
    rows = np.concatenate([l2_normalize(centre[:, :6]), l2_normalize(centre[:, 6:])], 1).repeat(20, axis=0)
    rows = (rows + 0.05 * rng.normal(size=rows.shape)).astype(np.float32)
    manifest = {"image_dim": 6, "text_dim": 10, "image_encoder": "x", "text_encoder": "y"}
    ids = [f"row{i}" for i in range(len(rows))]
    index = MultimodalIndex(build_faiss_index(rows, "Flat"), ids, ents, manifest, device="cpu", rank_method="search")
    on_a_gpu(index)
    q = queries(40, seed=9)
    gold = [ents[int(i)] for i in np.random.default_rng(3).integers(0, len(ents), 40)]
    got = index.entity_ranks(q[:, :6], q[:, 6:], gold, alpha=0.4, depth=200)
    exact = [r if r <= 200 else None for r in index.reference_ranks(q[:, :6], q[:, 6:], gold, alpha=0.4)]
    assert got == exact and max(index.faiss.ks) == FAISS_GPU_MAX_K
    assert sum(r is not None and r > 100 for r in exact) >= 5  # ranks deep enough to need more than 2048 rows


def test_placement_puts_one_replica_on_this_ranks_gpu(monkeypatch, caplog):
    from common.faiss_lib import faiss

    calls = []
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 8, raising=False)
    monkeypatch.setattr(faiss, "StandardGpuResources", lambda: "res", raising=False)
    monkeypatch.setattr(faiss, "GpuClonerOptions", lambda: type("O", (), {})(), raising=False)
    monkeypatch.setattr(
        faiss,
        "index_cpu_to_gpu",
        lambda res, dev, idx, co: calls.append((dev, co.useFloat16)) or "gpu-index",
        raising=False,
    )
    monkeypatch.setattr(faiss, "index_cpu_to_all_gpus", lambda *a, **k: pytest.fail("all GPUs"), raising=False)
    flat = build_faiss_index(np.eye(4, dtype=np.float32), "Flat")
    assert placement.index_to_device(flat, "cuda:3") == ("gpu-index", "cuda:3") and calls == [(3, True)]
    assert placement.index_to_device(flat, "cpu") == (flat, "cpu")
    hnsw = build_faiss_index(np.eye(4, dtype=np.float32), "HNSW4,Flat")
    with caplog.at_level(logging.WARNING, logger="refine_rl.placement"):
        assert placement.index_to_device(hnsw, "cuda:3") == (hnsw, "cpu")
    assert "cannot live on a GPU" in caplog.text and len(calls) == 1


def copy_fails(*a):
    raise RuntimeError(
        "Error in void faiss::gpu::allocMemory\nat faiss/gpu/utils/DeviceUtils.cu:71\n\ncudaMalloc: out of memory\n"
    )


@pytest.mark.parametrize(
    "gpus,copy,said",
    [
        (None, None, "this FAISS build has no GPU support"),  # faiss-cpu: no index_cpu_to_gpu at all
        (0, lambda *a: pytest.fail("copied"), "this FAISS build has no GPU support"),
        (1, copy_fails, "IndexFlat cannot be copied to cuda:0 (cudaMalloc: out of memory); it stays on the CPU"),
    ],
)
def test_an_index_that_cannot_go_to_the_gpu_stays_on_the_cpu_saying_why(monkeypatch, caplog, gpus, copy, said):
    from common.faiss_lib import faiss

    if gpus is None:
        monkeypatch.delattr(faiss, "index_cpu_to_gpu", raising=False)
    else:
        monkeypatch.setattr(faiss, "get_num_gpus", lambda: gpus, raising=False)
        monkeypatch.setattr(faiss, "index_cpu_to_gpu", copy, raising=False)
        monkeypatch.setattr(faiss, "StandardGpuResources", lambda: "res", raising=False)
        monkeypatch.setattr(faiss, "GpuClonerOptions", lambda: SimpleNamespace(), raising=False)
    flat = build_faiss_index(np.eye(4, dtype=np.float32), "Flat")
    with caplog.at_level(logging.WARNING, logger="refine_rl.placement"):
        assert placement.index_to_device(flat, "cuda:0") == (flat, "cpu")
    assert said in caplog.text


@pytest.mark.parametrize("device", ["cuda:abc", "cuda:", "cuda:-1", "cuda:0:1", "cuda:1.5", "cpufoo", "tpu"])
def test_a_malformed_device_is_named(device):
    with pytest.raises(
        ValueError, match=f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got '{re.escape(device)}'"
    ):
        placement.resolve_device(device)


@pytest.mark.parametrize(
    "env,cuda,expected,bare_cuda",
    [
        ({"LOCAL_RANK": "5"}, 8, "cuda:5", "cuda:5"),
        ({}, 8, "cuda:0", "cuda:0"),
        ({"LOCAL_RANK": "3"}, 0, "cpu", "cuda:0"),
        ({"LOCAL_RANK": "3"}, 1, "cuda:0", "cuda:0"),  # a task that sees only its own GPU (SLURM --gpus-per-task=1)
    ],
)
def test_process_device_is_this_ranks_gpu(monkeypatch, env, cuda, expected, bare_cuda):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda)
    assert placement.process_device() == expected
    assert placement.resolve_device("cuda") == bare_cuda
    with pytest.raises(ValueError, match="device must be"):
        placement.resolve_device("gpu")


@pytest.mark.parametrize(
    "device,expected",
    [
        (None, "cpu"),
        ("auto", "cpu"),
        (torch.device("cpu"), "cpu"),
        ("cpu:0", "cpu"),
        (torch.device("cuda", 2), "cuda:2"),
    ],
)
def test_a_device_is_resolved_from_none_auto_or_a_torch_device(monkeypatch, device, expected):
    """accelerate's state hands a torch.device; None and auto are this process's own (here without CUDA)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert placement.resolve_device(device) == expected


@pytest.mark.parametrize(
    "requested,processes,device,expected",
    [
        (None, 1, "cuda", "cuda:0"),  # accelerate's one-process device is a bare "cuda"
        (None, 8, "cuda:5", "cuda:5"),
        ("cuda:1", 1, "cuda", "cuda:1"),  # --device as given, not the state's
        ("cpu", 8, "cuda:5", "cpu"),
        ("auto", 2, "cpu", "cpu"),
    ],
)
def test_a_jobs_device_is_the_flag_else_its_processs_own(monkeypatch, requested, processes, device, expected):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    state = SimpleNamespace(num_processes=processes, device=device)
    assert placement.job_device(requested, state) == expected


def test_one_gpu_named_for_several_processes_is_refused():
    with pytest.raises(ValueError, match="--device cuda:1 with 2 processes would put every process on one GPU"):
        placement.job_device("cuda:1", SimpleNamespace(num_processes=2, device="cuda:0"))
    assert placement.job_device("cuda:1", None) == "cuda:1"  # one process, no launcher


@pytest.mark.parametrize("cores,procs,threads", [(2, 1, 2), (2, 2, 1), (192, 8, 24), (4, 8, 1)])
def test_threads_per_process(cores, procs, threads):
    assert placement.threads_per_process(cores, procs) == threads


@pytest.mark.parametrize("env,processes", [(None, 1), ("4", 4), ("0", 1)])
def test_threads_default_to_usable_cores_over_the_nodes_processes(monkeypatch, env, processes):
    import os

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    if env is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", env)
    assert placement.local_world_size() == processes
    assert placement.threads_per_process() == max(1, len(os.sched_getaffinity(0)) // processes)
    assert placement.threads_per_process(16) == 16 // processes
    assert placement.decode_workers(None) == placement.threads_per_process()


@pytest.mark.parametrize("cpu_count,cores", [(6, 6), (None, 1)])
def test_usable_cores_without_an_affinity_call_are_the_cpu_count(monkeypatch, cpu_count, cores):
    import os

    monkeypatch.delattr(os, "sched_getaffinity")  # not Linux
    monkeypatch.setattr(os, "cpu_count", lambda: cpu_count)
    assert placement.usable_cores() == cores


@pytest.mark.parametrize("setting", [0, 3])
def test_decode_workers_as_set(setting):
    assert placement.decode_workers(setting) == setting  # 0: decoded in the process itself


def test_configure_threads_sets_faiss_and_torch_alike():
    from common.faiss_lib import faiss

    before = torch.get_num_threads()
    try:
        assert placement.configure_threads(1) == 1 and torch.get_num_threads() == 1
        assert faiss.omp_get_max_threads() == 1
        n = placement.configure_threads()
        assert n == placement.threads_per_process() and torch.get_num_threads() == n
    finally:
        placement.configure_threads(before)


@pytest.mark.parametrize("device,ordinal", [("cuda:3", 3), ("cuda:0", 0), ("cpu", None)])
def test_gpu_ordinal(device, ordinal):
    assert placement.gpu_ordinal(device) == ordinal


@pytest.mark.parametrize(
    "name,device,dtype",
    [
        (None, "cpu", torch.float32),
        ("auto", "cpu", torch.float32),
        (None, "cuda:1", torch.bfloat16),
        ("auto", "cuda", torch.bfloat16),
        ("bf16", "cpu", torch.bfloat16),
        ("fp16", "cpu", torch.float16),
        ("float32", "cuda:0", torch.float32),
    ],
)
def test_resolve_dtype(name, device, dtype):
    assert placement.resolve_dtype(name, device) == dtype
    assert placement.dtype_name(dtype) == str(dtype).removeprefix("torch.")


def test_dtype_names_and_a_bad_one():
    assert [placement.dtype_name(d) for d in (torch.bfloat16, torch.float16)] == ["bfloat16", "float16"]
    with pytest.raises(ValueError, match="dtype must be one of auto, bfloat16, bf16, .*got 'half'"):
        placement.resolve_dtype("half")


class WaitingState:
    """An accelerate state whose ``wait_for_everyone`` raises ``error`` (None: returns), counting its calls."""

    def __init__(self, rank=1, count=2, error=None):
        self.process_index, self.num_processes, self.error, self.waits = rank, count, error, 0

    def wait_for_everyone(self):
        self.waits += 1
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize("state,waits", [(None, 0), (WaitingState(0, 1), 0), (WaitingState(1, 2), 1)])
def test_a_barrier_waits_only_with_other_processes(state, waits):
    processes = placement.Processes(state)
    processes.barrier("x")
    assert (processes.rank, processes.count) == ((state.process_index, state.num_processes) if state else (0, 1))
    assert (state.waits if state else 0) == waits


@pytest.mark.parametrize("said", ["[gloo] Timeout waiting for key", "Wait timed out after 600000 ms"])
def test_a_barrier_past_its_timeout_names_the_step_awaited(said):
    state = WaitingState(1, 2, RuntimeError(said))
    with pytest.raises(
        TimeoutError, match=rf"^process 1/2: .* at the barrier after the merge within .*: {re.escape(said)}$"
    ):
        placement.Processes(state).barrier("the merge")


def test_another_barrier_failure_is_raised_as_it_is():
    error = RuntimeError("Connection reset by peer")
    with pytest.raises(RuntimeError) as raised:
        placement.Processes(WaitingState(1, 2, error)).barrier("the merge")
    assert raised.value is error


def no_distributed():
    raise AttributeError("torch built without distributed support has no is_initialized")


@pytest.mark.parametrize(
    "count,available,initialized",
    [(1, True, lambda: False), (1, True, lambda: True), (2, True, lambda: False), (2, False, no_distributed)],
)
def test_without_a_process_group_a_process_raises_its_own_error_or_nothing(monkeypatch, count, available, initialized):
    """One process, or several without a process group: nothing is broadcast, an error is raised where it is."""
    import accelerate.utils
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_available", lambda: available)
    monkeypatch.setattr(dist, "is_initialized", initialized)
    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", lambda *a, **k: pytest.fail("broadcast"))
    error = FileNotFoundError("kb.jsonl")
    for processes in (placement.Processes(), placement.Processes(WaitingState(0, count))):
        processes.raise_everywhere(None)
        with pytest.raises(FileNotFoundError) as raised:
            processes.raise_everywhere(error)
        assert raised.value is error


@pytest.mark.parametrize("only", [{0}, None])
def test_usable_cores_are_this_processs_affinity(only):
    """A process pinned to some cores (taskset, a scheduler's cgroup) uses those, not the machine's."""
    import os

    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, only or before)
        assert placement.usable_cores() == len(only or before)
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.parametrize(
    "said,kind",
    [
        (("FileNotFoundError", "no kb.jsonl"), FileNotFoundError),
        (("ValueError", "no kb.jsonl"), ValueError),
        (("TimeoutError", "no kb.jsonl"), TimeoutError),
        (("KeyError", "no kb.jsonl"), RuntimeError),
    ],
)
def test_process_0s_error_is_raised_on_the_others_as_its_kind(monkeypatch, said, kind):
    """Several processes in a process group: what process 0 broadcast (here a stand-in for the broadcast) is raised
    on process 1 with process 0's kind, when it is one a caller tells apart, else as a RuntimeError; process 0
    raises its own error; nothing broadcast, nothing raised."""
    import accelerate.utils
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    sent = []
    monkeypatch.setattr(
        accelerate.utils,
        "broadcast_object_list",
        lambda objects, from_process: sent.append((objects, from_process)) or [said],
    )
    with pytest.raises(kind, match=r"^process 0: no kb\.jsonl$") as raised:
        placement.Processes(WaitingState(1, 2)).raise_everywhere(None)
    assert type(raised.value) is kind and sent == [([None], 0)]
    own = KeyError("k")
    with pytest.raises(KeyError) as raised:
        placement.Processes(WaitingState(0, 2)).raise_everywhere(own)
    assert raised.value is own and sent[-1] == ([("KeyError", "'k'")], 0)
    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", lambda objects, from_process: [None])
    placement.Processes(WaitingState(1, 2)).raise_everywhere(None)  # process 0 succeeded


class ZeRO3Config:
    """What accelerate registers with transformers under ``zero3_init_flag: true``, reduced to what transformers reads
    (no batch sizes: DeepSpeed's partitioned init, when installed, refuses it; without DeepSpeed, the import fails)."""

    config = {"zero_optimization": {"stage": 3}}

    def is_zero3(self):
        return True


def test_encoders_load_outside_zero3_partitioned_init():
    """With a ZeRO-3 config registered, from_pretrained partitions the encoder (with this stand-in config it fails
    trying); inside outside_zero3_init it loads whole, and the registration is back afterwards. The real ZeRO-3 runs
    (tests/test_deepspeed.py) check the encoders whole on every rank."""
    from transformers.integrations.deepspeed import (
        is_deepspeed_zero3_enabled,
        set_hf_deepspeed_config,
        unset_hf_deepspeed_config,
    )

    from retrieval.encoders import text_encoder

    text_encoder("tiny", device="cpu")  # build the tiny model's folder first, outside the ZeRO-3 registration
    cfg = ZeRO3Config()
    set_hf_deepspeed_config(cfg)
    try:
        assert is_deepspeed_zero3_enabled()
        with pytest.raises(Exception, match="deepspeed|train_batch_size or train_micro_batch_size"):
            text_encoder("tiny", device="cpu")
        with placement.outside_zero3_init():
            assert not is_deepspeed_zero3_enabled()
            enc = text_encoder("tiny", device="cpu")
        assert is_deepspeed_zero3_enabled()
    finally:
        unset_hf_deepspeed_config()
    assert all(p.numel() > 0 for p in enc.model.parameters())
    assert enc.encode(["a query"]).shape == (1, enc.dim)


def test_entities_that_share_an_image_share_a_rank_whichever_path_ranks_them():
    """Three entities with the same image and α = 1 (only the image counts): each one's rank is 1 + the entities
    strictly better, on FAISS's search path as on the exact ranker, though FAISS orders the tie arbitrarily."""
    rng = np.random.default_rng(0)
    v = l2_normalize(rng.normal(size=(6, 6)))
    v[1] = v[2] = v[0]  # entities 0, 1, 2 share one image
    t = l2_normalize(rng.normal(size=(6, 10)))
    manifest = {"image_dim": 6, "text_dim": 10, "image_encoder": "x", "text_encoder": "y"}
    ents = [f"e{i}" for i in range(6)]
    rows = build_faiss_index(np.concatenate([v, t], 1).astype(np.float32), "Flat")
    by = {
        method: MultimodalIndex(rows, [f"r{i}" for i in range(6)], ents, manifest, device="cpu", rank_method=method)
        for method in ("search", "exact")
    }
    query = v[:1] + 0.01 * l2_normalize(rng.normal(size=(1, 6)))  # nearest to the shared image
    for method, index in by.items():
        ranks = [index.entity_ranks(query, t[:1], [e], alpha=1.0, depth=6)[0] for e in ents[:3]]
        assert ranks == [1, 1, 1], method


def test_a_search_that_an_approximate_index_cannot_deepen_stops():
    """IVF with nprobe 1 returns far fewer rows than asked: the growing depth stops there (it used to quadruple k up
    to every row of the index, with the same rows back each time) and ranks what it got."""
    index, rows, ents = make([1] * 3000, factory="IVF64,Flat", rank_method="search")
    index.faiss.nprobe = 1
    asked, search = [], index.faiss.search

    def recording(q, k):
        asked.append(k)
        return search(q, k)

    index.faiss.search = recording
    q = queries(5, seed=7)
    ranked = index.rank(q[:, :6], q[:, 6:], alpha=0.4, depth=200)
    assert asked == [200]  # one entity per row: 200 rows asked, < 200 came back, nothing more to ask
    assert all(0 < len(rk.entities) < 200 for rk in ranked)


def index_dir(path, index, entity_ids):
    """``index`` (from ``make``) written as an index directory: index.faiss, rows.parquet, manifest.json."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from common.faiss_lib import faiss

    faiss.write_index(index.faiss, str(path / "index.faiss"))
    titles = [f"Title of {e}" for e in entity_ids]
    pq.write_table(
        pa.table({"entry_id": index.entry_ids, "entity_id": entity_ids, "title": titles}), path / "rows.parquet"
    )
    (path / "manifest.json").write_text(json.dumps(index.manifest))
    return path


@pytest.mark.parametrize("nprobe,expected", [(2, 2), (32, 16), (1000, 16)])
def test_load_sets_an_ivf_indexs_nprobe_up_to_its_lists(tmp_path, nprobe, expected):
    from common.faiss_lib import faiss

    index, rows, ents = make([2] * 200, factory="IVF16,Flat", rank_method="search")
    loaded = MultimodalIndex.load(str(index_dir(tmp_path, index, ents)), device="cpu", nprobe=nprobe)  # a str path
    assert faiss.extract_index_ivf(loaded.faiss).nprobe == expected and loaded.ef_search is None
    assert loaded.entity_titles == {e: f"Title of {e}" for e in ents} and loaded.num_entities == 200
    # the manifest's encoder names ("x", "y"), or a text encoder object encoding queries as the manifest says
    text = SimpleNamespace(name="y", query_prompt=None, max_seq_length=128)
    assert MultimodalIndex.load(tmp_path, image_encoder="x", text_encoder=text).text_encoder is text
    named = MultimodalIndex.load(tmp_path, image_encoder="x", text_encoder="y")
    assert named._image_encoder is None and named._text_encoder is None  # built from the names on first use


def test_load_refuses_a_folder_without_a_manifest_and_rows_that_are_not_the_indexs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    index, rows, ents = make([1, 2, 3])
    with pytest.raises(FileNotFoundError, match="is not a finished index directory: .*manifest.json is missing"):
        MultimodalIndex.load(tmp_path)
    index_dir(tmp_path, index, ents)
    pq.write_table(pa.table({"entry_id": index.entry_ids[:5], "entity_id": ents[:5]}), tmp_path / "rows.parquet")
    with pytest.raises(ValueError, match="rows.parquet has 5 rows but the FAISS index has 6; rebuild the index"):
        MultimodalIndex.load(tmp_path, device="cpu")


def test_hnsw_searches_as_deep_as_the_rows_it_is_asked_for(tmp_path):
    """FAISS's HNSW explores about efSearch candidates (16 unless set); a loaded index raises it to the rows each
    search asks for, so its depth-200 ranks of a 20-rows-per-entity index agree with the exact ones (at FAISS's 16,
    11 of these 40 did)."""
    index, rows, ents = make([20] * 300, factory="HNSW16,Flat", rank_method="search")
    loaded = MultimodalIndex.load(index_dir(tmp_path, index, ents), device="cpu", rank_method="search")
    q = queries(40, seed=9)
    gold = [ents[int(i)] for i in np.random.default_rng(3).integers(0, len(ents), 40)]
    got = loaded.entity_ranks(q[:, :6], q[:, 6:], gold, alpha=0.4, depth=200)
    exact = [r if r <= 200 else None for r in loaded.reference_ranks(q[:, :6], q[:, 6:], gold, alpha=0.4)]
    assert sum(a == b for a, b in zip(got, exact)) >= 38
