"""The retrieval reward called exactly as TRL calls it: columns repeated per generation, plus **kwargs."""

import json
import math

import numpy as np
import pytest
from PIL import Image

from rewards import RetrievalReward, format_completion, rank_reward
from rewards.retrieval import batch_metrics

G = 4  # generations per prompt


def trl_call(reward, rows, completions, images, trainer_state=None, **extra):
    """Mimic GRPOTrainer._calculate_rewards: every column but prompt, repeated G times, plus TRL's extras."""
    rep = lambda xs: [x for x in xs for _ in range(G)]  # noqa: E731
    logged = {}
    out = reward(
        prompts=rep([[{"role": "user", "content": r["question"]}] for r in rows]),
        completions=[[{"role": "assistant", "content": c}] for c in completions],
        completion_ids=[[1, 2]] * len(completions),
        id=rep([r["id"] for r in rows]),
        entity_id=rep([r["entity_id"] for r in rows]),
        question=rep([r["question"] for r in rows]),
        answers=rep([r["answers"] for r in rows]),
        image=rep(images),
        trainer_state=trainer_state,
        log_extra=lambda *a: None,
        log_metric=lambda k, v: logged.setdefault(k, []).append(v),
        **extra,
    )
    return out, {k: float(np.mean(v)) for k, v in logged.items()}


@pytest.fixture()
def batch(tiny_world):
    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")][:3]
    images = [Image.open(tiny_world / r["image"]).convert("RGB") for r in rows]
    return rows, images


def test_rewards_match_direct_ranking(tiny_index, batch):
    rows, images = batch
    reward = RetrievalReward(tiny_index, alpha=0.5)
    queries = []
    for r in rows:
        a = r["attributes"]
        queries += [f"{r['question']} {a['colour']} {a['shape']} {a['pattern']}", r["question"], "nonsense words", None]
    completions = [format_completion(q) if q else "garbage" for q in queries]
    out, logged = trl_call(reward, rows, completions, images)
    assert len(out) == len(completions) and all(math.isfinite(x) for x in out)
    gold = [r["entity_id"] for r in rows for _ in range(G)]
    img = tiny_index.encode_images([im for im in images for _ in range(G)])
    for i, q in enumerate(queries):
        if q is None:
            assert out[i] == -2.5  # unparseable → the miss penalty on the retrieval side
        else:
            expected = tiny_index.entity_ranks(img[i : i + 1], [q], [gold[i]], alpha=0.5, depth=200)[0]
            assert out[i] == rank_reward(expected)
    assert logged["retrieval/parse_rate"] == pytest.approx(0.75)
    assert logged["retrieval/same_as_question"] == pytest.approx(0.25)
    assert {"retrieval/hit@1", "retrieval/hit@200", "retrieval/miss_rate", "retrieval/query_tokens"} <= set(logged)


def record_calls(monkeypatch, obj, name, note):
    """Wrap obj.name so that every call first passes its argument to ``note``."""
    real = getattr(obj, name)
    monkeypatch.setattr(obj, name, lambda x: note(x) or real(x))


def test_images_are_encoded_once_per_question(tiny_index, batch, monkeypatch):
    rows, images = batch
    reward = RetrievalReward(tiny_index, alpha=0.3)
    calls = []
    record_calls(monkeypatch, tiny_index, "encode_images", lambda ims: calls.append(len(ims)))
    completions = [format_completion("red star")] * (len(rows) * G)
    first, _ = trl_call(reward, rows, completions, images)
    second, _ = trl_call(reward, rows, completions, images)
    assert calls == [len(rows)]  # one batch, one image per question id, never re-encoded
    assert first == second


