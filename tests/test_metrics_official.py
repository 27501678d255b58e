"""The benchmarks' official QA metrics, table-driven with hand-computed expectations (including the examples the
official scorers' READMEs and docstrings give) and properties (hypothesis)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gate.pipeline.metrics import official_correct
from gate.pipeline.metrics_evqa import evqa_correct, evqa_correct_batch, evqa_normalize, evqa_report
from gate.pipeline.metrics_infoseek import infoseek_correct, infoseek_report, infoseek_scores, numeric_answer
from gate.pipeline.vqa_accuracy import vqa_accuracy, vqa_scores
from retrieval.answers import answer_in_passage

# ---------------------------------------------------------------- E-VQA


@pytest.mark.parametrize(
    "text,expected",
    [
        ("The answer is: Paris.", "paris"),
        ("An Apple's pie", "apples pie"),
        ("three", "3"),
        ("It's TRUE", "its yes"),
        ("U.S.A.", "usa"),
        ("1,000", "1000"),
        ("9-10 meters", "910 meters"),
        ("<extra_id_0> Ten", "10"),
        ("  the\tMenger\nfamily ", "menger family"),
        ("‘quoted’ `x`", "quoted x"),
        ("none", "0"),
    ],
)
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


@pytest.mark.parametrize(
    "prediction,answer,qtype,bem_table,ok,bem_called",
    [
        # the E-VQA README's example (the TF-hub BEM's decisions stand in the table)
        (
            "William and Mary Menger",
            "the Menger family",
            "automatic",
            {("William and Mary Menger", "the Menger family"): 0.9},
            True,
            True,
        ),
        (
            "the Baker family",
            "the Menger family",
            "automatic",
            {("the Baker family", "the Menger family"): 0.1},
            False,
            True,
        ),
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
    ],
)
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
    table = {("W. Menger", "the Menger family"): 0.8, ("blue", "red,blue"): 0.7, ("x", "c"): 0.2}
    records = [
        dict(prediction=p, answer=a, question=Q, question_type=t)
        for p, a, t in [
            ("W. Menger", "the Menger family", "automatic"),
            ("menger family", "the Menger family", "templated"),
            ("blue", "red&&blue", "multi_answer"),
            ("x", "c|d", "2_hop"),
            ("", "c", "automatic"),
        ]
    ]
    bem = FakeBEM(table)
    batch = evqa_correct_batch(records, bem)
    # "blue" vs red&&blue is IoU 1/2: decided; three undecided questions, one with 2 alternatives, one blank
    assert len(bem.calls) == 1 and [r for _, r, _ in bem.calls[0]] == ["the Menger family", "c", "d", "c"]
    assert (
        batch
        == [evqa_correct(r["prediction"], r["answer"], Q, r["question_type"], FakeBEM(table)) for r in records]
        == [True, True, True, False, False]
    )
    report = evqa_report(records, batch)
    assert report == {"single_hop": 75.0, "two_hop": 0.0, "overall": 60.0, "n": 5}


def test_evqa_the_best_alternative_counts_one_by_one_and_in_a_batch():
    table = {("crimson", "scarlet"): 0.9, ("crimson", "red"): 0.1, ("maroon", "red"): 0.5}
    records = [
        dict(prediction="crimson", answer="scarlet|red", question=Q, question_type="templated"),  # the best: 0.9
        dict(prediction="maroon", answer="red", question=Q, question_type="automatic"),  # P = 0.5: equivalent
        dict(prediction="pink", answer="red", question=Q, question_type="2_hop"),
        dict(prediction="pink", answer="red", question=Q, question_type="automatic"),
    ]
    expected = [True, True, False, False]
    assert evqa_correct_batch(records, FakeBEM(table)) == expected
    assert [evqa_correct(r["prediction"], r["answer"], Q, r["question_type"], FakeBEM(table)) for r in records] == (
        expected
    )
    report = evqa_report(records, expected)
    assert report == pytest.approx({"single_hop": 200 / 3, "two_hop": 0.0, "overall": 50.0, "n": 4})


@pytest.mark.parametrize(
    "prediction,references,qtype,ok",
    [
        ("red", ["blue", "red"], "automatic", True),  # any one of the alternatives
        ("Paris, France", ["Paris"], "automatic", False),  # one answer: no splitting at commas
        ("Paris, France", ["Paris"], "multi_answer", True),  # IoU 1/2
        (None, ["red"], "automatic", False),  # no answer
        ("", ["the"], "automatic", False),  # a reference that normalises to nothing matches nothing
    ],
)
def test_evqa_exact_match(prediction, references, qtype, ok):
    from gate.pipeline.metrics_evqa import evqa_exact_match

    assert evqa_exact_match(prediction, references, qtype) is ok


# ---------------------------------------------------------------- InfoSeek


@pytest.mark.parametrize(
    "text,expected",
    [
        ("9-10", [9.0, 10.0]),
        ("about 1,234.5 m", 1234.5),
        ("between 30 and 40", [30.0, 40.0]),
        ("40 to 30", 40.0),
        ("none", [0.0, 0.0]),
        ("-5", -5.0),
        ("about -5 m", -5.0),  # a hyphen after a space is a minus sign
        ("roughly 9-10 m", [9.0, 10.0]),  # after a digit, a range dash
        ("3e2 km", 300.0),
        ("1990-1995", [1990.0, 1995.0]),
        ("v2.0", 2.0),
        ("1.2.3", [1.2, 3.0]),
        ("it is 5, 6 or 7", [5.0, 6.0]),
    ],
)
def test_numeric_answer_reads_the_first_one_or_two_numbers(text, expected):
    assert numeric_answer(text) == expected


RANGE = [{"wikidata": 35, "range": [30, 40]}]


@pytest.mark.parametrize(
    "prediction,answer_eval,qtype,ok",
    [
        ("35", RANGE, "Numerical", True),
        ("30", RANGE, "Numerical", True),
        ("40", RANGE, "Numerical", True),  # both ends of the range are in it
        ("41", RANGE, "Numerical", False),
        ("30 to 31", RANGE, "Numerical", True),  # inside, at either end
        ("39 to 40", RANGE, "Numerical", True),
        ("30 to 30", RANGE, "Numerical", True),
        ("40 to 40", RANGE, "Numerical", True),
        ("35-50", RANGE, "Numerical", False),  # starts inside, ends outside: IoU 5/20
        ("20-40", RANGE, "Numerical", True),  # IoU 10/20: the bound is inclusive
        ("19.5-40", RANGE, "Numerical", False),  # IoU 10/20.5
        ("2-3", [{"wikidata": 4, "range": [3.5, 4.5]}], "Numerical", False),  # disjoint: no overlap at all
        ("25-35", RANGE, "Numerical", False),  # overlaps, IoU 1/3
        ("32-38", RANGE, "Numerical", True),  # inside
        ("28-40", RANGE, "Numerical", True),  # IoU 10/12
        ("It is 45 m, not 35", RANGE, "Numerical", False),  # 45 > 35: the first number only
        ("no idea", RANGE, "Numerical", False),
        ("35", {"wikidata": 35, "range": [30, 40]}, "Numerical", True),
        ("35", [*RANGE, {"wikidata": 1, "range": [0, 1]}], "Numerical", True),  # the first item's range
        ("45", [{"wikidata": 35, "range": [30, 40, 50]}], "Numerical", False),  # its first two values
        ("The People's Republic of China!", ["China", "People's Republic of China"], "String", True),
        ("Eiffel-Tower", ["eiffel tower"], "String", False),
        ("1889", ["1889"], "Time", True),
        ("1890", ["1889"], "Time", False),  # no ±1 year in the official code
        ("1889", ["1889"], "time", True),
    ],
)
def test_infoseek_correct(prediction, answer_eval, qtype, ok):
    assert infoseek_correct(prediction, answer_eval, qtype) is ok


def test_infoseek_scores_per_split_and_harmonic_mean():
    def rec(i, split, ok):
        return dict(
            id=str(i),
            prediction="China" if ok else "Japan",
            answer_eval=["China"],
            question_type="String",
            data_split=f"val_unseen_{split}",
        )

    records = [rec(i, "question", i < 8) for i in range(9)] + [rec(i, "entity", i < 11) for i in range(9, 12)]
    s = infoseek_scores(records)
    assert s["unseen_question"] == 88.89 and s["unseen_entity"] == 66.67
    assert s["final"] == round(2 * 88.89 * 66.67 / (88.89 + 66.67), 2) == 76.19
    assert s["n"] == {"unseen_question": 9, "unseen_entity": 3}
    with pytest.raises(ValueError, match="question_type"):
        infoseek_scores([dict(records[0], question_type=None)])
    with pytest.raises(ValueError, match="data_split"):
        infoseek_scores([{k: v for k, v in records[0].items() if k != "data_split"}])


def test_infoseek_final_of_a_split_scoring_zero_is_zero():
    """The official harmonic mean takes a 0 split score as 1e-12, so the final score rounds to 0."""
    records = [
        dict(
            id=str(i),
            prediction="China" if i else "Japan",
            answer_eval=["China"],
            question_type="String",
            data_split=split,
        )
        for i, split in enumerate(["val_unseen_entity", "val_unseen_question"])
    ]
    s = infoseek_scores(records)
    assert (s["unseen_entity"], s["unseen_question"], s["final"]) == (0.0, 100.0, 0.0)


def test_infoseek_readme_figures():
    """edchengg/infoseek_eval's README: unseen-question 8.89 and unseen-entity 7.38 give the final 8.06."""
    q = [
        dict(
            prediction="yes" if i < 889 else "no",
            answer_eval=["yes"],
            question_type="String",
            data_split="val_unseen_question",
        )
        for i in range(10000)
    ]
    e = [
        dict(
            prediction="yes" if i < 738 else "no",
            answer_eval=["yes"],
            question_type="String",
            data_split="val_unseen_entity",
        )
        for i in range(10000)
    ]
    assert infoseek_scores(q + e)["final"] == 8.06


