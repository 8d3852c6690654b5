"""Distillation losses: hand-derived values and gradients, and independent fp64 formulations
(exact KL sums written out with exp / sum, and the expected policy gradient over every token)."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.losses.distill import (
    DISTILL_LOSSES,
    forward_kl_loss,
    full_reverse_kl_loss,
    reverse_kl_advantages,
    reverse_kl_loss,
)
from lmforge.losses.policy import Counts, PolicyLossSpec

F64 = torch.float64
LN2, LN3 = math.log(2.0), math.log(3.0)
ON_POLICY = PolicyLossSpec(loss_type="token_clip", aggregation="global_token_mean", eps_low=0.2, eps_high=0.2)


def t(values):
    return torch.tensor(values, dtype=F64)


def close(actual, expected, atol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


# ---- forward KL at temperature (logit mode) -----------------------------------------------


def test_forward_kl_hand_values_t1():
    """Teacher uniform (1/2, 1/2), student (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3);
    d loss / d student logits = q - p = (-1/4, 1/4)."""
    student = t([[0.0, LN3]]).requires_grad_()
    loss, metrics = forward_kl_loss(student, t([[0.0, 0.0]]), 1, temperature=1.0)
    close(loss, 0.5 * math.log(4 / 3))
    close(metrics["kl_sum"], 0.5 * math.log(4 / 3))
    loss.backward()
    close(student.grad, [[-0.25, 0.25]])


def test_forward_kl_hand_values_t2_scaled_by_t_squared():
    """T = 2: student logits / 2 = (0, ln3 / 2), q = (1, sqrt3) / (1 + sqrt3); teacher uniform.
    KL = ln((1 + sqrt3) / 2) - ln3 / 4; loss = 4 KL / num_tokens; gradient T (q - p) / num_tokens."""
    s3 = math.sqrt(3.0)
    student = t([[0.0, LN3]]).requires_grad_()
    loss, metrics = forward_kl_loss(student, t([[5.0, 5.0]]), 2, temperature=2.0)  # shift: same teacher
    kl = math.log((1 + s3) / 2) - LN3 / 4
    close(metrics["kl_sum"], kl)
    close(loss, 4 * kl / 2)
    loss.backward()
    q = torch.tensor([1 / (1 + s3), s3 / (1 + s3)], dtype=F64)
    close(student.grad, (2.0 * (q - 0.5) / 2)[None])


def independent_forward_kl(student, teacher, temperature):
    """sum_n sum_v p log(p / q), written out with exp and sums, row by row, in fp64."""
    total = 0.0
    for s_row, t_row in zip(student.tolist(), teacher.tolist()):
        zs = [math.exp(v / temperature) for v in s_row]
        zt = [math.exp(v / temperature) for v in t_row]
        q = [z / sum(zs) for z in zs]
        p = [z / sum(zt) for z in zt]
        total += sum(pv * math.log(pv / qv) for pv, qv in zip(p, q))
    return total


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0, 4.0])
def test_forward_kl_matches_independent_fp64(temperature):
    g = torch.Generator().manual_seed(0)
    student, teacher = (torch.randn(7, 11, generator=g, dtype=F64) * 2 for _ in range(2))
    loss, metrics = forward_kl_loss(student, teacher, 13, temperature=temperature)
    expected = independent_forward_kl(student, teacher, temperature)
    close(metrics["kl_sum"], expected)
    close(loss, temperature**2 * expected / 13)


def test_forward_kl_gradient_is_t_times_q_minus_p_and_teacher_gets_none():
    g = torch.Generator().manual_seed(1)
    student = torch.randn(3, 5, generator=g, dtype=F64).requires_grad_()
    teacher = torch.randn(3, 5, generator=g, dtype=F64).requires_grad_()
    T = 3.0
    loss, _ = forward_kl_loss(student, teacher, 6, temperature=T)
    loss.backward()
    q, p = torch.softmax(student.detach() / T, -1), torch.softmax(teacher.detach() / T, -1)
    close(student.grad, T * (q - p) / 6)
    assert teacher.grad is None


def test_forward_kl_zero_when_equal_and_splits_over_micro_batches():
    logits = torch.randn(6, 9, dtype=F64)
    close(forward_kl_loss(logits, logits.clone(), 6, temperature=2.0)[0], 0.0)
    student, teacher = torch.randn(6, 9, dtype=F64), torch.randn(6, 9, dtype=F64)
    whole = forward_kl_loss(student, teacher, 6, temperature=2.0)[0]
    parts = sum(forward_kl_loss(student[i : i + 2], teacher[i : i + 2], 6, temperature=2.0)[0] for i in (0, 2, 4))
    close(parts, whole)


def test_forward_kl_bad_input():
    with pytest.raises(ValueError, match="share one"):
        forward_kl_loss(torch.zeros(2, 3), torch.zeros(2, 4), 2)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        forward_kl_loss(torch.zeros(2, 3), torch.zeros(2, 3), 2, temperature=0.0)


# ---- per-token reverse KL as a policy-gradient signal (on-policy mode) ----------------------


def test_reverse_kl_hand_values_and_gradient():
    """Student sampled two tokens with p = 1/2, 1/4; teacher gives them 1/4, 1/4. Advantages
    (teacher - student) = (-ln2, 0); on-policy loss per token = (ln2, 0), global token mean ln2 / 2;
    gradient wrt the student's logprobs (ln2 / 2, 0)."""
    old = t([[math.log(0.5), math.log(0.25)]])
    teacher = t([[math.log(0.25), math.log(0.25)]])
    mask = torch.ones(1, 2)
    logprobs = old.clone().requires_grad_()
    advantages, metrics = reverse_kl_advantages(old, teacher, mask)
    close(advantages, [[-LN2, 0.0]])
    close(metrics["reverse_kl"], LN2 / 2)
    loss, metrics = reverse_kl_loss(
        logprobs, logprobs.detach(), teacher, mask, ON_POLICY, Counts(num_loss_tokens_global=2)
    )
    close(loss, LN2 / 2)
    loss.backward()
    close(logprobs.grad, [[LN2 / 2, 0.0]])


