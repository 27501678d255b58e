"""End-to-end metrics and gate baselines on hand-computed records (pure)."""

import pytest

from gate.pipeline.end_to_end import baselines, format_table, split_accuracy, summarize, system_correct, threshold_curve


def rec(alone, rag, retrieve, score=None, split="test", section_right=True, inspector=None, **kw):
    return {
        "id": kw.get("id", "q"),
        "split": split,
        "gate": {"retrieve": retrieve, "score": score},
        "alone": {"correct": alone, "token_accuracy": float(alone)},
        "rag": {"correct": rag, "token_accuracy": float(rag), "section_right": section_right, "inspector": inspector},
        "latency": {"gate": 0.1, "generate": 0.3},
    }


# alone right on 0 and 1; RAG right on 1, 2 and 3; the gate retrieves for 2 and 3 (perfect) and for 1 (harmless)
RECORDS = [
    rec(True, False, False, 0.2),
    rec(True, True, True, 0.6),
    rec(False, True, True, 0.9),
    rec(False, True, True, 0.7),
    rec(False, False, False, 0.4),
]


def test_system_correct_mixes_the_two_paths():
    assert system_correct(RECORDS, [r["gate"]["retrieve"] for r in RECORDS]).tolist() == [True, True, True, True, False]


def test_baselines_hand_computed():
    b = baselines(RECORDS, ratio=0.6)
    assert b["No RAG"] == {"accuracy": 0.4, "retrieval_ratio": 0.0}
    assert b["All RAG"] == {"accuracy": 0.6, "retrieval_ratio": 1.0}
    # the oracle retrieves exactly where the VLM alone was wrong (2, 3, 4): right on 0, 1, 2, 3
    assert b["oracle gate"] == {"accuracy": 0.8, "retrieval_ratio": 0.6}
    assert b["random gate"]["retrieval_ratio"] == 0.6 and 0.4 <= b["random gate"]["accuracy"] <= 0.8


def test_random_gate_averages_over_seeds():
    # with alone always right and RAG always wrong, a random gate at ratio r scores exactly 1 − r whatever the seed
    recs = [rec(True, False, False) for _ in range(10)]
    assert baselines(recs, 0.3)["random gate"]["accuracy"] == pytest.approx(0.7)


def test_summarize():
    m = summarize(RECORDS + [{"id": "gone", "skipped": "image file missing"}])
    assert m["n"] == 5 and m["skipped"] == 1
    assert m["accuracy"] == pytest.approx(0.8) and m["retrieval_ratio"] == pytest.approx(0.6)
    assert m["token_accuracy"] == pytest.approx(0.8)
    assert m["latency_s"] == {"gate": pytest.approx(0.1), "generate": pytest.approx(0.3)}
    assert m["inspector_confusion"] is None and m["section_right"] == 1.0
    assert "| gated pipeline | 80.0 | 60.0 |" in format_table(m)


def test_stage_latency_means_the_same_with_and_without_baselines():
    """latency_s: seconds per question of each stage over the questions that went through it, whichever kind of run
    reports it (without baselines a stage's mean was taken over every question, as if the others took 0 s there)."""
    from gate.pipeline.run import _summarize_chosen

    went = {"id": "a", "correct": True, "gate": {"retrieve": True}, "latency": {"gate": 0.1, "retrieve": 1.0}}
    alone = {"id": "b", "correct": False, "gate": {"retrieve": False}, "latency": {"gate": 0.1, "answer alone": 0.4}}
    assert _summarize_chosen([went, alone])["latency_s"] == {
        "gate": pytest.approx(0.1),
        "retrieve": pytest.approx(1.0),
        "answer alone": pytest.approx(0.4),
    }