# ---------------------------------------------------------------- VQA accuracy


@pytest.mark.parametrize("matches,expected", [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0), (10, 1.0)])
def test_vqa_accuracy_leave_one_out(matches, expected):
    answers = ["cat"] * matches + [f"other{i}" for i in range(10 - matches)]
    assert vqa_accuracy("cat", answers) == pytest.approx(expected)


@pytest.mark.parametrize(
    "prediction,answers,expected",
    [
        ("Two dogs.", ["2 dogs"] * 3 + ["dogs"] * 7, 0.9),
        ("the cat's toy", ["cat's toy"] * 4 + ["toy"] * 6, 1.0),
        ("dont know", ["don't know"] * 2 + ["no"] * 8, 0.6),
        ("hello-world", ["hello world"] * 3 + ["x"] * 7, 0.9),
        ("100,978", ["100978"] * 5 + ["x"] * 5, 1.0),
        ("Cat", ["cat"] * 10, 0.0),  # annotators agree: no normalisation at all (the official behaviour)
        ("xy z", ["x/y/ z"] * 3 + ["x"] * 7, 0.9),  # a mark beside a space anywhere: deleted everywhere
        ("xy z", ["x/y /z"] * 3 + ["x"] * 7, 0.9),
        ("x y z", ["x/y z"] * 3 + ["x"] * 7, 0.9),  # touching no space: a space
    ],
)
def test_vqa_accuracy_normalisation(prediction, answers, expected):
    assert vqa_accuracy(prediction, answers) == pytest.approx(expected)


