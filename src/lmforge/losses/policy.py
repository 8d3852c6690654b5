"""Losses as pure functions: tensors in, ``(loss, metrics)`` out.

Metrics are detached tensors; no ``.item()``, no collectives, no config objects in here: the
policy loss takes its hyperparameters as one small frozen ``PolicyLossSpec`` defined below.
Normalisation is explicit: callers pass the number of loss tokens summed over all micro-batches
of the optimizer step (and over ranks) (one frozen ``Counts``), so accumulation never changes the loss.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from lmforge.core.ops import entropy_from_logits, masked_mean, masked_sum


def sft_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    num_loss_tokens: int | torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level cross-entropy, summed over this micro-batch and divided by the step's token count.

    logits: (N, V) logits at the N loss positions of this micro-batch (already shifted: logits[i]
        predicts targets[i]). targets: (N,) token ids.
    num_loss_tokens: loss tokens in the whole optimizer step (all micro-batches, all ranks).

    Summing these per-micro-batch losses over the step gives the mean NLL per token of the step,
    exactly as if all rows had been one batch.
    """
    nll_sum = F.cross_entropy(logits.float(), targets, reduction="sum")
    loss = nll_sum / num_loss_tokens
    return loss, {"nll_sum": nll_sum.detach(), "num_tokens": torch.tensor(targets.numel())}


# --------------------------------------------------------------------------------------------
# RL losses. Shapes: B = sequences in this micro-batch, T = padded response length.
# logprobs, old_logprobs, ref_logprobs, rollout_logprobs, mask: (B, T); mask is 1 on response
# tokens that carry loss and 0 on padding. Policy-loss variants return *per-token* losses (B, T),
# zero at padding, plus metrics; ``aggregate`` turns per-token terms into the scalar to minimise.
# Every per-token term (policy, KL, entropy, value) goes through the same aggregation.
# --------------------------------------------------------------------------------------------

Metrics = dict[str, torch.Tensor]

GSPO_EPS_LOW = 3e-4  # GSPO paper (Zheng et al. 2025) sequence-ratio clip range
GSPO_EPS_HIGH = 4e-4


def _lookup(registry: dict, name: str, what: str):
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; valid: {', '.join(registry)}")
    return registry[name]


def _check_policy_inputs(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
) -> torch.Tensor:
    """Validate shapes and clip settings; return the bool mask."""
    if logprobs.dim() != 2 or logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            "logprobs, old_logprobs and mask must share one (B, T) shape, got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages must be (B,) per sequence or (B, T) per token with (B, T) = "
            f"{tuple(logprobs.shape)}, got {tuple(advantages.shape)}"
        )
    if not (0.0 <= eps_low < 1.0 and eps_high >= 0.0):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")
    return mask.bool()


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) or (B, T) advantages -> (B, T)."""
    return advantages.unsqueeze(-1).expand_as(like) if advantages.dim() == 1 else advantages


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Elementwise PPO loss ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)``, for either sign of A.

    With ``dual_clip = c > 1`` the loss for A < 0 is additionally capped at ``c |A|`` (reached when
    r > c), i.e. the objective becomes ``max(min(rA, clip(r) A), c A)`` for A < 0.
    Returns the loss and bool flags of the elements whose gradient a clip switched off.
    """
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = torch.maximum(unclipped, clipped)  # = -min(rA, clip(r)A)
    flags = {
        "clip_frac_low": (ratio < 1.0 - eps_low) & (advantages < 0),
        "clip_frac_high": (ratio > 1.0 + eps_high) & (advantages > 0),
    }
    if dual_clip is not None:
        negative = advantages < 0
        loss = torch.where(negative, torch.minimum(loss, -dual_clip * advantages), loss)
        flags["dual_clip_frac"] = negative & (ratio > dual_clip)
    return loss, flags


