"""Built-in synthetic tasks with exact checkers, deterministic from a seed.

A task makes :class:`Problem` s (prompt, target completion, answer) and scores a model's completion
against one. Tasks are chosen by a spec string, ``name`` or ``name:key=value,key=value``:

    task = get_task("addition:digits=3")
    train = task.make_problems(1000, seed=0, split="train")
    reward = task.score(generated_text, train[0])          # 1.0 or 0.0

Splits. Each task's problem space is cut once, by a hash of the prompt text, into fixed shares
(train 80 %, val 10 %, test 10 %). ``make_problems`` only draws from the share of the requested
split, so the three splits are disjoint whatever seeds are used, and a given (n, seed, split) always
returns the same list. Problems within one call are distinct while the split's share lasts; a
request for more problems than the share holds cycles through it again (in the same shuffled order).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
import random
import re
from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol

from ..core.config import refuse_ignored
from ..core.errors import ConfigError
from ..model.tokenizer import ASCII_ALPHABET
from .problem import SPLITS, Problem, split_of
from .rg import rg_task

_ENUMERATE_LIMIT = 100_000  # problem spaces up to this size are enumerated, larger ones sampled


class Task(Protocol):
    """What every task provides (see :class:`Addition` and :class:`ArithChat`)."""

    name: str

    @property
    def spec(self) -> str: ...
    @property
    def alphabet(self) -> str: ...
    def make_problems(self, n: int, seed: int, split: str) -> list[Problem]: ...
    def score(self, completion_text: str, problem: Problem) -> float: ...
    def is_correct(self, completion_text: str, problem: Problem) -> bool: ...


# ----------------------------------------------------------------------------- shared helpers


def _sample_split(
    problem_at: Callable[[int], Problem], space_size: int, n: int, seed: int, split: str, spec: str
) -> list[Problem]:
    """``n`` problems of ``split`` from a problem space indexed ``0 .. space_size - 1``."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    if n < 0:
        raise ValueError(f"number of problems must be >= 0, got {n}")
    rng = random.Random(f"{spec}|{seed}|{split}")
    if space_size <= _ENUMERATE_LIMIT:
        pool = [p for p in map(problem_at, range(space_size)) if split_of(p.prompt) == split]
        if not pool and n > 0:
            raise ValueError(f"task {spec!r} has no {split} problems; use a larger problem space")
        rng.shuffle(pool)
        return [pool[k % len(pool)] for k in range(n)]
    seen: set[int] = set()
    problems: list[Problem] = []
    while len(problems) < n:  # the space is large, so collisions and rejections are cheap
        index = rng.randrange(space_size)
        if index in seen:
            continue
        seen.add(index)
        problem = problem_at(index)
        if split_of(problem.prompt) == split:
            problems.append(problem)
    return problems


# ----------------------------------------------------------------------------- addition


@dataclass(frozen=True)
class Addition:
    """``digits``-digit addition for char-level models, answer written least-significant digit first.

    Prompt ``"37+48="``; completion ``"58"`` (the sum 85 reversed); answer ``"85"``. Operands have
    exactly ``digits`` digits (0-9 when ``digits=1``), so the columns line up in every prompt.

    Why reversed: the completion is the short worked answer one writes when adding by hand, column
    by column from the right -- 7+8 = 15, write 5 carry 1; 3+4+1 = 8, write 8 -- so each output digit
    depends only on one column of the prompt and the carry from the digit just written. A tiny
    char-level model learns this order quickly; in normal order the first digit it must write depends
    on every column, and small models stay near 0 % exact match.

    Score: leading whitespace is skipped, then the maximal run of digits is taken; the score is 1.0
    if that run equals ``problem.completion`` exactly, else 0.0. Anything after the run (an eos token's
    text, a newline, more text) is ignored, but a longer digit run (``"580"``) is wrong.
    """

    digits: int = 2
    name: ClassVar[str] = "addition"

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 9:
            raise ValueError(f"addition: digits must be between 1 and 9, got {self.digits}")

    @property
    def spec(self) -> str:
        return f"{self.name}:digits={self.digits}"

    @property
    def alphabet(self) -> str:
        return "0123456789+="

    def _problem_at(self, index: int) -> Problem:
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        count = 10**self.digits - low
        a, b = divmod(index, count)
        a, b = a + low, b + low
        total = str(a + b)
        return Problem(prompt=f"{a}+{b}=", completion=total[::-1], answer=total)

    def make_problems(self, n: int, seed: int, split: str) -> list[Problem]:
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        space_size = (10**self.digits - low) ** 2
        return _sample_split(self._problem_at, space_size, n, seed, split, self.spec)

    def score(self, completion_text: str, problem: Problem) -> float:
        match = re.match(r"\s*(\d*)", completion_text)
        return 1.0 if match and match.group(1) == problem.completion else 0.0

    def is_correct(self, completion_text: str, problem: Problem) -> bool:
        return self.score(completion_text, problem) == 1.0


