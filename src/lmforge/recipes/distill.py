"""``lmforge distill CONFIG``: pull a student towards a teacher that shares its tokenizer.

``mode: on_policy`` runs on the RL runtime (``lmforge.rl``): each step the student samples
``rollout.group_size`` completions of ``rollout.num_prompts`` prompts of ``data``; the teacher scores
every sampled token in one forward without gradients; each token's ``teacher - student`` log-probability
is its advantage in the policy-gradient loss (``losses.distill.reverse_kl_loss``: the per-token reverse
KL, optionally plus ``algo.reward_weight`` x the task reward's group-normalised advantage).

``mode: logit`` trains on fixed SFT-style rows (``fixed_data``, the data layer of ``lmforge sft``) with
the full-vocabulary forward KL to the teacher at temperature ``algo.temperature``
(``losses.distill.forward_kl_loss``), one teacher forward per micro-batch without gradients.

The teacher is ``teacher.name`` (any model spec), in bf16 where the device multiplies bf16 natively
(``teacher.dtype=auto``), or, with ``teacher.name`` empty, the student's own base model with its LoRA
adapters off. docs/distillation.md has the math and when to use which.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Literal

import torch

from .. import rl
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
from ..losses.advantages import compute_advantages
from ..losses.distill import DISTILL_LOSSES
from ..losses.policy import Counts, PolicyLossSpec, policy_loss
from ..model import lora
from ..model.load import load_model
from ..parallel.wrap import run_forward
from ..rl import config as rl_config
from ..rl.forward import completion_logits
from ..runtime import hardware
from ..runtime.loop import Trainer, build_state, full_model, train_loop
from ..runtime.optim import BatchOrder, logits_at, shifted_targets
from ..runtime.run import start_run
from ..supervised.sft_data import SFTDataConfig, build_data, check_fits_context, make_eval
from ..supervised.step import supervised_step, validation_loss

MODES = ("on_policy", "logit")


@dataclasses.dataclass
class TeacherConfig(ModelConfig):
    name: str = opt(
        "",
        "teacher model spec (HF dir, hub id, tiny:<arch>, as model.name); '' = the student's base "
        "model with its LoRA adapters off (needs model.lora.r > 0)",
    )
    dtype: Literal["auto", "fp32", "bf16"] = opt(
        "auto",
        "teacher weights: auto = bf16 where the device multiplies "
        "bf16 natively (CPU with AVX512-BF16 / AMX, CUDA), else fp32",
    )


@dataclasses.dataclass
class PromptDataConfig(rl_config.RLDataConfig):
    """``data`` of ``mode: on_policy``: the prompts the student samples from (as in ``lmforge grpo``)."""

    def validate(self) -> None:
        if self.task or self.path:  # unset in logit mode (checked in run_distill)
            super().validate()


@dataclasses.dataclass
class FixedDataConfig(SFTDataConfig):
    """``fixed_data`` of ``mode: logit``: SFT-style rows (as ``data`` in ``lmforge sft``)."""

    def validate(self) -> None:
        if self.task or self.path:  # unset in on-policy mode (checked in run_distill)
            super().validate()


@dataclasses.dataclass
class DistillAlgoConfig(rl_config.PolicyConfig):
    temperature: float = opt(
        1.0,
        "logit: softening temperature T of both distributions (the loss is x T^2); "
        "on_policy uses rollout.temperature for student and teacher",
    )
    reward_weight: float = opt(
        0.0,
        "on_policy: add this x the task reward's group-normalised advantage to each "
        "token's reverse-KL signal (0 = pure distillation; rewards are logged either way)",
    )
    signal: Literal["sampled", "full"] = opt(
        "sampled",
        "on_policy: sampled = each sampled token's teacher - student logprob as its advantage (policy "
        "gradient); full = the exact reverse KL over the whole vocabulary at each sampled prefix (GKD; the teacher "
        "runs inside each micro-batch, its (N, V) logits are not kept)",
    )

    def resolved(self) -> "DistillAlgoConfig":
        algo = rl_config.resolve_algo(self, {**rl_config.POLICY_DEFAULTS, "aggregation": "global_token_mean"})
        if algo.kl_coef:
            raise ConfigError(
                f"algo.kl_coef={algo.kl_coef}: distillation pulls the student towards the teacher, "
                "which takes the reference's place; remove algo.kl_coef"
            )
        if algo.signal == "full" and (algo.num_iterations > 1 or algo.num_mini_batches > 1 or algo.is_level != "none"):
            raise ConfigError(
                "algo.signal=full differentiates the exact KL at each prefix: no ratio, so "
                "algo.num_iterations, algo.num_mini_batches and algo.is_level do not apply; remove them"
            )
        if not algo.temperature > 0:
            raise ConfigError(f"algo.temperature must be > 0, got {algo.temperature}")
        return algo

    def validate(self) -> None:
        self.resolved()


@dataclasses.dataclass
class DistillConfig:
    mode: Literal["on_policy", "logit"] = opt(
        "on_policy",
        "on_policy: reverse KL on the student's samples (RL "
        "runtime); logit: forward KL on fixed_data at algo.temperature",
    )
    model: ModelConfig = section(ModelConfig, "the student")
    teacher: TeacherConfig = section(TeacherConfig, "the teacher (same tokenizer as the student, checked at start)")
    data: PromptDataConfig = section(PromptDataConfig, "on_policy: prompts (data.task or data.path, as in grpo)")
    rollout: rl_config.RolloutConfig = section(rl_config.RolloutConfig, "on_policy: sampling")
    rewards: rl_config.RewardsConfig = section(
        rl_config.RewardsConfig, "on_policy: task rewards (logged; trained on with algo.reward_weight > 0)"
    )
    fixed_data: FixedDataConfig = section(FixedDataConfig, "logit: SFT-style rows (as data in lmforge sft)")
    algo: DistillAlgoConfig = section(DistillAlgoConfig, "policy-gradient loss keys (on_policy), temperature (logit)")
    optim: OptimConfig = section(OptimConfig, "optimizer and LR schedule")
    train: TrainConfig = section(TrainConfig, "loop, evaluation and checkpoints (on_policy: max_steps = RL steps)")
    parallel: ParallelConfig = section(ParallelConfig, "processes under torchrun (docs/distributed.md)")
    logging: LoggingConfig = section(LoggingConfig, "progress and metrics sinks")


# ---- the teacher --------------------------------------------------------------------------


def check_shared_tokenizer(
    student_tok, teacher_tok, student_logits: int, teacher_logits: int, names: tuple[str, str]
) -> None:
    """ConfigError unless token id i means the same in both models: the vocabulary sizes, the ids a probe
    string encodes to (the student's first 512 tokens decoded), the eos / pad ids and the logit widths agree."""
    probe = student_tok.decode(list(range(min(len(student_tok), 512))), skip_special_tokens=True)
    problems = []
    if len(student_tok) != len(teacher_tok):
        problems.append(f"vocabulary size: student {len(student_tok)}, teacher {len(teacher_tok)}")
    ids_student = student_tok.encode(probe, add_special_tokens=False)
    ids_teacher = teacher_tok.encode(probe, add_special_tokens=False)
    if ids_student != ids_teacher:
        at = next(
            (i for i, (a, b) in enumerate(zip(ids_student, ids_teacher)) if a != b),
            min(len(ids_student), len(ids_teacher)),
        )
        problems.append(
            f"a probe string encodes differently (student {len(ids_student)} ids, teacher "
            f"{len(ids_teacher)}; first difference at id {at}: student "
            f"{ids_student[at : at + 4]}, teacher {ids_teacher[at : at + 4]})"
        )
    for attr in ("eos_token_id", "pad_token_id"):
        if getattr(student_tok, attr, None) != getattr(teacher_tok, attr, None):
            problems.append(
                f"{attr}: student {getattr(student_tok, attr, None)}, teacher {getattr(teacher_tok, attr, None)}"
            )
    if student_logits != teacher_logits:
        problems.append(f"output logits: student {student_logits}, teacher {teacher_logits}")
    if problems:
        raise ConfigError(
            f"the teacher ({names[1]}) and the student ({names[0]}) must share one tokenizer: "
            "distillation compares their probabilities token id by token id; "
            + "; ".join(problems)
            + " (pick a teacher of the student's family, or set teacher.tokenizer / model.tokenizer)"
        )


def load_teacher(cfg: DistillConfig, student, student_tok) -> tuple[torch.nn.Module | None, str]:
    """The teacher ``teacher.name`` names, frozen, in its dtype, tokenizer checked, and a line saying so;
    None for the LoRA-off view of the student (made once its adapters exist: :func:`teacher_of`)."""
    if not cfg.teacher.name:
        if not cfg.model.lora.r:
            raise ConfigError(
                "teacher.name is empty, which means the student's base model with its LoRA adapters "
                "off, but the student has none (model.lora.r = 0); set teacher.name to a model, or "
                "train the student with LoRA (model.lora.r > 0)"
            )
        if cfg.teacher.dtype == "bf16":
            raise ConfigError(
                "teacher.dtype=bf16: the LoRA-off teacher is the student's own base weights, in the "
                "student's dtype; remove teacher.dtype"
            )
        return None, "[teacher] the student's base model (its LoRA adapters off)"
    if cfg.teacher.lora.r:
        raise ConfigError(
            "teacher.lora: the teacher is not trained; remove teacher.lora (a LoRA adapter directory "
            "as teacher.name is loaded as it is)"
        )
    teacher, teacher_tok = load_model(cfg.teacher)
    check_shared_tokenizer(
        student_tok,
        teacher_tok,
        student.get_output_embeddings().weight.shape[0],
        teacher.get_output_embeddings().weight.shape[0],
        (cfg.model.name, cfg.teacher.name),
    )
    bf16 = cfg.teacher.dtype == "bf16" or (
        cfg.teacher.dtype == "auto" and hardware.detect(cfg.train.device).bf16_supported
    )
    dtype = torch.bfloat16 if bf16 else torch.float32
    teacher = teacher.to(dtype).eval()
    teacher.requires_grad_(False)
    return teacher, (
        f"[teacher] {cfg.teacher.name} in {'bf16' if bf16 else 'fp32'}"
        + (" (teacher.dtype=auto: this device has native bf16)" if cfg.teacher.dtype == "auto" and bf16 else "")
    )


def teacher_of(teacher: torch.nn.Module | None, student: torch.nn.Module, device) -> object:
    """The teacher on the run's device, or the student's LoRA-off view (``model.lora.DisabledAdapters``)."""
    if teacher is None:
        return lora.DisabledAdapters(student)
    return teacher.to(device)


# ---- on_policy: the RL runtime ------------------------------------------------------------


def micro_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    batch: rl.TrainBatch,
    spec: PolicyLossSpec,
    reward_weight: float,
    counts: Counts,
) -> tuple[torch.Tensor, dict]:
    """Reverse-KL policy-gradient loss of one micro-batch from its (B, C) ``logprobs`` (with gradient) and
    ``entropy`` (the teacher's logprobs in ``batch.ref_logprobs``), normalised by its update's ``counts``."""
    old = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs  # on-policy: ratio 1
    return DISTILL_LOSSES["on_policy"](
        logprobs,
        old,
        batch.ref_logprobs,
        batch.trained_mask,
        spec,
        counts,
        reward_advantages=batch.advantages,
        reward_weight=reward_weight,
        rollout_logprobs=batch.rollout_logprobs,
        entropy=entropy,
    )


