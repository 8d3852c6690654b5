"""``lmforge dpo CONFIG``: preference optimisation (DPO, IPO, SimPO) on prompt / chosen / rejected pairs.

Data is any source of docs/data.md in the formats of lmforge.data.preference, or pairs made from a
built-in task (``data.task=addition``: chosen = the answer, rejected = a plausible wrong one), whose
held-out accuracy is then reported. ``train.batch_size`` and ``train.micro_batch_size`` count pairs.

One step, top to bottom: the next global batch of pairs (the same order on every rank) -> this
rank's share -> micro-batches of pairs, each packed without padding, a pair's prompt once and its
two completions as branches of one attention tree (lmforge.supervised.pair_forward) -> the
reference's sequence log-probabilities of every micro-batch, without gradients, once per batch (a
frozen copy of the starting model, or with LoRA the policy with its adapters off; none for SimPO)
-> forward / backward of each micro-batch, chosen and rejected in the same forward, the loss
divided by the pairs of the whole step over all ranks -> clip, update. The loop around it (log, evaluate,
checkpoint, resume, summary) is lmforge.runtime.loop. The math: docs/preference.md.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Literal

import torch

from ..core.config import LoggingConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, opt, section
from ..core.errors import ConfigError, DataError
from ..data.preference import PreferenceData
from ..data.sft import uses_chat_format
from ..data.tasks import get_task
from ..losses.preference import REFERENCE_FREE, check_settings, preference_loss
from ..model import lora
from ..model.load import load_model
from ..parallel.wrap import run_forward
from ..rl.forward import matmul_weights
from ..rollout.evaluation import save_samples, task_accuracy
from ..runtime.loop import Trainer, TrainState, build_state, full_model, train_loop
from ..runtime.optim import BatchOrder
from ..runtime.run import start_run
from ..supervised.pair_forward import PairPack, pack_pairs, pair_logits, side_logps
from ..supervised.pairs import (
    PreferenceDataConfig,
    build_pairs,
    check_fits_context,
    choice_seq_len,
    held_out_pairs,
    pairs_step,
)

METRIC_KEYS = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "nll_chosen")


@dataclasses.dataclass
class PreferenceAlgoConfig:
    loss: Literal["sigmoid", "ipo", "simpo"] = opt(
        "sigmoid", "sigmoid = DPO, ipo = IPO, simpo = SimPO (no reference model); docs/preference.md"
    )
    beta: float = opt(0.1, "the inverse temperature of the implicit reward (DPO / IPO: 0.01-0.5; SimPO: 2-10)")
    label_smoothing: float = opt(0.0, "sigmoid: the probability that a pair's label is wrong (conservative DPO)")
    gamma: float = opt(0.0, "simpo: the target reward margin (the paper: 0.5-1.5 with beta 2-2.5)")
    nll_coef: float = opt(
        0.0,
        "weight of the chosen completions' mean token NLL added to the loss (RPO; "
        "1.0 in the paper): keeps the chosen answers likely",
    )
    disable_dropout: bool = opt(
        True,
        "turn off the model's own dropout (its config's attention / hidden dropout) "
        "in the policy's training forwards, as TRL does: the reference runs without it, so "
        "with it the log-ratios are noise even at step 1 (LoRA's model.lora.dropout stays)",
    )

    def validate(self) -> None:
        try:
            check_settings(self.loss, self.beta, self.label_smoothing, self.gamma)
        except ValueError as exc:
            raise ConfigError(f"algo: {exc}") from exc
        if self.nll_coef < 0:
            raise ConfigError(f"algo.nll_coef must be >= 0, got {self.nll_coef}")


@dataclasses.dataclass
class DPOConfig:
    model: ModelConfig = section(ModelConfig, "model to train (and, frozen, the reference)")
    data: PreferenceDataConfig = section(PreferenceDataConfig, "preference pairs")
    algo: PreferenceAlgoConfig = section(PreferenceAlgoConfig, "the preference loss")
    optim: OptimConfig = section(OptimConfig, "optimizer and LR schedule")
    train: TrainConfig = section(TrainConfig, "loop, evaluation and checkpoints (batch sizes count pairs)")
    parallel: ParallelConfig = section(ParallelConfig, "processes under torchrun (docs/distributed.md)")
    logging: LoggingConfig = section(LoggingConfig, "progress and metrics sinks")


# ----------------------------------------------------------------------------- forwards


def policy_logps(state: TrainState, batch: PairPack) -> tuple[torch.Tensor, torch.Tensor]:
    """(2b,) sequence log-probabilities of the trained policy and the trained-token counts, through
    the parallel root (DDP / FSDP2 see the forward)."""
    return side_logps(run_forward(state.wrapped, pair_logits, state.model, batch), batch)


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout of ``model`` to 0 -- ``nn.Dropout`` modules and the ``attention_dropout`` rates
    that Hugging Face attention modules apply in training mode -- except the LoRA adapters' own
    (``model.lora.dropout``, the user's choice: at step 1 it drops only zeros). In memory only: the
    saved config keeps its rates. Returns how many rates were set to 0."""
    num_disabled = 0
    for name, module in model.named_modules():
        if "lora_dropout" in name:
            continue
        if isinstance(module, torch.nn.Dropout) and module.p:
            module.p = 0.0
            num_disabled += 1
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, float) and rate:
            module.attention_dropout = 0.0
            num_disabled += 1
    return num_disabled


