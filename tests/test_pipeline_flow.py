"""The pipeline's per-batch flow (gate.pipeline.run.run_batch, rag_path) and its section ranker
(gate.pipeline.stages.SectionRanker) with stand-in stages: which answer each question ends with, what the Inspector and
the generator read, which section is chosen — in milliseconds, where tests/test_pipeline.py runs the tiny models."""

from types import SimpleNamespace

import numpy as np
import pytest

from gate.pipeline.run import context_of, run_batch
from gate.pipeline.stages import SectionRanker
from retrieval.ranking import Hit

QUESTIONS = [
    {"id": "q0", "question": "Q0", "answers": ["a0"], "entity_id": "E0"},
    {"id": "q1", "question": "Q1", "answers": ["a1"], "entity_id": "E1", "evidence_section_id": 1},
    {"id": "q2", "question": "Q2", "answers": ["a2"], "entity_id": "E2"},
]


def entry(entity, section):
    return {
        "entry_id": f"{entity}#s{section}",
        "entity_id": entity,
        "title": entity,
        "section": section,
        "section_title": f"S{section}",
        "text": f"text of {entity} {section}",
    }


def stages(gate_scores=None, verdicts=None, mct=None, baselines=True, generator=None):
    """Stand-ins: question i retrieves E{i} first, then E9; the chosen section is the article's section 1; the alone
    answer is "alone i"; the generator answers "a{i}" (right) from the context; the Inspector gives ``verdicts``."""
    calls = {}

    def log(name, value):
        calls.setdefault(name, []).append(value)
        return value

    def retrieve(images, queries, entity_ids):
        log("queries", list(queries))
        hits = [[Hit(q.split()[0].replace("Q", "E"), "", 0.5), Hit("E9", "", 0.4)] for q in queries]
        return np.zeros((len(queries), 2)), hits, [1] * len(queries)

    def first_stage(images, questions, hits):
        return [[entry(h.entity_id, 0) for h in hs] for hs in hits]

    def within(images, questions, text_emb, entity_ids):
        return [entry(log("article", e), 1) for e in entity_ids]

    def generate(images, questions, contexts):
        log("generated", list(zip(questions, contexts)))
        return [(generator or {}).get(q, (f"a{q[1]}", None)) for q in questions]

    def inspect(images, questions, contexts):
        log("inspected", list(zip(questions, contexts)))
        return [dict(verdicts[q]) for q in questions]

    def judge(pairs):
        for r, a in pairs:
            a["correct"] = a["answer"] in r["answers"]
            a["token_accuracy"] = float(a["correct"])

    gate = None
    if gate_scores is not None:  # γ = 0.5
        gate = type("Gate", (), {"threshold": 0.5, "__call__": lambda self, i, q: [gate_scores[x] for x in q]})()
    st = SimpleNamespace(
        args=SimpleNamespace(baselines=baselines, gate="hkb" if gate else "always"),
        gate=gate,
        answer=lambda images, questions: [f"alone {q[1]}" for q in questions],
        refiner=SimpleNamespace(refine=lambda images, questions, batch_size: [f"{q} refined" for q in questions]),
        retrieve=retrieve,
        rerank=SimpleNamespace(first_stage=first_stage, within=within),
        consistency=mct,
        inspect=inspect if verdicts is not None else None,
        generate=generate,
        judge=judge,
    )
    return st, calls


def by_id(records):
    return {r["id"]: r for r in records}


