"""Retrieval evaluation: metric functions, exclusions, α-sweep consistency, validation before loading."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import retrieval.eval_report as report
import retrieval.evaluate as ev
from retrieval.evaluate import EvalArgs, parse_ks, parse_sweep, pseudo_recall_at, recall_at
from retrieval.ranking import Ranked

QUIET = dict(log=lambda *a: None)


@pytest.mark.parametrize(
    "ranks,ks,expected",
    [
        ([1, 2, 6, None], [1, 5, 10], {"R@1": 25.0, "R@5": 50.0, "R@10": 75.0}),
        ([None, None], [1], {"R@1": 0.0}),
        ([3], [1, 3], {"R@1": 0.0, "R@3": 100.0}),
        ([], [1], {"R@1": 0.0}),
        ([1, None, 4], [1, 5], {"R@1": 100 / 3, "R@5": 200 / 3}),  # a share of 3 is no whole percent
    ],
)
def test_recall_at(ranks, ks, expected):
    assert recall_at(ranks, ks) == pytest.approx(expected)


def test_pseudo_recall_is_case_insensitive_and_respects_k():
    texts = [["It lives in Mossy Caves.", "eats seeds"], ["nothing", "the answer is here: Paris"]]
    answers = [["mossy caves"], ["paris"]]
    assert pseudo_recall_at(texts, answers, [1, 2]) == pytest.approx({"PR@1": 50.0, "PR@2": 100.0})
    assert pseudo_recall_at([["x"]], [[""]], [1]) == {"PR@1": 0.0}  # an empty answer never matches
    assert pseudo_recall_at([["in Paris"]], [["paris"]], [1]) == {"PR@1": 100.0}  # one question
    assert pseudo_recall_at([], [], [1]) == {"PR@1": 0.0}  # no question
    thirds = pseudo_recall_at([["Paris"], ["Rome"], ["Oslo"]], [["paris"], ["oslo"], ["oslo"]], [1])
    assert thirds == pytest.approx({"PR@1": 200 / 3})  # a share of 3 is no whole percent


def test_evaluate_ranked_cuts_ranks_at_the_depth_and_reads_the_top_k_sections():
    """Gold B ranked 2nd (at the depth: a hit), gold C 3rd (past the depth: a miss), gold X not in the index; PR@K
    reads the best section of each of the top K entities; a question without answers is a PR miss."""
    index = SimpleNamespace(entity_index={"A": 0, "B": 1, "C": 2}, entry_ids=["a0", "b0", "c0"])
    abc = Ranked(entities=np.array([0, 1, 2]), rows=np.array([0, 1, 2]), scores=np.array([3.0, 2.0, 1.0]))
    rows = [{"entity_id": "B", "answers": ["paris"]}, {"entity_id": "C", "answers": ["oslo"]}, {"entity_id": "X"}]
    texts = {"a0": "Rome", "b0": "It is in Paris.", "c0": "Oslo"}
    out = ev.evaluate_ranked(index, [abc] * 3, rows, [1, 2], depth=2, entry_texts=texts)
    assert out["ranks"] == [2, None, None]
    assert out["metrics"] == pytest.approx({"R@1": 0.0, "R@2": 100 / 3, "PR@1": 0.0, "PR@2": 100 / 3, "n": 3})


@pytest.mark.parametrize(
    "text,ok,error",
    [
        ("1,5,10", [1, 5, 10], None),
        ("10, 1", [1, 10], None),
        ("0", None, "--k: each K must be a positive integer, got 0"),
        ("a", None, "--k must be comma-separated positive integers, got 'a'"),
        ("", None, "--k: no K values given"),
    ],
)
def test_parse_ks(text, ok, error):
    if ok is None:
        with pytest.raises(ValueError, match=re.escape(error)):
            parse_ks(text)
    else:
        assert parse_ks(text) == ok


def test_parse_sweep():
    assert parse_sweep("0:1:0.25") == [0, 0.25, 0.5, 0.75, 1.0]
    assert parse_sweep("0:0.5:0.3") == [0, 0.3] and parse_sweep("0.5:1:0.3") == [0.5, 0.8]  # never past hi
    assert len(parse_sweep("0:1:0.05")) == 21 and parse_sweep("0:1:0.05")[-1] == 1.0
    assert parse_sweep("0.3:0.3:0.1") == [0.3]  # lo = hi: one α, as the message's "lo ≤ hi" allows
    for bad, error in [
        ("0:1", "--alpha_sweep must look like lo:hi:step"),
        ("0:2:0.5", "alpha must be in [0, 1], got 1.5"),  # the first α past 1
        ("1:0:0.1", "--alpha_sweep '1:0:0.1': need lo ≤ hi and step > 0"),
        ("0:1:0", "--alpha_sweep '0:1:0': need lo ≤ hi and step > 0"),
    ]:
        with pytest.raises(ValueError, match=re.escape(error)):
            parse_sweep(bad)


@pytest.mark.parametrize(
    "text,fields",
    [
        (None, []),
        ("", []),
        ("refined_query, query_caption,", ["refined_query", "query_caption"]),
        ("question", None),  # the --text_field itself
        ("refined_query,refined_query", None),
        ("a,refined_query,b,refined_query", None),
    ],
)
def test_compare_fields(text, fields):
    if fields is None:
        with pytest.raises(ValueError, match="--compare: field '(question|refined_query)' is given twice"):
            ev.compare_fields(text, "question")
    else:
        assert ev.compare_fields(text, "question") == fields


@pytest.mark.parametrize(
    "fields,files",
    [
        ([], {}),
        (["query caption"], {"query caption": "rank_change.png"}),
        (["refined_query", "a/b"], {"refined_query": "rank_change_refined_query.png", "a/b": "rank_change_a_b.png"}),
        (["a b", "a_b"], None),  # one file name for two fields: the second histogram would overwrite the first
        (["x", "a:b", "a?b"], None),
    ],
)
def test_each_compared_field_has_its_own_histogram(fields, files):
    if files is None:
        with pytest.raises(
            ValueError, match=r"--compare: fields \['a.b', 'a.b'\] would both write rank_change_a_b.png"
        ):
            ev.compare_fields(",".join(fields), "question")
    else:
        assert report.rank_change_files(fields) == files
        assert ev.compare_fields(",".join(fields), "question") == fields


def test_format_table_shows_the_columns_some_row_has_and_a_dash_where_a_row_lacks_one():
    results = {"question": {"R@1": 12.345, "R@5": 50.0, "PR@1": 7.0, "n": 4}, "refined": {"R@1": 100.0, "n": 4}}
    assert report.format_table(results, [1, 5], label="method").splitlines() == [
        "| method | n | R@1 | R@5 | PR@1 |",
        "|---|---|---|---|---|",
        "| question | 4 | 12.3 | 50.0 | 7.0 |",
        "| refined | 4 | 100.0 | — | — |",
    ]


def run(tiny_index_dir, queries, tmp_path, **kw):
    return ev.run(EvalArgs(index=str(tiny_index_dir), queries=str(queries), out=str(tmp_path / "ev"), **kw), **QUIET)


def test_sweep_equals_single_alpha_runs(tiny_index_dir, tiny_world, tmp_path, monkeypatch, encoders):
    real_load = ev.MultimodalIndex.load
    monkeypatch.setattr(ev.MultimodalIndex, "load", lambda p, **k: real_load(p, *encoders))
    q = tiny_world / "test.jsonl"
    sweep = run(tiny_index_dir, q, tmp_path, alpha_sweep="0:1:0.5")["results"]
    for a in ["0.0", "0.5", "1.0"]:
        single = run(tiny_index_dir, q, tmp_path / a, alpha=float(a))["results"]
        assert single[str(float(a))]["question"] == pytest.approx(sweep[a]["question"])
    assert (tmp_path / "ev" / "alpha_sweep.png").stat().st_size > 1000
    assert len(open(tmp_path / "ev" / "alpha_sweep.csv", encoding="utf-8").read().splitlines()) == 4
    # image-only retrieval on this world beats text-only (the vague question says nothing about the entity)
    assert sweep["1.0"]["question"]["R@5"] > sweep["0.0"]["question"]["R@5"]


def test_excluded_rows_are_counted(tiny_index_dir, tiny_world, tmp_path, monkeypatch, encoders):
    real_load = ev.MultimodalIndex.load
    monkeypatch.setattr(ev.MultimodalIndex, "load", lambda p, **k: real_load(p, *encoders))
    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")][:7]
    rows[0]["image"] = "images/none.png"
    rows[1]["entity_id"] = "E9999"
    rows[2]["question"] = ""
    rows[3]["entity_id"] = [rows[3]["entity_id"], rows[4]["entity_id"]]
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = run(tiny_index_dir, q, tmp_path, alpha=0.5, images_root=str(tiny_world))
    assert res["excluded"] == {
        "image missing": 1,
        "empty or missing text field (question)": 1,
        "2-hop question (one gold entity per hop; Recall@K ranks one)": 1,
    }
    # a gold entity with no index row stays in the denominator as a miss (the reference evaluation's protocol)
    assert res["gold_not_in_index"] == 1
    assert res["results"]["0.5"]["question"]["n"] == 4
    ranks = {
        r["id"]: r["rank_question"] for r in map(json.loads, open(tmp_path / "ev" / "ranks.jsonl", encoding="utf-8"))
    }
    assert ranks[rows[1]["id"]] is None and len(ranks) == 4
    q.write_text("".join(json.dumps(r) + "\n" for r in rows[4:]))
    known = run(tiny_index_dir, q, tmp_path / "known", alpha=0.5, images_root=str(tiny_world))["results"]["0.5"]
    for k in (1, 5, 20):
        assert res["results"]["0.5"]["question"][f"R@{k}"] == pytest.approx(known["question"][f"R@{k}"] * 3 / 4)
    # the question without an index row has an unreadable image too: excluded, so it is not counted as absent
    (tmp_path / "broken.png").write_bytes(b"not a png")
    rows[1]["image"] = str(tmp_path / "broken.png")
    q.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = run(tiny_index_dir, q, tmp_path / "unreadable", alpha=0.5, images_root=str(tiny_world))
    assert res["excluded"]["image unreadable"] == 1 and res["gold_not_in_index"] == 0
    assert res["results"]["0.5"]["question"]["n"] == 3


def test_compare_prints_two_fields(tiny_index_dir, tiny_world, tmp_path, monkeypatch, encoders):
    real_load = ev.MultimodalIndex.load
    monkeypatch.setattr(ev.MultimodalIndex, "load", lambda p, **k: real_load(p, *encoders))
    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")]
    for r in rows:
        r["refined_query"] = r["question"] + " " + " ".join(r["attributes"].values())
    q = tmp_path / "refined_test.jsonl"  # not in the shared toy world: its images are read from there
    q.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = []
    res = ev.run(
        EvalArgs(
            index=str(tiny_index_dir),
            queries=str(q),
            images_root=str(tiny_world),
            alpha=0.5,
            text_field="refined_query",
            compare="question",
            out=str(tmp_path / "ev"),
        ),
        log=lines.append,
    )
    per = res["results"]["0.5"]
    assert set(per) == {"refined_query", "question"} and "PR@1" in per["question"]
    assert "| refined_query |" in "\n".join(lines) and "| question |" in "\n".join(lines)
    ranks = [json.loads(x) for x in open(tmp_path / "ev" / "ranks.jsonl", encoding="utf-8")]
    assert len(ranks) == len(rows) and "rank_refined_query" in ranks[0]
    # stating the gold attributes moves the gold entity up for most questions
    assert res["rank_change"]["question"]["improved"] > res["rank_change"]["question"]["worse"]
    assert (tmp_path / "ev" / "rank_change.png").stat().st_size > 1000
    assert open(tmp_path / "ev" / "metrics.csv", encoding="utf-8").readline().startswith("field,R@1")
    # Table 8's way round (the question first, the methods compared): the change is still question → method, and
    # the files of the run above (ranks.jsonl, rank_change.png) do not outlive it in a sweep into the same folder
    args = dict(index=str(tiny_index_dir), queries=str(q), images_root=str(tiny_world), out=str(tmp_path / "ev"))
    for r in rows:
        r["question_copy"] = r["question"]
    q.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table8 = ev.run(
        EvalArgs(**args, alpha=0.5, text_field="question", compare="refined_query,question_copy"), log=lines.append
    )
    assert table8["rank_change"]["refined_query"] == res["rank_change"]["question"]
    assert table8["rank_change"]["question_copy"]["unchanged"] == 1.0
    assert sorted(p.name for p in (tmp_path / "ev").glob("rank_change*.png")) == [
        "rank_change_question_copy.png",
        "rank_change_refined_query.png",
    ]
    ev.run(EvalArgs(**args, alpha_sweep="0:1:0.5", text_field="question"), log=lines.append)
    left = sorted(p.name for p in (tmp_path / "ev").iterdir())
    assert left == ["alpha_sweep.csv", "alpha_sweep.png", "metrics.json"]


def test_a_k_deeper_than_the_depth_is_refused(tiny_index_dir, tiny_world):
    """R@250 with --depth 200 was R@200 under K's name (ranks past the depth are misses)."""
    with pytest.raises(ValueError, match="--k 250 is deeper than --depth 200: give --depth 250 or a smaller K"):
        ev.run(EvalArgs(index=str(tiny_index_dir), queries=str(tiny_world / "test.jsonl"), alpha=0.5, k="1,250"))