@given(st.text(max_size=20), st.lists(st.sampled_from(["cat", "dog", "a cat", "Cat."]), min_size=1, max_size=10))
def test_vqa_accuracy_in_unit_interval(prediction, answers):
    assert 0.0 <= vqa_accuracy(prediction, answers) <= 1.0


# ---------------------------------------------------------------- pseudo-recall


@pytest.mark.parametrize(
    "answers,passage,ok",
    [
        (["Mossy Caves"], "It lives in mossy caves, mostly.", True),
        (["12"], "The tower is 1200 m tall.", False),  # not inside a longer number
        (["12"], "It has 12.5 floors.", False),
        (["12"], "It has 12 floors.", True),
        (["red&&blue"], "Its flag is red and blue.", True),
        (["red&&blue"], "Its flag is red.", False),
        (["red && "], "Its flag is red.", True),  # an empty part asks for nothing
        (["cat", "Paris"], "The capital is Paris.", True),
        ([""], "anything", False),
        ([None], "None of these", False),  # a missing answer is no answer, not the word "none"
        (["Eiffel Tower"], "the eiffel-tower", False),  # punctuation deleted: "eiffeltower"
    ],
)
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

    from gate.pipeline.bem import bem_inputs

    tok = AutoTokenizer.from_pretrained(tiny_bem)
    batch = bem_inputs(tok, ["William and Mary Menger"], ["the Menger family"], [Q])
    tokens = tok.convert_ids_to_tokens(batch["input_ids"][0])
    assert tokens == [
        "[CLS]",
        "william",
        "and",
        "mary",
        "menger",
        "[SEP]",
        "the",
        "menger",
        "family",
        "[SEP]",
        "where",
        "does",
        "this",
        "hotel",
        "derive",
        "its",
        "name",
        "from",
        "?",
        "[SEP]",
    ]
    assert batch["token_type_ids"][0].tolist() == [0] * 6 + [1] * 14


