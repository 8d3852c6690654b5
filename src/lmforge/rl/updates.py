"""The update phase of an RL step (``lmforge grpo``, ``lmforge ppo``): passes over a rollout batch,
mini-batches (one optimizer update each), micro-batches (gradient accumulation), the aggregation
counts that make accumulation and data parallelism exact, skipping rows that cannot change the
update, and the reduction of the step's metrics over micro-batches and ranks.

Every count is of trained tokens (``TrainBatch.trained_mask``): a multi-turn row's environment
tokens are in no normaliser, whichever aggregation the loss uses.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..parallel.context import ParallelContext
from ..parallel.wrap import gradient_sync
from .batch import TrainBatch

Tensor = torch.Tensor


def global_counts(batch: TrainBatch, max_new_tokens: int, num_micro_batches: int = 1,
                  ctx: ParallelContext | None = None) -> dict:
    """The aggregation counts of one optimizer update: summed over its micro-batches and all ranks, once."""
    ctx = ctx or ParallelContext()
    num_seqs, num_tokens, num_micro = ctx.sum_counts(batch.num_rows, int(batch.trained_mask.sum()),
                                                     num_micro_batches)
    return {"num_seqs_global": num_seqs, "num_loss_tokens_global": num_tokens,
            "max_completion_len": max_new_tokens, "num_micro_batches_global": num_micro}


def reduce_metrics(records: list[tuple[dict, int]], ctx: ParallelContext | None = None) -> dict:
    """Per-micro-batch metrics of every rank -> one value each: max of ``*_max``, min of ``*_min``,
    else the mean weighted by the micro-batch's completion tokens. Three collectives in all."""
    ctx = ctx or ParallelContext()
    values: dict[str, list] = {}
    for metrics, weight in records:
        for key, value in metrics.items():
            values.setdefault(key, []).append((float(value), weight))
    keys = sorted(values)
    maxima = [k for k in keys if k.endswith("_max")]
    minima = [k for k in keys if k.endswith("_min")]
    means = [k for k in keys if k not in maxima and k not in minima]
    sums = torch.tensor([x for k in means for x in (sum(v * w for v, w in values[k]), sum(w for _, w in values[k]))],
                        dtype=torch.float64)
    highs = torch.tensor([max(v for v, _ in values[k]) for k in maxima], dtype=torch.float64)
    lows = torch.tensor([min(v for v, _ in values[k]) for k in minima], dtype=torch.float64)
    if ctx.distributed:
        ctx.all_reduce(sums)
        ctx.all_reduce(highs, op=torch.distributed.ReduceOp.MAX)
        ctx.all_reduce(lows, op=torch.distributed.ReduceOp.MIN)
    out = {k: float(sums[2 * i]) / max(float(sums[2 * i + 1]), 1) for i, k in enumerate(means)}
    out.update({k: float(highs[i]) for i, k in enumerate(maxima)})
    out.update({k: float(lows[i]) for i, k in enumerate(minima)})
    return {k: out[k] for k in values}  # first-seen order, as logged


LossFn = Callable[[TrainBatch, dict], tuple[Tensor, dict]]  # (micro-batch, counts) -> (loss, metrics)


def mini_batch_rows(num_rows: int, num_mini_batches: int) -> tuple[Tensor, ...]:
    """The row indices of each mini-batch: contiguous ranges, so a prompt's samples stay together."""
    return torch.arange(num_rows).tensor_split(num_mini_batches)


def micro_batch_order(batch: TrainBatch, informative: Tensor | None = None) -> Tensor:
    """The rows of a mini-batch sorted for cutting into micro-batches: the rows to train first
    (``informative``, when rows are skipped), each part longest first. A micro-batch's forward is as
    wide as its longest row, so rows of like length together pad less (a multi-turn batch mixes
    one-reply episodes with long ones); a group split over micro-batches runs its prompt in each, so
    :func:`update` keeps this order only where its forwards cost less than contiguous rows'."""
    lengths = batch.attention_mask.sum(1).cpu()
    key = -lengths if informative is None else (~informative.cpu()).long() * (int(lengths.max()) + 1) - lengths
    return torch.sort(key, stable=True).indices


