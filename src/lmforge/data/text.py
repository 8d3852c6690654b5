"""Pretraining text: load documents, tokenize, pack into fixed-length blocks, cache on disk.

    docs = load_text_files(["corpus/"])
    data = pack_documents(docs, tokenizer, seq_len=256, cache_dir=Path(".cache/lmforge"))
    inputs, targets = data.train[:, :-1], data.train[:, 1:]          # (N, seq_len) each

Packing: the documents of a split are tokenized (no special tokens), each followed by the eos token,
and concatenated into one stream that is cut into consecutive, non-overlapping blocks of
``seq_len + 1`` tokens; the last partial block is dropped.

Split: documents are shuffled with ``seed`` and ``round(val_fraction * num_docs)`` of them (at least
one when ``val_fraction > 0`` and there are two or more documents) are held out for validation, so no
document is in both splits. When ``val_fraction > 0`` but the held-out documents do not fill one
block (or there is a single document), the last block of the whole stream becomes the validation
set instead; then one document can contribute to both splits, and ``PackedData.val_overlaps_train``
says so.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.errors import DataError
from ..core.fileio import read_text
from ..model.tokenizer import tokenizer_fingerprint

logger = logging.getLogger(__name__)
DATASET_SUFFIXES = (".jsonl", ".json", ".ndjson", ".parquet", ".csv", ".tsv", ".arrow")  # data.path's, not text
_CACHE_VERSION = 1  # bump when the packing rule changes so that old cache files are not reused


def load_text_files(paths: list[str]) -> list[str]:
    """One document per ``.txt`` file; directories are searched recursively. Sorted, deterministic.

    Files named directly are used whatever their suffix, but a dataset file (``.jsonl``, ``.csv``, ...:
    :data:`DATASET_SUFFIXES`) is an error pointing to ``data.path``; inside directories only ``*.txt``.
    Files with only whitespace are skipped; if nothing is left, that is an error.
    """
    if not paths:
        raise DataError("no text paths given; pass .txt files or directories containing them")
    files: list[Path] = []
    for spec in paths:
        path = Path(spec).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.txt") if p.is_file())
            if not found:
                raise DataError(f"{path}: directory contains no .txt files")
            files.extend(found)
        elif path.suffix.lower() in DATASET_SUFFIXES:  # JSON / CSV syntax would be trained on as text
            raise DataError(
                f"{path}: data.files takes plain text files, and this is a dataset file; read its text "
                f"column with data.path={path} (data.columns={{text: <column>}} if it is named otherwise)"
            )
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"{path}: text file or directory not found")
    docs = [read_text(path, "text file") for path in files]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"no text found in {', '.join(map(str, files))} (all files are empty)")
    return docs


@dataclass
class PackedData:
    """Packed token blocks. ``train``: (N_train, seq_len + 1) long; ``val``: (N_val, seq_len + 1) long."""

    train: torch.Tensor
    val: torch.Tensor
    seq_len: int
    val_overlaps_train: bool
    from_cache: bool


def _to_blocks(stream: torch.Tensor, block_len: int) -> torch.Tensor:
    num_blocks = len(stream) // block_len
    # clone: a view would keep (and torch.save would write) the whole stream's storage
    return stream[: num_blocks * block_len].view(num_blocks, block_len).clone()


def _stream(token_lists: list[list[int]], doc_ids: list[int], eos: int) -> torch.Tensor:
    """The documents' tokens, each followed by eos, as one (num_tokens,) long tensor."""
    pieces = [torch.tensor([*token_lists[i], eos], dtype=torch.long) for i in doc_ids]
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)


