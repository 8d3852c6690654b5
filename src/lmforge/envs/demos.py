"""SFT warm-up demonstrations: whole episodes of an environment played by its scripted expert, as chat rows.

A built-in environment with a ``demonstration(state, rng) -> str`` method (the expert's next assistant
message; ``calculator``, ``guess_number``) plays each problem through its own ``reset`` / ``step``, so
a demonstration is exactly an episode the environment would accept and score. The rows are the SFT
``messages`` format (lmforge.data.sft) with the tools as lmforge.envs.toolcalls.render_messages gives
them to the template (the row's ``tools``, or the default format's system block for a template without
tool support): rendered by the chat template, a row is the text the episode runner renders for the same
conversation, so the model learns the very tokens it later samples in RL::

    rows = demonstration_rows(make_environment("calculator"), task.make_problems(64, 0, "train"), 0, tokenizer)
    # lmforge sft: data.task=multiplication data.env=calculator (supervised/sft_data.py)
"""

from __future__ import annotations

import random
from typing import Any

from ..core.errors import ConfigError
from .base import EpisodeState, Message, check_messages, check_step_result
from .toolcalls import supports_tools, tools_system_block

_MAX_TURNS = 100  # an expert that never finishes is a bug in its environment


def play(env, problem: Any, rng: random.Random) -> tuple[list[Message], dict[str, float]]:
    """One episode of ``env`` on ``problem`` with its expert replying; (the messages, the summed reward parts)."""
    state = EpisodeState(problem=problem)
    state.messages = list(check_messages(env.reset(problem, state), "reset"))
    totals: dict[str, float] = {}
    for state.turn in range(1, _MAX_TURNS + 1):
        message = {"role": "assistant", "content": env.demonstration(state, rng)}
        state.messages.append(message)
        result = check_step_result(env.step(state, message))
        for name, value in result.reward.items():
            totals[name] = totals.get(name, 0.0) + value
        if result.done:
            return state.messages, totals
        state.messages.extend(result.messages)
    raise RuntimeError(f"{type(env).__name__}'s expert did not finish within {_MAX_TURNS} turns")


def demonstration_rows(env, problems: list, seed: int, tokenizer) -> list[dict]:
    """One SFT row (``{"messages": [...]}``) per problem: the expert's episode, with the tools as the
    episode runner renders them for ``tokenizer`` (toolcalls.render_messages): a template that renders
    tools itself gets them as the row's ``tools`` (lmforge.data.sft passes them to it), any other the
    default format's system block as a message."""
    if not callable(getattr(env, "demonstration", None)):
        raise ConfigError(
            f"{type(env).__name__} has no scripted expert (a demonstration(state, rng) method), so "
            "it cannot write SFT demonstrations; built-in ones that do: calculator, guess_number"
        )
    native = bool(env.tools) and supports_tools(tokenizer)
    rng = random.Random(seed)
    rows = []
    for problem in problems:
        messages, _ = play(env, problem, rng)
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if native:
            rows.append({"messages": messages, "tools": env.tools})
            continue
        if env.tools:  # as render_messages adds it: merged into a first system message, else one of its own
            block = tools_system_block(env.tools)
            if messages[0]["role"] == "system":
                messages = [{**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}, *messages[1:]]
            else:
                messages = [{"role": "system", "content": block}, *messages]
        rows.append({"messages": messages})
    return rows