@torch.no_grad()
def teacher_completion_logits(teacher, model, batch: rl.TrainBatch, precision, wrapped) -> torch.Tensor:
    """(N, V) the teacher's logits that predict ``batch``'s trained tokens, without gradients."""
    with precision.autocast():
        if isinstance(teacher, lora.DisabledAdapters):
            with lora.adapters_disabled(model):
                return run_forward(wrapped, completion_logits, model, batch)
        return completion_logits(teacher, batch)


def full_micro_loss(
    model,
    teacher,
    batch: rl.TrainBatch,
    spec: PolicyLossSpec,
    reward_weight: float,
    temperature: float,
    counts: Counts,
    precision,
    wrapped=None,
) -> tuple[torch.Tensor, dict]:
    """algo.signal=full: the exact reverse KL at each sampled prefix (one teacher forward here, then the
    student's), plus the task reward's policy-gradient term when ``reward_weight`` is set."""
    teacher_logits = teacher_completion_logits(teacher, model, batch, precision, wrapped)
    with precision.autocast():
        logits = run_forward(wrapped, completion_logits, model, batch)  # (N, V)
    loss, kl = DISTILL_LOSSES["on_policy_full"](
        logits, teacher_logits, counts.num_loss_tokens_global, temperature=temperature
    )
    metrics = {"reverse_kl": kl["kl_sum"] / max(int(kl["num_tokens"]), 1)}
    if reward_weight:
        logprobs, _ = rl.completion_logprobs(logits, batch, temperature)
        reward_loss, reward_metrics = policy_loss(
            logprobs, logprobs.detach(), reward_weight * batch.advantages, batch.trained_mask, spec, counts
        )
        loss = loss + reward_loss
        metrics["reward_pg_loss"] = reward_metrics["pg_loss"]
    return loss, metrics