def test_the_deepest_k_may_equal_the_depth_and_a_gold_entity_ranked_there_is_a_hit(
    tiny_index_dir, tiny_world, tmp_path, monkeypatch, encoders
):
    real_load = ev.MultimodalIndex.load
    monkeypatch.setattr(ev.MultimodalIndex, "load", lambda p, **k: real_load(p, *encoders))
    run(tiny_index_dir, tiny_world / "test.jsonl", tmp_path, alpha=0.5)
    ranks = [json.loads(line)["rank_question"] for line in open(tmp_path / "ev" / "ranks.jsonl", encoding="utf-8")]
    depth = max(r for r in ranks if r is not None)  # some question's gold entity is ranked exactly there
    res = run(tiny_index_dir, tiny_world / "test.jsonl", tmp_path, alpha=0.5, k=f"1,{depth}", depth=depth)
    found = 100 * sum(r is not None for r in ranks) / len(ranks)
    assert res["results"]["0.5"]["question"][f"R@{depth}"] == pytest.approx(found)


def test_results_go_to_outputs_eval_and_the_queries_name_by_default(
    tiny_index_dir, tiny_world, tmp_path, monkeypatch, encoders
):
    real_load = ev.MultimodalIndex.load
    monkeypatch.setattr(ev.MultimodalIndex, "load", lambda p, **k: real_load(p, *encoders))
    monkeypatch.chdir(tmp_path)
    res = ev.run(EvalArgs(index=str(tiny_index_dir), queries=str(tiny_world / "test.jsonl"), alpha=0.5), **QUIET)
    assert json.loads((tmp_path / "outputs" / "eval" / "test" / "metrics.json").read_text(encoding="utf-8")) == res