def test_the_gate_routes_each_question_and_both_paths_answer_with_baselines():
    st, calls = stages(gate_scores={"Q0": 0.2, "Q1": 0.5, "Q2": 0.9})
    out = by_id(run_batch(st, QUESTIONS, [None] * 3))
    # γ = 0.5: retrieve at or above it; the RAG answer is right, the VLM's own wrong
    assert {q: (r["gate"], r["answer"], r["correct"]) for q, r in out.items()} == {
        "q0": ({"score": 0.2, "retrieve": False}, "alone 0", False),
        "q1": ({"score": 0.5, "retrieve": True}, "a1", True),
        "q2": ({"score": 0.9, "retrieve": True}, "a2", True),
    }
    assert all(r["alone"]["answer"] == f"alone {q[1]}" and r["rag"]["answer"] == f"a{q[1]}" for q, r in out.items())
    assert calls["queries"] == [["Q0 refined", "Q1 refined", "Q2 refined"]]  # the refined question is the query
    assert calls["article"] == ["E0", "E1", "E2"]  # the first stage's top article
    assert calls["generated"] == [[(f"Q{i}", f"E{i} - S1: text of E{i} 1") for i in range(3)]]
    r1 = out["q1"]["rag"]
    assert (r1["retrieved"], r1["gold_rank"], r1["section"], r1["section_right"]) == (["E1", "E9"], 1, "E1#s1", True)
    assert out["q1"]["rag"]["inspector"] is None and "without_inspector" not in out["q1"]["rag"]
    assert set(out["q0"]["latency"]) == {"gate", "answer alone", "refine", "retrieve", "rerank", "section", "generate"}


def test_without_baselines_each_question_takes_its_own_path_only():
    st, calls = stages(gate_scores={"Q0": 0.2, "Q1": 0.7, "Q2": 0.1}, baselines=False)
    out = by_id(run_batch(st, QUESTIONS, [None] * 3))
    assert (out["q0"]["rag"], out["q0"]["answer"]) == (None, "alone 0")
    assert (out["q1"]["alone"], out["q1"]["answer"]) == (None, "a1")
    assert calls["queries"] == [["Q1 refined"]]
    assert set(out["q0"]["latency"]) == {"gate", "answer alone"}
    assert set(out["q1"]["latency"]) == {"gate", "refine", "retrieve", "rerank", "section", "generate"}


@pytest.mark.parametrize("baselines", [True, False])
def test_an_inspector_fail_answers_with_its_own_answer(baselines):
    verdicts = {
        "Q0": {"pass": True, "p_pass": 0.9, "answer": None},
        "Q1": {"pass": False, "p_pass": 0.2, "answer": "inspector says a1"},
        "Q2": {"pass": False, "p_pass": 0.1, "answer": None},
    }
    st, calls = stages(verdicts=verdicts, baselines=baselines)
    out = by_id(run_batch(st, QUESTIONS, [None] * 3))
    assert out["q0"]["answer"] == "a0" and out["q1"]["answer"] == "inspector says a1"
    assert out["q2"]["rag"]["answer"] is None and "no parseable answer" in out["q2"]["rag"]["failed"]
    assert calls["inspected"][0][1] == ("Q1", "E1 - S1: text of E1 1")  # the section the generator would read
    if baselines:  # the generator answered every question: the run without the Inspector comes from the same run
        assert [q for q, _ in calls["generated"][0]] == ["Q0", "Q1", "Q2"]
        assert {q: r["rag"]["without_inspector"]["answer"] for q, r in out.items()} == {
            "q0": "a0",
            "q1": "a1",
            "q2": "a2",
        }
        assert out["q1"]["rag"]["without_inspector"]["correct"] is True
    else:
        assert [q for q, _ in calls["generated"][0]] == ["Q0"]
        assert "without_inspector" not in out["q1"]["rag"] and "without_inspector" in out["q0"]["rag"]
    assert "generate" in out["q0"]["latency"] and "generate" not in out["q1"]["latency"]


def test_a_generator_that_failed_is_recorded_with_why():
    st, _ = stages(generator={"Q1": (None, "generator failed after 3 attempts: URLError")})
    out = by_id(run_batch(st, QUESTIONS, [None] * 3))
    assert out["q1"]["rag"]["answer"] is None and out["q1"]["rag"]["failed"].startswith("generator failed")
    assert out["q1"]["correct"] is False


