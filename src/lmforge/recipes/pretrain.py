"""``lmforge pretrain CONFIG``: train a model (tiny or loaded) on packed raw text.

The text is ``.txt`` files (``data.files``) or the text column of a dataset (``data.path``, any source
of docs/data.md), read whole, or, with ``data.streaming``, packed as training consumes it.

Optionally trains its own byte-level BPE tokenizer on the same files first, so a model can be
built from nothing but text.
"""

from __future__ import annotations

import dataclasses
from itertools import islice
from pathlib import Path
from typing import Iterator

import torch

from ..core.config import LoggingConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, opt, section
from ..core.errors import ConfigError, DataError
from ..data.source import TEXT_COLUMN_NAMES, read_text_column
from ..data.stream import StreamingBlocks, first_blocks, held_out
from ..data.text import load_text_files, pack_documents
from ..model.load import cache_dir, context_length, load_model
from ..model.tokenizer import SAMPLE_TEXTS, check_unknown_tokens, train_bpe_tokenizer
from ..rollout.engine import SamplingParams, generate
from ..rollout.evaluation import save_samples
from ..runtime.run import start_run
from ..supervised.step import SupervisedData, train_supervised


@dataclasses.dataclass
class TextDataConfig:
    files: list[str] = opt([], "text files or directories (searched recursively for .txt)")
    path: str = opt(
        "",
        "instead of files: a dataset with a 'text' column: JSONL, Parquet, CSV, Arrow, a save_to_disk "
        "dir or a cached hub id (docs/data.md)",
    )
    split: str = opt("train", "path: the split to train on (a single file is split 'train')")
    eval_split: str = opt("", "path: a named split for the validation text instead of data.val_fraction")
    subset: str = opt("", "path: the hub dataset's config name")
    columns: dict[str, str] = opt(
        {}, "path: {text: <column>} when the text column is named otherwise", keys=TEXT_COLUMN_NAMES
    )
    streaming: bool = opt(
        False,
        "path: read and pack the text as training consumes it (corpora larger than "
        "memory; no shuffle, no disk cache; docs/data.md)",
    )
    val_blocks: int = opt(
        64, "streaming: validation blocks, packed from the first held-out documents", free_on_resume=True
    )
    seq_len: int = opt(128, "tokens per packed training block")
    val_fraction: float = opt(0.05, "fraction of documents held out for validation")
    cache: bool = opt(True, "cache tokenized blocks on disk ($LMFORGE_CACHE/text)", free_on_resume=True)

    def validate(self) -> None:
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(
                f"data.val_fraction must be in [0, 1) (a fraction: 0.05 holds out 5%), got {self.val_fraction}"
            )
        if self.seq_len < 8:
            raise ConfigError(f"data.seq_len must be >= 8, got {self.seq_len}")
        if self.files and self.path:
            raise ConfigError("set one of data.files (.txt files) and data.path (a dataset with a text column)")
        if self.streaming and not self.path:
            raise ConfigError("data.streaming reads a dataset: set data.path (data.files are read whole)")


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


def dataset_docs(d: TextDataConfig, split: str, streaming: bool = False) -> Iterator[str]:
    """The non-blank documents of a split of ``data.path`` (its ``text`` column after ``data.columns``)."""
    return (doc for doc in read_text_column(d.path, split, d.subset, d.columns, streaming) if doc.strip())


