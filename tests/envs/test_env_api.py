"""The environment API (lmforge.envs.base) and resolving environments by name (lmforge.envs.registry)."""

import sys
import types

import numpy as np
import pytest

from lmforge.core.errors import ConfigError
from lmforge.envs.base import EpisodeState, MalformedReply, StepResult, check_messages, check_step_result
from lmforge.envs.registry import make_environment, resolve_environment


class Echo:
    tools: list = []

    def __init__(self, answer_key: str = "answer"):
        self.answer_key = answer_key

    def reset(self, problem, state):
        state.info["target"] = problem[self.answer_key]
        return [{"role": "user", "content": problem["prompt"]}]

    def step(self, state, message):
        return StepResult([], {"correct": float(message["content"] == state.info["target"])}, done=True)


class NoStep:
    def reset(self, problem, state):
        return []


@pytest.fixture
def user_module(monkeypatch):
    module = types.ModuleType("my_envs")
    module.Echo, module.NoStep, module.not_a_class = Echo, NoStep, lambda: None
    monkeypatch.setitem(sys.modules, "my_envs", module)
    return module


def test_spec_resolves_a_user_class_and_passes_args(user_module):
    env = make_environment("my_envs:Echo", {"answer_key": "target"})
    state = EpisodeState(problem={"prompt": "2+2?", "target": "4"})
    assert env.reset(state.problem, state) == [{"role": "user", "content": "2+2?"}]
    assert env.step(state, {"role": "assistant", "content": "4"}).reward == {"correct": 1.0}


@pytest.mark.parametrize(
    "name, match",
    [
        ("no_such_env", "not a built-in environment"),
        ("my_envs:Missing", "has no class 'Missing'"),
        ("my_envs:not_a_class", "has no class"),
        ("my_envs:NoStep", "has no step method"),
        ("no_such_module_xyz:Env", "cannot import module"),
        (":Env", "both parts non-empty"),
    ],
)
def test_bad_names_are_config_errors(user_module, name, match):
    with pytest.raises(ConfigError, match=match):
        resolve_environment(name)


def test_unknown_constructor_argument_is_named(user_module):
    with pytest.raises(ConfigError, match=r"takes no argument\(s\) \['colour'\]"):
        make_environment("my_envs:Echo", {"colour": "red"})


@pytest.mark.parametrize(
    "messages, match",
    [
        ("hello", "expected a list"),
        ([{"role": "robot", "content": "x"}], "role 'robot'"),
        ([{"role": "assistant", "content": "x"}], "only the policy"),
        ([{"role": "user", "content": None}], "content NoneType"),
        (["x"], "expected a dict"),
    ],
)
def test_malformed_messages_are_named(messages, match):
    with pytest.raises(MalformedReply, match=match):
        check_messages(messages, "step")


def test_step_result_checks():
    good = StepResult([{"role": "tool", "content": "4"}], {"tool": 0.5}, done=False)
    assert check_step_result(good) is good
    numpy_part = StepResult([], {"r": np.float32(0.5), "n": np.int64(1)}, done=True)  # what numpy code returns
    assert check_step_result(numpy_part) is numpy_part
    with pytest.raises(MalformedReply, match="expected a StepResult"):
        check_step_result(([], {}, True))
    with pytest.raises(MalformedReply, match="finite number"):
        check_step_result(StepResult([], {"r": float("nan")}, done=True))
