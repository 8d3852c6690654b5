"""The supervised step shared by ``pretrain`` and ``sft``: next-token cross-entropy on the positions
the labels select, normalised by the loss tokens of the whole optimizer step over all ranks.

One step: take the next global batch of rows (the same order on every rank) -> this rank's share ->
micro-batches -> count the step's loss tokens over all ranks, once -> forward / backward each
micro-batch (gradients reduced across ranks on the last one only) -> clip, update. The loop around
it (log, evaluate, checkpoint, resume, summary) is :func:`lmforge.runtime.loop.train_loop`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import torch

from ..losses.policy import sft_loss
from ..parallel.wrap import gradient_sync, run_forward
from ..runtime.loop import Trainer, TrainState, build_state, full_model, train_loop
from ..runtime.optim import BatchOrder, Precision, count_loss_tokens, logits_at, shifted_targets
from ..runtime.run import Run


@dataclasses.dataclass
class SupervisedData:
    """Rows and how to batch them. ``collate(rows) -> {input_ids, labels, attention_mask}`` with
    labels aligned to input_ids and -100 where no loss is taken."""

    train_rows: list
    val_rows: list
    collate: Callable[[list], dict]
    order: object = None  # a resumable order with its own rows (streaming text); None = BatchOrder over train_rows


def micro_loss(state: TrainState, batch: dict, num_loss_tokens_global: int, precision: Precision):
    """Loss of one micro-batch, already divided by the step's loss-token count over all ranks."""
    positions, targets = shifted_targets(batch["labels"])
    with precision.autocast():
        logits = run_forward(
            state.wrapped, logits_at, state.model, batch["input_ids"], batch["attention_mask"], positions
        )
    return sft_loss(logits, targets, num_loss_tokens_global)


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def rank_share(rows: list, rank: int, world_size: int) -> list:
    """This rank's contiguous share of a global batch (equal shares: the batch size divides)."""
    per_rank = len(rows) // world_size
    return rows[rank * per_rank : (rank + 1) * per_rank]


def supervised_step(state: TrainState, data: SupervisedData, step: int, loss_fn: Callable | None = None) -> dict:
    """One optimizer step over the next global batch; returns its metrics (loss summed over ranks).

    ``loss_fn(batch, num_loss_tokens_global) -> (loss, sums)`` replaces the cross-entropy to the labels
    (e.g. lmforge distill's forward KL to a teacher); its ``sums`` (a dict of numbers, the same keys on
    every rank) are added up over the micro-batches and the ranks and returned as ``metrics["sums"]``."""
    run, updater = state.run, state.updater
    ctx, micro = run.ctx, run.micro_batch_size
    t0 = time.perf_counter()
    rows = rank_share(state.order.next(), ctx.rank, ctx.world_size)
    batches = [
        to_device(data.collate([data.train_rows[i] for i in rows[k : k + micro]]), run.device)
        for k in range(0, len(rows), micro)
    ]
    (num_loss_tokens_global,) = ctx.sum_counts(sum(count_loss_tokens(b["labels"]) for b in batches))
    data_time = time.perf_counter() - t0
    loss_sum = torch.zeros((), device=run.device)
    sums: dict[str, float] = {}
    for index, batch in enumerate(batches):
        with gradient_sync(state.wrapped, enabled=index == len(batches) - 1):
            if loss_fn is None:
                loss, extra = micro_loss(state, batch, max(num_loss_tokens_global, 1), updater.precision)[0], {}
            else:
                loss, extra = loss_fn(batch, max(num_loss_tokens_global, 1))
            updater.precision.backward(loss)
        loss_sum += loss.detach()
        for key, value in extra.items():
            sums[key] = sums.get(key, 0.0) + float(value)
    ctx.all_reduce(loss_sum)  # each rank's part is already over the global count: the sum is the loss
    if loss_fn is not None:
        totals = torch.tensor(list(sums.values()), dtype=torch.float64)
        ctx.all_reduce(totals)
        sums = dict(zip(sums, totals.tolist()))
    updater.check_loss(loss_sum, step)  # once per step (a host sync on GPUs), before the update, on every rank
    lr = updater.scheduler.get_last_lr()[0]
    grad_norm = updater.step(step)  # a non-finite norm stops the run or skips this update (train.on_nonfinite)
    metrics = {
        "loss": loss_sum,
        "lr": lr,
        "grad_norm": grad_norm,
        "skipped_updates": updater.num_skipped,
        "loss_tokens": num_loss_tokens_global,
        "num_tokens": sum(int(b["attention_mask"].sum()) for b in batches),
        "data_time": data_time,
    }
    if loss_fn is not None:
        metrics["sums"] = sums
    return metrics


@torch.no_grad()
def validation_loss(state: TrainState, data: SupervisedData, max_rows: int = 512) -> float:
    """Mean NLL per loss token over (up to ``max_rows``) validation rows, shared out over the ranks.

    Every rank runs the same number of forward passes (FSDP2 gathers parameters in each): a rank
    whose share is used up repeats a batch and counts nothing from it.
    """
    run = state.run
    ctx, micro = run.ctx, run.micro_batch_size
    was_training = state.model.training
    state.model.eval()
    rows = data.val_rows[:max_rows]
    mine = rows[ctx.rank :: ctx.world_size]
    num_batches = math.ceil(len(rows) / (micro * ctx.world_size)) if rows else 0
    totals = torch.zeros(2, dtype=torch.float64)  # nll, tokens
    for index in range(num_batches):
        part = mine[index * micro : (index + 1) * micro]
        batch = to_device(data.collate(part or rows[:1]), run.device)
        count = count_loss_tokens(batch["labels"]) if part else 0
        if count == 0 and not ctx.distributed:
            continue
        _, metrics = micro_loss(state, batch, max(count, 1), state.updater.precision)
        if count:
            totals += torch.tensor([float(metrics["nll_sum"]), count], dtype=torch.float64)
    ctx.all_reduce(totals)
    state.model.train(was_training)
    return float(totals[0] / max(totals[1], 1))


def train_supervised(
    run: Run, model, tokenizer, data: SupervisedData, evaluate: Callable[[object, int], dict] | None = None
) -> dict:
    """Train ``model`` on ``data`` as configured by ``run``; returns the final evaluation metrics."""
    tcfg = run.train
    if data.order is None and len(data.train_rows) < tcfg.batch_size:
        from ..core.errors import DataError

        raise DataError(
            f"{len(data.train_rows)} training rows are fewer than one batch "
            f"(train.batch_size={tcfg.batch_size}); lower train.batch_size or add data"
        )
    order = data.order if data.order is not None else BatchOrder(len(data.train_rows), tcfg.batch_size, tcfg.seed)
    state = build_state(run, model, tokenizer, order, tcfg.max_steps)

    def run_eval(step: int) -> dict:
        val_loss = validation_loss(state, data)
        metrics = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}
        if evaluate is not None:
            sampler = full_model(state)
            sampler.eval()
            metrics.update(evaluate(sampler, step))
            state.model.train()
        return metrics

    trainer = Trainer(step=lambda step: supervised_step(state, data, step), evaluate=run_eval, best_metric="val_loss")
    return train_loop(state, trainer)
