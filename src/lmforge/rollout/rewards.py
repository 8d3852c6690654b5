"""Reward functions for RL from verifiable rewards, and :class:`RewardSet`, which combines them.

A reward function has the signature ``fn(completion: str, problem, **kwargs) -> float`` where
``problem`` is a task :class:`~lmforge.data.tasks.Problem` or a data row (a dict with at least an
``"answer"`` key). Built-ins, chosen by name (docs/rewards.md has the formulas):

    exact     the task's own scorer (``Task.score``); without a task, exact match on the answer
    math      math-verify equivalence of the last ``\\boxed{}`` (else the last number) with the answer
    format    1.0 if a regular expression matches the completion (``pattern=``, ``match=search|full``)
    overlong  DAPO's soft overlong penalty from the completion's length in tokens (0 down to -1)

Any other function is named as ``"package.module:function"`` and imported on first use, and
``rm:DIR`` scores prompt + completion with the reward model saved in DIR (``lmforge rm``;
lmforge.rollout.reward_model).

A function with the attribute ``batched = True`` (``rm:DIR``) is called once per batch instead,
``fn(completions, problems, **kwargs) -> one float per completion``, in a worker thread under the
same timeout; if that call fails or times out, every completion of the batch fails with it.

Calls run in parallel (threads, or a process pool for functions marked ``executor="process"``,
e.g. ``math``) with a per-call timeout (:mod:`lmforge.rollout.timed_calls`). A call that raises,
returns NaN/inf or times out is a *failure*: it is logged, scored ``failure_value`` (0 by default)
and counted; one broken sample does not stop a run, but a function that fails on more than
``max_failure_fraction`` of a batch raises :class:`~lmforge.core.errors.TrainingError` naming the function
and its first error. :meth:`RewardSet.close` stops the workers (the RL runs call it at the end and
on errors).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..core.config import import_object
from ..core.errors import ConfigError, TrainingError
from .reward_model import reward_model_reward
from .timed_calls import TimedCalls, call_outcome

logger = logging.getLogger(__name__)

RewardFn = Callable[..., float]
EXECUTORS = ("thread", "process")


# ----------------------------------------------------------------------------- built-ins


def _field(problem: Any, name: str) -> Any:
    """``problem.name`` or ``problem[name]``; a clear error when neither exists."""
    if isinstance(problem, dict):
        if name not in problem:
            raise KeyError(f"row has no {name!r} key (keys: {sorted(problem)})")
        return problem[name]
    if not hasattr(problem, name):
        raise AttributeError(f"{type(problem).__name__} has no attribute {name!r}")
    return getattr(problem, name)


@functools.lru_cache(maxsize=32)
def _task_from_spec(spec: str) -> Any:
    from ..data.tasks import get_task  # lazy: only this path needs the task module

    return get_task(spec)


def _as_problem(row: dict) -> Any:
    from ..data.tasks import Problem

    return Problem(
        prompt=str(row.get("prompt", "")), completion=str(row.get("completion", "")), answer=str(_field(row, "answer"))
    )


def exact_reward(completion: str, problem: Any, task: Any = None) -> float:
    """The task's own scorer, ``task.score(completion, problem)``.

    ``task`` is a Task or a spec string for ``get_task`` (e.g. ``"addition:digits=2"``); a dict row
    may name its task under ``"task"`` and is turned into a Problem. With no task at all: 1.0 when
    the stripped completion equals the stripped ``answer``, else 0.0.
    """
    if task is None and isinstance(problem, dict):
        task = problem.get("task")
    if task is None:
        return float(completion.strip() == str(_field(problem, "answer")).strip())
    if isinstance(task, str):
        task = _task_from_spec(task)
    if isinstance(problem, dict):
        problem = _as_problem(problem)
    return float(task.score(completion, problem))


_LAST_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; None if none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
        i += 1
    return None  # unbalanced: an unfinished box is no answer


def final_answer(completion: str) -> str | None:
    """What ``math`` compares: the last ``\\boxed{}``'s contents, else the last number (commas in
    ``1,234`` dropped; ``3/4`` kept as a fraction), else None."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed.strip() or None
    numbers = _LAST_NUMBER.findall(completion)
    return numbers[-1].replace(",", "") if numbers else None


