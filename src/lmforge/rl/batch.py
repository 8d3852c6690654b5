"""The stages of one RL step's data, each a frozen dataclass that says what exists at that point.

1. :class:`~lmforge.rollout.RolloutBatch` -- a source's tokens: left-padded prompts (B, P), the
   tokens after each prompt (B, C, right-padded), the *trained* mask over them and the sampler's
   logprobs. A single-turn completion is all trained; a multi-turn row holds the policy's turns and
   the environment's tokens between them, so its trained tokens are several separate spans.
2. :class:`ScoredRollout` -- what a rollout source returns for a step: that rollout, its rewards
   and the step's rollout metrics (``lmforge.rl.sources``).
3. :class:`TrainBatch` -- the trainer's packed layout (below); a recipe adds its per-step tensors
   (advantages, pi_old, the reference's logprobs, PPO's values and returns) with :meth:`TrainBatch.with_`,
   which returns a new batch.

The packed layout. Each row is re-packed as ``prompt tokens, completion tokens, padding`` (B, L):
positions are then plain 0..L-1, exactly the position ids the engine used (it counts real tokens
only), so the model needs no position ids. ``positions`` (B, L) selects the logits that predict
trained tokens. The completion occupies one contiguous stretch of its packed row, in order, so
those N logits, taken in row-major order, line up with the true entries of ``trained_mask``
(B, C) taken in row-major order, however many spans a row has. Every loss, advantage, KL,
importance weight and aggregation count is then defined on ``trained_mask``: an environment token
inside a row is an input to the forward and nothing else.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core.errors import TrainingError
from ..parallel.context import ParallelContext
from ..rollout import RewardOutput, RolloutBatch

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class ScoredRollout:
    """One step's rows from a rollout source: this rank's share, scored."""

    rollout: RolloutBatch  # this rank's rows (a prompt's samples adjacent, groups whole)
    rewards: RewardOutput  # (B,) totals, per-function parts, failure counts
    metrics: dict  # detached scalars (reward, lengths, timings), already reduced over ranks (below)


def reduce_rollout_metrics(metrics: dict, ctx: ParallelContext) -> dict:
    """A rank's rollout / advantage metrics -> the step's over all ranks (every rank holds the same
    number of rows and groups): ``num_*``, ``*_failures``, ``*_errors`` and ``*_timeouts`` are summed, ``*_max`` /
    ``time_*`` take
    the maximum, ``reward_std`` is recombined from the ranks' means and variances, the rest are means."""
    if not ctx.distributed:
        return metrics
    keys = list(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    summed = ctx.all_reduce(values.clone())
    highest = ctx.all_reduce(values.clone(), op=torch.distributed.ReduceOp.MAX)
    out = {}
    for i, key in enumerate(keys):
        if key.startswith("num_") or key.endswith(("_failures", "_errors", "_timeouts")):
            out[key] = float(summed[i])
        elif key.endswith("_max") or key.startswith("time_"):
            out[key] = float(highest[i])
        else:
            out[key] = float(summed[i]) / ctx.world_size
    if "reward_std" in metrics and "reward" in metrics:
        second = ctx.all_reduce(
            torch.tensor([float(metrics["reward_std"]) ** 2 + float(metrics["reward"]) ** 2], dtype=torch.float64)
        )
        out["reward_std"] = max(float(second) / ctx.world_size - out["reward"] ** 2, 0.0) ** 0.5
    return out


def trained_spans(mask: Tensor) -> Tensor:
    """(B, C) trained mask -> (B, C) long span numbers: k >= 1 on the k-th separate run of trained
    tokens of its row, 0 elsewhere. A single-turn row is span 1; a multi-turn row has one span per
    policy turn."""
    trained = mask.bool()
    starts = trained.clone()
    starts[:, 1:] &= ~trained[:, :-1]
    return starts.long().cumsum(1) * trained


def trained_ends(mask: Tensor) -> Tensor:
    """(B, C) trained mask -> (B,) long: one past the column of each row's last trained token (0 for a
    row with none)."""
    columns = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask.bool() * columns).amax(1) if mask.shape[1] else mask.new_zeros(mask.shape[0], dtype=torch.long)