@pytest.mark.parametrize(
    "strategy,docs,summary,fallback,article,context,section",
    [
        ("filter", [0, 1], None, False, "E1", "E1 - S0: text of E1 0\n\nE9 - S0: text of E9 0", ["E1#s0", "E9#s0"]),
        ("merge", [1, 0], "they agree", False, "E9", "they agree", ["E9#s0", "E1#s0"]),
        ("rerank", [1, 0], None, False, "E9", "E9 - S1: text of E9 1", "E9#s1"),
        ("filter", [0], None, True, "E1", "E1 - S1: text of E1 1", "E1#s1"),  # fell back: the first stage's choice
    ],
)
def test_mct_decides_what_the_generator_reads(strategy, docs, summary, fallback, article, context, section):
    decision = {"strategy": strategy, "docs": docs, "summary": summary, "fallback": fallback, "listed": docs}
    read = []

    def mct(images, questions, sections):
        read.append(sections)
        return [decision] * len(questions)

    st, calls = stages(mct=mct)
    out = by_id(run_batch(st, QUESTIONS[1:2], [None]))
    assert read == [[["E1 - S0: text of E1 0", "E9 - S0: text of E9 0"]]]  # the first stage's sections, in order
    assert calls["article"] == [article] and calls["generated"] == [[("Q1", context)]]
    rag = out["q1"]["rag"]
    assert rag["section"] == section and rag["consistency"] == decision
    assert rag["section_right"] is (section == "E1#s1")  # q1's evidence: section 1 of E1
    # q0 names no evidence section: any section of E0 shown is right, one of them among others too
    (q0,) = run_batch(stages(mct=mct)[0], QUESTIONS[:1], [None])
    assert q0["rag"]["section_right"] is (strategy != "rerank")


def test_context_of_is_the_chosen_section_unless_mct_lists_others():
    chosen, picked = entry("E1", 1), [entry("E2", 0), entry("E3", 2)]
    joined = "E2 - S0: text of E2 0\n\nE3 - S2: text of E3 2"
    assert context_of(None, chosen, picked) == ([chosen], "E1 - S1: text of E1 1")
    for strategy, summary, fallback, expected in [
        ("filter", None, False, (picked, joined)),
        ("merge", "sum", False, (picked, "sum")),
        ("rerank", None, False, ([chosen], "E1 - S1: text of E1 1")),
        ("merge", None, True, ([chosen], "E1 - S1: text of E1 1")),
        ("filter", None, True, ([chosen], "E1 - S1: text of E1 1")),
    ]:
        mct = {"strategy": strategy, "summary": summary, "fallback": fallback}
        assert context_of(mct, chosen, picked) == expected, strategy


# ---------------------------------------------------------------- the section ranker


class Store:
    path = "store.sqlite"

    def __init__(self, articles):
        self.articles = articles

    def entry(self, entry_id):
        entity, _, s = entry_id.partition("#s")
        return next((e for e in self.articles.get(entity, []) if e["section"] == int(s)), None)

    def sections(self, entity_id, skip_titles=()):
        return [
            e
            for e in self.articles[entity_id]
            if not any(t in e["section_title"].lower() for t in [t.lower() for t in skip_titles])
        ]


class Scores:
    """A reranker whose score of a section is given by the section's text."""

    def __init__(self, by_text):
        self.by_text, self.asked = by_text, []

    def score(self, images, queries, sections):
        self.asked.append((list(queries), sections))
        return [np.array([self.by_text[s] for s in secs]) for secs in sections]


def ranker(articles, vectors, reranker=None, text_reranker=None, beta1=0.6, beta2=0.2):
    encoded = []

    def encode_documents(texts):
        encoded.extend(texts)
        return np.array([vectors[t] for t in texts], dtype=float)

    r = SectionRanker.__new__(SectionRanker)
    r.index = SimpleNamespace(manifest={"text_template": "{section_title}|{text}"}, encode_documents=encode_documents)
    r.beta1, r.beta2, r.store = beta1, beta2, Store(articles)
    r.reranker, r.text_reranker, r.section_emb = reranker, text_reranker, {}
    return r, encoded


