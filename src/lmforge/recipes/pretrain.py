"""``lmforge pretrain CONFIG``: train a model (tiny or loaded) on packed raw text.

Optionally trains its own byte-level BPE tokenizer on the same files first, so a model can be
built from nothing but text.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..config import LoggingConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, opt, section
from ..data.text import load_text_files, pack_documents
from ..errors import ConfigError
from ..evaluation import save_samples
from ..models import cache_dir, context_length, load_model
from ..rollout.engine import SamplingParams, generate
from ..tokenizer import train_bpe_tokenizer
from ..runtime.run import start_run
from .supervised import SupervisedData, train_supervised


@dataclasses.dataclass
class TextDataConfig:
    files: list[str] = opt([], "text files or directories (searched recursively for .txt)")
    seq_len: int = opt(128, "tokens per packed training block")
    val_fraction: float = opt(0.05, "fraction of documents held out for validation")
    cache: bool = opt(True, "cache tokenized blocks on disk ($LMFORGE_CACHE/text)")

    def validate(self) -> None:
        if self.seq_len < 8:
            raise ConfigError(f"data.seq_len must be >= 8, got {self.seq_len}")


@dataclasses.dataclass
class TokenizerTrainConfig:
    train: bool = opt(False, "train a byte-level BPE tokenizer on data.files first (saved in the run)")
    vocab_size: int = opt(2048, "BPE vocabulary size")
    min_frequency: int = opt(2, "minimum pair frequency for a BPE merge")


@dataclasses.dataclass
class PretrainConfig:
    model: ModelConfig = section(ModelConfig, "model to train")
    tokenizer: TokenizerTrainConfig = section(TokenizerTrainConfig, "tokenizer training")
    data: TextDataConfig = section(TextDataConfig, "text data")
    optim: OptimConfig = section(OptimConfig, "optimizer and LR schedule")
    train: TrainConfig = section(TrainConfig, "loop, evaluation and checkpoints")
    parallel: ParallelConfig = section(ParallelConfig, "processes under torchrun (docs/distributed.md)")
    logging: LoggingConfig = section(LoggingConfig, "progress and metrics sinks")


def collate_blocks(blocks: list[torch.Tensor]) -> dict:
    """Packed blocks of seq_len + 1 tokens: every next token is a target."""
    ids = torch.stack(blocks)
    return {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}


def make_sampler(cfg: PretrainConfig, tokenizer, val_blocks: torch.Tensor, run):
    """Greedy continuations of the first tokens of a few validation blocks."""
    prompts = [row[:16].tolist() for row in val_blocks[: cfg.train.num_samples]]
    if not prompts:  # train.num_samples=0 (or no validation blocks): validation loss only
        return None

    def evaluate(model, step: int) -> dict:
        params = SamplingParams(temperature=0.0, max_new_tokens=cfg.train.max_new_tokens)
        out = generate(model, prompts, params, pad_token_id=tokenizer.pad_token_id or 0)
        texts = [tokenizer.decode(row.tolist()) for row in out.completion_ids]
        if run.ctx.is_main:
            save_samples(run.dir, step, [tokenizer.decode(p) for p in prompts], texts, run.print)
        return {}

    return evaluate


def run_pretrain(cfg: PretrainConfig, console=None) -> dict:
    if not cfg.data.files:
        raise ConfigError("pretraining needs text: set data.files to .txt files or directories")
    docs = load_text_files(cfg.data.files)
    tokenizer = None
    if cfg.tokenizer.train:
        tok_dir = Path(cfg.train.output_dir) / "tokenizer"
        files = [Path(f) for f in cfg.data.files]
        txt_files = [p for f in files for p in ([f] if f.is_file() else sorted(f.rglob("*.txt")))]
        tokenizer = train_bpe_tokenizer(txt_files, cfg.tokenizer.vocab_size, tok_dir, cfg.tokenizer.min_frequency)
    model, tokenizer = load_model(cfg.model, tokenizer)
    context = context_length(model)
    if context is not None and cfg.data.seq_len + 1 > context:  # a block is seq_len + 1 tokens (inputs + last target)
        raise ConfigError(f"data.seq_len={cfg.data.seq_len}: a training block of {cfg.data.seq_len + 1} tokens does not "
                          f"fit the model's context of {context} (model.max_position_embeddings); set "
                          f"data.seq_len <= {context - 1}")
    run = start_run(cfg, "pretrain", model, seq_len=cfg.data.seq_len, console=console)
    packed = pack_documents(docs, tokenizer, cfg.data.seq_len, cfg.data.val_fraction, cfg.train.seed,
                            cache_dir() / "text" if cfg.data.cache else None)
    run.print(f"[data] {len(docs)} documents -> {len(packed.train)} train / {len(packed.val)} val blocks "
              f"of {cfg.data.seq_len} tokens")
    data = SupervisedData(list(packed.train), list(packed.val), collate_blocks)
    return train_supervised(run, model, tokenizer, data, make_sampler(cfg, tokenizer, packed.val, run))
