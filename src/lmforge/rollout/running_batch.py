"""The state of rows decoding together, and the KV-cache pieces the continuous-batching engine
(``continuous.ContinuousDecoder``) builds it from: caches left-padded to one width and concatenated, the
columns every row pads cut, a finished row's entries kept and prefilled after (docs in ``continuous``'s
module doc, "How rows share the batch" and "Kept caches").

Shapes: B = running rows, L = cached positions (left-padded), V = vocabulary size, H = KV heads,
D = head dim; N = rows admitted in one prefill.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .engine import decode_step, left_pad, prefill


def left_pad_cache(cache: DynamicCache, width: int) -> None:
    """Prepend zero key/value columns so the cache holds ``width`` positions (padding is masked out)."""
    for layer in cache.layers:
        missing = width - layer.keys.shape[-2]
        if missing > 0:
            pad = layer.keys.new_zeros((*layer.keys.shape[:2], missing, layer.keys.shape[-1]))
            layer.keys = torch.cat([pad, layer.keys], dim=-2)
            layer.values = torch.cat([pad.new_zeros((*pad.shape[:3], layer.values.shape[-1])), layer.values], -2)


def concat_cache(first: DynamicCache, second: DynamicCache) -> None:
    """Append ``second``'s rows to ``first`` (both already the same width)."""
    for a, b in zip(first.layers, second.layers):
        a.keys, a.values = torch.cat([a.keys, b.keys], 0), torch.cat([a.values, b.values], 0)


def trim_cache(cache: DynamicCache, start: int) -> None:
    """Drop the first ``start`` positions of every row (padding in every remaining row)."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, start:], layer.values[:, :, start:]


def check_full_attention(cache: DynamicCache, who: str) -> None:
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        raise ValueError(
            f"{who} merges full-attention KV caches between rows; this model has sliding-window or "
            "other special cache layers, which are not supported"
        )


Kept = tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]  # (ids fed, per layer (1, H, len, D) keys, values)


def kept_entries(batch: "RunningBatch", b: int, fed: list[int]) -> Kept:
    """Row ``b``'s KV entries of its real positions, which must be the ``fed`` ids (a finished row's
    prompt and its sampled tokens but the last, which was never fed to the model)."""
    real = batch.mask[b].bool()
    assert int(real.sum()) == len(fed), "the row's cached positions do not match its tokens"
    return fed, [(layer.keys[b : b + 1, :, real], layer.values[b : b + 1, :, real]) for layer in batch.cache.layers]


def reusable(kept: Kept | None, ids: list[int]) -> int:
    """How many leading ``ids`` have ``kept`` entries: all of the kept ones when ``ids`` continue them,
    else 0 (prefill them whole)."""
    if kept is None or len(kept[0]) >= len(ids) or ids[: len(kept[0])] != kept[0]:
        return 0
    return len(kept[0])


def distinct_rows(ids: list[list[int]], num_cached: list[int]) -> tuple[list[int], list[int]]:
    """The rows one prefill needs for rows ``ids``: (the index of each row prefilled, for each row the prefilled
    row it copies). Rows without kept entries whose ids are equal are prefilled once; a row after kept entries
    always by itself."""
    first: dict[tuple, int] = {}
    unique, source = [], []
    for n, (row, c) in enumerate(zip(ids, num_cached)):
        key = ("row", n) if c else ("ids", tuple(row))
        if key not in first:
            first[key] = len(unique)
            unique.append(n)
        source.append(first[key])
    return unique, source


def prefill_after_kept(
    model: torch.nn.Module, pad_token_id: int, rows: list[list[int]], kept: list[Kept | None], num_cached: list[int]
) -> tuple[torch.Tensor, DynamicCache, torch.Tensor, int]:
    """One prefill of ``rows`` (ids), each after its first ``num_cached`` ids' ``kept`` entries (0: none):
    the kept entries right-aligned before the new ids (left-padded), the padding between masked.
    Returns (last logits (N, V), the cache, its mask (N, width + P), the number of ids prefilled)."""
    device = next(model.parameters()).device
    ids, new_mask = left_pad([row[c:] for row, c in zip(rows, num_cached)], pad_token_id)  # (N, P)
    width = max(num_cached)
    cache = DynamicCache(config=model.config)
    check_full_attention(cache, "continuous batching")
    past_mask = torch.zeros((len(rows), width), dtype=torch.long)  # (N, width): the kept entries, right-aligned
    for n, c in enumerate(num_cached):
        if c:
            past_mask[n, width - c :] = 1
    if width:
        layers = _right_aligned(kept, num_cached, width)
        assert len(layers) == len(cache.layers), "the kept caches do not have the model's layers"
        for layer, (keys, values) in zip(cache.layers, layers):
            layer.update(keys, values)
    mask = torch.cat([past_mask, new_mask], 1).to(device)  # (N, width + P)
    logits, cache = prefill(model, ids.to(device), mask, cache)  # (N, V)
    return logits, cache, mask, int(new_mask.sum())


def _right_aligned(
    kept: list[Kept | None], num_cached: list[int], width: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (N, H, width, D) keys and values: each row's kept entries right-aligned, zeros before."""
    example = next(k[1] for k, c in zip(kept, num_cached) if c)
    out = []
    for i, (keys, values) in enumerate(example):
        all_keys = keys.new_zeros((len(kept), keys.shape[1], width, keys.shape[-1]))
        all_values = values.new_zeros((len(kept), values.shape[1], width, values.shape[-1]))
        for n, (entry, c) in enumerate(zip(kept, num_cached)):
            if c:
                all_keys[n, :, width - c :] = entry[1][i][0][0]
                all_values[n, :, width - c :] = entry[1][i][1][0]
        out.append((all_keys, all_values))
    return out


