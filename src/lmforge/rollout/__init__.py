"""Rollouts: the in-process sampling engine, the continuous-batching engine (``continuous``), reward functions
and the timed-call pool they and environment calls run on (``timed_calls``), held-out evaluation, reward models."""

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
