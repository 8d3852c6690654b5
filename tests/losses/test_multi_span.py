"""Rows whose trained tokens are several separate spans (a multi-turn row: the policy's turns with
environment tokens between them). Every loss, advantage, KL, importance weight and aggregation is
defined on the trained mask: hand-derived values on rows of two and three spans, with values at the
untrained positions chosen so that any leak would show; then the trainer's layout and logprobs on
such rows against an independent full forward.

    row 0: trained [1, 1, 0, 0, 1, 0, 0]   two spans (tokens 0-1 and 4)
    row 1: trained [1, 0, 1, 0, 1, 1, 0]   three spans (0, 2, 4-5)
"""

from __future__ import annotations

import math

import pytest
import torch

from lmforge import rl
from lmforge.core.config import ModelConfig
from lmforge.losses.advantages import gae, whiten_advantages
from lmforge.losses.policy import Counts, PolicyLossSpec, aggregate, kl_per_token, policy_loss, truncated_is_weights
from lmforge.model.load import load_model
from lmforge.recipes.ppo import terminal_rewards
from lmforge.rollout import RolloutBatch
from lmforge.runtime.optim import Precision, logits_at

F64 = torch.float64
MASK = torch.tensor([[1, 1, 0, 0, 1, 0, 0], [1, 0, 1, 0, 1, 1, 0]])
JUNK = 99.0  # at every untrained position


def spread(row0: list[float], row1: list[float], junk: float = JUNK) -> torch.Tensor:
    """(2, 7) float64 with the trained positions of each row set to the given values, ``junk`` elsewhere."""
    out = torch.full(MASK.shape, junk, dtype=F64)
    out[0][MASK[0].bool()] = torch.tensor(row0, dtype=F64)
    out[1][MASK[1].bool()] = torch.tensor(row1, dtype=F64)
    return out