def _ratio_metrics(ratio: torch.Tensor, flags: dict[str, torch.Tensor], valid: torch.Tensor) -> Metrics:
    """Masked clip fractions and ratio mean/min/max, all detached."""
    ratio = ratio.detach()
    weights = valid.to(ratio.dtype)
    metrics = {name: masked_mean(flag.to(ratio.dtype), weights) for name, flag in flags.items()}
    metrics["ratio_mean"] = masked_mean(ratio, weights)
    metrics["ratio_min"] = torch.where(valid, ratio, torch.inf).amin()
    metrics["ratio_max"] = torch.where(valid, ratio, -torch.inf).amax()
    return metrics


def _log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, valid: torch.Tensor):
    """logprobs - old_logprobs, 0 at padding (so padded -inf/NaN never reach exp or backward)."""
    return torch.where(valid, logprobs - old_logprobs, 0.0)


def token_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO/GRPO token-level clipped surrogate. Returns per-token losses (B, T), 0 at padding.

    r_t = exp(logprobs - old_logprobs); loss_t = -min(r_t A_t, clip(r_t, 1-eps_low, 1+eps_high) A_t).
    eps_high > eps_low is DAPO's clip-higher. advantages: (B,) or (B, T).
    """
    valid = _check_policy_inputs(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, dual_clip)
    ratio = torch.exp(_log_ratio(logprobs, old_logprobs, valid))
    loss, flags = _clipped_surrogate(ratio, _per_token(advantages, logprobs), eps_low, eps_high, dual_clip)
    return torch.where(valid, loss, 0.0), _ratio_metrics(ratio, flags, valid)


def _sequence_log_ratio(logprobs, old_logprobs, valid) -> torch.Tensor:
    """(B, T) -> (B,) mean over valid tokens of logprobs - old_logprobs (0 for an empty row)."""
    return masked_mean(_log_ratio(logprobs, old_logprobs, valid), valid.to(logprobs.dtype), dim=-1)


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = GSPO_EPS_LOW,
    eps_high: float = GSPO_EPS_HIGH,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO: clip the length-normalised sequence ratio ``s_i = exp(mean_t(logprobs - old_logprobs))``.

    loss_i = -min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i), advantages: (B,) only.
    Returned per token as loss_i on each valid token of row i, so that the ``seq_mean_token_mean``
    aggregation gives the paper's mean over sequences. Metrics are over non-empty sequences.
    """
    valid = _check_policy_inputs(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, dual_clip)
    if advantages.dim() != 1:
        raise ValueError("gspo needs one advantage per sequence, shape (B,); for per-token advantages use 'gspo_token'")
    seq_ratio = torch.exp(_sequence_log_ratio(logprobs, old_logprobs, valid))  # (B,)
    loss, flags = _clipped_surrogate(seq_ratio, advantages, eps_low, eps_high, dual_clip)
    token_losses = torch.where(valid, loss.unsqueeze(-1), 0.0)
    return token_losses, _ratio_metrics(seq_ratio, flags, valid.any(dim=-1))


