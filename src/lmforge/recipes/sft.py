"""``lmforge sft CONFIG``: supervised fine-tuning with a completion-only loss.

Data is any source of docs/data.md (JSONL, Parquet, CSV, Arrow, a ``save_to_disk`` directory, a cached hub
id) of chat (``messages``) or ``prompt``/``completion`` rows, or a
built-in synthetic task (``data.task=addition``), whose held-out accuracy is then reported, or an
environment's scripted demonstrations of a task's problems (``data.env=calculator``, lmforge.envs.demos).
"""

from __future__ import annotations

import dataclasses

from ..core.config import LoggingConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, section
from ..model.load import load_model
from ..runtime.run import start_run
from ..supervised.sft_data import SFTDataConfig, build_data, check_fits_context, make_eval
from ..supervised.step import train_supervised


@dataclasses.dataclass
class SFTConfig:
    model: ModelConfig = section(ModelConfig, "model to fine-tune")
    data: SFTDataConfig = section(SFTDataConfig, "training data")
    optim: OptimConfig = section(OptimConfig, "optimizer and LR schedule")
    train: TrainConfig = section(TrainConfig, "loop, evaluation and checkpoints")
    parallel: ParallelConfig = section(ParallelConfig, "processes under torchrun (docs/distributed.md)")
    logging: LoggingConfig = section(LoggingConfig, "progress and metrics sinks")


def run_sft(cfg: SFTConfig, model=None, tokenizer=None, console=None, name: str = "sft") -> dict:
    """Fine-tune and return the final evaluation metrics (val_loss, accuracy for tasks, run_dir)."""
    if model is None:
        model, tokenizer = load_model(cfg.model)
    run = start_run(cfg, name, model, seq_len=cfg.data.max_len, console=console)
    data, val_rows = build_data(cfg.data, cfg.train.seed, cfg.model, tokenizer, run.print)
    check_fits_context(model, data)
    run.print(f"[data] {len(data.train_rows)} training rows, {len(data.val_rows)} validation rows")
    return train_supervised(run, model, tokenizer, data, make_eval(cfg.data, run.train, tokenizer, run, val_rows))