def math_reward(completion: str, problem: Any) -> float:
    """1.0 if math-verify judges the completion's final answer (:func:`final_answer`) equal to the
    problem's ``answer``, else 0.0 (also when the completion has no box and no number).

    The reference answer may itself be written ``\\boxed{...}``; one math-verify cannot parse is an
    error (a failure), not a 0. math-verify's own signal-based timeouts are off: the caller's per-call
    timeout applies (this function runs in the process pool by default).
    """
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise ImportError(
            "the 'math' reward needs math-verify: pip install 'lmforge[math]' (or pip install math-verify)"
        ) from exc
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" notes: ours applies
    answer = str(_field(problem, "answer"))
    gold_text = last_boxed(answer) or answer
    gold = parse(f"${gold_text}$", parsing_timeout=None)
    if all(isinstance(g, str) for g in gold):  # nothing parsed (math-verify keeps only the raw text)
        raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
    predicted = final_answer(completion)
    if predicted is None:
        return 0.0
    target = parse(f"${predicted}$", parsing_timeout=None)
    if not target:
        return 0.0
    return float(verify(gold, target, timeout_seconds=None))


math_reward.executor = "process"  # CPU-heavy (sympy): beside the training process, killable when stuck


@functools.lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern, flags=re.DOTALL)


def format_reward(
    completion: str, problem: Any, pattern: str = r"<answer>.*?</answer>", match: str = "search"
) -> float:
    """1.0 if the regular expression ``pattern`` (DOTALL: ``.`` spans lines) matches, else 0.0.

    ``match="search"`` looks anywhere in the completion; ``match="full"`` needs the whole completion
    (surrounding whitespace stripped) to match, e.g. ``<think>.*?</think>\\s*<answer>.*?</answer>``.
    """
    regex = _compiled(pattern)
    if match == "full":
        return float(regex.fullmatch(completion.strip()) is not None)
    return float(regex.search(completion) is not None)


def _check_format(pattern: str = r"<answer>.*?</answer>", match: str = "search") -> None:
    try:
        _compiled(pattern)
    except re.error as exc:
        raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {exc}") from None
    if match not in ("search", "full"):
        raise ValueError(f"match must be 'search' or 'full', got {match!r}")


format_reward.check_kwargs = _check_format


def overlong_reward(
    completion: str,
    problem: Any,
    completion_len: int | None = None,
    max_new_tokens: int | None = None,
    max_len: int = 0,
    cache: int = 0,
) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) of a completion of ``L`` tokens:

        0                                   if L <= max_len - cache
        (max_len - cache - L) / cache       if max_len - cache < L <= max_len   (linear, 0 -> -1)
        -1                                  if L > max_len

    ``L`` counts the generated tokens including the stop token (``completion_len``, passed by the RL
    step). ``max_len`` defaults to ``rollout.max_new_tokens`` and ``cache`` to a fifth of it (the
    paper: 4096 of 20480), at least 1. Added to the task reward with its weight, it is <= 0.
    """
    length_max = int(max_len or max_new_tokens or 0)
    if length_max <= 0:
        raise ValueError("overlong needs kwargs max_len > 0 (or rollout.max_new_tokens passed as max_new_tokens)")
    if completion_len is None:
        raise ValueError("overlong needs the completion's length in tokens (RewardSet(..., completion_lens=...))")
    cache_len = int(cache) or max(1, length_max // 5)
    start = length_max - cache_len
    if completion_len <= start:
        return 0.0
    if completion_len <= length_max:
        return (start - completion_len) / cache_len
    return -1.0


def _check_overlong(max_len: int = 0, cache: int = 0, **_: Any) -> None:
    if max_len < 0 or cache < 0:
        raise ValueError(f"max_len and cache must be >= 0, got max_len={max_len}, cache={cache}")
    if max_len and cache > max_len:
        raise ValueError(f"cache ({cache}) must not exceed max_len ({max_len})")


overlong_reward.check_kwargs = _check_overlong

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact": exact_reward,
    "math": math_reward,
    "format": format_reward,
    "overlong": overlong_reward,
}


def resolve_reward(name: str) -> RewardFn:
    """A built-in by name, a reward model as ``"rm:DIR"``, or a user function given as
    ``"package.module:function"``."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if name.startswith("rm:"):
        if not name[3:]:
            raise ConfigError("reward 'rm:': name the reward model's directory, e.g. rm:runs/rm/final")
        return reward_model_reward(name[3:])
    if ":" not in name:
        raise ConfigError(f"unknown reward {name!r}: use one of {sorted(BUILTIN_REWARDS)} or 'package.module:function'")
    fn, where = import_object(name, f"reward {name!r}", "function")
    if not callable(fn):
        raise ConfigError(f"reward {name!r}: module {where} has no callable {name.partition(':')[2]!r}")
    return fn


