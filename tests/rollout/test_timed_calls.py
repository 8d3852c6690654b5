"""rollout/timed_calls.py, the one pool that reward functions and environment calls run on: what each
of the two former pools now gets from the other -- the environment's worker-reported start times and
located errors for rewards; call numbers never reused, cleanup when the pool is dropped, a given-up
pool given up once, for environments -- and the texts both share. The reward side's process workers
are tested through RewardSet (tests/rollout/test_rewards_real.py, slow)."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from lmforge.envs.episode import env_calls
from lmforge.rollout.timed_calls import TimedCalls, call_outcome, error_text, timeout_text


@pytest.fixture
def release():
    """An event the test's hanging calls wait on, set when the test ends so no thread outlives it long."""
    event = threading.Event()
    yield event
    event.set()


def _raise_here():
    raise KeyError("no such tool")


def test_an_error_names_its_type_message_and_the_line_that_raised():
    status, text = call_outcome(_raise_here, ())
    line = _raise_here.__code__.co_firstlineno + 1
    assert (status, text) == ("error", f"KeyError: 'no such tool' (at test_timed_calls.py:{line})")
    assert call_outcome(lambda a, b: a + b, (2, 3)) == ("ok", 5)
    assert error_text(ValueError("never raised")) == "ValueError: never raised"  # no traceback: no location


def test_a_timeout_names_the_setting_that_chose_it():
    assert (
        timeout_text(2.0, "env.tool_timeout_s", "call abandoned")
        == "timed out after 2 s (env.tool_timeout_s; call abandoned)"
    )


def test_an_environment_call_that_hangs_is_abandoned_and_the_one_queued_behind_it_still_runs(release):
    calls = env_calls(1, 0.3)  # one thread: "ok" waits behind "hang"
    try:
        start = time.monotonic()
        calls.submit("hang", release.wait, 60)
        calls.submit("ok", lambda: "answered")
        outcomes = calls.wait_all()
        elapsed = time.monotonic() - start
    finally:
        calls.close()
    assert outcomes == {
        "hang": ("timeout", "timed out after 0.3 s (env.tool_timeout_s; call abandoned)"),
        "ok": ("ok", "answered"),
    }
    assert elapsed < 3.0, f"{elapsed:.1f} s with a 0.3 s timeout"  # busy machine: generous


def test_a_call_is_timed_from_when_a_worker_takes_it_not_from_its_submission():
    # one thread, six calls of 0.2 s each with a 1 s timeout: the last ends 1.2 s after it was
    # submitted, but ran 0.2 s
    calls = TimedCalls(1, 1.0, "rewards.timeout_s", name="test-admission")
    try:
        for key in range(6):
            calls.submit(key, time.sleep, 0.2)
        assert calls.wait_all() == {key: ("ok", None) for key in range(6)}
    finally:
        calls.close()


def test_a_late_start_report_of_an_ended_call_is_not_taken_for_a_later_calls_start():
    started = threading.Event()

    def second():
        started.set()
        time.sleep(0.3)

    calls = TimedCalls(1, 1.0, "env.tool_timeout_s", name="test-tokens")
    try:
        calls.submit("first", lambda: 1)
        assert calls.wait_all() == {"first": ("ok", 1)}
        calls.submit("second", second)
        assert started.wait(5.0)
        # a report of the first call's number, read only now: a pool that numbered its calls from 0 again
        # would take it for the second call's start, long ago, and time that call out
        calls._thread_starts.put((0, time.monotonic() - 100.0))
        assert calls.wait_all() == {"second": ("ok", None)}
    finally:
        calls.close()


def test_a_pool_dropped_without_close_stops_its_threads():
    calls = TimedCalls(2, 1.0, "env.tool_timeout_s", name="test-dropped")
    calls.submit(0, lambda: 1)
    calls.wait_all()
    threads = [t for t in threading.enumerate() if t.name.startswith("lmforge-test-dropped-")]
    assert len(threads) == 2
    del calls
    gc.collect()
    for thread in threads:
        thread.join(2.0)
    assert not any(t.is_alive() for t in threads)


def test_a_call_overrunning_on_threads_given_up_already_leaves_the_new_threads_alone(release):
    calls = TimedCalls(2, 1.0, "env.tool_timeout_s", name="test-twice")
    try:
        calls.submit("a", release.wait, 60)
        time.sleep(0.5)
        calls.submit("b", release.wait, 60)  # times out about 0.5 s after "a"
        outcomes = dict(calls.poll(wait=True))
        assert list(outcomes) == ["a"] and outcomes["a"][0] == "timeout"
        calls.submit("c", lambda: "c")  # on fresh threads
        fresh = calls._executors["thread"]
        outcomes.update(calls.wait_all())
        assert outcomes["b"][0] == "timeout" and outcomes["c"] == ("ok", "c")
        assert calls._executors.get("thread") is fresh  # "b" ran on the given-up threads: nothing to give up
    finally:
        calls.close()


def _until(done, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
    return done()


def test_abandon_keeps_workers_that_are_not_busy_and_never_runs_the_queued_calls(release):
    ran, started = [], threading.Event()

    def hang():
        started.set()
        release.wait(60)

    calls = TimedCalls(1, 5.0, "env.tool_timeout_s", name="test-abandon")
    try:
        calls.submit("answered", lambda: "answered")  # ends, but is never collected
        idle = calls._executors["thread"]
        assert _until(lambda: calls._pending["answered"].future.done())
        calls.abandon()
        assert calls.num_pending == 0 and calls._executors["thread"] is idle  # not busy: kept
        calls.submit("running", hang)
        calls.submit("queued", ran.append, "queued")
        assert started.wait(5.0)
        calls.abandon()
        assert calls.num_pending == 0 and "thread" not in calls._executors  # the busy threads given up
        release.set()
        calls.submit("after", lambda: "after")
        assert calls.wait_all() == {"after": ("ok", "after")}  # no outcome of the abandoned calls
        time.sleep(0.1)
        assert ran == []  # the queued call never ran
    finally:
        calls.close()