def close(actual, expected, atol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


def test_spans_are_numbered_per_row():
    assert rl.trained_spans(MASK).tolist() == [[1, 1, 0, 0, 2, 0, 0], [1, 0, 2, 0, 3, 3, 0]]


@pytest.mark.parametrize(
    "mode, counts, expected",
    [
        ("seq_mean_token_mean", {}, ((1 + 2 + 3) / 3 + (4 + 5 + 6 + 7) / 4) / 2),  # 3.75
        ("token_mean", {}, 28 / 7),  # the 7 trained tokens, not the 14 positions
        ("global_token_mean", {"num_loss_tokens_global": 14}, 28 / 14),  # e.g. two ranks of 7
        ("seq_sum_max_len", {"max_completion_len": 8}, 28 / (2 * 8)),
    ],
)
def test_aggregations_count_trained_tokens_only(mode, counts, expected):
    losses = spread([1, 2, 3], [4, 5, 6, 7])
    close(aggregate(losses, MASK, mode, Counts(**counts)), expected)


def test_token_clip_with_sequence_advantages_broadcast_over_every_span():
    """Per-sequence advantages A = (1, -2) on every trained token of the row; ratios r per token;
    junk ratios e^5 at untrained positions. Clip 0.2 / 0.2, seq-mean-token-mean."""
    log_ratios = spread(
        [math.log(1.1), math.log(0.7), math.log(1.5)], [math.log(0.5), 0.0, math.log(1.3), math.log(0.9)], junk=5.0
    )
    old = torch.zeros(MASK.shape, dtype=F64)
    logprobs = log_ratios.clone().requires_grad_()
    loss, metrics = policy_loss(
        logprobs,
        old,
        torch.tensor([1.0, -2.0], dtype=F64),
        MASK,
        PolicyLossSpec(loss_type="token_clip", aggregation="seq_mean_token_mean", eps_low=0.2, eps_high=0.2),
    )
    # row 0, A = 1: -min(rA, clip(r) A) = -1.1, -0.7, -1.2; row 1, A = -2: max(2r, 2 clip(r)) = 1.6, 2.0, 2.6, 1.8
    close(loss, ((-1.1 - 0.7 - 1.2) / 3 + (1.6 + 2.0 + 2.6 + 1.8) / 4) / 2)
    close(metrics["ratio_mean"], (1.1 + 0.7 + 1.5 + 0.5 + 1.0 + 1.3 + 0.9) / 7)
    loss.backward()
    grad = logprobs.grad
    assert (grad[~MASK.bool()] == 0).all()  # no gradient reaches an environment token
    # unclipped tokens: d(-r A)/d logp = -r A, times the aggregation weight 1 / (n_row * B)
    close(grad[0, 0], -1.1 / 6)
    close(grad[0, 1], -0.7 / 6)
    close(grad[0, 4], 0.0)  # r = 1.5 > 1.2 with A > 0: clipped
    close(grad[1, 0], 0.0)  # r = 0.5 < 0.8 with A < 0: clipped
    close(grad[1, 2], 2 * 1.0 / 8)  # A < 0, r = 1: inside the clip range
    close(grad[1, 4], 2 * 1.3 / 8)  # A < 0, r = 1.3 > 1.2: the unclipped term is the larger loss


def test_gspo_sequence_ratio_is_the_mean_over_all_spans():
    log_ratios = spread(
        [math.log(1.1), math.log(0.7), math.log(1.5)], [math.log(0.5), 0.0, math.log(1.3), math.log(0.9)], junk=5.0
    )
    old = torch.zeros(MASK.shape, dtype=F64)
    eps_low, eps_high = 3e-4, 4e-4
    loss, _ = policy_loss(
        log_ratios,
        old,
        torch.tensor([1.0, -2.0], dtype=F64),
        MASK,
        PolicyLossSpec(loss_type="gspo", aggregation="seq_mean_token_mean", eps_low=eps_low, eps_high=eps_high),
    )
    s0 = (1.1 * 0.7 * 1.5) ** (1 / 3)  # 1.049: clipped to 1 + eps_high with A > 0
    s1 = (0.5 * 1.0 * 1.3 * 0.9) ** (1 / 4)  # 0.875: A < 0, the clipped 1 - eps_low gives the larger loss
    assert s0 > 1 + eps_high and s1 < 1 - eps_low
    close(loss, (-(1 + eps_high) * 1.0 + 2.0 * (1 - eps_low)) / 2)


def test_kl_and_importance_weights_over_spans():
    logprobs = spread([-1.0, -2.0, -0.5], [-1.5, -0.25, -3.0, -1.0], junk=-50.0)
    ref = spread([-1.5, -2.0, -0.25], [-1.0, -0.75, -3.0, -2.0], junk=0.0)
    kl = kl_per_token(logprobs, ref, MASK, estimator="k3")
    d = ref - logprobs
    close(kl[MASK.bool()], (d.exp() - d - 1)[MASK.bool()])
    assert (kl[~MASK.bool()] == 0).all()
    rollout = spread([-1.25, -2.0, -0.5], [-1.5, -0.5, -3.5, -1.0], junk=7.0)
    token = truncated_is_weights(logprobs, rollout, MASK, level="token", cap=2.0)
    close(token[0][MASK[0].bool()], [math.exp(0.25), 1.0, 1.0])
    assert (token[~MASK.bool()] == 0).all()
    sequence = truncated_is_weights(logprobs, rollout, MASK, level="sequence", cap=10.0)
    # the product of the row's token ratios over all its spans, on each of its trained tokens
    close(sequence[0][MASK[0].bool()], [math.exp(0.25)] * 3)
    close(sequence[1][MASK[1].bool()], [math.exp(0.25 + 0.5)] * 4)
    assert (sequence[~MASK.bool()] == 0).all()


def test_gae_steps_over_trained_tokens_only():
    """The episode's reward sits on the row's last trained token; an environment token is no time
    step: discounting and bootstrapping skip it. Values at untrained positions are junk (9)."""
    rewards = terminal_rewards(torch.tensor([1.0, 2.0]), MASK)
    assert rewards.tolist() == [[0, 0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 2, 0]]
    values = spread([0.1, 0.2, 0.4], [0.5, 0.25, 0.5, 1.0], junk=9.0)
    advantages, returns = gae(rewards, values, MASK, gamma=0.5, lam=0.5)
    # row 0, over steps (0, 1, 4): A4 = 1 - 0.4 = 0.6; d1 = 0.5 * 0.4 - 0.2 = 0, A1 = 0.25 * 0.6;
    # d0 = 0.5 * 0.2 - 0.1 = 0, A0 = 0.25 * A1
    close(advantages[0], [0.0375, 0.15, 0, 0, 0.6, 0, 0])
    close(returns[0], [0.1375, 0.35, 0, 0, 1.0, 0, 0])
    advantages, _ = gae(rewards, values, MASK, gamma=1.0, lam=1.0)
    close(advantages[1], [1.5, 0, 1.75, 0, 1.5, 1.0, 0])  # A_t = R - V_t
    whitened = whiten_advantages(advantages, MASK)
    assert (whitened[~MASK.bool()] == 0).all()
    close(whitened[MASK.bool()].mean(), 0.0)


# ----------------------------------------------------------------------------- the trainer's layout


def tiny():
    return load_model(
        ModelConfig(
            name="tiny:llama",
            tokenizer="char",
            hidden_size=32,
            num_layers=2,
            num_heads=2,
            max_position_embeddings=32,
            init_seed=0,
        )
    )


def multi_span_rollout(pad: int) -> RolloutBatch:
    """2 prompts x 2 rows (shared prompts, as a group's); completions mix trained and environment tokens."""
    completions = [[8, 9, 20, 21, 10], [11, 22, 12, 13], [14, 19, 18, 15, 16, 17], [12, 21]]  # ids < 23
    trained = [[1, 1, 0, 0, 1], [1, 0, 1, 1], [1, 0, 0, 1, 1, 0], [1, 0]]
    width = max(map(len, completions))
    ids = torch.full((4, width), pad)
    real = torch.zeros(4, width, dtype=torch.long)
    mask = torch.zeros(4, width, dtype=torch.long)
    for b, (c, t) in enumerate(zip(completions, trained)):
        ids[b, : len(c)], real[b, : len(c)], mask[b, : len(t)] = torch.tensor(c), 1, torch.tensor(t)
    prompt_ids = torch.tensor([[3, 4, 5], [3, 4, 5], [pad, 6, 7], [pad, 6, 7]])
    prompt_mask = (torch.arange(3)[None, :] >= torch.tensor([0, 0, 1, 1])[:, None]).long()
    return RolloutBatch(
        prompt_ids,
        prompt_mask,
        ids,
        real,
        torch.zeros(4, width),
        torch.tensor([0, 0, 1, 1]),
        prompt_mask.sum(1),
        real.sum(1),
        torch.zeros(4, dtype=torch.bool),
        trained_mask=mask,
    )


def test_packed_logprobs_are_those_of_a_full_forward_at_the_trained_tokens():
    """Independent formulation: each row's real tokens through the model in one plain forward,
    log_softmax at the position before each trained token. Both trainer paths (packed rows, and each
    prompt once with its KV cache shared by the group's rows) must give it, and 0 elsewhere."""
    model, tokenizer = tiny()
    model.eval()
    rollout = multi_span_rollout(tokenizer.pad_token_id)
    batch = rl.pack_rollout(rollout, tokenizer.pad_token_id, need_rollout_logprobs=False)
    expected = torch.zeros(batch.trained_mask.shape)
    for b in range(4):
        prompt = rollout.prompt_ids[b][rollout.prompt_mask[b].bool()]
        completion = rollout.completion_ids[b][rollout.completion_mask[b].bool()]
        row = torch.cat([prompt, completion])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(row[None]).logits[0].float(), -1)
        for t in rollout.trained_mask[b].nonzero().flatten().tolist():
            expected[b, t] = logprobs[len(prompt) + t - 1, completion[t]]
    precision = Precision(torch.device("cpu"), torch.float32)
    assert rl.shares_prompts(model, batch)
    shared = rl.batch_logprobs(model, batch, 4, 1.0, precision)
    torch.testing.assert_close(shared, expected, rtol=0, atol=1e-5)
    with torch.no_grad():
        packed = logits_at(model, batch.input_ids, batch.attention_mask, batch.positions)
    torch.testing.assert_close(rl.completion_logprobs(packed, batch, 1.0)[0], expected, rtol=0, atol=1e-5)
    assert int(batch.positions.sum()) == int(rollout.trained_mask.sum()) == 10
    assert rl.global_counts(batch, 8).num_loss_tokens_global == 10  # trained tokens, not the 17 real ones


def test_a_trained_mask_outside_the_completion_is_refused():
    rollout = multi_span_rollout(0)
    bad = rollout.trained_mask.clone()
    bad[3, 4] = 1  # row 3 has 2 tokens: position 4 is padding
    from lmforge.core.errors import TrainingError

    with pytest.raises(TrainingError, match="outside completion_mask"):
        rl.pack_rollout(RolloutBatch(**{**rollout.__dict__, "trained_mask": bad}), 0, need_rollout_logprobs=False)
