"""reasoning-gym datasets as lmforge tasks: ``data.task=rg:<name>`` (optional extra ``lmforge[rg]``).

reasoning-gym (https://github.com/open-thought/reasoning-gym) generates problems procedurally and
scores answers with each dataset's own ``score_answer(answer, entry)``. :class:`RGTask` wraps one
dataset in the :class:`~lmforge.data.tasks.Task` protocol, so the RL recipes (prompts, the ``exact``
reward, held-out accuracy) and SFT (``prompt -> completion`` rows) use it like a built-in task.

Spec: ``rg:<name>`` or ``rg:<name>:key=value,key=value``. Keys are the dataset's own config fields
(``min_animals=2``; lists as YAML, ``operators=[+,-]``) plus ``answer_format``:

    tags   (default) the prompt asks for the answer between ``<answer>`` and ``</answer>``; the text
           inside the last such pair is what ``score_answer`` sees (no pair: ``None``, scored 0 by
           the dataset). The SFT target is ``<answer>{answer}</answer>``.
    plain  the prompt asks for just the answer; the whole stripped completion is scored. The SFT
           target is the answer itself.
    last_number
           the prompt asks for just the answer, and the last number in the completion is scored
           (none: ``None``, scored 0), so "3 + 4 = 7" counts as 7. For datasets with numeric answers,
           and for chat models that restate the question before answering. The SFT target is the
           answer itself.

Splits are disjoint whatever the seeds: a problem belongs to the split that the hash of its
question text assigns it (:func:`~lmforge.data.tasks.split_of`, 80/10/10), and ``make_problems(n,
seed, split)`` draws dataset entries from a generator seeded by ``(spec, seed, split)`` and keeps
those of the requested split. The same ``(n, seed, split)`` always gives the same list.

List the dataset names and their parameters with ``python -m lmforge.data.rg`` (``... rg <name>``
for one dataset's parameters).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import logging
import re
import string
import sys
import typing
from typing import Any

import yaml

from .problem import SPLITS, Problem, split_of

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'lmforge[rg]' (or pip install reasoning-gym)"
ANSWER_FORMATS = ("tags", "plain", "last_number")
_RESERVED = {
    "seed": "set by lmforge from train.seed and the split",
    "size": "set by lmforge (data.num_train / num_eval)",
}
_TAG_INSTRUCTION = "Give your final answer between <answer> and </answer> tags."
_PLAIN_INSTRUCTION = "Reply with only the final answer."
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")  # last_number: 1,234 -> 1234; -2.5
_MAX_DRAWS_PER_PROBLEM = 60  # the test share is 10 %, so ~10 draws per problem are expected


def _registry() -> dict[str, tuple[type, type]]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as exc:
        raise ValueError(f"rg: tasks need the reasoning-gym package: {INSTALL_HINT}") from exc
    return DATASETS


def list_tasks() -> list[str]:
    """The reasoning-gym dataset names usable as ``rg:<name>``."""
    return sorted(_registry())


def task_parameters(name: str) -> dict[str, Any]:
    """``{parameter: default}`` of dataset ``name`` (without ``seed`` and ``size``, which lmforge sets)."""
    registry = _registry()
    if name not in registry:
        raise ValueError(_unknown_name(name, registry))
    _, config_cls = registry[name]
    out = {}
    for f in dataclasses.fields(config_cls):
        if f.name in _RESERVED:
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
        else:
            out[f.name] = "(required)"
    return out


def _unknown_name(name: str, registry: dict) -> str:
    close = difflib.get_close_matches(name, list(registry), n=3, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return (
        f"rg: unknown reasoning-gym dataset {name!r}.{hint} List them with: python -m lmforge.data.rg "
        f"({len(registry)} datasets)"
    )


def _split_params(text: str) -> list[str]:
    """``"a=1,b=[1,2],c=x"`` -> ``["a=1", "b=[1,2]", "c=x"]``: commas inside brackets stay."""
    items, depth, current = [], 0, []
    for char in text:
        if char in "[({":
            depth += 1
        elif char in "])}":
            depth -= 1
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]


def _parse_value(raw: str, hint: Any, default: Any) -> Any:
    """A parameter value: kept as text for ``str`` fields, else read as YAML (lists become tuples
    where the default is a tuple)."""
    if hint is str:
        return raw
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    if isinstance(value, list) and isinstance(default, tuple):
        value = tuple(value)
    return value


def _format_value(value: Any) -> str:
    """A parameter value as spec text that :func:`_parse_value` reads back (lists as ``[a,b]``)."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_format_value(v) for v in value) + "]"
    return str(value)


@dataclasses.dataclass(frozen=True)
class RGProblem(Problem):
    """A :class:`Problem` that keeps the reasoning-gym entry (question, answer, metadata) for scoring."""

    entry: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)


