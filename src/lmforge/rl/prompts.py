"""The prompts of an RL run: a task's or a file's rows, tokenized once, with the held-out problems;
the share of a step's prompts each rank samples (groups whole); the sampler's seed of a step."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..core.errors import ConfigError, DataError
from ..data.prompts import held_out_split, load_prompt_rows
from ..data.sft import encode_prompts, uses_chat_format
from ..data.tasks import get_task
from ..model.load import context_length
from ..model.safe_encode import holds_special
from ..parallel.context import ParallelContext
from .config import RLDataConfig


@dataclasses.dataclass
class PromptSet:
    """Training prompts as token ids, what the reward functions see for each, held-out problems."""

    prompt_ids: list[list[int]]
    problems: list  # one per prompt: a task Problem, or the JSONL row (a dict)
    task: Any  # the Task (passed to rewards as task=...), or None for a prompts file
    eval_problems: list
    chat: bool
    num_dropped: int = 0  # prompts longer than data.max_prompt_len, dropped
    num_truncated: int = 0  # ... or cut to their last max_prompt_len tokens
    num_special_text: int = 0  # prompts whose text held special-token strings, encoded as text
    eval_note: str = ""  # prompts files: what was held out for evaluation, or why nothing was


def build_prompts(data: RLDataConfig, tokenizer, seed: int, max_prompt_len: int = 0) -> PromptSet:
    """Prompts of the task or file, tokenized; those longer than ``max_prompt_len`` (0 = no limit)
    dropped or left-truncated as ``data.prompt_truncation`` says, and counted."""
    chat = uses_chat_format(tokenizer, data.use_chat_template)
    if data.task:
        task = get_task(data.task)
        problems = task.make_problems(data.num_train, seed, "train")
        eval_problems = task.make_problems(data.num_eval, seed, "test")
        texts = [p.prompt for p in problems]
    else:
        task, eval_problems = None, []
        problems = load_prompt_rows(data.path, data.split, data.subset, data.columns)
        texts = [row["prompt"] for row in problems]
    prompt_ids = encode_prompts(tokenizer, texts, chat)
    special_text = sum(holds_special(tokenizer, text) for text in texts)
    dropped = truncated = 0
    if max_prompt_len:
        long = [len(ids) > max_prompt_len for ids in prompt_ids]
        if data.prompt_truncation == "left":
            truncated = sum(long)
            prompt_ids = [ids[-max_prompt_len:] for ids in prompt_ids]
        else:
            dropped = sum(long)
            problems = [p for p, too_long in zip(problems, long) if not too_long]
            prompt_ids = [ids for ids, too_long in zip(prompt_ids, long) if not too_long]
        if not prompt_ids:
            raise DataError(
                f"every one of the {len(long)} prompts is longer than data.max_prompt_len="
                f"{max_prompt_len} tokens; raise it (with a longer-context model) or use "
                "data.prompt_truncation=left"
            )
    prompts = PromptSet(prompt_ids, problems, task, eval_problems, chat, dropped, truncated, special_text)
    if not data.task:
        hold_out_rows(prompts, data, seed)
    return prompts


def hold_out_rows(prompts: PromptSet, data: RLDataConfig, seed: int) -> None:
    """Fill ``prompts.eval_problems`` from a prompts source (``lmforge.data.prompts`` module doc):
    a named split, or rows moved out of the training prompts."""
    if data.eval_split:
        rows = load_prompt_rows(data.path, data.eval_split, data.subset, data.columns)[: data.num_eval]
        prompts.eval_problems = rows
        prompts.eval_note = f"{len(rows)} held-out rows from split {data.eval_split!r}"
        return
    has_answers = any("answer" in row for row in prompts.problems)
    train, held, prompts.eval_note = held_out_split(data, len(prompts.problems), has_answers, seed)
    prompts.eval_problems = [prompts.problems[i] for i in held]
    prompts.problems = [prompts.problems[i] for i in train]
    prompts.prompt_ids = [prompts.prompt_ids[i] for i in train]


def prompt_budget(max_prompt_len: int, max_new_tokens: int, model) -> int:
    """``data.max_prompt_len`` resolved against the model's context: prompt + rollout.max_new_tokens must fit."""
    context = context_length(model)
    if context is None:
        return max_prompt_len
    if max_new_tokens >= context:
        raise ConfigError(
            f"rollout.max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's "
            f"context of {context} tokens"
        )
    if max_prompt_len and max_prompt_len + max_new_tokens > context:
        raise ConfigError(
            f"data.max_prompt_len={max_prompt_len} + rollout.max_new_tokens={max_new_tokens} exceeds "
            f"the model's context of {context} tokens; lower one of them"
        )
    return max_prompt_len or context - max_new_tokens


def rank_prompts(rows: list[int], num_mini_batches: int, ctx: ParallelContext) -> list[int]:
    """This rank's prompts of a step's global ``rows``: its share of each mini-batch, groups whole.

    Mini-batch m of the step is the m-th contiguous chunk of ``rows``; rank r takes the r-th part of
    each chunk. Then the rank's own m-th mini-batch is its share of the global m-th mini-batch, and
    the union over ranks of each update's rows is the update of a single process.
    """
    if not ctx.distributed:
        return rows
    per_mini = len(rows) // num_mini_batches
    share = per_mini // ctx.world_size
    return [rows[m * per_mini + ctx.rank * share + i] for m in range(num_mini_batches) for i in range(share)]


def step_seed(seed: int, step: int, rank: int = 0) -> int:
    """The sampler's seed at ``step`` on ``rank``: a function of both, so a resumed run samples the same."""
    return seed * 1_000_003 + step + 1_000_000_007 * rank
