"""``lmforge rm CONFIG``: a reward model (Bradley-Terry) on prompt / chosen / rejected pairs.

The model is the starting causal LM's body with a scalar head (lmforge.rollout.reward_model: transformers'
``*ForSequenceClassification``, ``num_labels=1``, the head at zero so every reward starts at 0); the
reward of a sequence is read at its last non-pad token. The pairs are DPO's (lmforge.data.preference
through the dpo recipe's ``data`` section: a file with column maps, or a built-in task), with the same
skip counts. ``train.batch_size`` and ``train.micro_batch_size`` count pairs.

One step, top to bottom: the next global batch of pairs (the same order on every rank) -> this
rank's share -> micro-batches of b pairs, each one forward of 2b rows (the chosen sides, then the
rejected ones) -> Bradley-Terry loss over the step's pair count on all ranks -> backward -> clip,
update. The loop around it (log, evaluate, checkpoint, resume, summary) is lmforge.runtime.loop; the
final/ and best/ directories load with ``AutoModelForSequenceClassification`` and serve as an RL
reward with ``rewards.functions=[rm:DIR]``. The math: docs/reward-models.md.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from ..core.config import (
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    opt,
    refuse_ignored,
    section,
)
from ..core.errors import ConfigError, DataError
from ..data.preference import PreferenceData, PreferencePair, collate_pairs
from ..losses.reward import reward_loss
from ..model.load import load_model
from ..parallel.wrap import run_forward
from ..rollout.reward_model import from_causal_lm, sequence_rewards
from ..runtime.loop import Trainer, TrainState, build_state, train_loop
from ..runtime.optim import BatchOrder
from ..runtime.run import start_run
from ..supervised.pairs import PreferenceDataConfig, build_pairs, check_fits_context, held_out_pairs, pairs_step

METRIC_KEYS = ("rewards_chosen", "rewards_rejected", "reward_margin", "accuracy")


@dataclasses.dataclass
class RewardAlgoConfig:
    loss: Literal["bradley_terry"] = opt(
        "bradley_terry", "-log sigmoid(r_chosen - r_rejected - margin) (docs/reward-models.md)"
    )
    margin: float = opt(
        0.0, "how far the chosen reward should lead the rejected one (Llama 2's margin); 0 = plain Bradley-Terry"
    )

    def validate(self) -> None:
        if not self.margin >= 0:
            raise ConfigError(f"algo.margin must be >= 0, got {self.margin}")


@dataclasses.dataclass
class RMConfig:
    model: ModelConfig = section(ModelConfig, "the causal LM whose body the reward model starts from")
    data: PreferenceDataConfig = section(PreferenceDataConfig, "preference pairs (as lmforge dpo reads them)")
    algo: RewardAlgoConfig = section(RewardAlgoConfig, "the reward-model loss")
    optim: OptimConfig = section(OptimConfig, "optimizer and LR schedule")
    train: TrainConfig = section(TrainConfig, "loop, evaluation and checkpoints (batch sizes count pairs)")
    parallel: ParallelConfig = section(ParallelConfig, "processes under torchrun (docs/distributed.md)")
    logging: LoggingConfig = section(LoggingConfig, "progress and metrics sinks")

    def validate(self) -> None:
        refuse_ignored(
            self.data,
            "data",
            ("num_eval",),
            "by lmforge rm (it measures held-out pairwise accuracy "
            "on the data.num_val pairs, not the task's exact-match accuracy)",
        )


def pair_rewards(state: TrainState, pairs: list[PreferencePair]) -> tuple[torch.Tensor, torch.Tensor]:
    """(b,) chosen and (b,) rejected rewards of ``pairs``, in one forward of 2b rows through the root."""
    batch = collate_pairs(pairs, state.tokenizer.pad_token_id)  # (2b, T): chosen rows, then rejected rows
    ids, mask = batch["input_ids"].to(state.run.device), batch["attention_mask"].to(state.run.device)
    with state.updater.precision.autocast():
        rewards = run_forward(state.wrapped, sequence_rewards, state.model, ids, mask).float()  # (2b,)
    return rewards[: len(pairs)], rewards[len(pairs) :]


def rm_step(state: TrainState, data: PreferenceData, algo: RewardAlgoConfig, step: int) -> dict:
    """One optimizer step of the reward-model loss over the next global batch of pairs (supervised.pairs.pairs_step)."""

    def micro_loss(pairs, _, num_pairs_global):
        return reward_loss(
            *pair_rewards(state, pairs), loss_type=algo.loss, margin=algo.margin, num_pairs_global=num_pairs_global
        )

    return pairs_step(
        state,
        data,
        step,
        list,
        micro_loss,
        METRIC_KEYS,
        lambda pairs: sum(len(side.input_ids) for pair in pairs for side in pair),
    )


def held_out(state: TrainState, data: PreferenceData, algo: RewardAlgoConfig, max_pairs: int = 1024) -> dict:
    """Loss, pairwise accuracy and margin over the held-out pairs (supervised.pairs.held_out_pairs)."""

    def pairs_loss(pairs):
        return reward_loss(*pair_rewards(state, pairs), loss_type=algo.loss, margin=algo.margin, num_pairs_global=1)

    return held_out_pairs(
        state, data, max_pairs, pairs_loss, {"val_accuracy": "accuracy", "val_reward_margin": "reward_margin"}
    )


def run_rm(cfg: RMConfig, model=None, tokenizer=None, console=None) -> dict:
    """Train a reward model on preference pairs; returns the final held-out metrics (and ``<key>_before``)."""
    if cfg.model.lora.r:
        raise ConfigError(
            "lmforge rm trains the whole model and its head; model.lora is not supported here yet (set model.lora.r=0)"
        )
    if model is None:
        model, tokenizer = load_model(cfg.model)
    # a step's forward holds both sides of each pair: the hardware choice sees rows twice max_len long
    run = start_run(cfg, "rm", model, seq_len=2 * cfg.data.max_len, console=console)
    train_data, val_data = build_pairs(cfg.data, run.train, cfg.model, tokenizer, run.print, model.to(run.device))
    check_fits_context(model, train_data, val_data)
    run.print(f"[data] {len(train_data)} training pairs, {len(val_data)} held-out pairs")
    if len(train_data) < run.train.batch_size:
        raise DataError(
            f"{len(train_data)} training pairs are fewer than one batch (train.batch_size="
            f"{run.train.batch_size}); lower train.batch_size or add data"
        )
    reward_model = from_causal_lm(model, tokenizer).to(run.device)
    state = build_state(
        run,
        reward_model,
        tokenizer,
        BatchOrder(len(train_data), run.train.batch_size, run.train.seed),
        run.train.max_steps,
    )
    trainer = Trainer(
        step=lambda step: rm_step(state, train_data, cfg.algo, step),
        evaluate=lambda step: held_out(state, val_data, cfg.algo),
        evaluate_at_start=bool(len(val_data)),
        best_metric="val_loss" if len(val_data) else None,
    )
    return train_loop(state, trainer)