def sec(entity, section, title, text):
    return {"entry_id": f"{entity}#s{section}", "entity_id": entity, "section": section, "title": entity,
            "section_title": title, "text": text}  # fmt: skip


ARTICLES = {
    "A": [sec("A", 0, "Intro", "a0"), sec("A", 1, "Diet", "a1"), sec("A", 2, "References", "a2")],
    "B": [sec("B", 0, "Intro", "b0")],
    "C": [sec("C", 0, "External links", "c0"), sec("C", 1, "Notes and references", "c1")],
}


def test_the_first_stage_mixes_retrieval_and_reranker_by_beta1():
    hits = [[Hit("A", "A#s0", 0.50), Hit("B", "B#s0", 0.48), Hit("C", "C#s1", 0.47)]]
    plain, _ = ranker(ARTICLES, {})
    assert [e["entry_id"] for e in plain.first_stage([None], ["q"], hits)[0]] == ["A#s0", "B#s0", "C#s1"]
    texts = {"A - Intro: a0": 0.1, "B - Intro: b0": 0.9, "C - Notes and references: c1": 0.1}
    rr = Scores(texts)
    mixed, _ = ranker(ARTICLES, {}, reranker=rr, beta1=0.6)
    # 0.6·retrieval + 0.4·reranker: A 0.34, B 0.648, C 0.322
    assert [e["entry_id"] for e in mixed.first_stage([None], ["q"], hits)[0]] == ["B#s0", "A#s0", "C#s1"]
    assert rr.asked == [(["q"], [list(texts)])]  # the question, and each section as the models read it
    kept, _ = ranker(ARTICLES, {}, reranker=Scores(texts), beta1=1.0)  # β1 = 1: the retrieval order
    assert [e["entry_id"] for e in kept.first_stage([None], ["q"], hits)[0]] == ["A#s0", "B#s0", "C#s1"]
    tie, _ = ranker(ARTICLES, {}, reranker=Scores(dict.fromkeys(texts, 0.5)), beta1=0.0)  # a tie keeps retrieval's
    assert [e["entry_id"] for e in tie.first_stage([None], ["q"], hits)[0]] == ["A#s0", "B#s0", "C#s1"]
    with pytest.raises(ValueError, match=r"no entry 'D#s0' \(1 missing\): it was built from another KB"):
        plain.first_stage([None], ["q"], [[Hit("D", "D#s0", 0.5)]])


def test_within_the_article_text_similarity_and_text_reranker_by_beta2():
    vectors = {"Intro|a0": [1.0, 0.0], "Diet|a1": [0.6, 0.8], "References|a2": [1.0, 0.0], "Intro|b0": [0.0, 1.0]}
    vectors |= {"External links|c0": [1.0, 0.0], "Notes and references|c1": [0.0, 1.0]}
    query = np.array([[0.8, 0.6], [0.0, 1.0]])  # A's a0: 0.8, a1: 0.96 by similarity
    plain, encoded = ranker(ARTICLES, vectors)
    assert [e["entry_id"] for e in plain.within([None] * 2, ["q", "r"], query, ["A", "B"])] == ["A#s1", "B#s0"]
    assert sorted(encoded) == ["Diet|a1", "Intro|a0", "Intro|b0"]  # "References" is no evidence: left out
    plain.within([None], ["q"], query[:1], ["A"])
    assert len(encoded) == 3  # each section embedded once per run
    # an article of references only still has something to show
    assert plain.within([None], ["q"], query[1:], ["C"])[0]["entry_id"] == "C#s1"
    text = Scores({"A - Intro: a0": 1.0, "A - Diet: a1": 0.0})
    # (1 − β2)·similarity + β2·reranker: at β2 = 0.2, a0 0.84 and a1 0.768; at β2 = 0.1, a0 0.82 and a1 0.864
    for beta2, expected in [(0.2, "A#s0"), (0.1, "A#s1"), (0.0, "A#s1"), (1.0, "A#s0")]:
        mixed, _ = ranker(ARTICLES, vectors, text_reranker=text, beta2=beta2)
        assert mixed.within([None], ["q"], query[:1], ["A"])[0]["entry_id"] == expected, beta2
    assert text.asked[-1] == (["q"], [["A - Intro: a0", "A - Diet: a1"]])