def _micro_batch_plan(mini: TrainBatch, micro_batch_size: int, informative: Tensor | None, ctx: ParallelContext,
                      length_order: bool, flops_of: Callable[[TrainBatch], float] | None) -> tuple[int, list[Tensor]]:
    """(number of micro-batches, the row sets that run) for a mini-batch: contiguous rows, or with
    ``length_order`` (one process, ``flops_of`` given) the rows of :func:`micro_batch_order` when its
    micro-batches' forwards cost fewer FLOPs."""
    plans = []
    orders = [torch.arange(mini.num_rows)]
    if length_order and not ctx.distributed and flops_of is not None:
        orders.append(micro_batch_order(mini, informative))
    for order in orders:
        micro_rows = list(order.split(micro_batch_size))
        run = micro_rows if informative is None else _rows_to_run(micro_rows, informative, ctx)
        plans.append((len(micro_rows), run))
    if len(plans) == 1:
        return plans[0]
    return min(plans, key=lambda plan: sum(flops_of(mini.select(rows)) for rows in plan[1]))


def informative_rows(advantages: Tensor) -> Tensor:
    """(B,) bool: rows with a non-zero advantage somewhere ((B,) per sequence or (B, C) per token)."""
    return advantages.reshape(advantages.shape[0], -1).ne(0).any(1)