def test_inspector_confusion_against_the_oracle():
    recs = [
        rec(False, True, True, inspector={"pass": True}, section_right=True),
        rec(False, False, True, inspector={"pass": True}, section_right=False),
        rec(False, False, True, inspector={"pass": False}, section_right=False),
        rec(False, False, True, inspector={"pass": False}, section_right=False),
    ]
    m = summarize(recs)
    assert m["inspector_confusion"] == {
        "pass_right": 1,
        "pass_wrong": 1,
        "fail_right": 0,
        "fail_wrong": 2,
        "routing_accuracy": 0.75,
    }
    assert m["without_inspector"] is None  # no record carries the answer without the Inspector
    table = format_table(m)
    assert "| PASS | 1 | 1 |" in table and "| FAIL | 0 | 2 |" in table and "routing accuracy: 75.0 %" in table


def test_the_same_run_without_the_inspector():
    """Question 1: the Inspector FAILed a right section and its own answer was wrong, the generator's right; question
    2: it FAILed a wrong section and answered right itself, the generator wrong."""
    recs = [
        rec(False, False, True, inspector={"pass": False}),
        rec(False, True, True, inspector={"pass": False}),
        rec(True, True, False, inspector={"pass": True}),
    ]
    for r, plain in zip(recs, (True, False, True)):
        r["rag"]["without_inspector"] = {"answer": "x", "correct": plain}
    m = summarize(recs)
    assert m["accuracy"] == pytest.approx(2 / 3)  # with: wrong, right, right (alone)
    assert m["without_inspector"] == {
        "accuracy": pytest.approx(2 / 3),
        "All RAG": pytest.approx(2 / 3),
        "oracle gate": pytest.approx(2 / 3),
    }
    recs[1]["rag"]["without_inspector"]["correct"] = True
    assert summarize(recs)["without_inspector"]["All RAG"] == pytest.approx(1.0)
    assert "| All RAG, without the Inspector | 100.0 | 100.0 |" in format_table(summarize(recs))


def test_split_accuracy_with_the_infoseek_harmonic_mean():
    recs = [
        rec(True, True, False, split="val_unseen_question"),
        rec(False, False, False, split="val_unseen_question"),
        rec(True, True, False, split="val_unseen_entity"),
        rec(True, True, False, split="val_unseen_entity"),
        rec(True, True, False, split="unseen_entity"),
        rec(False, False, False, split="unseen_entity"),
    ]
    for r in recs:
        r["question_type"] = "String"
    acc = split_accuracy(recs, system_correct(recs, [False] * 6))
    assert acc["unseen_question"] == 0.5 and acc["unseen_entity"] == 0.75
    assert acc["hm"] == pytest.approx(2 * 0.5 * 0.75 / 1.25)
    assert "hm" not in split_accuracy(recs[:2], [True, False])
    recs[3]["question_type"] = None  # the official final score needs every question's type
    assert "hm" not in split_accuracy(recs, system_correct(recs, [False] * 6))


def test_hop_accuracy_is_the_e_vqa_report():
    from gate.pipeline.end_to_end import hop_accuracy

    recs = [rec(ok, ok, False) for ok in (True, True, False, True)]
    for r, t in zip(recs, ["templated", "multi_answer", "2_hop", "automatic"]):
        r["question_type"] = t
    acc = hop_accuracy(recs, system_correct(recs, [False] * 4))
    assert acc == {"single_hop": 1.0, "two_hop": 0.0, "overall": 0.75}
    assert hop_accuracy(recs[:1] and [rec(True, True, False)], [True]) is None  # no E-VQA types: no such report


def test_threshold_curve_sweeps_one_scoring_pass():
    curve = threshold_curve(RECORDS, [0.0, 0.5, 0.8, 1.0])
    assert [c["retrieval_ratio"] for c in curve] == pytest.approx([1.0, 0.6, 0.2, 0.0])
    assert [c["accuracy"] for c in curve] == pytest.approx([0.6, 0.8, 0.6, 0.4])


