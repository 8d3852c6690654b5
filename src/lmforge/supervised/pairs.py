"""Preference pairs for training (``lmforge dpo``, ``lmforge rm``): the data section, the pairs tokenized
(from any source of docs/data.md, or made from a task: rule-made or the starting model's own wrong
answers), the context check, and the step and held-out pass over pairs that both commands drive with
their own loss."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Literal

import torch

from ..core.config import ModelConfig, TrainConfig, opt
from ..core.errors import ConfigError
from ..data.preference import (
    COLUMN_NAMES,
    PreferenceData,
    load_preference_rows,
    pairs_from_task,
    row_texts,
    tokenize_pairs,
)
from ..data.sft import uses_chat_format
from ..data.source import split_by_fraction
from ..data.tasks import check_task_section, get_task
from ..model.load import context_length
from ..model.tokenizer import check_unknown_tokens
from ..parallel.wrap import gradient_sync
from ..rollout.evaluation import complete
from ..runtime.loop import TrainState
from .pair_forward import segment_length
from .step import rank_share


@dataclasses.dataclass
class PreferenceDataConfig:
    path: str = opt(
        "",
        "prompt / chosen / rejected rows (text or messages): JSONL, Parquet, CSV, Arrow, a "
        "save_to_disk dir or a cached hub id (docs/preference.md)",
    )
    split: str = opt("train", "path: the split to train on (a single file is split 'train')")
    eval_split: str = opt("", "path: a named split for the held-out pairs instead of data.val_fraction")
    subset: str = opt("", "path: the hub dataset's config name")
    columns: dict[str, str] = opt(
        {}, "path: lmforge name -> the data's column, e.g. {chosen: response_a}", keys=COLUMN_NAMES
    )
    task: str = opt(
        "",
        "pairs from a built-in task instead of a file (chosen = the answer, rejected = the answer "
        "without its carries or one digit off by one), e.g. addition",
    )
    rejected: Literal["rule", "policy"] = opt(
        "rule",
        "task: the rejected answers: rule = the answer without its "
        "carries or one digit off by one; policy = the starting model's own "
        "wrong greedy answer (a rule-made one where it is right)",
    )
    num_train: int = opt(4000, "task: training pairs")
    num_val: int = opt(200, "task: held-out pairs (preference loss and accuracy)", free_on_resume=True)
    num_eval: int = opt(200, "task: held-out problems for exact-match accuracy (greedy)", free_on_resume=True)
    val_fraction: float = opt(0.05, "path: fraction of pairs held out (seeded by train.seed)")
    max_len: int = opt(256, "longest tokenized side of a pair (prompt + completion)")
    use_chat_template: Literal["auto", "on", "off"] = opt("auto", "text pairs through the chat template")
    truncation: Literal["right", "drop"] = opt("right", "over-long pairs: cut each side on the right, or drop them")

    def validate(self) -> None:
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if bool(self.path) == bool(self.task):
            raise ConfigError(
                "set exactly one of data.path (preference rows from any source of docs/data.md) and "
                "data.task (pairs made from a built-in task, e.g. addition)"
            )
        if self.task:
            check_task_section(self, ("split", "eval_split", "val_fraction", "subset", "columns"))
        elif self.rejected != "rule":
            raise ConfigError(
                "data.rejected chooses how pairs are made from data.task; with data.path the rows "
                "hold their rejected answers"
            )


def model_answers(
    model, tokenizer, task, n: int, seed: int, split: str, d: PreferenceDataConfig, max_new_tokens: int
) -> list[str]:
    """The model's greedy completions of the ``n`` problems of ``split`` (data.rejected=policy)."""
    chat = uses_chat_format(tokenizer, d.use_chat_template)
    problems = task.make_problems(n, seed, split)
    return complete(model, tokenizer, [p.prompt for p in problems], max_new_tokens, chat)


def build_pairs(
    d: PreferenceDataConfig, train: TrainConfig, model_cfg: ModelConfig, tokenizer, printer=print, model=None
) -> tuple[PreferenceData, PreferenceData]:
    """Tokenized training and held-out pairs of the data section ``d``, each with its skip counts printed
    (``train``: the seed and, with data.rejected=policy, the answers' length). ``model``: the starting
    model, whose answers are the rejected ones with data.rejected=policy."""
    if d.task:
        task = get_task(d.task)
        answers = {split: None for split in ("train", "val")}
        if d.rejected == "policy":
            answers = {
                split: model_answers(model, tokenizer, task, n, train.seed, split, d, train.max_new_tokens)
                for split, n in (("train", d.num_train), ("val", d.num_val))
            }
            problems = task.make_problems(d.num_train, train.seed, "train")
            blank = sum(not a.strip() for a in answers["train"])
            wrong = sum(bool(a.strip()) and not task.is_correct(a, p) for a, p in zip(answers["train"], problems))
            printer(
                f"[data] the starting model answers {wrong} of {d.num_train} training problems wrongly "
                f"(and {blank} blank): those {wrong} answers are the rejected ones, rule-made wrong answers "
                "the rest (the blank and the right ones)"
            )
        train_rows = pairs_from_task(task, d.num_train, train.seed, "train", answers["train"])
        val_rows = pairs_from_task(task, d.num_val, train.seed, "val", answers["val"])
    else:
        train_rows = load_preference_rows(d.path, d.split, d.subset, d.columns)
        if d.eval_split:
            val_rows = load_preference_rows(d.path, d.eval_split, d.subset, d.columns)
        else:
            train_rows, val_rows = split_by_fraction(train_rows, d.val_fraction, train.seed)
    check_unknown_tokens(tokenizer, row_texts(train_rows), model_cfg, d.path or f"data.task={d.task}", printer)
    parts = []
    for name, rows in (("training", train_rows), ("held-out", val_rows)):
        if not rows:
            parts.append(PreferenceData())
            continue
        data = tokenize_pairs(rows, tokenizer, d.max_len, d.use_chat_template, d.truncation)
        if data.report(d.max_len, d.truncation):
            printer(f"[data] {name} pairs: {data.report(d.max_len, d.truncation)}")
        parts.append(data)
    return parts[0], parts[1]