def make_reference(model, loss: str):
    """A frozen copy of the starting model; with LoRA, :class:`model.lora.DisabledAdapters` (the policy with
    its adapters off, no copy); None for a reference-free loss (SimPO)."""
    if loss in REFERENCE_FREE:
        return None
    if lora.has_adapters(model):
        return lora.DisabledAdapters(model)
    return copy.deepcopy(model).eval().requires_grad_(False)


def reference_logps(state: TrainState, reference, batch: PairPack) -> torch.Tensor | None:
    """(2b,) sequence log-probabilities of the reference, no gradients; None when there is none."""
    if reference is None:
        return None
    with state.updater.precision.autocast():
        if isinstance(reference, lora.DisabledAdapters):  # through the root: FSDP2 gathers the base weights
            with torch.no_grad(), lora.adapters_disabled(reference.model):
                return policy_logps(state, batch)[0]
        with torch.inference_mode():  # a frozen copy: no autograd bookkeeping at all
            logps = side_logps(pair_logits(reference, batch), batch)[0]
    return logps.clone()  # a normal tensor again: the loss uses it under autograd


def micro_loss(state: TrainState, algo: PreferenceAlgoConfig, batch: PairPack, ref_logps, num_pairs_global: int):
    """The loss of one micro-batch of b pairs (2b sides, one forward), over the step's pair count."""
    with state.updater.precision.autocast():
        logps, lens = policy_logps(state, batch)
    num = logps.shape[0] // 2
    refs = (None, None) if ref_logps is None else (ref_logps[:num], ref_logps[num:])
    return preference_loss(
        logps[:num],
        logps[num:],
        lens[:num],
        lens[num:],
        *refs,
        loss_type=algo.loss,
        beta=algo.beta,
        label_smoothing=algo.label_smoothing,
        gamma=algo.gamma,
        nll_coef=algo.nll_coef,
        num_pairs_global=num_pairs_global,
    )


# ----------------------------------------------------------------------------- step and evaluation


def pack_forward_flops(model, pack: PairPack) -> float:
    """Matmul FLOPs of one forward over ``pack`` as :func:`pair_forward.pair_logits` runs it: every
    laid-out token through the body (a shared prompt once), the LM head on the predicting positions only."""
    body, head = matmul_weights(model)
    return 2.0 * (body * sum(row.numel() for row in pack.input_ids) + head * int(pack.predict_at.numel()))


def dpo_step(state: TrainState, data: PreferenceData, algo: PreferenceAlgoConfig, reference, step: int) -> dict:
    """One optimizer step of the preference loss (:func:`pairs_step`); the reference's logprobs are
    computed once per micro-batch, before any update. FLOPs: the policy's forward and backward (3
    forwards) and the reference's forward, where there is one."""
    device = state.run.device
    forwards = 3 + (reference is not None)
    return pairs_step(
        state,
        data,
        step,
        lambda pairs: pack_pairs(pairs).to(device),
        lambda batch, ref, num_pairs: micro_loss(state, algo, batch, ref, num_pairs),
        METRIC_KEYS,
        lambda batch: batch.num_tokens,
        before=lambda batch: reference_logps(state, reference, batch),
        count_flops=lambda batch: forwards * pack_forward_flops(state.model, batch),
    )


