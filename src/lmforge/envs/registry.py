"""Environments by name: ``env.name`` is a built-in name of :data:`ENVIRONMENTS` or a user class given
as ``package.module:Class``; ``env.args`` go to its constructor (docs/environments.md)."""

from __future__ import annotations

import inspect
import traceback
from typing import Any

from ..core.config import import_object
from ..core.errors import ConfigError
from .base import Environment
from .calculator import Calculator
from .guess_number import GuessNumber
from .textarena import TextArenaGame

# Built-in environments: name -> class (one line each).
ENVIRONMENTS: dict[str, type] = {
    "calculator": Calculator,  # multiplication with a calculator tool (data.task: multiplication)
    "guess_number": GuessNumber,  # guess a secret number, told higher / lower (data.task: guess_number)
    "textarena": TextArenaGame,  # a TextArena single-player game, unmodified (env.args: game; data.task: seeds)
}


def resolve_environment(name: str) -> type:
    """The class ``name`` stands for (a built-in name, or ``package.module:Class``); ConfigError when
    it cannot be found or has no ``reset`` / ``step``."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    if ":" not in name:
        builtin = ", ".join(sorted(ENVIRONMENTS)) or "none"
        raise ConfigError(f"env.name={name!r} is not a built-in environment ({builtin}) nor a 'package.module:Class'")
    cls, where = import_object(name, f"env.name={name!r}", "Class")
    if not inspect.isclass(cls):
        raise ConfigError(f"env.name={name!r}: module {where} has no class {name.partition(':')[2]!r}")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(
            f"env.name={name!r}: class {cls.__name__} has no {' and no '.join(missing)} method; an "
            "environment needs reset(problem, state) and step(state, message) "
            "(lmforge.envs.base.Environment)"
        )
    return cls


def check_environment(name: str, args: dict[str, Any] | None = None) -> type:
    """The class of ``name`` after checking ``args`` against its constructor: ConfigError for an
    argument it does not take or a required one missing (at config load, before the run starts)."""
    cls = resolve_environment(name)
    args = dict(args or {})
    params = inspect.signature(cls).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        accepted = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        unknown = sorted(set(args) - accepted)
        if unknown:
            raise ConfigError(
                f"env.args: {cls.__name__} takes no argument(s) {unknown}; it takes {sorted(accepted) or 'none'}"
            )
    missing = sorted(
        p.name
        for p in params
        if p.default is p.empty and p.name not in args and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    )
    if missing:
        raise ConfigError(f"env.args: {cls.__name__} needs argument(s) {missing}; set them in env.args")
    return cls


def make_environment(name: str, args: dict[str, Any] | None = None) -> Environment:
    """An instance of the environment ``name`` built with ``args`` (:func:`check_environment`).

    Whatever its constructor raises (a server that is down, a file that is missing, a bad argument) is
    a ConfigError -- the user's to fix, exit 2 -- naming the class, the file and line it raised at and
    the exception, not an internal error of lmforge. Signals (BaseException) pass through."""
    cls = check_environment(name, args)
    try:
        env = cls(**dict(args or {}))
    except Exception as exc:
        raise ConfigError(
            f"env.name={name!r}: {cls.__module__}.{cls.__qualname__}(**env.args) raised "
            f"{_where(exc, cls)}: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(getattr(env, "tools", []), list):
        raise ConfigError(f"env.name={name!r}: {cls.__name__}.tools must be a list of tool schemas")
    return env


def _where(exc: BaseException, cls: type) -> str:
    """``at FILE:LINE`` for the innermost frame of ``exc``'s traceback, and ``(called from FILE:LINE)``
    for the last line of ``cls``'s own file on the way there when that is another place (a library
    raised: the line of the environment that called it)."""
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # [0] is the call in make_environment
    if not frames:
        return "in its constructor"
    last = frames[-1]
    text = f"at {last.filename}:{last.lineno}"
    try:
        own_file = inspect.getsourcefile(cls)
    except TypeError:  # a class without a source file (built in C)
        own_file = None
    own = [f for f in frames if own_file and f.filename == own_file]
    if own and own[-1] is not last:
        text += f" (called from {own[-1].filename}:{own[-1].lineno})"
    return text
