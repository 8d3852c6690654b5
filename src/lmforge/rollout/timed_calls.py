"""One pool for the calls that may hang: reward functions (:class:`~lmforge.rollout.rewards.RewardSet`)
and environment calls (:class:`~lmforge.envs.episode.EpisodeRunner`) both run on a :class:`TimedCalls`,
so a reward and a tool that hang are admitted, timed, given up, reported and counted the same way.

Admission. A call is submitted under a key and runs when a worker is free; its clock starts when a
worker takes it (the worker reports the start), so time spent queued behind other calls never counts.

Two kinds of worker:

``thread``   daemon threads of this process. Cheap to start and to call; right for functions that
             are fast or wait on I/O, and the only kind for an environment (it holds state here:
             its episodes' states, its connections). A call that overruns its timeout is
             *abandoned*: its thread is left to finish in the background (Python cannot stop a
             thread), and the calls still queued move to fresh threads so they are not stuck
             behind it. Daemon threads never keep the interpreter from exiting.
``process``  a process pool (``forkserver`` on Linux, so workers start from a clean single-threaded
             server rather than a fork of the training process). Right for CPU-heavy verifiers
             (math-verify, sympy): they run beside the training process instead of holding the GIL.
             Inside the worker a ``SIGALRM`` timer interrupts a call that overruns (this stops pure
             Python code and sleeps); if the worker still does not answer within the timeout plus a
             grace period, counted from when the worker reported the call's start (code stuck in C
             that ignores signals), the pool's processes are killed, the call is timed out, and the
             other unfinished calls run again on a new pool.

Outcomes. Every call ends as ``("ok", value)``, ``("error", text)`` or ``("timeout", text)``, which
the callers count by status and log. A worker never sends exceptions back as objects (a user's
exception type may not unpickle). An error reads ``Type: message (at file.py:line)``, the line that
raised; a timeout ``timed out after T s (KEY; what became of the call)``, KEY being the setting that
chose T (``rewards.timeout_s``, ``env.tool_timeout_s``).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
import traceback
import weakref
from typing import Any, Callable

Outcome = tuple[str, Any]  # ("ok", value), ("error", text) or ("timeout", text)
TICK_S = 0.01  # a timed wait looks at the clocks (and the workers' start reports) this often


class CallTimeout(Exception):
    """Raised inside a worker process when a call overruns its timeout."""


def _on_alarm(signum, frame):
    raise CallTimeout("timed out")


def timeout_text(seconds: float, key: str, how: str) -> str:
    """A timed-out call's text: the limit, the setting that chose it, and ``how`` the call was given up."""
    return f"timed out after {seconds:g} s ({key}; {how})"


def error_text(exc: BaseException) -> str:
    """``Type: message (at file.py:line)``: the line that raised, so a user finds a bug in their function.
    The file's name without its directory keeps the warning that quotes it to one readable line."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def call_outcome(fn: Callable[..., Any], args: tuple, alarm_s: float = 0.0, key: str = "") -> Outcome:
    """``fn(*args)`` as an outcome (module doc). ``alarm_s > 0`` arms a ``SIGALRM`` timer first; this only
    works in a process's main thread (a process-pool worker), and is skipped anywhere else."""
    armed = alarm_s > 0 and threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    if armed:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, alarm_s)
    try:
        return "ok", fn(*args)
    except CallTimeout:
        return "timeout", timeout_text(alarm_s, key, "stopped in the worker")
    except Exception as exc:  # noqa: BLE001 - a user's function may raise anything; the caller counts and logs it
        return "error", error_text(exc)
    finally:
        if armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def _drain(reports) -> list[tuple[int, float]]:
    """The ``(token, start time)`` reports waiting in ``reports`` (a thread or a process queue)."""
    out = []
    while True:
        try:
            out.append(reports.get_nowait())
        except queue.Empty:
            return out


# ----------------------------------------------------------------------------- the workers


class DaemonThreadPool:
    """A minimal executor on daemon threads (``ThreadPoolExecutor``'s threads are joined at exit, so
    one hung call would keep the process alive). Each call's ``(token, start time)`` goes to
    ``started``, which the pools that replace one another share: a call that started just before its
    pool was given up is still timed."""

    def __init__(self, workers: int, name: str, started: queue.SimpleQueue):
        self.started = started
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"lmforge-{name}-{i}", daemon=True) for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        from ..core.ops import adopt_thread_count

        adopt_thread_count()  # a reward model's forward may run here: its OpenMP team as set (core/ops.py)
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, token, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            self.started.put((token, time.monotonic()))
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(exc)

    def submit(self, token: int, fn: Callable, *args: Any) -> cf.Future:
        future: cf.Future = cf.Future()
        self._queue.put((future, token, fn, args))
        return future

    def shutdown(self) -> None:
        """Stop idle threads once the queue drains; a thread stuck in a call finishes in the background."""
        for _ in self._threads:
            self._queue.put(None)

    kill = shutdown  # a thread cannot be stopped: giving the pool up is all there is


