"""Ranking math of MultimodalIndex against a direct numpy computation of α·cos_image + (1−α)·cos_text."""

import re
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.encoders import l2_normalize
from retrieval.faiss_build import build_faiss_index
from retrieval.index import MultimodalIndex, require_index
from retrieval.ranking import check_alpha, check_k, query_vectors


def make_index(n_entities, rows_per_entity, di=8, dt=12, seed=0):
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, rows_per_entity + 1, size=n_entities)
    entity_ids = [f"ent{e}" for e, c in enumerate(counts) for _ in range(c)]
    v = l2_normalize(rng.normal(size=(len(entity_ids), di)))
    t = l2_normalize(rng.normal(size=(len(entity_ids), dt)))
    index = build_faiss_index(np.concatenate([v, t], 1), "Flat")
    manifest = {"image_dim": di, "text_dim": dt, "image_encoder": "x", "text_encoder": "y"}
    entry_ids = [f"row{i}" for i in range(len(entity_ids))]
    return MultimodalIndex(index, entry_ids, entity_ids, manifest), v, t, entity_ids


def numpy_entity_scores(v, t, entity_ids, qv, qt, alpha):
    """Best α·cos_i + (1−α)·cos_t per entity, for one query."""
    s = alpha * (v @ l2_normalize(qv)) + (1 - alpha) * (t @ l2_normalize(qt))
    best = {}
    for e, x in zip(entity_ids, s):
        best[e] = max(best.get(e, -np.inf), float(x))
    return best


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 0.63, 1.0])
@pytest.mark.parametrize("rows_per_entity", [1, 3, 40])
def test_search_matches_numpy(alpha, rows_per_entity):
    idx, v, t, ents = make_index(60, rows_per_entity, seed=rows_per_entity)
    rng = np.random.default_rng(1)
    qv, qt = rng.normal(size=(5, 8)), rng.normal(size=(5, 12))
    hits = idx.search(qv.astype(np.float32), qt.astype(np.float32), alpha=alpha, k=25)
    for q in range(5):
        best = numpy_entity_scores(v, t, ents, qv[q], qt[q], alpha)
        expected = sorted(best.values(), reverse=True)[:25]
        got = [h.score for h in hits[q]]
        assert len({h.entity_id for h in hits[q]}) == len(hits[q]) == 25  # one hit per entity
        np.testing.assert_allclose(got, expected, atol=1e-5)  # same score profile, ties allowed
        for h in hits[q]:  # each hit's score is its entity's best row, and the row belongs to the entity
            assert abs(h.score - best[h.entity_id]) < 1e-5
            assert ents[int(h.entry_id[3:])] == h.entity_id
        assert got == sorted(got, reverse=True)


@settings(max_examples=40, deadline=None)
@given(alpha=st.floats(0, 1), seed=st.integers(0, 10_000), depth=st.integers(1, 30))
def test_entity_ranks_property(alpha, seed, depth):
    idx, v, t, ents = make_index(25, 6, seed=seed % 7)
    rng = np.random.default_rng(seed)
    qv, qt = rng.normal(size=(3, 8)).astype(np.float32), rng.normal(size=(3, 12)).astype(np.float32)
    gold = [f"ent{rng.integers(25)}" for _ in range(3)]
    ranks = idx.entity_ranks(qv, qt, gold, alpha=alpha, depth=depth)
    for q in range(3):
        best = numpy_entity_scores(v, t, ents, qv[q], qt[q], alpha)
        g = best[gold[q]]
        better = sum(1 for s in best.values() if s > g + 1e-5)
        tied_or_better = sum(1 for s in best.values() if s >= g - 1e-5)
        if ranks[q] is None:
            assert better + 1 > depth or tied_or_better > depth
        else:
            assert better + 1 <= ranks[q] <= tied_or_better
            assert ranks[q] <= depth