# ----------------------------------------------------------------------------- combining


@dataclass
class RewardOutput:
    """Rewards of one batch. B = batch, F = number of reward functions."""

    total: torch.Tensor  # (B,) float32: sum_f weight_f * per_function[:, f]
    per_function: torch.Tensor  # (B, F) float32: unweighted rewards, failure_value where the function failed
    names: list[str]  # (F,) names for logging, e.g. "exact", "mypkg.rewards:length"
    num_failed: torch.Tensor  # (F,) int64: failures per function in this batch (timeouts included)
    num_timed_out: torch.Tensor = dataclasses.field(  # (F,) int64: the failures that were timeouts
        default_factory=lambda: torch.zeros(0, dtype=torch.int64)
    )
    # (B, C) float32 or None: the parts of ``total`` an environment gave after each turn, on that turn's last
    # policy token (PPO credits them there; the rest of ``total`` goes on the last one). None: all at the end.
    turn_rewards: torch.Tensor | None = None


class _BatchCall:
    """A batched reward as ``_score`` calls it: ``fn(completions, problems, **kwargs)``, checked to give
    one value per completion (``batched``: ``_score`` returns the list of floats)."""

    batched = True

    def __init__(self, fn: RewardFn, num_rows: int):
        self.fn, self.num_rows = fn, num_rows

    def __call__(self, completions, problems, **kwargs) -> list:
        values = list(self.fn(completions, problems, **kwargs))
        if len(values) != self.num_rows:
            raise ValueError(f"a batched reward returned {len(values)} values for {self.num_rows} completions")
        return values


def _accepted_kwargs(fn: RewardFn) -> set[str] | None:
    """Keyword names ``fn`` accepts; None when it takes ``**kwargs`` (everything is accepted)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def default_workers() -> int:
    """Reward workers when none are configured: the cores, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


def _score(fn: RewardFn, completion: Any, problem: Any, kwargs: dict) -> float | list[float]:
    """One reward call as a worker runs it: ``fn(completion, problem, **kwargs)`` as a float (a list of
    floats for a function marked ``batched``, called with lists of completions and problems). A module
    function, so that a process worker can unpickle it."""
    value = fn(completion, problem, **kwargs)
    return [float(v) for v in value] if getattr(fn, "batched", False) else float(value)


