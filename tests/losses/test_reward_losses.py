"""Reward-model loss (Bradley-Terry): hand-derived values and gradients, and an independent fp64
formulation with Python floats (math, not torch)."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.losses.reward import REWARD_LOSSES, reward_loss

F64 = torch.float64


def t(values, dtype=F64, grad=False):
    return torch.tensor(values, dtype=dtype, requires_grad=grad)


def close(actual, expected, atol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


def test_bradley_terry_hand_values_and_gradient():
    # pair 1: r_w = 1, r_l = 0: -log sigmoid(1) = log(1 + e^-1); a win
    # pair 2: r_w = r_l = 0.5: -log sigmoid(0) = log 2; a tie, not a win
    # pair 3: r_w = -1, r_l = 1: -log sigmoid(-2) = log(1 + e^2); a loss
    chosen, rejected = t([1.0, 0.5, -1.0], grad=True), t([0.0, 0.5, 1.0], grad=True)
    loss, metrics = reward_loss(chosen, rejected)
    close(loss, (math.log1p(math.exp(-1.0)) + math.log(2.0) + math.log1p(math.exp(2.0))) / 3)
    close(metrics["accuracy"], 1 / 3)
    close(metrics["reward_margin"], (1.0 + 0.0 - 2.0) / 3)
    close(metrics["rewards_chosen"], 0.5 / 3)
    close(metrics["rewards_rejected"], 1.5 / 3)
    loss.backward()
    # d/dr_w of -log sigmoid(d) / 3 = -sigmoid(-d) / 3 = -1 / (3 (1 + e^d)), d = r_w - r_l: 1, 0, -2
    expected = [-1.0 / (3 * (1 + math.e)), -1.0 / 6, -1.0 / (3 * (1 + math.exp(-2.0)))]
    close(chosen.grad, expected)
    close(rejected.grad, [-g for g in expected])


def test_margin_hand_value():
    # r_w - r_l = 1, margin 1: -log sigmoid(0) = log 2 (the accuracy does not see the margin: a win)
    loss, metrics = reward_loss(t([1.5]), t([0.5]), margin=1.0)
    close(loss, math.log(2.0))
    close(metrics["accuracy"], 1.0)


def reference_fp64(chosen: list[float], rejected: list[float], margin: float) -> float:
    """-log sigmoid(d) = log(1 + exp(-d)) written out, stably, in Python floats."""
    total = 0.0
    for win, lose in zip(chosen, rejected):
        d = win - lose - margin
        total += math.log1p(math.exp(-d)) if d >= 0 else -d + math.log1p(math.exp(d))
    return total / len(chosen)


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("margin", [0.0, 0.7])
def test_against_independent_formulation(dtype, atol, margin):
    gen = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(64, generator=gen, dtype=F64) * 4, torch.randn(64, generator=gen, dtype=F64) * 4
    loss, _ = reward_loss(chosen.to(dtype), rejected.to(dtype), margin=margin)
    expected = reference_fp64(chosen.tolist(), rejected.tolist(), margin)
    assert abs(float(loss) - expected) <= atol


def test_micro_batches_sum_to_the_full_batch():
    gen = torch.Generator().manual_seed(1)
    chosen, rejected = torch.randn(8, generator=gen, dtype=F64), torch.randn(8, generator=gen, dtype=F64)
    full, full_metrics = reward_loss(chosen, rejected)
    parts = [reward_loss(chosen[k : k + 3], rejected[k : k + 3], num_pairs_global=8) for k in range(0, 8, 3)]
    close(sum(p[0] for p in parts), full)
    for key in full_metrics:
        close(sum(p[1][key] for p in parts), full_metrics[key])


def test_large_margins_stay_finite():
    loss, _ = reward_loss(t([200.0, -200.0], dtype=torch.float32), t([-200.0, 200.0], dtype=torch.float32))
    assert torch.isfinite(loss) and abs(float(loss) - 400.0 / 2) < 1e-3


def test_bad_settings():
    assert set(REWARD_LOSSES) == {"bradley_terry"}
    with pytest.raises(ValueError, match="unknown reward-model loss"):
        reward_loss(t([1.0]), t([0.0]), loss_type="hinge")
    with pytest.raises(ValueError, match="margin must be >= 0"):
        reward_loss(t([1.0]), t([0.0]), margin=-1.0)
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        reward_loss(t([[1.0]]), t([[0.0]]))