class RunningBatch:
    """The state of the rows decoding together: their KV cache, attention mask (B, L) long (1 on
    real cached positions), next-token logits (B, V) float32 and next positions (B,) long. Rows are
    added (``add``), kept (``keep``: the others leave) and advanced one token (``decode``); the
    caller keeps its own per-row records in the same order. ``lmforge serve``'s scheduler and
    :class:`ContinuousDecoder` share it."""

    def __init__(self):
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    def add(self, cache: DynamicCache, mask: torch.Tensor, logits: torch.Tensor) -> None:
        """Append prefilled rows (their cache, mask (N, L') and last logits (N, V)) after the running ones:
        the narrower cache is left-padded with masked positions."""
        if not len(self):
            self.cache, self.mask, self.logits, self.positions = cache, mask, logits, mask.sum(1)
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for c in (self.cache, cache):
            left_pad_cache(c, width)
        pad = lambda m: torch.cat([m.new_zeros((m.shape[0], width - m.shape[1])), m], 1)  # noqa: E731
        concat_cache(self.cache, cache)
        self.mask = torch.cat([pad(self.mask), pad(mask)], 0)
        self.logits = torch.cat([self.logits, logits], 0)
        self.positions = torch.cat([self.positions, mask.sum(1)], 0)

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order); cut the columns that are padding in every one left."""
        if not rows:
            self.cache = self.mask = self.logits = self.positions = None
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask, self.logits, self.positions = self.mask[index], self.logits[index], self.positions[index]
        start = int((self.mask.cumsum(1) == 0).sum(1).min())  # leading padding common to every row
        if start:
            trim_cache(self.cache, start)
            self.mask = self.mask[:, start:]

    def compact(self) -> None:
        """Move each row's real positions to the right end of the cache, in order, and cut the columns no
        row needs: the holes that rejected draft tokens leave (``ContinuousDecoder``, ``draft_tokens``).
        Attention sees the same keys in the same order, so nothing a row computes changes."""
        real = self.mask.bool()
        width = int(real.sum(1).max())
        if width == self.mask.shape[1]:
            return
        # a stable sort puts each row's masked columns first and its real ones after them, in order
        order = torch.sort(real.to(torch.int8), dim=1, stable=True).indices[:, -width:]  # (B, width)
        for layer in self.cache.layers:
            pick = lambda t: t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1]))  # noqa: E731
            layer.keys, layer.values = pick(layer.keys), pick(layer.values)
        self.mask = self.mask.gather(1, order)

    def decode(self, model: torch.nn.Module, tokens: torch.Tensor) -> None:
        """Feed one token per row (B,) and take the next logits."""
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self), 1))], 1)  # (B, L + 1)
        self.logits, self.cache = decode_step(model, tokens, self.cache, self.mask, self.positions)
        self.positions = self.positions + 1
