"""The update phase of an RL step (``lmforge grpo``, ``lmforge ppo``, ``lmforge distill``): passes
over a rollout batch, mini-batches (one optimizer update each), micro-batches (gradient
accumulation), the aggregation counts that make accumulation and data parallelism exact, skipping
rows that cannot change the update, and the reduction of the step's metrics over micro-batches and
ranks, all in one object the recipe iterates (:class:`Updates`), so that the recipe's step holds
the loop itself::

    updates = Updates(batch, plan, updater, step, ctx, wrapped)
    for update in updates:            # num_iterations x num_mini_batches optimizer updates
        for micro in update:          # its micro-batches; gradients synced on the last one
            logprobs = ...            # the recipe's forward
            loss, metrics = policy_loss(..., update.counts)
            update.backward(loss, metrics)
        update.step()                 # loss check, clipping, optimizer and scheduler step
    metrics = updates.metrics()

Every count is of trained tokens (``TrainBatch.trained_mask``): a multi-turn row's environment
tokens are in no normaliser, whichever aggregation the loss uses.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import torch

from ..losses.policy import Counts
from ..parallel.context import ParallelContext
from ..parallel.wrap import gradient_sync
from .batch import TrainBatch

Tensor = torch.Tensor


def global_counts(
    batch: TrainBatch, max_new_tokens: int, num_micro_batches: int = 1, ctx: ParallelContext | None = None
) -> Counts:
    """The aggregation counts of one optimizer update: summed over its micro-batches and all ranks, once."""
    ctx = ctx or ParallelContext()
    num_seqs, num_tokens, num_micro = ctx.sum_counts(batch.num_rows, int(batch.trained_mask.sum()), num_micro_batches)
    return Counts(
        num_seqs_global=num_seqs,
        num_loss_tokens_global=num_tokens,
        max_completion_len=max_new_tokens,
        num_micro_batches_global=num_micro,
    )


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
    sums = torch.tensor(
        [x for k in means for x in (sum(v * w for v, w in values[k]), sum(w for _, w in values[k]))],
        dtype=torch.float64,
    )
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


def mini_batch_rows(num_rows: int, num_mini_batches: int) -> tuple[Tensor, ...]:
    """The row indices of each mini-batch: contiguous ranges, so a prompt's samples stay together."""
    return torch.arange(num_rows).tensor_split(num_mini_batches)


def micro_batch_order(batch: TrainBatch, informative: Tensor | None = None) -> Tensor:
    """The rows of a mini-batch sorted for cutting into micro-batches: the rows to train first
    (``informative``, when rows are skipped), each part longest first. A micro-batch's forward is as
    wide as its longest row, so rows of like length together pad less (a multi-turn batch mixes
    one-reply episodes with long ones); a group split over micro-batches runs its prompt in each, so
    :class:`Updates` keeps this order only where its forwards cost less than contiguous rows'."""
    lengths = batch.attention_mask.sum(1).cpu()
    key = -lengths if informative is None else (~informative.cpu()).long() * (int(lengths.max()) + 1) - lengths
    return torch.sort(key, stable=True).indices


