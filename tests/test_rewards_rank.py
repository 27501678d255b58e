"""Rank tiers: the paper's table, and validation of configured tables."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rewards import DEFAULT_TIERS, parse_tiers, rank_reward, validate_tiers
from rewards.rank import max_depth

PAPER = [
    (1, 4.0),
    (5, 4.0),
    (6, 3.5),
    (10, 3.5),
    (11, 3.0),
    (20, 3.0),
    (21, 1.0),
    (50, 1.0),
    (51, 0.5),
    (100, 0.5),
    (101, 0.1),
    (200, 0.1),
    (201, -2.5),
    (None, -2.5),
]


@pytest.mark.parametrize("rank,reward", PAPER)
def test_paper_tiers(rank, reward):
    assert rank_reward(rank) == reward


def test_custom_tiers_and_miss():
    tiers = validate_tiers([(1, 1, 2.0), (2, 3, 1.0)], miss=-1)
    assert [rank_reward(r, tiers, miss=-1) for r in (1, 2, 3, 4, None)] == [2.0, 1.0, 1.0, -1.0, -1.0]
    assert parse_tiers("1-5:4,6-10:3.5,11-20:3,21-50:1,51-100:0.5,101-200:0.1") == DEFAULT_TIERS


@pytest.mark.parametrize(
    "tiers,match",
    [
        ([], "empty"),
        ([(2, 5, 4.0)], "contiguous from rank 1"),
        ([(1, 5, 4.0), (7, 10, 3.0)], "should start at 6"),
        ([(1, 5, 4.0), (6, 4, 3.0)], "ends before it starts"),
        ([(1, 5, 3.0), (6, 10, 3.5)], "must not increase"),
        ([(1, 5, float("nan"))], "non-finite"),
        ("nonsense", "triples"),
    ],
)
def test_bad_tables_are_refused(tiers, match):
    with pytest.raises(ValueError, match=match):
        validate_tiers(tiers)


@pytest.mark.parametrize(
    "tiers,miss",
    [
        ([(1, 5, 4.0), (6, 10, 4.0)], -1.0),  # equal neighbours: "non-increasing" allows them
        ([(1, 5, 4.0), (6, 10, 1.0)], 1.0),  # a miss equal to the deepest tier's reward: "not above" it
    ],
)
def test_boundary_tables_are_accepted(tiers, miss):
    assert validate_tiers(tiers, miss) == tuple(tiers)


@pytest.mark.parametrize("miss", [float("nan"), float("-inf")])
def test_a_non_finite_miss_is_refused(miss):
    with pytest.raises(ValueError, match="must be finite"):
        validate_tiers(DEFAULT_TIERS, miss)


@pytest.mark.parametrize("tiers,depth", [(None, 200), (DEFAULT_TIERS, 200), (((1, 5, 4.0), (6, 30, 1.0)), 30)])
def test_max_depth_is_the_deepest_tiers_last_rank(tiers, depth):
    assert max_depth(tiers) == depth


def test_miss_above_last_tier_is_refused():
    with pytest.raises(ValueError, match="miss"):
        validate_tiers(DEFAULT_TIERS, miss=1.0)


def test_parse_tiers_checks_the_miss_reward_it_is_given():
    """Negative tiers below the default miss (-2.5) with a miss below them: refused naming a miss never set."""
    assert parse_tiers("1-5:-1,6-200:-3", miss=-5) == ((1, 5, -1.0), (6, 200, -3.0))
    with pytest.raises(ValueError, match="the miss reward -2 must be .* not above the deepest tier.s -3.0"):
        parse_tiers("1-5:-1,6-200:-3", miss=-2)


def test_parse_tiers_bad_text():
    with pytest.raises(ValueError, match="lo-hi:reward"):
        parse_tiers("1-5=4")


@given(st.integers(1, 400), st.integers(1, 400))
def test_reward_never_increases_with_rank(a, b):
    lo, hi = sorted((a, b))
    assert rank_reward(lo) >= rank_reward(hi) >= rank_reward(None)
