"""The environment API: what a multi-turn environment is, and what it hands back after each turn.

An environment turns a task's problem into the first messages of a conversation (``reset``) and
answers each assistant message (``step``) with its own messages, reward parts and whether the
episode is over. The episode runner (``lmforge.envs.episode``) owns the conversation and the
tokens; an environment only sees messages. One environment object serves every episode of a run,
from several threads at once, so per-episode data belongs in ``state.info``, never on ``self``::

    class Echo:                                  # any class with these members is an Environment
        tools: list[dict] = []
        def reset(self, problem, state):
            state.info["target"] = problem.answer
            return [{"role": "user", "content": problem.prompt}]
        def step(self, state, message):
            right = message["content"].strip() == state.info["target"]
            return StepResult([], {"correct": float(right)}, done=True)

Messages are OpenAI-style dicts (:data:`Message`); :func:`check_messages` is the runner's check of
what an environment returns (a malformed reply is counted, and the episode ends, never the run).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Protocol, runtime_checkable

# An OpenAI-style chat message: {"role": "system" | "user" | "assistant" | "tool", "content": str, and
# optionally "tool_calls": [...], "tool_call_id": str, "name": str}.
Message = dict[str, Any]

ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass
class EpisodeState:
    """One episode, owned by the runner and handed to ``step``."""

    problem: Any  # the task's problem (lmforge.data.problem.Problem) or a data row (a dict)
    messages: list[Message] = dataclasses.field(default_factory=list)  # reset's messages, then every turn's
    turn: int = 0  # assistant turns taken so far
    info: dict = dataclasses.field(default_factory=dict)  # the environment's own scratch space
    # events the environment counts, summed into the step's metrics: "tool_calls", "invalid_tool_calls"
    # (the runner ends the episode at env.max_invalid_calls), "tool_errors" (lmforge.envs.tool_env)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """An environment's answer to one assistant message."""

    messages: list[Message]  # the environment's reply (user / tool messages); [] when done
    reward: dict[str, float] = dataclasses.field(default_factory=dict)  # this step's parts, summed over the episode
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    """What the episode runner calls (module doc). ``tools`` are OpenAI tool schemas given to the chat
    template ([] for none)."""

    tools: list[dict]

    def reset(self, problem: Any, state: EpisodeState) -> list[Message]:
        """The first messages of the episode for ``problem`` (``state.info`` may be filled here)."""

    def step(self, state: EpisodeState, message: Message) -> StepResult:
        """Answer the assistant's ``message`` (already appended to ``state.messages``)."""


class MalformedReply(ValueError):
    """An environment returned something that is not a list of messages / a StepResult. The runner
    counts it, logs it and ends that episode; the run goes on."""


def check_messages(messages: Any, where: str) -> list[Message]:
    """``messages`` if it is a list of messages with a known role and string content, else
    :class:`MalformedReply` saying what is wrong (``where`` names the call, e.g. ``reset``)."""
    if not isinstance(messages, list):
        raise MalformedReply(f"{where} returned {type(messages).__name__}, expected a list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise MalformedReply(f"{where}: message {i} is {type(message).__name__}, expected a dict")
        if message.get("role") not in ROLES:
            raise MalformedReply(f"{where}: message {i} has role {message.get('role')!r}; valid: {', '.join(ROLES)}")
        if message["role"] == "assistant":
            raise MalformedReply(f"{where}: message {i} has role 'assistant'; only the policy writes those")
        if not isinstance(message.get("content"), str):
            raise MalformedReply(
                f"{where}: message {i} has content {type(message.get('content')).__name__}, expected a string"
            )
    return messages


def check_step_result(result: Any) -> StepResult:
    """``result`` if it is a well-formed :class:`StepResult` (finite float reward parts), else
    :class:`MalformedReply`."""
    if not isinstance(result, StepResult):
        raise MalformedReply(f"step returned {type(result).__name__}, expected a StepResult")
    check_messages(result.messages, "step")
    if not isinstance(result.reward, dict):
        raise MalformedReply(f"step returned reward {type(result.reward).__name__}, expected a dict of floats")
    for name, value in result.reward.items():
        # numbers.Real: Python's and numpy's scalars alike (np.float32 is not a float); a bool is a mistake
        if (
            not isinstance(name, str)
            or isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not math.isfinite(value)
        ):
            raise MalformedReply(f"step returned reward part {name!r} = {value!r}; expected a finite number")
    return result
