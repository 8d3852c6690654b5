"""RL losses: hand-derived values and gradients, finite differences, identities, invariances."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.core.ops import selective_log_softmax
from lmforge.losses.policy import (
    AGGREGATIONS,
    GSPO_EPS_HIGH,
    GSPO_EPS_LOW,
    IS_LEVELS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    Counts,
    PolicyLossSpec,
    aggregate,
    entropy_bonus,
    gspo_loss,
    gspo_token_loss,
    kl_per_token,
    logprob_alignment_metrics,
    policy_loss,
    token_clip_loss,
    truncated_is_weights,
    value_loss,
)

F64 = torch.float64


def t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


def close(actual, expected, atol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


def leaf(values):
    return t(values).requires_grad_()


def token_grad(fn, logprobs, *args, **kwargs):
    """Gradient of sum(per-token losses) wrt logprobs: the per-token derivative."""
    logprobs = logprobs.detach().clone().requires_grad_()
    token_losses, _ = fn(logprobs, *args, **kwargs)
    token_losses.sum().backward()
    return logprobs.grad


def random_batch(seed, lengths=(5, 2, 4, 1), num_positions=6):
    """logprobs, old_logprobs (ratios in ~[0.6, 1.6]), mask for sequences of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    shape = (len(lengths), num_positions)
    logprobs = -torch.rand(shape, generator=g, dtype=F64) * 3 - 0.1
    old_logprobs = logprobs + (torch.rand(shape, generator=g, dtype=F64) - 0.5)
    mask = torch.arange(num_positions)[None, :] < torch.tensor(lengths)[:, None]
    return logprobs, old_logprobs, mask


# ---- token-level clipped surrogate -----------------------------------------------------------

RATIOS = [0.5, 1.0, 1.5]


@pytest.mark.parametrize(
    "advantage, expected_loss, expected_grad",
    [
        # A > 0: min(rA, clip(r)A). r=0.5 -> 0.5A (unclipped), r=1.5 -> 1.2A (clipped, no grad)
        (2.0, [-1.0, -2.0, -2.4], [-1.0, -2.0, 0.0]),
        # A < 0: r=0.5 -> min(-1, -1.6) = -1.6 clipped (grad 0); r=1.5 -> min(-3, -2.4) = -3
        # unclipped, d(-rA)/dlogp = -rA = 3. (Using max for A<0 would swap both.)
        (-2.0, [1.6, 2.0, 3.0], [0.0, 2.0, 3.0]),
    ],
)
def test_token_clip_values_and_gradients_both_signs(advantage, expected_loss, expected_grad):
    old_logprobs = t([[-1.0, -1.0, -1.0]])
    logprobs = old_logprobs + torch.log(t([RATIOS]))
    mask = torch.ones(1, 3, dtype=torch.bool)
    advantages = t([advantage])
    token_losses, metrics = token_clip_loss(logprobs, old_logprobs, advantages, mask)
    close(token_losses, [expected_loss])
    grad = token_grad(token_clip_loss, logprobs, old_logprobs, advantages, mask)
    close(grad, [expected_grad])
    low, high = (1 / 3, 0.0) if advantage < 0 else (0.0, 1 / 3)  # only clips that stop gradients
    close(metrics["clip_frac_low"], low)
    close(metrics["clip_frac_high"], high)
    close(metrics["ratio_min"], 0.5)
    close(metrics["ratio_max"], 1.5)
    close(metrics["ratio_mean"], 1.0)


def test_token_clip_negative_advantage_gradient_at_half_and_one_and_half():
    """The DESIGN.md check: for A < 0, r = 0.5 is clipped (zero gradient), r = 1.5 is not."""
    old_logprobs = t([[0.0, 0.0]]) - 2.0
    logprobs = old_logprobs + torch.log(t([[0.5, 1.5]]))
    grad = token_grad(token_clip_loss, logprobs, old_logprobs, t([-1.0]), torch.ones(1, 2))
    assert grad[0, 0].item() == 0.0
    close(grad[0, 1], 1.5)