def _micro_batch_plan(
    mini: TrainBatch,
    micro_batch_size: int,
    informative: Tensor | None,
    ctx: ParallelContext,
    length_order: bool,
    flops_of: Callable[[TrainBatch], float] | None,
) -> tuple[int, list[Tensor]]:
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


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
    """How a step's batch is cut into optimizer updates and micro-batches; the same every step of a run
    (built once from the resolved algo section and the run's micro-batch size).

    ``num_iterations`` passes over the batch, each of ``num_mini_batches`` updates; micro-batches of
    ``micro_batch_size`` rows; ``max_completion_len``: the generation budget (Dr. GRPO's normaliser).

    ``first_on_policy``: the first mini-batch of the first pass takes pi_old from its own (detached)
    forward, since the weights have not moved yet; ``batch.old_logprobs`` of its rows is not read
    (its micro-batches carry ``old_logprobs=None``).

    ``length_order``: only for a loss that is a sum over rows normalised by global counts (not a
    per-micro-batch mean such as ``token_mean``), whose update does not depend on which rows share a
    micro-batch (up to float rounding). On one process, with ``flops_of``, each mini-batch is then cut
    from length-sorted rows where that costs fewer forward FLOPs (:func:`_micro_batch_plan`); under
    several ranks micro-batches stay contiguous, so every rank makes the same model calls (FSDP2
    gathers weights inside them).
    """

    num_iterations: int
    num_mini_batches: int
    micro_batch_size: int
    max_completion_len: int
    first_on_policy: bool = False
    length_order: bool = False

    @property
    def num_updates(self) -> int:
        """Optimizer steps per RL step."""
        return self.num_iterations * self.num_mini_batches

    @classmethod
    def from_algo(cls, algo, micro_batch_size: int, max_new_tokens: int) -> "UpdatePlan":
        """The plan of a resolved policy-gradient algo section: pi_old from the first update's own forward
        when several updates follow it; length-ordered micro-batches unless the loss is a mean per
        micro-batch (``token_mean``)."""
        return cls(
            algo.num_iterations,
            algo.num_mini_batches,
            micro_batch_size,
            max_new_tokens,
            first_on_policy=algo.num_iterations > 1 or algo.num_mini_batches > 1,
            length_order=algo.aggregation != "token_mean",
        )

    def pi_old_rows(self, rows: Tensor, distributed: bool) -> Tensor:
        """(B,) bool: the rows whose pi_old an update phase of several updates reads, of ``rows`` (the rows
        that are trained): less the first mini-batch of the first pass, which takes pi_old from its own
        forward (``first_on_policy``). Under several ranks every rank computes all its rows (FSDP2
        gathers weights inside each forward, so every rank must make the same calls)."""
        need = torch.ones_like(rows) if distributed else rows.clone()
        if self.num_iterations == 1:
            need[mini_batch_rows(len(rows), self.num_mini_batches)[0]] = False
        return need


class Updates:
    """The update phase of one step, iterated by the recipe: ``plan.num_updates`` :class:`Update` s,
    each yielding its micro-batches; after the loop, :meth:`metrics` and :attr:`flops`.

    Mini-batches are contiguous row ranges (a prompt's samples stay together); the rank's rows were
    chosen so that its m-th mini-batch is its share of the global m-th mini-batch
    (:func:`lmforge.rl.prompts.rank_prompts`). Each is split into micro-batches whose losses,
    normalised by the mini-batch's global counts (``update.counts``, summed over its micro-batches
    and all ranks once), are accumulated into one optimizer step; gradients are summed across ranks
    (``ctx``; ``wrapped``, the parallel root) on the last micro-batch only.

    ``rows_to_train`` ((B,) bool, e.g. :func:`informative_rows`; only for a loss that is a sum of
    advantage-weighted terms: no KL, no entropy bonus, no value loss): the other rows, whose
    advantages are all 0, add exactly 0 to the gradient, so they are not run; a micro-batch with
    none left is skipped on every rank (one small all-reduce per mini-batch under several ranks),
    and an update with nothing left steps the optimizer on zero gradients, as the full computation
    would (AdamW's moments still move the weights). The counts that normalise the loss are those of
    all rows, so the update is the same; the logged policy metrics (ratio, clip fractions, entropy)
    are then over the rows trained.

    ``flops_of(micro)``: the forward FLOPs of a micro-batch (``rl.forward_flops``); it prices the
    length-ordered cut (``plan.length_order``) and counts :attr:`flops`.
    """

    def __init__(
        self,
        batch: TrainBatch,
        plan: UpdatePlan,
        updater,
        step: int,
        ctx: ParallelContext | None = None,
        wrapped=None,
        *,
        rows_to_train: Tensor | None = None,
        flops_of: Callable[[TrainBatch], float] | None = None,
    ):
        self.batch, self.plan, self.updater, self.step_index = batch, plan, updater, step
        self.ctx, self.wrapped, self.flops_of = ctx or ParallelContext(), wrapped, flops_of
        self.informative = None if rows_to_train is None else rows_to_train.cpu()
        self.records: list[tuple[dict, int]] = []  # (a micro-batch's metrics, its trained tokens)
        self.losses: list[Tensor] = []  # each update's loss, summed over its micro-batches and ranks
        self.grad_norms: list[Tensor] = []
        self.trained_rows = 0
        self.forward_flops = 0.0
        self.lr = updater.scheduler.get_last_lr()[0]  # the learning rate of this step's first update
        # mini-batch -> (its global counts, the row sets of its micro-batches that run): the same on
        # every pass, so their collectives run on the first one only
        self._plans: dict[int, tuple[Counts, list[Tensor]]] = {}

    def __iter__(self) -> Iterator["Update"]:
        for iteration in range(self.plan.num_iterations):
            for m, mini_rows in enumerate(mini_batch_rows(self.batch.num_rows, self.plan.num_mini_batches)):
                mini = self.batch.select(mini_rows)
                if self.plan.first_on_policy and iteration == 0 and m == 0:
                    mini = mini.with_(old_logprobs=None)
                if m not in self._plans:
                    informative = None if self.informative is None else self.informative[mini_rows]
                    num_micro, run = _micro_batch_plan(
                        mini, self.plan.micro_batch_size, informative, self.ctx, self.plan.length_order, self.flops_of
                    )
                    self._plans[m] = (global_counts(mini, self.plan.max_completion_len, num_micro, self.ctx), run)
                update = Update(self, mini, *self._plans[m])
                yield update
                if not update.stepped:
                    raise RuntimeError(
                        "an update's loop ended without update.step(): call it after the "
                        "micro-batch loop, once per update"
                    )

    @property
    def flops(self) -> float:
        """FLOPs of the micro-batches run: forward and backward, 3 x the forward (0 without ``flops_of``)."""
        return 3 * self.forward_flops

    def metrics(self) -> dict:
        """The step's update metrics: the policy metrics reduced over micro-batches and ranks
        (:func:`reduce_metrics`), the mean loss and gradient norm of the updates, the largest norm,
        the learning rate, the updates skipped as non-finite, and (rows skipped) the rows trained."""
        grad_norms = torch.stack(self.grad_norms)
        out = {
            **(reduce_metrics(self.records, self.ctx) if self.records else {}),
            "loss": torch.stack(self.losses).mean(),
            "grad_norm": grad_norms.mean(),
            "grad_norm_max": grad_norms.max(),
            "lr": self.lr,
            "skipped_updates": self.updater.num_skipped,
        }
        if self.informative is not None:
            out["frac_rows_trained"] = self.trained_rows / (self.batch.num_rows * self.plan.num_iterations)
        return out