def teacher_logprobs(teacher, batch: rl.TrainBatch, state: rl.RLState, temperature: float) -> torch.Tensor:
    """(B, C) the teacher's logprobs of every sampled token: one forward per micro-batch, no gradients (the
    LoRA-off view runs through the parallel root, as the student does)."""
    wrapped = state.train.wrapped if isinstance(teacher, lora.DisabledAdapters) else None
    return rl.batch_logprobs(
        teacher, batch, state.micro_batch_size, temperature, state.updater.precision, wrapped=wrapped
    ).float()


def on_policy_step(
    state: rl.RLState, algo: DistillAlgoConfig, teacher, spec: PolicyLossSpec, plan: rl.UpdatePlan, step: int
) -> dict:
    """Sample, score with the task rewards, pack, score every sampled token with the teacher, pi_old, then
    the updates: for each update, for each micro-batch, forward, loss and backward; then the optimizer step."""
    model, wrapped, precision = state.model, state.train.wrapped, state.updater.precision
    temperature = state.rollout.temperature
    scored = state.source.next_batch(step)  # this rank's rows, scored (lmforge.rl.sources)
    start = time.perf_counter()
    batch = rl.pack_rollout(scored.rollout, state.tokenizer.pad_token_id, need_rollout_logprobs=algo.is_level != "none")
    batch = batch.to(state.run.device)
    if algo.signal == "sampled":  # signal=full: the teacher runs inside each micro-batch's loss instead
        batch = batch.with_(ref_logprobs=teacher_logprobs(teacher, batch, state, temperature))
    time_teacher = time.perf_counter() - start
    if algo.reward_weight:
        advantages, _ = compute_advantages("group_norm", scored.rewards.total, state.rollout.group_size)
        batch = batch.with_(advantages=advantages.to(state.run.device))
    teacher_module = teacher.model if isinstance(teacher, lora.DisabledAdapters) else teacher
    flops = rl.sampling_flops(model, batch) + rl.batch_forward_flops(teacher_module, batch, state.micro_batch_size)
    if plan.first_on_policy:  # several updates: the weights move before the last one
        need = plan.pi_old_rows(torch.ones(batch.num_rows, dtype=torch.bool), state.run.ctx.distributed)
        pi_old, old_flops = rl.old_logprobs(model, batch, need, state.micro_batch_size, temperature, precision, wrapped)
        batch = batch.with_(old_logprobs=pi_old)
        flops += old_flops
    updates = rl.Updates(
        batch, plan, state.updater, step, state.run.ctx, wrapped, flops_of=functools.partial(rl.forward_flops, model)
    )
    for update in updates:
        for micro in update:
            if algo.signal == "sampled":
                logprobs, entropy = rl.policy_logprobs(
                    model, micro, temperature, precision, entropy_grad=spec.entropy_coef != 0, wrapped=wrapped
                )
                loss, metrics = micro_loss(logprobs, entropy, micro, spec, algo.reward_weight, update.counts)
            else:
                loss, metrics = full_micro_loss(
                    model, teacher, micro, spec, algo.reward_weight, temperature, update.counts, precision, wrapped
                )
            update.backward(loss, metrics)
        update.step()
    return {
        **scored.metrics,
        **updates.metrics(),
        "time_teacher": time_teacher,
        "time_training": time.perf_counter() - start,
        "num_tokens": int(batch.attention_mask.sum()) * algo.num_iterations,
        "num_flops": flops + updates.flops,
    }


