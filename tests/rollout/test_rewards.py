"""Reward functions and RewardSet: built-ins, user functions, weighting, failure handling."""

from __future__ import annotations

import logging
import math
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from lmforge.core.errors import ConfigError, TrainingError
from lmforge.data.tasks import Problem, get_task
from lmforge.rollout.rewards import RewardSet, exact_reward, format_reward, math_reward, resolve_reward

# ----------------------------------------------------------------------------- built-ins


def test_exact_uses_the_task_scorer():
    task = get_task("addition:digits=2")
    problem = Problem(prompt="37+48=", completion="58", answer="85")  # completion is the reversed sum
    assert exact_reward("58", problem, task=task) == 1.0
    assert exact_reward("85", problem, task=task) == 0.0
    assert exact_reward(" 58<eos>", problem, task="addition:digits=2") == 1.0  # spec string works too
    row = {"prompt": "37+48=", "completion": "58", "answer": "85", "task": "addition"}  # dict row naming its task
    assert exact_reward("58", row) == 1.0 and exact_reward("580", row) == 0.0


def test_exact_without_task_compares_stripped_answer():
    assert exact_reward(" 42\n", {"answer": "42"}) == 1.0
    assert exact_reward("42.0", {"answer": "42"}) == 0.0
    with pytest.raises(KeyError, match="answer"):
        exact_reward("42", {"solution": "42"})


def test_format_reward_pattern():
    assert format_reward("think... <answer>7</answer>", {}) == 1.0
    assert format_reward("<answer>\n7\n</answer>", {}) == 1.0  # DOTALL: spans lines
    assert format_reward("7", {}) == 0.0
    assert format_reward("#### 12", {}, pattern=r"####\s*\d+") == 1.0


def test_math_reward_uses_math_verify():
    pytest.importorskip("math_verify")
    assert math_reward(r"so the answer is $\boxed{\frac{1}{2}}$", {"answer": "0.5"}) == 1.0
    assert math_reward(r"the answer is $\boxed{4}$", {"answer": "4"}) == 1.0
    assert math_reward(r"the answer is $\boxed{5}$", {"answer": "4"}) == 0.0


def test_math_reward_without_math_verify_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes "import math_verify" raise ImportError
    with pytest.raises(ImportError, match="pip install"):
        math_reward("4", {"answer": "4"})