def test_bem_scores_are_softmax_index_1_and_feed_the_official_rule(tiny_bem):
    import math

    from gate.pipeline.bem import BEMScorer

    bem = BEMScorer(str(tiny_bem), device="cpu", batch_size=2, log=lambda *a: None)
    probs = bem(["the Baker family"] * 3, ["the Menger family"] * 3, [Q] * 3)
    assert probs == pytest.approx([1 / (1 + math.exp(-1.0))] * 3, abs=1e-5)  # sigmoid(1) ≈ 0.73 ≥ 0.5
    # the pipeline's judge loads BEM in a dtype named, and fp32 under auto on every device, as the official scorer
    from types import SimpleNamespace

    import torch

    from common.placement import resolve_dtype
    from gate.pipeline.bem import bem_dtype
    from gate.pipeline.stages import Judge

    for dtype, expected in (("bf16", torch.bfloat16), ("auto", torch.float32)):
        args = SimpleNamespace(metric="evqa", bem=str(tiny_bem), bem_device=None, batch_size=2, dtype=dtype)
        assert Judge(args, "cpu").bem.model.dtype == expected
        assert resolve_dtype(bem_dtype(dtype), "cuda:0") == expected  # on a GPU too (auto: bf16 for other models)
    assert evqa_correct("the Baker family", "the Menger family", Q, "automatic", bem=bem) is True
    import torch

    with torch.no_grad():
        bem.model.classifier.bias.copy_(torch.tensor([1.0, 0.0]))
    assert evqa_correct("the Baker family", "the Menger family", Q, "automatic", bem=bem) is False
    assert evqa_correct("The Menger family", "the Menger family", Q, "automatic", bem=bem) is True  # exact match


# ---------------------------------------------------------------- the pipeline's rule by name


def test_official_correct_by_benchmark():
    evqa = [
        dict(question=Q, answers=["the Menger family"], question_type="automatic"),
        dict(question=Q, answers=["red&&blue", "purple"], question_type="multi_answer"),
        dict(question=Q, answers=["x"], question_type=None),
    ]
    bem = FakeBEM({("Menger clan", "the Menger family"): 0.8, ("", "x"): 0.6})
    # no answer (None) is scored as the empty prediction a results file holds: it goes to BEM like any blank one
    assert official_correct("evqa", evqa, ["Menger clan", "blue and red", None], bem) == [True, True, True]
    assert ("", "x", Q) in bem.calls[0]
    assert official_correct("evqa", evqa, ["Menger clan", "purple", "x"]) == [False, True, True]  # no BEM
    infoseek = [
        dict(question="q", answers=["China"], answer_eval=["China", "PRC"], question_type="String"),
        dict(
            question="q", answers=["35"], answer_eval=[{"wikidata": 35, "range": [30, 40]}], question_type="Numerical"
        ),
        dict(question="q", answers=["35"], answer_eval=[{"wikidata": 35, "range": [30, 40]}]),
    ]
    assert official_correct("infoseek", infoseek, ["prc", "about 33", "38"]) == [True, True, True]
    assert official_correct("infoseek", infoseek, ["Japan", "25-35", None]) == [False, False, False]
    # no answer is the official scorer's empty prediction: never a String match, [0, 0] for a Numerical question
    around_zero = dict(question="q", answers=["0"], answer_eval=[{"wikidata": 0, "range": [-1, 1]}])
    typed = [infoseek[0], dict(around_zero, question_type="Numerical"), infoseek[1]]
    assert official_correct("infoseek", typed, [None, None, None]) == [False, True, False]
    # an untyped record without answer_eval: its answers are the aliases
    assert official_correct("infoseek", [dict(question="q", answers=["Paris"])] * 2, ["paris", "Lyon"]) == [True, False]
    with pytest.raises(ValueError, match="unknown metric"):
        official_correct("bleu", infoseek, ["a", "b", "c"])