def test_the_clock_gives_each_stage_its_seconds_per_question(monkeypatch):
    import gate.pipeline.run as run_module
    from gate.pipeline.run import Clock

    ticks = iter([10.0, 12.0, 20.0, 26.0, 30.0, 31.0])
    monkeypatch.setattr(run_module, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    bar = SimpleNamespace(n=0, update=lambda n: setattr(bar, "n", bar.n + n))
    clock = Clock({"generate": bar})
    assert clock.time("generate", 2, lambda x, y=0: x + y, 1, y=2) == 3
    assert clock.time_rows("generate", lambda xs: [x * 10 for x in xs], [2, 0], [1, 2, 3]) == {2: 30, 0: 10}
    assert clock.time_rows("generate", lambda xs: pytest.fail("not called for no rows"), [], [1]) == {}
    clock.time("gate", 4, lambda: None)
    # generate: (12 − 10) + (26 − 20) seconds over 2 + 2 questions; gate: 1 second over 4
    assert clock.per_question() == {"generate": pytest.approx(2.0), "gate": pytest.approx(0.25)}
    assert bar.n == 4


def test_no_question_to_retrieve_for_calls_no_rag_stage():
    from gate.pipeline.run import stage_names

    st, calls = stages(gate_scores={"Q0": 0.1, "Q1": 0.2, "Q2": 0.3}, baselines=False)
    out = run_batch(st, QUESTIONS, [None] * 3)
    assert [r["answer"] for r in out] == ["alone 0", "alone 1", "alone 2"] and calls == {}
    assert stage_names(False) == [
        "gate",
        "answer alone",
        "refine",
        "retrieve",
        "rerank",
        "section",
        "inspect",
        "generate",
    ]
    assert stage_names(True)[5:7] == ["consistency", "section"] and len(stage_names(True)) == 9


FAILED = "generator failed after 3 attempts: URLError"


@pytest.mark.parametrize(
    "record,again",
    [
        ({"id": "q", "skipped": "image file missing"}, True),
        ({"id": "q", "alone": {"failed": FAILED}, "rag": None}, True),
        ({"id": "q", "alone": None, "rag": {"failed": FAILED}}, True),
        ({"id": "q", "alone": {"answer": "x"}, "rag": {"answer": "y", "without_inspector": {"failed": FAILED}}}, True),
        ({"id": "q", "alone": {"answer": None, "failed": "empty answer"}, "rag": None}, False),  # the model's answer
        ({"id": "q", "alone": {"answer": "x"}, "rag": {"answer": None, "failed": "the Inspector failed"}}, False),
        ({"id": "q", "alone": {"answer": "x"}, "rag": None}, False),
    ],
)
def test_a_prediction_is_made_again_for_a_missing_image_or_a_failed_request(record, again):
    from gate.pipeline.run import unfinished

    assert unfinished(record) is again


def test_the_threshold_grid_spans_the_gates_scale_and_one_past_its_highest_score():
    from gate.pipeline.run import threshold_grid

    binary = threshold_grid([1.0, 0.2, 0.7])  # a float32 softmax gives 1.0 exactly: still a probability
    assert binary[:21] == pytest.approx(np.linspace(0, 1, 21)) and binary[21] == np.nextafter(1.0, 2.0)
    low = threshold_grid([0.3, -0.0])
    assert (low[0], low[-1]) == (0.0, np.nextafter(1.0, 2.0))
    skb = threshold_grid([2.5, 5.0, 0.99999994])  # skb's expected digit, its probabilities summing to under 1
    assert skb[0] == pytest.approx(0.99999994) and skb[1:21] == pytest.approx(np.linspace(1, 5, 21)[1:])
    assert skb[21] == np.nextafter(5.0, 6.0)


def test_the_report_writes_its_files_and_names_the_gate(tmp_path):
    import json

    from gate.pipeline.end_to_end import summarize
    from gate.pipeline.run import report

    def rec(i, alone, rag, retrieve, score):
        rag = {"answer": "r", "correct": rag, "token_accuracy": 0.0, "section_right": True, "inspector": None}
        return {"id": f"q{i}", "split": "test", "gate": {"retrieve": retrieve, "score": score}, "latency": {},
                "alone": {"answer": "a", "correct": alone, "token_accuracy": 0.0}, "rag": rag}  # fmt: skip

    records = [rec(0, True, False, False, 0.2), rec(1, False, True, True, 0.8)]
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "gate.json").write_text(json.dumps({"variant": "hkb"}))
    (tmp_path / "placement.json").write_text(json.dumps({"gate": "cpu float32"}))
    args = SimpleNamespace(gate=str(gate))
    metrics = report(records, tmp_path, args, log=lambda *a: None)
    assert json.loads((tmp_path / "metrics.json").read_text()) == metrics
    assert metrics["placement"] == {"gate": "cpu float32"} and metrics["accuracy"] == summarize(records)["accuracy"]
    assert len(metrics["threshold_curve"]) == 22
    assert f"| pipeline (gate: hkb, {gate}) | 100.0 | 50.0 |" in (tmp_path / "metrics.md").read_text()
    assert (tmp_path / "accuracy_vs_retrieval.png").stat().st_size > 0
    # without baselines (each question down its own path): the chosen answers only, no curve and no figure
    out = tmp_path / "chosen"
    out.mkdir()
    chosen = [
        {**records[0], "rag": None, "answer": "a", "correct": True},
        {**records[1], "alone": None, "answer": "r", "correct": True},
    ]
    metrics = report([*chosen, {"id": "q2", "skipped": "x"}], out, SimpleNamespace(gate="always"), log=lambda *a: None)
    assert (metrics["accuracy"], metrics["baselines"], "threshold_curve" in metrics) == (1.0, {}, False)
    assert (metrics["n"], metrics["skipped"]) == (2, 1)
    # with baselines and no gate score (always / never): no curve to draw
    unscored = [{**r, "gate": {"retrieve": True, "score": None}} for r in records]
    assert "threshold_curve" not in report(unscored, tmp_path, SimpleNamespace(gate="always"), log=lambda *a: None)
    assert "| pipeline (gate: always) | 100.0 | 50.0 |" in (out / "metrics.md").read_text()
    assert "placement" not in metrics
    assert report([{"id": "q", "skipped": "x"}], out, SimpleNamespace(gate="never"), log=lambda *a: None)["n"] == 0
    assert (out / "metrics.md").read_text() == "no answered questions\n"


