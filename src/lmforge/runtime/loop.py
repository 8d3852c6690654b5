"""The one training loop. Every recipe (pretrain, SFT, GRPO, PPO, the antidistillation student) runs
here; a recipe supplies only its step function and its evaluation.

Read top to bottom: :func:`build_state` wraps the trained modules for the parallel strategy, builds
the optimizer and resumes -> :func:`train_loop` runs ``step(n)`` for n = resumed step + 1 ..
max_steps, logs each step's metrics, evaluates and checkpoints on their cadence, then writes the
final model, the summary and the curves. Only rank 0 writes to the console and to files.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..model import load, lora
from ..parallel.wrap import Root, full_state_dict, is_sharded, unwrap, wrap
from . import checkpoint as ckpt
from .metrics import RunLogger, StepTimer, plot_run, print_summary, summary, truncate_metrics
from .optim import BatchOrder, Precision, Updater
from .quant_hooks import apply_train_qat, write_quantized_copies
from .run import Run, release_run_lock


@dataclasses.dataclass
class TrainState:
    """What the loop trains and checkpoints."""

    run: Run
    wrapped: torch.nn.Module  # the Root, wrapped for the parallel strategy: every training forward goes through it
    model: torch.nn.Module  # the policy (an HF causal LM), inside the root
    tokenizer: Any
    updater: Updater
    order: BatchOrder  # the resumable data order
    step: int = 0  # optimizer steps (RL: RL steps) already done
    saved: dict = dataclasses.field(default_factory=dict)  # the trainer state resumed from ({} if fresh)

    _full: Any = None  # FSDP2: the gathered copy that evaluation samples from

    @property
    def root(self) -> Root:
        return unwrap(self.wrapped)


def full_model(state: TrainState) -> torch.nn.Module:
    """The policy with all its parameters, for generation (evaluation samples, rollouts).

    One process or DDP: the policy itself. FSDP2: a plain copy on this rank, refreshed from the shards
    on each call (a collective: every rank calls it at the same point).
    """
    if not is_sharded(state.wrapped):
        return state.model
    from transformers import AutoModelForCausalLM

    weights = full_state_dict(state.wrapped)
    if state._full is None:
        state._full = AutoModelForCausalLM.from_config(state.model.config).to(state.run.device).eval()
        if getattr(state.model.config, "lmforge_qat", None):  # sample from what is trained: the fake-quantized model
            from ..quantize import apply_qat

            apply_qat(state._full, state.model.config.lmforge_qat)
        state._full.requires_grad_(False)
    missing, unexpected = state._full.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if missing:
        state._full.tie_weights()
    return state._full


def build_state(
    run: Run,
    model,
    tokenizer,
    order: BatchOrder,
    num_updates: int,
    extra_modules: dict[str, torch.nn.Module] | None = None,
) -> TrainState:
    """Move to the device, turn on gradient checkpointing where chosen, wrap (DDP / FSDP2), build the
    optimizer (AdamW, schedule over ``num_updates``, precision) and resume as ``train.resume`` says.

    ``extra_modules`` (PPO's value head) are trained, clipped and checkpointed with the model.
    """
    model = lora.apply_for_run(model, run.model_cfg.lora, run.train, run.ctx).to(
        run.device
    )  # LoRA: adapters only train
    apply_train_qat(run, model)  # train.qat: before the optimizer and the wrapping
    if run.choices.gradient_checkpointing:
        load.enable_activation_checkpointing(model)
        model.config.use_cache = False
        if lora.has_adapters(model):  # frozen embeddings: reentrant checkpointing (older transformers'
            # default) needs block inputs that want grads; the non-reentrant default of 5.x does not
            model.enable_input_require_grads()
    if lora.has_adapters(model):
        trainable, total = lora.count_trainable(model)
        run.print(
            f"[lora] training {trainable:,} adapter parameters of {total:,} ({100 * trainable / total:.2f}%); "
            "the base model is frozen"
        )
    model.train()
    wrapped = wrap(
        Root(policy=model, **(extra_modules or {})), run.ctx, run.device, run.choices.dtype, run.parallel.grad_sync
    )
    tcfg = run.train
    updater = Updater.build(
        wrapped,
        run.optim,
        num_updates,
        Precision(run.device, run.choices.dtype),
        tcfg.on_nonfinite,
        tcfg.max_nonfinite_skips,
    )
    state = TrainState(run, wrapped, model, tokenizer, updater, order)
    state.saved = ckpt.resume_training(run.train.resume, run.dir, state, run.print)
    state.step = state.saved.get("step", 0)
    return state


@dataclasses.dataclass
class Trainer:
    """A recipe's part of the loop.

    ``step(n) -> metrics`` runs optimizer step (RL: RL step) ``n`` (1-based) and returns its metrics,
    already reduced over ranks, plus the reserved keys ``num_tokens`` (tokens this rank processed)
    and optionally ``num_flops`` (matmul FLOPs this rank executed) and ``data_time`` (seconds).
    """

    step: Callable[[int], dict]
    evaluate: Callable[[int], dict] | None = None  # -> metrics, at eval_every and at the end
    evaluate_at_start: bool = False  # also at step 0, logged as the curve's start and returned as <key>_before
    best_metric: str | None = None  # keep best/ at the lowest value of this evaluation metric
    extra_state: Callable[[], dict] = dict  # more trainer state to checkpoint (PPO: the value head)
    save_final_extra: Callable[[Path], None] | None = None
    time_keys: tuple[str, ...] = ()  # per-step seconds summed for the summary's time split


class NullLogger:
    """The logger of ranks other than 0: takes every call, writes nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def make_logger(run: Run):
    if not run.ctx.is_main:
        return NullLogger()
    return RunLogger(run.dir, run.logging, run.train.max_steps, console=run.console)


def due(every: int, step: int, last: bool) -> bool:
    return bool(every and step % every == 0) or last


def train_loop(state: TrainState, trainer: Trainer) -> dict:
    """Steps ``state.step + 1 .. train.max_steps``; then the final model, the summary and the curves.
    Returns the last evaluation's metrics (plus ``<key>_before`` from a start evaluation) and ``run_dir``."""
    run, tcfg = state.run, state.run.train
    if run.ctx.is_main:  # each step logged once: a resumed run drops what came after its checkpoint
        truncate_metrics(run.dir / "metrics.jsonl", state.step)
    logger = make_logger(run)
    timer, totals = StepTimer(), dict.fromkeys(trainer.time_keys, 0.0)
    if "timer" in state.saved:  # the summary covers the whole run, not just since the resume
        timer.load_state_dict(state.saved["timer"])
        totals.update({k: v for k, v in state.saved.get("time_totals", {}).items() if k in totals})
    best = state.saved.get("best_metric", state.saved.get("best_val_loss", float("inf")))
    final: dict = {}
    try:  # the run directory's lock is released however the run ends
        logger.start_progress(run.name, completed=state.step)
        try:
            if trainer.evaluate is not None and trainer.evaluate_at_start and state.step == 0:
                before = trainer.evaluate(0)
                logger.log(0, before, kind="eval")
                final = {f"{key}_before": value for key, value in before.items()}
            for step in range(state.step, tcfg.max_steps):
                done, start = step + 1, time.perf_counter()
                run.ctx.mark(f"the collectives of training step {done}")  # named if a rank stalls here
                metrics = trainer.step(done)
                step_time = time.perf_counter() - start
                work = run.ctx.all_reduce(
                    torch.tensor([metrics.pop("num_tokens"), metrics.pop("num_flops", 0.0)], dtype=torch.float64)
                )  # over all ranks
                num_tokens = int(work[0])
                timer.record(step_time, metrics.pop("data_time", 0.0), num_tokens, float(work[1]))
                totals = {key: totals[key] + metrics[key] for key in trainer.time_keys}
                logger.log(
                    done,
                    {**metrics, "tokens_per_s": num_tokens / step_time, "step_time": step_time},
                    echo=done % tcfg.log_every == 0 or done == 1,
                )
                logger.advance(done)
                state.step = done
                last = done == tcfg.max_steps
                if trainer.evaluate is not None and due(tcfg.eval_every, done, last):
                    run.ctx.mark(f"the evaluation at step {done}")
                    evaluation = trainer.evaluate(done)
                    logger.log(done, evaluation, kind="eval")
                    final.update(evaluation)
                    if trainer.best_metric and evaluation[trainer.best_metric] < best:
                        best = evaluation[trainer.best_metric]
                        ckpt.save_model_dir(run.dir / "best", state, quantized_copies(state, run.dir / "best"))
                if due(tcfg.save_every, done, last):
                    ckpt.save_checkpoint(
                        state,
                        {
                            **trainer.extra_state(),
                            "best_metric": best,
                            "timer": timer.state_dict(),
                            "time_totals": dict(totals),
                        },
                        tcfg.keep_last,
                    )
            run.ctx.mark("the save of final/")
            ckpt.save_model_dir(run.dir / "final", state, quantized_copies(state, run.dir / "final"))
            if lora.has_adapters(state.model) and run.model_cfg.lora.save_merged:
                ckpt.save_merged_dir(run.dir / "final" / "merged", state)
            if trainer.save_final_extra is not None and run.ctx.is_main:
                trainer.save_final_extra(run.dir / "final")
        finally:
            logger.close()
        finish(state, timer, totals, logger)
    finally:
        release_run_lock(run)
    return {**final, "run_dir": str(run.dir)}


def quantized_copies(state: TrainState, checkpoint_dir: Path):
    """``train.save_quantized``: a writer of the quantized copies for ``ckpt.save_model_dir``, which
    runs it (rank 0) inside the new best/ or final/ before that is renamed into place, so the
    directory appears with its copies; None when no format is asked for. Under FSDP2 every rank
    joins the gather here. A failed format is reported, never fatal."""
    formats = state.run.train.save_quantized
    if not formats:
        return None
    model = full_model(state)
    return lambda directory: write_quantized_copies(
        model, state.tokenizer, directory, formats, state.run.print, shown_as=checkpoint_dir
    )


def finish(state: TrainState, timer: StepTimer, totals: dict, logger) -> None:
    """End-of-run summary (rank 0): time, throughput over all ranks, MFU, memory; the curves."""
    run = state.run
    if not run.ctx.is_main:
        return
    figures = summary(timer, run.flops_per_token(state.model), run.peak_gflops() * run.ctx.world_size, run.device)
    figures.update({f"{key}_s": value for key, value in totals.items()})
    print_summary(logger, figures)
    if totals:
        run.print(
            "[summary] time split: "
            + " | ".join(f"{key.removeprefix('time_')} {value:.1f}s" for key, value in totals.items())
        )
    plot_run(run.dir)
    run.print(f"[done] run directory: {run.dir}")