@pytest.mark.parametrize(
    "scores",
    [
        [1.0, 0.2],  # a float32 softmax gives 1.0 exactly: the curve stopped at retrieval ratio 0.5, not No RAG's 0
        [5.0, 2.5],  # skb with all its probability on "5"
        [0.99999994, 3.0],  # skb's probabilities summing to just under 1: the curve never reached All RAG
        [0.3, 0.7],
        [float("nan"), 3.0],  # a NaN made the scale depend on the order of the scores (it never retrieves itself)
    ],
)
def test_the_threshold_curve_runs_from_all_rag_to_no_rag(scores, tmp_path):
    from types import SimpleNamespace

    from gate.pipeline.run import report

    records = [rec(True, False, s >= 0.5, s, id=f"q{i}") for i, s in enumerate(scores)]
    curve = report(records, tmp_path, SimpleNamespace(gate="always"), log=lambda *a: None)["threshold_curve"]
    all_rag = sum(s == s for s in scores) / len(scores)  # a NaN score retrieves at no threshold
    assert (curve[0]["retrieval_ratio"], curve[-1]["retrieval_ratio"]) == (all_rag, 0.0)
    assert [c["threshold"] for c in curve] == sorted(c["threshold"] for c in curve) and len(curve) == 22


def test_without_answers_counts_the_questions_scored_not_the_skipped(tmp_path):
    from types import SimpleNamespace

    from gate.pipeline.run import report

    records = [rec(True, True, True, 0.9, id="a"), rec(False, False, True, 0.9, id="b"), {"id": "c", "skipped": "x"}]
    metrics = report(records, tmp_path, SimpleNamespace(gate="always"), lambda *a: None, without_answers={"b", "c"})
    assert (metrics["n"], metrics["skipped"], metrics["without_answers"]) == (2, 1, 1)


def test_rerank_score_is_the_beta_mix():
    import numpy as np

    from gate.pipeline.rerank import combine, unflatten

    assert combine([1.0, 0.0], [0.0, 1.0], 0.25).tolist() == pytest.approx([0.25, 0.75])
    with pytest.raises(ValueError, match="β"):
        combine([1.0], [0.0], 1.5)
    parts = unflatten(np.arange(5.0), [["a", "b"], [], ["c", "d", "e"]])
    assert [p.tolist() for p in parts] == [[0.0, 1.0], [], [2.0, 3.0, 4.0]]


def test_infoseek_official_figures_count_every_question():
    """A question the pipeline gave no answer for is in the results file as an empty prediction, which InfoSeek's
    official scorer scores like any other: it stays in its split's denominator (wrong here, a String question), and
    metrics.md says how many there were."""
    recs = [
        rec(True, True, False, split="val_unseen_question"),
        rec(False, False, False, split="val_unseen_question"),
        rec(True, True, False, split="val_unseen_question"),
        rec(True, True, False, split="val_unseen_entity"),
        rec(False, True, False, split="val_unseen_entity"),  # right with retrieval only
    ]
    for i, (r, kind) in enumerate(zip(recs, ["String", "Time", "String", "Numerical", "String"])):
        r["id"], r["question_type"] = f"q{i}", kind
        r["alone"]["answer"] = "x"
    recs[1]["alone"].update(answer=None, failed="empty answer")  # no answer: scored as "" (wrong), still counted
    m = summarize(recs)
    info = m["infoseek"]
    assert (info["unseen_question"], info["unseen_entity"], info["final"]) == (66.67, 50.0, 57.14)
    assert info["n"] == {"unseen_question": 3, "unseen_entity": 2}
    assert info["no_answer"] == {"unseen_question": 1, "unseen_entity": 0}
    assert info["per_type"]["unseen_question"] == {"time": 0.0, "numerical": 0.0, "string": 100.0}
    table = format_table(m)
    assert "| gated pipeline (every question; without an answer, an empty prediction: 1) | 66.67 | 50.00 | 57.14 |" in (
        table
    )
    # the baselines' official scores beside the system's (their pooled accuracy is not the table's figure)
    assert m["baselines"]["All RAG"]["accuracy"] == pytest.approx(0.8)
    assert "| No RAG | 66.67 | 50.00 | 57.14 |" in table and "| All RAG | 66.67 | 100.00 | 80.00 |" in table
    assert "| oracle gate | 66.67 | 100.00 | 80.00 |" in table and "| random gate | " not in table.split("InfoSeek")[1]
    assert "every question with its image" in format_table({**m, "skipped": 1})
    assert "| unseen question (3 questions) | unseen entity (2 questions) | final |" in table
    assert "A split with no question scores 0" not in table
    # a run of the first questions only (--limit): the official val file starts with one split, the other scores 0
    one_split = summarize(recs[:3])
    assert (one_split["infoseek"]["unseen_entity"], one_split["infoseek"]["final"]) == (0.0, 0.0)
    assert "unseen entity (0 questions)" in format_table(one_split)
    assert "A split with no question scores 0" in format_table(one_split)
    assert summarize([rec(True, True, False)])["infoseek"] is None  # not InfoSeek questions: no such figures
    # one question converted without its type: the official scorer cannot score it, and every figure went, unsaid
    untyped = [*recs[:4], {**recs[4], "question_type": None}]
    m = summarize(untyped)
    assert m["infoseek"] is None and m["infoseek_untyped"] == ["q4"]
    assert "InfoSeek's official scores are left out: 1 question(s) have no InfoSeek question type" in format_table(m)


