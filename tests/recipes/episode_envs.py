"""Environments for the episode tests, loaded by name as ``episode_envs:<Class>`` (tests/recipes is on
sys.path): one that ends after the first reply, a multi-turn one, a tool-using one and broken ones."""

import time

from lmforge.envs.base import StepResult
from lmforge.envs.tool_env import ToolEnv


class OneTurn:
    """The single-turn case as an environment: the prompt as one user message, done after one reply."""

    tools: list = []

    def reset(self, problem, state):
        return [{"role": "user", "content": problem.prompt}]

    def step(self, state, message):
        return StepResult([], {}, done=True)


class Again:
    """Asks "again" until the ``turns``-th reply: the part ``turn`` is 0.25 after each earlier reply, and
    ``said`` is 1 when the last reply is non-empty."""

    tools: list = []

    def __init__(self, turns: int = 2):
        self.turns = turns

    def reset(self, problem, state):
        return [{"role": "user", "content": problem.prompt}]

    def step(self, state, message):
        if state.turn < self.turns:
            return StepResult([{"role": "user", "content": "again"}], {"turn": 0.25}, done=False)
        return StepResult([], {"said": float(bool(message["content"].strip()))}, done=True)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


class Adder(ToolEnv):
    """A tool environment: the answer is scored by the task's exact check."""

    def __init__(self):
        super().__init__([add])

    def finish(self, state, message):
        return StepResult([], {"correct": float(message["content"].strip() == str(state.problem.answer))}, done=True)


class Raises:
    tools: list = []

    def reset(self, problem, state):
        return [{"role": "user", "content": problem.prompt}]

    def step(self, state, message):
        raise RuntimeError("environment bug")


class Hangs(Raises):
    def step(self, state, message):
        time.sleep(3)
        return StepResult([], {}, done=True)


class Malformed(Raises):
    def step(self, state, message):
        return StepResult([{"role": "user", "content": 42}], {}, done=False)


class Recorder(Again):
    """``Again``, writing each episode's prompt to ``<path>.<pid>`` when it starts (which process
    played which problems)."""

    def __init__(self, path: str, turns: int = 2):
        super().__init__(turns)
        self.path = path

    def reset(self, problem, state):
        import os
        import threading

        with _LOCK.setdefault("lock", threading.Lock()):
            with open(f"{self.path}.{os.getpid()}", "a") as handle:
                handle.write(problem.prompt + "\n")
        return super().reset(problem, state)


_LOCK: dict = {}
