"""A reward, an environment and an agent for the fault table (tests/reliability/test_faults.py), loaded by
name (``fault_plugins:score``) with this directory on PYTHONPATH. Each behaves until the launcher arms its
fault (``fault_launcher.armed()``, a file any process can see), then hangs or dies as the row asks."""

from __future__ import annotations

import os
import signal
import time
from typing import ClassVar

from lmforge.envs.base import StepResult

FOREVER_S = 3600.0


def _armed(kind: str) -> bool:
    folder = os.environ.get("LMFORGE_FAULT_DIR", "")
    return (
        bool(folder)
        and os.environ.get("LMFORGE_FAULT", "").split(":")[0] == kind
        and os.path.exists(os.path.join(folder, "armed"))
    )


def onset() -> None:
    """Note the moment the fault happened (the table's 'seconds to exit' count from the first one)."""
    with open(os.path.join(os.environ["LMFORGE_FAULT_DIR"], "onset"), "a") as out:
        out.write(f"{time.time()}\n")


def score(completion: str, problem, **kwargs) -> float:
    """A reward that varies within a group; under ``reward_hang`` it never returns, under
    ``reward_worker_dies`` its worker process is killed."""
    if _armed("reward_hang"):
        onset()
        time.sleep(FOREVER_S)
    if _armed("reward_worker_dies"):
        onset()
        os.kill(os.getpid(), signal.SIGKILL)
    return (len(completion) % 3) / 2


class Echo:
    """One turn: the prompt as a user message; the episode ends after the reply (scored by ``score``),
    unless ``env_hang`` is armed: then the environment's step never returns."""

    tools: ClassVar[list] = []

    def reset(self, problem, state):
        return [{"role": "user", "content": problem.prompt}]

    def step(self, state, message):
        if _armed("env_hang"):
            onset()
            time.sleep(FOREVER_S)
        return StepResult([], {"len": (len(message["content"]) % 3) / 2}, done=True)


def agent(base_url, problem, episode):
    """One chat call through the openai client; under ``agent_hang`` the agent never finishes."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": problem["prompt"]}])
    if _armed("agent_hang"):
        onset()
        time.sleep(FOREVER_S)
    return (len(reply.choices[0].message.content or "") % 3) / 2