def test_questions_without_answers_are_counted_or_refused_by_the_rule():
    from gate.pipeline.run import count_unanswered

    rows = [
        {"id": "a", "question": "?", "answers": ["x"]},
        {"id": "b", "question": "?"},
        {"id": "c", "question": "?", "answer_eval": ["y"]},
    ]
    said = []
    assert count_unanswered(rows, "infoseek", "q.jsonl", said.append) == {"b"}
    assert said == [
        "1 of 3 question(s) in q.jsonl have no answers (nor answer_eval): every answer to them is scored wrong, a "
        "miss in accuracy (unless it is skipped)"
    ]
    said.clear()
    assert count_unanswered(rows[:1], "evqa", "q.jsonl", said.append) == set() and said == []
    with pytest.raises(
        ValueError, match=r"q.jsonl: 1 question\(s\) have no answers .* the evqa rule cannot score \(first: b\)"
    ):
        count_unanswered(rows, "evqa", "q.jsonl", said.append)
    typed = [{**rows[1], "question_type": "String"}]
    with pytest.raises(ValueError, match="the infoseek rule cannot score"):
        count_unanswered(typed, "infoseek", "q.jsonl", said.append)


def test_each_question_of_a_batch_reads_its_own_articles_similarities():
    vectors = {"Intro|a0": [1.0, 0.0], "Diet|a1": [0.6, 0.8], "Intro|b0": [0.0, 1.0]}
    plain, _ = ranker(ARTICLES, vectors)
    chosen = plain.within([None] * 2, ["q", "r"], np.array([[0.0, 1.0], [1.0, 0.0]]), ["B", "A"])
    assert [e["entry_id"] for e in chosen] == ["B#s0", "A#s0"]  # A by a0 · (1, 0) = 1 over a1's 0.6