def test_reverse_kl_with_task_reward():
    """reward_weight 0.5, sequence advantage 1: A = (-ln2 + 1/2, 1/2); loss = -(sum A) / 2."""
    old = t([[math.log(0.5), math.log(0.25)]])
    teacher = t([[math.log(0.25), math.log(0.25)]])
    logprobs = old.clone().requires_grad_()
    loss, _ = reverse_kl_loss(
        logprobs,
        old,
        teacher,
        torch.ones(1, 2),
        reward_advantages=t([1.0]),
        reward_weight=0.5,
        spec=ON_POLICY,
        counts=Counts(num_loss_tokens_global=2),
    )
    close(loss, (LN2 - 1.0) / 2)
    loss.backward()
    close(logprobs.grad, [[(LN2 - 0.5) / 2, -0.25]])


def test_reverse_kl_padding_never_reaches_the_loss():
    """-inf / NaN at padding (a teacher's logprob of a pad token) changes nothing and makes no NaN."""
    old = t([[-0.5, -1.0, 0.0], [-2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    teacher = t([[-0.7, -0.2, -math.inf], [-1.0, math.nan, -math.inf]])
    logprobs = old.clone().requires_grad_()
    loss, metrics = reverse_kl_loss(logprobs, old, teacher, mask, ON_POLICY, Counts(num_loss_tokens_global=3))
    loss.backward()
    close(loss, ((-0.5 + 0.7) + (-1.0 + 0.2) + (-2.0 + 1.0)) / 3)
    close(metrics["reverse_kl"], ((-0.5 + 0.7) + (-1.0 + 0.2) + (-2.0 + 1.0)) / 3)
    assert torch.isfinite(logprobs.grad).all()
    close(logprobs.grad[mask == 0], [0.0, 0.0, 0.0])


def test_expected_gradient_is_the_exact_reverse_kl_gradient():
    """Independent formulation, fp64: for one step over a vocabulary of V tokens, the surrogate's
    gradient wrt the student's logits, averaged over the student's own samples y ~ q (enumerated,
    weighted by q(y)), equals the gradient of the exact KL(q || p) = sum_v q_v (log q_v - log p_v)."""
    g = torch.Generator().manual_seed(3)
    V = 6
    logits = torch.randn(V, generator=g, dtype=F64).requires_grad_()
    teacher_logprobs = torch.log_softmax(torch.randn(V, generator=g, dtype=F64), -1)
    q = torch.softmax(logits.detach(), -1)
    expected_grad = torch.zeros(V, dtype=F64)
    for y in range(V):
        logprobs = torch.log_softmax(logits, -1)[y].reshape(1, 1)
        loss, _ = reverse_kl_loss(
            logprobs,
            logprobs.detach(),
            teacher_logprobs[y].reshape(1, 1),
            torch.ones(1, 1),
            ON_POLICY,
            Counts(num_loss_tokens_global=1),
        )
        (grad,) = torch.autograd.grad(loss, logits)
        expected_grad += q[y] * grad
    exact = logits.detach().clone().requires_grad_()
    log_q = exact - torch.logsumexp(exact, 0)
    kl = (log_q.exp() * (log_q - teacher_logprobs)).sum()
    (exact_grad,) = torch.autograd.grad(kl, exact)
    close(expected_grad, exact_grad, atol=1e-12)
    assert exact_grad.abs().max() > 1e-2  # the check is not of two zeros


def test_reverse_kl_off_policy_ratio_is_clipped():
    """With old != current (several updates per batch), the token_clip surrogate applies: a token
    whose ratio left [1 - eps, 1 + eps] in the advantage's direction has no gradient."""
    old = t([[-1.0, -1.0]])
    teacher = t([[-2.0, 0.0]])  # advantages (-1, +1)
    logprobs = t([[-1.0 - 0.5, -1.0 + 0.5]]).requires_grad_()  # ratios e^-0.5 (A < 0), e^0.5 (A > 0): both clipped
    loss, metrics = reverse_kl_loss(
        logprobs, old, teacher, torch.ones(1, 2), ON_POLICY, Counts(num_loss_tokens_global=2)
    )
    loss.backward()
    close(logprobs.grad, [[0.0, 0.0]])
    close(metrics["clip_frac_low"], 0.5)
    close(metrics["clip_frac_high"], 0.5)


def test_reverse_kl_bad_input():
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        reverse_kl_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="reward_advantages"):
        reverse_kl_advantages(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), reward_weight=1.0)
    with pytest.raises(ValueError, match=r"\(B,\)"):
        reverse_kl_advantages(
            torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), reward_advantages=torch.zeros(3), reward_weight=1.0
        )


