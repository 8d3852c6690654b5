"""Streaming pretraining text: documents read one at a time and packed into blocks as training
consumes them, so a corpus larger than memory never has to be loaded or tokenized whole.

    blocks = StreamingBlocks(lambda: read_text_column("corpus/", streaming=True), tokenizer, seq_len=256,
                             batch_rows=32)
    rows = blocks.next()                     # global indices of the next batch's blocks
    batch = [blocks[i] for i in rows]        # (seq_len + 1,) long tensors

Packing is the rule of :mod:`lmforge.data.text` (each document's tokens, then eos, concatenated and
cut into consecutive blocks of ``seq_len + 1``; the last partial block of a pass is dropped), applied
to the documents in stream order: :func:`pack_stream` yields exactly the blocks that
``pack_documents(docs, val_fraction=0)`` stacks (a test checks this). There is no shuffle: blocks are
trained on in stream order, and a new pass starts when the stream ends.

Held-out text: a document is held out when the sha256 of its text falls below ``val_fraction``
(:func:`held_out`), a fixed function of the text that needs no look at the rest of the corpus; the
validation blocks are the first ``max_blocks`` packed from those documents (or from a named split).

Resume: :class:`StreamingBlocks` saves (pass, blocks consumed) and on resume re-reads the stream
and skips that many blocks, re-tokenizing them (the cost of not keeping an index of the corpus).
Under torchrun every rank reads the whole stream and trains on its share of each batch.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Iterable, Iterator

import torch

from ..core.errors import DataError


def pack_stream(docs: Iterable[str], tokenizer, seq_len: int, docs_per_call: int = 64) -> Iterator[torch.Tensor]:
    """Blocks of ``seq_len + 1`` tokens (long) from ``docs`` in order (module doc)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no eos token, which packing puts between documents")
    block_len, carry, chunk = seq_len + 1, [], []

    def flush():
        for ids in tokenizer(chunk, add_special_tokens=False, verbose=False)["input_ids"]:
            carry.extend(ids)
            carry.append(eos)
        chunk.clear()

    for doc in docs:
        chunk.append(doc)
        if len(chunk) < docs_per_call:
            continue
        flush()
        while len(carry) >= block_len:
            yield torch.tensor(carry[:block_len], dtype=torch.long)
            del carry[:block_len]
    if chunk:
        flush()
    while len(carry) >= block_len:
        yield torch.tensor(carry[:block_len], dtype=torch.long)
        del carry[:block_len]


def held_out(doc: str, val_fraction: float) -> bool:
    """Whether ``doc`` is a validation document: sha256 of its text, as a fraction, below ``val_fraction``."""
    digest = hashlib.sha256(doc.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def first_blocks(docs: Iterable[str], tokenizer, seq_len: int, max_blocks: int) -> torch.Tensor:
    """The first ``max_blocks`` packed blocks of ``docs`` as (N, seq_len + 1); reads no further."""
    blocks = []
    for block in pack_stream(docs, tokenizer, seq_len):
        blocks.append(block)
        if len(blocks) >= max_blocks:
            break
    return torch.stack(blocks) if blocks else torch.empty(0, seq_len + 1, dtype=torch.long)


class StreamingBlocks:
    """The training blocks of a document stream, and their resumable order (``next`` /
    ``state_dict`` / ``load_state_dict``, as :class:`lmforge.runtime.optim.BatchOrder`).

    ``open_docs()`` returns a fresh iterator over the training documents (called once per pass).
    Block indices count up over the whole run; only the current batch's blocks are kept.
    """

    def __init__(self, open_docs: Callable[[], Iterator[str]], tokenizer, seq_len: int, batch_rows: int):
        self.open_docs, self.tokenizer, self.seq_len, self.batch_rows = open_docs, tokenizer, seq_len, batch_rows
        self.epoch, self.pos = 0, 0  # pass over the stream, blocks consumed in it
        self._blocks: Iterator[torch.Tensor] | None = None
        self._held: dict[int, torch.Tensor] = {}
        self._count = 0  # blocks handed out so far (their indices)

    def _next_block(self) -> torch.Tensor:
        if self._blocks is None:
            self._blocks = pack_stream(self.open_docs(), self.tokenizer, self.seq_len)
        block = next(self._blocks, None)
        if block is None:  # the stream ended: start the next pass
            if self.pos == 0:
                raise DataError(
                    f"the text stream holds less than one block of seq_len + 1 = {self.seq_len + 1} "
                    "tokens; add text or lower data.seq_len"
                )
            self.epoch, self.pos = self.epoch + 1, 0
            self._blocks = pack_stream(self.open_docs(), self.tokenizer, self.seq_len)
            return self._next_block()
        self.pos += 1
        return block

    def next(self) -> list[int]:
        self._held = {}
        for _ in range(self.batch_rows):
            self._held[self._count] = self._next_block()
            self._count += 1
        return list(self._held)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self._held[index]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "streaming": True}

    def load_state_dict(self, state: dict) -> None:
        if not state.get("streaming"):
            raise DataError(
                "this checkpoint was written by a run that read its text without data.streaming; "
                "resume it with the same data settings"
            )
        self._blocks, self._held = None, {}
        self.epoch, self.pos = state["epoch"], 0
        for _ in range(state["pos"]):  # re-read (and re-tokenize) the blocks this pass had consumed
            self._next_block()