@pytest.mark.parametrize("method", ["exact", "search"])
def test_one_text_batch_and_one_ranking_pass_per_call(tiny_index, batch, monkeypatch, method):
    rows, images = batch
    monkeypatch.setattr(tiny_index, "rank_method", method)
    reward = RetrievalReward(tiny_index, alpha=0.3)
    texts, passes = [], []
    record_calls(monkeypatch, tiny_index, "encode_texts", lambda t: texts.append(len(t)))
    if method == "exact":  # a GPU's path: no FAISS search in the reward
        real = tiny_index.exact.ranks
        monkeypatch.setattr(tiny_index.exact, "ranks", lambda q, g: passes.append(len(q)) or real(q, g))
        monkeypatch.setattr(tiny_index.faiss, "search", lambda *a: pytest.fail("FAISS searched"), raising=False)
    else:  # a CPU's path (faster there): one FAISS search for every query of the call
        real_s = tiny_index.faiss.search
        monkeypatch.setattr(
            tiny_index,
            "faiss",
            type(
                "F",
                (),
                {
                    "search": lambda self, q, k: passes.append(len(q)) or real_s(q, k),
                    "ntotal": tiny_index.faiss.ntotal,
                    "d": tiny_index.faiss.d,
                },
            )(),
        )
    trl_call(reward, rows, [format_completion(f"q {i}") for i in range(len(rows) * G)], images)
    assert texts == [len(rows) * G] and passes == [len(rows) * G]


def test_image_cache_is_keyed_by_the_image_not_the_question_id(tiny_index, batch, tiny_world):
    """Two splits can both have a question 'q-0': the second must not reuse the first's image embedding."""
    rows, images = batch
    reward = RetrievalReward(tiny_index, alpha=1.0)  # α = 1: the rank depends on the image only
    clash = [dict(r, id="q-0") for r in rows[:2]]
    out_a, _ = trl_call(reward, clash[:1], [format_completion("x")] * G, images[:1])
    out_b, _ = trl_call(reward, clash[1:], [format_completion("x")] * G, images[1:2])
    fresh = RetrievalReward(tiny_index, alpha=1.0)
    alone, _ = trl_call(fresh, clash[1:], [format_completion("x")] * G, images[1:2])
    assert out_b == alone and len(reward.image_cache) == 2
    # with an image_path column, the path is the key; without one, equal pixels share a key
    paths = RetrievalReward(tiny_index, alpha=1.0)
    trl_call(paths, rows[:1], [format_completion("x")] * G, images[:1], image_path=[str(rows[0]["image"])] * G)
    assert list(paths.image_cache) == [f"path:{rows[0]['image']}"]
    assert len(set(reward.image_cache)) == 2 and all(k.startswith("pixels:") for k in reward.image_cache)


def test_two_palette_images_of_other_colours_get_other_keys():
    """A palette ("P") image's bytes are indices into its palette: red and blue squares of index 0 differ in the
    palette alone, so the key must read it (else one's cached embedding answers for the other); equal images share."""
    from PIL import Image

    from rewards.retrieval import image_keys

    def square(rgb):
        img = Image.new("P", (4, 4), 0)
        img.putpalette(list(rgb) + [0, 0, 0] * 255)
        return img

    red, blue, red_again = square((255, 0, 0)), square((0, 0, 255)), square((255, 0, 0))
    assert red.tobytes() == blue.tobytes() and red.convert("RGB").tobytes() != blue.convert("RGB").tobytes()
    keys = image_keys(None, [red, blue, red_again])
    assert keys[0] != keys[1] and keys[0] == keys[2]


def test_images_of_the_same_bytes_in_other_shapes_or_modes_get_other_keys():
    from rewards.retrieval import image_keys

    images = [Image.new("L", (2, 8), 7), Image.new("L", (4, 4), 7), Image.new("P", (4, 4), 7)]
    assert len({img.tobytes() for img in images}) == 1 and len(set(image_keys(None, images))) == 3


def test_an_image_path_column_keys_images_by_path_and_a_missing_image_is_named():
    """With ``image_path`` (rl.data's datasets) the key is the path, the key stored embeddings are found under
    (rl.image_embeddings); without it, a completion with no image is an error that says so."""
    from rewards.retrieval import image_keys

    assert image_keys(["/d/a.png", "/d/a.png", "/d/b.png"], [None] * 3) == ["path:/d/a.png"] * 2 + ["path:/d/b.png"]
    with pytest.raises(ValueError, match="a completion has neither an image nor an image_path"):
        image_keys(None, [Image.new("RGB", (2, 2)), None])


