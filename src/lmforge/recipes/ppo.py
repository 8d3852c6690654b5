"""``lmforge ppo CONFIG``: PPO from verifiable rewards with a value head and GAE.

One step: sample ``rollout.group_size`` completions for each of the next prompts and score them;
one no-grad pass gives the rollout-time logprobs and values; each completion's reward is placed on
its last token (minus ``algo.kl_coef`` times the per-token KL to the reference, when on); GAE turns
these into per-token advantages and value targets; the advantages are whitened over the batch;
then ``algo.num_iterations`` passes of ``algo.num_mini_batches`` updates minimise the clipped
policy loss plus ``algo.value_coef`` times the clipped value loss.

The critic is a linear value head on the policy's last hidden state (shared body, as in the early
RLHF implementations): cheap, and one forward gives logits and values. It is saved in each
checkpoint's trainer state and as ``final/value_head.pt``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

import torch

from .. import rl
from ..core.config import LoggingConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, opt, section
from ..core.errors import ConfigError
from ..core.ops import masked_mean, masked_sum
from ..losses.advantages import gae, whiten_advantages
from ..losses.policy import Counts, PolicyLossSpec, kl_per_token, policy_loss, value_loss
from ..parallel.context import ParallelContext
from ..parallel.wrap import full_state_dict, is_sharded, run_forward
from ..rl import config as rl_config
from ..runtime.optim import PLAIN_HEAD_MODELS, decoder_of

# Policy losses that take per-token advantages (B, T); plain "gspo" needs one per sequence.
PER_TOKEN_ADVANTAGE_LOSSES = ("token_clip", "gspo_token")


@dataclasses.dataclass
class PPOAlgoConfig(rl_config.PolicyConfig):
    kl_coef: float | None = opt(
        None, "per-token KL penalty in the reward, against the starting policy (loaded only when > 0; unset: 0)"
    )
    kl_estimator: str = opt("k1", "estimator of the KL penalty in the reward: k1, k2, k3")
    gamma: float = opt(1.0, "GAE discount")
    lam: float = opt(0.95, "GAE lambda")
    value_coef: float = opt(0.1, "weight of the value loss (the critic shares the policy's body)")
    value_clip: float | None = opt(0.2, "clip the value update around the rollout-time value (null = off)")
    whiten: bool = opt(True, "whiten the GAE advantages over the batch's completion tokens")

    def resolved(self) -> "PPOAlgoConfig":
        algo = rl_config.resolve_algo(self, rl_config.POLICY_DEFAULTS)
        if algo.loss_type not in PER_TOKEN_ADVANTAGE_LOSSES:
            raise ConfigError(
                f"ppo has per-token advantages; algo.loss_type must be one of "
                f"{', '.join(PER_TOKEN_ADVANTAGE_LOSSES)}, got {algo.loss_type!r}"
            )
        if not (0.0 <= algo.gamma <= 1.0 and 0.0 <= algo.lam <= 1.0):
            raise ConfigError(f"algo.gamma and algo.lam must lie in [0, 1], got {algo.gamma}, {algo.lam}")
        if algo.value_clip is not None and algo.value_clip <= 0:
            raise ConfigError(f"algo.value_clip must be > 0 (or null), got {algo.value_clip}")
        return algo


@dataclasses.dataclass
class PPOConfig:
    model: ModelConfig = section(ModelConfig, "policy to train (also the KL reference when algo.kl_coef > 0)")
    data: rl_config.RLDataConfig = section(rl_config.RLDataConfig, "prompts")
    rollout: rl_config.RolloutConfig = section(rl_config.RolloutConfig, "sampling")
    rewards: rl_config.RewardsConfig = section(rl_config.RewardsConfig, "reward functions")
    env: rl_config.EnvConfig = section(
        rl_config.EnvConfig, "multi-turn environment and its limits (env.name '' = single-turn; docs/environments.md)"
    )
    algo: PPOAlgoConfig = section(PPOAlgoConfig, "GAE, policy and value losses")
    optim: OptimConfig = section(OptimConfig, "optimizer and LR schedule (one scheduler step per update)")
    train: TrainConfig = section(TrainConfig, "loop, evaluation and checkpoints (max_steps = RL steps)")
    parallel: ParallelConfig = section(ParallelConfig, "processes under torchrun (docs/distributed.md)")
    logging: LoggingConfig = section(LoggingConfig, "progress and metrics sinks")


class ValueHead(torch.nn.Module):
    """V(s_t) = w . h_t + b on the last hidden state; zero-initialised, so the first values are 0."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, H) -> (N,)
        return self.linear(hidden.float()).squeeze(-1)