# ---------------------------------------------------------------- the official scorers' finer points (items 1–9)
# Each table below comes from reading the official code: google-research encyclopedic_vqa/evaluation_utils.py
# (E-VQA), edchengg/infoseek_eval infoseek_eval.py (InfoSeek), GT-Vision-Lab/VQA
# PythonEvaluationTools/vqaEvaluation/vqaEval.py (VQA).


@pytest.mark.parametrize(
    "text,expected",
    [  # 1: with the answer starting with it, every "<extra_id_0> " goes
        ("<extra_id_0> Paris <extra_id_0> France", "paris france"),
        ("<EXTRA_ID_0> Ten <extra_id_0> two", "10 2"),  # lowercased before the prefix is looked for
        ("<extra_id_0> Paris <extra_id_0>", "paris extraid0"),  # the last one has no space after it (stripped)
        ("Paris <extra_id_0> France", "paris extraid0 france"),  # not at the start: kept, its punctuation deleted
        ("<extra_id_0>Paris", "extraid0paris"),  # no space after it: not the prefix
        ("<extra_id_0> ", "extraid0"),  # stripped first, so the prefix's space is gone
    ],
)
def test_evqa_normalize_removes_every_span_prefix(text, expected):
    assert evqa_normalize(text) == expected


@pytest.mark.parametrize(
    "prediction,answer,qtype,refs",
    [  # 2: a blank prediction is never decided by exact match
        ("", "red", "automatic", ["red"]),
        ("   ", "red|crimson", "templated", ["red", "crimson"]),
        ("", "red&&blue", "multi_answer", ["red,blue"]),
        ("\n", "Menger", "2_hop", ["Menger"]),
    ],
)
@pytest.mark.parametrize("verdict", [0.9, 0.1])
def test_evqa_blank_prediction_goes_to_bem(prediction, answer, qtype, refs, verdict):
    bem = FakeBEM({(prediction, r): verdict for r in refs})
    assert evqa_correct(prediction, answer, Q, qtype, bem=bem) is (verdict >= 0.5)
    assert bem.calls == [[(prediction, r, Q) for r in refs]]
    batch_bem = FakeBEM({(prediction, r): verdict for r in refs})
    rows = [dict(id="q1", prediction=prediction, answer=answer, question=Q, question_type=qtype)]
    assert evqa_correct_batch(rows, batch_bem) == [verdict >= 0.5] and batch_bem.calls == bem.calls


@given(st.text(alphabet=" \t\n", max_size=5), st.sampled_from(["templated", "automatic", "2_hop", "multi_answer"]))
def test_evqa_any_blank_prediction_asks_bem_once_per_alternative(blank, qtype):
    bem = FakeBEM({})
    assert evqa_correct(blank, "Red|Blue&&Green", Q, qtype, bem=bem) is False
    assert len(bem.calls) == 1 and [c for c, _, _ in bem.calls[0]] == [blank, blank]