def test_repeated_queries_are_encoded_once(tiny_index, batch, monkeypatch):
    rows, images = batch
    reward = RetrievalReward(tiny_index, alpha=0.3)
    texts = []
    record_calls(monkeypatch, tiny_index, "encode_texts", lambda t: texts.append(list(t)))
    completions = [format_completion(f"q {i % 3}") for i in range(len(rows) * G)]
    first, _ = trl_call(reward, rows, completions, images)
    second, _ = trl_call(reward, rows, completions, images)
    assert texts == [["q 0", "q 1", "q 2"]] and first == second


def test_a_full_text_cache_keeps_the_calls_own_texts(tiny_index):
    """A call that fills the cache while repeating a cached query: the cache was cleared before that query was read
    back (a KeyError that ended a long single-process run)."""
    reward = RetrievalReward(tiny_index, alpha=0.3)
    reward.text_cache_size = 4
    reward.text_embeddings(["a", "b", "c"])
    got = reward.text_embeddings(["a", "d", "e"])  # 3 cached + 2 new > 4
    assert np.allclose(got, tiny_index.encode_texts(["a", "d", "e"]), atol=1e-6)
    assert set(reward.text_cache) == {"a", "d", "e"}  # the others went: the cache stays bounded


def test_length_cap_and_custom_penalties(tiny_index, batch):
    rows, images = batch
    reward = RetrievalReward(tiny_index, alpha=0.3, max_query_tokens=3, unparseable=-7.0)
    out, _ = trl_call(reward, rows, [format_completion("one two three four")] * (len(rows) * G), images)
    assert out == [-7.0] * (len(rows) * G)


def test_a_query_holding_half_an_emoji_is_unparseable_not_a_crash(tiny_index, batch, tmp_path):
    """The answer's JSON escapes a lone surrogate (a sampled emoji cut in half): it parsed, and then the text
    encoder's tokenizer raised a TypeError that ended the training step."""
    rows, images = batch
    reward = RetrievalReward(tiny_index, alpha=0.3, unparseable=-7.0)
    bad = '<think>x</think><answer>{"query": "red circle \\ud83d"}</answer>'
    completions = [bad] + [format_completion("red circle")] * (len(rows) * G - 1)
    out, _ = trl_call(reward, rows, completions, images)
    assert out[0] == -7.0 and all(x != -7.0 for x in out[1:])


def test_bad_settings_are_refused(tiny_index):
    with pytest.raises(ValueError, match="alpha"):
        RetrievalReward(tiny_index, alpha=1.5)
    with pytest.raises(ValueError, match="contiguous"):
        RetrievalReward(tiny_index, alpha=0.5, tiers=[(2, 5, 1.0)])
    with pytest.raises(ValueError, match="finite"):
        RetrievalReward(tiny_index, alpha=0.5, unparseable=float("nan"))
    with pytest.raises(ValueError, match="entity_id"):
        RetrievalReward(tiny_index, alpha=0.5)(prompts=[1], completions=["x"])


def test_metrics_are_logged_per_completion_so_ranks_pool_exactly():
    """TRL sums (value, count) over ranks: per-completion values make the pooled figure the mean over all
    completions; per-rank means would weight a rank's mean hit rank the same whatever its number of hits."""
    from rewards.retrieval import completion_metrics

    rank_a = completion_metrics(["q"] * 4, [1, 3, 5, 7], None)
    rank_b = completion_metrics(["q"] * 4, [None, None, None, 41], None)
    rank_c = completion_metrics(["q"] * 4, [None] * 4, None)  # no hit at all on this rank
    pooled = {k: [x for d in (rank_a, rank_b, rank_c) for x in d.get(k, [])] for k in rank_a}
    assert "retrieval/mean_hit_rank" not in rank_c
    assert np.mean(pooled["retrieval/mean_hit_rank"]) == pytest.approx((1 + 3 + 5 + 7 + 41) / 5)
    assert np.mean(pooled["retrieval/hit@5"]) == pytest.approx(3 / 12)
    assert np.mean(pooled["retrieval/miss_rate"]) == pytest.approx(7 / 12)


def test_batch_metrics_table():
    m = batch_metrics(["a b", None, "q", "c d e f"], [1, None, 7, None], ["q", "x", "q", "y"])
    assert m["retrieval/hit@1"] == 0.25 and m["retrieval/hit@10"] == 0.5 and m["retrieval/miss_rate"] == 0.5
    assert m["retrieval/mean_hit_rank"] == 4 and m["retrieval/parse_rate"] == 0.75
    assert m["retrieval/query_tokens"] == pytest.approx((2 + 1 + 4) / 3)
    assert m["retrieval/same_as_question"] == 0.25
    assert np.isfinite(list(m.values())).all()


