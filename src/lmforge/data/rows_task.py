"""A task made of data rows: a ``prompt`` and an ``answer`` from any source of :mod:`lmforge.data.source`
(JSONL, Parquet, CSV, Arrow, a ``save_to_disk`` directory, a cached hub id), with the same interface as
the built-in tasks (:class:`lmforge.data.tasks.Task`), so a recipe that samples and scores a task's
problems (antidistillation) can take a file instead.

- Splits: the train / val / test split of a row is a fixed function of its prompt text
  (:func:`lmforge.data.tasks.split_of`: 80 / 10 / 10 by a hash), so the three are disjoint whatever the
  seed, and a row keeps its split when rows are added to the file.
- ``make_problems(n, seed, split)``: that split's rows in an order shuffled by ``seed``, at most ``n``
  (fewer when the split has fewer rows; an empty split is an error naming the file and the sizes).
- Scoring: ``score_fn(completion, problem)``, given by the caller (e.g. a reward of
  :mod:`lmforge.rollout.rewards`); by default 1.0 when the stripped completion equals the stripped
  answer. A completion is correct when it scores >= 1.
"""

from __future__ import annotations

import random
from typing import Callable

from ..core.errors import DataError
from .problem import SPLITS, Problem, split_of
from .source import read_rows, string_column

COLUMN_NAMES = ("prompt", "answer")  # what data.columns may map
_HINT = " (map the data's columns with data.columns={prompt: <column>, answer: <column>})"


def exact_match(completion: str, problem: Problem) -> float:
    return float(completion.strip() == problem.answer.strip())


class RowsTask:
    """See the module doc. ``rows`` are dicts with string ``prompt`` and ``answer`` columns."""

    def __init__(
        self,
        source: str,
        rows: list[dict],
        where: list[str] | None = None,
        score_fn: Callable[[str, Problem], float] | None = None,
        score_name: str = "exact",
    ):
        self.name = f"rows:{source}"
        self.source = source
        self.score_fn = score_fn or exact_match
        self.score_name = score_name
        where = where or [f"{source}:row {i}" for i in range(1, len(rows) + 1)]
        self._by_split: dict[str, list[Problem]] = {split: [] for split in SPLITS}
        for row, place in zip(rows, where):
            if not isinstance(row, dict):
                raise DataError(
                    f"{place}: each row needs 'prompt' and 'answer' strings{_HINT}; got {type(row).__name__}"
                )
            prompt = string_column(row, "prompt", place, _HINT)
            answer = row.get("answer")
            if isinstance(answer, (int, float)) and not isinstance(answer, bool):
                answer = str(answer)  # a numeric column: its text is the answer
                row = {**row, "answer": answer}
            answer = string_column(row, "answer", place, _HINT)
            self._by_split[split_of(prompt)].append(Problem(prompt=prompt, completion=answer, answer=answer))

    @classmethod
    def load(
        cls,
        path: str,
        split: str = "train",
        subset: str = "",
        columns: dict[str, str] | None = None,
        score_fn: Callable[[str, Problem], float] | None = None,
        score_name: str = "exact",
    ) -> "RowsTask":
        found = read_rows(path, split, subset, columns, what="prompt/answer file")
        return cls(found.source, found.rows, found.where, score_fn, score_name)

    @property
    def spec(self) -> str:
        return self.name

    @property
    def alphabet(self) -> str:
        text = "".join(p.prompt + p.answer for problems in self._by_split.values() for p in problems)
        return "".join(sorted(set(text)))

    def sizes(self) -> dict[str, int]:
        return {split: len(problems) for split, problems in self._by_split.items()}

    def make_problems(self, n: int, seed: int, split: str) -> list[Problem]:
        if split not in self._by_split:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        pool = list(self._by_split[split])
        if not pool:
            sizes = ", ".join(f"{s} {k}" for s, k in self.sizes().items())
            raise DataError(
                f"{self.source}: no row falls in the {split!r} split (rows per split, by a hash of "
                f"the prompt: {sizes}); add rows or use another split"
            )
        random.Random(seed).shuffle(pool)
        return pool[:n]

    def score(self, completion_text: str, problem: Problem) -> float:
        try:
            return float(self.score_fn(completion_text, problem))
        except Exception as exc:  # a user's reward: say which and where, never a silent 0
            raise DataError(
                f"{self.source}: the {self.score_name!r} reward failed on the prompt "
                f"{problem.prompt[:60]!r} (answer {problem.answer[:30]!r}): {type(exc).__name__}: {exc}"
            ) from exc

    def is_correct(self, completion_text: str, problem: Problem) -> bool:
        return self.score(completion_text, problem) >= 1.0