# ---- full-vocabulary reverse KL at the student's sampled prefixes ---------------------------


def test_full_reverse_kl_hand_values():
    """Student (1/4, 3/4), teacher uniform: KL(q || p) = 1/4 ln(1/2) + 3/4 ln(3/2); gradient wrt the
    student's logits q_v (log q_v - log p_v - KL) = (1/4 (ln(1/2) - KL), 3/4 (ln(3/2) - KL))."""
    student = t([[0.0, LN3]]).requires_grad_()
    loss, metrics = full_reverse_kl_loss(student, t([[1.0, 1.0]]), 1)
    kl = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    close(loss, kl)
    close(metrics["kl_sum"], kl)
    loss.backward()
    close(student.grad, [[0.25 * (math.log(0.5) - kl), 0.75 * (math.log(1.5) - kl)]])


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_full_reverse_kl_matches_independent_fp64_and_the_sampled_expectation(temperature):
    """Against the written-out KL with the roles swapped, and against reverse_kl_loss's gradient averaged
    over every token the student could sample (same expected gradient, no sampling noise)."""
    g = torch.Generator().manual_seed(5)
    student, teacher = (torch.randn(4, 7, generator=g, dtype=F64) * 2 for _ in range(2))
    loss, metrics = full_reverse_kl_loss(student, teacher, 9, temperature=temperature)
    expected = independent_forward_kl(teacher, student, temperature)  # KL(student || teacher)
    close(metrics["kl_sum"], expected)
    close(loss, expected / 9)
    logits = student[0].clone().requires_grad_()
    (full_grad,) = torch.autograd.grad(
        full_reverse_kl_loss(logits[None], teacher[:1], 1, temperature=temperature)[0], logits
    )
    q = torch.softmax(student[0] / temperature, -1)
    teacher_logprobs = torch.log_softmax(teacher[0] / temperature, -1)
    sampled_grad = torch.zeros(7, dtype=F64)
    for y in range(7):
        logprobs = torch.log_softmax(logits / temperature, -1)[y].reshape(1, 1)
        sampled, _ = reverse_kl_loss(
            logprobs,
            logprobs.detach(),
            teacher_logprobs[y].reshape(1, 1),
            torch.ones(1, 1),
            ON_POLICY,
            Counts(num_loss_tokens_global=1),
        )
        sampled_grad += q[y] * torch.autograd.grad(sampled, logits)[0]
    close(sampled_grad, full_grad)
    assert full_grad.abs().max() > 1e-2


def test_registry_names_each_kind():
    assert DISTILL_LOSSES == {
        "on_policy": reverse_kl_loss,
        "on_policy_full": full_reverse_kl_loss,
        "logit": forward_kl_loss,
    }