def make_on_policy_step(state: rl.RLState, algo: DistillAlgoConfig, teacher) -> Callable[[int], dict]:
    """The run's ``step -> metrics``: :func:`on_policy_step` with the loss spec and update plan built once
    (micro-batches in row order: ``length_order`` off, as before)."""
    spec = rl_config.policy_spec(algo)
    plan = dataclasses.replace(
        rl.UpdatePlan.from_algo(algo, state.micro_batch_size, state.rollout.max_new_tokens), length_order=False
    )
    return lambda step: on_policy_step(state, algo, teacher, spec, plan, step)


def run_on_policy(
    cfg: DistillConfig, algo: DistillAlgoConfig, model, tokenizer, teacher, note: str, console, name: str
) -> dict:
    if cfg.rollout.group_size < 2 and algo.reward_weight:
        raise ConfigError(
            f"algo.reward_weight={algo.reward_weight} uses group-relative reward advantages: "
            f"rollout.group_size must be >= 2, got {cfg.rollout.group_size}"
        )
    state = rl.prepare(cfg, name, algo, model, tokenizer, console)
    teacher = teacher_of(teacher, state.model, state.run.device)
    state.run.print(note)
    state.run.print(f"[algo] mode=on_policy {rl_config.describe_algo(algo)}")
    return rl.train_rl(state, make_on_policy_step(state, algo, teacher))