def test_a_run_without_baselines_keeps_the_benchmarks_own_figures():
    """baselines: false (each question down its chosen path only) reported pooled accuracy alone: InfoSeek's official
    scores and the per-split figures were gone. They are what the same choices give with baselines."""
    from gate.pipeline.run import _summarize_chosen

    recs = []
    for i, (alone, rag, retrieve, split, kind) in enumerate(
        [
            (True, False, False, "val_unseen_question", "String"),
            (False, True, True, "val_unseen_question", "Time"),
            (False, False, True, "val_unseen_entity", "String"),
            (True, True, False, "val_unseen_entity", "Numerical"),
            (False, True, False, "val_unseen_entity", "String"),
        ]
    ):
        r = rec(alone, rag, retrieve, split=split, id=f"q{i}")
        r["question_type"] = kind
        r["alone"]["answer"] = r["rag"]["answer"] = "x"
        recs.append(r)
    with_baselines = summarize(recs)
    chosen = [
        {
            **r,
            "alone": None if r["gate"]["retrieve"] else r["alone"],
            "rag": r["rag"] if r["gate"]["retrieve"] else None,
            "correct": (r["rag"] if r["gate"]["retrieve"] else r["alone"])["correct"],
            "answer": "x",
        }
        for r in recs
    ]
    alone_only = _summarize_chosen(chosen)
    assert alone_only["infoseek"] == with_baselines["infoseek"] and alone_only["infoseek"]["final"] > 0
    assert alone_only["accuracy_by_split"] == with_baselines["accuracy_by_split"]
    assert alone_only["accuracy"] == pytest.approx(with_baselines["accuracy"])


@pytest.mark.parametrize(
    "entity,section,gold_entity,gold_section,expected",
    [
        ("e1", 3, "e1", 3, True),
        ("e1", 3, "e1", 4, False),  # the gold article, another section than the evidence
        ("e2", 3, "e1", 3, False),  # another article
        ("e2", None, "e1", None, False),
        ("e1", None, "e1", 3, True),  # the section's index unknown: the article decides
        ("e1", 3, "e1", None, True),  # no evidence section named (InfoSeek)
        ("e1", 3, "e1", [3, 5], True),  # a list (a two-hop question's, one per hop): the article decides
        (7, "3", "7", 3, True),  # ids and indices compared as what they name, whatever JSON made of them
    ],
)
def test_the_gold_section_is_the_evidence_section_of_the_gold_article(
    entity, section, gold_entity, gold_section, expected
):
    from gate.pipeline.end_to_end import is_gold_section

    assert is_gold_section(entity, section, gold_entity, gold_section) is expected


