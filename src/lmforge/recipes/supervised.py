"""The supervised loop shared by ``pretrain`` and ``sft``: next-token cross-entropy on the positions
the labels select, normalised by the loss tokens of the whole optimizer step.

Read top to bottom: set up -> (resume) -> for each step: fetch micro-batches, count loss tokens,
forward/backward each micro-batch, clip, step -> log / evaluate / checkpoint -> final save + summary.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import torch

from .. import checkpoint as ckpt
from ..losses import sft_loss
from ..metrics import RunLogger, StepTimer, plot_run, print_summary, summary
from ..train import (BatchOrder, Precision, Updater, check_finite, count_loss_tokens, logits_at,
                     shifted_targets)
from .common import Run


@dataclasses.dataclass
class SupervisedData:
    """Rows and how to batch them. ``collate(rows) -> {input_ids, labels, attention_mask}`` with
    labels aligned to input_ids and -100 where no loss is taken."""

    train_rows: list
    val_rows: list
    collate: Callable[[list], dict]


def micro_loss(model, batch: dict, num_loss_tokens_step: int, precision: Precision):
    """Loss of one micro-batch, already divided by the step's loss-token count."""
    positions, targets = shifted_targets(batch["labels"])
    with precision.autocast():
        logits = logits_at(model, batch["input_ids"], batch["attention_mask"], positions)
    return sft_loss(logits, targets, num_loss_tokens_step)


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.no_grad()
def validation_loss(model, data: SupervisedData, batch_rows: int, device, precision: Precision,
                    max_rows: int = 512) -> float:
    """Mean NLL per loss token over (up to ``max_rows``) validation rows."""
    was_training = model.training
    model.eval()
    nll, tokens = 0.0, 0
    rows = data.val_rows[:max_rows]
    for start in range(0, len(rows), batch_rows):
        batch = to_device(data.collate(rows[start:start + batch_rows]), device)
        count = count_loss_tokens(batch["labels"])
        if count == 0:
            continue
        _, metrics = micro_loss(model, batch, count, precision)
        nll += float(metrics["nll_sum"])
        tokens += count
    model.train(was_training)
    return nll / max(tokens, 1)


def train_supervised(run: Run, model, tokenizer, data: SupervisedData,
                     evaluate: Callable[[object, int], dict] | None = None) -> dict:
    """Train ``model`` on ``data`` as configured by ``run``; returns the final evaluation metrics."""
    cfg, device = run.cfg, run.device
    tcfg = cfg.train
    model.to(device)
    if run.choices.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    model.train()
    updater = Updater.build(model, cfg.optim, tcfg.max_steps, Precision(device, run.choices.dtype))
    precision = updater.precision
    order = BatchOrder(len(data.train_rows), run.choices.micro_batch_size, tcfg.seed)
    state = {"step": 0, "best_val_loss": math.inf}

    saved = ckpt.resume_training(tcfg.resume, run.dir, model, updater, order, run.print)
    if saved:
        state = {"step": saved["step"], "best_val_loss": saved["best_val_loss"]}

    def trainer_state() -> dict:
        return {**updater.state_dict(), "data": order.state_dict(), "best_val_loss": state["best_val_loss"]}

    logger = RunLogger(run.dir, cfg.logging, tcfg.max_steps, console=run.console)
    timer = StepTimer()
    final_metrics: dict = {}
    logger.start_progress(f"{run.name}", completed=state["step"])
    try:
        for step in range(state["step"], tcfg.max_steps):
            t0 = time.perf_counter()
            batches = [to_device(data.collate([data.train_rows[i] for i in order.next()]), device)
                       for _ in range(tcfg.grad_accum)]
            num_loss_tokens = sum(count_loss_tokens(b["labels"]) for b in batches)
            data_time = time.perf_counter() - t0
            loss_sum = torch.zeros((), device=device)
            for batch in batches:
                loss, _ = micro_loss(model, batch, max(num_loss_tokens, 1), precision)
                precision.backward(loss)
                loss_sum += loss.detach()
            check_finite(loss_sum, step + 1)  # once per step (a host sync on GPUs), before the update
            lr = updater.scheduler.get_last_lr()[0]
            grad_norm = updater.step()
            step_time = time.perf_counter() - t0
            num_tokens = sum(int(b["attention_mask"].sum()) for b in batches)
            timer.record(step_time, data_time, num_tokens)
            done = step + 1
            logger.log(done, {"loss": loss_sum, "lr": lr, "grad_norm": grad_norm,
                              "tokens_per_s": num_tokens / step_time, "step_time": step_time,
                              "loss_tokens": num_loss_tokens},
                       echo=done % tcfg.log_every == 0 or done == 1)
            logger.advance(done)
            last = done == tcfg.max_steps
            if (tcfg.eval_every and done % tcfg.eval_every == 0) or last:
                final_metrics = run_eval(run, model, data, precision, evaluate, done, logger)
                if final_metrics["val_loss"] < state["best_val_loss"]:
                    state["best_val_loss"] = final_metrics["val_loss"]
                    ckpt.save_model_dir(run.dir / "best", model, tokenizer)
            if (tcfg.save_every and done % tcfg.save_every == 0) or last:
                ckpt.save_checkpoint(run.dir, done, model, tokenizer, trainer_state(), tcfg.keep_last)
        ckpt.save_model_dir(run.dir / "final", model, tokenizer)
    finally:
        logger.close()
    figures = summary(timer, run.flops_per_token(model), run.peak_gflops(), device)
    print_summary(logger, figures)
    plot_run(run.dir)
    return final_metrics


def run_eval(run: Run, model, data: SupervisedData, precision, evaluate, step: int, logger) -> dict:
    val_loss = validation_loss(model, data, run.choices.micro_batch_size, run.device, precision)
    metrics = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}
    if evaluate is not None:
        model.eval()
        metrics.update(evaluate(model, step))
        model.train()
    logger.log(step, metrics, kind="eval")
    return metrics