@pytest.mark.parametrize("k,depth", [(5, 200), (25, 10), (3, 3)])
def test_search_and_rank_equals_search_and_entity_ranks(k, depth):
    idx, *_ = make_index(60, 3, seed=4)
    rng = np.random.default_rng(5)
    qv, qt = rng.normal(size=(6, 8)).astype(np.float32), rng.normal(size=(6, 12)).astype(np.float32)
    gold = [f"ent{i * 9}" for i in range(6)]
    hits, ranks = idx.search_and_rank(qv, qt, gold, alpha=0.4, k=k, depth=depth)
    alone = idx.search(qv, qt, alpha=0.4, k=k)
    for h, a in zip(hits, alone):
        np.testing.assert_allclose([x.score for x in h], [x.score for x in a], atol=1e-6)
        assert len(h) == k
    assert ranks == idx.entity_ranks(qv, qt, gold, alpha=0.4, depth=depth)


def test_rank_beyond_depth_is_none_and_unknown_entity_is_none():
    idx, *_ = make_index(50, 2)
    rng = np.random.default_rng(3)
    qv, qt = rng.normal(size=(1, 8)).astype(np.float32), rng.normal(size=(1, 12)).astype(np.float32)
    order = [h.entity_id for h in idx.search(qv, qt, alpha=0.5, k=50)[0]]
    assert idx.entity_ranks(qv, qt, [order[-1]], alpha=0.5, depth=10) == [None]
    assert idx.entity_ranks(qv, qt, [order[3]], alpha=0.5, depth=10) == [4]
    assert idx.entity_ranks(qv, qt, ["not-an-entity"], alpha=0.5, depth=10) == [None]
    three = np.repeat(qv, 3, 0), np.repeat(qt, 3, 0)  # k deeper than depth: ranks past depth are still misses
    hits, ranks = idx.search_and_rank(*three, [order[14], order[3], "not-an-entity"], alpha=0.5, k=20, depth=10)
    assert ranks == [None, 4, None] and [h.entity_id for h in hits[0]] == order[:20]
    assert idx.has_entity(order[0]) and not idx.has_entity("not-an-entity")
    for method in ("search", "exact"):  # every entity is within depth 200: only an unknown one can be None
        idx.rank_method = method
        ranks = idx.entity_ranks(*three, [order[0], order[49], "not-an-entity"], alpha=0.5, depth=200)
        assert ranks == [1, 50, None], method
        for bad in [dict(alpha=1.5, depth=10), dict(alpha=0.5, depth=0)]:
            with pytest.raises(ValueError, match="alpha must be in|depth must be a positive integer"):
                idx.entity_ranks(*three, order[:3], **bad)


@pytest.mark.parametrize("layout,flag", [("finished", "index"), ("no manifest", "index"), ("none", "retriever"),
                                         ("empty", "index"), ("file", "index")])  # fmt: skip
def test_require_index_names_the_flag_of_a_folder_that_is_no_finished_index(tmp_path, layout, flag):
    folder = tmp_path / "idx"
    if layout in ("finished", "no manifest"):
        folder.mkdir()
    if layout == "finished":
        (folder / "manifest.json").write_text('{"rows": 3}')
    if layout == "file":
        folder.write_text("not a folder")
    value = {"none": None, "empty": ""}.get(layout, str(folder))
    if layout == "finished":
        assert require_index(value, flag) == {"rows": 3}
        return
    with pytest.raises(ValueError, match=f"^--{flag}: {re.escape(repr(value))} is not a finished index directory"):
        require_index(value, flag)