def held_out_preferences(
    state: TrainState, data: PreferenceData, algo: PreferenceAlgoConfig, reference, max_pairs: int = 512
) -> dict:
    """Loss, reward accuracy and margin over the held-out pairs (:func:`held_out_pairs`)."""

    def pairs_loss(pairs):
        batch = pack_pairs(pairs).to(state.run.device)
        return micro_loss(state, algo, batch, reference_logps(state, reference, batch), 1)

    return held_out_pairs(
        state,
        data,
        max_pairs,
        pairs_loss,
        {"val_reward_accuracy": "reward_accuracy", "val_reward_margin": "reward_margin"},
    )


def make_task_eval(cfg: DPOConfig, tokenizer, run):
    """Greedy exact-match accuracy on held-out problems of ``data.task`` (None for file data)."""
    if not cfg.data.task:
        return None
    task = get_task(cfg.data.task)
    problems = task.make_problems(cfg.data.num_eval, cfg.train.seed, "test")
    chat = uses_chat_format(tokenizer, cfg.data.use_chat_template)

    def evaluate(model, step: int) -> dict:
        accuracy, texts = task_accuracy(model, tokenizer, task, problems, cfg.train.max_new_tokens, chat)
        if run.ctx.is_main:
            save_samples(
                run.dir,
                step,
                [p.prompt for p in problems[: cfg.train.num_samples]],
                texts[: cfg.train.num_samples],
                run.print,
            )
        return {"accuracy": accuracy}

    return evaluate


def run_dpo(cfg: DPOConfig, model=None, tokenizer=None, console=None) -> dict:
    """Train on preference pairs; returns the final evaluation (and ``<key>_before``, from step 0)."""
    if model is None:
        model, tokenizer = load_model(cfg.model)
    # Pairs that need no model are read first, so the hardware choice (activation checkpointing) sizes
    # memory for the longest pair as it runs, not for two sides of data.max_len tokens each.
    early, lines = cfg.data.rejected != "policy", []
    if early:
        train_data, val_data = build_pairs(cfg.data, cfg.train, cfg.model, tokenizer, lines.append)
    seq_len = choice_seq_len(train_data, val_data) if early else 2 * cfg.data.max_len
    run = start_run(cfg, "dpo", model, seq_len=seq_len, console=console)
    for line in lines:
        run.print(line)
    if not early:
        train_data, val_data = build_pairs(cfg.data, run.train, cfg.model, tokenizer, run.print, model.to(run.device))
    check_fits_context(model, train_data, val_data)
    run.print(f"[data] {len(train_data)} training pairs, {len(val_data)} held-out pairs")
    if len(train_data) < run.train.batch_size:
        raise DataError(
            f"{len(train_data)} training pairs are fewer than one batch (train.batch_size="
            f"{run.train.batch_size}); lower train.batch_size or add data"
        )
    model = lora.apply_for_run(model, cfg.model.lora, run.train, run.ctx).to(run.device)
    if cfg.algo.disable_dropout and (num_disabled := disable_dropout(model)):
        run.print(f"[algo] dropout off in the policy ({num_disabled} rate(s) set to 0; algo.disable_dropout)")
    reference = make_reference(model, cfg.algo.loss)  # before resuming: the reference is the starting model
    order = BatchOrder(len(train_data), run.train.batch_size, run.train.seed)
    state = build_state(run, model, tokenizer, order, run.train.max_steps)
    task_eval = make_task_eval(cfg, tokenizer, run)

    def evaluate(step: int) -> dict:
        metrics = held_out_preferences(state, val_data, cfg.algo, reference)
        if task_eval is not None:
            sampler = full_model(state)
            sampler.eval()
            metrics.update(task_eval(sampler, step))
            state.model.train()
        return metrics

    trainer = Trainer(
        step=lambda step: dpo_step(state, train_data, cfg.algo, reference, step),
        evaluate=evaluate,
        evaluate_at_start=True,
        best_metric="val_loss" if len(val_data) else None,
    )
    return train_loop(state, trainer)