@pytest.mark.parametrize("before,after,expected", [([5, None, 1], [1, 3, None], [4, 198, -200]), ([], [], [])])
def test_rank_changes(before, after, expected):
    assert report.rank_changes(before, after, depth=200) == expected


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(alpha=2.0), "alpha"),
        (dict(alpha=0.5, k="0"), "--k"),
        (dict(), "--alpha is required"),
        (dict(alpha=0.5, alpha_sweep="x"), "alpha_sweep"),
        (dict(alpha=0.5, depth=0), "depth must be a positive integer, got 0"),
        (dict(alpha=0.5, images_root="/no/such/folder"), "--images_root: folder /no/such/folder does not exist"),
    ],
)
def test_invalid_settings_fail_before_loading(tiny_index_dir, tiny_world, tmp_path, monkeypatch, kw, match):
    monkeypatch.setattr(ev.MultimodalIndex, "load", lambda *a, **k: pytest.fail("the index was loaded"))
    with pytest.raises(ValueError, match=match):
        run(tiny_index_dir, tiny_world / "test.jsonl", tmp_path, **kw)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "key,null,said", [("id", False, "lacks"), ("entity_id", False, "lacks"), ("id", True, "has null for")]
)
def test_a_question_without_id_or_gold_entity_is_named_before_loading(
    tiny_index_dir, tiny_world, tmp_path, monkeypatch, key, null, said
):
    """A row without an id (or gold entity) was a KeyError after every image was encoded, and the earlier run's
    metrics.json, metrics.csv and ranks.jsonl in the same --out were deleted first."""
    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")][:4]
    rows[2][key] = None
    if not null:
        del rows[2][key]
    q = write_rows(tmp_path / "q.jsonl", rows)
    earlier = tmp_path / "ev" / "metrics.json"
    earlier.parent.mkdir()
    earlier.write_text("{}")
    monkeypatch.setattr(ev.MultimodalIndex, "load", lambda *a, **k: pytest.fail("the index was loaded"))
    with pytest.raises(ValueError, match=re.escape(f'{q}:3 {said} "{key}"')):
        run(tiny_index_dir, q, tmp_path, alpha=0.5, images_root=str(tiny_world))
    assert earlier.read_text() == "{}"


