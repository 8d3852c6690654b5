"""Rollout sources: where an RL step's rows come from, behind one interface (``base.RolloutSource``).

``rollout.backend`` names one of :data:`SOURCES`; ``rollout.async_steps > 0`` wraps it in
:class:`~lmforge.rl.sources.overlap.Overlapped`, which takes its batches ahead in a background
thread. Adding a source is one file with a ``build(setup) -> RolloutSource`` and one entry here
(docs/architecture.md shows one); the loop does not change.
"""

from __future__ import annotations

from typing import Callable

from ...core.errors import ConfigError
from . import agent, atropos, episodes, inprocess, verifiers, vllm
from .base import Policy, RolloutSource, SourceSetup
from .overlap import Overlapped, check_async

__all__ = ["SOURCES", "Policy", "RolloutSource", "SourceSetup", "check_source", "make_source", "resume_source"]

SOURCES: dict[str, Callable[[SourceSetup], RolloutSource]] = {
    "inprocess": inprocess.build,  # the built-in sampler, on the policy or a bf16 / fp16 copy (rollout.dtype)
    "vllm": vllm.build,  # vLLM in the training process (one CUDA GPU)
    "atropos": atropos.build,  # scored groups pulled from an Atropos API server
    "verifiers": verifiers.build,  # episodes of a verifiers v1 environment on the policy, served in process
    "agent": agent.build,  # episodes of an unmodified OpenAI-client agent on the policy, served in process
    "episodes": episodes.build,  # multi-turn episodes of env.name on the inprocess engines (chosen by env.name)
}


def source_name(rollout, env) -> str:
    """The source a run uses: ``episodes`` when ``env.name`` is set, else ``rollout.backend``."""
    return "episodes" if env is not None and env.name else rollout.backend


def check_source(rollout, is_level: str, distributed: bool) -> None:
    """ConfigError for an unknown ``rollout.backend`` or an overlap that cannot run (before the run
    directory is taken)."""
    if rollout.backend not in SOURCES or rollout.backend == "episodes":
        valid = ", ".join(name for name in SOURCES if name != "episodes")
        raise ConfigError(
            f"rollout.backend={rollout.backend!r} is not a rollout source; valid: {valid} (episodes "
            "of an environment: set env.name)"
        )
    check_async(rollout, is_level, distributed)


def make_source(setup: SourceSetup) -> RolloutSource:
    """The source ``setup.rollout.backend`` names (episodes when ``setup.env.name`` is set), overlapped
    when ``rollout.async_steps > 0``."""
    check_source(setup.rollout, setup.is_level, setup.ctx.distributed)
    source = SOURCES[source_name(setup.rollout, setup.env)](setup)
    if setup.rollout.async_steps:
        return Overlapped(source, setup)
    return source


def resume_source(source: RolloutSource, saved: dict, say: Callable[[str], None]) -> None:
    """Hand a resumed checkpoint's trainer state to ``source``. A synchronous source resuming an
    overlapped run's checkpoint says what it skips: the prompts of the batches that run had launched."""
    source.load_state_dict(saved)
    launched = saved.get("async_rollouts", {}).get("pending")
    if launched and not isinstance(source, Overlapped):
        say(
            f"[rollout] note: resuming an async checkpoint synchronously skips the prompts of its "
            f"{len(launched)} launched batch(es); set rollout.async_steps to train on them"
        )