class RGTask:
    """One reasoning-gym dataset as a :class:`~lmforge.data.tasks.Task` (see the module docstring).

    Score: ``dataset.score_answer(extracted, entry)``, a float in [0, 1] (some datasets give partial
    credit, e.g. a countdown expression that misses the target). ``is_correct``: score >= 0.999.
    Errors raised by ``score_answer`` propagate from ``score`` (the reward wrapper counts them as
    failures); ``is_correct`` logs them and counts the answer as wrong.
    """

    name = "rg"

    def __init__(self, dataset: str, params: dict[str, Any] | None = None, answer_format: str = "tags"):
        registry = _registry()
        if dataset not in registry:
            raise ValueError(_unknown_name(dataset, registry))
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(
                f"rg:{dataset}: answer_format must be one of {', '.join(ANSWER_FORMATS)}, got {answer_format!r}"
            )
        self.dataset = dataset
        self.params = dict(params or {})
        self.answer_format = answer_format
        dataset_cls, config_cls = registry[dataset]
        for key in self.params:
            if key in _RESERVED:
                raise ValueError(f"rg:{dataset}: parameter {key!r} is {_RESERVED[key]}; leave it out")
        try:  # build once to check the parameters: unknown names and the dataset's own validation
            self._scorer = self._make(1, 0)
        except (TypeError, ValueError, AssertionError) as exc:
            valid = ", ".join(f"{k}={v!r}" for k, v in task_parameters(dataset).items())
            raise ValueError(
                f"rg:{dataset}: bad parameters {self.params!r}: {type(exc).__name__}: {exc}. "
                f"Valid parameters (defaults): {valid}"
            ) from None

    def _make(self, size: int, seed: int):
        from reasoning_gym import create_dataset

        return create_dataset(self.dataset, size=size, seed=seed, **self.params)

    def __reduce__(self):  # pickled by spec, so that a process pool can rebuild it cheaply
        return (RGTask, (self.dataset, self.params, self.answer_format))

    def __repr__(self) -> str:
        return f"RGTask({self.spec!r})"

    @property
    def spec(self) -> str:
        params = {**self.params, "answer_format": self.answer_format}
        text = ",".join(f"{k}={_format_value(v)}" for k, v in sorted(params.items()))
        return f"rg:{self.dataset}:{text}"

    @property
    def alphabet(self) -> str:
        """Printable ASCII (for char-level tokenizers; other characters become ``<unk>``)."""
        return "".join(c for c in string.printable if c not in "\r\x0b\x0c")

    def prompt_of(self, question: str) -> str:
        instruction = _TAG_INSTRUCTION if self.answer_format == "tags" else _PLAIN_INSTRUCTION
        return f"{question.rstrip()}\n\n{instruction}"

    def problem_of(self, entry: dict) -> RGProblem:
        answer = str(entry["answer"])
        completion = f"<answer>{answer}</answer>" if self.answer_format == "tags" else answer
        return RGProblem(
            prompt=self.prompt_of(str(entry["question"])), completion=completion, answer=answer, entry=entry
        )

    def make_problems(self, n: int, seed: int, split: str) -> list[Problem]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
        if n < 0:
            raise ValueError(f"number of problems must be >= 0, got {n}")
        if n == 0:
            return []
        # the answer format does not change which problems are drawn
        key = f"rg:{self.dataset}:{sorted(self.params.items())}|{seed}|{split}"
        generator_seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big")
        budget = max(1000, _MAX_DRAWS_PER_PROBLEM * n)
        dataset = self._make(budget, generator_seed)
        problems: list[Problem] = []
        for index in range(budget):
            entry = dataset[index]
            if split_of(str(entry["question"])) == split:
                problems.append(self.problem_of(entry))
                if len(problems) == n:
                    return problems
        raise ValueError(
            f"rg:{self.dataset}: only {len(problems)} {split} problems in {budget} draws (wanted {n}); "
            "the dataset's parameters leave too few distinct questions, widen them"
        )

    def extract(self, completion_text: str) -> str | None:
        """What ``score_answer`` sees: the last ``<answer>`` tag's text (tags) or the stripped text (plain)."""
        if self.answer_format == "plain":
            return completion_text.strip()
        if self.answer_format == "last_number":
            numbers = _NUMBER.findall(completion_text)
            return numbers[-1].replace(",", "") if numbers else None
        from reasoning_gym.utils import extract_answer

        return extract_answer(completion_text)

    def score(self, completion_text: str, problem: Problem) -> float:
        entry = getattr(problem, "entry", None)
        if not entry:
            entry = {"question": problem.prompt, "answer": problem.answer, "metadata": {}}
        return float(self._scorer.score_answer(self.extract(completion_text), entry))

    def is_correct(self, completion_text: str, problem: Problem) -> bool:
        try:
            return self.score(completion_text, problem) >= 0.999
        except Exception as exc:  # noqa: BLE001 - the dataset's scorer; logged, counted as wrong
            logger.warning(
                "rg:%s: score_answer raised on %r (counted wrong): %s: %s",
                self.dataset,
                completion_text[:200],
                type(exc).__name__,
                exc,
            )
            return False


def rg_task(spec: str) -> RGTask:
    """Build an :class:`RGTask` from ``"rg:<name>"`` or ``"rg:<name>:key=value,..."``."""
    body = spec.strip()[len("rg:") :]
    name, _, params_text = body.partition(":")
    name = name.strip()
    if not name:
        raise ValueError(
            f"task spec {spec!r}: name a reasoning-gym dataset, e.g. rg:leg_counting "
            "(list them with python -m lmforge.data.rg)"
        )
    registry = _registry()
    if name not in registry:
        raise ValueError(_unknown_name(name, registry))
    _, config_cls = registry[name]
    hints = typing.get_type_hints(config_cls)
    defaults = task_parameters(name)
    params: dict[str, Any] = {}
    answer_format = "tags"
    for item in _split_params(params_text):
        key, eq, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if key == "answer_format" and eq:
            answer_format = raw
            continue
        if not eq or key not in hints or key in _RESERVED:
            valid = ", ".join(f"{k}={v!r}" for k, v in defaults.items())
            raise ValueError(
                f"task {spec!r}: bad parameter {item!r}; valid (defaults): answer_format='tags' "
                f"(or 'plain', 'last_number'), {valid}"
            )
        params[key] = _parse_value(raw, hints[key], defaults.get(key))
    return RGTask(name, params, answer_format)


def _main(argv: list[str]) -> int:
    if argv:
        for name in argv:
            print(f"rg:{name}")
            for key, value in task_parameters(name).items():
                print(f"  {key} = {value!r}")
        return 0
    for name in list_tasks():
        print(f"rg:{name}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