def test_the_completions_tables_top3_comes_from_the_exact_ranker_where_it_ranks(tiny_index, batch, monkeypatch):
    """On the GPU path (exact ranks) the table's top-3 is the exact ranker's per-entity scores: FAISS is never
    searched, and the titles are FAISS's top-3 all the same."""
    from rl.monitor import RefinerMonitor, TimedReward

    rows, images = batch
    reward, fmt = RetrievalReward(tiny_index, alpha=0.3), TimedReward(lambda **k: [1.0] * (len(rows) * G))
    queries = [f"a query {i}" for i in range(len(rows) * G)]
    trl_call(reward, rows, [format_completion(q) for q in queries], images)
    fmt(completions=queries)
    monitor = RefinerMonitor(reward, fmt, [fmt], table_steps=1, output_dir=".")
    monkeypatch.setattr(tiny_index, "rank_method", "search")
    by_faiss = [r["top3"] for r in monitor.rows()]
    monkeypatch.setattr(tiny_index, "rank_method", "exact")
    monkeypatch.setattr(tiny_index.faiss, "search", lambda *a: pytest.fail("FAISS searched"), raising=False)
    by_exact = [r["top3"] for r in monitor.rows()]
    assert by_exact == by_faiss and len(by_exact) == len(queries) and all(len(t) == 3 for t in by_exact)


def test_an_evaluation_between_steps_leaves_the_table_its_training_completions(tiny_index, batch, tmp_path):
    """TRL reuses a generation for steps_per_generation steps and evaluates between them: the monitor's table at the
    next step showed the evaluation's completions (the reward and the format reward kept the latest call's, eval or
    not)."""
    from types import SimpleNamespace

    from rl.monitor import RefinerMonitor, TimedReward

    rows, images = batch
    reward = RetrievalReward(tiny_index, alpha=0.3)
    model = SimpleNamespace(training=True)
    reward.follow(SimpleNamespace(model=model))
    n = len(rows) * G
    fmt = TimedReward(lambda **k: [1.0] * n if model.training else [-4.0] * n)
    monitor = RefinerMonitor(reward, fmt, [fmt], table_steps=1, output_dir=str(tmp_path))
    monitor.on_step_begin(None, None, None)  # step 5 (global_step 4 while it runs)
    trl_call(reward, rows, [format_completion(f"train {i}") for i in range(n)], images)
    fmt(completions=["x"] * n)
    monitor.on_step_end(
        SimpleNamespace(reward_weights=None, report_to=[]),
        SimpleNamespace(global_step=5, is_world_process_zero=False),
        None,
    )
    model.training = False  # the evaluation after step 5
    trl_call(reward, rows, [format_completion(f"eval {i}") for i in range(n)], images)
    fmt(completions=["x"] * n)
    table = monitor.rows()
    assert [r["query"] for r in table] == [f"train {i}" for i in range(n)]
    assert [r["format_reward"] for r in table] == [1.0] * n


def test_the_completions_log_numbers_steps_as_log_history_does(tiny_index, batch, tmp_path):
    """An evaluation after step N was numbered N + 1 in completions.rank<R>.jsonl, where log_history has it at N."""
    from types import SimpleNamespace

    rows, images = batch
    log = tmp_path / "completions.rank0.jsonl"
    reward = RetrievalReward(tiny_index, alpha=0.3, completions_log=log)
    model = SimpleNamespace(training=True)
    reward.follow(SimpleNamespace(model=model))
    n = len(rows) * G
    state = SimpleNamespace(global_step=4)  # while step 5 runs
    trl_call(reward, rows, [format_completion("q")] * n, images, trainer_state=state)
    state.global_step, model.training = 5, False  # the evaluation after step 5, logged at step 5
    trl_call(reward, rows, [format_completion("q")] * n, images, trainer_state=state)
    logged = [json.loads(line) for line in open(log, encoding="utf-8")]
    assert [(r["mode"], r["step"]) for r in logged] == [("train", 5)] * n + [("eval", 5)] * n