def streaming_data(cfg: PretrainConfig, tokenizer, run) -> SupervisedData:
    """Training blocks packed as they are consumed; validation blocks from the held-out documents
    (``data.val_fraction``, by a hash of their text) or the named ``data.eval_split``."""
    d, fraction = cfg.data, cfg.data.val_fraction

    def train_docs() -> Iterator[str]:  # called again for every pass over the stream
        docs = dataset_docs(d, d.split, streaming=True)
        return docs if d.eval_split else (doc for doc in docs if not held_out(doc, fraction))

    if d.eval_split:
        val_docs = dataset_docs(d, d.eval_split, streaming=True)
    else:
        val_docs = (doc for doc in dataset_docs(d, d.split, streaming=True) if held_out(doc, fraction))
    val_rows = []
    if d.eval_split or fraction > 0:
        val_rows = list(first_blocks(val_docs, tokenizer, d.seq_len, d.val_blocks))
    blocks = StreamingBlocks(train_docs, tokenizer, d.seq_len, run.train.batch_size)
    run.print(
        f"[data] streaming {d.path} (split {d.split!r}) in blocks of {d.seq_len} tokens; "
        f"{len(val_rows)} validation blocks"
    )
    return SupervisedData(blocks, val_rows, collate_blocks, order=blocks)  # indexed by the indices it hands out


def run_pretrain(cfg: PretrainConfig, console=None) -> dict:
    d = cfg.data
    d.validate()
    if not d.files and not d.path:
        raise ConfigError(
            "pretraining needs text: set data.files to .txt files or directories, or data.path to a "
            "dataset with a text column (docs/data.md)"
        )
    if cfg.tokenizer.train and not d.files:
        raise ConfigError(
            "tokenizer.train learns from the .txt files of data.files; with data.path, train a "
            "tokenizer separately and set model.tokenizer"
        )
    docs = val_docs = None
    if d.files:
        docs = load_text_files(d.files)
    elif not d.streaming:
        docs = list(dataset_docs(d, d.split))
        val_docs = list(dataset_docs(d, d.eval_split)) if d.eval_split else None
        if not docs:
            raise DataError(f"{d.path}: no text in split {d.split!r} (every document is blank)")
    tokenizer = None
    if cfg.tokenizer.train:  # in memory: the run directory is not ours until start_run has locked it
        files = [Path(f) for f in cfg.data.files]
        txt_files = [p for f in files for p in ([f] if f.is_file() else sorted(f.rglob("*.txt")))]
        tokenizer = train_bpe_tokenizer(txt_files, cfg.tokenizer.vocab_size, None, cfg.tokenizer.min_frequency)
    model, tokenizer = load_model(cfg.model, tokenizer)
    context = context_length(model)
    if context is not None and cfg.data.seq_len + 1 > context:  # a block is seq_len + 1 tokens (inputs + last target)
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len}: a training block of {cfg.data.seq_len + 1} tokens does not "
            f"fit the model's context of {context} (model.max_position_embeddings); set "
            f"data.seq_len <= {context - 1}"
        )
    run = start_run(cfg, "pretrain", model, seq_len=cfg.data.seq_len, console=console)
    if cfg.tokenizer.train and run.ctx.is_main:
        tokenizer.save_pretrained(str(run.dir / "tokenizer"))
    sample = docs if docs is not None else list(islice(dataset_docs(d, d.split, streaming=True), SAMPLE_TEXTS))
    check_unknown_tokens(tokenizer, sample, cfg.model, d.path or "data.files", run.print)
    if d.streaming:
        data = streaming_data(cfg, tokenizer, run)
        val = torch.stack(data.val_rows) if data.val_rows else torch.empty(0, d.seq_len + 1, dtype=torch.long)
        return train_supervised(run, model, tokenizer, data, make_sampler(cfg, tokenizer, val, run))
    cache = cache_dir() / "text" if cfg.data.cache else None
    fraction = 0.0 if val_docs is not None else cfg.data.val_fraction
    packed = pack_documents(docs, tokenizer, cfg.data.seq_len, fraction, cfg.train.seed, cache)
    if val_docs is not None:  # a named split: its blocks are the validation set
        packed.val = pack_documents(val_docs, tokenizer, cfg.data.seq_len, 0.0, cfg.train.seed, cache).train
    run.print(
        f"[data] {len(docs)} documents -> {len(packed.train)} train / {len(packed.val)} val blocks "
        f"of {cfg.data.seq_len} tokens"
    )
    data = SupervisedData(list(packed.train), list(packed.val), collate_blocks)
    return train_supervised(run, model, tokenizer, data, make_sampler(cfg, tokenizer, packed.val, run))
