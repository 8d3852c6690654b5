"""Rewards for real tasks: math-verify on the boxed / last number, format regexes, DAPO's overlong
penalty, weighted combinations from the config, and the parallel runner's timeouts and failures."""

from __future__ import annotations

import logging
import sys
import textwrap
import threading
import time

import pytest
import torch

from lmforge.core.config import load_config
from lmforge.core.errors import ConfigError, TrainingError
from lmforge.rollout.rewards import RewardSet, final_answer, format_reward, last_boxed, math_reward, overlong_reward

# ----------------------------------------------------------------------------- math


@pytest.mark.parametrize(
    "text,expected",
    [
        (r"so $\boxed{\frac{1}{2}}$ it is", r"\frac{1}{2}"),
        (r"\boxed{7} ... check: 8", "7"),  # the box wins over a later number
        (r"first \boxed{1}, then \boxed{x^{2}}", "x^{2}"),  # the last box, braces balanced
        ("I have 3 apples and 5 pears, 8 in all.", "8"),
        ("total: 1,234 dollars", "1234"),
        ("x = -3", "-3"),
        ("three quarters: 3/4", "3/4"),
        ("no digits here", None),
        (r"\boxed{12", "12"),  # an unfinished box is no box: the last number
    ],
)
def test_final_answer(text, expected):
    assert final_answer(text) == expected


def test_last_boxed_unbalanced_is_none():
    assert last_boxed(r"\boxed{12") is None and last_boxed("plain") is None


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        (r"so the answer is $\boxed{\frac{1}{2}}$", "0.5", 1.0),
        (r"the answer is $\boxed{4}$", "4", 1.0),
        (r"the answer is $\boxed{5}$", "4", 0.0),
        (r"\boxed{7}. Sanity check with 8 apples.", "7", 1.0),
        ("I had 12 apples and ate 5, leaving 7.", "7", 1.0),
        ("I had 12 apples and ate 5, leaving 7.", "12", 0.0),  # the last number, not any number
        ("It is 3/4 of the cake", "0.75", 1.0),
        ("The total is 1,234.", "1234", 1.0),
        ("The answer is -3", "-3", 1.0),
        ("The answer is 3", "-3", 0.0),
        ("I cannot tell.", "3", 0.0),
        ("The answer is 42", r"\boxed{42}", 1.0),  # a boxed reference answer
    ],
)
def test_math_reward(completion, answer, expected):
    pytest.importorskip("math_verify")
    assert math_reward(completion, {"answer": answer}) == expected


def test_math_reward_unparsable_reference_is_an_error():
    pytest.importorskip("math_verify")
    with pytest.raises(ValueError, match="cannot parse the reference answer"):
        math_reward("4", {"answer": "???"})


@pytest.mark.slow
def test_math_reward_inline_matches_process_pool():
    """The same verdicts from the default process pool. Slow: the forkserver workers import torch
    once (about 8 s on a busy 2-core machine)."""
    pytest.importorskip("math_verify")
    cases = [(r"\boxed{\frac12}", "0.5"), ("so 41", "42"), ("so 42", "42"), ("none", "1")]
    completions, problems = [c for c, _ in cases], [{"answer": a} for _, a in cases]
    with RewardSet([("math", 1.0)], timeout_s=0) as inline:
        want = inline(completions, problems).per_function[:, 0].tolist()
    assert want == [1.0, 0.0, 1.0, 0.0]
    with RewardSet([("math", 1.0)], timeout_s=30, workers=2) as pooled:
        assert pooled.executors == ["process"]
        assert pooled(completions, problems).per_function[:, 0].tolist() == want


# ----------------------------------------------------------------------------- format

THINK_ANSWER = r"<think>.*?</think>\s*<answer>.*?</answer>"