# ----------------------------------------------------------------------------- addition with a scratchpad


@dataclass(frozen=True)
class AdditionTrace:
    """``digits``-digit addition whose completion is a column-by-column worked trace, then the answer.

    Prompt ``"372+459="``; with ``trace=1`` the completion adds the columns from the right, each as
    ``a+b+carry=ss`` (two-digit column sum), then a newline and the sum in the normal order::

        2+9+0=11 7+5+1=13 3+4+1=08
        831

    With ``trace=0`` the completion is only ``"831"``. The answer is ``"831"`` either way. The trace
    carries the knowledge: every step is a one-column lookup, and the answer is the last digits of the
    column sums read backwards (with a leading 1 when the last column carries). A tiny char-level model
    learns the traced form but stays far below it on the answers alone, whose first digit depends on every
    column. This is the task of the antidistillation reproduction (docs/antidistillation-reproduction.md).

    Score: the text after the last newline (the whole text when there is none), leading whitespace
    skipped; 1.0 if its maximal leading digit run equals the answer, else 0.0. The trace itself is not
    checked: a wrong trace with the right answer counts as correct.
    """

    digits: int = 3
    trace: int = 1
    name: ClassVar[str] = "addition_trace"

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 9:
            raise ValueError(f"addition_trace: digits must be between 1 and 9, got {self.digits}")
        if self.trace not in (0, 1):
            raise ValueError(f"addition_trace: trace must be 0 (answers only) or 1 (worked trace), got {self.trace}")

    @property
    def spec(self) -> str:
        return f"{self.name}:digits={self.digits},trace={self.trace}"

    @property
    def alphabet(self) -> str:
        return "0123456789+= \n"

    def worked_trace(self, a: int, b: int) -> str:
        """The column-by-column lines, e.g. ``"2+9+0=11 7+5+1=13 3+4+1=08"`` for 372 + 459."""
        steps, carry = [], 0
        for column in range(self.digits):
            x, y = a // 10**column % 10, b // 10**column % 10
            total = x + y + carry
            steps.append(f"{x}+{y}+{carry}={total:02d}")
            carry = total // 10
        return " ".join(steps)

    def _problem_at(self, index: int) -> Problem:
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        count = 10**self.digits - low
        a, b = divmod(index, count)
        a, b = a + low, b + low
        answer = str(a + b)
        completion = f"{self.worked_trace(a, b)}\n{answer}" if self.trace else answer
        return Problem(prompt=f"{a}+{b}=", completion=completion, answer=answer)

    def make_problems(self, n: int, seed: int, split: str) -> list[Problem]:
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        space_size = (10**self.digits - low) ** 2
        # the split of a prompt is a function of its text, so trace=0 and trace=1 share the splits
        return _sample_split(self._problem_at, space_size, n, seed, split, f"{self.name}:digits={self.digits}")

    def score(self, completion_text: str, problem: Problem) -> float:
        match = re.match(r"\s*(\d*)", completion_text.rsplit("\n", 1)[-1])
        return 1.0 if match and match.group(1) == problem.answer else 0.0

    def is_correct(self, completion_text: str, problem: Problem) -> bool:
        return self.score(completion_text, problem) == 1.0


# ----------------------------------------------------------------------------- arith_chat

_FIRST_INTEGER = re.compile(r"-?\d+")
_ARITH_PROMPT = "What is {a} {op} {b}? Answer with just the number."