def _hidden_and_logits(model, value_head: ValueHead, batch: rl.TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, H) last hidden states at the completion-predicting positions and (N,) values there."""
    hidden = decoder_of(model)(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    hidden = hidden[batch.positions]  # (N, H)
    return model.get_output_embeddings()(hidden), value_head(hidden)  # (N, V), (N,)


def policy_and_values(
    model,
    value_head: ValueHead,
    batch: rl.TrainBatch,
    temperature: float,
    precision,
    entropy_grad: bool = False,
    wrapped=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs, entropy and values, each (B, C), of the completion tokens from one forward pass
    (through ``wrapped``, the parallel root, when given).

    values[b, t] is the critic's estimate at the position that predicts completion token t, i.e.
    V(s_t) before emitting it, as ``gae`` expects.
    """
    if decoder_of(model) is None or model.config.model_type not in PLAIN_HEAD_MODELS:
        raise ConfigError(
            f"ppo's value head needs a model whose logits are lm_head(last hidden state) "
            f"({', '.join(sorted(PLAIN_HEAD_MODELS))}); got {model.config.model_type!r}"
        )
    with precision.autocast():
        if wrapped is None:
            logits, values = _hidden_and_logits(model, value_head, batch)
        else:
            logits, values = run_forward(wrapped, _hidden_and_logits, model, value_head, batch)
    logprobs, entropy = rl.completion_logprobs(logits, batch, temperature, entropy_grad)
    return logprobs, entropy, rl.scatter_completion(values, batch.trained_mask.bool())