def test_format_search_and_full():
    good = "<think>2+2 is 4</think>\n<answer>4</answer>"
    assert format_reward(good, {}, pattern=THINK_ANSWER, match="full") == 1.0
    assert format_reward("  " + good + "\n", {}, pattern=THINK_ANSWER, match="full") == 1.0  # outer space stripped
    assert format_reward(good + " and more", {}, pattern=THINK_ANSWER, match="full") == 0.0
    assert format_reward(good + " and more", {}, pattern=THINK_ANSWER) == 1.0  # search: anywhere
    assert format_reward("<answer>4</answer>", {}, pattern=THINK_ANSWER) == 0.0
    assert (
        format_reward("<think>\nmulti\nline\n</think><answer>4</answer>", {}, pattern=THINK_ANSWER, match="full") == 1.0
    )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"pattern": "(<answer>"}, "not a valid regular expression"),
        ({"match": "fullmatch"}, "match must be 'search' or 'full'"),
        ({"patern": "x"}, r"unknown keyword\(s\) \['patern'\]"),
    ],
)
def test_format_bad_kwargs_fail_at_construction(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RewardSet([("format", 1.0, kwargs)])


# ----------------------------------------------------------------------------- overlong


@pytest.mark.parametrize(
    "length,expected",
    [
        (0, 0.0),
        (15, 0.0),  # up to max_len - cache = 15: no penalty
        (16, -0.2),
        (18, -0.6),
        (19, -0.8),  # (15 - L) / 5
        (20, -1.0),  # max_len itself: -1
        (21, -1.0),
        (100, -1.0),  # beyond: -1
    ],
)
def test_overlong_values(length, expected):
    assert overlong_reward("", {}, completion_len=length, max_len=20, cache=5) == pytest.approx(expected, abs=1e-12)


def test_overlong_defaults_from_max_new_tokens():
    # max_len = max_new_tokens = 10, cache = 10 // 5 = 2: the penalty starts after 8 tokens
    values = [overlong_reward("", {}, completion_len=n, max_new_tokens=10) for n in (8, 9, 10)]
    assert values == [0.0, -0.5, -1.0]
    assert overlong_reward("", {}, completion_len=7, max_new_tokens=10, max_len=8, cache=4) == -0.75  # max_len wins


def test_overlong_needs_lengths_and_checks_kwargs():
    with pytest.raises(ValueError, match="length in tokens"):
        overlong_reward("", {}, max_len=10)
    with pytest.raises(ValueError, match="max_len > 0"):
        overlong_reward("", {}, completion_len=3)
    with pytest.raises(ConfigError, match="must not exceed"):
        RewardSet([("overlong", 1.0, {"max_len": 4, "cache": 8})])
    # without completion_lens every call fails: counted, and the run stops (all of the batch failed)
    with pytest.raises(TrainingError, match="overlong.*length in tokens"):
        RewardSet([("overlong", 1.0, {"max_len": 4})])(["a", "b"], [{}, {}])


# ----------------------------------------------------------------------------- weighted, from the config


def test_weighted_combination_from_config():
    from lmforge.recipes.grpo import GRPOConfig

    cfg = load_config(
        GRPOConfig,
        None,
        [
            "data.task=addition",
            "rewards.functions=[{name: exact, weight: 1.0}, {name: format, weight: 0.2, pattern: '^\\d+$'},"
            " {name: overlong, weight: 0.5, kwargs: {cache: 2}}]",
        ],
    )
    specs = cfg.rewards.specs()
    assert specs == [
        ("exact", 1.0, {}, {}),
        ("format", 0.2, {"pattern": r"^\d+$"}, {}),
        ("overlong", 0.5, {"cache": 2}, {}),
    ]
    rewards = RewardSet(specs, timeout_s=cfg.rewards.timeout_s)
    problems = [{"answer": "42"}] * 3
    out = rewards(["42", "42 apples", "7"], problems, completion_lens=[3, 5, 4], max_new_tokens=4)
    # overlong with max_len 4, cache 2: L=3 -> -0.5, L=5 -> -1, L=4 -> -1
    expected = torch.tensor([[1.0, 1.0, -0.5], [0.0, 0.0, -1.0], [0.0, 1.0, -1.0]])
    torch.testing.assert_close(out.per_function, expected, rtol=0, atol=0)
    torch.testing.assert_close(out.total, torch.tensor([1 + 0.2 - 0.25, 0 + 0 - 0.5, 0 + 0.2 - 0.5]), rtol=0, atol=1e-7)
    rewards.close()


def test_config_options_and_errors():
    from lmforge.recipes.grpo import GRPOConfig

    cfg = load_config(
        GRPOConfig,
        None,
        [
            "data.task=addition",
            "rewards.timeout_s=2.5",
            "rewards.workers=3",
            "rewards.functions=[{name: exact, executor: process, failure_value: -1}]",
        ],
    )
    assert cfg.rewards.specs() == [("exact", 1.0, {}, {"executor": "process", "failure_value": -1})]
    assert (cfg.rewards.timeout_s, cfg.rewards.workers) == (2.5, 3)
    with pytest.raises(ConfigError, match="rewards.timeout_s"):
        load_config(GRPOConfig, None, ["data.task=addition", "rewards.timeout_s=-1"])
    with pytest.raises(ConfigError, match="executor must be one of"):
        RewardSet([("exact", 1.0, {}, {"executor": "gpu"})])
    with pytest.raises(ConfigError, match="unknown option"):
        RewardSet([("exact", 1.0, {}, {"retries": 2})])


# ----------------------------------------------------------------------------- timeouts and failures


@pytest.fixture
def slow_module(tmp_path, monkeypatch):
    (tmp_path / "slow_rewards.py").write_text(
        textwrap.dedent("""
        import threading, time
        RELEASE = threading.Event()

        def hang_on_hang(completion, problem):
            if completion == "hang":
                RELEASE.wait(60)  # a hung verifier (released when the test ends)
            return 1.0

        def sleep_on_hang(completion, problem):
            if completion == "hang":
                time.sleep(60)
            return 1.0

        def sleep_on_hang_pause_on_wait(completion, problem):
            time.sleep(60 if completion == "hang" else 0.3 if completion == "wait" else 0)
            return 1.0

        def deaf_on_hang(completion, problem):
            import signal
            if completion == "hang":  # blocks SIGALRM, like C code that never returns to Python
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
                time.sleep(60)
            return 1.0

        def raise_on_boom(completion, problem):
            if completion == "boom":
                raise RuntimeError("verifier crashed")
            return 1.0
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import slow_rewards

    yield slow_rewards
    slow_rewards.RELEASE.set()
    sys.modules.pop("slow_rewards", None)


def test_hanging_thread_call_times_out_and_the_batch_finishes(slow_module, caplog):
    rewards = RewardSet(
        [("slow_rewards:hang_on_hang", 1.0, {}, {"failure_value": -1.0}), ("exact", 1.0)], timeout_s=0.5, workers=2
    )
    completions = ["ok", "hang", "ok", "ok", "ok", "ok"]
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="lmforge.rollout.rewards"):
        out = rewards(completions, [{"answer": "ok"}] * 6)
    elapsed = time.monotonic() - start
    assert elapsed < 3.0, f"the batch took {elapsed:.1f} s with a 0.5 s timeout"  # busy machine: generous bound
    assert out.per_function[:, 0].tolist() == [1.0, -1.0, 1.0, 1.0, 1.0, 1.0]
    assert out.per_function[:, 1].tolist() == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert out.num_failed.tolist() == [1, 0] and out.num_timed_out.tolist() == [1, 0]
    assert rewards.total_timeouts == [1, 0] and rewards.total_failures == [1, 0]
    assert any("hang_on_hang" in r.getMessage() and "timed out after 0.5 s" in r.getMessage() for r in caplog.records)
    # the stuck thread is abandoned; the next batch runs on fresh threads
    out = rewards(["ok"] * 4, [{"answer": "ok"}] * 4)
    assert out.per_function[:, 0].tolist() == [1.0] * 4 and out.num_failed.tolist() == [0, 0]
    rewards.close()


def test_hanging_calls_beyond_the_worker_count_still_finish(slow_module):
    # three hung calls on two threads: the third is queued behind them and must still be reached
    rewards = RewardSet([("slow_rewards:hang_on_hang", 1.0)], timeout_s=0.3, workers=2, max_failure_fraction=1.0)
    start = time.monotonic()
    out = rewards(["hang", "hang", "hang", "ok"], [{}] * 4)
    assert time.monotonic() - start < 3.0
    assert out.per_function[:, 0].tolist() == [0.0, 0.0, 0.0, 1.0] and out.num_timed_out.tolist() == [3]
    rewards.close()


def test_raising_reward_is_counted_and_logged(slow_module, caplog):
    rewards = RewardSet([("slow_rewards:raise_on_boom", 1.0)], timeout_s=5, workers=2)
    with caplog.at_level(logging.WARNING, logger="lmforge.rollout.rewards"):
        out = rewards(["ok", "boom", "ok", "boom"], [{}] * 4)
    assert out.per_function[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert out.num_failed.tolist() == [2] and out.num_timed_out.tolist() == [0]
    messages = [r.getMessage() for r in caplog.records]
    assert "sample 1" in messages[0] and "RuntimeError: verifier crashed" in messages[0]
    assert "2 of 4" in messages[1]
    rewards.close()


def test_inline_mode_gives_the_same_scores(slow_module):
    specs = [("slow_rewards:raise_on_boom", 0.5), ("format", 2.0, {"pattern": "o"})]
    completions, problems = ["ok", "boom", "x"], [{}] * 3
    with RewardSet(specs, timeout_s=0) as inline, RewardSet(specs, timeout_s=5) as parallel:
        a, b = inline(completions, problems), parallel(completions, problems)
    assert a.per_function.tolist() == b.per_function.tolist() == [[1.0, 1.0], [0.0, 1.0], [1.0, 0.0]]
    assert a.num_failed.tolist() == b.num_failed.tolist() == [1, 0]


def test_close_stops_the_threads_and_the_set_is_reusable(slow_module):
    rewards = RewardSet([("exact", 1.0)], timeout_s=5, workers=3)
    rewards(["a"], [{"answer": "a"}])
    threads = [t for t in threading.enumerate() if t.name.startswith("lmforge-reward")]
    assert len(threads) >= 3
    rewards.close()
    for thread in threads:
        thread.join(2.0)
    assert not any(t.is_alive() for t in threads)
    assert rewards(["a"], [{"answer": "b"}]).per_function.tolist() == [[0.0]]
    rewards.close()


@pytest.mark.slow
def test_hanging_process_call_is_stopped_in_the_worker(slow_module):
    """A process-pool call that sleeps past the timeout is interrupted (SIGALRM) and counted; the pool
    keeps working. Slow: the forkserver workers import torch once (about 10 s on a busy 2-core machine)."""
    rewards = RewardSet([("slow_rewards:sleep_on_hang", 1.0, {}, {"executor": "process"})], timeout_s=1.0, workers=2)
    rewards(["warm"], [{}])
    start = time.monotonic()
    out = rewards(["ok", "hang", "ok", "ok"], [{}] * 4)
    elapsed = time.monotonic() - start
    assert elapsed < 10.0, f"{elapsed:.1f} s with a 1 s timeout"  # about 1 s when quiet; generous for a busy machine
    assert out.per_function[:, 0].tolist() == [1.0, 0.0, 1.0, 1.0] and out.num_timed_out.tolist() == [1], out
    assert rewards(["ok"] * 3, [{}] * 3).per_function[:, 0].tolist() == [1.0] * 3
    rewards.close()


@pytest.mark.slow
def test_late_start_reports_of_an_earlier_batch_are_ignored(slow_module):
    """A worker's start report can be read only during the next batch (it failed in CI with a
    KeyError). Reports of earlier calls claiming a start long ago must neither break the next batch
    nor be taken for the start of one of its calls (which would time out the 0.3 s one)."""
    rewards = RewardSet(
        [("slow_rewards:sleep_on_hang_pause_on_wait", 1.0, {}, {"executor": "process"})], timeout_s=1.0, workers=2
    )
    rewards(["warm"], [{}])
    reports = rewards.calls._executors["process"].started
    long_ago = time.monotonic() - 100.0
    for token in (0, 10_000):  # 0: the warm call's number (before, each batch counted from 0 again)
        reports.put((token, long_ago))
    time.sleep(0.5)  # a multiprocessing queue hands items over through a feeder thread
    out = rewards(["wait", "ok", "ok"], [{}] * 3)
    assert out.per_function[:, 0].tolist() == [1.0] * 3 and out.num_timed_out.tolist() == [0], out
    rewards.close()


@pytest.mark.slow
def test_process_calls_deaf_to_the_alarm_get_their_pool_killed(slow_module):
    """Workers that ignore SIGALRM are killed after timeout + max(1, timeout / 2); the calls queued
    behind them run again on a new pool and are scored. Slow: two pool start-ups."""
    rewards = RewardSet(
        [("slow_rewards:deaf_on_hang", 1.0, {}, {"executor": "process"})],
        timeout_s=1.0,
        workers=2,
        max_failure_fraction=1.0,
    )
    rewards(["warm"], [{}])
    old_processes = list(rewards.calls._executors["process"]._pool._processes.values())
    start = time.monotonic()
    out = rewards(["hang", "hang", "ok", "ok", "ok", "ok"], [{}] * 6)  # both workers stuck, four calls queued
    elapsed = time.monotonic() - start
    assert out.per_function[:, 0].tolist() == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0] and out.num_timed_out.tolist() == [2], (
        out,
        elapsed,
    )
    assert elapsed < 60.0  # 2 s to the kill, then a new pool's start-up (seconds on a busy machine)
    assert old_processes and not any(p.is_alive() for p in old_processes)
    assert rewards(["ok"] * 3, [{}] * 3).per_function[:, 0].tolist() == [1.0] * 3
    rewards.close()
