"""RL prompt rows from any source of :mod:`lmforge.data.source`, and their held-out split.

A row is a dict with a ``prompt`` string; every other column (``answer`` above all) goes to the
reward functions as it is. ``data.columns`` renames the data's columns to these names first.

Held-out rows (for greedy accuracy, :func:`lmforge.rollout.evaluation.held_out_evaluator`):

- ``data.eval_split`` names a split of the source (e.g. ``test``): its first ``data.num_eval`` rows;
- else, when the rows have an ``answer`` column, ``data.eval_fraction`` of them, chosen with
  ``train.seed`` (:func:`lmforge.data.source.split_by_fraction`), at most ``data.num_eval``; the rest train.
- else (no answers, so the built-in rewards could not score them) nothing is held out and the run
  says why; name a split with ``data.eval_split`` to evaluate with rewards that need no answer.
"""

from __future__ import annotations

from ..core.errors import DataError
from .source import read_rows, split_by_fraction, string_column

# The names lmforge itself reads from an RL row (the prompt; the built-in rewards' answer and task):
# what data.columns may map. The other columns reach the reward functions under their own names.
COLUMN_NAMES = ("prompt", "answer", "task")
_PROMPT_HINT = " (plus what the rewards read, e.g. 'answer'; map columns with data.columns={prompt: <column>})"


def load_prompt_rows(
    path: str, split: str = "train", subset: str = "", columns: dict[str, str] | None = None
) -> list[dict]:
    """Rows with a ``prompt`` string; a row without one is a DataError naming the row and column."""
    found = read_rows(str(path), split, subset, columns, what="prompts file")
    for row, where in zip(found.rows, found.where):
        if not isinstance(row, dict):
            raise DataError(f"{where}: each row needs a 'prompt' string{_PROMPT_HINT}; got {type(row).__name__}")
        string_column(row, "prompt", where, f": each row needs a 'prompt' string{_PROMPT_HINT}")
    return found.rows


def prompt_texts(problems: list) -> list[str]:
    """The prompt strings of a task's problems or a file's rows (for the tokenizer check)."""
    return [p["prompt"] if isinstance(p, dict) else p.prompt for p in problems]


def held_out_split(data, num_rows: int, has_answers: bool, seed: int) -> tuple[list[int], list[int], str]:
    """(row indices to train on, row indices to hold out, a note for the log) for a prompts source
    of ``num_rows`` rows; ``data`` is the RL data config section (``eval_split`` handled by the caller)."""
    everything = list(range(num_rows))
    if not data.num_eval:
        return everything, [], "no held-out evaluation (data.num_eval=0)"
    if not has_answers:
        return (
            everything,
            [],
            (
                f"no held-out evaluation: the rows of {data.path} have no 'answer' column for "
                "the rewards to score against; map one with data.columns={answer: <column>}, or "
                "name a split with data.eval_split to evaluate with rewards that need no answer"
            ),
        )
    if data.eval_fraction <= 0 or num_rows < 2:
        return (
            everything,
            [],
            (
                "no held-out evaluation (data.eval_fraction=0)"
                if num_rows >= 2
                else "no held-out evaluation: a single row is all there is to train on"
            ),
        )
    kept, held = split_by_fraction(everything, data.eval_fraction, seed)
    kept, held = sorted(kept + held[data.num_eval :]), sorted(held[: data.num_eval])
    return (
        kept,
        held,
        (f"{len(held)} rows held out for evaluation (data.eval_fraction={data.eval_fraction}, seed {seed})"),
    )