def test_an_earlier_run_is_removed_only_once_the_new_results_are_written(
    tiny_index_dir, tiny_world, tmp_path, monkeypatch, encoders
):
    real_load = ev.MultimodalIndex.load
    monkeypatch.setattr(ev.MultimodalIndex, "load", lambda p, **k: real_load(p, *encoders))
    q = tiny_world / "test.jsonl"
    run(tiny_index_dir, q, tmp_path, alpha=0.5)
    before = {p.name: p.read_bytes() for p in (tmp_path / "ev").iterdir() if p.name != "metrics.md"}

    def disk_full(*a):
        raise OSError("No space left on device")

    monkeypatch.setattr(ev, "write_csv", disk_full)
    with pytest.raises(OSError):
        run(tiny_index_dir, q, tmp_path, alpha=0.25)
    assert {p.name: p.read_bytes() for p in (tmp_path / "ev").iterdir() if p.name in before} == before


def test_questions_without_answers_are_counted_for_pseudo_recall(
    tiny_index_dir, tiny_world, tmp_path, monkeypatch, encoders
):
    """Without answers PR@K was 0 without a word."""
    real_load = ev.MultimodalIndex.load
    monkeypatch.setattr(ev.MultimodalIndex, "load", lambda p, **k: real_load(p, *encoders))
    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")][:6]
    for r in rows[:2]:
        del r["answers"]
    lines = []
    q = write_rows(tmp_path / "q.jsonl", rows)
    args = dict(index=str(tiny_index_dir), queries=str(q), images_root=str(tiny_world), alpha=0.5)
    res = ev.run(EvalArgs(**args, out=str(tmp_path / "some")), log=lines.append)
    assert res["without_answers"] == 2 and 0 < res["results"]["0.5"]["question"]["PR@20"] <= 100 * 4 / 6
    assert "pseudo-recall: 2 of 6 question(s) have no answers: each counts as a miss in PR@K" in lines
    for r in rows:
        r.pop("answers", None)
    write_rows(q, rows)
    res = ev.run(EvalArgs(**args, out=str(tmp_path / "none")), log=lines.append)
    assert res["without_answers"] == 6 and not any(k.startswith("PR@") for k in res["results"]["0.5"]["question"])
    assert f"pseudo-recall skipped: no question in {q} has answers" in lines