def test_summarize_counts_failures_mct_and_leaves_infoseek_figures_to_infoseek_questions():
    from gate.pipeline.end_to_end import hop_accuracy

    recs = [rec(True, False, False, 0.2, split=None), rec(False, True, True, 0.9), rec(True, True, True, 0.7)]
    recs[0]["rag"]["failed"] = "HTTP 503"  # one request failed on each path, on different questions
    recs[1]["alone"]["failed"] = "HTTP 503"
    recs[0]["rag"]["consistency"] = {"strategy": "filter", "fallback": True, "listed": None}
    recs[1]["rag"]["consistency"] = {"strategy": "filter", "fallback": False, "listed": [2, 1]}
    for r, t in zip(recs, ["templated", "automatic", "multi_answer"]):
        r["question_type"] = t
    m = summarize(recs)
    assert m["failed"] == 2
    assert m["consistency"] == {"strategy": "filter", "n": 2, "fallback_ratio": 0.5, "mean_listed": 1.0}
    assert m["accuracy_by_split"] == {"all": 1.0, "test": 1.0}  # a question without a split: "all"
    # E-VQA questions: no InfoSeek figure anywhere, and no note that InfoSeek's are left out
    assert m["infoseek"] is None and m["infoseek_untyped"] == []
    assert all("infoseek" not in b for b in m["baselines"].values())
    assert m["without_inspector"] is None
    table = format_table(m)
    assert "InfoSeek" not in table
    assert "MCT (filter): 1.00 sections listed on average; 50.0 % fell back to the first stage's choice" in table
    assert hop_accuracy([{"question_type": "automatic"}, {}], [True, False]) == {
        "single_hop": 0.5,
        "two_hop": None,
        "overall": 0.5,
    }
    assert summarize([{"id": "a", "skipped": "x"}, {"id": "b", "skipped": "y"}]) == {"n": 0, "skipped": 2}


def test_infoseek_questions_without_a_split_are_named_not_scored():
    recs = [rec(True, True, False, split="val_unseen_question"), rec(True, True, False, split=None, id="q1")]
    for r in recs:
        r["question_type"] = "String"
    m = summarize(recs)
    assert m["infoseek"] is None and m["infoseek_untyped"] == ["q1"]


def test_the_table_holds_every_baseline_and_the_run_without_the_inspector():
    recs = [dict(r, id=f"q{i}") for i, r in enumerate(RECORDS)] + [{"id": "gone", "skipped": "image missing"}]
    for r in recs[:5]:
        r["rag"] = {**r["rag"], "without_inspector": {"answer": "x", "correct": True}}
    m = summarize(recs)
    table = format_table(m, "pipeline (gate: hkb)")
    for row in (
        "| pipeline (gate: hkb) | 80.0 | 60.0 |",
        "| No RAG | 40.0 | 0.0 |",
        "| All RAG | 60.0 | 100.0 |",
        "| oracle gate | 80.0 | 60.0 |",
        "| pipeline (gate: hkb), without the Inspector | 80.0 | 60.0 |",
        "| All RAG, without the Inspector | 100.0 | 100.0 |",
        "| oracle gate, without the Inspector | 100.0 | 60.0 |",
        "1 question(s) skipped (image missing or unusable) are in no figure above",
    ):
        assert row in table, row
    assert "| random gate | " in table and "skipped" not in format_table(summarize(recs[:5]))
    partly = [dict(r, rag={k: v for k, v in r["rag"].items() if k != "without_inspector"}) for r in recs[:1]]
    assert summarize(partly + recs[1:])["without_inspector"] is None  # every record must carry it