class RewardSet:
    """Weighted sum of reward functions, run in parallel with a per-call timeout, robust to failures.

    specs: ``(name, weight)``, ``(name, weight, fn_kwargs)`` or ``(name, weight, fn_kwargs, options)``
    tuples, e.g. ``[("exact", 1.0), ("format", 0.2, {"pattern": r"####\\s*\\d+"})]``. ``options``:
    ``executor`` ("thread" or "process"; default: the function's ``executor`` attribute, else
    "thread") and ``failure_value`` (the score of a failed call, default 0.0).
    max_failure_fraction: a function failing on more than this fraction of a batch raises.
    timeout_s: longest time one call may run (> 0); 0 runs every call in the calling thread, one
    after the other, with no timeout.
    workers: threads, and processes for process functions (0 = :func:`default_workers`).
    """

    def __init__(
        self, specs: Sequence[tuple], max_failure_fraction: float = 0.5, timeout_s: float = 10.0, workers: int = 0
    ):
        if not specs:
            raise ConfigError("RewardSet needs at least one (name, weight) spec")
        if not 0.0 <= max_failure_fraction <= 1.0:
            raise ConfigError(f"max_failure_fraction must be in [0, 1], got {max_failure_fraction}")
        if not (math.isfinite(timeout_s) and timeout_s >= 0):
            raise ConfigError(f"reward timeout_s must be >= 0 (0 = no timeout, in the calling thread), got {timeout_s}")
        if workers < 0:
            raise ConfigError(f"reward workers must be >= 0 (0 = automatic), got {workers}")
        self.names: list[str] = []
        self.fns: list[RewardFn] = []
        self.fn_kwargs: list[dict[str, Any]] = []
        self.executors: list[str] = []
        self.failure_values: list[float] = []
        self._accepts: list[set[str] | None] = []
        weights = []
        for spec in specs:
            if len(spec) not in (2, 3, 4) or not isinstance(spec[0], str):
                raise ConfigError(
                    f"reward spec {spec!r}: expected (name, weight), (name, weight, kwargs) or "
                    "(name, weight, kwargs, options)"
                )
            name = spec[0]
            fn = resolve_reward(name)
            if not isinstance(spec[1], (int, float)) or not math.isfinite(spec[1]):
                raise ConfigError(f"reward {name!r}: weight must be a finite number, got {spec[1]!r}")
            fn_kwargs = dict(spec[2]) if len(spec) >= 3 else {}
            options = dict(spec[3]) if len(spec) == 4 else {}
            accepts = _accepted_kwargs(fn)
            self._check_kwargs(name, fn, fn_kwargs, accepts)
            unknown = set(options) - {"executor", "failure_value"}
            if unknown:
                raise ConfigError(
                    f"reward {name!r}: unknown option(s) {sorted(unknown)}; valid: executor, failure_value"
                )
            executor = options.get("executor") or getattr(fn, "executor", "thread")
            if executor not in EXECUTORS:
                raise ConfigError(f"reward {name!r}: executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
            if getattr(fn, "batched", False) and executor != "thread":
                raise ConfigError(
                    f"reward {name!r} is batched (one call per batch, e.g. a reward model): it runs in "
                    "a thread; drop executor=process"
                )
            failure_value = options.get("failure_value", 0.0)
            if not isinstance(failure_value, (int, float)) or not math.isfinite(failure_value):
                raise ConfigError(f"reward {name!r}: failure_value must be a finite number, got {failure_value!r}")
            self.names.append(name)
            self.fns.append(fn)
            self.fn_kwargs.append(fn_kwargs)
            self._accepts.append(accepts)
            self.executors.append(executor)
            self.failure_values.append(float(failure_value))
            weights.append(float(spec[1]))
        self.weights = torch.tensor(weights, dtype=torch.float32)  # (F,)
        self.max_failure_fraction = max_failure_fraction
        self.timeout_s = float(timeout_s)
        self.workers = workers or default_workers()
        self.total_failures = [0] * len(self.fns)  # over the whole run, for logging
        self.total_timeouts = [0] * len(self.fns)
        self.calls = TimedCalls(self.workers, self.timeout_s, "rewards.timeout_s", name="reward")
        # one batch on the pool at a time: a set may be called from two threads (the training set scores
        # the agent evaluation's episodes on the main thread while rollout.async_steps' thread scores a batch)
        self._scoring = threading.Lock()

    @staticmethod
    def _check_kwargs(name: str, fn: RewardFn, fn_kwargs: dict, accepts: set[str] | None) -> None:
        if accepts is not None:
            unknown = sorted(set(fn_kwargs) - accepts)
            if unknown:
                valid = sorted(accepts - {"completion", "problem"})
                raise ConfigError(f"reward {name!r}: unknown keyword(s) {unknown}; it accepts {valid}")
        check = getattr(fn, "check_kwargs", None)
        if check is not None:
            try:
                check(**fn_kwargs)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"reward {name!r}: {exc}") from None

    # ------------------------------------------------------------------------- workers

    def close(self) -> None:
        """Stop the worker threads and processes (idempotent; the set can be used again afterwards)."""
        self.calls.close()

    def __enter__(self) -> "RewardSet":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------- scoring

    def _kwargs(self, f: int, shared: dict[str, Any], length: int | None) -> dict[str, Any]:
        kwargs = {**shared, **({} if length is None else {"completion_len": length}), **self.fn_kwargs[f]}
        if self._accepts[f] is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self._accepts[f]}
        return kwargs

    def _batched(self, f: int) -> bool:
        return bool(getattr(self.fns[f], "batched", False))

    def _job_args(self, job: tuple[int, int], completions, problems, shared, lengths) -> tuple:
        """``(fn, completion(s), problem(s), kwargs)`` of a job; row -1: a batched function's whole batch."""
        i, f = job
        if i < 0:
            kwargs = self._kwargs(f, {**shared, "completion_lens": list(lengths)}, None)
            return _BatchCall(self.fns[f], len(completions)), list(completions), list(problems), kwargs
        return self.fns[f], completions[i], problems[i], self._kwargs(f, shared, lengths[i])

    def _run_inline(self, jobs: list[tuple[int, int]], completions, problems, shared, lengths) -> dict:
        return {job: call_outcome(_score, self._job_args(job, completions, problems, shared, lengths)) for job in jobs}

    def _run_parallel(self, jobs: list[tuple[int, int]], completions, problems, shared, lengths) -> dict:
        """Every job's ``(status, value_or_text)`` from the pool (``TimedCalls``: a job running longer
        than the timeout is ``timeout``)."""
        with self._scoring:  # waits at most for the other batch's calls, each bounded by the timeout
            for job in jobs:
                self.calls.submit(
                    job,
                    _score,
                    *self._job_args(job, completions, problems, shared, lengths),
                    process=self.executors[job[1]] == "process",
                )
            return self.calls.wait_all()

    def __call__(
        self,
        completions: Sequence[str],
        problems: Sequence[Any],
        *,
        completion_lens: Sequence[int] | None = None,
        **shared: Any,
    ) -> RewardOutput:
        """Score a batch. ``shared`` keywords (e.g. ``task=``, ``max_new_tokens=``) go to every function
        that accepts them; ``completion_lens`` (tokens per completion) reaches them as ``completion_len``."""
        if len(completions) != len(problems):
            raise ValueError(
                f"{len(completions)} completions but {len(problems)} problems; pass one problem per completion"
            )
        num_rows, num_fns = len(completions), len(self.fns)
        lengths = [None] * num_rows if completion_lens is None else [int(n) for n in completion_lens]
        if len(lengths) != num_rows:
            raise ValueError(f"{len(lengths)} completion_lens for {num_rows} completions")
        jobs = [(i, f) for f in range(num_fns) for i in ([-1] if self._batched(f) and num_rows else range(num_rows))]
        run = self._run_parallel if self.timeout_s > 0 else self._run_inline
        try:
            results = run(jobs, completions, problems, shared, lengths)
        except BaseException:
            self.close()  # e.g. KeyboardInterrupt while waiting: no worker outlives the error
            raise
        for job in [job for job in results if job[0] < 0]:  # a batched call: its outcome for each row
            status, value = results.pop(job)
            results.update({(i, job[1]): (status, value[i] if status == "ok" else value) for i in range(num_rows)})
        per_function = torch.zeros(num_rows, num_fns, dtype=torch.float32)
        num_failed = torch.zeros(num_fns, dtype=torch.int64)
        num_timed_out = torch.zeros(num_fns, dtype=torch.int64)
        for f, name in enumerate(self.names):
            first_error: str | None = None
            for i in range(num_rows):
                status, value = results[(i, f)]
                if status == "ok" and not math.isfinite(value):
                    status, value = "error", f"ValueError: reward is not finite: {value}"
                if status == "ok":
                    per_function[i, f] = value
                    continue
                per_function[i, f] = self.failure_values[f]
                num_failed[f] += 1
                num_timed_out[f] += status == "timeout"
                if first_error is None:  # one detailed warning per function and batch, then a count
                    first_error = value
                    logger.warning(
                        "reward %r failed on sample %d (%r), scored %g: %s",
                        name,
                        i,
                        completions[i][:200],
                        self.failure_values[f],
                        value,
                    )
            if int(num_failed[f]) > 1:
                logger.warning(
                    "reward %r failed on %d of %d samples in this batch (%d timed out; all scored %g)",
                    name,
                    int(num_failed[f]),
                    num_rows,
                    int(num_timed_out[f]),
                    self.failure_values[f],
                )
            self.total_failures[f] += int(num_failed[f])
            self.total_timeouts[f] += int(num_timed_out[f])
            if num_rows and int(num_failed[f]) > self.max_failure_fraction * num_rows:
                raise TrainingError(
                    f"reward {name!r} failed on {int(num_failed[f])}/{num_rows} samples (more than "
                    f"max_failure_fraction={self.max_failure_fraction}); first error: {first_error}"
                )
        total = per_function @ self.weights  # (B,)
        return RewardOutput(
            total=total,
            per_function=per_function,
            names=list(self.names),
            num_failed=num_failed,
            num_timed_out=num_timed_out,
        )