def gspo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = GSPO_EPS_LOW,
    eps_high: float = GSPO_EPS_HIGH,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO-token: per-token ratio ``s_it = sg[s_i] * p_t / sg[p_t]`` with per-token advantages.

    s_it equals s_i in value; its gradient is s_i * grad log p_t. Equal to ``gspo`` (values and
    gradients, under ``seq_mean_token_mean``) when A is constant within each sequence.
    advantages: (B,) or (B, T). Returns per-token losses (B, T), 0 at padding.
    """
    valid = _check_policy_inputs(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, dual_clip)
    seq_ratio = torch.exp(_sequence_log_ratio(logprobs, old_logprobs, valid)).detach()
    self_ratio = torch.exp(_log_ratio(logprobs, logprobs.detach(), valid))  # 1, gradient grad log p
    ratio = seq_ratio.unsqueeze(-1) * self_ratio
    loss, flags = _clipped_surrogate(ratio, _per_token(advantages, logprobs), eps_low, eps_high, dual_clip)
    return torch.where(valid, loss, 0.0), _ratio_metrics(ratio, flags, valid)


POLICY_LOSSES = {
    "token_clip": token_clip_loss,
    "gspo": gspo_loss,
    "gspo_token": gspo_token_loss,
}


# ---- aggregation: per-token (B, T) -> scalar ------------------------------------------------
# Counts ending in _global are summed over every micro-batch of the optimizer step and over all
# ranks, once per step, by the caller. With them, summing the per-micro-batch losses reproduces
# the full-batch loss exactly. Each mode reads only the counts it needs.


@dataclasses.dataclass(frozen=True)
class Counts:
    """The counts that normalise an aggregated loss, one value for a whole optimizer update (built by
    the caller once per update: ``lmforge.rl.updates.Updates``). None: not known, where a mode has a
    default (this micro-batch's B, one micro-batch); a mode that needs a count raises without it."""

    num_seqs_global: int | torch.Tensor | None = None  # rows of the update, all micro-batches and ranks
    num_loss_tokens_global: int | torch.Tensor | None = None  # trained tokens of the update, likewise
    max_completion_len: int | None = None  # the generation budget (max new tokens), a constant
    num_micro_batches_global: int | None = None  # micro-batches of the update, all ranks


def seq_mean_token_mean(token_losses, mask, counts: Counts) -> torch.Tensor:
    """GRPO paper: mean over tokens within each sequence, then sum / num_seqs_global.

    num_seqs_global defaults to this batch's B (rows with an empty mask count, contributing 0).
    """
    weights = mask.to(token_losses.dtype)
    num_seqs = token_losses.shape[0] if counts.num_seqs_global is None else counts.num_seqs_global
    return masked_mean(token_losses, weights, dim=-1).sum() / num_seqs


def token_mean(token_losses, mask, counts: Counts) -> torch.Tensor:
    """Local token mean (BNPO): each micro-batch's mean over its own valid tokens, averaged over the
    step's micro-batches on all ranks (num_micro_batches_global, default 1), so the step's loss does
    not grow with the number of micro-batches or ranks."""
    num_micro = 1 if counts.num_micro_batches_global is None else counts.num_micro_batches_global
    return masked_mean(token_losses, mask.to(token_losses.dtype)) / num_micro


def global_token_mean(token_losses, mask, counts: Counts) -> torch.Tensor:
    """DAPO: sum over valid tokens / num_loss_tokens_global (the step's tokens, all ranks)."""
    if counts.num_loss_tokens_global is None:
        raise ValueError(
            "aggregation 'global_token_mean' needs num_loss_tokens_global: the number of loss "
            "tokens summed over all micro-batches and ranks of the optimizer step"
        )
    return masked_sum(token_losses, mask.to(token_losses.dtype)) / counts.num_loss_tokens_global


def seq_sum_max_len(token_losses, mask, counts: Counts) -> torch.Tensor:
    """Dr. GRPO: sum over valid tokens / (num_seqs_global * max_completion_len).

    max_completion_len is the generation budget (a constant), not this batch's padded length, so
    it is required; num_seqs_global defaults to this batch's B.
    """
    if counts.max_completion_len is None:
        raise ValueError(
            "aggregation 'seq_sum_max_len' needs max_completion_len: the generation budget "
            "(max new tokens), the same constant for every micro-batch"
        )
    num_seqs = token_losses.shape[0] if counts.num_seqs_global is None else counts.num_seqs_global
    total = masked_sum(token_losses, mask.to(token_losses.dtype))
    return total / (num_seqs * counts.max_completion_len)


AGGREGATIONS = {
    "seq_mean_token_mean": seq_mean_token_mean,
    "token_mean": token_mean,
    "global_token_mean": global_token_mean,
    "seq_sum_max_len": seq_sum_max_len,
}


def aggregate(
    token_losses: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    counts: Counts = Counts(),
) -> torch.Tensor:
    """Reduce per-token values (B, T) with the aggregation ``mode`` (a key of ``AGGREGATIONS``),
    normalised by the update's ``counts``."""
    if token_losses.shape != mask.shape:
        raise ValueError(f"token_losses {tuple(token_losses.shape)} and mask {tuple(mask.shape)} must match")
    return _lookup(AGGREGATIONS, mode, "aggregation")(token_losses, mask, counts)


# ---- KL to a reference policy -------------------------------------------------------------
# Estimators of KL(pi || pi_ref) from tokens sampled from pi, as functions of
# log_ratio = logprobs - ref_logprobs. Gradients wrt logprobs: k1 -> 1, k2 -> log_ratio,
# k3 -> 1 - p_ref / p.


def kl_k1(log_ratio: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref_logp (unbiased for KL, high variance, can be negative)."""
    return log_ratio


def kl_k2(log_ratio: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 (logp - ref_logp)^2 (biased, low variance, >= 0)."""
    return 0.5 * log_ratio**2


def kl_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1 (unbiased, >= 0). expm1 for precision."""
    return torch.expm1(-log_ratio) + log_ratio


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_per_token(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    estimator: str = "k3",
) -> torch.Tensor:
    """Per-token KL estimate (B, T) of the policy to the reference, 0 at padding."""
    if not (logprobs.shape == ref_logprobs.shape == mask.shape):
        raise ValueError(
            "logprobs, ref_logprobs and mask must share one (B, T) shape, got "
            f"{tuple(logprobs.shape)}, {tuple(ref_logprobs.shape)}, {tuple(mask.shape)}"
        )
    estimate = _lookup(KL_ESTIMATORS, estimator, "KL estimator")
    valid = mask.bool()
    return torch.where(valid, estimate(_log_ratio(logprobs, ref_logprobs, valid)), 0.0)


# ---- entropy bonus and PPO value loss -----------------------------------------------------


def entropy_bonus(
    mask: torch.Tensor,
    *,
    aggregation: str,
    logits: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    counts: Counts = Counts(),
) -> tuple[torch.Tensor, Metrics]:
    """Loss ``-aggregate(H_t)``: adding ``coef * loss`` to the objective raises the entropy.

    Give exactly one of ``logits`` (B, T, V) -- already divided by the sampling temperature -- or a
    precomputed per-token ``entropy`` (B, T). mask: (B, T).
    """
    if (logits is None) == (entropy is None):
        raise ValueError("entropy_bonus needs exactly one of logits (B, T, V) or entropy (B, T)")
    if entropy is None:
        entropy = entropy_from_logits(logits)
    mean_entropy = aggregate(entropy, mask, aggregation, counts)
    return -mean_entropy, {"entropy": mean_entropy.detach()}


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregation: str,
    old_values: torch.Tensor | None = None,
    clip_eps: float | None = None,
    counts: Counts = Counts(),
) -> tuple[torch.Tensor, Metrics]:
    """PPO critic loss, per token ``0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)``.

    values (current critic), returns (GAE targets), old_values (critic at rollout time), mask:
    (B, T). ``clip_eps=None`` gives the unclipped ``0.5 (V - R)^2``.
    """
    if not (values.shape == returns.shape == mask.shape):
        raise ValueError(
            "values, returns and mask must share one (B, T) shape, got "
            f"{tuple(values.shape)}, {tuple(returns.shape)}, {tuple(mask.shape)}"
        )
    valid = mask.bool()
    error = torch.where(valid, values - returns, 0.0)
    squared = error**2
    metrics: Metrics = {}
    if clip_eps is not None:
        if old_values is None or old_values.shape != values.shape:
            raise ValueError("value clipping (clip_eps) needs old_values shaped like values")
        if clip_eps <= 0:
            raise ValueError(f"clip_eps must be > 0 (or None to disable), got {clip_eps}")
        clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        clipped_squared = torch.where(valid, clipped - returns, 0.0) ** 2
        metrics["value_clip_frac"] = masked_mean(
            (clipped_squared > squared).to(values.dtype), valid.to(values.dtype)
        ).detach()
        squared = torch.maximum(squared, clipped_squared)
    loss = aggregate(0.5 * squared, mask, aggregation, counts)
    metrics["value_loss"] = loss.detach()
    metrics["value_mean"] = masked_mean(values, valid.to(values.dtype)).detach()
    return loss, metrics


# ---- the rollout engine vs the trainer: truncated importance sampling ---------------------
# old_logprobs are recomputed by the trainer; rollout_logprobs were reported by the inference
# engine that sampled. They differ through kernels, precision and (if misconfigured) temperature.
# The weight min(pi_old / pi_rollout, cap) corrects the policy-gradient for sampling from the
# engine's distribution; it is detached (a constant per token).


def _token_log_weights(log_ratio: torch.Tensor) -> torch.Tensor:
    """One weight per token: log(pi_old(y_t) / pi_rollout(y_t))."""
    return log_ratio


def _sequence_log_weights(log_ratio: torch.Tensor) -> torch.Tensor:
    """One weight per sequence: the product of its token ratios (padding holds log-ratio 0)."""
    return log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)


IS_LEVELS = {"token": _token_log_weights, "sequence": _sequence_log_weights}


def truncated_is_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    level: str = "token",
    cap: float = 2.0,
) -> torch.Tensor:
    """Detached weights (B, T) ``min(exp(log_w), cap)``, 0 at padding.

    level "token": log_w = old_logprobs - rollout_logprobs per token. level "sequence":
    log_w = sum over the sequence's valid tokens (exp of the *sum*, i.e. the product of token ratios),
    broadcast to its tokens. The cap is applied in log space, so long sequences cannot overflow.
    """
    if rollout_logprobs is None:
        raise ValueError(
            "truncated importance sampling needs rollout_logprobs: the per-token logprobs the "
            "inference engine reported when it sampled the completions; store them in the "
            "rollout, or turn importance sampling off"
        )
    if not (old_logprobs.shape == rollout_logprobs.shape == mask.shape):
        raise ValueError(
            "old_logprobs, rollout_logprobs and mask must share one (B, T) shape, got "
            f"{tuple(old_logprobs.shape)}, {tuple(rollout_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if cap <= 0:
        raise ValueError(f"the importance-weight cap must be > 0, got {cap}")
    log_weights_fn = _lookup(IS_LEVELS, level, "importance-sampling level")
    valid = mask.bool()
    log_ratio = _log_ratio(old_logprobs.detach(), rollout_logprobs.detach(), valid)
    log_weights = log_weights_fn(log_ratio).clamp(max=math.log(cap))
    return torch.where(valid, torch.exp(log_weights), 0.0)


@torch.no_grad()
def logprob_alignment_metrics(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    ratio_low: float = 0.5,
    ratio_high: float = 2.0,
) -> Metrics:
    """How far the trainer's logprobs (B, T) are from the engine's, over the mask.

    diff = logprobs - rollout_logprobs, ratio = exp(diff). Reports mean diff, mean |diff|,
    max |diff|, mean ratio, the fractions of tokens with ratio < ratio_low / > ratio_high, and
    the k3 estimate of KL(rollout || trainer).
    """
    if not (logprobs.shape == rollout_logprobs.shape == mask.shape):
        raise ValueError(
            "logprobs, rollout_logprobs and mask must share one (B, T) shape, got "
            f"{tuple(logprobs.shape)}, {tuple(rollout_logprobs.shape)}, {tuple(mask.shape)}"
        )
    valid = mask.bool()
    weights = valid.to(logprobs.dtype)
    diff = _log_ratio(logprobs, rollout_logprobs, valid)
    ratio = torch.exp(diff)
    return {
        "rollout_diff_mean": masked_mean(diff, weights),
        "rollout_diff_abs_mean": masked_mean(diff.abs(), weights),
        "rollout_diff_abs_max": diff.abs().amax(),  # padding holds 0, which never wins
        "rollout_ratio_mean": masked_mean(ratio, weights),
        "rollout_ratio_frac_low": masked_mean((ratio < ratio_low).to(weights.dtype), weights),
        "rollout_ratio_frac_high": masked_mean((ratio > ratio_high).to(weights.dtype), weights),
        "rollout_kl_k3": masked_mean(kl_k3(-diff), weights),
    }


# ---- the composed policy loss -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PolicyLossSpec:
    """The hyperparameters of :func:`policy_loss`, fixed for a run (built once from the resolved algo
    section: ``lmforge.rl.config.policy_spec``).

    loss_type: a key of ``POLICY_LOSSES``; aggregation: a key of ``AGGREGATIONS``; eps_low / eps_high:
    the clip range; dual_clip: None (off) or c > 1; is_level: None (off) or a key of ``IS_LEVELS``,
    with the weight cap is_cap; kl_coef and kl_estimator (a key of ``KL_ESTIMATORS``): the KL term to
    the reference; entropy_coef: the entropy bonus's weight.
    """

    loss_type: str
    aggregation: str
    eps_low: float
    eps_high: float
    dual_clip: float | None = None
    is_level: str | None = None
    is_cap: float = 2.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    spec: PolicyLossSpec,
    counts: Counts = Counts(),
    *,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """``aggregate(w * policy_term) + kl_coef * aggregate(kl) - entropy_coef * aggregate(H)``.

    ``spec``: the loss's hyperparameters; ``counts``: the update's aggregation counts. With
    ``spec.is_level`` set, w = ``truncated_is_weights(old_logprobs, rollout_logprobs)``, else 1.
    Shapes: (B, T) for every per-token tensor (``entropy`` precomputed per token), advantages (B,)
    or (B, T). KL / entropy / rollout-alignment metrics are reported whenever their inputs are given.
    """
    term_fn = _lookup(POLICY_LOSSES, spec.loss_type, "policy loss")
    token_losses, metrics = term_fn(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        eps_low=spec.eps_low,
        eps_high=spec.eps_high,
        dual_clip=spec.dual_clip,
    )
    if spec.is_level is not None:
        weights = truncated_is_weights(old_logprobs, rollout_logprobs, mask, level=spec.is_level, cap=spec.is_cap)
        token_losses = token_losses * weights
        metrics["is_weight_mean"] = masked_mean(weights, mask.to(weights.dtype))
        metrics["is_weight_max"] = weights.amax()  # padding holds 0
        # truncated weights sit at the cap (up to the rounding of exp(log(cap)))
        capped = (weights >= spec.is_cap * (1 - 1e-6)) & mask.bool()
        metrics["is_weight_clip_frac"] = masked_mean(capped.to(weights.dtype), mask.to(weights.dtype))
    if rollout_logprobs is not None:
        metrics.update(logprob_alignment_metrics(old_logprobs, rollout_logprobs, mask, ratio_high=spec.is_cap))
    loss = aggregate(token_losses, mask, spec.aggregation, counts)
    metrics["pg_loss"] = loss.detach()

    if spec.kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef != 0 needs ref_logprobs (the reference model's logprobs)")
    if ref_logprobs is not None:
        kl = aggregate(
            kl_per_token(logprobs, ref_logprobs, mask, estimator=spec.kl_estimator),
            mask,
            spec.aggregation,
            counts,
        )
        loss = loss + spec.kl_coef * kl
        metrics["kl"] = kl.detach()

    if spec.entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs the per-token entropy (B, T)")
    if entropy is not None:
        entropy_loss, entropy_metrics = entropy_bonus(
            mask, aggregation=spec.aggregation, entropy=entropy, counts=counts
        )
        loss = loss + spec.entropy_coef * entropy_loss
        metrics.update(entropy_metrics)
    return loss, metrics
