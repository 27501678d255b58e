"""Gate label functions and QA metrics: hand-computed cases (table-driven) and properties (hypothesis)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gate.pipeline.metrics import harmonic_mean, token_accuracy
from gate.pipeline.metrics_infoseek import infoseek_match
from gate.train.labels import certainty, hkb_label, judged_mean, kbm_accuracy_label, kbm_certainty_label, skb_label
from retrieval.answers import normalize_answer

# ---------------------------------------------------------------- metrics


@pytest.mark.parametrize(
    "text,expected",
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  A  cat, an apple ", "cat apple"),
        ("Théâtre", "théâtre"),
        ("", ""),
        (None, ""),
        (1889, "1889"),
        ("anthem", "anthem"),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    "prediction,answer_eval,ok",
    [
        ("France", ["France", "French Republic"], True),
        ("the french republic.", ["France", "French Republic"], True),
        ("Germany", ["France"], False),
        ("", [""], False),
        (None, ["France"], False),  # no prediction never matches
        ("France", [], False),  # no answers at all: a miss
        ("France", [None, "France"], True),  # a null alias is left out
        ("1889", [{"wikidata": 1889, "range": [1887, 1891]}], True),
        ("It was built in 1,890.", {"wikidata": 1889, "range": [1887, 1891]}, True),
        ("1900", [{"wikidata": 1889, "range": [1887, 1891]}], False),
        ("about 6.5 metres", [{"wikidata": 6.3, "range": [5.67, 6.93]}], True),
        ("between 1880 and 1888 — say 1885 to 1888", [{"wikidata": 1889, "range": [1887, 1891]}], False),  # 1880–1888
        ("1885 to 1890", [{"wikidata": 1889, "range": [1887, 1891]}], True),  # IoU 3/6: the bound is inclusive
        ("1887 to 1892", [{"wikidata": 1889, "range": [1887, 1891]}], True),  # IoU 4/5
        ("1850-1880", [{"wikidata": 1889, "range": [1887, 1891]}], False),
        ("no number", [{"wikidata": 1889, "range": [1887, 1891]}], False),
        ("1889", [{"wikidata": 1889}], True),  # no range given: the value itself as an alias
        ("", [{"wikidata": 0, "range": [-1, 1]}], False),  # empty never matches (the official scorer reads [0, 0])
        ("  ", [{"wikidata": 2, "range": [0, 5]}], False),
        ("3", [{"wikidata": "x"}, {"wikidata": 3, "range": [2, 4]}], True),  # the range of the item that has one
        ("Eiffel-Tower", ["eiffel tower"], False),  # punctuation is deleted, not replaced by a space
        ("EiffelTower", ["Eiffel-Tower"], True),
    ],
)
def test_infoseek_match(prediction, answer_eval, ok):
    assert infoseek_match(prediction, answer_eval) is ok


@pytest.mark.parametrize(
    "prediction,golds,expected",
    [
        ("the red fox jumps", ["red fox"], 1.0),
        ("a red dog", ["red fox", "dog"], 1.0),
        ("a red dog", ["red fox"], 0.5),
        ("nothing", ["red fox"], 0.0),
        ("anything", [""], 0.0),
    ],
)
def test_token_accuracy(prediction, golds, expected):
    assert token_accuracy(prediction, golds) == pytest.approx(expected)


@pytest.mark.parametrize("a,b,expected", [(0.5, 0.5, 0.5), (0.2, 0.6, 0.3), (0, 0, 0), (1, 0, 0)])
def test_harmonic_mean(a, b, expected):
    assert harmonic_mean(a, b) == pytest.approx(expected)


@given(st.floats(0, 1), st.floats(0, 1))
def test_harmonic_mean_between_min_and_mean(a, b):
    h = harmonic_mean(a, b)
    assert min(a, b) - 1e-12 <= h <= (a + b) / 2 + 1e-12


@given(st.text(), st.lists(st.text(), max_size=4))
def test_token_accuracy_in_unit_interval(prediction, golds):
    assert 0.0 <= token_accuracy(prediction, golds) <= 1.0


# ---------------------------------------------------------------- labels (high score = the model knows = no search)


@pytest.mark.parametrize(
    "scores,epsilon,label",
    [
        ([5, 5, 4], 3.0, "false"),
        ([1, 1, 2], 3.0, "true"),
        ([3, 3], 3.0, "false"),
        ([2.9], 3.0, "true"),
    ],
)
def test_hkb_label(scores, epsilon, label):
    assert hkb_label(scores, epsilon) == label


@pytest.mark.parametrize("scores,label", [([5, 5], 1.0), ([1, 1], 5.0), ([2, 4], 3.0), ([1, 2, 3, 4, 5], 3.0)])
def test_skb_label(scores, label):
    assert skb_label(scores) == pytest.approx(label)


def test_judged_mean_validates():
    assert judged_mean([1, 2, 3]) == 2
    assert judged_mean([1, 2]) == pytest.approx(1.5)  # a true mean, not a floor
    assert judged_mean([1, 5]) == 3  # both ends of the scale are scores
    for bad, error in [
        ([], "judged_mean needs at least one score"),
        ([0], r"judged scores must lie in \[1, 5\], got 0.0"),
        ([0.9], r"judged scores must lie in \[1, 5\], got 0.9"),
        ([5.1], r"judged scores must lie in \[1, 5\], got 5.1"),
        ([6], r"judged scores must lie in \[1, 5\], got 6.0"),
        ([float("nan")], r"judged scores must lie in \[1, 5\], got nan"),
    ]:
        with pytest.raises(ValueError, match=error):
            judged_mean(bad)


@given(st.lists(st.floats(1, 5), min_size=1, max_size=30))
def test_skb_is_flipped_mean_in_range(scores):
    assert 1.0 - 1e-9 <= skb_label(scores) <= 5.0 + 1e-9
    assert skb_label(scores) == pytest.approx(6 - judged_mean(scores))


@pytest.mark.parametrize(
    "correct,tau,search",
    [
        ([True] * 9 + [False], 0.9, False),
        ([True] * 8 + [False] * 2, 0.9, True),
        ([False], 0.9, True),
        ([True], 0.9, False),
        ([True, False], 0.5, False),
    ],
)
def test_kbm_accuracy_label(correct, tau, search):
    assert kbm_accuracy_label(correct, tau) is search
    assert kbm_accuracy_label(iter(correct), tau) is search  # any iterable of judgements


def test_kbm_accuracy_label_needs_an_answer():
    with pytest.raises(ValueError, match="kbm_accuracy_label needs at least one sampled answer"):
        kbm_accuracy_label([])


@pytest.mark.parametrize(
    "answers,expected",
    [
        (["Paris", "paris.", "The Paris"], 1.0),
        (["a", "b"], 0.0),
        (["x", "y", "z"], 0.0),
        (["x"] * 3 + ["y"], 1 - (-(0.75 * math.log(0.75) + 0.25 * math.log(0.25))) / math.log(4)),
        (["x"] * 2 + ["y"] * 2, 0.5),  # two clusters of two among four answers: H = log 2, Hmax = log 4
        (["x"] * 29 + ["y"], 1 - (-(29 / 30 * math.log(29 / 30) + 1 / 30 * math.log(1 / 30))) / math.log(30)),
        ([""] * 30, 0.0),  # no answer agrees with another non-answer: all normalised to "" was certainty 1.0
        (["", "the", "A", "an", "..."] * 6, 0.0),
        ([""], 0.0),
        (["x", "x", "", ""], 1 - (-(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))) / math.log(4)),
    ],
)
def test_certainty(answers, expected):
    assert certainty(answers) == pytest.approx(expected)


def test_kbm_certainty_label_polarity():
    assert kbm_certainty_label(["Paris"] * 30) is False  # all agree: certain, no search
    assert kbm_certainty_label(["Paris"] * 15 + ["Lyon"] * 15) is True
    assert kbm_certainty_label(["Paris"] * 29 + ["Lyon"]) is False  # 29 of 30 agree: certain (0.96 ≥ τ = 0.9)
    assert kbm_certainty_label(["x", "x", "y", "y"], tau=0.5) is False  # C = 0.5 exactly: not below τ
    with pytest.raises(ValueError, match="certainty needs at least one answer"):
        certainty([])


@given(st.lists(st.sampled_from(["x", "y", "z", "", "the"]), min_size=1, max_size=40))
def test_certainty_in_unit_interval_and_one_iff_unanimous(answers):
    c = certainty(answers)
    assert 0.0 <= c <= 1.0
    assert (c == 1.0) == (len(set(answers)) == 1 and answers[0] in ("x", "y", "z"))  # "" and "the": no answer


# ---------------------------------------------------------------- MMKB and Inspector labels
from gate.train.labels import inspector_label, ret_label, srt_label  # noqa: E402


@pytest.mark.parametrize("correct,label", [(True, "NoRet"), (False, "Ret")])
def test_ret_label(correct, label):
    assert ret_label(correct) == label


@pytest.mark.parametrize(
    "without,with_doc,label",
    [
        (False, True, "Rel"),
        (True, False, "NoRel"),
        (True, True, None),
        (False, False, None),
    ],
)
def test_srt_label_follows_the_papers_text(without, with_doc, label):
    assert srt_label(without, with_doc) == label


@pytest.mark.parametrize(
    "top,gold,text_ok,expected",
    [
        ("Q1", "Q1", None, {"pass": "true"}),
        ("Q1", "Q1", True, {"pass": "true"}),
        ("Q1", "Q1", False, {"pass": "false", "answer": "Paris"}),
        ("Q2", "Q1", None, {"pass": "false", "answer": "Paris"}),
        ("Q2", "Q1", True, {"pass": "false", "answer": "Paris"}),
    ],
)
def test_inspector_label(top, gold, text_ok, expected):
    assert inspector_label(top, gold, "Paris", text_ok) == expected


# ---------------------------------------------------------------- one question's labels (gate.train.labelling)


def labelled(variant, contexts=None, alone_rule="sampled-majority", **rec):
    from gate.train.build_data import BuildDataArgs
    from gate.train.labelling import label_records

    args = BuildDataArgs(epsilon=3.0, tau=0.5, correct_score=4.0, alone_rule=alone_rule, mct_rule="srt")
    rec = {"id": "q", "question": "Where?", "answers": ["caves"], "scores": [4.0, 4.0, 1.0, 1.0], **rec}
    return label_records(variant, rec, args, contexts)


@pytest.mark.parametrize(
    "variant,rec,expected",
    [
        ("ret", {}, [{"search": False}]),  # 2 of 4 samples at the correct score: half is right alone
        ("ret", {"scores": [4.0, 3.9, 1.0, 1.0]}, [{"search": True}]),  # 1 of 4
        ("ret", {"greedy_score": 4.0, "alone_rule": "greedy"}, [{"search": False}]),  # the greedy answer, at the bar
        ("ret", {"greedy_score": 3.9, "alone_rule": "greedy"}, [{"search": True}]),
        ("ret", {"greedy_score": None, "alone_rule": "greedy"}, []),  # its judgement failed: no label
        ("kbm-acc", {}, [{"search": False}]),  # accuracy 2/4 is not below τ = 0.5
        ("hkb", {"scores": [5.0, None, 5.0]}, []),  # one sample unjudged: no label from the others
        ("hkb", {"scores": [None, None]}, []),
        ("hkb", {"scores": []}, []),
        ("srt", {}, []),  # no context record: no document to label
        ("mct", {"hits": []}, []),  # Algorithm 3 without consistency records: nothing to label
    ],
)
def test_label_records_rules(variant, rec, expected):
    assert labelled(variant, **rec) == expected


def test_srt_needs_this_questions_context():
    assert labelled("srt", contexts={"other": {"doc_scores": [5.0], "hits": [{"text": "t"}]}}) == []
    (got,) = labelled("srt", contexts={"q": {"doc_scores": [1.0], "hits": [{"text": "t"}]}})
    assert (got["id"], got["relevant"], got["context"]) == ("q#d1", False, "t")  # right alone, wrong with it
    (got,) = labelled("srt", contexts={"q": {"doc_scores": [4.0], "hits": [{"text": "t"}]}}, scores=[1.0, 1.0])
    assert got["relevant"] is True  # wrong alone, right with it: a score at the correct score is right


@pytest.mark.parametrize("ratio", [-0.1, 1.2])
def test_mct_example_refuses_a_negative_ratio_outside_the_unit_interval(ratio):
    from gate.train.labels import mct_example

    with pytest.raises(ValueError, match=r"the negative ratio τ must lie in \[0, 1\]"):
        mct_example([0.9, 0.8, 0.1, 0.2, 0.3], negative_ratio=ratio)


def test_mct_example_shuffles_the_relevant_documents_among_the_others():
    """Shown in a seeded random order: the relevant documents are not always listed first."""
    from gate.train.labels import mct_example

    listed = {tuple(mct_example([0.9, 0.8, 0.1, 0.2, 0.3], 0.5, 1.0, seed)["consistent"]) for seed in range(20)}
    assert len(listed) > 1 and listed != {(1, 2)}


# ---------------------------------------------------------------- completions and how they read back (gate.variants)


def test_completions_keep_non_ascii_text_as_written():
    from gate.variants import completion, spec

    assert (
        completion(spec("inspector"), {"pass": "false", "answer": "Zürich"}) == '{"pass": "false", "answer": "Zürich"}'
    )
    assert completion(spec("mct"), {"consistent": [2], "summary": "Größe"}) == '{"consistent": [2], "summary": "Größe"}'


def test_a_binary_label_must_be_a_bool():
    from gate.variants import completion, spec

    with pytest.raises(ValueError, match="variant hkb: binary label must be a bool, got 'false'"):
        completion(spec("hkb"), "false")


@pytest.mark.parametrize(
    "variant,text,expected",
    [
        ("answer", "  Paris ", "Paris"),
        ("answer", None, ""),
        ("hkb", None, None),
        ("hkb", "", None),
    ],
)
def test_parse_completion_of_empty_or_answer_replies(variant, text, expected):
    from gate.variants import parse_completion, spec

    assert parse_completion(spec(variant), text) == expected


def test_the_longest_verbaliser_a_reply_starts_with_wins_in_any_order():
    from gate.variants import verbaliser_index

    assert verbaliser_index(("no search", "no"), "no search needed") == 0
    assert verbaliser_index(("no", "no search"), "no search needed") == 1
    assert verbaliser_index(("no search", "no"), "no, thanks") is None  # "no," is not the word "no"
    assert verbaliser_index(("no search", "no"), "no thanks") == 1


def test_verbalisers_must_match_the_variants_count():
    from gate.variants import spec

    with pytest.raises(ValueError, match="variant hkb needs 2 verbalisers"):
        spec("hkb", ["yes", "no", "maybe"])


def test_the_answer_variant_takes_a_context_when_given_one():
    from gate.variants import spec, user_text

    assert user_text(spec("answer"), "Where?") == "Where?"
    assert user_text(spec("answer"), "Where?", "In caves.") == "Context: In caves.\nQuestion: Where?"
    assert user_text(spec("hkb"), "Where?", "In caves.") == "Where?"  # a no-context variant ignores one


def test_mct_reads_the_first_object_whose_numbers_are_all_integers():
    from gate.variants import parse_completion, spec

    reply = '{"consistent": [1, "two"]} {"consistent": {}} {"consistent": [true]} {"consistent": [2], "summary": "s"}'
    assert parse_completion(spec("mct"), reply) == {"consistent": [2], "summary": "s"}
