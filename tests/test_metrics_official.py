"""The benchmarks' official QA metrics, table-driven with hand-computed expectations (including the examples the
official scorers' READMEs and docstrings give) and properties (hypothesis)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gate.metrics import (
    answer_in_passage,
    evqa_correct,
    evqa_correct_batch,
    evqa_normalize,
    evqa_report,
    infoseek_correct,
    infoseek_scores,
    numeric_answer,
    official_correct,
    vqa_accuracy,
)

# ---------------------------------------------------------------- E-VQA


@pytest.mark.parametrize("text,expected", [
    ("The answer is: Paris.", "paris"), ("An Apple's pie", "apples pie"), ("three", "3"), ("It's TRUE", "its yes"),
    ("U.S.A.", "usa"), ("1,000", "1000"), ("9-10 meters", "910 meters"), ("<extra_id_0> Ten", "10"),
    ("  the\tMenger\nfamily ", "menger family"), ("‘quoted’ `x`", "quoted x"), ("none", "0"),
])
def test_evqa_normalize(text, expected):
    assert evqa_normalize(text) == expected


class FakeBEM:
    """A BEM stand-in: P(equivalent) from a table keyed by (candidate, reference); records every call."""

    def __init__(self, table):
        self.table, self.calls = table, []

    def __call__(self, candidates, references, questions):
        self.calls.append(list(zip(candidates, references, questions)))
        return [self.table.get((c, r), 0.0) for c, r in zip(candidates, references)]


Q = "Where does this hotel derive its name from?"


@pytest.mark.parametrize("prediction,answer,qtype,bem_table,ok,bem_called", [
    # the E-VQA README's example (the TF-hub BEM's decisions stand in the table)
    ("William and Mary Menger", "the Menger family", "automatic", {("William and Mary Menger", "the Menger family"): 0.9},
     True, True),
    ("the Baker family", "the Menger family", "automatic", {("the Baker family", "the Menger family"): 0.1}, False, True),
    # exact match after normalisation decides without BEM
    ("The Menger Family.", "the Menger family", "templated", {}, True, False),
    ("Menger", "Baker|menger", "automatic", {}, True, False),  # `|` alternatives: the best counts
    # multi_answer: IoU of the && parts and the candidate split on ',', ' and ', ' & '
    ("Red and Blue", "red&&blue&&green", "multi_answer", {}, True, False),  # 2/3
    ("red", "red&&blue&&green", "multi_answer", {}, False, True),  # 1/3 → BEM (here: no)
    ("red, blue, green, yellow", "red&&blue", "multi_answer", {}, True, False),  # 2/4
    ("Red And Blue", "red&&blue", "multi_answer", {}, False, True),  # split before lowercasing: one part
    # BEM at the threshold, and BEM sees && as commas for multi_answer
    ("crimson", "red&&blue", "multi_answer", {("crimson", "red,blue"): 0.5}, True, True),
    ("crimson", "red", "templated", {("crimson", "red"): 0.49}, False, True),
])
def test_evqa_correct(prediction, answer, qtype, bem_table, ok, bem_called):
    bem = FakeBEM(bem_table)
    assert evqa_correct(prediction, answer, Q, qtype, bem=bem) is ok
    assert bool(bem.calls) is bem_called
    for call in bem.calls:
        assert all(q == Q and "&&" not in r for _, r, q in call)


def test_evqa_without_bem_is_exact_match_only_and_bad_input_is_named():
    assert evqa_correct("William and Mary Menger", "the Menger family", Q, "automatic") is False
    with pytest.raises(ValueError, match="question type"):
        evqa_correct("x", "y", Q, "multianswer")
    with pytest.raises(ValueError, match="empty"):
        evqa_correct("x", " | ", Q, "automatic")


def test_evqa_batch_equals_one_by_one_with_one_bem_call():
    table = {("W. Menger", "the Menger family"): 0.8, ("blue", "red,blue"): 0.7, ("x", "a"): 0.2}
    records = [dict(prediction=p, answer=a, question=Q, question_type=t) for p, a, t in [
        ("W. Menger", "the Menger family", "automatic"), ("menger family", "the Menger family", "templated"),
        ("blue", "red&&blue", "multi_answer"), ("x", "a|b", "2_hop"), ("", "a", "automatic")]]
    bem = FakeBEM(table)
    batch = evqa_correct_batch(records, bem)
    # "blue" vs red&&blue is IoU 1/2: decided; two undecided questions, one with 2 alternatives; none for ""
    assert len(bem.calls) == 1 and [r for _, r, _ in bem.calls[0]] == ["the Menger family", "a", "b"]
    assert batch == [evqa_correct(r["prediction"], r["answer"], Q, r["question_type"], FakeBEM(table))
                     for r in records] == [True, True, True, False, False]
    report = evqa_report(records, batch)
    assert report == {"single_hop": 75.0, "two_hop": 0.0, "overall": 60.0, "n": 5}


# ---------------------------------------------------------------- InfoSeek


@pytest.mark.parametrize("text,expected", [
    ("9-10", [9.0, 10.0]), ("about 1,234.5 m", 1234.5), ("between 30 and 40", [30.0, 40.0]), ("40 to 30", 40.0),
    ("none", [0.0, 0.0]), ("-5", -5.0), ("3e2 km", 300.0), ("1990-1995", [1990.0, 1995.0]), ("v2.0", 2.0),
    ("1.2.3", [1.2, 3.0]), ("it is 5, 6 or 7", [5.0, 6.0]),
])
def test_numeric_answer_reads_the_first_one_or_two_numbers(text, expected):
    assert numeric_answer(text) == expected


RANGE = [{"wikidata": 35, "range": [30, 40]}]


@pytest.mark.parametrize("prediction,answer_eval,qtype,ok", [
    ("35", RANGE, "Numerical", True), ("30", RANGE, "Numerical", True), ("41", RANGE, "Numerical", False),
    ("25-35", RANGE, "Numerical", False),  # overlaps, IoU 1/3
    ("32-38", RANGE, "Numerical", True),  # inside
    ("28-40", RANGE, "Numerical", True),  # IoU 10/12
    ("It is 45 m, not 35", RANGE, "Numerical", False),  # 45 > 35: the first number only
    ("no idea", RANGE, "Numerical", False), ("35", {"wikidata": 35, "range": [30, 40]}, "Numerical", True),
    ("The People's Republic of China!", ["China", "People's Republic of China"], "String", True),
    ("Eiffel-Tower", ["eiffel tower"], "String", False), ("1889", ["1889"], "Time", True),
    ("1890", ["1889"], "Time", False),  # no ±1 year in the official code
    ("1889", ["1889"], "time", True),
])
def test_infoseek_correct(prediction, answer_eval, qtype, ok):
    assert infoseek_correct(prediction, answer_eval, qtype) is ok


def test_infoseek_scores_per_split_and_harmonic_mean():
    def rec(i, split, ok):
        return dict(id=str(i), prediction="China" if ok else "Japan", answer_eval=["China"], question_type="String",
                    data_split=f"val_unseen_{split}")
    records = [rec(i, "question", i < 8) for i in range(9)] + [rec(i, "entity", i < 11) for i in range(9, 12)]
    s = infoseek_scores(records)
    assert s["unseen_question"] == 88.89 and s["unseen_entity"] == 66.67
    assert s["final"] == round(2 * 88.89 * 66.67 / (88.89 + 66.67), 2) == 76.19
    assert s["n"] == {"unseen_question": 9, "unseen_entity": 3}
    with pytest.raises(ValueError, match="question_type"):
        infoseek_scores([dict(records[0], question_type=None)])
    with pytest.raises(ValueError, match="data_split"):
        infoseek_scores([dict(records[0], data_split="train")])


def test_infoseek_readme_figures():
    """edchengg/infoseek_eval's README: unseen-question 8.89 and unseen-entity 7.38 give the final 8.06."""
    q = [dict(prediction="yes" if i < 889 else "no", answer_eval=["yes"], question_type="String",
              data_split="val_unseen_question") for i in range(10000)]
    e = [dict(prediction="yes" if i < 738 else "no", answer_eval=["yes"], question_type="String",
              data_split="val_unseen_entity") for i in range(10000)]
    assert infoseek_scores(q + e)["final"] == 8.06