@dataclass(frozen=True)
class ArithChat:
    """Small-operand arithmetic in natural language, for instruction-tuned models.

    Prompt ``"What is 3 + 4? Answer with just the number."``; completion and answer ``"7"``.
    Operands are 0..``max_operand``; ``ops`` is a string of operators drawn from ``"+-"``.
    Subtraction is only asked with the larger operand first, so every answer is >= 0.
    The operands are small on purpose: a 135M instruct model already answers some correctly, so
    RL starts with a non-zero reward.

    Score: the first integer in the completion (regex ``-?\\d+``: an optional minus sign directly
    before a run of digits) is compared with the answer; 1.0 if equal, 0.0 if different or if the
    completion has no integer. ``"7"``, ``"7."``, ``"The answer is 7"`` all score 1.0; a completion that
    repeats the question first (``"3 + 4 = 7"``) scores 0.0, as the prompt asks for just the number.
    """

    max_operand: int = 9
    ops: str = "+-"
    name: ClassVar[str] = "arith_chat"

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise ValueError(f"arith_chat: max_operand must be >= 1, got {self.max_operand}")
        if not self.ops or set(self.ops) - set("+-") or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"arith_chat: ops must be '+', '-' or '+-', got {self.ops!r}")

    @property
    def spec(self) -> str:
        return f"{self.name}:max_operand={self.max_operand},ops={self.ops}"

    @property
    def alphabet(self) -> str:
        fixed_text = _ARITH_PROMPT.format(a="", op="", b="")
        return "".join(sorted(set(fixed_text) | set("0123456789") | set(self.ops)))

    def _space_sizes(self) -> list[int]:
        m = self.max_operand + 1
        return [m * m if op == "+" else m * (m + 1) // 2 for op in self.ops]

    def _problem_at(self, index: int) -> Problem:
        for op, size in zip(self.ops, self._space_sizes()):
            if index < size:
                break
            index -= size
        if op == "+":
            a, b = divmod(index, self.max_operand + 1)
            result = a + b
        else:  # triangular index over pairs a >= b
            a = (math.isqrt(8 * index + 1) - 1) // 2
            b = index - a * (a + 1) // 2
            result = a - b
        prompt = _ARITH_PROMPT.format(a=a, op=op, b=b)
        return Problem(prompt=prompt, completion=str(result), answer=str(result))

    def make_problems(self, n: int, seed: int, split: str) -> list[Problem]:
        return _sample_split(self._problem_at, sum(self._space_sizes()), n, seed, split, self.spec)

    def score(self, completion_text: str, problem: Problem) -> float:
        match = _FIRST_INTEGER.search(completion_text)
        return 1.0 if match and int(match.group()) == int(problem.answer) else 0.0

    def is_correct(self, completion_text: str, problem: Problem) -> bool:
        return self.score(completion_text, problem) == 1.0


# ----------------------------------------------------------------------------- multiplication (a tool-use task)


@dataclass(frozen=True)
class Multiplication:
    """``digits`` x ``digits``-digit multiplication: the problems of the ``calculator`` environment
    (lmforge.envs.calculator), where a tiny model cannot compute the product but can call a tool for it.

    Prompt ``"123*456="``; completion and answer ``"56088"`` (the product, in the normal order).

    Score: 1.0 if the completion with surrounding whitespace stripped equals the answer exactly, else
    0.0 (``"56088."`` or ``"56088 "`` followed by more text score 0.0).

    Alphabet: printable ASCII and the newline (:data:`lmforge.model.tokenizer.ASCII_ALPHABET`), since in the
    environment a char-level model reads and writes tool calls (JSON) and messages, not only digits.
    """

    digits: int = 3
    name: ClassVar[str] = "multiplication"

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 9:
            raise ValueError(f"multiplication: digits must be between 1 and 9, got {self.digits}")

    @property
    def spec(self) -> str:
        return f"{self.name}:digits={self.digits}"

    @property
    def alphabet(self) -> str:
        return ASCII_ALPHABET

    def _problem_at(self, index: int) -> Problem:
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        a, b = divmod(index, 10**self.digits - low)
        a, b = a + low, b + low
        return Problem(prompt=f"{a}*{b}=", completion=str(a * b), answer=str(a * b))

    def make_problems(self, n: int, seed: int, split: str) -> list[Problem]:
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        return _sample_split(self._problem_at, (10**self.digits - low) ** 2, n, seed, split, self.spec)

    def score(self, completion_text: str, problem: Problem) -> float:
        return 1.0 if completion_text.strip() == problem.answer else 0.0

    def is_correct(self, completion_text: str, problem: Problem) -> bool:
        return self.score(completion_text, problem) == 1.0


# ----------------------------------------------------------------------------- guess_number (a multi-turn game)


@functools.lru_cache(maxsize=8)
def _guess_openings(high: int, min_width: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Every opening range ``(low, high)`` of at least ``min_width`` numbers within 1..``high``, and the
    running count of (range, secret) games up to each, for indexing the games of all ranges at once."""
    ranges = [(a, b) for a in range(1, high + 1) for b in range(a + min_width - 1, high + 1)]
    ends = list(itertools.accumulate(b - a + 1 for a, b in ranges))
    return ranges, ends


@dataclass(frozen=True)
class GuessNumber:
    """The secrets of the ``guess_number`` game (lmforge.envs.guess_number): a number from a range that
    the model finds by guessing, told "higher" or "lower" after each wrong guess.

    ``min_width=0`` (the default): every game opens ``"guess 1-100"`` (``high=100``; the model must not
    see the secret); completion and answer: the secret, e.g. ``"37"``. Since every prompt is the same,
    the split of a problem is that of the text ``"secret 37"`` (the same hash, :func:`split_of`), so the
    held-out games have secrets no training game has. ``make_problems`` cycles through its split's
    secrets when ``n`` is larger (with ``high=100``, the test split holds 11 secrets).

    ``min_width=W`` (2 or more): each game opens on its own range of at least ``W`` numbers within
    1..``high``, e.g. ``"guess 23-87"``, with a secret in it (every (range, secret) pair equally
    likely). The split is by the prompt as in the other tasks, so a held-out game opens on a range no
    training game opens on; its secret, and the ranges its later answers name, are numbers the training
    games use too. There are thousands of held-out games rather than eleven.

    Score (a single-turn guess, one shot): 1.0 if the completion, stripped, is the secret, else 0.0.
    """

    high: int = 100
    min_width: int = 0
    name: ClassVar[str] = "guess_number"

    def __post_init__(self) -> None:
        if not 10 <= self.high <= 10_000:
            raise ValueError(f"guess_number: high must be between 10 and 10000, got {self.high}")
        if self.min_width != 0 and not 2 <= self.min_width <= self.high:
            raise ValueError(
                f"guess_number: min_width must be 0 (every game opens 'guess 1-{self.high}') or "
                f"from 2 to high={self.high} (random opening ranges), got {self.min_width}"
            )
        if self.min_width and self.high > 1000:
            raise ValueError(f"guess_number: random opening ranges (min_width) need high <= 1000, got {self.high}")

    @property
    def spec(self) -> str:
        return f"{self.name}:high={self.high}" + (f",min_width={self.min_width}" if self.min_width else "")

    @property
    def prompt(self) -> str:
        return f"guess 1-{self.high}"

    @property
    def alphabet(self) -> str:
        return ASCII_ALPHABET

    def _ranged_problem_at(self, index: int) -> Problem:
        ranges, ends = _guess_openings(self.high, self.min_width)
        k = bisect.bisect_right(ends, index)
        low, high = ranges[k]
        secret = low + index - (ends[k - 1] if k else 0)
        return Problem(prompt=f"guess {low}-{high}", completion=str(secret), answer=str(secret))

    def make_problems(self, n: int, seed: int, split: str) -> list[Problem]:
        if self.min_width:
            size = _guess_openings(self.high, self.min_width)[1][-1]
            return _sample_split(self._ranged_problem_at, size, n, seed, split, self.spec)
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
        if n < 0:
            raise ValueError(f"number of problems must be >= 0, got {n}")
        pool = [s for s in range(1, self.high + 1) if split_of(f"secret {s}") == split]
        if not pool and n > 0:
            raise ValueError(f"task {self.spec!r} has no {split} secrets; use a larger high")
        random.Random(f"{self.spec}|{seed}|{split}").shuffle(pool)
        return [
            Problem(prompt=self.prompt, completion=str(s), answer=str(s))
            for s in (pool[k % len(pool)] for k in range(n))
        ]

    def score(self, completion_text: str, problem: Problem) -> float:
        return 1.0 if completion_text.strip() == problem.answer else 0.0

    def is_correct(self, completion_text: str, problem: Problem) -> bool:
        return self.score(completion_text, problem) == 1.0


# ----------------------------------------------------------------------------- seeds (games that deal themselves)


@dataclass(frozen=True)
class Seeds:
    """Seeds for environments that build each game from a seed themselves (e.g. ``env.name=textarena``,
    lmforge.envs.textarena): problem ``k`` is the game dealt by seed ``k``, for ``k`` below ``count``.

    Prompt ``"seed 17"`` (the environment's ``reset`` writes the real first messages); completion and
    answer: the seed, ``"17"``. Splits by the prompt's hash, so the held-out games are dealt by seeds no
    training game uses.

    Score (a single-turn completion, which has no game to play): 1.0 if the completion, stripped, is the
    seed, else 0.0.
    """

    count: int = 10_000
    name: ClassVar[str] = "seeds"

    def __post_init__(self) -> None:
        if not 10 <= self.count <= _ENUMERATE_LIMIT:
            raise ValueError(f"seeds: count must be between 10 and {_ENUMERATE_LIMIT}, got {self.count}")

    @property
    def spec(self) -> str:
        return f"{self.name}:count={self.count}"

    @property
    def alphabet(self) -> str:
        return ASCII_ALPHABET

    def make_problems(self, n: int, seed: int, split: str) -> list[Problem]:
        return _sample_split(
            lambda k: Problem(prompt=f"seed {k}", completion=str(k), answer=str(k)),
            self.count,
            n,
            seed,
            split,
            self.spec,
        )

    def score(self, completion_text: str, problem: Problem) -> float:
        return 1.0 if completion_text.strip() == problem.answer else 0.0

    def is_correct(self, completion_text: str, problem: Problem) -> bool:
        return self.score(completion_text, problem) == 1.0


# ----------------------------------------------------------------------------- registry

TASKS: dict[str, type] = {
    Addition.name: Addition,
    AdditionTrace.name: AdditionTrace,
    ArithChat.name: ArithChat,
    Multiplication.name: Multiplication,
    GuessNumber.name: GuessNumber,
    Seeds.name: Seeds,
}


def get_task(spec: str) -> Task:
    """Build a task from ``"name"`` or ``"name:key=value,key=value"`` (e.g. ``"addition:digits=3"``),
    or a reasoning-gym dataset from ``"rg:<name>[:key=value,...]"`` (:mod:`lmforge.data.rg`)."""
    if spec.strip().startswith("rg:"):
        return rg_task(spec)  # reasoning-gym itself is imported there, when a dataset is built
    name, _, params_text = spec.strip().partition(":")
    if name not in TASKS:
        raise ValueError(
            f"unknown task {name!r} in spec {spec!r}; valid tasks: {', '.join(sorted(TASKS))}, "
            "or rg:<name> for a reasoning-gym dataset"
        )
    cls = TASKS[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, object] = {}
    for item in filter(None, (s.strip() for s in params_text.split(","))):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or key not in fields:
            valid = ", ".join(f"{k}=<{f.type}> (default {f.default!r})" for k, f in fields.items())
            raise ValueError(f"task {name!r}: bad parameter {item!r} in spec {spec!r}; valid: {valid}")
        if fields[key].type == "int":
            try:
                kwargs[key] = int(value)
            except ValueError:
                raise ValueError(f"task {name!r}: {key} must be an integer, got {value!r}") from None
        else:
            kwargs[key] = value
    return cls(**kwargs)


def check_task_section(section, path_keys: tuple[str, ...]) -> None:
    """A data section with ``task`` set (SFT rows, preference pairs, RL prompts): the task spec builds (else a
    ConfigError naming data.task: an unknown task or parameter, or reasoning-gym not installed), and none of
    ``path_keys``, the keys that select and map the rows of data.path, is set."""
    try:
        get_task(section.task)
    except ValueError as exc:
        raise ConfigError(f"data.task: {exc}") from exc
    refuse_ignored(
        section, "data", path_keys, f"with data.task={section.task!r} (they select and map the rows of data.path)"
    )
