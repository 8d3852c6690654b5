"""The seam between an RL step and where its rows come from: the :class:`RolloutSource` protocol and
the :class:`SourceSetup` a source is built from.

The loop calls a source in this order (``lmforge.rl.loop.train_rl``)::

    source.load_state_dict(saved)            # once, resuming: what the checkpoint's trainer state holds
    source.sync_weights(policy, version)     # once before the first step: the start (or resumed) weights
    for step in first..max_steps:
        scored = source.next_batch(step)     # the recipe's step: this rank's rows, scored
        ...update...
        source.sync_weights(policy, step)    # the weights after the step's update
        source.state_dict()                  # when a checkpoint is written
    source.close()                           # however the run ends

``policy`` is a callable returning the full policy module (under FSDP2 it gathers the shards: a
collective, so a source calls it on every rank or on none, at the same step). A source that samples
from the live policy keeps what it returns; one with its own copy (bf16, vLLM) copies from it; one
fed by an inference server pushes it there. A source may call it later, in its next ``next_batch``
(the sampling sources do: after the last step no copy is made). ``version`` counts the optimizer's
RL steps behind those weights.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from ...parallel.context import ParallelContext
from ...rollout import RewardSet
from ...runtime.optim import BatchOrder
from ..batch import ScoredRollout
from ..config import EnvConfig, RolloutConfig
from ..prompts import PromptSet

Policy = Callable[[], torch.nn.Module]


class RolloutSource(Protocol):
    """Where an RL step's rows come from (module doc for the order of calls)."""

    def next_batch(self, step: int) -> ScoredRollout:
        """This rank's rows for ``step`` (1-based), scored; the metrics reduced over ranks."""

    def sync_weights(self, policy: Policy, version: int) -> None:
        """The policy has changed: ``policy()`` gives it, after ``version`` RL steps."""

    def state_dict(self) -> dict:
        """What a checkpoint must hold for an exact resume ({} when nothing); merged into the trainer state."""

    def load_state_dict(self, state: dict) -> None:
        """Resume from a checkpoint's trainer state (every key, not only this source's)."""

    def close(self) -> None:
        """Stop threads and processes; called however the run ends."""


@dataclasses.dataclass(frozen=True)
class SourceSetup:
    """What a source is built from: the rollout section and the run's parts it may use, resolved."""

    rollout: RolloutConfig  # the rollout section (sampling, backend keys)
    prompts: PromptSet  # the run's prompts (sampling sources draw from them)
    order: BatchOrder  # the run's prompt order; the runtime checkpoints it
    tokenizer: Any
    reward_set: RewardSet  # the configured rewards, with their timeouts and workers
    ctx: ParallelContext
    policy: torch.nn.Module  # the full policy at the start (for sources that copy it)
    seed: int  # train.seed
    num_mini_batches: int  # algo.num_mini_batches: how a step's prompts are shared out (rank_prompts)
    is_level: str  # algo.is_level (a source whose logprobs differ from the trainer's says so)
    max_prompt_len: int  # data.max_prompt_len, resolved
    max_steps: int  # train.max_steps
    run_dir: Path
    bf16_native: bool  # the device multiplies bf16 natively (hardware.HardwareInfo.bf16_supported)
    print: Callable[[str], None]  # the run's console (rank 0 prints)
    env: EnvConfig | None = None  # the env section: env.name set -> episodes of that environment (sources/episodes.py)
