"""Continuous batching: rows join a running batch between two decode steps and leave it as soon as
they finish, so nobody waits for the slowest row of a batch.

``ContinuousDecoder`` is the loop without a server or an environment around it: ``admit`` a row
(a key, its token ids, its ``SamplingParams``), call ``step`` again and again; each call prefills
the rows admitted since the last one, samples one token for every running row, hands back the rows
that finished (a stop token, or ``max_new_tokens``) and runs the model once on the rest. The
episode runner (``envs/episode.py``) drives it, one row per episode turn.

How rows share the batch (``RunningBatch``, which ``lmforge serve``'s scheduler runs on too:
docs/serving.md "Batching"): the KV caches of the new rows and of the running ones are left-padded
to one width and concatenated; the attention mask is 0 on padding and the position ids count real
tokens only, so padding never shifts RoPE. Columns that are padding in every row are cut when rows
leave. Rows admitted together with equal ids and nothing kept (a group's first turn) are prefilled
once.

Each row samples from its own generator, seeded by its ``params.seed``: its tokens do not depend
on which rows share its steps (up to the float rounding of a different batch shape, which moves a
greedy argmax or a sampled draw only at a near tie). Rows of equal settings share one
``sample_token`` call, each with the uniform drawn from its own generator.

Kept caches (``keep_cache=True``): a finished row's KV entries (every position fed to the model:
its ids and its sampled tokens but the last, or all of them when it ended on a kept draft) are kept
under its key. When the key is admitted again
with ids that start with exactly those tokens -- an episode's next turn: its history, the sampled
turn and the environment's delta -- only the new ids are prefilled, after the kept entries (the
padding between them masked). Any other ids are prefilled whole. ``release(key)`` drops a kept cache.

Speculative decoding (``drafter=NgramDrafter(...)``): the model call that feeds each row's sampled
token also feeds the tokens the drafter guesses after it (``verify_step``), so a row can gain several
tokens per call. Each guessed position is drawn as the plain loop would draw it -- from the logits
after the tokens before it, with the row's next uniform, by ``sample_token`` -- and kept only when the
draw equals the guess. At the first draw that does not, the row stops and that draw's uniform waits
(``_Row.pending``) for the next step, which draws the same token from the same logits. A seeded row
therefore decodes the tokens it decodes without drafts (checked on CPU; up to float rounding, as with
a different batch shape), an unseeded one the same distribution. Rejected positions stay in the cache,
masked out, until ``RunningBatch.compact`` moves each row's real positions together.

Shapes: B = running rows, L = cached positions (left-padded), V = vocabulary size, H = KV heads,
D = head dim; N = rows admitted in one prefill.
"""
from __future__ import annotations

import dataclasses
from typing import Hashable

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .engine import SamplingParams, decode_step, left_pad, prefill, sample_token, verify_step


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


def has_full_attention_caches(model) -> bool:
    """True when every cache layer ``model`` builds is a plain full-attention one, which rows can share
    (False for sliding-window or other special layers: Mistral's default config, Gemma 2/3, ...)."""
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)


def check_full_attention(cache: DynamicCache, who: str) -> None:
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        raise ValueError(f"{who} merges full-attention KV caches between rows; this model has sliding-window or "
                         "other special cache layers, which are not supported")


Kept = tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]  # (ids fed, per layer (1, H, len, D) keys, values)


def kept_entries(batch: "RunningBatch", b: int, fed: list[int]) -> Kept:
    """Row ``b``'s KV entries of its real positions, which must be the ``fed`` ids (a finished row's
    prompt and its sampled tokens but the last, which was never fed to the model)."""
    real = batch.mask[b].bool()
    assert int(real.sum()) == len(fed), "the row's cached positions do not match its tokens"
    return fed, [(layer.keys[b:b + 1, :, real], layer.values[b:b + 1, :, real]) for layer in batch.cache.layers]