def test_a_queries_file_without_an_evaluable_question_is_refused_before_loading(tiny_index_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(ev.MultimodalIndex, "load", lambda *a, **k: pytest.fail("the index was loaded"))
    q = write_rows(tmp_path / "q.jsonl", [{"id": i, "entity_id": "E", "image": f"{i}.png"} for i in "ab"])
    with pytest.raises(ValueError, match=re.escape(f"no question in {q} can be evaluated ({{'image missing': 2}})")):
        run(tiny_index_dir, q, tmp_path, alpha=0.5)


def test_missing_index_or_queries_named(tiny_index_dir, tmp_path):
    with pytest.raises(ValueError, match="--index"):
        ev.run(EvalArgs(index=str(tmp_path), queries="x", alpha=0.5))
    with pytest.raises(ValueError, match="--queries"):
        ev.run(EvalArgs(index=str(tiny_index_dir), queries=str(tmp_path / "none.jsonl"), alpha=0.5))


def test_query_images_stream_through_workers_and_a_corrupt_one_is_excluded(
    tiny_index_dir, tiny_world, tmp_path, monkeypatch, encoders
):
    real_load = ev.MultimodalIndex.load
    monkeypatch.setattr(ev.MultimodalIndex, "load", lambda p, **k: real_load(p, *encoders))
    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")][:8]
    (tmp_path / "broken.png").write_bytes(b"not a png")
    rows[2]["image"] = str(tmp_path / "broken.png")
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps(r) + "\n" for r in rows))
    by_workers = [
        run(tiny_index_dir, q, tmp_path / str(w), alpha=0.5, images_root=str(tiny_world), workers=w) for w in (0, 2)
    ]
    for res in by_workers:
        assert res["excluded"] == {"image unreadable": 1} and res["results"]["0.5"]["question"]["n"] == 7
    assert by_workers[0]["results"] == by_workers[1]["results"]
    ranks = [json.loads(x)["id"] for x in open(tmp_path / "2" / "ev" / "ranks.jsonl", encoding="utf-8")]
    assert ranks == [r["id"] for i, r in enumerate(rows) if i != 2]


