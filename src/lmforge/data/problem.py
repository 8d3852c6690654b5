"""What every task is made of: a :class:`Problem`, and the fixed split a prompt belongs to (below
the task modules: the built-in tasks, reasoning-gym's and data rows' all use it)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

SPLITS = ("train", "val", "test")
_SPLIT_SHARES = (0.8, 0.1, 0.1)  # train, val, test


@dataclass(frozen=True)
class Problem:
    """One task instance.

    prompt:     the text the model is conditioned on, e.g. ``"37+48="``.
    completion: the exact target text for SFT (without any eos token), e.g. ``"58"``.
    answer:     the answer in human-readable form, e.g. ``"85"``; for logging and for checkers.
    """

    prompt: str
    completion: str
    answer: str


def split_of(prompt: str) -> str:
    """The split a prompt belongs to: a fixed function of the prompt text (sha256), seed-independent."""
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    cumulative = 0.0
    for split, share in zip(SPLITS, _SPLIT_SHARES):
        cumulative += share
        if u < cumulative:
            return split
    return SPLITS[-1]