def _tiny_bert(folder, type_vocab_size):
    """A tiny BERT classifier like conftest's tiny_bem, with ``type_vocab_size`` segment embeddings."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

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
    torch.manual_seed(0)
    model = BertForSequenceClassification(
        BertConfig(
            vocab_size=len(words),
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            num_labels=2,
            type_vocab_size=type_vocab_size,
        )
    )
    model.save_pretrained(folder)
    BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}, do_lower_case=True).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "type_vocab_size,question_segment",
    [
        (2, 1),  # the published PyTorch port (bert-base-uncased, 2 segment types): its model card's 0 / 1 / 1
        (3, 2),  # a model with room for it: the official combine_segments' 0 / 1 / 2
    ],
)
def test_bem_question_segment_follows_the_model(tmp_path, type_vocab_size, question_segment):
    """3: the official input gives candidate, reference and question segment ids 0, 1, 2; the PyTorch port has only
    two segment embeddings and its card gives reference and question both 1 — each model gets what it can read."""
    import torch

    from gate.pipeline.bem import BEMScorer, bem_inputs

    bem = BEMScorer(str(_tiny_bert(tmp_path, type_vocab_size)), device="cpu", log=lambda *a: None)
    assert bem.question_segment == question_segment
    batch = bem_inputs(
        bem.tokenizer,
        ["William and Mary Menger", "Baker"],
        ["the Menger family", "Menger"],
        [Q, Q],
        question_segment=question_segment,
    )
    tokens = bem.tokenizer.convert_ids_to_tokens(batch["input_ids"][0])
    assert tokens[:10] == ["[CLS]", "william", "and", "mary", "menger", "[SEP]", "the", "menger", "family", "[SEP]"]
    assert batch["token_type_ids"][0].tolist() == [0] * 6 + [1] * 4 + [question_segment] * 10
    short = batch["attention_mask"][1].tolist()  # the second row is padded: padding keeps segment 0
    assert batch["token_type_ids"][1].tolist() == [0] * 3 + [1] * 2 + [question_segment] * 10 + [0] * (20 - 15)
    assert sum(short) == 15
    assert len(bem(["William and Mary Menger"], ["the Menger family"], [Q])) == 1  # the model reads it
    if type_vocab_size == 2:  # the official segment ids do not fit the port's two segment embeddings
        with torch.no_grad(), pytest.raises(IndexError):
            bem.model(**bem_inputs(bem.tokenizer, ["Baker"], ["Menger"], [Q], question_segment=2))


def _split_records(split, right, total, kind="String"):
    return [
        dict(
            id=f"{split}{i}",
            prediction="China" if i < right else "Japan",
            answer_eval=["China"],
            question_type=kind,
            data_split=f"val_unseen_{split}",
        )
        for i in range(total)
    ]


@pytest.mark.parametrize(
    "right,total,official",
    [  # 4: round(fraction * 100, 2), not round(100 * k / n, 2)
        (23, 160, 14.37),
        (49, 160, 30.63),
        (51, 160, 31.87),
        (93, 160, 58.13),
        (8, 9, 88.89),
    ],
)
def test_infoseek_split_score_rounds_the_fraction(right, total, official):
    s = infoseek_scores(_split_records("question", right, total) + _split_records("entity", 1, 2))
    assert s["unseen_question"] == official and s["all_questions"]["unseen_question"] == official
    assert s["final"] == round(2 / (1 / official + 1 / 50.0), 2)


def test_infoseek_question_without_prediction_is_left_out_officially():
    """5: the official scorer only sees predictions; ours counts a question without one as wrong. Both reported."""
    records = _split_records("question", 1, 2) + _split_records("entity", 1, 1)
    records += [{k: v for k, v in r.items() if k != "prediction"} for r in _split_records("question", 0, 1)]
    records += [{k: v for k, v in r.items() if k != "prediction"} for r in _split_records("entity", 0, 1)]
    s = infoseek_scores(records)
    assert (s["unseen_question"], s["unseen_entity"], s["final"]) == (50.0, 100.0, 66.67)
    assert s["n"] == {"unseen_question": 2, "unseen_entity": 1}
    assert s["no_prediction"] == {"unseen_question": 1, "unseen_entity": 1}
    ours = s["all_questions"]
    assert (ours["unseen_question"], ours["unseen_entity"], ours["final"]) == (33.33, 50.0, 40.0)
    assert ours["n"] == {"unseen_question": 3, "unseen_entity": 2}


@given(st.lists(st.tuples(st.booleans(), st.sampled_from([True, False, None])), min_size=1, max_size=30))
def test_infoseek_official_and_all_question_figures(rows):
    """5, as a property: the official split score is over answered questions, ours over all; ours is never higher."""
    from gate.pipeline.metrics_infoseek import infoseek_report

    records = [
        dict(id=str(i), question_type="String", data_split="val_unseen_question" if q else "val_unseen_entity")
        for i, (q, _) in enumerate(rows)
    ]
    s = infoseek_report(records, [ok for _, ok in rows])
    for split, flag in (("unseen_question", True), ("unseen_entity", False)):
        answered = [ok for q, ok in rows if q is flag and ok is not None]
        everyone = [bool(ok) for q, ok in rows if q is flag]
        assert s[split] == (round(sum(answered) / len(answered) * 100, 2) if answered else 0)
        assert s["all_questions"][split] == (round(sum(everyone) / len(everyone) * 100, 2) if everyone else 0)
        assert s["all_questions"][split] <= s[split]


def test_infoseek_per_type_scores_are_per_split():
    """6: per-type scores per split, 0 for a type without questions; any data_split not ending in unseen_question is
    the unseen-entity split; a type other than Time / Numerical scores as String."""

    def rec(i, split, kind, prediction, answer_eval):
        return dict(id=str(i), prediction=prediction, answer_eval=answer_eval, question_type=kind, data_split=split)

    rng = [{"wikidata": 35, "range": [30, 40]}]
    records = [
        rec(0, "val_unseen_question", "String", "China", ["China"]),
        rec(1, "val_unseen_question", "string", "Japan", ["China"]),
        rec(2, "val_unseen_question", "Time", "1889", ["1889"]),
        rec(3, "val_unseen_entity", "Numerical", "35", rng),
        rec(4, "train", "Other", "The Seine", ["seine"]),  # → unseen entity, scored as String
        rec(5, "", "Time", "1900", ["1889"]),
    ]  # → unseen entity
    s = infoseek_scores(records)
    assert s["per_type"] == {
        "unseen_question": {"time": 100.0, "numerical": 0, "string": 50.0},
        "unseen_entity": {"time": 0.0, "numerical": 100.0, "string": 100.0},
    }
    assert s["n"] == {"unseen_question": 3, "unseen_entity": 3}
    assert (s["unseen_question"], s["unseen_entity"]) == (66.67, 66.67)


@pytest.mark.parametrize(
    "prediction,answer_eval,qtype,ok",
    [  # 6: other types are String
        ("The Seine", ["seine"], "Other", True),
        ("Seine", ["Loire"], "entity", False),
        ("35", ["35"], "Location", True),
    ],
)
def test_infoseek_other_question_types_score_as_string(prediction, answer_eval, qtype, ok):
    assert infoseek_correct(prediction, answer_eval, qtype) is ok


@pytest.mark.parametrize(
    "prediction,answer_eval,qtype,ok",
    [  # 7: "" equals an alias that normalises to ""
        ("", ["A"], "String", True),
        ("the", ["A"], "String", True),
        ("", ["x", "The"], "Time", True),
        ("", ["x"], "String", False),
        ("...", ["an"], "String", True),
        ("x", ["A"], "String", False),
    ],
)
def test_infoseek_empty_prediction_matches_an_empty_alias(prediction, answer_eval, qtype, ok):
    from gate.pipeline.metrics_infoseek import infoseek_match

    assert infoseek_correct(prediction, answer_eval, qtype) is ok
    assert infoseek_match(prediction, answer_eval) is False  # the untyped rule (gate labels): "" never matches


def test_vqa_scores_are_the_official_report():
    """8: per-question accuracies in % rounded to 2 decimals; overall, per question type and per answer type from the
    unrounded ones, each rounded to 2 decimals."""
    from gate.pipeline.vqa_accuracy import vqa_scores

    def rec(qid, prediction, answers, qtype, atype):
        return dict(question_id=qid, prediction=prediction, answers=answers, question_type=qtype, answer_type=atype)

    records = [
        rec(1, "cat", ["cat"] * 10, "what is", "other"),
        rec(2, "Two", ["2"] * 3 + ["3"] * 7, "how many", "number"),  # 0.9
        rec(3, "yes", ["no"] * 9 + ["yes"], "is this", "yes/no"),  # 0.3
        rec(4, "dog", ["cat"] * 10, "what is", "other"),
        rec(5, "cat", ["cat"] + [f"x{i}" for i in range(6)], "what is", "other"),
    ]  # 2/7
    s = vqa_scores(records)
    assert s["per_question"] == {1: 100.0, 2: 90.0, 3: 30.0, 4: 0.0, 5: 28.57}
    assert s["overall"] == round(100 * (1 + 0.9 + 0.3 + 0 + 2 / 7) / 5, 2) == 49.71
    assert s["per_question_type"] == {"what is": 42.86, "how many": 90.0, "is this": 30.0}
    assert s["per_answer_type"] == {"other": 42.86, "number": 90.0, "yes/no": 30.0}


def test_vqa_rounding_is_the_official_python_2_rounding():
    """8: the official evaluator is Python 2 code, whose round() takes an exact tie away from zero (Python 3's goes
    to even): 1 right out of 800 is 0.125 % → 0.13."""
    from gate.pipeline.vqa_accuracy import vqa_scores

    records = [
        dict(
            question_id=i,
            prediction="cat" if i == 0 else "dog",
            answers=["cat"] * 10,
            question_type="what",
            answer_type="other",
        )
        for i in range(800)
    ]
    s = vqa_scores(records)
    assert s["overall"] == 0.13 and s["per_question_type"] == {"what": 0.13} and s["per_answer_type"] == {"other": 0.13}


@pytest.mark.parametrize(
    "prediction,gold",
    [  # 8: the contraction entries that were missing
        ("'ows'at", "ow's'at"),
        ("'ow'sat", "ow's'at"),
        ("ow's'at", "'ows'at"),
    ],
)
def test_vqa_contractions(prediction, gold):
    from gate.pipeline.vqa_accuracy import vqa_normalize

    assert vqa_normalize(prediction) == vqa_normalize(gold) == "'ow's'at"
    assert vqa_accuracy(prediction, [gold] * 3 + ["x"] * 7) == pytest.approx(0.9)


_VQA_ROW = dict(question_id="q7", prediction="cat", answers=["cat"] * 3, question_type="what", answer_type="other")


def _vqa(**kw):
    return vqa_scores([dict(_VQA_ROW, **kw)])


def _infoseek(**kw):
    return infoseek_scores(
        [
            dict(
                dict(
                    id="q7", prediction="x", answer_eval=["x"], question_type="String", data_split="val_unseen_question"
                ),
                **kw,
            )
        ]
    )


@pytest.mark.parametrize(
    "call,match",
    [  # 9: what the official code rejects is refused, naming the question
        (lambda: evqa_correct(None, "red", Q, "automatic", qid="q7"), "q7.*prediction"),
        (lambda: evqa_correct("x", "", Q, "automatic", qid="q7"), "q7.*empty"),
        (lambda: evqa_correct("x", "The", Q, "automatic", qid="q7"), "q7.*empty"),
        (lambda: evqa_correct("x", "red|the answer is", Q, "templated", qid="q7"), "q7.*empty"),
        (lambda: evqa_correct("x", "a&&the", Q, "multi_answer", qid="q7"), "q7.*empty"),
        (lambda: evqa_correct("x", "red", Q, "multianswer", qid="q7"), "q7.*question type"),
        (
            lambda: evqa_correct_batch(
                [dict(id="q7", prediction=None, answer="red", question=Q, question_type="automatic")]
            ),
            "q7.*prediction",
        ),
        (lambda: infoseek_correct(None, ["China"], "String", qid="q7"), "q7.*prediction"),
        (lambda: infoseek_correct("x", [], "String", qid="q7"), "q7.*answer_eval"),
        (lambda: infoseek_correct("3", [], "Numerical", qid="q7"), "q7.*answer_eval"),
        (lambda: infoseek_correct("3", ["3"], "Numerical", qid="q7"), "q7.*range"),
        (lambda: infoseek_correct("3", [{"wikidata": 3}], "Numerical", qid="q7"), "q7.*range"),
        (lambda: infoseek_correct("3", [{"range": [3]}], "Numerical", qid="q7"), "q7.*range"),
        (lambda: infoseek_correct("wikidata", {"wikidata": "x"}, "String", qid="q7"), "q7.*answer_eval"),
        (lambda: infoseek_correct("x", ["x", None], "String", qid="q7"), "q7.*must hold strings"),
        (lambda: infoseek_correct("x", [{"wikidata": "x"}], "Time", qid="q7"), "q7.*must hold strings"),
        (lambda: infoseek_correct("x", ["x"], None, qid="q7"), "q7.*question_type"),
        (lambda: infoseek_report([dict(id="q7", question_type="String")], [True]), "q7.*data_split"),
        (lambda: infoseek_report([dict(id="q7", question_type="String", data_split="val")], []), "1 InfoSeek .* 0"),
        (lambda: _infoseek(prediction=None), "q7.*prediction"),
        (lambda: _infoseek(answer_eval=[]), "q7.*answer_eval"),
        (lambda: _infoseek(data_split=None), "q7.*data_split"),
        (lambda: _infoseek(question_type=None), "question_type.*q7"),
        (lambda: _vqa(prediction=None), "q7.*prediction"),
        (lambda: _vqa(answers=[]), "q7.*answers"),
        (lambda: _vqa(answer_type=None), "q7.*answer_type"),
        (lambda: _vqa(answers=["cat", None, "cat"]), "q7.*answers"),
        (lambda: vqa_scores([]), "at least one question"),
        (lambda: vqa_scores([_VQA_ROW, _VQA_ROW]), "'q7' appears twice"),
        (lambda: evqa_normalize(None), "needs a string"),
        (lambda: official_correct("infoseek", [{"question": Q}], []), "1 question records but 0 predictions"),
        (lambda: evqa_correct("x", None, Q, "automatic", qid="q7"), "q7.*reference answer must be a string"),
    ],
)
def test_bad_input_is_refused_naming_the_question(call, match):
    with pytest.raises(ValueError, match=match):
        call()