_STARTED = None  # in a process-pool worker: the queue on which it reports when each call starts


def _init_worker(started) -> None:
    global _STARTED
    _STARTED = started


def _reported(token: int, fn: Callable, *args: Any) -> Any:
    """A process worker's call, its start reported first (``time.monotonic`` is system-wide on Linux),
    so that the parent times it from when it really started, not from when it was queued."""
    _STARTED.put((token, time.monotonic()))
    return fn(*args)


def _ping() -> int:
    return os.getpid()


def _process_context():
    if sys.platform.startswith("linux"):
        context = multiprocessing.get_context("forkserver")
        # workers import the modules of the process calls (reward functions) once in the server, not once each
        context.set_forkserver_preload(["lmforge.rollout.timed_calls", "lmforge.rollout.rewards"])
        return context
    return multiprocessing.get_context("spawn")


class ProcessPool:
    """A ``ProcessPoolExecutor`` that is started (and its workers warmed) before the first timed call,
    and that can be killed when a worker hangs."""

    STARTUP_TIMEOUT_S = 300.0  # first start: the forkserver imports torch and lmforge once

    def __init__(self, workers: int, name: str):
        context = _process_context()
        self.started = context.Queue()  # (token, start time) of each call, from the workers
        self._pool = cf.ProcessPoolExecutor(
            max_workers=workers, mp_context=context, initializer=_init_worker, initargs=(self.started,)
        )
        warm = [self._pool.submit(_ping) for _ in range(workers)]
        done, not_done = cf.wait(warm, timeout=self.STARTUP_TIMEOUT_S)
        if not_done:
            self.kill()
            raise RuntimeError(f"{name} process pool: workers did not start within {self.STARTUP_TIMEOUT_S:g} s")
        for future in done:
            future.result()  # a worker that failed to start raises here

    def submit(self, token: int, fn: Callable, *args: Any) -> cf.Future:
        return self._pool.submit(_reported, token, fn, *args)

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


# ----------------------------------------------------------------------------- the pool


@dataclasses.dataclass
class _Call:
    """A pending call: what to run, and where and since when it runs (``start``: None until reported)."""

    fn: Callable[..., Any]
    args: tuple
    kind: str  # "thread" or "process"
    token: int = -1  # matches the worker's start report; never reused
    future: cf.Future | None = None
    workers: Any = None  # the DaemonThreadPool or ProcessPool it was submitted to
    start: float | None = None


def _shutdown_all(executors: dict) -> None:
    for kind in list(executors):
        executors.pop(kind).shutdown()