@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """A rollout laid out for the trainer (module doc). B rows, L packed length, C completion width."""

    input_ids: Tensor  # (B, L) long: prompt tokens, completion tokens, then padding
    attention_mask: Tensor  # (B, L) long
    positions: Tensor  # (B, L) bool: the logits here predict trained tokens
    completion_ids: Tensor  # (B, C) long: every token after the prompt (policy's and environment's)
    trained_mask: Tensor  # (B, C) long: 1 on the policy-sampled tokens, possibly several spans per row
    rollout_logprobs: Tensor | None  # (B, C) the sampler's logprobs of the trained tokens (None if it reports none)
    group_index: Tensor | None = None  # (B,) long: rows with one value share their prompt (a rollout group)
    prompt_lens: Tensor | None = None  # (B,) long: prompt tokens at the start of each packed row
    advantages: Tensor | None = None  # (B,) per sequence (GRPO) or (B, C) per token (PPO)
    old_logprobs: Tensor | None = None  # (B, C) trainer logprobs at the rollout's weights (None: on-policy)
    ref_logprobs: Tensor | None = None  # (B, C) reference model logprobs
    old_values: Tensor | None = None  # (B, C) PPO critic at rollout time
    returns: Tensor | None = None  # (B, C) PPO value targets

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def segment_ids(self) -> Tensor:
        """(B, C) long: which trained span of its row each token is in (:func:`trained_spans`)."""
        return trained_spans(self.trained_mask)

    def with_(self, **fields) -> "TrainBatch":
        """A copy with ``fields`` set (a recipe adding what its step computed)."""
        return dataclasses.replace(self, **fields)

    def to(self, device) -> "TrainBatch":
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None
            },
        )

    def select(self, rows: Tensor) -> "TrainBatch":
        """The rows ``rows`` (1-D index tensor), with packed columns that are padding in all of them cut."""
        picked = {
            f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[rows]
            for f in dataclasses.fields(self)
        }
        width = int(picked["attention_mask"].sum(1).max())
        for name in ("input_ids", "attention_mask", "positions"):
            picked[name] = picked[name][:, :width]
        return TrainBatch(**picked)


def pack_rollout(rollout: RolloutBatch, pad_token_id: int, need_rollout_logprobs: bool) -> TrainBatch:
    """Re-pack a rollout as ``prompt, completion, padding`` rows (module doc)."""
    if need_rollout_logprobs and rollout.logprobs is None:
        raise TrainingError(
            "algo.is_level weights by the sampler's logprobs, but this rollout carries none "
            "(RolloutBatch.logprobs is None); use a rollout engine that reports them, or set "
            "algo.is_level=none"
        )
    trained = rollout.trained
    if bool((trained.bool() & ~rollout.completion_mask.bool()).any()):
        raise TrainingError(
            "RolloutBatch.trained_mask marks tokens outside completion_mask (padding); a rollout "
            "source must train only on tokens of its rows"
        )
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], dim=1)  # (B, P + C)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], dim=1)
    is_trained = torch.cat([torch.zeros_like(rollout.prompt_mask), trained], dim=1)
    # A stable sort on "is padding" moves each row's real tokens to the front, keeping their order.
    order = torch.sort((mask == 0).long(), dim=1, stable=True).indices
    ids, mask, is_trained = ids.gather(1, order), mask.gather(1, order), is_trained.gather(1, order)
    positions = torch.zeros_like(mask, dtype=torch.bool)
    positions[:, :-1] = is_trained[:, 1:].bool()  # logits at t predict token t + 1
    width = int(mask.sum(1).max())
    return TrainBatch(
        input_ids=ids[:, :width],
        attention_mask=mask[:, :width],
        positions=positions[:, :width],
        completion_ids=rollout.completion_ids,
        trained_mask=trained,
        rollout_logprobs=rollout.logprobs,
        group_index=rollout.group_index,
        prompt_lens=rollout.prompt_lens,
    )


def scatter_completion(flat: Tensor, mask: Tensor) -> Tensor:
    """(N,) values of the mask's true entries, row-major -> (B, C), 0 elsewhere (differentiable)."""
    return flat.new_zeros(mask.shape).masked_scatter(mask, flat)
