"""SFT rows for training: the data section of ``lmforge sft`` (also ``lmforge distill``'s ``fixed_data``),
its rows tokenized with completion masks (from any source of docs/data.md, a task's problems or an
environment's demonstrations), the context check, and the evaluation that samples held-out prompts
(and, for a task, measures exact-match accuracy)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Literal

from ..core.config import ModelConfig, TrainConfig, opt
from ..core.errors import ConfigError
from ..data.sft import (
    CHAT_SMALL,
    collate_sft,
    encode_chat_prompt,
    encode_prompt,
    load_sft_rows,
    row_texts,
    sft_rows_from_task,
    special_text_note,
    tokenize_sft,
    uses_chat_format,
)
from ..data.sft import COLUMN_NAMES as SFT_COLUMNS
from ..data.tasks import check_task_section, get_task
from ..envs.demos import demonstration_rows
from ..envs.registry import make_environment, resolve_environment
from ..model.load import context_length
from ..model.tokenizer import check_unknown_tokens
from ..rollout.evaluation import complete_ids, save_samples, task_accuracy
from .step import SupervisedData


@dataclasses.dataclass
class SFTDataConfig:
    path: str = opt(
        "",
        "chat (messages) or prompt/completion rows: JSONL, Parquet, CSV, Arrow, a save_to_disk dir or a "
        "cached hub id (docs/data.md); builtin:chat_small = the shipped chat set",
    )
    split: str = opt("train", "path: the split to train on (a single file is split 'train')")
    eval_split: str = opt("", "path: a named split for the validation rows instead of data.val_fraction")
    subset: str = opt("", "path: the hub dataset's config name (e.g. main)")
    columns: dict[str, str] = opt(
        {}, "path: lmforge name -> the data's column, e.g. {prompt: question, completion: answer}", keys=SFT_COLUMNS
    )
    task: str = opt("", "built-in synthetic task instead of a file, e.g. addition or addition:digits=3")
    num_train: int = opt(8000, "task: training problems")
    num_val: int = opt(200, "task: validation problems (loss)", free_on_resume=True)
    num_eval: int = opt(200, "task: held-out problems for exact-match accuracy", free_on_resume=True)
    env: str = opt(
        "",
        "task: train on this environment's scripted demonstrations of the task's problems instead "
        "(whole episodes; built-ins with an expert: calculator, guess_number; docs/environments.md)",
    )
    env_args: dict[str, Any] = opt({}, "env: the environment's arguments, e.g. {max_guesses: 8}")
    val_fraction: float = opt(0.05, "path: fraction of rows held out for validation loss (seeded by train.seed)")
    max_len: int = opt(256, "longest tokenized row (prompt + completion)")
    completion_only: bool = opt(True, "loss only on assistant / completion tokens")
    use_chat_template: Literal["auto", "on", "off"] = opt("auto", "prompt/completion rows through the chat template")
    truncation: Literal["right", "drop"] = opt("right", "over-long rows: cut on the right, or drop them")

    def validate(self) -> None:
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(
                f"data.val_fraction must be in [0, 1) (a fraction: 0.05 holds out 5%), got {self.val_fraction}"
            )
        if bool(self.path) == bool(self.task):
            raise ConfigError(
                "set exactly one of data.path (rows from any source of docs/data.md: JSONL, Parquet, "
                "CSV, Arrow, a save_to_disk dir, a cached hub id) and data.task (e.g. addition)"
            )
        if self.task:
            check_task_section(self, ("split", "eval_split", "val_fraction", "subset", "columns"))
            if self.env:
                try:  # an unknown environment: a ConfigError now, not after the model loads
                    resolve_environment(self.env)
                except ConfigError as exc:
                    raise ConfigError(f"data.env: {exc}") from exc
        elif self.env or self.env_args:
            raise ConfigError(
                "data.env needs data.task: the environment plays the task's problems "
                "(e.g. data.task=multiplication data.env=calculator)"
            )


def split_rows(rows: list, val_fraction: float, seed: int) -> tuple[list, list]:
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    num_val = max(1, int(len(rows) * val_fraction)) if len(rows) > 1 else 0
    return rows[num_val:], rows[:num_val]


def build_data(
    d: SFTDataConfig, seed: int, model_cfg: ModelConfig, tokenizer, printer=print
) -> tuple[SupervisedData, list[dict]]:
    """Tokenized train / validation examples of the data section ``d`` (rows, a task's problems or an
    environment's demonstrations, seeded by ``seed``), and the raw validation rows (for samples)."""
    if d.task:
        task = get_task(d.task)
        train_rows = sft_rows_from_task(task, d.num_train, seed, "train")
        val_rows = sft_rows_from_task(task, d.num_val, seed, "val")
        if d.env:  # the environment's expert plays the same problems: whole episodes as chat rows
            env = make_environment(d.env, d.env_args)
            train_rows, val_rows = (
                demonstration_rows(env, task.make_problems(n, seed, split), seed, tokenizer)
                for n, split in ((d.num_train, "train"), (d.num_val, "val"))
            )
    else:
        path = CHAT_SMALL if d.path == "builtin:chat_small" else d.path
        train_rows = load_sft_rows(path, d.split, d.subset, d.columns)
        if d.eval_split:
            val_rows = load_sft_rows(path, d.eval_split, d.subset, d.columns)
        else:
            train_rows, val_rows = split_rows(train_rows, d.val_fraction, seed)
    check_unknown_tokens(tokenizer, row_texts(train_rows), model_cfg, d.path or f"data.task={d.task}", printer)
    parts = []
    for rows in (train_rows, val_rows):
        data = tokenize_sft(
            rows,
            tokenizer,
            d.max_len,
            completion_only=d.completion_only,
            use_chat_template=d.use_chat_template,
            truncation=d.truncation,
        )
        if data.num_truncated or data.num_dropped:
            printer(
                f"[data] {data.num_truncated} rows truncated to {d.max_len} tokens, "
                f"{data.num_dropped} dropped (data.truncation={d.truncation})"
            )
        if data.num_special_text:
            printer(special_text_note(data.num_special_text))
        parts.append(data.examples)
    if not parts[0]:
        raise ConfigError("no SFT training rows left after tokenization; raise data.max_len")
    pad_id = tokenizer.pad_token_id
    return SupervisedData(parts[0], parts[1], lambda rows: collate_sft(rows, pad_id)), val_rows


def check_fits_context(model, data: SupervisedData) -> None:
    """Every tokenized row must fit the model's context: an error naming both numbers otherwise."""
    context = context_length(model)
    longest = max((len(row.input_ids) for row in data.train_rows + data.val_rows), default=0)
    if context is not None and longest > context:
        raise ConfigError(
            f"the longest SFT row has {longest} tokens but the model's context is {context} "
            f"(model.max_position_embeddings); set data.max_len <= {context} (longer rows are then "
            "cut or dropped per data.truncation)"
        )


def prompt_ids_of(row: dict, tokenizer, chat: bool) -> list[int]:
    """The prompt part of an SFT row as token ids (everything before the last assistant turn)."""
    if "messages" in row:
        messages = row["messages"]
        if messages and messages[-1].get("role") == "assistant":
            messages = messages[:-1]
        return encode_chat_prompt(tokenizer, messages, row.get("tools"))
    return encode_prompt(tokenizer, row["prompt"], chat)


def first_turn(row: dict) -> dict:
    """A messages row cut before its first assistant message (other rows as they are)."""
    if "messages" not in row:
        return row
    roles = [m["role"] for m in row["messages"]]
    return {**row, "messages": row["messages"][: roles.index("assistant")]} if "assistant" in roles else row


def make_eval(data: SFTDataConfig, train: TrainConfig, tokenizer, run, val_rows: list[dict]):
    """Each evaluation prints and saves a few generations; for a task it also measures exact-match
    accuracy on held-out problems (``data``: the rows' section; ``train``: samples, lengths, seed)."""
    chat = uses_chat_format(tokenizer, data.use_chat_template)
    k, max_new = train.num_samples, train.max_new_tokens
    if not data.task or data.env:
        # an environment's episodes (data.env): samples of their first turn
        rows = [first_turn(row) for row in val_rows[:k]] if data.env else val_rows[:k]

        def sample_only(model, step: int) -> dict:
            prompts = [prompt_ids_of(row, tokenizer, chat) for row in rows]
            texts = complete_ids(model, tokenizer, prompts, max_new)
            if run.ctx.is_main:
                save_samples(run.dir, step, [tokenizer.decode(p) for p in prompts], texts, run.print)
            return {}

        return sample_only if rows else None
    task = get_task(data.task)
    problems = task.make_problems(data.num_eval, train.seed, "test")

    def evaluate(model, step: int) -> dict:
        accuracy, texts = task_accuracy(model, tokenizer, task, problems, max_new, chat)
        if run.ctx.is_main:
            save_samples(run.dir, step, [p.prompt for p in problems[:k]], texts[:k], run.print)
        return {"accuracy": accuracy}

    return evaluate