class TimedCalls:
    """Calls on ``workers`` threads (and, for calls submitted with ``process=True``, ``workers``
    processes), each limited to ``timeout_s`` from when a worker takes it (0: no limit). Timeouts
    name ``timeout_key``, the setting that chose ``timeout_s``; threads are named ``lmforge-{name}-i``.
    Workers start on first use and again after :meth:`close`.

    ``submit`` calls, ``poll`` the ones that ended (or ``wait_all`` for every one); ``abandon`` the
    pending ones when the batch that wanted them failed; ``close`` at the end (also done when the pool
    is garbage-collected, or at interpreter exit).
    """

    def __init__(self, workers: int, timeout_s: float, timeout_key: str, name: str):
        self.workers, self.timeout_s, self.timeout_key, self.name = workers, timeout_s, timeout_key, name
        self._executors: dict[str, Any] = {}  # "thread" / "process" -> the workers new calls go to
        self._thread_starts: queue.SimpleQueue = queue.SimpleQueue()  # shared by successive thread pools
        self._pending: dict[Any, _Call] = {}  # in submission order
        self._keys: dict[int, Any] = {}  # token -> key of the pending calls
        # numbered across batches: a start report read after its call ended must match no later call
        self._tokens = itertools.count()
        self._finalizer = weakref.finalize(self, _shutdown_all, self._executors)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def limit_s(self, kind: str) -> float:
        """How long a started call of ``kind`` may run before it is given up: the timeout, and for a
        process a grace period more (its worker stops it itself at the timeout, with SIGALRM)."""
        if kind == "process" and self.timeout_s:
            return self.timeout_s + max(1.0, 0.5 * self.timeout_s)
        return self.timeout_s

    def submit(self, key: Any, fn: Callable[..., Any], *args: Any, process: bool = False) -> None:
        """Queue ``fn(*args)`` under ``key`` (a key not pending), on a process worker with ``process``
        (``fn`` and ``args`` must then pickle: ``fn`` importable by module path)."""
        assert key not in self._pending, f"{key!r} is pending already"
        self._run(key, _Call(fn, args, "process" if process else "thread"))

    def _run(self, key: Any, call: _Call) -> None:
        workers = self._executors.get(call.kind)
        if workers is None:
            workers = (
                DaemonThreadPool(self.workers, self.name, self._thread_starts)
                if call.kind == "thread"
                else ProcessPool(self.workers, self.name)
            )
            self._executors[call.kind] = workers
        call.token, call.workers, call.start = next(self._tokens), workers, None
        alarm_s = self.timeout_s if call.kind == "process" else 0.0
        call.future = workers.submit(call.token, call_outcome, call.fn, call.args, alarm_s, self.timeout_key)
        self._pending[key], self._keys[call.token] = call, key

    def _forget(self, key: Any) -> _Call:
        call = self._pending.pop(key)
        del self._keys[call.token]
        return call

    def poll(self, wait: bool) -> list[tuple[Any, Outcome]]:
        """The calls that ended since the last poll, as ``(key, outcome)`` in submission order (a call
        moved to fresh workers counts as submitted then). With ``wait``, blocks until one has ended or
        timed out, when any is pending (with ``timeout_s`` 0: as long as the calls run)."""
        while True:
            if wait and self._pending:
                cf.wait(
                    [call.future for call in self._pending.values()],
                    return_when=cf.FIRST_COMPLETED,
                    timeout=TICK_S if self.timeout_s else None,
                )
            ended = self._collect()
            if ended or not wait or not self._pending:
                return ended

    def wait_all(self) -> dict[Any, Outcome]:
        """Every pending call's outcome, waiting for the last (each bounded as in :meth:`poll`)."""
        outcomes: dict[Any, Outcome] = {}
        while self._pending:
            outcomes.update(self.poll(wait=True))
        return outcomes

    def _collect(self) -> list[tuple[Any, Outcome]]:
        """One look at the pending calls: the ended ones, and the overdue ones given up as timeouts."""
        process = self._executors.get("process")  # a given-up process pool's calls have all moved or died
        for reports in (self._thread_starts, *([process.started] if process else [])):
            for token, start in _drain(reports):
                if token in self._keys:  # else the late report of a call that has ended
                    self._pending[self._keys[token]].start = start
        now, ended, overdue = time.monotonic(), [], []
        for key, call in list(self._pending.items()):
            if call.future.done():
                outcome = self._result(call)
            elif self.timeout_s and call.start is not None and now - call.start > self.limit_s(call.kind):
                how = "worker killed" if call.kind == "process" else "call abandoned"
                outcome = ("timeout", timeout_text(self.timeout_s, self.timeout_key, how))
                overdue.append(call)
            else:
                continue
            ended.append((key, outcome))
            self._forget(key)
        for call in overdue:
            if self._executors.get(call.kind) is call.workers:  # else given up already
                self._replace(call.kind)
        return ended

    def _result(self, call: _Call) -> Outcome:
        try:
            return call.future.result()
        except Exception as exc:  # noqa: BLE001 - e.g. BrokenProcessPool: a worker process died
            if self._executors.get(call.kind) is call.workers:
                self._executors.pop(call.kind).kill()  # broken: the next call starts new workers
            return "error", f"{type(exc).__name__}: {exc} (the {self.name} worker died)"

    def _replace(self, kind: str) -> None:
        """Give up the ``kind`` workers after a call overran: a thread pool is left to drain (the stuck
        thread finishes in the background), a process pool is killed. Its calls still queued (for a
        process pool, also those running) move to fresh workers; running threads go on being timed."""
        workers = self._executors.pop(kind)
        moved = [
            key
            for key, call in self._pending.items()
            if call.workers is workers and (kind == "process" or call.future.cancel())
        ]
        workers.kill()
        for key in moved:
            self._run(key, self._forget(key))

    def abandon(self) -> None:
        """Forget the pending calls (a batch that failed): the queued ones never run, and workers busy
        with one are given up as at a timeout, so no result of this batch reaches a later one."""
        busy = {
            call.kind
            for call in self._pending.values()
            if not (call.future.cancel() or call.future.done()) and self._executors.get(call.kind) is call.workers
        }
        for kind in busy:
            self._executors.pop(kind).kill()
        self._pending.clear()
        self._keys.clear()

    def close(self) -> None:
        """Forget the pending calls and stop the workers: idle threads exit, a thread stuck in a call
        finishes in the background, processes get a few seconds and are then killed."""
        for call in self._pending.values():
            call.future.cancel()
        self._pending.clear()
        self._keys.clear()
        _shutdown_all(self._executors)
