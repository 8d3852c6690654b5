"""Distillation losses (``lmforge distill``): pure functions, tensors in, ``(loss, metrics)`` out.

Two ways to pull a student towards a teacher that shares its tokenizer (docs/distillation.md):

- ``reverse_kl``: on-policy distillation (GKD, Agarwal et al. 2024; the per-token reverse-KL reward of
  "on-policy distillation", Thinking Machines 2025). The student samples; the teacher scores each
  sampled token; the per-token signal ``log p_student(y_t) - log p_teacher(y_t)`` is a negative
  reward (an advantage ``teacher - student`` per token) in the policy-gradient loss of
  ``losses.policy_loss``. Its loss value, on-policy, is the sampled estimate (k1) of the per-token
  reverse KL ``KL(student || teacher)``.
- ``full_reverse_kl``: the same on-policy rows, but at each sampled prefix the exact reverse KL over the
  whole vocabulary (GKD's on-policy reverse KL): no sampling noise per position, (N, V) teacher logits.
- ``forward_kl``: logit distillation on fixed data (Hinton et al. 2015): at every loss position, the
  full-vocabulary ``KL(teacher || student)`` of the temperature-softened distributions, times T^2.

Like ``losses``: metrics are detached tensors; no ``.item()``, no collectives, no config objects;
every count that normalises a loss is passed in by the caller (summed over micro-batches and ranks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmforge.core.ops import masked_mean
from lmforge.losses.policy import Counts, Metrics, PolicyLossSpec, policy_loss


def reverse_kl_advantages(
    old_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    reward_advantages: torch.Tensor | None = None,
    reward_weight: float = 0.0,
) -> tuple[torch.Tensor, Metrics]:
    """Per-token advantages (B, T) of on-policy distillation, 0 at padding, and metrics.

    A_t = (teacher_logprobs_t - old_logprobs_t) + reward_weight * reward_advantages_i: the negative
    per-token reverse-KL signal of the sampled token y_t (old_logprobs: the student when it sampled,
    teacher_logprobs: the teacher's log-probability of the same token), plus, optionally, a task
    reward's per-sequence advantage (B,) broadcast over the row's tokens. Each token's signal is its
    own (discount 0): a token is not credited with the divergence of the tokens after it.

    Shapes: old_logprobs, teacher_logprobs, mask (B, T); reward_advantages (B,) or None.
    Metric ``reverse_kl``: the mean over valid tokens of old - teacher, the sampled (k1) estimate of
    KL(student || teacher) per token.
    """
    if not (old_logprobs.shape == teacher_logprobs.shape == mask.shape) or old_logprobs.dim() != 2:
        raise ValueError(
            "old_logprobs, teacher_logprobs and mask must share one (B, T) shape, got "
            f"{tuple(old_logprobs.shape)}, {tuple(teacher_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if reward_weight != 0.0 and reward_advantages is None:
        raise ValueError("reward_weight != 0 needs reward_advantages: one advantage per sequence, shape (B,)")
    valid = mask.bool()
    # padding may hold -inf or garbage in either tensor: it never enters the arithmetic
    signal = torch.where(valid, teacher_logprobs.detach() - old_logprobs.detach(), 0.0)
    advantages = signal
    if reward_advantages is not None and reward_weight != 0.0:
        if reward_advantages.shape != old_logprobs.shape[:1]:
            raise ValueError(
                f"reward_advantages must be (B,) = ({old_logprobs.shape[0]},), got {tuple(reward_advantages.shape)}"
            )
        advantages = torch.where(valid, signal + reward_weight * reward_advantages.detach()[:, None], 0.0)
    return advantages, {"reverse_kl": masked_mean(-signal, valid.to(signal.dtype))}


def reverse_kl_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    spec: PolicyLossSpec,
    counts: Counts = Counts(),
    *,
    reward_advantages: torch.Tensor | None = None,
    reward_weight: float = 0.0,
    rollout_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """On-policy distillation: ``losses.policy_loss`` with :func:`reverse_kl_advantages`.

    logprobs: (B, T) the student's log-probabilities of its sampled tokens, with gradient;
    old_logprobs: (B, T) the same at sampling time (``logprobs.detach()`` on-policy);
    teacher_logprobs: (B, T) the teacher's, no gradient; mask: (B, T) the trained tokens;
    reward_advantages: (B,) or None. ``spec`` and ``counts`` (the loss type, aggregation, clip range,
    importance weights; the update's global counts), ``rollout_logprobs`` and ``entropy`` (B, T) go to
    ``policy_loss`` as they are.

    On-policy (old = logprobs.detach(), ratio 1) each token's loss is ``old - teacher``, so with a
    token-mean aggregation the loss is the sampled reverse KL per token, and its gradient is
    ``(log p_student - log p_teacher) * grad log p_student`` per token: the policy gradient of the
    reverse KL with each token's own divergence as its (negative) reward.
    """
    advantages, metrics = reverse_kl_advantages(
        old_logprobs, teacher_logprobs, mask, reward_advantages=reward_advantages, reward_weight=reward_weight
    )
    loss, policy_metrics = policy_loss(
        logprobs, old_logprobs, advantages, mask, spec, counts, rollout_logprobs=rollout_logprobs, entropy=entropy
    )
    return loss, {**metrics, **policy_metrics}


def forward_kl_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    num_loss_tokens: int | torch.Tensor,
    *,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, Metrics]:
    """Logit distillation: ``T^2 * sum_n KL(softmax(t_n / T) || softmax(s_n / T)) / num_loss_tokens``.

    student_logits, teacher_logits: (N, V) at the N loss positions of this micro-batch (the teacher's
    without gradient). num_loss_tokens: loss tokens in the whole optimizer step (all micro-batches,
    all ranks), so the step's loss is the mean per token, as in ``losses.sft_loss``.

    The T^2 factor is the convention of Hinton et al. (2015): the gradient of the softened KL wrt a
    student logit is (q_T - p_T) / T, so T^2 keeps the gradient's size roughly independent of T
    (and comparable with a cross-entropy term). Metric ``kl_sum`` is the unscaled KL summed over the
    N positions (divide by the token count for the KL per token at temperature T).
    """
    if student_logits.dim() != 2 or student_logits.shape != teacher_logits.shape:
        raise ValueError(
            "student_logits and teacher_logits must share one (N, V) shape, got "
            f"{tuple(student_logits.shape)}, {tuple(teacher_logits.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"the distillation temperature must be > 0, got {temperature}")
    dtype = torch.promote_types(student_logits.dtype, torch.float32)  # bf16 / fp16 logits: the softmax in fp32
    student_logprobs = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    teacher_logprobs = torch.log_softmax(teacher_logits.detach().to(dtype) / temperature, dim=-1)
    # sum_v p_v (log p_v - log q_v); a teacher probability of exactly 0 contributes 0
    kl_sum = F.kl_div(student_logprobs, teacher_logprobs, log_target=True, reduction="sum")
    loss = temperature**2 * kl_sum / num_loss_tokens
    return loss, {"kl_sum": kl_sum.detach(), "num_tokens": torch.tensor(student_logits.shape[0])}


def full_reverse_kl_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    num_loss_tokens: int | torch.Tensor,
    *,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, Metrics]:
    """On-policy distillation with the exact per-position reverse KL (GKD with beta = 1):
    ``sum_n KL(softmax(s_n / T) || softmax(t_n / T)) / num_loss_tokens``.

    student_logits, teacher_logits: (N, V) at the N positions that predict the student's sampled tokens
    (the teacher's without gradient); T: the sampling temperature (the distribution the student sampled
    from), no T^2 factor, so the loss is the reverse KL per token. The sampled prefixes are the only
    randomness: at each position the full vocabulary is summed, where ``reverse_kl_loss`` uses the one
    token sampled there (same expected gradient, more variance, no (N, V) teacher logits).
    Metric ``kl_sum``: the KL summed over the N positions.
    """
    if student_logits.dim() != 2 or student_logits.shape != teacher_logits.shape:
        raise ValueError(
            "student_logits and teacher_logits must share one (N, V) shape, got "
            f"{tuple(student_logits.shape)}, {tuple(teacher_logits.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"the sampling temperature must be > 0, got {temperature}")
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    student_logprobs = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    teacher_logprobs = torch.log_softmax(teacher_logits.detach().to(dtype) / temperature, dim=-1)
    kl_sum = F.kl_div(teacher_logprobs, student_logprobs, log_target=True, reduction="sum")  # KL(student || teacher)
    return kl_sum / num_loss_tokens, {"kl_sum": kl_sum.detach(), "num_tokens": torch.tensor(student_logits.shape[0])}


# The loss of each kind of ``lmforge distill`` (recipes/distill.py: mode, and algo.signal for on_policy).
DISTILL_LOSSES = {
    "on_policy": reverse_kl_loss,  # the student's sampled tokens, the teacher's logprobs of them
    "on_policy_full": full_reverse_kl_loss,  # the student's sampled prefixes, both full distributions there
    "logit": forward_kl_loss,  # fixed data, full-vocabulary teacher distribution
}