def test_the_encoders_given_encode_queries_and_documents():
    """Encoders handed to the index are the ones it encodes with (none is built from the manifest's names, here
    "x" and "y", which name no model); queries carry the instruction, documents never (``is_query``)."""
    idx, v, t, ents = make_index(5, 2)
    calls = []
    text = SimpleNamespace(encode=lambda texts, is_query: calls.append((texts, is_query)) or t[: len(texts)])
    image = SimpleNamespace(encode=lambda images: calls.append((images, "image")) or v[: len(images)])
    given = MultimodalIndex(idx.faiss, idx.entry_ids, ents, idx.manifest, image_encoder=image, text_encoder=text)
    np.testing.assert_array_equal(given.encode_texts(("q",)), t[:1])
    np.testing.assert_array_equal(given.encode_documents(["d1", "d2"]), t[:2])
    np.testing.assert_array_equal(given.encode_images(iter(["pic"])), v[:1])
    assert calls == [(["q"], True), (["d1", "d2"], False), (["pic"], "image")]
    hits = given.search(["pic"], ["q"], alpha=0.5, k=1)  # images and texts given as such are encoded first
    assert hits == idx.search(v[:1], t[:1], alpha=0.5, k=1)


def test_query_vector_is_normalised_and_weighted():
    rng = np.random.default_rng(0)
    v, t = rng.normal(size=(4, 8)), rng.normal(size=(4, 12))
    q, norms = query_vectors(v, t, 0.25)
    np.testing.assert_allclose(np.linalg.norm(q, axis=1), 1.0, atol=1e-6)
    ratio = np.linalg.norm(q[:, :8], axis=1) / np.linalg.norm(q[:, 8:], axis=1)
    np.testing.assert_allclose(ratio, 0.25 / 0.75, rtol=1e-5)


@pytest.mark.parametrize("bad", [-0.1, 1.01, float("nan"), "0.5", None, True, False])  # YAML's alpha: true was α 1
def test_alpha_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match=f"alpha must be in \\[0, 1\\], got {bad!r}"):
        check_alpha(bad)
    with pytest.raises(ValueError, match="alpha must be in"):
        query_vectors(np.ones((1, 8)), np.ones((1, 12)), bad)


@pytest.mark.parametrize("good,expected", [(0, 0.0), (1, 1.0), (0.3, 0.3)])
def test_alpha_in_range_is_a_float(good, expected):
    assert check_alpha(good) == expected and type(check_alpha(good)) is float


@pytest.mark.parametrize("bad", [0, -1, 2.5, 3.0, True, "3", None])
def test_a_k_that_is_not_a_positive_integer_is_refused(bad):
    with pytest.raises(ValueError, match=f"depth must be a positive integer, got {re.escape(repr(bad))}"):
        check_k(bad, "depth")


@pytest.mark.parametrize("good", [1, 200, np.int64(7)])
def test_a_positive_integer_k_is_an_int(good):
    assert check_k(good) == int(good) and type(check_k(good)) is int


def test_bad_k_and_shapes_are_refused():
    idx, *_ = make_index(10, 2)
    qv, qt = np.ones((1, 8), np.float32), np.ones((1, 12), np.float32)
    with pytest.raises(ValueError, match="k must be a positive integer"):
        idx.search(qv, qt, alpha=0.5, k=0)
    with pytest.raises(ValueError, match=r"shape \(n, 8\)"):
        idx.search(np.ones((1, 5), np.float32), qt, alpha=0.5, k=3)
    for bad_v, bad_t, said in [
        (np.ones((1, 8, 2), np.float32), qt, r"image embeddings must have shape \(n, 8\), got \(1, 8, 2\)"),
        (qv, np.ones((1, 12, 2), np.float32), r"text embeddings must have shape \(n, 12\), got \(1, 12, 2\)"),
        (qv, np.ones((1, 5), np.float32), r"text embeddings must have shape \(n, 12\), got \(1, 5\)"),
        (qv, np.ones((2, 12), np.float32), "got 1 images but 2 texts"),
    ]:
        with pytest.raises(ValueError, match=said):
            idx.search(bad_v, bad_t, alpha=0.5, k=3)
    for call, said in [
        (lambda: idx.rank(qv, qt, alpha=0.5, depth=0), "depth must be a positive integer"),
        (lambda: idx.search_and_rank(qv, qt, ["ent0"], alpha=0.5, k=0), "k must be a positive integer"),
        (lambda: idx.search_and_rank(qv, qt, ["ent0"], alpha=0.5, k=3, depth=0), "depth must be a positive integer"),
        (lambda: idx.search_and_rank(qv, qt, ["ent0"], alpha=2, k=3), "alpha must be in"),
        (lambda: idx.top_entities(qv, qt, alpha=0.5, k=0), "k must be a positive integer"),
        (lambda: idx.top_entities(qv, qt, alpha=-1, k=3), "alpha must be in"),
        (lambda: idx.entity_ranks(qv, qt, ["ent0"], alpha=0.5, depth=-2), "depth must be a positive integer"),
    ]:
        with pytest.raises(ValueError, match=said):
            call()


