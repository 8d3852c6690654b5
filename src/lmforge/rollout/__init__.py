"""Rollouts: the in-process sampling engine and reward functions."""

from .engine import (
    CastEngine,
    RolloutBatch,
    SamplingParams,
    decode_step,
    expand_cache,
    generate,
    make_cache,
    prefill,
    process_logits,
    sample_token,
)
from .rewards import BUILTIN_REWARDS, RewardOutput, RewardSet, resolve_reward

__all__ = [
    "CastEngine",
    "BUILTIN_REWARDS",
    "RewardOutput",
    "RewardSet",
    "RolloutBatch",
    "SamplingParams",
    "decode_step",
    "expand_cache",
    "generate",
    "make_cache",
    "prefill",
    "process_logits",
    "resolve_reward",
    "sample_token",
]
