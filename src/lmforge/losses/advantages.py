"""Advantage estimators as vectorised pure functions.

Outcome-reward estimators (one scalar reward per completion) take ``rewards`` shaped
``(num_groups, group_size)`` -- row g holds the completions sampled for prompt g -- or flat ``(B,)``
with ``group_size`` given (consecutive runs of ``group_size`` rows share a prompt). They return
``(advantages, metrics)``: advantages in the shape of ``rewards``, metrics a dict of detached tensors.

    ADVANTAGES = {"group_norm", "group_mean", "rloo", "batch_norm"}

A *zero-variance group* (every completion of a prompt got the same reward) carries no learning signal
under any group-relative estimator: its advantages are set to exactly 0 (never NaN, never a rounding
residue such as 1e-17) and ``num_zero_variance_groups`` / ``frac_zero_variance_groups`` report how
many there were.

Per-token estimators for PPO (``gae``, ``whiten_advantages``) take ``(B, T)`` tensors and a mask.
Nothing here needs gradients; every output is detached.
"""

from __future__ import annotations

from typing import Callable

import torch

from lmforge.core.ops import masked_mean, masked_sum

Metrics = dict[str, torch.Tensor]


def _grouped(rewards: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """Validate and view ``rewards`` as (num_groups, group_size) floats."""
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if rewards.dim() == 2:
        if group_size is not None and group_size != rewards.shape[1]:
            raise ValueError(
                f"rewards has shape {tuple(rewards.shape)} (num_groups, group_size) but group_size="
                f"{group_size}; pass group_size=None or flatten the rewards to (B,)"
            )
        grouped = rewards
    elif rewards.dim() == 1:
        if group_size is None:
            raise ValueError("flat rewards of shape (B,) need group_size (completions per prompt)")
        if group_size < 1 or rewards.numel() % group_size:
            raise ValueError(
                f"{rewards.numel()} rewards cannot be split into groups of {group_size}; B must be "
                "num_prompts * group_size with each prompt's completions consecutive"
            )
        grouped = rewards.view(-1, group_size)
    else:
        raise ValueError(f"rewards must be (num_groups, group_size) or (B,), got shape {tuple(rewards.shape)}")
    if grouped.shape[0] == 0:
        raise ValueError("rewards is empty")
    if grouped.shape[1] < 2:
        raise ValueError(
            f"group_size is {grouped.shape[1]}; group-relative advantages need at least 2 completions "
            "per prompt (with 1, every advantage would be 0)"
        )
    return grouped.detach()


def _zero_variance(grouped: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """(num_groups, G) -> bool (num_groups, 1) flag of groups whose rewards are all equal, + metrics."""
    flat = grouped.amax(dim=1) == grouped.amin(dim=1)  # exact: no tolerance, no mean/std rounding
    metrics = {
        "num_zero_variance_groups": flat.sum(),
        "frac_zero_variance_groups": flat.to(grouped.dtype).mean(),
    }
    return flat.unsqueeze(1), metrics


def group_normalized_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    *,
    std_eps: float = 1e-6,
    scale_by_std: bool = True,
) -> tuple[torch.Tensor, Metrics]:
    """GRPO: ``A_i = (r_i - mean(group)) / (std(group) + std_eps)``.

    std is the sample standard deviation (Bessel-corrected, ``torch.std``'s default), as in the
    common GRPO implementations. ``scale_by_std=False`` gives ``r_i - mean(group)`` (Dr. GRPO).
    rewards: (num_groups, G) or (B,) with ``group_size``. Returns advantages in rewards' shape.
    """
    if std_eps < 0:
        raise ValueError(f"std_eps must be >= 0, got {std_eps}")
    grouped = _grouped(rewards, group_size)
    flat, metrics = _zero_variance(grouped)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (grouped.std(dim=1, keepdim=True) + std_eps)
    # Zero-variance groups may hold 0/0 = NaN or a rounding residue here; both are replaced by 0.
    advantages = torch.where(flat, 0.0, centred)
    return advantages.view(rewards.shape), metrics


def group_mean_advantages(rewards: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, Metrics]:
    """Dr. GRPO: ``A_i = r_i - mean(group)`` (no division by the group std).

    rewards: (num_groups, G) or (B,) with ``group_size``. Returns advantages in rewards' shape.
    """
    return group_normalized_advantages(rewards, group_size, scale_by_std=False)


def rloo_advantages(rewards: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, Metrics]:
    """RLOO: ``A_i = r_i - mean_{j != i} r_j`` (leave-one-out baseline; equals G/(G-1) (r_i - mean)).

    rewards: (num_groups, G) or (B,) with ``group_size``. Returns advantages in rewards' shape.
    """
    grouped = _grouped(rewards, group_size)
    flat, metrics = _zero_variance(grouped)
    num_others = grouped.shape[1] - 1
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / num_others
    advantages = torch.where(flat, 0.0, grouped - baseline)
    return advantages.view(rewards.shape), metrics


def batch_normalized_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    *,
    std_eps: float = 1e-6,
) -> tuple[torch.Tensor, Metrics]:
    """Whole-batch normalisation: ``A_i = (r_i - mean(batch)) / (std(batch) + std_eps)``.

    The baseline ignores the groups, so a zero-variance group still gets non-zero advantages (its
    reward is compared with the batch); only a constant batch gives all zeros. The zero-variance
    metrics are still computed over the groups, for monitoring. A flat (B,) batch without
    ``group_size`` counts as a single group.
    """
    if std_eps < 0:
        raise ValueError(f"std_eps must be >= 0, got {std_eps}")
    if rewards.dim() == 1 and group_size is None:
        group_size = rewards.numel()
    grouped = _grouped(rewards, group_size)
    _, metrics = _zero_variance(grouped)
    everything = grouped.reshape(-1)
    constant = everything.amax() == everything.amin()
    normalized = (everything - everything.mean()) / (everything.std() + std_eps)
    advantages = torch.where(constant, 0.0, normalized)  # discards 0/0 for a constant batch
    return advantages.view(rewards.shape), metrics


