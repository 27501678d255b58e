"""Rewards for the refiner: output format, rank tiers, and the batched retrieval reward (TRL reward functions)."""

from rewards.format import FormatReward, format_completion, format_reward, parse_completion, parse_query
from rewards.rank import DEFAULT_MISS, DEFAULT_TIERS, parse_tiers, rank_reward, validate_tiers
from rewards.retrieval import RetrievalReward

__all__ = [
    "DEFAULT_MISS",
    "DEFAULT_TIERS",
    "FormatReward",
    "RetrievalReward",
    "format_completion",
    "format_reward",
    "parse_completion",
    "parse_query",
    "parse_tiers",
    "rank_reward",
    "validate_tiers",
]