def update(batch: TrainBatch, algo, updater, micro_batch_size: int, max_new_tokens: int, loss_fn: LossFn, step: int,
           ctx: ParallelContext | None = None, wrapped=None, rows_to_train: Tensor | None = None,
           first_on_policy: bool = False, flops_of: Callable[[TrainBatch], float] | None = None,
           length_order: bool = False) -> dict:
    """``algo.num_iterations`` passes over this rank's ``batch``, each of ``algo.num_mini_batches`` updates.

    Mini-batches are contiguous row ranges (a prompt's samples stay together); the rank's rows were
    chosen so that its m-th mini-batch is its share of the global m-th mini-batch
    (:func:`lmforge.rl.prompts.rank_prompts`). Each is split into micro-batches of ``micro_batch_size``
    rows (contiguous, or of like length: ``length_order``) whose losses, normalised by the
    mini-batch's global counts, are accumulated into one optimizer step;
    gradients are summed across ranks (``ctx``; ``wrapped``, the parallel root) on the last
    micro-batch. ``loss_fn(micro_batch, counts) -> (loss, metrics)``.

    ``rows_to_train`` ((B,) bool, e.g. :func:`informative_rows`; only for a loss that is a sum of
    advantage-weighted terms: no KL, no entropy bonus, no value loss): the other rows, whose
    advantages are all 0, add exactly 0 to the gradient, so they are not run; a micro-batch with
    none left is skipped on every rank (one small all-reduce per mini-batch under several ranks),
    and an update with nothing left steps the optimizer on zero gradients, as the full computation
    would (AdamW's moments still move the weights). The counts that normalise the loss are those of
    all rows, so the update is the same; the logged policy metrics (ratio, clip fractions, entropy)
    are then over the rows trained.

    ``first_on_policy``: the first mini-batch of the first pass takes pi_old from its own (detached)
    forward, since the weights have not moved yet; ``batch.old_logprobs`` of its rows is not read.

    ``length_order``: only for a loss that is a sum over rows normalised by global counts (not a
    per-micro-batch mean such as ``token_mean``), whose update does not depend on which rows share a
    micro-batch (up to float rounding). On one process, with ``flops_of``, each mini-batch is then cut
    from length-sorted rows where that costs fewer forward FLOPs (:func:`_micro_batch_plan`); under
    several ranks micro-batches stay contiguous, so every rank makes the same model calls (FSDP2
    gathers weights inside them).

    ``flops_of(micro)``: the forward FLOPs of a micro-batch, summed over those trained (returned as
    ``_forward_flops``, for the caller's FLOP count).
    """
    ctx = ctx or ParallelContext()
    records, losses, grad_norms = [], [], []
    lr = updater.scheduler.get_last_lr()[0]
    informative = None if rows_to_train is None else rows_to_train.cpu()
    # mini-batch -> (its global counts, the row sets of its micro-batches that run): the same on
    # every pass, so their collectives run on the first one only
    plans: dict[int, tuple[dict, list[Tensor]]] = {}
    trained_rows, flops = 0, 0.0
    for iteration in range(algo.num_iterations):
        for m, mini_rows in enumerate(mini_batch_rows(batch.num_rows, algo.num_mini_batches)):
            mini = batch.select(mini_rows)
            if first_on_policy and iteration == 0 and m == 0:
                mini = mini.with_(old_logprobs=None)
            if m not in plans:
                mini_informative = None if informative is None else informative[mini_rows]
                num_micro, run = _micro_batch_plan(mini, micro_batch_size, mini_informative, ctx, length_order, flops_of)
                plans[m] = (global_counts(mini, max_new_tokens, num_micro, ctx), run)
            counts, plan = plans[m]
            loss_sum = torch.zeros((), device=batch.input_ids.device)
            for index, rows in enumerate(plan):
                micro = mini.select(rows)
                with gradient_sync(wrapped, enabled=index == len(plan) - 1):
                    loss, metrics = loss_fn(micro, counts)
                    updater.precision.backward(loss)
                loss_sum = loss_sum + loss.detach()
                records.append((metrics, int(micro.trained_mask.sum())))
                trained_rows += micro.num_rows
                if flops_of is not None:
                    flops += flops_of(micro)
            if not plan:  # every advantage of this update is 0: the full computation's gradient is 0
                _zero_missing_grads(updater.module)
            ctx.all_reduce(loss_sum)  # each rank's part is over the global counts: the sum is the loss
            updater.check_loss(loss_sum, step)  # once per update (a host sync on GPUs), on every rank, before it
            grad_norms.append(updater.step(step))  # non-finite: stop, or skip this update (train.on_nonfinite)
            losses.append(loss_sum)
    grad_norms = torch.stack(grad_norms)
    out = {**(reduce_metrics(records, ctx) if records else {}), "loss": torch.stack(losses).mean(),
           "grad_norm": grad_norms.mean(), "grad_norm_max": grad_norms.max(), "lr": lr,
           "skipped_updates": updater.num_skipped}
    if informative is not None:
        out["frac_rows_trained"] = trained_rows / (batch.num_rows * algo.num_iterations)
    if flops_of is not None:
        out["_forward_flops"] = flops
    return out


def _rows_to_run(micro_rows: list[Tensor], informative: Tensor, ctx: ParallelContext) -> list[Tensor]:
    """The micro-batches (row sets within the mini-batch) that must run: each keeps its informative
    rows; one with none is dropped if it has none on every rank, else it runs whole on this rank (so
    every rank runs the same forwards: DDP and FSDP2 communicate inside them)."""
    kept = [rows[informative[rows]] for rows in micro_rows]
    anywhere = torch.tensor([len(rows) > 0 for rows in kept], dtype=torch.float32)
    if ctx.distributed:
        anywhere = ctx.all_reduce(anywhere, op=torch.distributed.ReduceOp.MAX)
    return [rows if len(rows) else whole for rows, whole, run in zip(kept, micro_rows, anywhere.tolist()) if run]


def _zero_missing_grads(module: torch.nn.Module) -> None:
    """Zero gradients where none were accumulated, so the optimizer steps those parameters as it
    would on a zero gradient (AdamW skips parameters whose .grad is None)."""
    for param in module.parameters():
        if param.requires_grad and param.grad is None:
            param.grad = torch.zeros_like(param)
