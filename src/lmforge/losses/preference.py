"""Preference losses as pure functions: sequence log-probabilities in, ``(loss, metrics)`` out.

A pair is a prompt x with a chosen completion y_w and a rejected one y_l. Every input here is per
pair, shape (B,): ``chosen_logps`` = log pi(y_w | x) summed over y_w's trained tokens, ``ref_*`` the
same under the frozen reference, ``chosen_lens`` / ``rejected_lens`` the number of those tokens.
Each variant returns three (B,) tensors: the per-pair loss and the implicit rewards r_w, r_l whose
difference the loss pushes up (reported as ``rewards_chosen`` / ``rewards_rejected``).
:func:`preference_loss` sums the per-pair losses and divides by ``num_pairs_global``, the pairs of
the whole optimizer step over all micro-batches and ranks, so summing its result over the step's
micro-batches and ranks gives the mean over the step's pairs, whatever the split. Metrics are divided
by the same count (their sums over the step are means) and detached. The math, and when to use
which: docs/preference.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
Metrics = dict[str, Tensor]


def dpo_sigmoid(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    chosen_lens: Tensor,
    rejected_lens: Tensor,
    *,
    beta: float,
    label_smoothing: float,
    gamma: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """DPO (Rafailov et al. 2023): r = beta * (log pi(y|x) - log pi_ref(y|x)), sums over tokens;
    loss = -(1 - eps) log sigmoid(r_w - r_l) - eps log sigmoid(r_l - r_w) with eps = label_smoothing
    (conservative DPO: the label is wrong with probability eps). All (B,); lens and gamma unused."""
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps)
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps)
    margin = chosen_rewards - rejected_rewards
    losses = -(1.0 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
    return losses, chosen_rewards, rejected_rewards


def ipo(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    chosen_lens: Tensor,
    rejected_lens: Tensor,
    *,
    beta: float,
    label_smoothing: float,
    gamma: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """IPO (Azar et al. 2023): h = rho_w - rho_l with rho = (log pi(y|x) - log pi_ref(y|x)) / |y|,
    the log-ratio per token; loss = (h - 1 / (2 beta))^2, a regression of the margin onto a fixed
    target instead of pushing it to infinity. The paper writes sums; the per-token mean is what its
    authors advised for sequences (and TRL's ``ipo`` does the same). Rewards: beta * rho. All (B,)."""
    chosen_ratio = (chosen_logps - ref_chosen_logps) / chosen_lens.clamp(min=1)
    rejected_ratio = (rejected_logps - ref_rejected_logps) / rejected_lens.clamp(min=1)
    losses = (chosen_ratio - rejected_ratio - 1.0 / (2.0 * beta)) ** 2
    return losses, beta * chosen_ratio, beta * rejected_ratio


def simpo(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    chosen_lens: Tensor,
    rejected_lens: Tensor,
    *,
    beta: float,
    label_smoothing: float,
    gamma: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """SimPO (Meng et al. 2024), reference-free: r = beta * log pi(y|x) / |y| (the mean token
    log-probability); loss = -log sigmoid(r_w - r_l - gamma), gamma the target margin. The ref
    inputs are ignored (may be None). All (B,)."""
    chosen_rewards = beta * chosen_logps / chosen_lens.clamp(min=1)
    rejected_rewards = beta * rejected_logps / rejected_lens.clamp(min=1)
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma)
    return losses, chosen_rewards, rejected_rewards


PREFERENCE_LOSSES = {"sigmoid": dpo_sigmoid, "ipo": ipo, "simpo": simpo}
REFERENCE_FREE = {"simpo"}  # variants that need no reference model


def check_settings(loss_type: str, beta: float, label_smoothing: float, gamma: float) -> None:
    """ValueError naming what is wrong with a variant's settings."""
    if loss_type not in PREFERENCE_LOSSES:
        raise ValueError(f"unknown preference loss {loss_type!r}; valid: {', '.join(PREFERENCE_LOSSES)}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(
            f"label_smoothing must be in [0, 0.5) (the probability that a label is flipped), got {label_smoothing}"
        )
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError(f"label_smoothing is defined for the 'sigmoid' (DPO) loss only, not {loss_type!r}")
    if gamma and loss_type != "simpo":
        raise ValueError(f"gamma (the target reward margin) is defined for 'simpo' only, not {loss_type!r}")


def preference_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    chosen_lens: Tensor,
    rejected_lens: Tensor,
    ref_chosen_logps: Tensor | None = None,
    ref_rejected_logps: Tensor | None = None,
    *,
    loss_type: str,
    beta: float,
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
    nll_coef: float = 0.0,
    num_pairs_global: int | Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """``sum_i (loss_i + nll_coef * nll_i) / num_pairs_global`` for the variant ``loss_type`` (a key
    of PREFERENCE_LOSSES), with nll_i = -log pi(y_w|x) / |y_w| the chosen completion's mean token
    NLL (RPO, Pang et al. 2024: keeps the chosen answers likely while the margin grows).

    Every tensor is (B,) (see the module doc); ``num_pairs_global`` defaults to B. Metrics, each a
    sum over this batch's pairs divided by ``num_pairs_global``: ``rewards_chosen``,
    ``rewards_rejected``, ``reward_margin`` (r_w - r_l), ``reward_accuracy`` (the fraction with
    r_w > r_l strictly: a tie, as at the start of DPO where policy = reference, is not a win) and
    ``nll_chosen``.
    """
    check_settings(loss_type, beta, label_smoothing, gamma)
    if nll_coef < 0:
        raise ValueError(f"nll_coef must be >= 0, got {nll_coef}")
    shape = chosen_logps.shape
    given = [chosen_logps, rejected_logps, chosen_lens, rejected_lens]
    if loss_type not in REFERENCE_FREE:
        if ref_chosen_logps is None or ref_rejected_logps is None:
            raise ValueError(
                f"the {loss_type!r} loss needs the reference log-probabilities ref_chosen_logps and "
                "ref_rejected_logps (only 'simpo' is reference-free)"
            )
        given += [ref_chosen_logps, ref_rejected_logps]
    if len(shape) != 1 or any(t.shape != shape for t in given):
        raise ValueError(f"every input must be one value per pair, shape (B,); got {[tuple(t.shape) for t in given]}")
    losses, chosen_rewards, rejected_rewards = PREFERENCE_LOSSES[loss_type](
        chosen_logps,
        rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        chosen_lens,
        rejected_lens,
        beta=beta,
        label_smoothing=label_smoothing,
        gamma=gamma,
    )
    nll = -chosen_logps / chosen_lens.clamp(min=1)
    if nll_coef:
        losses = losses + nll_coef * nll
    num_pairs = shape[0] if num_pairs_global is None else num_pairs_global
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    metrics = {
        "rewards_chosen": chosen_rewards.sum() / num_pairs,
        "rewards_rejected": rejected_rewards.sum() / num_pairs,
        "reward_margin": (chosen_rewards - rejected_rewards).sum() / num_pairs,
        "reward_accuracy": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype).sum() / num_pairs,
        "nll_chosen": nll.detach().sum() / num_pairs,
    }
    return losses.sum() / num_pairs, metrics


def sequence_logps(token_logprobs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(B, T) per-token log-probabilities and trained mask -> (sums (B,), token counts (B,)).
    Padding may hold anything (it is selected away, never multiplied: -inf * 0 would be NaN)."""
    valid = mask.bool()
    return torch.where(valid, token_logprobs, 0.0).sum(-1), valid.sum(-1)