@pytest.mark.parametrize("method", ["exact", "search"])
def test_top_entities_are_the_best_k_entities_on_either_path(method):
    """Where ranks are exact (a GPU), the top entities come from the exact ranker's per-entity scores; else from
    FAISS's search: either way the k entities with the best rows, best first (numpy here)."""
    idx, v, t, ents = make_index(40, 3, seed=6)
    idx.rank_method = method
    assert idx.uses_exact_ranks == (method == "exact")
    if method == "exact":  # the exact ranker's scores: FAISS (memory-mapped on the CPU in training) is not searched
        idx.faiss.search = lambda *a: pytest.fail("FAISS searched where ranks are exact")
    with pytest.raises(ValueError, match="k must be a positive integer"):
        idx.top_entities(np.ones((1, 8)), np.ones((1, 12)), alpha=0.3, k=0)
    rng = np.random.default_rng(7)
    qv, qt = rng.normal(size=(4, 8)).astype(np.float32), rng.normal(size=(4, 12)).astype(np.float32)
    for k in (1, 5, 60):  # 60: more than the 40 entities there are
        top = idx.top_entities(qv, qt, alpha=0.3, k=k)
        for i, got in enumerate(top):
            best = numpy_entity_scores(v, t, ents, qv[i], qt[i], 0.3)
            assert got == sorted(best, key=best.get, reverse=True)[:k]


def test_a_trained_factory_learns_from_rows_across_the_whole_kb(monkeypatch):
    """Four clusters of rows, one after another as a KB groups its articles; IVF4 trained on at most 400 of the 4,000
    rows has a centroid near every cluster (trained on the first 400, all four sat in the first cluster)."""
    from retrieval.faiss_build import build_faiss_index_from_chunks

    rng = np.random.default_rng(0)
    centres = l2_normalize(rng.normal(size=(4, 16)))
    rows = np.concatenate([l2_normalize(c + 0.1 * rng.normal(size=(1000, 16))) for c in centres]).astype(np.float32)
    chunks = lambda: (rows[s : s + 300] for s in range(0, len(rows), 300))  # noqa: E731
    for total in (None, len(rows)):
        index = build_faiss_index_from_chunks(chunks, "IVF4,Flat", 16, max_train_rows=400, total_rows=total)
        learned = index.quantizer.reconstruct_n(0, 4)
        assert (centres @ l2_normalize(learned).T).max(axis=1).min() > 0.9  # each cluster has its centroid
        assert index.ntotal == len(rows)
    from common.faiss_lib import faiss

    trained, train = [], faiss.IndexIVFFlat.train
    monkeypatch.setattr(faiss.IndexIVFFlat, "train", lambda self, x: trained.append(x.copy()) or train(self, x))
    uneven = lambda: (rows[s : s + 333] for s in range(0, len(rows), 333))  # noqa: E731
    for most, sample in [(400, rows[::10]), (4000, rows), (5000, rows)]:  # every 10th, wherever the chunks cut
        build_faiss_index_from_chunks(uneven, "IVF4,Flat", 16, max_train_rows=most)
        np.testing.assert_array_equal(trained[-1], sample)