def terminal_rewards(rewards: torch.Tensor, trained_mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence rewards -> (B, C) per-token rewards: each on its row's last trained token (the
    policy's last action; environment tokens after it, if any, are not actions). A row with no
    trained token puts it on column 0, which GAE skips as it skips every untrained position."""
    last = rl.trained_ends(trained_mask).clamp(min=1) - 1  # (B,) index of the last trained token
    return torch.zeros(trained_mask.shape, dtype=torch.float32, device=trained_mask.device).scatter(
        1, last[:, None], rewards.float()[:, None]
    )


def episode_rewards(
    rewards: torch.Tensor, turn_rewards: torch.Tensor | None, trained_mask: torch.Tensor
) -> torch.Tensor:
    """(B,) rewards -> (B, C) per-token rewards: an environment's per-turn parts ``turn_rewards`` (B, C),
    already on the last policy token of their turn, and the rest of each reward on the row's last
    trained token (:func:`terminal_rewards`). Without per-turn parts (None), all at the end."""
    if turn_rewards is None:
        return terminal_rewards(rewards, trained_mask)
    turn = turn_rewards.to(device=trained_mask.device, dtype=torch.float32)
    return terminal_rewards(rewards.to(trained_mask.device).float() - turn.sum(1), trained_mask) + turn


@torch.no_grad()
def add_targets(
    model,
    value_head: ValueHead,
    ref_model,
    algo: PPOAlgoConfig,
    batch: rl.TrainBatch,
    rewards: torch.Tensor,
    temperature: float,
    micro_batch_size: int,
    precision,
    wrapped=None,
    ctx: ParallelContext | None = None,
    turn_rewards: torch.Tensor | None = None,
) -> tuple[rl.TrainBatch, dict]:
    """``batch`` with its old logprobs and values, advantages and returns from (B,) ``rewards`` (an
    environment's per-turn parts of them, ``turn_rewards`` (B, C), credited on their turns).

    PPO always needs this no-grad pass (GAE needs the rollout-time values), so its old logprobs
    come from it at no extra cost, on-policy or not. GAE runs over the trained tokens only: an
    environment token inside a row is no time step. The whitening statistics are over all ranks'
    trained tokens (``ctx``). Returns the new batch and KL / advantage metrics.
    """
    ctx = ctx or ParallelContext()
    parts = [
        policy_and_values(model, value_head, batch.select(rows), temperature, precision, wrapped=wrapped)
        for rows in torch.arange(batch.num_rows).split(micro_batch_size)
    ]
    old_logprobs = torch.cat([p[0] for p in parts])
    old_values = torch.cat([p[2] for p in parts])
    mask = batch.trained_mask
    token_rewards = episode_rewards(rewards.to(mask.device), turn_rewards, mask)
    metrics = {}
    if ref_model is not None:
        ref_logprobs = rl.batch_logprobs(ref_model, batch, micro_batch_size, temperature, precision)
        kl = kl_per_token(old_logprobs, ref_logprobs, mask, estimator=algo.kl_estimator)
        token_rewards = token_rewards - algo.kl_coef * kl
        metrics["kl"] = masked_mean(kl, mask.float())
    advantages, returns = gae(token_rewards, old_values, mask, gamma=algo.gamma, lam=algo.lam)
    metrics["advantage_abs_mean"] = masked_mean(advantages.abs(), mask.float())
    metrics["return_mean"] = masked_mean(returns, mask.float())
    if algo.whiten:
        advantages = whiten_over_ranks(advantages, mask, ctx)
    return batch.with_(
        old_logprobs=old_logprobs, old_values=old_values, advantages=advantages, returns=returns
    ), metrics


def whiten_over_ranks(
    advantages: torch.Tensor, mask: torch.Tensor, ctx: ParallelContext, std_eps: float = 1e-8
) -> torch.Tensor:
    """``whiten_advantages`` with the mean and the sample std of every rank's valid tokens (two
    all-reduces); one process calls ``whiten_advantages`` itself."""
    if not ctx.distributed:
        return whiten_advantages(advantages, mask, std_eps=std_eps)
    valid = mask.bool()
    weights = valid.to(advantages.dtype)
    totals = ctx.all_reduce(torch.stack([masked_sum(advantages, weights), weights.sum()]).double())
    mean = (totals[0] / totals[1].clamp(min=1)).to(advantages.dtype)
    centred = torch.where(valid, advantages - mean, 0.0)
    squares = ctx.all_reduce(masked_sum(centred**2, weights).double().reshape(1))[0]
    std = (squares / (totals[1] - 1).clamp(min=1)).sqrt().to(advantages.dtype)
    return torch.where(valid, centred / (std + std_eps), 0.0)


def micro_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    values: torch.Tensor,
    batch: rl.TrainBatch,
    spec: PolicyLossSpec,
    algo: PPOAlgoConfig,
    counts: Counts,
) -> tuple[torch.Tensor, dict]:
    """Clipped policy loss + value_coef x clipped value loss of one micro-batch from its forward's (B, C)
    ``logprobs``, ``entropy`` and ``values`` (global ``counts``; ``spec`` without a KL term: PPO's KL to
    the reference is in the reward)."""
    pg_loss, metrics = policy_loss(
        logprobs,
        batch.old_logprobs,
        batch.advantages,
        batch.trained_mask,
        spec,
        counts,
        rollout_logprobs=batch.rollout_logprobs,
        entropy=entropy,
    )
    v_loss, v_metrics = value_loss(
        values,
        batch.returns,
        batch.trained_mask,
        aggregation=spec.aggregation,
        old_values=batch.old_values,
        clip_eps=algo.value_clip,
        counts=counts,
    )
    return pg_loss + algo.value_coef * v_loss, {**metrics, **v_metrics}


def ppo_step(
    state: rl.RLState, value_head: ValueHead, algo: PPOAlgoConfig, spec: PolicyLossSpec, plan: rl.UpdatePlan, step: int
) -> dict:
    """Sample, score, pack, GAE targets (pi_old and values from one no-grad pass), then the updates: for
    each update, for each micro-batch, forward, loss and backward; then the optimizer step. Returns the
    step's metrics."""
    model, wrapped, precision = state.model, state.train.wrapped, state.updater.precision
    temperature = state.rollout.temperature
    scored = state.source.next_batch(step)  # this rank's rows, scored (lmforge.rl.sources)
    metrics = dict(scored.metrics)
    start = time.perf_counter()
    batch = rl.pack_rollout(scored.rollout, state.tokenizer.pad_token_id, need_rollout_logprobs=algo.is_level != "none")
    batch = batch.to(state.run.device)
    batch, target_metrics = add_targets(
        model,
        value_head,
        state.ref_model,
        algo,
        batch,
        scored.rewards.total,
        temperature,
        state.micro_batch_size,
        precision,
        wrapped=wrapped,
        ctx=state.run.ctx,
        turn_rewards=scored.rewards.turn_rewards,
    )
    metrics.update(rl.reduce_rollout_metrics(target_metrics, state.run.ctx))
    updates = rl.Updates(batch, plan, state.updater, step, state.run.ctx, wrapped)
    for update in updates:
        for micro in update:
            logprobs, entropy, values = policy_and_values(
                model, value_head, micro, temperature, precision, entropy_grad=spec.entropy_coef != 0, wrapped=wrapped
            )
            loss, micro_metrics = micro_loss(logprobs, entropy, values, micro, spec, algo, update.counts)
            update.backward(loss, micro_metrics)
        update.step()
    return {
        **metrics,
        **updates.metrics(),
        "time_training": time.perf_counter() - start,
        "num_tokens": int(batch.attention_mask.sum()) * algo.num_iterations,
        "num_flops": rl.step_flops(
            model,
            batch,
            state.micro_batch_size,
            algo.num_iterations,
            1 + int(state.ref_model is not None),
            share_prompts=False,
        ),
    }


def make_step(state: rl.RLState, value_head: ValueHead, algo: PPOAlgoConfig) -> Callable[[int], dict]:
    """The run's ``step -> metrics``: :func:`ppo_step` with the loss spec and update plan built once. The
    spec has no KL term: the KL to the reference is in the reward (``add_targets``), never also in the loss.
    pi_old comes from ``add_targets``'s pass for every update."""
    spec = dataclasses.replace(rl_config.policy_spec(algo), kl_coef=0.0)
    plan = rl.UpdatePlan(
        algo.num_iterations, algo.num_mini_batches, state.micro_batch_size, state.rollout.max_new_tokens
    )
    return lambda step: ppo_step(state, value_head, algo, spec, plan, step)


def run_ppo(cfg: PPOConfig, model=None, tokenizer=None, console=None, name: str = "ppo") -> dict:
    """Train with PPO; returns the final metrics (``accuracy``, ``accuracy_before`` for tasks) and ``run_dir``."""
    algo = cfg.algo.resolved()
    if model is None:
        from ..model.load import load_model

        model, tokenizer = load_model(cfg.model)
    value_head = ValueHead(model.config.hidden_size)
    state = rl.prepare(cfg, name, algo, model, tokenizer, console, extra_modules={"value_head": value_head})
    if "value_head" in state.train.saved and not state.train.saved.get("strategy") == "fsdp2":
        value_head.load_state_dict(state.train.saved["value_head"])  # (FSDP2: restored from dcp/ with the model)
    state.run.print(f"[algo] {rl_config.describe_algo(algo)}")

    sharded = is_sharded(state.train.wrapped)

    def value_head_state() -> dict:
        return full_state_dict(state.train.wrapped, "value_head")  # (a collective under FSDP2)

    def save_value_head(final_dir: Path) -> None:
        torch.save(final_value_head, final_dir / "value_head.pt")

    final_value_head: dict = {}

    def extra_state() -> dict:
        nonlocal final_value_head
        final_value_head = value_head_state()
        return {} if sharded else {"value_head": final_value_head}

    return rl.train_rl(state, make_step(state, value_head, algo), extra_state=extra_state, save_extra=save_value_head)