# ---- logit: fixed data --------------------------------------------------------------------


@torch.no_grad()
def teacher_logits_at(state, teacher, batch: dict, positions: torch.Tensor) -> torch.Tensor:
    """(N, V) the teacher's logits at the loss positions of a micro-batch, without gradients."""
    with state.updater.precision.autocast():
        if isinstance(teacher, lora.DisabledAdapters):
            with lora.adapters_disabled(state.model):
                return run_forward(
                    state.wrapped, logits_at, state.model, batch["input_ids"], batch["attention_mask"], positions
                )
        return logits_at(teacher, batch["input_ids"], batch["attention_mask"], positions)


def logit_micro_loss(state, teacher, batch: dict, num_loss_tokens_global: int, temperature: float):
    """Forward KL of one micro-batch, already divided by the step's loss-token count over all ranks."""
    positions, _ = shifted_targets(batch["labels"])
    teacher_logits = teacher_logits_at(state, teacher, batch, positions)
    with state.updater.precision.autocast():
        logits = run_forward(
            state.wrapped, logits_at, state.model, batch["input_ids"], batch["attention_mask"], positions
        )
    return DISTILL_LOSSES["logit"](logits, teacher_logits, num_loss_tokens_global, temperature=temperature)


def logit_step(state, data, teacher, temperature: float, step: int) -> dict:
    """One optimizer step over the next global batch of rows: ``supervised.step.supervised_step`` with the
    forward KL to the teacher instead of the cross-entropy to the labels."""

    def loss_fn(batch, num_loss_tokens_global):
        loss, metrics = logit_micro_loss(state, teacher, batch, num_loss_tokens_global, temperature)
        return loss, {"kl_sum": metrics["kl_sum"], "num_tokens": metrics["num_tokens"]}

    metrics = supervised_step(state, data, step, loss_fn)
    kl = metrics.pop("sums")  # unscaled KL sum and its tokens, over the micro-batches and ranks
    return {"loss": metrics.pop("loss"), "forward_kl": kl["kl_sum"] / max(kl["num_tokens"], 1), **metrics}