ADVANTAGES: dict[str, Callable[..., tuple[torch.Tensor, Metrics]]] = {
    "group_norm": group_normalized_advantages,  # GRPO
    "group_mean": group_mean_advantages,  # Dr. GRPO
    "rloo": rloo_advantages,
    "batch_norm": batch_normalized_advantages,
}
# The estimators that divide by a std and so take ``std_eps``; the others take no option.
STD_NORMALISED = frozenset({"group_norm", "batch_norm"})


def compute_advantages(
    name: str, rewards: torch.Tensor, group_size: int | None = None, **options
) -> tuple[torch.Tensor, Metrics]:
    """Look up ``name`` in ``ADVANTAGES`` and call it; ``options`` go to the estimator."""
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(ADVANTAGES)}")
    return ADVANTAGES[name](rewards, group_size, **options)


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over tokens, for PPO.

    rewards, values, mask: (B, T). ``rewards[b, t]`` is the reward received after emitting token t
    (typically 0 everywhere except the last response token, minus any per-token KL penalty).
    ``values[b, t]`` is V(s_t), the critic's estimate before emitting token t.

    Walking t backwards over the *valid* tokens of each row:
        delta_t = r_t + gamma * V(next valid token) - V_t
        A_t     = delta_t + gamma * lam * A(next valid token)
    with V = A = 0 after the last valid token (the episode ends there: no bootstrap). Masked
    positions get A = returns = 0 and are skipped, so padding on either side and holes inside a
    row (e.g. tool output) are handled; rewards placed on masked positions are ignored.

    Returns ``(advantages, returns)``, both (B, T), with ``returns = advantages + values`` on
    valid tokens (the critic's regression target).
    """
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError(
            "gae needs rewards, values and mask of the same (B, T) shape, got "
            f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    valid = mask.bool()
    rewards = rewards.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = delta + gamma * lam * next_advantage
        here = valid[:, t]
        advantages[:, t] = torch.where(here, advantage_t, 0.0)
        next_value = torch.where(here, values[:, t], next_value)
        next_advantage = torch.where(here, advantage_t, next_advantage)
    returns = torch.where(valid, advantages + values, 0.0)
    return advantages, returns


@torch.no_grad()
def whiten_advantages(advantages: torch.Tensor, mask: torch.Tensor, *, std_eps: float = 1e-8) -> torch.Tensor:
    """``(A - mean) / (std + std_eps)`` over the valid tokens (sample std); 0 at masked positions.

    advantages, mask: (B, T). The usual PPO step after ``gae`` (over the local batch).
    """
    if advantages.shape != mask.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} and mask {tuple(mask.shape)} must match")
    valid = mask.bool()
    weights = valid.to(advantages.dtype)
    num_tokens = weights.sum()
    mean = masked_mean(advantages, weights)
    centred = torch.where(valid, advantages - mean, 0.0)
    std = (masked_sum(centred**2, weights) / (num_tokens - 1).clamp(min=1)).sqrt()
    return torch.where(valid, centred / (std + std_eps), 0.0)
