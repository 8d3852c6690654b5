"""Running reward calls in parallel with a per-call timeout (used by :class:`~lmforge.rollout.rewards.RewardSet`).

Two kinds of worker:

``thread``   daemon threads of this process. Cheap to start and to call; right for functions that
             are fast or wait on I/O. A call that overruns its timeout is *abandoned*: it is counted
             as a failure, its thread is left to finish in the background (Python cannot stop a
             thread), and the calls still queued move to fresh threads so they are not stuck
             behind it. Daemon threads never keep the interpreter from exiting.
``process``  a process pool (``forkserver`` on Linux, so workers start from a clean single-threaded
             server rather than a fork of the training process). Right for CPU-heavy verifiers
             (math-verify, sympy): they run beside the training process instead of holding the GIL.
             Inside the worker a ``SIGALRM`` timer interrupts a call that overruns (this stops pure
             Python code and sleeps); if the worker still does not answer within the timeout plus a
             grace period, counted from when the worker reported the call's start (code stuck in C that ignores signals), the pool's processes are killed,
             the call counts as a failure, and the other unfinished calls run again on a new pool.

A worker never sends exceptions back as objects (a user's exception type may not unpickle): it
returns ``("ok", value)``, ``("error", text)`` or ``("timeout", text)``.
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from typing import Any, Callable


class RewardTimeout(Exception):
    """Raised inside a worker process when a call overruns its timeout."""


def _on_alarm(signum, frame):  # noqa: ARG001 - signal handler signature
    raise RewardTimeout("timed out")


_STARTED = None  # in a process-pool worker: the queue on which it reports when each call starts


def _init_worker(started) -> None:
    global _STARTED
    _STARTED = started


def invoke(fn: Callable[..., Any], completion: str, problem: Any, kwargs: dict, alarm_s: float,
           token: int | None = None) -> tuple:
    """Call ``fn(completion, problem, **kwargs)``; the result as ``(status, value_or_text)`` (a list of
    floats for a function marked ``batched``, called with lists of completions and problems).

    ``alarm_s > 0`` arms a ``SIGALRM`` timer first; this only works in a process's main thread (a
    process-pool worker), and is skipped anywhere else. In a worker, ``token`` and the start time
    (``time.monotonic``, system-wide on Linux) go to the pool's ``started`` queue first, so that the
    parent times the call from when it really started, not from when it was queued.
    """
    if token is not None and _STARTED is not None:
        _STARTED.put((token, time.monotonic()))
    armed = alarm_s > 0 and threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    if armed:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, alarm_s)
    try:
        value = fn(completion, problem, **kwargs)
        # a batched function (RewardSet's whole-batch call): one float per completion
        return ("ok", [float(v) for v in value] if getattr(fn, "batched", False) else float(value))
    except RewardTimeout:
        return ("timeout", f"timed out after {alarm_s:g} s (rewards.timeout_s; stopped in the worker)")
    except Exception as exc:  # noqa: BLE001 - a reward may raise anything; the caller counts and logs it
        return ("error", f"{type(exc).__name__}: {exc}")
    finally:
        if armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def _ping() -> int:
    return os.getpid()


class DaemonThreadPool:
    """A minimal executor on daemon threads (``ThreadPoolExecutor``'s threads are joined at exit, so
    one hung call would keep the process alive)."""

    def __init__(self, workers: int, name: str = "reward"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"lmforge-{name}-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        from ..ops import adopt_thread_count
        adopt_thread_count()  # a reward model's forward may run here: its OpenMP team as set (ops.py)
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(exc)

    def submit(self, fn: Callable, *args: Any) -> cf.Future:
        future: cf.Future = cf.Future()
        self._queue.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Stop idle threads once the queue drains; a thread stuck in a call finishes in the background."""
        for _ in self._threads:
            self._queue.put(None)


def _process_context():
    if sys.platform.startswith("linux"):
        context = multiprocessing.get_context("forkserver")
        # workers import the reward module once in the server, not once each
        context.set_forkserver_preload(["lmforge.rollout.reward_pool", "lmforge.rollout.rewards"])
        return context
    return multiprocessing.get_context("spawn")


class ProcessPool:
    """A ``ProcessPoolExecutor`` that is started (and its workers warmed) before the first timed call,
    and that can be killed when a worker hangs."""

    STARTUP_TIMEOUT_S = 300.0  # first start: the forkserver imports torch and lmforge once

    def __init__(self, workers: int):
        self.workers = workers
        context = _process_context()
        self.started = context.Queue()  # (token, start time) of each call, from the workers
        self._pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_init_worker,
                                            initargs=(self.started,))
        warm = [self._pool.submit(_ping) for _ in range(workers)]
        done, not_done = cf.wait(warm, timeout=self.STARTUP_TIMEOUT_S)
        if not_done:
            self.kill()
            raise RuntimeError(f"reward process pool: workers did not start within {self.STARTUP_TIMEOUT_S:g} s")
        for future in done:
            future.result()  # a worker that failed to start raises here

    def submit(self, fn: Callable, *args: Any) -> cf.Future:
        return self._pool.submit(fn, *args)

    def drain_started(self) -> list[tuple[int, float]]:
        """The ``(token, start time)`` reports that arrived since the last call."""
        reports = []
        while True:
            try:
                reports.append(self.started.get_nowait())
            except queue.Empty:
                return reports

    def kill(self) -> None:
        """Terminate the workers now (hung or not) and release the pool."""
        processes = list(getattr(self._pool, "_processes", {}).values())  # private, but the only handle
        for process in processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + 5.0
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._close_queue()

    def _close_queue(self) -> None:
        self.started.close()
        self.started.cancel_join_thread()  # never block on reports nobody will read

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Cancel queued calls, let the workers exit for up to ``grace_s``, then kill what is left."""
        processes = list(getattr(self._pool, "_processes", {}).values())
        self._pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + grace_s
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        if any(process.is_alive() for process in processes):
            self.kill()
        else:
            self._close_queue()