def run_logit(
    cfg: DistillConfig, algo: DistillAlgoConfig, model, tokenizer, teacher, note: str, console, name: str
) -> dict:
    run = start_run(cfg, name, model, seq_len=cfg.fixed_data.max_len, console=console)
    tcfg = run.train  # resolved: the batch size chosen when unset
    data, val_rows = build_data(cfg.fixed_data, tcfg.seed, cfg.model, tokenizer, run.print)
    check_fits_context(model, data)
    if len(data.train_rows) < tcfg.batch_size:
        raise DataError(
            f"{len(data.train_rows)} training rows are fewer than one batch (train.batch_size="
            f"{tcfg.batch_size}); lower train.batch_size or add data"
        )
    run.print(f"[data] {len(data.train_rows)} training rows, {len(data.val_rows)} validation rows")
    run.print(note)
    run.print(f"[algo] mode=logit temperature={algo.temperature}")
    state = build_state(
        run, model, tokenizer, BatchOrder(len(data.train_rows), tcfg.batch_size, tcfg.seed), tcfg.max_steps
    )
    teacher = teacher_of(teacher, state.model, run.device)
    evaluate = make_eval(cfg.fixed_data, tcfg, tokenizer, run, val_rows)

    def run_eval(step: int) -> dict:
        metrics = {"val_loss": validation_loss(state, data)}  # the student's NLL of the rows' own completions
        if evaluate is not None:
            sampler = full_model(state)
            sampler.eval()
            metrics.update(evaluate(sampler, step))
            state.model.train()
        return metrics

    trainer = Trainer(
        step=lambda step: logit_step(state, data, teacher, algo.temperature, step),
        evaluate=run_eval,
        evaluate_at_start=True,
    )
    return train_loop(state, trainer)


# ---- the command --------------------------------------------------------------------------


def check_mode(cfg: DistillConfig) -> None:
    """ConfigError for a mode without its data, or with the other mode's data set."""
    if cfg.mode not in MODES:
        raise ConfigError(f"mode={cfg.mode!r} is not known; valid: {', '.join(MODES)}")
    mine, other = ("data", "fixed_data") if cfg.mode == "on_policy" else ("fixed_data", "data")
    if not (getattr(cfg, mine).task or getattr(cfg, mine).path):
        raise ConfigError(f"mode={cfg.mode} takes its rows from {mine}: set {mine}.task (e.g. addition) or {mine}.path")
    refuse_ignored(getattr(cfg, other), other, ("task", "path"), f"with mode={cfg.mode} (it reads {mine})")
    if cfg.mode == "logit":
        refuse_ignored(cfg.algo, "algo", ("reward_weight",), "with mode=logit (no rewards on fixed data)")
    elif cfg.algo.temperature != 1.0:
        raise ConfigError(
            "algo.temperature is logit mode's; on_policy scores with rollout.temperature (the "
            "distribution the student sampled from); remove algo.temperature"
        )


def run_distill(cfg: DistillConfig, model=None, tokenizer=None, console=None, name: str = "distill") -> dict:
    """Distil ``teacher`` into ``model``; returns the final metrics (``accuracy`` for tasks) and ``run_dir``."""
    check_mode(cfg)
    algo = cfg.algo.resolved()
    if model is None:
        model, tokenizer = load_model(cfg.model)
    teacher, note = load_teacher(cfg, model, tokenizer)
    run = run_on_policy if cfg.mode == "on_policy" else run_logit
    return run(cfg, algo, model, tokenizer, teacher, note, console, name)