# ---------------------------------------------------------------- VQA accuracy


@pytest.mark.parametrize("matches,expected", [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0), (10, 1.0)])
def test_vqa_accuracy_leave_one_out(matches, expected):
    answers = ["cat"] * matches + [f"other{i}" for i in range(10 - matches)]
    assert vqa_accuracy("cat", answers) == pytest.approx(expected)


@pytest.mark.parametrize("prediction,answers,expected", [
    ("Two dogs.", ["2 dogs"] * 3 + ["dogs"] * 7, 0.9),
    ("the cat's toy", ["cat's toy"] * 4 + ["toy"] * 6, 1.0),
    ("dont know", ["don't know"] * 2 + ["no"] * 8, 0.6),
    ("hello-world", ["hello world"] * 3 + ["x"] * 7, 0.9),
    ("100,978", ["100978"] * 5 + ["x"] * 5, 1.0),
    ("Cat", ["cat"] * 10, 0.0),  # annotators agree: no normalisation at all (the official behaviour)
])
def test_vqa_accuracy_normalisation(prediction, answers, expected):
    assert vqa_accuracy(prediction, answers) == pytest.approx(expected)


@given(st.text(max_size=20), st.lists(st.sampled_from(["cat", "dog", "a cat", "Cat."]), min_size=1, max_size=10))
def test_vqa_accuracy_in_unit_interval(prediction, answers):
    assert 0.0 <= vqa_accuracy(prediction, answers) <= 1.0


