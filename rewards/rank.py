"""Rank-tier retrieval reward (the paper's table by default).

A tier table is a list of ``(lo, hi, reward)``: contiguous from rank 1, increasing, rewards non-increasing with
rank; a rank deeper than the last tier (or ``None``) earns ``miss``.
"""

from __future__ import annotations

import math

# WikiSeeker's rank-tier retrieval reward (its reward definition for the refiner's GRPO; docs/design.md, "Rewards"):
# the gold entity's rank → reward, and DEFAULT_MISS beyond rank 200 or when it is not retrieved. The one place these
# values are stated: RefinerArguments' defaults (rl/arguments.py: reward_tiers, miss_reward, depth) are built from
# them, and the real GRPO configs (configs/grpo/{evqa,infoseek}.yaml) leave them to those defaults.
DEFAULT_TIERS: tuple[tuple[int, int, float], ...] = (
    (1, 5, 4.0),
    (6, 10, 3.5),
    (11, 20, 3.0),
    (21, 50, 1.0),
    (51, 100, 0.5),
    (101, 200, 0.1),
)
DEFAULT_MISS = -2.5


def validate_tiers(tiers, miss: float = DEFAULT_MISS) -> tuple[tuple[int, int, float], ...]:
    """Return the table as tuples, or raise ValueError saying what is wrong with it."""
    try:
        table = tuple((int(lo), int(hi), float(r)) for lo, hi, r in tiers)
    except (TypeError, ValueError):
        raise ValueError(f"reward tiers must be a list of [lo, hi, reward] triples, got {tiers!r}") from None
    if not table:
        raise ValueError("reward tiers are empty")
    expected_lo = 1
    for lo, hi, r in table:
        if lo != expected_lo:
            raise ValueError(
                f"reward tiers must be contiguous from rank 1: tier [{lo}, {hi}] should start at {expected_lo}"
            )
        if hi < lo:
            raise ValueError(f"reward tier [{lo}, {hi}] ends before it starts")
        if not math.isfinite(r):
            raise ValueError(f"reward tier [{lo}, {hi}] has a non-finite reward {r}")
        expected_lo = hi + 1
    for (lo1, hi1, r1), (lo2, hi2, r2) in zip(table, table[1:]):
        if r2 > r1:
            raise ValueError(
                f"rewards must not increase with rank: [{lo2}, {hi2}] → {r2} is above [{lo1}, {hi1}] → {r1}"
            )
    if not math.isfinite(float(miss)) or float(miss) > table[-1][2]:
        raise ValueError(f"the miss reward {miss} must be finite and not above the deepest tier's {table[-1][2]}")
    return table


def parse_tiers(text: str, miss: float = DEFAULT_MISS) -> tuple[tuple[int, int, float], ...]:
    """``"1-5:4,6-10:3.5,…"`` → a tier table, validated with the miss reward it is paid beside."""
    tiers = []
    for part in str(text).split(","):
        try:
            span, reward = part.split(":")
            lo, hi = span.split("-")
            tiers.append((int(lo), int(hi), float(reward)))
        except ValueError:
            raise ValueError(f"reward tier {part.strip()!r} must look like lo-hi:reward (e.g. 1-5:4)") from None
    return validate_tiers(tiers, miss)


def max_depth(tiers=None) -> int:
    return (tiers or DEFAULT_TIERS)[-1][1]


def rank_reward(rank: int | None, tiers=None, miss: float | None = None) -> float:
    """Reward of a 1-based rank (``None`` = not retrieved)."""
    table = DEFAULT_TIERS if tiers is None else tiers
    miss = DEFAULT_MISS if miss is None else float(miss)
    if rank is None:
        return miss
    for lo, hi, r in table:
        if lo <= rank <= hi:
            return r
    return miss