@pytest.mark.parametrize("factory", ["HNSW8,Flat", "IVF4,Flat"])
def test_an_approximate_index_is_reported_against_flat(
    tiny_world, tiny_index, tiny_index_dir, tmp_path, encoders, monkeypatch, factory
):
    """The Flat reference of an approximate index is an exact search over the same vectors: its ranks equal the
    exact ranks of the Flat index built from the same KB, and evaluate prints both with their agreement."""
    from retrieval.build_index import BuildArgs, build_index
    from retrieval.index import MultimodalIndex

    out = tmp_path / "idx"
    build_index(
        BuildArgs(
            kb=str(tiny_world / "kb.jsonl"),
            out=str(out),
            image_encoder="tiny",
            text_encoder="tiny",
            factory=factory,
            shard_size=32,
        ),
        encoders=encoders,
        **QUIET,
    )
    approx = MultimodalIndex.load(out, *encoders, nprobe=1)  # IVF: 1 of 4 lists, often not the gold entity's
    assert approx.is_approximate and not tiny_index.is_approximate
    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")]
    from PIL import Image

    img = approx.encode_images([Image.open(tiny_world / r["image"]) for r in rows])
    txt = approx.encode_texts([r["question"] for r in rows])
    from retrieval.ranking import query_vectors

    q, _ = query_vectors(img, txt, 0.5)
    gold = [r["entity_id"] for r in rows]
    assert approx.reference_ranks(img, txt, gold, 0.5) == tiny_index.exact.ranks(
        q, [tiny_index.entity_index[g] for g in gold]
    )
    real_load = ev.MultimodalIndex.load
    monkeypatch.setattr(ev.MultimodalIndex, "load", lambda p, **k: real_load(p, *encoders, nprobe=1))
    lines = []
    res = ev.run(
        EvalArgs(
            index=str(out), queries=str(tiny_world / "test.jsonl"), alpha=0.5, k="1,5", depth=5, out=str(tmp_path / "e")
        ),
        log=lines.append,
    )["results"]["0.5"]
    flat = run(tiny_index_dir, tiny_world / "test.jsonl", tmp_path / "flat", alpha=0.5, k="1,5")["results"]["0.5"]
    for k in ("R@1", "R@5"):
        assert res["question (Flat reference)"][k] == pytest.approx(flat["question"][k])
    # the agreement: the share of questions whose gold entity the approximate search ranks where the exact search
    # over the same vectors does, both ranks past the depth counted as a miss (None)
    depth = 5
    from retrieval.ranking import ranks_of

    def capped(ranks):
        return [r if r is not None and r <= depth else None for r in ranks]

    approx_ranks = capped(ranks_of(approx.rank(img, txt, 0.5, depth), [approx.entity_index[g] for g in gold]))
    exact_ranks = tiny_index.exact.ranks(q, [tiny_index.entity_index[g] for g in gold])
    assert any(r > depth for r in exact_ranks)  # a gold entity past the depth: the reference is capped there too
    exact_ranks = capped(exact_ranks)
    reported = {
        r["id"]: r["rank_question"] for r in map(json.loads, open(tmp_path / "e" / "ranks.jsonl", encoding="utf-8"))
    }
    assert [reported[r["id"]] for r in rows] == approx_ranks  # the ranks evaluate reports are the approximate ones
    agreement = 100.0 * sum(a == e for a, e in zip(approx_ranks, exact_ranks)) / len(rows)
    assert res["question"]["same_rank_as_flat"] == pytest.approx(agreement)
    if factory.startswith("IVF"):  # 1 list of 4 searched: some gold entities are not found, so the check can fail
        assert agreement < 100
    assert any("same rank as an exact search over the same vectors" in x for x in lines)
    assert "| question (Flat reference) |" in "\n".join(lines)


@pytest.mark.parametrize(
    "change,kept,excluded",  # a field changed to ... is left out of the row
    [
        ({}, True, {}),
        ({"image": ...}, False, {"image missing": 1}),
        ({"image": None}, False, {"image missing": 1}),
        ({"image": ""}, False, {"image missing": 1}),
        ({"image": 5}, False, {"image missing": 1}),
        ({"image": ["images/a.png"]}, False, {"image missing": 1}),
        ({"image": "images/none.png"}, False, {"image missing": 1}),
        ({"entity_id": ["E1", "E2"]}, False, {"2-hop question (one gold entity per hop; Recall@K ranks one)": 1}),
        ({"question": ...}, False, {"empty or missing text field (question, refined)": 1}),
        ({"question": None}, False, {"empty or missing text field (question, refined)": 1}),
        ({"question": "  "}, False, {"empty or missing text field (question, refined)": 1}),
        ({"question": 5}, False, {"empty or missing text field (question, refined)": 1}),
        ({"refined": ""}, False, {"empty or missing text field (question, refined)": 1}),
    ],
)
def test_load_questions_keeps_a_row_only_with_an_image_one_gold_entity_and_every_text_field(
    tiny_world, tmp_path, change, kept, excluded
):
    image = "images/" + next((tiny_world / "images").iterdir()).name
    good = {"id": "q0", "entity_id": "E1", "image": image, "question": "what is this?", "refined": "a red bird"}
    bad = {k: v for k, v in {**good, **change}.items() if v is not ...}
    q = write_rows(tmp_path / "q.jsonl", [good, bad | {"id": "q1"}, good | {"id": "q2"}, bad | {"id": "q3"}])
    rows, dropped = ev.load_questions(q, ["question", "refined"], tiny_world)
    assert [r["id"] for r in rows] == (["q0", "q1", "q2", "q3"] if kept else ["q0", "q2"])
    assert dropped == {reason: 2 * count for reason, count in excluded.items()}