def choice_seq_len(*datasets: PreferenceData) -> int:
    """The tokens of the longest pair as the forward runs it (its prompt once, both completions:
    :func:`pair_forward.segment_length`): what the hardware choice sizes activation memory for."""
    return max((segment_length(pair) for data in datasets for pair in data.pairs), default=1)


def check_fits_context(model, *datasets: PreferenceData) -> None:
    context = context_length(model)
    longest = max((len(side.input_ids) for data in datasets for pair in data.pairs for side in pair), default=0)
    if context is not None and longest > context:
        raise ConfigError(
            f"the longest side of a pair has {longest} tokens but the model's context is {context}; "
            f"set data.max_len <= {context} (longer pairs are then cut or dropped per data.truncation)"
        )
    window = getattr(getattr(model, "config", None), "sliding_window", None)
    if window and longest > window:  # pair_forward's tree mask is full causal within a side
        raise ConfigError(
            f"the longest side of a pair has {longest} tokens but the model attends within a sliding "
            f"window of {window}, which lmforge dpo's packed forward does not apply; set "
            f"data.max_len <= {window}"
        )


def pairs_step(
    state: TrainState,
    data: PreferenceData,
    step: int,
    make_batch: Callable,
    micro_loss: Callable,
    metric_keys: tuple[str, ...],
    count_tokens: Callable,
    before: Callable | None = None,
    count_flops: Callable | None = None,
) -> dict:
    """One optimizer step over the next global batch of pairs (lmforge dpo and lmforge rm); metrics are
    means over all its pairs.

    This rank's share is cut into micro-batches, ``make_batch(pairs)`` each; ``before(batch)`` (e.g. the
    reference's logprobs) runs on every micro-batch before any update; ``micro_loss(batch, before_value,
    num_pairs_global) -> (loss, metrics)`` is already divided by the global pair count, so the sums over
    micro-batches and ranks are the means. ``count_tokens(batch)``: the tokens a micro-batch holds;
    ``count_flops(batch)``: the matmul FLOPs this step spends on it (else the summary assumes 6N a token)."""
    run, updater = state.run, state.updater
    ctx, micro = run.ctx, run.micro_batch_size
    t0 = time.perf_counter()
    global_rows = state.order.next()
    rows = rank_share(global_rows, ctx.rank, ctx.world_size)
    batches = [make_batch([data.pairs[i] for i in rows[k : k + micro]]) for k in range(0, len(rows), micro)]
    data_time = time.perf_counter() - t0
    prepared = [before(batch) for batch in batches] if before else [None] * len(batches)
    totals = torch.zeros(1 + len(metric_keys), device=run.device)  # loss, then metric_keys
    for index, (batch, value) in enumerate(zip(batches, prepared)):
        with gradient_sync(state.wrapped, enabled=index == len(batches) - 1):
            loss, metrics = micro_loss(batch, value, len(global_rows))
            updater.precision.backward(loss)
        totals += torch.stack([loss.detach().float(), *(metrics[k].float() for k in metric_keys)])
    ctx.all_reduce(totals)  # each part is already over the global pair count: the sums are the means
    updater.check_loss(totals[0], step)
    lr = updater.scheduler.get_last_lr()[0]
    grad_norm = updater.step(step)
    out = {
        "loss": totals[0],
        **dict(zip(metric_keys, totals[1:])),
        "lr": lr,
        "grad_norm": grad_norm,
        "skipped_updates": updater.num_skipped,
        "num_tokens": sum(count_tokens(b) for b in batches),
        "data_time": data_time,
    }
    if count_flops is not None:
        out["num_flops"] = float(sum(count_flops(b) for b in batches))
    return out


@torch.no_grad()
def held_out_pairs(
    state: TrainState, data: PreferenceData, max_pairs: int, pairs_loss: Callable, names: dict[str, str]
) -> dict:
    """``val_loss`` and the ``names`` (output name -> metric of ``pairs_loss(pairs) -> (loss, metrics)``,
    summed over pairs) as means over (up to ``max_pairs``) held-out pairs, shared out over the ranks;
    every rank runs the same number of forwards (FSDP2 gathers in each), a rank whose share is used up
    repeats a batch and counts nothing from it."""
    run = state.run
    ctx, micro = run.ctx, run.micro_batch_size
    pairs = data.pairs[:max_pairs]
    if not pairs:
        return {}
    was_training = state.model.training
    state.model.eval()
    mine = pairs[ctx.rank :: ctx.world_size]
    totals = torch.zeros(1 + len(names), dtype=torch.float64)  # loss sum, then the named sums
    for index in range(-(-len(pairs) // (micro * ctx.world_size))):
        part = mine[index * micro : (index + 1) * micro]
        loss, metrics = pairs_loss(part or pairs[:1])
        if part:
            totals += torch.tensor([float(loss), *(float(metrics[key]) for key in names.values())], dtype=torch.float64)
    ctx.all_reduce(totals)
    state.model.train(was_training)
    return {
        "val_loss": float(totals[0]) / len(pairs),
        **{name: float(total) / len(pairs) for name, total in zip(names, totals[1:])},
    }
