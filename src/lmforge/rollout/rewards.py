"""Reward functions for RL from verifiable rewards, and :class:`RewardSet`, which combines them.

A reward function has the signature ``fn(completion: str, problem, **kwargs) -> float`` where
``problem`` is a task :class:`~lmforge.data.tasks.Problem` or a data row (a dict with at least an
``"answer"`` key). Built-ins, chosen by name:

    exact   the task's own scorer (``Task.score``); without a task, exact match on the answer
    math    symbolic equivalence through ``math-verify`` (optional dependency)
    format  1.0 if a regular expression matches the completion (``pattern=`` keyword)

Any other function is named as ``"package.module:function"`` and imported on first use.

A function that raises, or returns NaN/inf, is a *failure*: it is logged, scored 0 and counted.
One broken sample does not stop a run; a function that fails on more than ``max_failure_fraction``
of a batch raises :class:`~lmforge.errors.TrainingError` naming the function and its first error.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math
import re
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..errors import ConfigError, TrainingError

logger = logging.getLogger(__name__)

RewardFn = Callable[..., float]


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

    return Problem(prompt=str(row.get("prompt", "")), completion=str(row.get("completion", "")),
                   answer=str(_field(row, "answer")))


def exact_reward(completion: str, problem: Any, task: Any = None, **kwargs: Any) -> float:
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


def math_reward(completion: str, problem: Any, **kwargs: Any) -> float:
    """1.0 if ``math-verify`` judges the completion's final answer equal to the problem's answer."""
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise ImportError(
            "the 'math' reward needs math-verify: pip install 'lmforge[math]' (or pip install math-verify)"
        ) from exc
    answer = str(_field(problem, "answer"))
    # math-verify parses LaTeX or plain expressions; wrap a bare answer so both forms are recognised.
    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    return float(verify(gold, parse(completion)))


def format_reward(completion: str, problem: Any, pattern: str = r"<answer>.*?</answer>", **kwargs: Any) -> float:
    """1.0 if the regular expression ``pattern`` matches anywhere in the completion (DOTALL), else 0.0."""
    return float(re.search(pattern, completion, flags=re.DOTALL) is not None)


BUILTIN_REWARDS: dict[str, RewardFn] = {"exact": exact_reward, "math": math_reward, "format": format_reward}


def resolve_reward(name: str) -> RewardFn:
    """A built-in by name, or a user function given as ``"package.module:function"``."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" not in name:
        raise ConfigError(
            f"unknown reward {name!r}: use one of {sorted(BUILTIN_REWARDS)} or 'package.module:function'"
        )
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"reward {name!r}: expected 'package.module:function' with both parts non-empty")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"reward {name!r}: cannot import module {module_name!r} ({exc}); is it installed or on PYTHONPATH?"
        ) from exc
    except Exception as exc:  # the module itself is broken: a syntax error, or code that raises on import
        raise ConfigError(f"reward {name!r}: importing module {module_name!r} failed at "
                          f"{_where_raised(exc)}: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        where = getattr(module, "__file__", None) or module_name
        raise ConfigError(f"reward {name!r}: module {module_name!r} ({where}) has no callable {attr!r}")
    return fn


def _where_raised(exc: BaseException) -> str:
    """``file:line`` of a syntax error, else of the innermost frame of ``exc``'s traceback."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "(unknown place)"


# ----------------------------------------------------------------------------- combining

@dataclass
class RewardOutput:
    """Rewards of one batch. B = batch, F = number of reward functions."""

    total: torch.Tensor  # (B,) float32: sum_f weight_f * per_function[:, f]
    per_function: torch.Tensor  # (B, F) float32: unweighted rewards, 0 where the function failed
    names: list[str]  # (F,) names for logging, e.g. "exact", "mypkg.rewards:length"
    num_failed: torch.Tensor  # (F,) int64: failures per function in this batch


def _accepted_kwargs(fn: RewardFn) -> set[str] | None:
    """Keyword names ``fn`` accepts; None when it takes ``**kwargs`` (everything is accepted)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


class RewardSet:
    """Weighted sum of reward functions, robust to individual failures.

    specs: ``(name, weight)`` or ``(name, weight, fn_kwargs)`` tuples, e.g.
    ``[("exact", 1.0), ("format", 0.2, {"pattern": r"####\\s*\\d+"})]``.
    max_failure_fraction: a function failing on more than this fraction of a batch raises.
    """

    def __init__(self, specs: Sequence[tuple], max_failure_fraction: float = 0.5):
        if not specs:
            raise ConfigError("RewardSet needs at least one (name, weight) spec")
        if not 0.0 <= max_failure_fraction <= 1.0:
            raise ConfigError(f"max_failure_fraction must be in [0, 1], got {max_failure_fraction}")
        self.names: list[str] = []
        self.fns: list[RewardFn] = []
        self.fn_kwargs: list[dict[str, Any]] = []
        self._accepts: list[set[str] | None] = []
        weights = []
        for spec in specs:
            if len(spec) not in (2, 3) or not isinstance(spec[0], str):
                raise ConfigError(f"reward spec {spec!r}: expected (name, weight) or (name, weight, kwargs)")
            fn = resolve_reward(spec[0])
            self.names.append(spec[0])
            self.fns.append(fn)
            self.fn_kwargs.append(dict(spec[2]) if len(spec) == 3 else {})
            self._accepts.append(_accepted_kwargs(fn))
            if not isinstance(spec[1], (int, float)) or not math.isfinite(spec[1]):
                raise ConfigError(f"reward {spec[0]!r}: weight must be a finite number, got {spec[1]!r}")
            weights.append(float(spec[1]))
        self.weights = torch.tensor(weights, dtype=torch.float32)  # (F,)
        self.max_failure_fraction = max_failure_fraction
        self.total_failures = [0] * len(self.fns)  # over the whole run, for logging

    def _call_one(self, f: int, completion: str, problem: Any, shared: dict[str, Any]) -> float:
        kwargs = {**shared, **self.fn_kwargs[f]}
        if self._accepts[f] is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self._accepts[f]}
        value = float(self.fns[f](completion, problem, **kwargs))
        if not math.isfinite(value):
            raise ValueError(f"reward is not finite: {value}")
        return value

    def __call__(self, completions: Sequence[str], problems: Sequence[Any], **shared: Any) -> RewardOutput:
        """Score a batch. ``shared`` keywords (e.g. ``task=``) go to every function that accepts them."""
        if len(completions) != len(problems):
            raise ValueError(f"{len(completions)} completions but {len(problems)} problems; "
                             "pass one problem per completion")
        num_rows, num_fns = len(completions), len(self.fns)
        per_function = torch.zeros(num_rows, num_fns, dtype=torch.float32)
        num_failed = torch.zeros(num_fns, dtype=torch.int64)
        for f, name in enumerate(self.names):
            first_error: Exception | None = None
            for i, (completion, problem) in enumerate(zip(completions, problems)):
                try:
                    per_function[i, f] = self._call_one(f, completion, problem, shared)
                except Exception as exc:  # noqa: BLE001 - a user reward may raise anything; counted and logged
                    num_failed[f] += 1
                    if first_error is None:  # one detailed warning per function and batch, then a count
                        first_error = exc
                        logger.warning("reward %r failed on sample %d (%r), scored 0: %s: %s",
                                       name, i, completion[:200], type(exc).__name__, exc)
            if int(num_failed[f]) > 1:
                logger.warning("reward %r failed on %d of %d samples in this batch (all scored 0)",
                               name, int(num_failed[f]), num_rows)
            self.total_failures[f] += int(num_failed[f])
            if num_rows and int(num_failed[f]) > self.max_failure_fraction * num_rows:
                raise TrainingError(
                    f"reward {name!r} failed on {int(num_failed[f])}/{num_rows} samples (more than "
                    f"max_failure_fraction={self.max_failure_fraction}); first error: "
                    f"{type(first_error).__name__}: {first_error}"
                ) from first_error
        total = per_function @ self.weights  # (B,)
        return RewardOutput(total=total, per_function=per_function, names=list(self.names), num_failed=num_failed)