# ---------------------------------------------------------------- pseudo-recall


@pytest.mark.parametrize("answers,passage,ok", [
    (["Mossy Caves"], "It lives in mossy caves, mostly.", True),
    (["12"], "The tower is 1200 m tall.", False),  # not inside a longer number
    (["12"], "It has 12.5 floors.", False),
    (["12"], "It has 12 floors.", True),
    (["red&&blue"], "Its flag is red and blue.", True), (["red&&blue"], "Its flag is red.", False),
    (["cat", "Paris"], "The capital is Paris.", True), ([""], "anything", False),
    (["Eiffel Tower"], "the eiffel-tower", False),  # punctuation deleted: "eiffeltower"
])
def test_answer_in_passage(answers, passage, ok):
    assert answer_in_passage(answers, passage) is ok


WORDS = st.lists(st.text(alphabet="bcdxyz", min_size=1, max_size=5), min_size=1, max_size=3).map(" ".join)


@given(WORDS, st.text(alphabet="mnp ,.-!", max_size=30), st.text(alphabet="mnp ,.-!", max_size=30))
def test_an_answer_between_spaces_is_always_found(answer, before, after):
    assert answer_in_passage([answer.upper()], f"{before} {answer} {after}")
    assert not answer_in_passage([answer], f"{before} {answer}q{after}")  # glued to another word: not whole words


# ---------------------------------------------------------------- BEM wiring (a tiny random BERT built offline)


def test_bem_input_is_cls_candidate_sep_reference_sep_question_sep(tiny_bem):
    from transformers import AutoTokenizer

    from gate.bem import bem_inputs

    tok = AutoTokenizer.from_pretrained(tiny_bem)
    batch = bem_inputs(tok, ["William and Mary Menger"], ["the Menger family"], [Q])
    tokens = tok.convert_ids_to_tokens(batch["input_ids"][0])
    assert tokens == ["[CLS]", "william", "and", "mary", "menger", "[SEP]", "the", "menger", "family", "[SEP]",
                      "where", "does", "this", "hotel", "derive", "its", "name", "from", "?", "[SEP]"]
    assert batch["token_type_ids"][0].tolist() == [0] * 6 + [1] * 14


def test_bem_scores_are_softmax_index_1_and_feed_the_official_rule(tiny_bem):
    import math

    from gate.bem import BEMScorer

    bem = BEMScorer(str(tiny_bem), device="cpu", batch_size=2, log=lambda *a: None)
    probs = bem(["the Baker family"] * 3, ["the Menger family"] * 3, [Q] * 3)
    assert probs == pytest.approx([1 / (1 + math.exp(-1.0))] * 3, abs=1e-5)  # sigmoid(1) ≈ 0.73 ≥ 0.5
    assert evqa_correct("the Baker family", "the Menger family", Q, "automatic", bem=bem) is True
    import torch

    with torch.no_grad():
        bem.model.classifier.bias.copy_(torch.tensor([1.0, 0.0]))
    assert evqa_correct("the Baker family", "the Menger family", Q, "automatic", bem=bem) is False
    assert evqa_correct("The Menger family", "the Menger family", Q, "automatic", bem=bem) is True  # exact match


# ---------------------------------------------------------------- the pipeline's rule by name


def test_official_correct_by_benchmark():
    evqa = [dict(question=Q, answers=["the Menger family"], question_type="automatic"),
            dict(question=Q, answers=["red&&blue", "purple"], question_type="multi_answer"),
            dict(question=Q, answers=["x"], question_type=None)]
    bem = FakeBEM({("Menger clan", "the Menger family"): 0.8})
    assert official_correct("evqa", evqa, ["Menger clan", "blue and red", None], bem) == [True, True, False]
    assert official_correct("evqa", evqa, ["Menger clan", "purple", "x"]) == [False, True, True]  # no BEM
    infoseek = [dict(question="q", answers=["China"], answer_eval=["China", "PRC"], question_type="String"),
                dict(question="q", answers=["35"], answer_eval=[{"wikidata": 35, "range": [30, 40]}],
                     question_type="Numerical"),
                dict(question="q", answers=["35"], answer_eval=[{"wikidata": 35, "range": [30, 40]}])]
    assert official_correct("infoseek", infoseek, ["prc", "about 33", "38"]) == [True, True, True]
    assert official_correct("infoseek", infoseek, ["Japan", "25-35", None]) == [False, False, False]
    with pytest.raises(ValueError, match="unknown metric"):
        official_correct("bleu", infoseek, ["a", "b", "c"])