def test_the_judge_scores_by_the_benchmarks_rule_and_tells_no_answer_apart():
    from gate.pipeline.stages import Judge

    args = SimpleNamespace(metric="infoseek", bem="kortukov/answer-equivalence-bem", bem_device=None, dtype=None)
    judge = Judge(args, "cpu")
    assert judge.bem is None  # BEM is E-VQA's
    pairs = [
        ({"question": "?", "answers": ["Eiffel Tower"]}, {"answer": "the eiffel tower"}),
        ({"question": "?", "answers": ["Eiffel Tower"]}, {"answer": "Eiffel"}),
        ({"question": "?", "answers": ["Eiffel Tower"]}, {"answer": None}),
        ({"question": "?"}, {"answer": "x"}),
    ]
    judge(pairs)
    assert [(a["correct"], a["token_accuracy"]) for _, a in pairs] == [
        (True, 1.0),
        (False, 0.5),
        (False, 0.0),
        (False, 0.0),
    ]
    judge([])  # nothing to judge: no call
    assert Judge(SimpleNamespace(**{**args.__dict__, "metric": "evqa", "bem": "none"}), "cpu").bem is None


@pytest.mark.parametrize(
    "variant,threshold,refused",
    [
        ("hkb", None, False),
        ("hkb", 0.0, False),
        ("hkb", 1.0, False),
        ("hkb", 3.0, True),
        ("kbm", -0.1, True),
        ("skb", 0.5, True),
        ("skb", 1.0, False),
        ("skb", 5.0, False),
        ("skb", 5.5, True),
    ],
)
def test_a_gate_threshold_off_the_gates_scale_is_refused_before_any_model_loads(
    tmp_path, monkeypatch, variant, threshold, refused
):
    """γ is a probability for the binary gates and skb's expected digit 1–5: an skb gate at the binary gates' 0.5
    sent every question to retrieval, a binary gate at 3 none, without a word."""
    import gate.pipeline.arguments as pa
    from common.files import write_json_atomic
    from gate.scoring import GATE_FILE

    gate, model, queries = tmp_path / "gate", tmp_path / "vlm", tmp_path / "q.jsonl"
    for folder in (gate, model):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    write_json_atomic(gate / GATE_FILE, {"variant": variant})
    queries.write_text("")
    monkeypatch.setattr(pa, "require_index", lambda index: None)  # no index needed to check γ
    args = pa.PipelineArgs(
        queries=str(queries),
        out=str(tmp_path / "out"),
        gate=str(gate),
        gate_threshold=threshold,
        answerer=str(model),
        generator=str(model),
        index="idx",
        refiner="none",
    )
    if refused:
        with pytest.raises(ValueError, match=rf"--gate_threshold {threshold:g} is off the {variant} gate's scale"):
            pa.validate(args)
    else:
        pa.validate(args)
