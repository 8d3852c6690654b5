"""``lmforge grpo CONFIG``: group-relative policy optimisation from verifiable rewards.

One step: take the next ``rollout.num_prompts`` prompts (a seeded order that resumes exactly),
sample ``rollout.group_size`` completions for each, score them, turn the rewards into group-relative
advantages, then make ``algo.num_iterations`` passes of ``algo.num_mini_batches`` optimizer
updates over the batch with the clipped policy loss on completion tokens. Presets name the usual
combinations (GRPO, Dr. GRPO, DAPO, GSPO, RLOO); docs/rl-recipes.md explains each key.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import torch

from .. import rl
from ..core.config import LoggingConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, opt, section
from ..core.errors import ConfigError
from ..losses.advantages import ADVANTAGES, STD_NORMALISED, compute_advantages
from ..losses.policy import Counts, PolicyLossSpec, policy_loss
from ..rl import config as rl_config

# Named combinations of algo keys; an explicitly set key always wins over its preset value.
PRESETS: dict[str, dict] = {
    # DeepSeekMath GRPO (Shao et al. 2024): std-normalised group advantages, per-sequence token
    # mean, symmetric clip, k3 KL to the reference with weight 0.04.
    "grpo": {
        "advantage": "group_norm",
        "loss_type": "token_clip",
        "aggregation": "seq_mean_token_mean",
        "eps_low": 0.2,
        "eps_high": 0.2,
        "kl_coef": 0.04,
    },
    # Dr. GRPO (Liu et al. 2025): no std division, no per-sequence length normalisation, no KL.
    "dr_grpo": {
        "advantage": "group_mean",
        "loss_type": "token_clip",
        "aggregation": "seq_sum_max_len",
        "eps_low": 0.2,
        "eps_high": 0.2,
        "kl_coef": 0.0,
    },
    # DAPO (Yu et al. 2025): clip-higher and a token mean over the whole update, no KL. (Dynamic
    # sampling and overlong shaping are not implemented; zero-variance groups are only counted.)
    "dapo": {
        "advantage": "group_norm",
        "loss_type": "token_clip",
        "aggregation": "global_token_mean",
        "eps_low": 0.2,
        "eps_high": 0.28,
        "kl_coef": 0.0,
    },
    # GSPO (Zheng et al. 2025): clipped sequence ratio; its clip range 3e-4 / 4e-4 comes with the loss.
    "gspo": {"advantage": "group_norm", "loss_type": "gspo", "aggregation": "seq_mean_token_mean", "kl_coef": 0.0},
    # RLOO (Ahmadian et al. 2024): leave-one-out baseline; sequence log-prob sums (a constant
    # normaliser), as in its sequence-level REINFORCE objective.
    "rloo": {
        "advantage": "rloo",
        "loss_type": "token_clip",
        "aggregation": "seq_sum_max_len",
        "eps_low": 0.2,
        "eps_high": 0.2,
        "kl_coef": 0.0,
    },
}
GRPO_DEFAULTS = {**rl_config.POLICY_DEFAULTS, "advantage": "group_norm"}


@dataclasses.dataclass
class GRPOAlgoConfig(rl_config.PolicyConfig):
    preset: str = opt("", f"named combination: {', '.join(PRESETS)} ('' = none); explicit keys win")
    advantage: str | None = opt(None, f"advantage estimator: {', '.join(ADVANTAGES)} (unset: preset, else group_norm)")
    std_eps: float = opt(1e-6, "added to the std by the std-normalising estimators (group_norm, batch_norm)")
    skip_zero_advantage: bool = opt(
        True,
        "do not run rows whose advantage is 0 (e.g. groups that all scored "
        "the same) when the loss has no KL or entropy term: their gradient is "
        "exactly 0, so the update is the same for less compute",
    )

    def resolved(self) -> "GRPOAlgoConfig":
        if self.preset and self.preset not in PRESETS:
            raise ConfigError(f"algo.preset={self.preset!r} is not known; valid: {', '.join(PRESETS)} ('' = none)")
        return rl_config.resolve_algo(self, GRPO_DEFAULTS, PRESETS.get(self.preset, {}))


@dataclasses.dataclass
class GRPOConfig:
    model: ModelConfig = section(ModelConfig, "policy to train (also the KL reference when algo.kl_coef > 0)")
    data: rl_config.RLDataConfig = section(rl_config.RLDataConfig, "prompts")
    rollout: rl_config.RolloutConfig = section(rl_config.RolloutConfig, "sampling")
    rewards: rl_config.RewardsConfig = section(rl_config.RewardsConfig, "reward functions")
    env: rl_config.EnvConfig = section(
        rl_config.EnvConfig, "multi-turn environment and its limits (env.name '' = single-turn; docs/environments.md)"
    )
    algo: GRPOAlgoConfig = section(GRPOAlgoConfig, "advantages and policy loss")
    optim: OptimConfig = section(OptimConfig, "optimizer and LR schedule (one scheduler step per update)")
    train: TrainConfig = section(TrainConfig, "loop, evaluation and checkpoints (max_steps = RL steps)")
    parallel: ParallelConfig = section(ParallelConfig, "processes under torchrun (docs/distributed.md)")
    logging: LoggingConfig = section(LoggingConfig, "progress and metrics sinks")


def advantages_of(
    rewards: torch.Tensor, algo: GRPOAlgoConfig, group_size: int, episode_index: torch.Tensor | None = None
):
    """(B,) rewards -> (B,) advantages and metrics (zero-variance groups are counted, advantage 0).

    With ``episode_index`` (B,) (an agent's episodes may give several rows each: RolloutBatch), the
    groups are of episodes: each episode's reward (that of its first row) is compared with its group's,
    and its advantage shared by its rows; a row of episode -1 (padding) gets 0."""
    options = {"std_eps": algo.std_eps} if algo.advantage in STD_NORMALISED else {}
    if episode_index is None:
        return compute_advantages(algo.advantage, rewards, group_size, **options)
    real = episode_index >= 0
    rows = real.nonzero()[:, 0]
    first = torch.full((int(episode_index.max()) + 1,), len(real), dtype=torch.long)
    first.scatter_reduce_(0, episode_index[rows], rows, reduce="amin")  # each episode's first row
    per_episode, metrics = compute_advantages(algo.advantage, rewards[first], group_size, **options)
    return torch.where(real, per_episode[episode_index.clamp(min=0)], 0.0), metrics


def micro_loss(
    logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: rl.TrainBatch, spec: PolicyLossSpec, counts: Counts
) -> tuple[torch.Tensor, dict]:
    """Policy loss of one micro-batch from its (B, C) ``logprobs`` (with gradient) and ``entropy``,
    normalised by its update's global ``counts``."""
    # On-policy (one pass, one update, batch.old_logprobs None): the weights have not moved since
    # sampling, so pi_old is this forward pass itself. Detached, it gives ratio 1 and the plain
    # policy gradient, and saves a second forward over the batch.
    old_logprobs = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs
    return policy_loss(
        logprobs,
        old_logprobs,
        batch.advantages,
        batch.trained_mask,
        spec,
        counts,
        rollout_logprobs=batch.rollout_logprobs,
        ref_logprobs=batch.ref_logprobs,
        entropy=entropy,
    )


def grpo_step(state: rl.RLState, algo: GRPOAlgoConfig, spec: PolicyLossSpec, plan: rl.UpdatePlan, step: int) -> dict:
    """Sample, score, compute advantages, pack, reference and pi_old logprobs, then the updates: for each
    update, for each micro-batch, forward, loss and backward; then the optimizer step. Returns the step's
    metrics."""
    model, wrapped, precision = state.model, state.train.wrapped, state.updater.precision
    temperature = state.rollout.temperature
    scored = state.source.next_batch(step)  # this rank's rows, scored (lmforge.rl.sources)
    start = time.perf_counter()
    advantages, adv_metrics = advantages_of(
        scored.rewards.total, algo, state.rollout.group_size, scored.rollout.episode_index
    )
    adv_metrics = rl.reduce_rollout_metrics(adv_metrics, state.run.ctx)
    batch = rl.pack_rollout(scored.rollout, state.tokenizer.pad_token_id, need_rollout_logprobs=algo.is_level != "none")
    batch = batch.with_(advantages=advantages).to(state.run.device)
    flops = rl.sampling_flops(model, batch)
    if state.ref_model is not None:
        batch = batch.with_(
            ref_logprobs=rl.batch_logprobs(state.ref_model, batch, state.micro_batch_size, temperature, precision)
        )
        flops += rl.batch_forward_flops(model, batch, state.micro_batch_size)
    # Zero-advantage rows add nothing to a loss without KL or entropy terms: they are not run.
    skip = algo.skip_zero_advantage and state.ref_model is None and algo.entropy_coef == 0
    informative = rl.informative_rows(advantages) if skip else torch.ones(batch.num_rows, dtype=torch.bool)
    if plan.first_on_policy:  # several updates: the weights move before the last one
        need = plan.pi_old_rows(informative, state.run.ctx.distributed)
        pi_old, old_flops = rl.old_logprobs(model, batch, need, state.micro_batch_size, temperature, precision, wrapped)
        batch = batch.with_(old_logprobs=pi_old)
        flops += old_flops
    updates = rl.Updates(
        batch,
        plan,
        state.updater,
        step,
        state.run.ctx,
        wrapped,
        rows_to_train=informative if skip else None,
        flops_of=functools.partial(rl.forward_flops, model),
    )
    for update in updates:
        for micro in update:
            logprobs, entropy = rl.policy_logprobs(
                model, micro, temperature, precision, entropy_grad=spec.entropy_coef != 0, wrapped=wrapped
            )
            loss, metrics = micro_loss(logprobs, entropy, micro, spec, update.counts)
            update.backward(loss, metrics)
        update.step()
    return {
        **scored.metrics,
        **adv_metrics,
        **updates.metrics(),
        "time_training": time.perf_counter() - start,
        "num_tokens": int(batch.attention_mask.sum()) * algo.num_iterations,
        "num_flops": flops + updates.flops,
    }


def make_step(state: rl.RLState, algo: GRPOAlgoConfig) -> Callable[[int], dict]:
    """The run's ``step -> metrics``: :func:`grpo_step` with the loss spec and update plan built once."""
    spec = rl_config.policy_spec(algo)
    plan = rl.UpdatePlan.from_algo(algo, state.micro_batch_size, state.rollout.max_new_tokens)
    return lambda step: grpo_step(state, algo, spec, plan, step)


def run_grpo(cfg: GRPOConfig, model=None, tokenizer=None, console=None, name: str = "grpo") -> dict:
    """Train with GRPO; returns the final metrics (``accuracy``, ``accuracy_before`` for tasks) and ``run_dir``."""
    algo = cfg.algo.resolved()
    if cfg.rollout.group_size < 2:
        raise ConfigError(
            f"rollout.group_size must be >= 2 for group-relative advantages, got {cfg.rollout.group_size}"
        )
    state = rl.prepare(cfg, name, algo, model, tokenizer, console)
    state.run.print(f"[algo] {rl_config.describe_algo(algo)}")
    return rl.train_rl(state, make_step(state, algo))