def _cache_key(docs: list[str], tokenizer, seq_len: int, val_fraction: float, seed: int) -> str:
    settings = f"v{_CACHE_VERSION}|{tokenizer_fingerprint(tokenizer)}|{seq_len}|{val_fraction}|{seed}"
    h = hashlib.sha256(settings.encode("utf-8"))
    for doc in docs:  # length-prefixed so that document boundaries are part of the key
        data = doc.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _pack(
    docs: list[str], tokenizer, seq_len: int, val_fraction: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(train blocks, val blocks, whether val was carved from the whole stream); see module doc."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no eos token, which packing puts between documents")
    token_lists = tokenizer(docs, add_special_tokens=False, verbose=False)["input_ids"]
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    num_val = round(val_fraction * len(docs))
    if val_fraction > 0 and len(docs) >= 2:
        num_val = min(max(num_val, 1), len(docs) - 1)
    else:
        num_val = 0
    val_ids, train_ids = sorted(order[:num_val]), sorted(order[num_val:])
    train_stream, val_stream = _stream(token_lists, train_ids, eos), _stream(token_lists, val_ids, eos)
    block_len = seq_len + 1
    train, val = _to_blocks(train_stream, block_len), _to_blocks(val_stream, block_len)
    overlap = False
    if val_fraction > 0 and len(val) == 0:  # carve one block off the end of the whole stream
        whole = torch.cat([train_stream, val_stream])
        train, val = _to_blocks(whole[:-block_len], block_len), _to_blocks(whole[-block_len:], block_len)
        overlap = True
    if len(train) == 0:
        num_tokens = len(train_stream) + len(val_stream)
        need = block_len * (2 if val_fraction > 0 else 1)
        raise DataError(
            f"not enough text to pack: {len(docs)} document(s) give {num_tokens} tokens, "
            f"but seq_len={seq_len} "
            f"needs at least {need} (one train block{' and one val block' if val_fraction > 0 else ''} of "
            f"seq_len + 1 tokens); add text or lower seq_len"
        )
    return train, val, overlap


def _load_cache(cache_file: Path) -> dict | None:
    """A packed-data cache file, or None (with a warning) when it is unreadable: it is rebuilt."""
    try:
        saved = torch.load(cache_file, weights_only=True)
        if isinstance(saved, dict) and {"train", "val", "val_overlaps_train"} <= saved.keys():
            return saved
        problem = "it does not hold packed data"
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt: torch raises several types (RuntimeError, EOFError, ...)
        problem = f"{type(exc).__name__}: {exc}"
    logger.warning("ignoring the unreadable data cache %s (%s); packing the text again", cache_file, problem)
    return None


def pack_documents(
    docs: list[str],
    tokenizer,
    seq_len: int,
    val_fraction: float = 0.05,
    seed: int = 0,
    cache_dir: Path | None = None,
) -> PackedData:
    """Tokenize and pack ``docs`` into train/val blocks of ``seq_len + 1`` tokens (see module doc).

    With ``cache_dir``, the result is stored in ``cache_dir/packed-<key>.pt``, the key hashing the
    documents' text, the tokenizer (:func:`lmforge.model.tokenizer.tokenizer_fingerprint`), ``seq_len``,
    ``val_fraction`` and ``seed``; a later call with the same inputs loads it without tokenizing.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if not docs:
        raise DataError("no documents to pack")
    cache_file = None
    if cache_dir is not None:
        key = _cache_key(docs, tokenizer, seq_len, val_fraction, seed)
        cache_file = Path(cache_dir) / f"packed-{key[:32]}.pt"
        saved = _load_cache(cache_file) if cache_file.is_file() else None
        if saved is not None:
            overlap = saved["val_overlaps_train"]
            return PackedData(saved["train"], saved["val"], seq_len, overlap, from_cache=True)
    train, val, overlap = _pack(docs, tokenizer, seq_len, val_fraction, seed)
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
        torch.save({"train": train, "val": val, "val_overlaps_train": overlap}, tmp)
        os.replace(tmp, cache_file)  # atomic: a crashed run never leaves a half-written cache file
    return PackedData(train, val, seq_len, overlap, from_cache=False)