def test_main_runs_the_evaluation_its_flags_describe(monkeypatch):
    seen = []
    monkeypatch.setattr(ev, "run", seen.append)
    ev.main(["--index", "idx", "--queries", "q.jsonl", "--alpha", "0.25", "--compare", "refined_query"])
    assert seen == [EvalArgs(index="idx", queries="q.jsonl", alpha=0.25, compare="refined_query")]


def test_metrics_csv_rounds_to_four_places_and_leaves_a_metric_a_row_lacks_empty(tmp_path):
    report.write_csv(
        tmp_path / "metrics.csv",
        {
            "question": {"R@1": 12.345678, "PR@1": 50.0, "n": 3, "same_rank_as_flat": 200 / 3},
            "question (Flat reference)": {"R@1": 100 / 3, "n": 3},
        },
    )
    assert (tmp_path / "metrics.csv").read_text(encoding="utf-8").splitlines() == [
        "field,R@1,PR@1,n,same_rank_as_flat",
        "question,12.3457,50.0,3,66.6667",
        "question (Flat reference),33.3333,,3,",
    ]


def saved_figures(monkeypatch) -> dict:
    """File name → the figure evaluate saved there (still written to disk)."""
    figures = {}
    real = report.save_figure

    def keep(fig, path, **kw):
        figures[Path(path).name] = fig
        real(fig, path, **kw)

    monkeypatch.setattr(report, "save_figure", keep)
    return figures


def test_rank_change_summary_and_histogram(tmp_path, monkeypatch):
    figures = saved_figures(monkeypatch)
    before, after = [3, 4, 5, 7, 2, None, 1], [2, 2, 6, 7, 2, 1, None]  # moved up 1, 2, -1, 0, 0, 10, -10 (depth 10)
    summary = report.write_rank_change(tmp_path / "rank_change.png", before, after, 10, "question", "refined")
    assert summary == pytest.approx({"improved": 3 / 7, "unchanged": 2 / 7, "worse": 2 / 7, "median": 0.0})
    assert (tmp_path / "rank_change.png").stat().st_size > 1000
    (ax,) = figures["rank_change.png"].axes
    assert sum(p.get_height() for p in ax.patches) == 7  # every question in the histogram
    assert ax.get_xlabel() == "rank improvement (question rank − refined rank)"
    assert list(ax.lines[0].get_xdata()) == [0, 0]  # the no-change line
    one = report.write_rank_change(tmp_path / "one.png", [2], [1], 10, "question", "refined")
    assert one == {"improved": 1.0, "unchanged": 0.0, "worse": 0.0, "median": 1.0}
    no_questions = report.write_rank_change(tmp_path / "none.png", [], [], 10, "question", "refined")
    assert no_questions == {"improved": 0.0, "unchanged": 0.0, "worse": 0.0, "median": 0.0}


@pytest.mark.parametrize("fields", [["question"], ["question", "refined"]])
def test_alpha_sweep_csv_table_and_plot(tmp_path, monkeypatch, fields):
    figures = saved_figures(monkeypatch)
    metrics = {(0.0, "question"): (10.0, 20.125), (0.5, "question"): (30.0, 40.0)}
    metrics |= {(0.0, "refined"): (12.5, 25.0), (0.5, "refined"): (50.0, 62.5)}
    results = {a: {f: {"metrics": dict(zip(["R@1", "R@5"], metrics[a, f]))} for f in fields} for a in (0.0, 0.5)}
    lines = []
    report.write_sweep(tmp_path, [0.0, 0.5], fields, [1, 5], results, lines.append)
    rows = [(a, f) for a in (0.0, 0.5) for f in fields]
    assert (tmp_path / "alpha_sweep.csv").read_text(encoding="utf-8").splitlines() == ["alpha,field,R@1,R@5"] + [
        f"{a},{f},{metrics[a, f][0]:.2f},{metrics[a, f][1]:.2f}" for a, f in rows
    ]
    assert lines == [
        "\n".join(
            ["| α | field | R@1 | R@5 |", "|---|---|---|---|"]
            + [f"| {a:g} | {f} | {metrics[a, f][0]:.1f} | {metrics[a, f][1]:.1f} |" for a, f in rows]
        )
    ]
    (ax,) = figures["alpha_sweep.png"].axes
    curves = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}
    label = "{k} ({f})" if len(fields) > 1 else "{k}"
    assert curves == {
        label.format(k=k, f=f): ([0.0, 0.5], [metrics[0.0, f][i], metrics[0.5, f][i]])
        for f in fields
        for i, k in enumerate(["R@1", "R@5"])
    }
    assert (tmp_path / "alpha_sweep.png").stat().st_size > 1000


