"""MMKB-RAG's MCT: Algorithm 3's examples (property-tested), SKB's stochastic digit, the inference strategies (table),
the consistency data stage and the pipeline's use of an mct gate."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gate.pipeline.consistency import apply_strategy
from gate.train.labels import mct_example, stochastic_digit


@given(st.lists(st.floats(0, 1), max_size=8), st.floats(0, 1), st.integers(0, 10**6))
def test_mct_example_properties(probs, tau, seed):
    got = mct_example(probs, gamma=0.5, negative_ratio=tau, seed=seed)
    relevant = [j for j, p in enumerate(probs) if p >= 0.5]
    norel = [j for j, p in enumerate(probs) if p < 0.5]
    if len(relevant) < 2:
        assert got is None
        return
    shown = got["shown"]
    assert len(set(shown)) == len(shown) and set(relevant) <= set(shown)
    assert len(shown) - len(relevant) == round(tau * len(norel))  # τ of the NoRel documents mixed in
    listed = [shown[i - 1] for i in got["consistent"]]
    assert sorted(listed) == relevant  # exactly the relevant ones...
    assert [probs[j] for j in listed] == sorted((probs[j] for j in listed), reverse=True)  # ...most relevant first
    assert mct_example(probs, 0.5, tau, seed) == got  # seeded


def test_mct_example_refuses_a_bad_ratio():
    with pytest.raises(ValueError, match="negative ratio"):
        mct_example([0.9, 0.9], negative_ratio=30)


@given(st.floats(1, 5), st.integers(0, 10**6))
def test_stochastic_digit_is_floor_or_ceil(score, seed):
    import math

    d = stochastic_digit(score, seed)
    assert d in (math.floor(score), math.ceil(score))
    assert stochastic_digit(float(round(score)), seed) == round(score)


def test_stochastic_digit_expectation_and_range():
    assert sum(stochastic_digit(3.75, s) for s in range(4000)) / 4000 == pytest.approx(3.75, abs=0.03)
    with pytest.raises(ValueError, match=r"\[1, 5\]"):
        stochastic_digit(5.5, 0)


@pytest.mark.parametrize(
    "strategy,parsed,docs,summary,fallback",
    [
        ("filter", {"consistent": [3, 1], "summary": "s"}, [0, 2], None, False),  # first-stage order kept
        ("rerank", {"consistent": [3, 1], "summary": "s"}, [2, 0, 1, 3], None, False),  # listed first, then the rest
        ("merge", {"consistent": [3, 1], "summary": "s"}, [2, 0], "s", False),
        ("merge", {"consistent": [3], "summary": None}, [0], None, True),  # merge without a summary
        ("filter", {"consistent": [9, 0], "summary": None}, [0], None, True),  # no valid number
        ("filter", {"consistent": [2, 2], "summary": None}, [1], None, False),  # repeats once
        ("filter", {"consistent": [4, 5, 1], "summary": None}, [0, 3], None, False),  # the last section is valid
        ("rerank", None, [0], None, True),  # unparseable output
    ],
)
def test_apply_strategy(strategy, parsed, docs, summary, fallback):
    got = apply_strategy(strategy, 4, parsed)
    assert (got["docs"], got["summary"], got["fallback"], got["strategy"]) == (docs, summary, fallback, strategy)


def test_apply_strategy_names():
    with pytest.raises(ValueError, match="filter, merge, rerank"):
        apply_strategy("vote", 3, None)