def test_clip_higher_is_asymmetric():
    old_logprobs = t([[-1.0, -1.0]])
    logprobs = old_logprobs + torch.log(t([[1.25, 0.75]]))
    advantages = t([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    # eps_high = 0.28: r = 1.25 < 1.28 is inside for A > 0; eps_low = 0.2: r = 0.75 clipped for A < 0
    losses, _ = token_clip_loss(logprobs, old_logprobs, advantages, mask, eps_low=0.2, eps_high=0.28)
    close(losses, [[-1.25, 0.8]])
    grad = token_grad(token_clip_loss, logprobs, old_logprobs, advantages, mask, eps_high=0.28)
    close(grad, [[-1.25, 0.0]])
    symmetric, _ = token_clip_loss(logprobs, old_logprobs, advantages, mask)
    close(symmetric, [[-1.2, 0.8]])


def test_dual_clip_bounds_negative_advantage_loss():
    old_logprobs = t([[0.0, 0.0, 0.0]]) - 3.0
    logprobs = old_logprobs + torch.log(t([[4.0, 2.0, 4.0]]))
    advantages = t([[-1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)
    losses, metrics = token_clip_loss(logprobs, old_logprobs, advantages, mask, dual_clip=3.0)
    # A=-1, r=4: PPO loss 4 capped at c|A| = 3; r=2 < c: loss 2; A>0 untouched: -1.2
    close(losses, [[3.0, 2.0, -1.2]])
    grad = token_grad(token_clip_loss, logprobs, old_logprobs, advantages, mask, dual_clip=3.0)
    close(grad, [[0.0, 2.0, 0.0]])
    close(metrics["dual_clip_frac"], 1 / 3)
    undual, _ = token_clip_loss(logprobs, old_logprobs, advantages, mask)
    close(undual, [[4.0, 2.0, -1.2]])
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        token_clip_loss(logprobs, old_logprobs, advantages, mask, dual_clip=1.0)


def test_padding_is_ignored_and_never_nan():
    logprobs = leaf([[-1.0, -2.0, 0.0]])
    old_logprobs = t([[-1.0, -2.5, -math.inf]])  # padded position holds -inf
    mask = torch.tensor([[True, True, False]])
    advantages = {"token_clip": t([[1.0, -1.0, math.nan]]), "gspo": t([1.0]), "gspo_token": t([[1.0, 1.0, math.nan]])}
    for name, fn in POLICY_LOSSES.items():
        token_losses, metrics = fn(logprobs, old_logprobs, advantages[name], mask, eps_low=0.2, eps_high=0.2)
        assert token_losses[0, 2].item() == 0.0, name
        token_losses.sum().backward()
        assert torch.isfinite(logprobs.grad).all(), name
        assert logprobs.grad[0, 2].item() == 0.0, name
        assert all(torch.isfinite(v) for v in metrics.values()), name
        assert not any(v.requires_grad for v in metrics.values()), name
        logprobs.grad = None


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_policy_losses_gradcheck(name):
    logprobs, old_logprobs, mask = random_batch(7)
    advantages = torch.randn(4, dtype=F64, generator=torch.Generator().manual_seed(8))
    eps = dict(eps_low=0.2, eps_high=0.28, dual_clip=1.4)

    def objective(lp):
        token_losses, _ = POLICY_LOSSES[name](lp, old_logprobs, advantages, mask, **eps)
        return aggregate(token_losses, mask, "seq_mean_token_mean")

    assert torch.autograd.gradcheck(objective, (logprobs.requires_grad_(),), atol=1e-8)


# ---- GSPO ------------------------------------------------------------------------------------


def test_gspo_constants_are_the_paper_values():
    assert (GSPO_EPS_LOW, GSPO_EPS_HIGH) == (3e-4, 4e-4)


def test_gspo_hand_values_and_gradient():
    old_logprobs = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    # row 0: log-ratios [0.1, -0.3] -> s = exp(-0.1); row 1: [0.3, 0.3, 0.3] -> s = exp(0.3)
    logprobs = old_logprobs + t([[0.1, -0.3, 7.0], [0.3, 0.3, 0.3]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    advantages = t([2.0, 1.0])
    losses, metrics = gspo_loss(logprobs, old_logprobs, advantages, mask, eps_low=0.2, eps_high=0.2)
    s0 = math.exp(-0.1)
    # row 0 inside [0.8, 1.2]: -s0 * 2 on each valid token; row 1: exp(0.3) > 1.2 -> -1.2 * 1
    close(losses, [[-2 * s0, -2 * s0, 0.0], [-1.2, -1.2, -1.2]])
    close(metrics["clip_frac_high"], 0.5)
    # d loss_0 / d logp_t = -A s0 / |y_0| per valid token (loss counted once per sequence)
    logprobs = logprobs.clone().requires_grad_()
    loss = aggregate(
        gspo_loss(logprobs, old_logprobs, advantages, mask, eps_low=0.2, eps_high=0.2)[0], mask, "seq_mean_token_mean"
    )
    close(loss, (-2 * s0 - 1.2) / 2)
    loss.backward()
    close(logprobs.grad, [[-s0 / 2, -s0 / 2, 0.0], [0.0, 0.0, 0.0]])


def test_gspo_paper_clip_range():
    old_logprobs = torch.zeros(2, 2, dtype=F64)
    logprobs = t([[1e-3, 1e-3], [-1e-4, -1e-4]])  # s = e^1e-3 (clipped), s = e^-1e-4 (inside)
    losses, _ = gspo_loss(logprobs, old_logprobs, t([1.0, 1.0]), torch.ones(2, 2))
    close(losses, [[-1.0004, -1.0004], [-math.exp(-1e-4)] * 2])


def test_gspo_rejects_per_token_advantages():
    logprobs, old_logprobs, mask = random_batch(0)
    with pytest.raises(ValueError, match="gspo_token"):
        gspo_loss(logprobs, old_logprobs, torch.zeros_like(logprobs), mask)


def loss_and_grad(fn, logprobs, old_logprobs, advantages, mask, aggregation, **kwargs):
    logprobs = logprobs.detach().clone().requires_grad_()
    loss = aggregate(fn(logprobs, old_logprobs, advantages, mask, **kwargs)[0], mask, aggregation)
    loss.backward()
    return loss.detach(), logprobs.grad


def test_gspo_equals_grpo_on_policy_under_seq_mean_token_mean():
    """Identity: at old = current every ratio is 1 and nothing is clipped, so
    grad GSPO = -1/G sum_i A_i grad s_i = -1/G sum_i A_i (1/|y_i|) sum_t grad logp_it,
    which is the GRPO gradient when GRPO averages tokens within a sequence then over sequences.
    With token_mean (1/sum|y_i| instead of 1/(G |y_i|)) it holds only for equal lengths."""
    logprobs, _, mask = random_batch(9)  # unequal lengths 5, 2, 4, 1
    advantages = t([1.5, -0.5, 0.25, -1.25])
    on_policy = logprobs.detach()
    gspo = loss_and_grad(gspo_loss, logprobs, on_policy, advantages, mask, "seq_mean_token_mean")
    grpo = loss_and_grad(token_clip_loss, logprobs, on_policy, advantages, mask, "seq_mean_token_mean")
    close(gspo[0], grpo[0])
    close(gspo[1], grpo[1])
    close(gspo[0], -advantages.mean())
    assert gspo[1].abs().min() == 0 and gspo[1].abs().max() > 0.1  # padding 0, tokens not
    grpo_token_mean = loss_and_grad(token_clip_loss, logprobs, on_policy, advantages, mask, "token_mean")
    assert (grpo_token_mean[1] - gspo[1]).abs().max() > 1e-2


def test_gspo_equals_grpo_on_policy_token_mean_when_lengths_equal():
    logprobs, _, mask = random_batch(10, lengths=(3, 3, 3, 3))
    advantages = t([1.0, -2.0, 0.5, 0.0])
    on_policy = logprobs.detach()
    gspo = loss_and_grad(gspo_loss, logprobs, on_policy, advantages, mask, "seq_mean_token_mean")
    grpo = loss_and_grad(token_clip_loss, logprobs, on_policy, advantages, mask, "token_mean")
    close(gspo[1], grpo[1])


@pytest.mark.parametrize("eps", [(0.05, 0.08), (GSPO_EPS_LOW, GSPO_EPS_HIGH)])
def test_gspo_token_equals_gspo_for_sequence_constant_advantages(eps):
    logprobs, old_logprobs, mask = random_batch(11, lengths=(5, 2, 4, 1, 6, 3), num_positions=6)
    advantages = t([1.0, -1.0, 0.5, -2.0, 0.75, -0.3])
    kwargs = dict(eps_low=eps[0], eps_high=eps[1], dual_clip=None)
    seq = loss_and_grad(gspo_loss, logprobs, old_logprobs, advantages, mask, "seq_mean_token_mean", **kwargs)
    per_token_adv = advantages[:, None].expand_as(logprobs)
    tok = loss_and_grad(gspo_token_loss, logprobs, old_logprobs, per_token_adv, mask, "seq_mean_token_mean", **kwargs)
    close(tok[0], seq[0])
    close(tok[1], seq[1])
    # both clipped and unclipped sequences occur with the wide range: the check covers both branches
    nonzero_rows = (seq[1].abs().sum(-1) > 0).sum().item()
    if eps[0] == 0.05:
        assert 0 < nonzero_rows < len(advantages)
    # with advantages varying within a sequence the two differ
    varying = per_token_adv + torch.linspace(-1, 1, logprobs.shape[1], dtype=F64)
    tok_var = loss_and_grad(
        gspo_token_loss, logprobs, old_logprobs, varying, mask, "seq_mean_token_mean", eps_low=0.5, eps_high=5.0
    )
    seq_wide = loss_and_grad(
        gspo_loss, logprobs, old_logprobs, advantages, mask, "seq_mean_token_mean", eps_low=0.5, eps_high=5.0
    )
    assert (tok_var[1] - seq_wide[1]).abs().max() > 1e-3


# ---- aggregation -----------------------------------------------------------------------------

TOKEN_LOSSES = t([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0]])  # 50, 60 sit on padding
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize(
    "mode, counts, expected",
    [
        ("seq_mean_token_mean", {}, (2.0 + 4.0) / 2),
        ("seq_mean_token_mean", {"num_seqs_global": 4}, (2.0 + 4.0) / 4),
        ("token_mean", {}, 10.0 / 4),
        ("global_token_mean", {"num_loss_tokens_global": 8}, 10.0 / 8),
        ("seq_sum_max_len", {"max_completion_len": 5}, 10.0 / (2 * 5)),
        ("seq_sum_max_len", {"max_completion_len": 5, "num_seqs_global": 4}, 10.0 / (4 * 5)),
    ],
)
def test_aggregation_hand_values(mode, counts, expected):
    close(aggregate(TOKEN_LOSSES, MASK, mode, Counts(**counts)), expected)


def test_aggregations_needing_counts_raise_without_them():
    with pytest.raises(ValueError, match="num_loss_tokens_global"):
        aggregate(TOKEN_LOSSES, MASK, "global_token_mean")
    with pytest.raises(ValueError, match="max_completion_len"):
        aggregate(TOKEN_LOSSES, MASK, "seq_sum_max_len")
    with pytest.raises(ValueError, match="must match"):
        aggregate(TOKEN_LOSSES, MASK[:, :2], "token_mean")


def step_inputs(seed):
    """One optimizer step's batch: 5 sequences, lengths 1..6, padded to 6."""
    logprobs, old_logprobs, mask = random_batch(seed, lengths=(6, 1, 3, 5, 2), num_positions=6)
    g = torch.Generator().manual_seed(seed + 100)
    return dict(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=torch.randn(5, generator=g, dtype=F64),
        mask=mask,
        rollout_logprobs=old_logprobs + 0.3 * torch.randn(5, 6, generator=g, dtype=F64),
        ref_logprobs=logprobs + 0.2 * torch.randn(5, 6, generator=g, dtype=F64),
        entropy=torch.rand(5, 6, generator=g, dtype=F64),
    )


def run_step(inputs, rows, aggregation, counts, loss_type="token_clip"):
    """policy_loss on rows, trimmed to their own longest sequence; returns loss and grad (full size)."""
    num_positions = int(inputs["mask"][rows].sum(-1).max())
    part = {k: v[rows] if v.dim() == 1 else v[rows, :num_positions] for k, v in inputs.items()}
    logprobs = part.pop("logprobs").clone().requires_grad_()
    spec = PolicyLossSpec(
        loss_type=loss_type,
        aggregation=aggregation,
        eps_low=0.2,
        eps_high=0.28,
        is_level="token",
        kl_coef=0.1,
        entropy_coef=0.01,
    )
    loss, _ = policy_loss(
        logprobs,
        part.pop("old_logprobs"),
        part.pop("advantages"),
        part.pop("mask"),
        spec,
        Counts(**counts),
        **part,
    )
    loss.backward()
    grad = torch.zeros_like(inputs["logprobs"])
    grad[rows, :num_positions] = logprobs.grad
    return loss.detach(), grad


@pytest.mark.parametrize("loss_type", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "global_token_mean", "seq_sum_max_len"])
def test_micro_batches_reproduce_full_batch(aggregation, loss_type):
    inputs = step_inputs(12)
    counts = dict(num_seqs_global=5, num_loss_tokens_global=inputs["mask"].sum(), max_completion_len=8)
    full_loss, full_grad = run_step(inputs, [0, 1, 2, 3, 4], aggregation, counts, loss_type)
    micro = [run_step(inputs, rows, aggregation, counts, loss_type) for rows in ([1, 4], [0, 2, 3])]
    close(sum(loss for loss, _ in micro), full_loss)
    close(sum(grad for _, grad in micro), full_grad)


def test_local_token_mean_is_not_accumulation_invariant():
    """The contrast that shows the test above can fail: a local mean weights micro-batches."""
    inputs = step_inputs(12)
    full_loss, _ = run_step(inputs, [0, 1, 2, 3, 4], "token_mean", {})
    micro = [run_step(inputs, rows, "token_mean", {})[0] for rows in ([1, 4], [0, 2, 3])]
    assert abs((sum(micro) / 2 - full_loss).item()) > 1e-3


# ---- KL --------------------------------------------------------------------------------------


def test_kl_hand_values_and_gradients():
    # p = 2 p_ref: d = log 2. k1 = log 2, k2 = 0.5 log^2 2, k3 = 1/2 + log 2 - 1; k3' = 1 - 1/2
    ref_logprobs = t([[-2.0]])
    logprobs = ref_logprobs + math.log(2.0)
    expected = {"k1": (math.log(2), 1.0), "k2": (0.5 * math.log(2) ** 2, math.log(2)), "k3": (math.log(2) - 0.5, 0.5)}
    for name, (value, grad) in expected.items():
        lp = logprobs.clone().requires_grad_()
        kl = kl_per_token(lp, ref_logprobs, torch.ones(1, 1), estimator=name)
        kl.sum().backward()
        close(kl, [[value]])
        close(lp.grad, [[grad]])


def test_k3_gradient_is_one_minus_ref_over_p():
    logprobs, ref_logprobs, mask = random_batch(13)
    logprobs.requires_grad_()
    kl_per_token(logprobs, ref_logprobs, mask, estimator="k3").sum().backward()
    expected = torch.where(mask, 1 - torch.exp(ref_logprobs - logprobs.detach()), 0.0)
    close(logprobs.grad, expected)


@pytest.mark.parametrize("name", sorted(KL_ESTIMATORS))
def test_kl_gradcheck_and_padding(name):
    logprobs, ref_logprobs, mask = random_batch(14)
    ref_logprobs = torch.where(mask, ref_logprobs, -math.inf)
    assert torch.autograd.gradcheck(
        lambda lp: kl_per_token(lp, ref_logprobs, mask, estimator=name), (logprobs.requires_grad_(),)
    )
    kl = kl_per_token(logprobs, ref_logprobs, mask, estimator=name)
    assert torch.isfinite(kl).all() and (kl[~mask] == 0).all()


def test_k3_is_accurate_for_tiny_differences():
    d = 1e-9  # k3 ~ d^2 / 2 = 5e-19; exp(-d) + d - 1 would lose it to cancellation
    kl = kl_per_token(t([[d]]), t([[0.0]]), torch.ones(1, 1), estimator="k3")
    assert abs(kl.item() - 0.5 * d * d) < 1e-3 * 0.5 * d * d


# ---- entropy and value -----------------------------------------------------------------------


def test_entropy_bonus_from_logits_and_precomputed():
    logits = torch.zeros(2, 3, 4)  # uniform over 4 tokens: H = log 4
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, metrics = entropy_bonus(mask, aggregation="token_mean", logits=logits)
    close(loss, -math.log(4), atol=1e-6)
    close(metrics["entropy"], math.log(4), atol=1e-6)
    entropy = t([[1.0, 3.0, 100.0], [4.0, 100.0, 100.0]])
    loss, _ = entropy_bonus(mask, aggregation="seq_mean_token_mean", entropy=entropy)
    close(loss, -(2.0 + 4.0) / 2)
    with pytest.raises(ValueError, match="exactly one"):
        entropy_bonus(mask, aggregation="token_mean")
    with pytest.raises(ValueError, match="exactly one"):
        entropy_bonus(mask, aggregation="token_mean", logits=logits, entropy=entropy)


def test_value_loss_clipping_hand_values():
    # token 0: V=1.5, V_old=1, R=2: clip(V)=1.2; max(0.25, 0.64) -> 0.32, clipped branch: grad 0
    # token 1: V=1.5, V_old=1, R=1: max(0.25, 0.04) -> 0.125, unclipped: grad V - R = 0.5
    values = leaf([[1.5, 1.5, 9.0]])
    returns = t([[2.0, 1.0, math.nan]])  # NaN on padding must not leak
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = value_loss(
        values,
        returns,
        mask,
        aggregation="global_token_mean",
        old_values=t([[1.0, 1.0, 0.0]]),
        clip_eps=0.2,
        counts=Counts(num_loss_tokens_global=2),
    )
    close(loss, (0.32 + 0.125) / 2)
    loss.backward()
    close(values.grad, [[0.0, 0.25, 0.0]])
    close(metrics["value_clip_frac"], 0.5)
    unclipped, _ = value_loss(values.detach(), returns, mask, aggregation="token_mean")
    close(unclipped, (0.125 + 0.125) / 2)
    with pytest.raises(ValueError, match="old_values"):
        value_loss(values, returns, mask, aggregation="token_mean", clip_eps=0.2)


# ---- truncated importance sampling and alignment --------------------------------------------


def test_truncated_is_weights_token_and_sequence():
    old_logprobs = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]]).requires_grad_()
    rollout_logprobs = old_logprobs.detach() - torch.log(t([[0.5, 3.0, 1.0], [0.5, 1.5, 7.0]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    token = truncated_is_weights(old_logprobs, rollout_logprobs, mask, level="token", cap=2.0)
    close(token, [[0.5, 2.0, 1.0], [0.5, 1.5, 0.0]])
    assert not token.requires_grad
    # sequence: exp(sum): row 0 -> 0.5 * 3 * 1 = 1.5; row 1 -> 0.5 * 1.5 = 0.75 (7 is padding)
    seq = truncated_is_weights(old_logprobs, rollout_logprobs, mask, level="sequence", cap=2.0)
    close(seq, [[1.5, 1.5, 1.5], [0.75, 0.75, 0.0]])
    huge = truncated_is_weights(old_logprobs, rollout_logprobs - 400.0, mask, level="sequence")
    close(huge, [[2.0, 2.0, 2.0], [2.0, 2.0, 0.0]])  # exp(1200) would overflow without log-space cap


def test_missing_rollout_logprobs_is_a_clear_error():
    logprobs, old_logprobs, mask = random_batch(15)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        truncated_is_weights(old_logprobs, None, mask)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(
            logprobs,
            old_logprobs,
            t([1.0] * 4),
            mask,
            PolicyLossSpec(
                loss_type="token_clip", aggregation="token_mean", eps_low=0.2, eps_high=0.2, is_level="token"
            ),
        )


def test_is_weights_multiply_the_policy_term():
    inputs = step_inputs(16)
    common = dict(loss_type="token_clip", aggregation="token_mean", eps_low=0.2, eps_high=0.2)
    args = (inputs["logprobs"], inputs["old_logprobs"], inputs["advantages"], inputs["mask"])
    loss, metrics = policy_loss(
        *args, PolicyLossSpec(**common, is_level="token", is_cap=1.2), rollout_logprobs=inputs["rollout_logprobs"]
    )
    weights = truncated_is_weights(inputs["old_logprobs"], inputs["rollout_logprobs"], inputs["mask"], cap=1.2)
    token_losses, _ = token_clip_loss(*args)
    close(loss, aggregate(token_losses * weights, inputs["mask"], "token_mean"))
    valid_weights = weights[inputs["mask"]]
    assert (valid_weights < 1.1).any() and ((valid_weights - 1.2).abs() < 1e-12).any()
    plain, _ = policy_loss(*args, PolicyLossSpec(**common))
    assert abs((plain - loss).item()) > 1e-4


def test_alignment_metrics_hand_values():
    rollout_logprobs = t([[-1.0, -1.0, -1.0, 0.0]])
    logprobs = rollout_logprobs + t([[0.1, -0.3, math.log(3.0), 5.0]])  # last token is padding
    mask = torch.tensor([[1, 1, 1, 0]])
    m = logprob_alignment_metrics(logprobs, rollout_logprobs, mask)
    close(m["rollout_diff_mean"], (0.1 - 0.3 + math.log(3)) / 3)
    close(m["rollout_diff_abs_mean"], (0.1 + 0.3 + math.log(3)) / 3)
    close(m["rollout_diff_abs_max"], math.log(3))
    close(m["rollout_ratio_mean"], (math.exp(0.1) + math.exp(-0.3) + 3.0) / 3)
    close(m["rollout_ratio_frac_high"], 1 / 3)
    close(m["rollout_ratio_frac_low"], 0.0)
    k3 = [math.exp(d) - 1 - d for d in (0.1, -0.3, math.log(3))]
    close(m["rollout_kl_k3"], sum(k3) / 3)


def test_alignment_metrics_detect_a_temperature_mismatch():
    """Logprobs recomputed at the sampling temperature agree with the engine; at T = 1 they do not."""
    g = torch.Generator().manual_seed(22)
    logits = torch.randn(3, 5, 11, generator=g, dtype=F64) * 3
    temperature = 0.7
    tokens = torch.multinomial(torch.softmax(logits / temperature, -1).view(-1, 11), 1, generator=g).view(3, 5)
    rollout_logprobs = selective_log_softmax(logits / temperature, tokens)
    mask = torch.ones(3, 5)
    same = logprob_alignment_metrics(selective_log_softmax(logits / temperature, tokens), rollout_logprobs, mask)
    wrong = logprob_alignment_metrics(selective_log_softmax(logits, tokens), rollout_logprobs, mask)
    assert same["rollout_diff_abs_max"].item() == 0.0
    assert wrong["rollout_diff_abs_mean"].item() > 0.05
    assert wrong["rollout_kl_k3"].item() > 1e-3


# ---- composition -----------------------------------------------------------------------------


def test_policy_loss_is_the_sum_of_its_parts():
    inputs = step_inputs(17)
    mask = inputs["mask"]
    args = (inputs["logprobs"], inputs["old_logprobs"], inputs["advantages"], mask)
    spec = PolicyLossSpec(
        loss_type="gspo_token",
        aggregation="seq_mean_token_mean",
        eps_low=0.1,
        eps_high=0.2,
        kl_coef=0.05,
        kl_estimator="k2",
        entropy_coef=0.01,
    )
    loss, metrics = policy_loss(*args, spec, ref_logprobs=inputs["ref_logprobs"], entropy=inputs["entropy"])
    pg = aggregate(gspo_token_loss(*args, eps_low=0.1, eps_high=0.2)[0], mask, "seq_mean_token_mean")
    kl = aggregate(
        kl_per_token(inputs["logprobs"], inputs["ref_logprobs"], mask, estimator="k2"), mask, "seq_mean_token_mean"
    )
    ent = aggregate(inputs["entropy"], mask, "seq_mean_token_mean")
    close(loss, pg + 0.05 * kl - 0.01 * ent)
    close(metrics["pg_loss"], pg)
    close(metrics["kl"], kl)
    close(metrics["entropy"], ent)
    for key in ("clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min", "ratio_max"):
        assert key in metrics
    assert not any(v.requires_grad for v in metrics.values())


def test_policy_loss_gradcheck_all_terms():
    inputs = step_inputs(21)
    logprobs = inputs.pop("logprobs").requires_grad_()
    old_logprobs, advantages, mask = inputs.pop("old_logprobs"), inputs.pop("advantages"), inputs.pop("mask")

    def objective(lp):
        spec = PolicyLossSpec(
            loss_type="token_clip",
            aggregation="global_token_mean",
            eps_low=0.2,
            eps_high=0.28,
            dual_clip=3.0,
            is_level="sequence",
            kl_coef=0.3,
        )
        return policy_loss(lp, old_logprobs, advantages, mask, spec, Counts(num_loss_tokens_global=40), **inputs)[0]

    assert torch.autograd.gradcheck(objective, (logprobs,), atol=1e-8)


def test_policy_loss_requires_inputs_for_nonzero_coefficients():
    logprobs, old_logprobs, mask = random_batch(18)
    common = dict(loss_type="token_clip", aggregation="token_mean", eps_low=0.2, eps_high=0.2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, old_logprobs, t([1.0] * 4), mask, PolicyLossSpec(**common, kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(logprobs, old_logprobs, t([1.0] * 4), mask, PolicyLossSpec(**common, entropy_coef=0.1))


def test_shape_and_range_errors():
    logprobs, old_logprobs, mask = random_batch(19)
    with pytest.raises(ValueError, match="advantages must be"):
        token_clip_loss(logprobs, old_logprobs, t([1.0, 2.0]), mask)
    with pytest.raises(ValueError, match="same|share"):
        token_clip_loss(logprobs, old_logprobs[:, :2], t([1.0] * 4), mask)
    with pytest.raises(ValueError, match="eps_low"):
        token_clip_loss(logprobs, old_logprobs, t([1.0] * 4), mask, eps_low=1.0)


# ---- registries ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, registry",
    [
        (
            lambda lp, m: policy_loss(
                lp,
                lp,
                t([1.0] * 4),
                m,
                PolicyLossSpec(loss_type="ppo_max", aggregation="token_mean", eps_low=0.2, eps_high=0.2),
            ),
            POLICY_LOSSES,
        ),
        (lambda lp, m: aggregate(lp, m, "sum"), AGGREGATIONS),
        (lambda lp, m: kl_per_token(lp, lp, m, estimator="k4"), KL_ESTIMATORS),
        (lambda lp, m: truncated_is_weights(lp, lp, m, level="seq"), IS_LEVELS),
    ],
)
def test_unknown_registry_names_list_the_valid_ones(call, registry):
    logprobs, _, mask = random_batch(20)
    with pytest.raises(ValueError, match="unknown") as info:
        call(logprobs, mask)
    for name in registry:
        assert repr(name)[1:-1] in str(info.value)