def test_pseudo_recall_reads_the_kb_given_or_is_skipped_without_one_and_metrics_md_is_the_table(
    tiny_index_dir, tiny_world, tmp_path, monkeypatch, encoders
):
    real_load = ev.MultimodalIndex.load
    monkeypatch.setattr(ev.MultimodalIndex, "load", lambda p, **k: real_load(p, *encoders))
    q = tiny_world / "test.jsonl"
    lines = []
    args = dict(index=str(tiny_index_dir), queries=str(q), alpha=0.5)
    seen = []  # (index, ranking, section texts) of each evaluation
    real_evaluate = ev.evaluate_ranked
    monkeypatch.setattr(
        ev, "evaluate_ranked", lambda i, rk, *a: seen.append((i, rk, a[-1])) or real_evaluate(i, rk, *a)
    )
    own = ev.run(EvalArgs(**args, out=str(tmp_path / "own")), log=lines.append)["results"]["0.5"]["question"]
    assert own["PR@20"] > own["PR@1"] > 0
    ((index, ranking, texts),) = seen  # the text of every section ranked in a question's top 20 is read
    assert all(index.entry_ids[row] in texts for rk in ranking for row in rk.rows[:20])
    assert not any("no row in the index" in x or "have no answers" in x for x in lines)  # every question has both
    kb = [{**r, "text": ""} for r in map(json.loads, open(tiny_world / "kb.jsonl", encoding="utf-8"))]
    write_rows(tmp_path / "kb.jsonl", kb)  # no section holds an answer
    blank = ev.run(EvalArgs(**args, kb=str(tmp_path / "kb.jsonl"), out=str(tmp_path / "blank")), **QUIET)
    blank = blank["results"]["0.5"]["question"]
    assert blank == {**own, "PR@1": 0.0, "PR@5": 0.0, "PR@10": 0.0, "PR@20": 0.0}
    lines.clear()
    missing = ev.run(EvalArgs(**args, kb=str(tmp_path / "none.jsonl"), out=str(tmp_path / "none")), log=lines.append)
    assert missing["results"]["0.5"]["question"] == {k: v for k, v in own.items() if not k.startswith("PR@")}
    assert f"pseudo-recall skipped: KB file {tmp_path / 'none.jsonl'} not found (pass --kb)" in lines
    table = report.format_table(missing["results"]["0.5"], [1, 5, 10, 20])
    assert (tmp_path / "none" / "metrics.md").read_text(encoding="utf-8") == f"α = 0.5\n\n{table}\n"


def test_questions_without_a_readable_image_are_named_and_none_left_is_refused(
    tiny_index_dir, tiny_world, tmp_path, monkeypatch, encoders
):
    real_load = ev.MultimodalIndex.load
    monkeypatch.setattr(ev.MultimodalIndex, "load", lambda p, **k: real_load(p, *encoders))
    rows = [json.loads(x) for x in open(tiny_world / "test.jsonl", encoding="utf-8")][:7]
    for i, r in enumerate(rows[:6]):
        (tmp_path / f"broken{i}.png").write_bytes(b"not a png")
        r["image"] = str(tmp_path / f"broken{i}.png")
    rows[6]["entity_id"] = "E9999"
    q = write_rows(tmp_path / "q.jsonl", rows)
    lines = []
    res = ev.run(
        EvalArgs(
            index=str(tiny_index_dir), queries=str(q), alpha=0.5, images_root=str(tiny_world), out=str(tmp_path / "ev")
        ),
        log=lines.append,
    )
    assert res["excluded"] == {"image unreadable": 6} and res["gold_not_in_index"] == 1
    named = [x for x in lines if x.startswith("excluded: ")]
    assert len(named) == 5 and all("broken" in x for x in named)  # the first five are named
    assert "1 of 1 question(s) have a gold entity with no row in the index: counted as misses" in lines
    write_rows(q, rows[:6])
    with pytest.raises(ValueError, match=re.escape(f"no question in {q} has a readable image")):
        run(tiny_index_dir, q, tmp_path, alpha=0.5, images_root=str(tiny_world))