class Update:
    """One optimizer update: iterate its micro-batches (each inside ``gradient_sync``, enabled on the
    last), call :meth:`backward` once per micro-batch, then :meth:`step` once. ``counts``: the
    update's global aggregation counts, for the loss."""

    def __init__(self, updates: Updates, mini: TrainBatch, counts: Counts, micro_rows: list[Tensor]):
        self.updates, self.mini, self.counts, self.micro_rows = updates, mini, counts, micro_rows
        self.loss_sum = torch.zeros((), device=mini.input_ids.device)
        self.num_backward = 0
        self._metrics: dict = {}
        self.stepped = False

    def __iter__(self) -> Iterator[TrainBatch]:
        last = len(self.micro_rows) - 1
        for index, rows in enumerate(self.micro_rows):
            micro = self.mini.select(rows)
            # the caller's forward and backward run while this generator is paused at the yield
            with gradient_sync(self.updates.wrapped, enabled=index == last):
                yield micro
            if self.num_backward != index + 1:
                raise RuntimeError("each micro-batch of an update needs exactly one update.backward(loss, metrics)")
            self.updates.records.append((self._metrics, int(micro.trained_mask.sum())))
            self.updates.trained_rows += micro.num_rows
            if self.updates.flops_of is not None:
                self.updates.forward_flops += self.updates.flops_of(micro)

    def backward(self, loss: Tensor, metrics: dict) -> None:
        """Backward of one micro-batch's loss (already normalised by ``counts``), its metrics kept."""
        self.updates.updater.precision.backward(loss)
        self.loss_sum = self.loss_sum + loss.detach()
        self._metrics = metrics
        self.num_backward += 1

    def step(self) -> None:
        """Close the update: zero gradients where none ran, sum the loss over ranks, check it, clip
        and step (``updater.step``: a non-finite norm stops, or skips this update: train.on_nonfinite)."""
        if self.stepped:
            raise RuntimeError(
                "update.step() was called twice for one update: call it once per update, after its micro-batches"
            )
        updates = self.updates
        if not self.micro_rows:  # every advantage of this update is 0: the full computation's gradient is 0
            _zero_missing_grads(updates.updater.module)
        updates.ctx.all_reduce(self.loss_sum)  # each rank's part is over the global counts: the sum is the loss
        updates.updater.check_loss(self.loss_sum, updates.step_index)  # once per update, on every rank, before it
        updates.grad_norms.append(updates.updater.step(updates.step_index))
        updates.losses.append(self.loss_sum)
        self.stepped = True


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
