"""Reward-model losses as pure functions: per-pair scalar rewards in, ``(loss, metrics)`` out.

A pair is a prompt x with a chosen completion y_w and a rejected one y_l; a reward model gives each
a scalar, ``chosen_rewards`` = r(x, y_w) and ``rejected_rewards`` = r(x, y_l), each of shape (B,).
Each variant returns the (B,) per-pair loss. :func:`reward_loss` sums it and divides by
``num_pairs_global``, the pairs of the whole optimizer step over all micro-batches and ranks, so the
sum of its results over a step's micro-batches and ranks is the mean over the step's pairs whatever
the split. Metrics are divided by the same count and detached. The math: docs/reward-models.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
Metrics = dict[str, Tensor]


def bradley_terry(chosen_rewards: Tensor, rejected_rewards: Tensor, *, margin: float) -> Tensor:
    """Bradley-Terry (1952), as in InstructGPT's reward model (Ouyang et al. 2022):
    P(y_w > y_l | x) = sigmoid(r_w - r_l), loss = -log sigmoid(r_w - r_l - m), the negative
    log-likelihood of the preference. ``margin`` m >= 0 asks the chosen reward to lead by at least
    about m (Llama 2's margin term, Touvron et al. 2023). (B,), (B,) -> (B,)."""
    return -F.logsigmoid(chosen_rewards - rejected_rewards - margin)


REWARD_LOSSES = {"bradley_terry": bradley_terry}


def reward_loss(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    *,
    loss_type: str = "bradley_terry",
    margin: float = 0.0,
    num_pairs_global: int | Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """``sum_i loss_i / num_pairs_global`` for the variant ``loss_type`` (a key of REWARD_LOSSES).

    ``chosen_rewards``, ``rejected_rewards``: (B,) scalar rewards of each pair's two sides.
    ``num_pairs_global`` defaults to B. Metrics, each a sum over this batch's pairs divided by
    ``num_pairs_global``: ``rewards_chosen``, ``rewards_rejected``, ``reward_margin`` (r_w - r_l)
    and ``accuracy`` (the fraction with r_w > r_l strictly: a tie is not a win).
    """
    if loss_type not in REWARD_LOSSES:
        raise ValueError(f"unknown reward-model loss {loss_type!r}; valid: {', '.join(REWARD_LOSSES)}")
    if not margin >= 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    if chosen_rewards.ndim != 1 or chosen_rewards.shape != rejected_rewards.shape:
        raise ValueError(
            f"chosen_rewards and rejected_rewards must be one value per pair, shape (B,); got "
            f"{tuple(chosen_rewards.shape)} and {tuple(rejected_rewards.shape)}"
        )
    losses = REWARD_LOSSES[loss_type](chosen_rewards, rejected_rewards, margin=margin)
    num_pairs = chosen_rewards.shape[0] if num_pairs_global is None else num_pairs_global
    chosen, rejected = chosen_rewards.detach(), rejected_rewards.detach()
    metrics = {
        "rewards_chosen": chosen.sum() / num_pairs,
        "rewards_rejected": rejected.sum() / num_pairs,
        "reward_margin": (chosen - rejected).sum() / num_pairs,
        "accuracy": (chosen > rejected).to(chosen.dtype).sum() / num_pairs,
    }
    return losses.sum() / num_pairs, metrics