# ----------------------------------------------------------------------------- resolving names


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent("""
        import time

        def length(completion, problem, **kwargs):
            return float(len(completion))

        def slow_length(completion, problem, **kwargs):
            time.sleep(0.01)
            return float(len(completion))

        def picky(completion, problem, scale=1.0):
            return scale * float(completion == problem["answer"])

        def sometimes_broken(completion, problem, **kwargs):
            if "boom" in completion:
                raise ZeroDivisionError("division by zero in user reward")
            return 1.0

        def non_finite(completion, problem, **kwargs):
            return {"nan": float("nan"), "inf": float("inf")}.get(completion, 1.0)

        NOT_CALLABLE = 3
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_resolve_user_function(user_module):
    assert resolve_reward(f"{user_module}:length")("abc", {}) == 3.0


@pytest.mark.parametrize(
    "name,message",
    [
        ("no_such_module_xyz:fn", "cannot import module"),
        ("my_rewards:missing", "no callable"),
        ("my_rewards:NOT_CALLABLE", "no callable"),
        ("exactly", "unknown reward"),
    ],
)
def test_resolve_errors_are_clear(user_module, name, message):
    with pytest.raises(ConfigError, match=message):
        resolve_reward(name)


# ----------------------------------------------------------------------------- RewardSet


def test_weighted_total_and_matrix(user_module):
    rewards = RewardSet([("exact", 1.0), (f"{user_module}:length", 0.5), ("format", 2.0, {"pattern": r"^\d+$"})])
    out = rewards(["42", "7x", "123"], [{"answer": "42"}, {"answer": "7"}, {"answer": "5"}])
    expected = torch.tensor([[1.0, 2.0, 1.0], [0.0, 2.0, 0.0], [0.0, 3.0, 1.0]])
    assert out.names == ["exact", "my_rewards:length", "format"]
    torch.testing.assert_close(out.per_function, expected, rtol=0, atol=0)
    torch.testing.assert_close(out.total, torch.tensor([1 + 1.0 + 2, 0 + 1.0 + 0, 0 + 1.5 + 2]), rtol=0, atol=0)
    assert out.num_failed.tolist() == [0, 0, 0]


def test_shared_kwargs_reach_only_functions_that_accept_them(user_module):
    rewards = RewardSet([(f"{user_module}:picky", 1.0, {"scale": 3.0}), ("exact", 1.0)])
    row = {"prompt": "37+48=", "completion": "58", "answer": "58"}
    # picky has no **kwargs and no `task` parameter: it must not receive task=...; exact uses it.
    out = rewards(["58"], [row], task=get_task("addition:digits=2"))
    assert out.per_function.tolist() == [[3.0, 1.0]]


def test_failures_are_logged_scored_zero_and_counted(user_module, caplog):
    rewards = RewardSet([(f"{user_module}:sometimes_broken", 1.0), ("exact", 1.0)])
    completions = ["ok", "boom " + "x" * 500, "ok", "boom", "ok", "ok"]
    with caplog.at_level(logging.WARNING, logger="lmforge.rollout.rewards"):
        out = rewards(completions, [{"answer": "ok"}] * 6)
    assert out.per_function[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert out.total.tolist() == [2.0, 0.0, 2.0, 0.0, 2.0, 2.0]
    assert out.num_failed.tolist() == [2, 0]
    rewards(["boom"] + ["ok"] * 5, [{"answer": "ok"}] * 6)
    assert rewards.total_failures == [3, 0]  # accumulated over batches
    message = caplog.records[0].getMessage()
    assert "sometimes_broken" in message and "ZeroDivisionError" in message and "boom xxx" in message
    assert len(message) < 400  # the sample text is truncated
    assert "2 of 6" in caplog.records[1].getMessage()  # further failures are counted, not repeated


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_non_finite_rewards_are_failures(user_module, bad):
    rewards = RewardSet([(f"{user_module}:non_finite", 1.0)])
    out = rewards([bad, "ok", "ok"], [{}] * 3)
    assert out.per_function[:, 0].tolist() == [0.0, 1.0, 1.0]
    assert out.num_failed.tolist() == [1] and math.isfinite(float(out.total.sum()))


def test_too_many_failures_raise_training_error(user_module):
    rewards = RewardSet([("exact", 1.0), (f"{user_module}:sometimes_broken", 1.0)])
    rewards(["boom", "boom", "ok", "ok"], [{"answer": "ok"}] * 4)  # exactly half: tolerated
    with pytest.raises(TrainingError, match=r"sometimes_broken.*3/4.*ZeroDivisionError: division by zero"):
        rewards(["boom", "boom", "boom", "ok"], [{"answer": "ok"}] * 4)
    strict = RewardSet([(f"{user_module}:sometimes_broken", 1.0)], max_failure_fraction=0.0)
    with pytest.raises(TrainingError):
        strict(["boom", "ok"], [{}, {}])


def test_bad_specs_and_inputs():
    with pytest.raises(ConfigError):
        RewardSet([])
    with pytest.raises(ConfigError):
        RewardSet([("exact",)])
    with pytest.raises(ConfigError):
        RewardSet([("exact", 1.0)], max_failure_fraction=1.5)
    with pytest.raises(ConfigError, match="weight"):
        RewardSet([("exact", float("nan"))])
    with pytest.raises(ValueError, match="one problem per completion"):
        RewardSet([("exact", 1.0)])(["a", "b"], [{"answer": "a"}])


def test_a_failed_calls_warning_names_the_line_of_the_users_file_that_raised(user_module, caplog):
    with caplog.at_level(logging.WARNING, logger="lmforge.rollout.rewards"):
        RewardSet([(f"{user_module}:sometimes_broken", 1.0)])(["boom", "ok"], [{}, {}])
    lines = Path(sys.modules[user_module].__file__).read_text().splitlines()
    line = 1 + next(i for i, text in enumerate(lines) if "raise ZeroDivisionError" in text)
    message = caplog.records[0].getMessage()
    assert f"ZeroDivisionError: division by zero in user reward (at my_rewards.py:{line})" in message


def test_one_set_called_from_two_threads_at_once_scores_each_batch(user_module):
    """The agent evaluation scores on the training set while rollout.async_steps' thread may score a
    batch: the two batches share the set's pool one after the other, each with its own results."""
    rewards = RewardSet([(f"{user_module}:slow_length", 1.0)], timeout_s=5.0, workers=2)
    out, errors, together = {}, [], threading.Barrier(2, timeout=10.0)

    def score(name: str, completions: list[str]) -> None:
        try:
            together.wait()
            out[name] = rewards(completions, [{}] * len(completions)).per_function[:, 0].tolist()
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=score, args=(name, [name * n for n in range(1, 40)])) for name in "ab"]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30.0)
    finally:
        rewards.close()
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert out == {"a": [float(n) for n in range(1, 40)], "b": [float(n) for n in range(1, 40)]}
