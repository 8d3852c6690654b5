"""Preference losses (DPO sigmoid, IPO, SimPO): hand-derived values and gradients, and an
independent fp64 formulation that recomputes the implicit rewards from per-token log-probabilities
with Python floats (math, not torch)."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.losses.preference import PREFERENCE_LOSSES, preference_loss, sequence_logps

F64 = torch.float64
LOG1P_EXP_NEG1 = math.log1p(math.exp(-1.0))  # -log sigmoid(1) = 0.31326168751822286


def t(values, dtype=F64, grad=False):
    return torch.tensor(values, dtype=dtype, requires_grad=grad)


def close(actual, expected, atol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


def test_dpo_sigmoid_hand_values_and_gradient():
    # pair 1: log pi = -1 / -3, log pi_ref = -2 / -2, beta 0.5:
    #   r_w = 0.5 (-1 + 2) = 0.5, r_l = 0.5 (-3 + 2) = -0.5, margin 1, loss -log sigmoid(1) = log(1 + e^-1)
    # pair 2: policy = reference: r_w = r_l = 0, loss -log sigmoid(0) = log 2, a tie (not a win)
    chosen = t([-1.0, -2.0], grad=True)
    loss, metrics = preference_loss(
        chosen, t([-3.0, -2.0]), t([1, 1]), t([1, 1]), t([-2.0, -2.0]), t([-2.0, -2.0]), loss_type="sigmoid", beta=0.5
    )
    close(loss, (LOG1P_EXP_NEG1 + math.log(2.0)) / 2)
    close(metrics["rewards_chosen"], (0.5 + 0.0) / 2)
    close(metrics["rewards_rejected"], (-0.5 + 0.0) / 2)
    close(metrics["reward_margin"], (1.0 + 0.0) / 2)
    close(metrics["reward_accuracy"], 0.5)
    loss.backward()
    # d/d log pi(y_w) of -log sigmoid(beta m) / 2 = -beta sigmoid(-beta m) / 2:
    # pair 1: -0.5 sigmoid(-1) / 2 = -0.25 / (1 + e) ; pair 2: -0.5 * 0.5 / 2 = -0.125
    close(chosen.grad, [-0.25 / (1.0 + math.e), -0.125])


def test_dpo_label_smoothing_hand_value():
    # margin 1, eps 0.1: 0.9 log(1 + e^-1) + 0.1 log(1 + e^1); log(1 + e) = 1 + log(1 + e^-1),
    # so the loss is log(1 + e^-1) + 0.1 = 0.41326168751822286
    loss, _ = preference_loss(
        t([-1.0]), t([-3.0]), t([1]), t([1]), t([-2.0]), t([-2.0]), loss_type="sigmoid", beta=0.5, label_smoothing=0.1
    )
    close(loss, LOG1P_EXP_NEG1 + 0.1)
    close(loss, 0.41326168751822286, atol=1e-15)


def test_ipo_hand_values_and_gradient():
    # beta 0.25: target margin 1 / (2 beta) = 2. Per-token log-ratios:
    # pair 1: rho_w = (-2 + 4) / 2 = 1, rho_l = (-9 + 6) / 3 = -1, h = 2, loss (2 - 2)^2 = 0
    # pair 2: rho_w = (-4 + 4) / 2 = 0, rho_l = -1, h = 1, loss (1 - 2)^2 = 1
    chosen = t([-2.0, -4.0], grad=True)
    loss, metrics = preference_loss(
        chosen, t([-9.0, -9.0]), t([2, 2]), t([3, 3]), t([-4.0, -4.0]), t([-6.0, -6.0]), loss_type="ipo", beta=0.25
    )
    close(loss, (0.0 + 1.0) / 2)
    close(metrics["rewards_chosen"], 0.25 * (1.0 + 0.0) / 2)
    close(metrics["rewards_rejected"], 0.25 * (-1.0 - 1.0) / 2)
    close(metrics["reward_accuracy"], 1.0)
    loss.backward()
    # d/d log pi(y_w) of (h - 2)^2 / 2 = (h - 2) / |y_w|: pair 1: 0, pair 2: -1 / 2
    close(chosen.grad, [0.0, -0.5])


def test_simpo_hand_values_ignores_the_reference():
    # beta 2, gamma 1: r_w = 2 * (-3 / 3) = -2, r_l = 2 * (-8 / 4) = -4, loss -log sigmoid(-2 + 4 - 1)
    rejected = t([-8.0], grad=True)
    loss, metrics = preference_loss(t([-3.0]), rejected, t([3]), t([4]), loss_type="simpo", beta=2.0, gamma=1.0)
    close(loss, LOG1P_EXP_NEG1)
    close(metrics["rewards_chosen"], -2.0)
    close(metrics["rewards_rejected"], -4.0)
    close(metrics["reward_margin"], 2.0)
    loss.backward()
    # d/d log pi(y_l) = sigmoid(-1) * beta / |y_l| = 0.5 / (1 + e)
    close(rejected.grad, [0.5 / (1.0 + math.e)])
    with_ref, _ = preference_loss(
        t([-3.0]), t([-8.0]), t([3]), t([4]), t([5.0]), t([7.0]), loss_type="simpo", beta=2.0, gamma=1.0
    )
    close(with_ref, loss)


def test_nll_term_hand_value_and_gradient():
    # DPO pair 1 of the first test (loss log(1 + e^-1)) plus 0.5 x the chosen's mean token NLL:
    # log pi(y_w) = -1 over |y_w| = 4 tokens -> nll 0.25, loss log(1 + e^-1) + 0.125
    chosen = t([-1.0], grad=True)
    loss, metrics = preference_loss(
        chosen, t([-3.0]), t([4]), t([1]), t([-2.0]), t([-2.0]), loss_type="sigmoid", beta=0.5, nll_coef=0.5
    )
    close(loss, LOG1P_EXP_NEG1 + 0.125)
    close(metrics["nll_chosen"], 0.25)
    loss.backward()
    # -0.5 sigmoid(-1) (DPO) - 0.5 / 4 (NLL)
    close(chosen.grad, [-0.5 / (1.0 + math.e) - 0.125])
    with pytest.raises(ValueError, match="nll_coef must be >= 0"):
        preference_loss(chosen, t([-3.0]), t([4]), t([1]), loss_type="simpo", beta=0.5, nll_coef=-1.0)


def reference_pair_loss(loss_type, pol_w, pol_l, ref_w, ref_l, beta, eps, gamma, nll_coef):
    """One pair's (loss, r_w, r_l) from per-token log-probabilities (lists of floats), from the papers'
    formulas with Python floats."""
    log_sigmoid = lambda x: -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))  # noqa: E731
    nll = -sum(pol_w) / len(pol_w)
    if loss_type == "sigmoid":
        r_w, r_l = beta * (sum(pol_w) - sum(ref_w)), beta * (sum(pol_l) - sum(ref_l))
        return -(1 - eps) * log_sigmoid(r_w - r_l) - eps * log_sigmoid(r_l - r_w) + nll_coef * nll, r_w, r_l
    if loss_type == "ipo":
        rho_w = sum(p - r for p, r in zip(pol_w, ref_w)) / len(pol_w)
        rho_l = sum(p - r for p, r in zip(pol_l, ref_l)) / len(pol_l)
        return (rho_w - rho_l - 1 / (2 * beta)) ** 2 + nll_coef * nll, beta * rho_w, beta * rho_l
    r_w, r_l = beta * sum(pol_w) / len(pol_w), beta * sum(pol_l) / len(pol_l)
    return -log_sigmoid(r_w - r_l - gamma) + nll_coef * nll, r_w, r_l


SETTINGS = {
    "sigmoid": dict(beta=0.1, label_smoothing=0.2, gamma=0.0, nll_coef=0.0),
    "ipo": dict(beta=0.3, label_smoothing=0.0, gamma=0.0, nll_coef=0.7),
    "simpo": dict(beta=2.5, label_smoothing=0.0, gamma=1.4, nll_coef=0.2),
}


@pytest.mark.parametrize("loss_type", list(PREFERENCE_LOSSES))
@pytest.mark.parametrize("dtype, atol", [(F64, 1e-12), (torch.float32, 2e-5)])
def test_matches_independent_formulation_from_token_logprobs(loss_type, dtype, atol):
    gen = torch.Generator().manual_seed(7)
    num_pairs, width = 6, 9
    lens = {side: torch.randint(1, width + 1, (num_pairs,), generator=gen) for side in ("w", "l")}
    masks = {side: (torch.arange(width)[None] < lens[side][:, None]) for side in lens}
    tokens = {
        (who, side): torch.where(
            masks[side], -3 * torch.rand(num_pairs, width, generator=gen, dtype=F64), float("-inf")
        )  # padding holds -inf: never reaches a sum
        for who in ("pol", "ref")
        for side in ("w", "l")
    }
    settings = SETTINGS[loss_type]
    expected = [
        reference_pair_loss(
            loss_type,
            *[tokens[k][i][: lens[k[1]][i]].tolist() for k in [("pol", "w"), ("pol", "l"), ("ref", "w"), ("ref", "l")]],
            settings["beta"],
            settings["label_smoothing"],
            settings["gamma"],
            settings["nll_coef"],
        )
        for i in range(num_pairs)
    ]
    (pol_w, len_w), (pol_l, len_l), (ref_w, _), (ref_l, _) = [
        sequence_logps(tokens[k].to(dtype), masks[k[1]])
        for k in [("pol", "w"), ("pol", "l"), ("ref", "w"), ("ref", "l")]
    ]
    loss, metrics = preference_loss(pol_w, pol_l, len_w, len_l, ref_w, ref_l, loss_type=loss_type, **settings)
    close(loss, sum(e[0] for e in expected) / num_pairs, atol)
    close(metrics["rewards_chosen"], sum(e[1] for e in expected) / num_pairs, atol)
    close(metrics["rewards_rejected"], sum(e[2] for e in expected) / num_pairs, atol)
    close(metrics["reward_accuracy"], sum(e[1] > e[2] for e in expected) / num_pairs, atol)
    assert 0 < sum(e[1] > e[2] for e in expected) < num_pairs  # the accuracy check sees both outcomes


@pytest.mark.parametrize("loss_type", list(PREFERENCE_LOSSES))
def test_micro_batches_and_ranks_sum_to_the_full_batch(loss_type):
    gen = torch.Generator().manual_seed(3)
    values = [-5 * torch.rand(8, generator=gen, dtype=F64) for _ in range(4)]
    lens = [torch.randint(1, 6, (8,), generator=gen) for _ in range(2)]
    kwargs = dict(loss_type=loss_type, **SETTINGS[loss_type])
    full, full_metrics = preference_loss(values[0], values[1], *lens, values[2], values[3], **kwargs)
    parts = [
        preference_loss(
            *(v[rows] for v in values[:2]),
            *(n[rows] for n in lens),
            *(v[rows] for v in values[2:]),
            num_pairs_global=8,
            **kwargs,
        )
        for rows in (slice(0, 3), slice(3, 8))
    ]
    close(parts[0][0] + parts[1][0], full)
    for key, value in full_metrics.items():
        close(parts[0][1][key] + parts[1][1][key], value)


def test_bad_settings_and_inputs_name_the_problem():
    one = t([-1.0])
    with pytest.raises(ValueError, match="needs the reference"):
        preference_loss(one, one, t([1]), t([1]), loss_type="sigmoid", beta=0.1)
    with pytest.raises(ValueError, match="label_smoothing is defined for the 'sigmoid'"):
        preference_loss(one, one, t([1]), t([1]), one, one, loss_type="ipo", beta=0.1, label_smoothing=0.1)
    with pytest.raises(ValueError, match="gamma"):
        preference_loss(one, one, t([1]), t([1]), one, one, loss_type="sigmoid", beta=0.1, gamma=1.0)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\)"):
        preference_loss(one, one, t([1]), t([1]), one, one, loss_type="sigmoid", beta=0.1, label_smoothing=0.5)
    with pytest.raises(ValueError, match="beta must be > 0"):
        preference_loss(one, one, t([1]), t([1]), one, one, loss_type="sigmoid", beta=0.0)
    with pytest.raises(ValueError, match="unknown preference loss 'orpo'"):
        preference_loss(one, one, t([1]), t([1]), one, one, loss_type="orpo", beta=0.1)
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        preference_loss(t([[-1.0]]), t([[-1.0]]), t([[1]]), t([[1]]), loss_type="simpo", beta=0.1)
