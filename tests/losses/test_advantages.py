"""Advantage estimators: hand-derived values, plain-loop references, zero-variance groups, GAE."""

from __future__ import annotations

import inspect
import math
import statistics

import pytest
import torch

from lmforge.losses.advantages import (
    ADVANTAGES,
    STD_NORMALISED,
    batch_normalized_advantages,
    compute_advantages,
    gae,
    group_mean_advantages,
    group_normalized_advantages,
    rloo_advantages,
    whiten_advantages,
)

F64 = torch.float64


def t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


def close(actual, expected, atol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


# ---- plain-loop references -------------------------------------------------------------------


def loop_group_norm(groups, std_eps, scale_by_std):
    out = []
    for group in groups:
        if len(set(group)) == 1:
            out.append([0.0] * len(group))
            continue
        mean = statistics.fmean(group)
        scale = statistics.stdev(group) + std_eps if scale_by_std else 1.0
        out.append([(r - mean) / scale for r in group])
    return out


def loop_rloo(groups):
    out = []
    for group in groups:
        if len(set(group)) == 1:
            out.append([0.0] * len(group))
            continue
        row = []
        for i, r in enumerate(group):
            others = [x for j, x in enumerate(group) if j != i]
            row.append(r - sum(others) / len(others))
        out.append(row)
    return out


def random_groups(seed, num_groups=7, group_size=5):
    """Binary and continuous rewards, with two zero-variance groups (rows 0 and 3)."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (num_groups, group_size), generator=g).to(F64)
    rewards[1:3] = torch.randn(2, group_size, generator=g, dtype=F64)
    rewards[0] = 1.0
    rewards[3] = 0.1  # all 0.1: a naive mean/std leaves a ~1e-17 residue here
    return rewards


# ---- hand-derived values ---------------------------------------------------------------------


def test_group_norm_hand_values():
    # group [1,0,0,0]: mean 0.25, sample std sqrt(0.75/3) = 0.5 -> (r - 0.25) / 0.5
    adv, metrics = group_normalized_advantages(t([[1, 0, 0, 0], [2, 2, 2, 2]]), std_eps=0.0)
    close(adv, [[1.5, -0.5, -0.5, -0.5], [0, 0, 0, 0]])
    assert metrics["num_zero_variance_groups"].item() == 1
    close(metrics["frac_zero_variance_groups"], 0.5)


def test_group_norm_std_eps_is_added_to_std():
    adv, _ = group_normalized_advantages(t([[1, 0, 0, 0]]), std_eps=0.5)  # divide by 0.5 + 0.5
    close(adv, [[0.75, -0.25, -0.25, -0.25]])


def test_group_norm_without_std_and_group_mean_are_dr_grpo():
    expected = [[0.75, -0.25, -0.25, -0.25]]
    close(group_normalized_advantages(t([[1, 0, 0, 0]]), scale_by_std=False)[0], expected)
    close(group_mean_advantages(t([[1, 0, 0, 0]]))[0], expected)


def test_rloo_hand_values():
    # A_0 = 1 - mean(0,0,0) = 1 ; A_j = 0 - mean(1,0,0) = -1/3
    adv, _ = rloo_advantages(t([[1, 0, 0, 0]]))
    close(adv, [[1.0, -1 / 3, -1 / 3, -1 / 3]])


def test_rloo_is_scaled_mean_centering():
    rewards = random_groups(0)
    group_size = rewards.shape[1]
    expected = group_mean_advantages(rewards)[0] * group_size / (group_size - 1)
    close(rloo_advantages(rewards)[0], expected)


def test_batch_norm_hand_values():
    # flat batch [1,0,0,0] without groups = one group
    close(batch_normalized_advantages(t([1, 0, 0, 0]), std_eps=0.0)[0], [1.5, -0.5, -0.5, -0.5])
    # two zero-variance groups: still a signal across the batch. mean 0.5, std sqrt(1/3)
    adv, metrics = batch_normalized_advantages(t([[1, 1], [0, 0]]), std_eps=0.0)
    half_sqrt3 = 0.5 * math.sqrt(3.0)
    close(adv, [[half_sqrt3, half_sqrt3], [-half_sqrt3, -half_sqrt3]])
    assert metrics["num_zero_variance_groups"].item() == 2
    close(batch_normalized_advantages(t([3, 3, 3, 3]))[0], [0, 0, 0, 0])


# ---- against the loops -----------------------------------------------------------------------


@pytest.mark.parametrize("scale_by_std", [True, False])
@pytest.mark.parametrize("std_eps", [0.0, 1e-6, 0.3])
def test_group_norm_matches_loop(scale_by_std, std_eps):
    rewards = random_groups(1)
    adv, metrics = group_normalized_advantages(rewards, std_eps=std_eps, scale_by_std=scale_by_std)
    close(adv, loop_group_norm(rewards.tolist(), std_eps, scale_by_std))
    assert metrics["num_zero_variance_groups"].item() == 2


def test_rloo_matches_loop():
    rewards = random_groups(2)
    close(rloo_advantages(rewards)[0], loop_rloo(rewards.tolist()))


def test_batch_norm_matches_loop():
    rewards = random_groups(3)
    flat = rewards.flatten().tolist()
    mean, std = statistics.fmean(flat), statistics.stdev(flat)
    expected = [[(r - mean) / (std + 1e-6) for r in row] for row in rewards.tolist()]
    close(batch_normalized_advantages(rewards)[0], expected)


# ---- zero-variance groups --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["group_norm", "group_mean", "rloo"])
def test_zero_variance_groups_are_exactly_zero(name):
    rewards = t([[0.1, 0.1, 0.1], [0.7, 0.7, 0.7], [1.0, 0.0, 1.0]])
    # The exact-zero guarantee is not vacuous: naive centring leaves a residue for [0.1]*3.
    assert (rewards[0] - rewards[0].mean()).abs().max() > 0
    adv, metrics = compute_advantages(name, rewards)
    assert torch.equal(adv[:2], torch.zeros(2, 3, dtype=F64))
    assert adv[2].abs().min() > 0
    assert torch.isfinite(adv).all()
    assert metrics["num_zero_variance_groups"].item() == 2
    close(metrics["frac_zero_variance_groups"], 2 / 3)


def test_all_groups_zero_variance_no_nan_even_with_zero_eps():
    adv, metrics = group_normalized_advantages(t([[1, 1], [0, 0]]), std_eps=0.0)
    assert torch.equal(adv, torch.zeros(2, 2, dtype=F64))
    close(metrics["frac_zero_variance_groups"], 1.0)


# ---- shapes, dtypes, registry ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_flat_with_group_size_equals_grouped(name):
    rewards = random_groups(4)
    grouped, _ = compute_advantages(name, rewards)
    flat, _ = compute_advantages(name, rewards.flatten(), group_size=rewards.shape[1])
    assert flat.shape == (rewards.numel(),)
    assert torch.equal(flat.view_as(rewards), grouped)


def test_integer_rewards_are_accepted_and_outputs_are_detached():
    adv, metrics = compute_advantages("group_norm", torch.tensor([1, 0, 0, 0]), group_size=4)
    close(adv, [1.5, -0.5, -0.5, -0.5], atol=1e-5)  # default eps 1e-6 on std 0.5
    rewards = t([[1, 0], [0, 1]]).requires_grad_()
    for name in ADVANTAGES:
        adv, metrics = compute_advantages(name, rewards)
        assert not adv.requires_grad
        assert not any(value.requires_grad for value in metrics.values())


@pytest.mark.parametrize(
    "rewards, group_size, match",
    [
        (t([1, 0, 1]), None, "need group_size"),
        (t([1, 0, 1]), 2, "cannot be split"),
        (t([[1, 0], [0, 1]]), 3, "group_size=3"),
        (t([[1], [0]]), None, "at least 2"),
        (t([1, 0]), 1, "at least 2"),
        (torch.zeros(2, 2, 2, dtype=F64), None, r"\(B,\)"),
        (torch.zeros(0, 4, dtype=F64), None, "empty"),
    ],
)
def test_bad_reward_shapes_raise(rewards, group_size, match):
    with pytest.raises(ValueError, match=match):
        group_normalized_advantages(rewards, group_size)


def test_negative_std_eps_raises():
    with pytest.raises(ValueError, match="std_eps"):
        group_normalized_advantages(t([[1, 0]]), std_eps=-1.0)


def test_unknown_advantage_name_lists_valid_names():
    with pytest.raises(ValueError, match="unknown advantage estimator 'grpoo'") as info:
        compute_advantages("grpoo", t([[1, 0]]))
    for name in ADVANTAGES:
        assert name in str(info.value)


# ---- GAE -------------------------------------------------------------------------------------


def loop_gae(rewards, values, mask, gamma, lam):
    """Per row: compress to the valid tokens, run the textbook recursion, scatter back."""
    adv_out, ret_out = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        idx = [i for i, m in enumerate(m_row) if m]
        adv_row, ret_row = [0.0] * len(m_row), [0.0] * len(m_row)
        running = 0.0
        for k in reversed(range(len(idx))):
            next_v = v_row[idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = r_row[idx[k]] + gamma * next_v - v_row[idx[k]]
            running = delta + gamma * lam * running
            adv_row[idx[k]] = running
            ret_row[idx[k]] = running + v_row[idx[k]]
        adv_out.append(adv_row)
        ret_out.append(ret_row)
    return adv_out, ret_out


def test_gae_hand_values():
    # gamma = lam = 0.5, r = [1, 0, 2], V = [1, 2, 4]:
    # t=2: delta = 2 - 4 = -2, A = -2 ; t=1: delta = 0 + 0.5*4 - 2 = 0, A = 0 + 0.25*(-2) = -0.5
    # t=0: delta = 1 + 0.5*2 - 1 = 1, A = 1 + 0.25*(-0.5) = 0.875 ; returns = A + V
    adv, ret = gae(t([[1, 0, 2]]), t([[1, 2, 4]]), t([[1, 1, 1]]), gamma=0.5, lam=0.5)
    close(adv, [[0.875, -0.5, -2.0]])
    close(ret, [[1.875, 1.5, 2.0]])


def test_gae_padding_and_holes_bootstrap_zero_and_are_skipped():
    nan = float("nan")
    # the same 3-token episode, right-padded, left-padded, and with a hole; padded values are NaN
    rewards = t([[1, 0, 2, 5, 5], [5, 5, 1, 0, 2], [1, 5, 0, 2, 5]])
    values = t([[1, 2, 4, nan, nan], [nan, nan, 1, 2, 4], [1, nan, 2, 4, nan]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    close(adv, [[0.875, -0.5, -2, 0, 0], [0, 0, 0.875, -0.5, -2], [0.875, 0, -0.5, -2, 0]])
    close(ret, [[1.875, 1.5, 2, 0, 0], [0, 0, 1.875, 1.5, 2], [1.875, 0, 1.5, 2, 0]])


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.7)])
def test_gae_matches_loop(gamma, lam):
    g = torch.Generator().manual_seed(5)
    rewards = torch.randn(6, 9, generator=g, dtype=F64)
    values = torch.randn(6, 9, generator=g, dtype=F64)
    mask = torch.rand(6, 9, generator=g) > 0.3
    mask[0] = False  # an empty row
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    exp_adv, exp_ret = loop_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    close(adv, exp_adv)
    close(ret, exp_ret)


def test_gae_limits_monte_carlo_and_td():
    g = torch.Generator().manual_seed(6)
    rewards = torch.randn(3, 5, generator=g, dtype=F64)
    values = torch.randn(3, 5, generator=g, dtype=F64)
    mask = torch.ones(3, 5)
    # lam = 1, gamma = 1: A_t = sum_{k >= t} r_k - V_t
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    reward_to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    close(adv, reward_to_go - values)
    close(ret, reward_to_go)
    # lam = 0: A_t = r_t + gamma V_{t+1} - V_t (one-step TD error)
    adv, _ = gae(rewards, values, mask, gamma=0.9, lam=0.0)
    next_values = torch.cat([values[:, 1:], torch.zeros(3, 1, dtype=F64)], dim=1)
    close(adv, rewards + 0.9 * next_values - values)


def test_gae_outputs_carry_no_gradient_and_validate():
    values = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    adv, ret = gae(t([[0, 1]]), values, t([[1, 1]]), gamma=1.0, lam=1.0)
    assert not adv.requires_grad and not ret.requires_grad
    with pytest.raises(ValueError, match="same"):
        gae(t([[0, 1]]), t([[0, 1, 2]]), t([[1, 1]]), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="gamma"):
        gae(t([[0, 1]]), t([[0, 1]]), t([[1, 1]]), gamma=1.5, lam=1.0)


def test_whiten_hand_values_and_padding():
    # valid [1, 2, 3]: mean 2, sample std 1 -> [-1, 0, 1]; padding -> 0
    out = whiten_advantages(t([[1, 2, 99], [3, 99, 99]]), t([[1, 1, 0], [1, 0, 0]]), std_eps=0.0)
    close(out, [[-1, 0, 0], [1, 0, 0]])
    single = whiten_advantages(t([[4.0, 7.0]]), t([[1, 0]]))
    close(single, [[0.0, 0.0]])  # one valid token: centred to 0, no NaN


def test_std_eps_goes_to_exactly_the_estimators_that_take_it():
    """``STD_NORMALISED`` (which estimators ``grpo.advantages_of`` hands ``algo.std_eps``) names the
    estimators whose signature has ``std_eps``: a new std-normalising estimator must be listed."""
    for name, estimator in ADVANTAGES.items():
        assert ("std_eps" in inspect.signature(estimator).parameters) == (name in STD_NORMALISED), name