def reusable(kept: Kept | None, ids: list[int]) -> int:
    """How many leading ``ids`` have ``kept`` entries: all of the kept ones when ``ids`` continue them,
    else 0 (prefill them whole)."""
    if kept is None or len(kept[0]) >= len(ids) or ids[:len(kept[0])] != kept[0]:
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


def prefill_after_kept(model: torch.nn.Module, pad_token_id: int, rows: list[list[int]], kept: list[Kept | None],
                       num_cached: list[int]) -> tuple[torch.Tensor, DynamicCache, torch.Tensor, int]:
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
            past_mask[n, width - c:] = 1
    if width:
        layers = _right_aligned(kept, num_cached, width)
        assert len(layers) == len(cache.layers), "the kept caches do not have the model's layers"
        for layer, (keys, values) in zip(cache.layers, layers):
            layer.update(keys, values)
    mask = torch.cat([past_mask, new_mask], 1).to(device)  # (N, width + P)
    logits, cache = prefill(model, ids.to(device), mask, cache)  # (N, V)
    return logits, cache, mask, int(new_mask.sum())


def _right_aligned(kept: list[Kept | None], num_cached: list[int], width: int
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (N, H, width, D) keys and values: each row's kept entries right-aligned, zeros before."""
    example = next(k[1] for k, c in zip(kept, num_cached) if c)
    out = []
    for i, (keys, values) in enumerate(example):
        all_keys = keys.new_zeros((len(kept), keys.shape[1], width, keys.shape[-1]))
        all_values = values.new_zeros((len(kept), values.shape[1], width, values.shape[-1]))
        for n, (entry, c) in enumerate(zip(kept, num_cached)):
            if c:
                all_keys[n, :, width - c:] = entry[1][i][0][0]
                all_values[n, :, width - c:] = entry[1][i][1][0]
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


@dataclasses.dataclass
class FinishedRow:
    """A row that left the batch: the tokens it sampled (the stop token included) and their logprobs."""

    key: Hashable
    token_ids: list[int]
    logprobs: list[float]  # of the distribution each token was drawn from (rollout/engine.py module doc)
    truncated: bool  # ended at max_new_tokens without a stop token


@dataclasses.dataclass
class _Row:
    key: Hashable
    ids: list[int]  # what it was admitted with
    params: SamplingParams
    generator: torch.Generator | None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    pending: torch.Tensor | None = None  # (1, 1): the uniform a rejected draft position drew, for the next draw
    index: dict | None = None  # NgramDrafter.index of ids (speculative decoding)


class NgramDrafter:
    """Draft tokens for speculative decoding, from token n-grams seen before (no second model).

    ``observe(tokens)`` counts, for every ``n`` consecutive tokens, the token that came next;
    ``propose(context, limit, stop_ids)`` follows the most frequent continuation of the last ``n``
    tokens while it is confident -- seen at least ``min_count`` times and at least ``min_share`` of
    what followed that context -- up to ``limit`` tokens or a stop token. A context's counts are
    halved when one passes ``max_count``, so the table follows a policy that changes; past
    ``max_contexts`` contexts, those seen fewer than ``min_count`` times (which never draft) are
    dropped, and if that leaves more than half, the table starts again. Kept across RL steps, the table learns the text
    the policy writes over and over (a tool call's syntax). Where it has nothing confident,
    ``propose`` copies from the row's own ids what followed the last occurrence of the row's last
    two tokens (``index``): a number copied from the question or from a tool's result.
    """

    def __init__(self, max_tokens: int, n: int = 4, min_count: int = 2, min_share: float = 0.75,
                 max_count: int = 64, max_contexts: int = 1_000_000):
        if max_tokens < 1 or n < 1:
            raise ValueError(f"NgramDrafter needs max_tokens >= 1 and n >= 1, got {max_tokens}, {n}")
        self.max_tokens, self.n, self.min_count, self.min_share = max_tokens, n, min_count, min_share
        self.max_count, self.max_contexts = max_count, max_contexts
        self.table: dict[tuple[int, ...], dict[int, int]] = {}

    def observe(self, tokens: list[int]) -> None:
        n, table = self.n, self.table
        if len(table) > self.max_contexts:
            self._prune()
        for i in range(n, len(tokens)):
            counts = table.setdefault(tuple(tokens[i - n:i]), {})
            token = tokens[i]
            counts[token] = counts.get(token, 0) + 1
            if counts[token] > self.max_count:
                for t in list(counts):
                    counts[t] //= 2
                    if not counts[t]:
                        del counts[t]

    def _prune(self) -> None:
        table = self.table
        for key in [key for key, counts in table.items() if sum(counts.values()) < self.min_count]:
            del table[key]
        if len(table) > self.max_contexts // 2:
            table.clear()

    @staticmethod
    def index(ids: list[int]) -> dict:
        """For ``propose``'s lookup in a row's own ids: the last position of each pair of consecutive
        tokens that some token follows."""
        return {(ids[i - 1], ids[i]): i for i in range(1, len(ids) - 1)}

    def propose(self, context: list[int], limit: int, stop_ids: list[int], ids: list[int] | None = None,
                index: dict | None = None) -> list[int]:
        """Up to ``limit`` tokens to follow ``context`` (its last ``n`` tokens are what counts). When the
        table has nothing confident and the row's ``ids`` and their ``index`` are given: what followed the
        last occurrence in ``ids`` of the context's last two tokens (a copy from the prompt or a tool's
        result), up to ``limit`` tokens or a stop token."""
        draft = self._from_table(context, limit, stop_ids)
        if draft or index is None or not context:
            return draft
        at = index.get(tuple(context[-2:])) if len(context) > 1 else None
        if at is None:
            return draft
        for token in ids[at + 1:at + 1 + limit]:
            draft.append(token)
            if token in stop_ids:
                break
        return draft

    def _from_table(self, context: list[int], limit: int, stop_ids: list[int]) -> list[int]:
        if len(context) < self.n:
            return []
        key, draft = tuple(context[-self.n:]), []
        while len(draft) < limit:
            counts = self.table.get(key)
            if not counts:
                break
            token, count = max(counts.items(), key=lambda item: item[1])
            if count < self.min_count or count < self.min_share * sum(counts.values()):
                break
            draft.append(token)
            if token in stop_ids:
                break
            key = key[1:] + (token,)
        return draft


class ContinuousDecoder:
    """Rows of ``model`` decoded together, joining and leaving between steps (module doc).

    The model must be in eval mode (the caller's to set); ``step`` runs under inference mode.
    ``num_model_calls`` counts prefills and decode steps. With a ``drafter`` (speculative decoding,
    module doc) ``num_draft_tokens`` / ``num_accepted_tokens`` count the drafted and accepted tokens.
    """

    def __init__(self, model: torch.nn.Module, pad_token_id: int, keep_cache: bool = True,
                 drafter: NgramDrafter | None = None):
        self.model, self.pad_token_id, self.keep_cache, self.drafter = model, pad_token_id, keep_cache, drafter
        self.device = next(model.parameters()).device
        self.num_model_calls = 0
        self.num_prefilled_tokens = 0  # real tokens run through a prefill (kept caches spare their history)
        self.num_draft_tokens = self.num_accepted_tokens = 0
        self._queue: list[_Row] = []
        self._rows: list[_Row] = []
        self._kept: dict[Hashable, Kept] = {}
        self._batch = RunningBatch()

    @property
    def busy(self) -> bool:
        """Rows running or waiting to join."""
        return bool(self._rows or self._queue)

    @property
    def num_running(self) -> int:
        return len(self._rows)

    def admit(self, key: Hashable, ids: list[int], params: SamplingParams) -> None:
        """Queue a row; it joins at the next ``step``. ``params.seed`` seeds the row's own generator."""
        if params.stop_strings:
            raise ValueError("ContinuousDecoder stops on stop_token_ids only; stop_strings are not supported")
        if not ids:
            raise ValueError(f"row {key!r} has no ids; every row needs at least one token (e.g. BOS)")
        generator = None
        if params.seed is not None and params.temperature > 0:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self._queue.append(_Row(key, list(ids), params, generator))

    def release(self, key: Hashable) -> None:
        """Forget ``key``'s kept cache (its episode ended)."""
        self._kept.pop(key, None)

    @torch.inference_mode()
    def step(self) -> list[FinishedRow]:
        """Admit the queued rows, sample a token for every row, retire finished rows, run the model on the
        rest (with a drafter: on each row's token and its drafts, keeping the drafts its draws confirm, and
        retire the rows those ended)."""
        if self._queue:
            self._admit()
        if not self._rows:
            return []
        tokens = self._sample()  # (B,)
        finished, keep = self._retire(fed_all=False)
        if len(keep) < len(tokens):
            tokens = tokens[torch.tensor(keep, dtype=torch.long, device=self.device)]
        if self._rows:
            if self.drafter is None:
                self._batch.decode(self.model, tokens)
            else:
                self._verify(tokens)
                finished += self._retire(fed_all=True)[0]  # rows that accepted drafts up to their end
            self.num_model_calls += 1
        return finished

    # ------------------------------------------------------------------ internals

    def _retire(self, fed_all: bool) -> tuple[list[FinishedRow], list[int]]:
        """Take the rows that ended (a stop token, or max_new_tokens) out of the batch, keeping their KV
        entries; returns them and the indices of the rows left. ``fed_all``: every token of a row has
        been fed to the model (after a verify step), else all but the last one."""
        finished, keep = [], []
        for b, row in enumerate(self._rows):
            stop = row.tokens[-1] in row.params.stop_token_ids
            if stop or len(row.tokens) >= row.params.max_new_tokens:
                finished.append(FinishedRow(row.key, row.tokens, row.logprobs, truncated=not stop))
                if self.keep_cache:
                    self._keep(b, row, fed_all)
                if self.drafter is not None:
                    self.drafter.observe(row.ids[-self.drafter.n:] + row.tokens)
            else:
                keep.append(b)
        if len(keep) < len(self._rows):
            self._rows = [self._rows[b] for b in keep]
            self._batch.keep(keep)
        return finished, keep

    def _verify(self, tokens: torch.Tensor) -> None:
        """Speculative decoding: feed each row's sampled token (B,) and the tokens the drafter proposes
        after it in one forward, accept a prefix of the drafts (``_accept``), and keep the cache entries
        and next logits of what was accepted; the rejected positions are masked out (``compact`` cuts
        them away once they are a quarter of the cache)."""
        n, rows, batch = self.drafter.n, self._rows, self._batch
        drafts = []
        for row in rows:
            # at most max_new_tokens - 1 sampled tokens are ever fed, as without drafts: no position goes
            # past what the plain loop feeds (the model's context)
            limit = min(self.drafter.max_tokens, row.params.max_new_tokens - len(row.tokens) - 1)
            context = row.tokens[-n:] if len(row.tokens) >= n else row.ids[len(row.tokens) - n:] + row.tokens
            if limit <= 0:
                drafts.append([])
                continue
            if row.index is None:
                row.index = self.drafter.index(row.ids)
            # cut to the limit whatever the drafter returns (a subclass's propose may overrun it)
            drafts.append(list(self.drafter.propose(context, limit, row.params.stop_token_ids, row.ids,
                                                    row.index))[:limit])
        width = max(len(d) for d in drafts)
        if not width:
            batch.decode(self.model, tokens)
            return
        ids = torch.full((len(rows), 1 + width), self.pad_token_id, dtype=torch.long)
        fed = torch.zeros((len(rows), 1 + width), dtype=torch.long)  # 1 on the sampled token and the drafts
        fed[:, 0] = 1
        for b, draft in enumerate(drafts):
            if draft:
                ids[b, 1:1 + len(draft)], fed[b, 1:1 + len(draft)] = torch.tensor(draft), 1
        self.num_draft_tokens += int(fed.sum()) - len(rows)
        ids, fed = ids.to(self.device), fed.to(self.device)
        ids[:, 0] = tokens  # the sampled tokens stay on the device
        # padding columns repeat their row's last fed position: masked, and never past the row's own
        offsets = torch.minimum(torch.arange(1 + width)[None], torch.tensor([[len(d)] for d in drafts]))
        positions = batch.positions[:, None] + offsets.to(self.device)  # (B, 1 + width)
        logits, batch.cache = verify_step(self.model, ids, batch.cache,
                                          torch.cat([batch.mask, fed], 1), positions)  # (B, 1 + width, V)
        accepted = torch.tensor(self._accept(drafts, logits), dtype=torch.long, device=self.device)  # (B,)
        self.num_accepted_tokens += int(accepted.sum())
        kept = fed * (torch.arange(1 + width, device=self.device)[None] <= accepted[:, None])
        batch.mask = torch.cat([batch.mask, kept], 1)
        batch.logits = logits[torch.arange(len(rows), device=self.device), accepted]  # after the last accepted
        batch.positions = batch.positions + 1 + accepted
        if 4 * (batch.mask.shape[1] - int(batch.mask.sum(1).max())) > batch.mask.shape[1]:
            batch.compact()

    def _accept(self, drafts: list[list[int]], logits: torch.Tensor) -> list[int]:
        """How many of each row's drafts to keep, appending them (and their logprobs) to the row.

        Row b's draft token d at offset i follows its sampled token and drafts 0..i-1, so logits[b, i]
        are the logits its token there is drawn from. That token is drawn as ``step`` would draw it
        (``sample_token``, with the next uniform of the row's generator; greedy: the argmax); d is kept
        when the draw is d, and at the first draw that is not, the row stops: that draw's uniform waits
        in ``_Row.pending`` for the next step, which draws the same token from the same logits. So a
        row's tokens are the ones it samples one token at a time (up to the float rounding of a forward
        of a different shape), and a draft is kept with probability p(d). A kept stop token ends the
        row: nothing after it is kept."""
        accepted = [0] * len(drafts)
        groups: dict[tuple, list[int]] = {}
        for b, (row, draft) in enumerate(zip(self._rows, drafts)):
            if draft:
                p = row.params
                groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(b)
        width = logits.shape[1] - 1
        for (temperature, _, _), members in groups.items():
            params = self._rows[members[0]].params
            block = logits[torch.tensor(members, device=self.device), :width]  # (R, width, V)
            uniforms, states = None, []
            if temperature > 0:
                uniforms = torch.zeros((len(members), width, 1), device=self.device)
                for r, b in enumerate(members):
                    row = self._rows[b]
                    states.append(None if row.generator is None else row.generator.get_state())
                    # one draw per position, as ``_draw`` makes them (a (k,) draw need not equal k (1,)
                    # draws: CUDA's generator), kept on the device (no sync per row)
                    uniforms[r, :len(drafts[b])] = torch.cat([self._draw(row) for _ in drafts[b]])
                uniforms = uniforms.reshape(-1, 1)
            drawn, logprobs = sample_token(block.reshape(-1, block.shape[-1]), params, uniforms=uniforms)
            drawn, logprobs = drawn.view(len(members), width).tolist(), logprobs.view(len(members), width).tolist()
            for r, b in enumerate(members):
                row, draft = self._rows[b], drafts[b]
                kept = next((i for i, token in enumerate(draft) if drawn[r][i] != token), len(draft))
                stop = next((i for i, token in enumerate(draft[:kept]) if token in row.params.stop_token_ids), None)
                if stop is not None:
                    kept = stop + 1
                row.tokens += draft[:kept]
                row.logprobs += logprobs[r][:kept]
                accepted[b] = kept
                if temperature > 0 and kept < len(draft):
                    self._rewind(row, states[r], uniforms[r * width:r * width + len(draft)], kept)
        return accepted

    def _rewind(self, row: _Row, state: torch.Tensor | None, uniforms: torch.Tensor, kept: int) -> None:
        """After ``kept`` drafts of a row were kept: the draws past ``kept`` never happened. The draw at
        ``kept`` (a rejection's, which the next step repeats, or one a kept stop token left unused) waits
        in ``pending``; the generator goes back to just after it."""
        row.pending = uniforms[kept:kept + 1].view(1, 1)
        if state is not None:
            row.generator.set_state(state)
            for _ in range(kept + 1):
                torch.rand((1, 1), generator=row.generator, device=self.device)

    def _keep(self, b: int, row: _Row, fed_all: bool = False) -> None:
        """Keep row ``b``'s KV entries of its real positions: its ids and its sampled tokens, all of them
        (``fed_all``) or all but the last (which was never fed to the model)."""
        self._kept[row.key] = kept_entries(self._batch, b, row.ids + (row.tokens if fed_all else row.tokens[:-1]))

    def _reusable(self, row: _Row) -> int:
        """How many leading ids of ``row`` have kept KV entries (0: prefill it whole)."""
        cached = reusable(self._kept.get(row.key), row.ids)
        if not cached:
            self._kept.pop(row.key, None)
        return cached

    def _admit(self) -> None:
        """Prefill the queued rows (after their kept entries) in one model call and merge them in. Rows
        without kept entries whose ids are equal (a group's first turn) are prefilled once and copied."""
        batch, self._queue = self._queue, []
        cached = [self._reusable(row) for row in batch]
        unique, source = distinct_rows([row.ids for row in batch], cached)
        rows, num_cached = [batch[n] for n in unique], [cached[n] for n in unique]
        if self.drafter is not None:
            for row, c in zip(rows, num_cached):
                self.drafter.observe(row.ids[max(0, c - self.drafter.n):])
        logits, cache, mask, prefilled = prefill_after_kept(
            self.model, self.pad_token_id, [row.ids for row in rows], [self._kept.get(row.key) for row in rows],
            num_cached)
        self.num_model_calls += 1
        self.num_prefilled_tokens += prefilled
        if len(rows) < len(batch):
            index = torch.tensor(source, dtype=torch.long, device=self.device)
            cache.batch_select_indices(index)
            mask, logits = mask[index], logits[index]
        for row in batch:
            self._kept.pop(row.key, None)
        self._batch.add(cache, mask, logits)
        self._rows += batch

    def _sample(self) -> torch.Tensor:
        """One token per running row from its own settings and generator (one uniform per row, drawn as
        ``sample_token`` draws it); rows of equal settings share one ``sample_token`` call. Returns (B,) long."""
        tokens = torch.empty(len(self._rows), dtype=torch.long, device=self.device)
        groups: dict[tuple, list[int]] = {}
        for b, row in enumerate(self._rows):
            p = row.params
            groups.setdefault((p.temperature, p.top_k, p.top_p, row.generator is None), []).append(b)
        for (temperature, _, _, unseeded), rows in groups.items():
            first = self._rows[rows[0]]
            index = torch.tensor(rows, device=self.device)
            uniforms = None
            if temperature > 0 and (not unseeded or any(self._rows[b].pending is not None for b in rows)):
                uniforms = torch.cat([self._draw(self._rows[b]) for b in rows])  # (R, 1)
            picked, logprobs = sample_token(self._batch.logits[index], first.params, uniforms=uniforms)
            tokens[index] = picked
            for b, token, logprob in zip(rows, picked.tolist(), logprobs.tolist()):
                self._rows[b].tokens.append(token)
                self._rows[b].logprobs.append(logprob)
        return tokens

    def _draw(self, row: _Row) -> torch.Tensor:
        """The row's next uniform, (1, 1) on the device: the one a rejected draft left waiting, else one
        from its generator (the global one for an unseeded row)."""
        if row.pending is not None:
            u, row.pending = row.pending, None
            return u
        return torch.rand((1, 1), generator=row.generator, device=self.device)
