"""Continuous batching: rows join a running batch between two decode steps and leave it as soon as
they finish, so nobody waits for the slowest row of a batch.

``ContinuousDecoder`` is the one engine of it, without a server or an environment around it: ``admit``
rows (a key, token ids, ``SamplingParams``, ``n`` samples), call ``step`` again and again; each call
prefills the rows admitted since the last one, samples one token for every running row, hands back the
rows that finished (a stop token or stop string, ``max_new_tokens``, a cancel) and runs the model once
on the rest. Two drivers share it, so admission, prefill after kept entries, sampling, drafts and
retirement are written once: the episode runner (``envs/episode.py``: one row per episode turn, its
environment step between turns) and ``lmforge serve``'s scheduler (``serve/scheduler.py``: a request is
``n`` rows; it keeps the queue, weight updates, streaming through ``step``'s ``on_token``, and metrics).

How rows share the batch (``running_batch.RunningBatch`` and its cache pieces; docs/serving.md
"Batching"): the KV caches of the new rows and of the running ones are left-padded
to one width and concatenated; the attention mask is 0 on padding and the position ids count real
tokens only, so padding never shifts RoPE. Columns that are padding in every row are cut when rows
leave. Rows admitted together with equal ids and nothing kept (a group's first turn, a request's
samples) are prefilled once.

The samples of one ``admit`` draw from one generator, seeded by its ``params.seed``, in row order (an
episode turn is one sample: its own generator): their tokens do not depend on which rows share their
steps (up to the float rounding of a different batch shape, which moves a greedy argmax or a sampled
draw only at a near tie). Rows of equal temperature / top-k / top-p share one ``sample_token`` call,
each with the uniform drawn from its own generator. A row's logits processors (serve's logit bias,
penalties, grammars: ``admit``'s ``processors``) change its raw logits first, and its logprobs (and
``top_logprobs`` alternatives) are of the distribution after them, the one it was drawn from.

Kept caches (``keep_cache=True``: under the row's key; or a given ``cache_key``, serve's sessions): a
finished single sample's KV entries (every position fed to the model: its ids and its sampled tokens but
the last, or all of them when it ended on a kept draft) are kept under its key. When the key is admitted again
with ids that start with exactly those tokens -- an episode's next turn: its history, the sampled
turn and the environment's delta -- only the new ids are prefilled, after the kept entries (the
padding between them masked). Any other ids are prefilled whole. ``release(key)`` drops a kept cache.

Speculative decoding (``drafter=NgramDrafter(...)``): the model call that feeds each row's sampled
token also feeds the tokens the drafter guesses after it (``verify_step``), so a row can gain several
tokens per call. Each guessed position is drawn as the plain loop would draw it -- from the logits
after the tokens before it, with the row's next uniform, by ``sample_token`` -- and kept only when the
draw equals the guess. At the first draw that does not, the row stops and that draw's uniform waits
(``Row.pending``) for the next step, which draws the same token from the same logits. A seeded row
therefore decodes the tokens it decodes without drafts (checked on CPU; up to float rounding, as with
a different batch shape), an unseeded one the same distribution. Rejected positions stay in the cache,
masked out, until ``RunningBatch.compact`` moves each row's real positions together.

Shapes: B = running rows, L = cached positions (left-padded), V = vocabulary size, H = KV heads,
D = head dim; N = rows admitted in one prefill.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Callable, Hashable

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .drafts import NgramDrafter
from .engine import SamplingParams, process_logits, sample_token, verify_step
from .running_batch import Kept, RunningBatch, distinct_rows, kept_entries, prefill_after_kept, reusable


def has_full_attention_caches(model) -> bool:
    """True when every cache layer ``model`` builds is a plain full-attention one, which rows can share
    (False for sliding-window or other special layers: Mistral's default config, Gemma 2/3, ...)."""
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)


@dataclasses.dataclass
class FinishedRow:
    """A row that left the batch: the tokens it sampled (the stop token included) and their logprobs."""

    key: Hashable
    token_ids: list[int]
    logprobs: list[float]  # of the distribution each token was drawn from (rollout/engine.py module doc)
    truncated: bool  # ended without a stop token (max_new_tokens; or cancelled)


@dataclasses.dataclass(eq=False)
class Row:
    """One sample in the batch: what ``ContinuousDecoder.admit`` was given and what it has sampled so far.
    The engine writes it; a driver reads it (``step``'s ``on_token``)."""

    key: Hashable  # the driver's handle (an episode's index, a serve request)
    index: int  # its place among the samples admitted with it
    n: int  # samples admitted with it; a kept cache is one row's, so only a single sample reuses or keeps one
    ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None  # shared by the n samples, which draw from it in row order
    cache_key: Hashable | None = None  # its kept KV entries' key (None: never kept)
    processors: list = dataclasses.field(default_factory=list)  # process(logits (V,), ids, tokens), in order
    min_tokens: int = 0  # no stop token or stop string ends it before it has this many tokens
    num_top_logprobs: int = 0  # best alternatives recorded per token
    cancelled: threading.Event | None = None  # set: it leaves at the next step, finish reason "cancelled"
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)  # per token, best first
    finish_reason: str | None = None  # "stop", "length" or "cancelled" once it has finished
    pending: torch.Tensor | None = None  # (1, 1): the uniform a rejected draft position drew, for the next draw
    ngram_index: dict | None = None  # NgramDrafter.index of ids (speculative decoding)


class ContinuousDecoder:
    """Rows of ``model`` decoded together, joining and leaving between steps: the one continuous-batching
    engine, which the episode runner and ``lmforge serve``'s scheduler both drive (module doc).

    The model must be in eval mode (the caller's to set); ``step`` runs under inference mode.
    ``num_model_calls`` counts prefills and decode steps, ``num_steps`` the decode steps alone. With a
    ``drafter`` (speculative decoding, module doc) ``num_draft_tokens`` / ``num_accepted_tokens`` count
    the drafted and accepted tokens. ``decode_fn(ids) -> str`` is needed for stop strings; ``max_kept``
    bounds the kept caches (the oldest key goes first; None: until ``release``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        keep_cache: bool = True,
        drafter: NgramDrafter | None = None,
        decode_fn: Callable[[list[int]], str] | None = None,
        max_kept: int | None = None,
    ):
        self.model, self.pad_token_id, self.keep_cache, self.drafter = model, pad_token_id, keep_cache, drafter
        self.decode_fn, self.max_kept = decode_fn, max_kept
        self.device = next(model.parameters()).device
        self.num_model_calls = self.num_steps = 0
        self.num_prefilled_tokens = 0  # real tokens run through a prefill (kept caches spare their history)
        self.num_cached_tokens = 0  # ids whose kept entries spared their prefill
        self.num_sampled_tokens = 0  # tokens sampled one per row and step (accepted drafts: num_accepted_tokens)
        self.num_draft_tokens = self.num_accepted_tokens = 0
        self._queue: list[Row] = []
        self._rows: list[Row] = []
        self._kept: collections.OrderedDict[Hashable, Kept] = collections.OrderedDict()
        self._batch = RunningBatch()

    @property
    def busy(self) -> bool:
        """Rows running or waiting to join."""
        return bool(self._rows or self._queue)

    @property
    def num_running(self) -> int:
        return len(self._rows)

    @property
    def rows(self) -> list[Row]:
        """The rows running, then those waiting to join (a copy)."""
        return self._rows + self._queue

    def admit(
        self,
        key: Hashable,
        ids: list[int],
        params: SamplingParams,
        n: int = 1,
        *,
        cache_key: Hashable | None = None,
        processors: Callable[[], list] | None = None,
        min_tokens: int = 0,
        top_logprobs: int = 0,
        cancelled: threading.Event | None = None,
    ) -> list[Row]:
        """Queue ``n`` samples of ``ids``; they join at the next ``step``. ``params.seed`` seeds one generator
        that the n samples draw from in turn. ``cache_key`` keys a single sample's kept KV entries (default:
        ``key``, when ``keep_cache``); ``processors()`` makes each sample's own logits processors (serve's
        ``RowProcessor``s); the other keywords are ``Row``'s fields. Returns the queued rows."""
        if params.stop_strings and self.decode_fn is None:
            raise ValueError(
                "ContinuousDecoder stops on stop_token_ids only without a decode_fn; stop_strings are not supported"
            )
        if self.drafter is not None and (params.stop_strings or processors or min_tokens or top_logprobs):
            raise ValueError(
                "a ContinuousDecoder with a drafter checks drafts against plain draws: no stop_strings, "
                "processors, min_tokens or top_logprobs"
            )
        if not ids:
            raise ValueError(f"row {key!r} has no ids; every row needs at least one token (e.g. BOS)")
        generator = None
        if params.seed is not None and params.temperature > 0:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if cache_key is None and self.keep_cache:
            cache_key = key
        rows = [
            Row(
                key,
                i,
                n,
                list(ids),
                params,
                generator,
                cache_key,
                processors() if processors else [],
                min_tokens,
                top_logprobs,
                cancelled,
            )
            for i in range(n)
        ]
        self._queue += rows
        return rows

    def release(self, key: Hashable) -> None:
        """Forget ``key``'s kept cache (its episode ended)."""
        self._kept.pop(key, None)

    def release_all(self) -> None:
        """Forget every kept cache (entries of weights that just changed)."""
        self._kept.clear()

    @torch.inference_mode()
    def step(self, on_token: Callable[[Row], None] | None = None) -> list[FinishedRow]:
        """Admit the queued rows, sample a token for every row, retire finished rows, run the model on the
        rest (with a drafter: on each row's token and its drafts, keeping the drafts its draws confirm, and
        retire the rows those ended). ``on_token(row)`` is called for every row, in order, once its new
        token and its ``finish_reason`` are set (serve's streaming; not with a drafter)."""
        if on_token is not None and self.drafter is not None:
            raise ValueError("on_token reports one token per step; a drafter adds several")
        if self._queue:
            self._admit()
        if not self._rows:
            return []
        tokens = self._sample()  # (B,)
        finished, keep = self._retire(fed_all=False, on_token=on_token)
        if len(keep) < len(tokens):
            tokens = tokens[torch.tensor(keep, dtype=torch.long, device=self.device)]
        if self._rows:
            if self.drafter is None:
                self._batch.decode(self.model, tokens)
            else:
                self._verify(tokens)
                finished += self._retire(fed_all=True)[0]  # rows that accepted drafts up to their end
            self.num_model_calls += 1
            self.num_steps += 1
        return [
            FinishedRow(row.key, row.tokens, row.logprobs, truncated=row.finish_reason != "stop") for row in finished
        ]

    # ------------------------------------------------------------------ internals

    def _finish_reason(self, row: Row) -> str | None:
        """Why ``row`` ends after its newest token, or None: cancelled, a stop token or stop string (after
        ``min_tokens``), or ``max_new_tokens``."""
        params, least = row.params, row.min_tokens
        if row.cancelled is not None and row.cancelled.is_set():
            return "cancelled"
        if len(row.tokens) > least and row.tokens[-1] in params.stop_token_ids:
            return "stop"
        if params.stop_strings and len(row.tokens) > least:
            window = max(map(len, params.stop_strings)) + 8
            start = max(0, len(row.tokens) - window)
            tail = self.decode_fn(row.tokens[start:])
            # with min_tokens, a stop string counts only if it ends past the first min_tokens tokens' text
            after = len(self.decode_fn(row.tokens[start:least])) if start < least else 0
            if any(s in tail[max(0, after - len(s) + 1) :] for s in params.stop_strings):
                return "stop"
        if len(row.tokens) >= params.max_new_tokens:
            return "length"
        return None

    def _retire(self, fed_all: bool, on_token: Callable[[Row], None] | None = None) -> tuple[list[Row], list[int]]:
        """Take the rows that ended (``_finish_reason``) out of the batch, keeping the KV entries of those with
        a cache key; returns them and the indices of the rows left. ``fed_all``: every token of a row has
        been fed to the model (after a verify step), else all but the last one."""
        keep = []
        for b, row in enumerate(self._rows):
            row.finish_reason = self._finish_reason(row)
            if on_token is not None:
                on_token(row)
            if row.finish_reason is None:
                keep.append(b)
        if len(keep) == len(self._rows):
            return [], keep
        finished = []
        for b, row in enumerate(self._rows):
            if row.finish_reason is None:
                continue
            finished.append(row)
            if row.cache_key is not None and row.n == 1 and row.finish_reason != "cancelled":
                self._keep(b, row, fed_all)
            if self.drafter is not None:
                self.drafter.observe(row.ids[-self.drafter.n :] + row.tokens)
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
            context = row.tokens[-n:] if len(row.tokens) >= n else row.ids[len(row.tokens) - n :] + row.tokens
            if limit <= 0:
                drafts.append([])
                continue
            if row.ngram_index is None:
                row.ngram_index = self.drafter.index(row.ids)
            # cut to the limit whatever the drafter returns (a subclass's propose may overrun it)
            drafts.append(
                list(self.drafter.propose(context, limit, row.params.stop_token_ids, row.ids, row.ngram_index))[:limit]
            )
        width = max(len(d) for d in drafts)
        if not width:
            batch.decode(self.model, tokens)
            return
        ids = torch.full((len(rows), 1 + width), self.pad_token_id, dtype=torch.long)
        fed = torch.zeros((len(rows), 1 + width), dtype=torch.long)  # 1 on the sampled token and the drafts
        fed[:, 0] = 1
        for b, draft in enumerate(drafts):
            if draft:
                ids[b, 1 : 1 + len(draft)], fed[b, 1 : 1 + len(draft)] = torch.tensor(draft), 1
        self.num_draft_tokens += int(fed.sum()) - len(rows)
        ids, fed = ids.to(self.device), fed.to(self.device)
        ids[:, 0] = tokens  # the sampled tokens stay on the device
        # padding columns repeat their row's last fed position: masked, and never past the row's own
        offsets = torch.minimum(torch.arange(1 + width)[None], torch.tensor([[len(d)] for d in drafts]))
        positions = batch.positions[:, None] + offsets.to(self.device)  # (B, 1 + width)
        logits, batch.cache = verify_step(
            self.model, ids, batch.cache, torch.cat([batch.mask, fed], 1), positions
        )  # (B, 1 + width, V)
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
        in ``Row.pending`` for the next step, which draws the same token from the same logits. So a
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
                    uniforms[r, : len(drafts[b])] = torch.cat([self._draw(row) for _ in drafts[b]])
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
                    self._rewind(row, states[r], uniforms[r * width : r * width + len(draft)], kept)
        return accepted

    def _rewind(self, row: Row, state: torch.Tensor | None, uniforms: torch.Tensor, kept: int) -> None:
        """After ``kept`` drafts of a row were kept: the draws past ``kept`` never happened. The draw at
        ``kept`` (a rejection's, which the next step repeats, or one a kept stop token left unused) waits
        in ``pending``; the generator goes back to just after it."""
        row.pending = uniforms[kept : kept + 1].view(1, 1)
        if state is not None:
            row.generator.set_state(state)
            for _ in range(kept + 1):
                torch.rand((1, 1), generator=row.generator, device=self.device)

    def _keep(self, b: int, row: Row, fed_all: bool = False) -> None:
        """Keep row ``b``'s KV entries of its real positions under its cache key: its ids and its sampled
        tokens, all of them (``fed_all``) or all but the last (which was never fed to the model)."""
        fed = row.ids + (row.tokens if fed_all else row.tokens[:-1])
        self._kept[row.cache_key] = kept_entries(self._batch, b, fed)
        self._kept.move_to_end(row.cache_key)
        while self.max_kept is not None and len(self._kept) > self.max_kept:
            self._kept.popitem(last=False)

    def _reusable(self, row: Row) -> int:
        """How many leading ids of ``row`` have kept KV entries (0: prefill it whole)."""
        if row.cache_key is None or row.n != 1:
            return 0
        return reusable(self._kept.get(row.cache_key), row.ids)

    def _admit(self) -> None:
        """Prefill the queued rows (after their kept entries) in one model call and merge them in. Rows
        without kept entries whose ids are equal (a group's first turn, a request's samples) are prefilled
        once and copied. Admitted keys' kept entries are dropped: used, or stale (the row keeps its own)."""
        batch = self._queue  # cleared only once merged: a driver that fails its rows still finds them
        cached = [self._reusable(row) for row in batch]
        unique, source = distinct_rows([row.ids for row in batch], cached)
        rows, num_cached = [batch[n] for n in unique], [cached[n] for n in unique]
        if self.drafter is not None:
            for row, c in zip(rows, num_cached):
                self.drafter.observe(row.ids[max(0, c - self.drafter.n) :])
        logits, cache, mask, prefilled = prefill_after_kept(
            self.model,
            self.pad_token_id,
            [row.ids for row in rows],
            [self._kept.get(row.cache_key) if c else None for row, c in zip(rows, num_cached)],
            num_cached,
        )
        self.num_model_calls += 1
        self.num_prefilled_tokens += prefilled
        self.num_cached_tokens += sum(cached)
        if len(rows) < len(batch):
            index = torch.tensor(source, dtype=torch.long, device=self.device)
            cache.batch_select_indices(index)
            mask, logits = mask[index], logits[index]
        for row in batch:
            if row.cache_key is not None:
                self._kept.pop(row.cache_key, None)
        self._batch.add(cache, mask, logits)
        self._rows += batch
        self._queue = []

    def _sample(self) -> torch.Tensor:
        """One token per running row from its own settings and processors, with its logprob (and best
        alternatives, if asked) of the distribution it was drawn from; rows of equal settings share one
        ``sample_token`` call, each with its own draw (``_uniforms``). Returns (B,) long."""
        tokens = torch.empty(len(self._rows), dtype=torch.long, device=self.device)
        groups: dict[tuple, list[int]] = {}
        extras = set()  # the groups with a row that has processors or wants top logprobs (serve's)
        for b, row in enumerate(self._rows):
            p = row.params
            key = (p.temperature, p.top_k, p.top_p)
            groups.setdefault(key, []).append(b)
            if row.processors or row.num_top_logprobs:
                extras.add(key)
        for key, rows in groups.items():
            params = self._rows[rows[0]].params
            index = torch.tensor(rows, device=self.device)
            logits = self._batch.logits[index]  # (R, V), a copy
            if key in extras:
                logits = self._processed(logits, rows)
            uniforms = self._uniforms(rows) if params.temperature > 0 else None
            picked, logprobs = sample_token(logits, params, uniforms=uniforms)
            tokens[index] = picked
            wanted, top = max(self._rows[b].num_top_logprobs for b in rows) if key in extras else 0, None
            if wanted:  # the most likely alternatives of the distribution each token was drawn from
                values, ids = torch.topk(process_logits(logits, params), wanted, dim=-1)
                top = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
            for i, (b, token, logprob) in enumerate(zip(rows, picked.tolist(), logprobs.tolist())):
                row = self._rows[b]
                row.tokens.append(token)
                row.logprobs.append(logprob)
                if row.num_top_logprobs:
                    row.top_logprobs.append(top[i][: row.num_top_logprobs])
        self.num_sampled_tokens += len(self._rows)
        return tokens

    def _processed(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """(R, V) logits of ``rows``, each changed in place by its row's processors, in order."""
        for i, b in enumerate(rows):
            row = self._rows[b]
            for processor in row.processors:
                processor.process(logits[i], row.ids, row.tokens)
        return logits

    def _uniforms(self, rows: list[int]) -> torch.Tensor:
        """(R, 1) the draws of ``rows``: the rows of one generator (a request's samples; the global generator's
        for unseeded rows) draw together in row order, as a ``sample_token`` call of those rows alone would,
        unless one of them has a draw waiting (``pending``): then each takes its own (``_draw``)."""
        members = [self._rows[b] for b in rows]
        if len({id(row.generator) for row in members}) == len(members):  # a generator each (episode turns)
            return torch.cat([self._draw(row) for row in members])
        by_generator: dict[int, list[int]] = {}
        for i, row in enumerate(members):
            by_generator.setdefault(id(row.generator), []).append(i)
        parts: list[torch.Tensor] = [None] * len(rows)  # (1, 1) each, in row order: one cat, no scatter per group
        for positions in by_generator.values():
            group = [members[i] for i in positions]
            if len(group) == 1 or any(row.pending is not None for row in group):
                drawn = [self._draw(row) for row in group]
            else:
                drawn = torch.rand((len(group), 1), generator=group[0].generator, device=self.device).split(1)
            for i, u in zip(positions, drawn):
                parts[i] = u
        return torch.cat(parts)

    def _draw(self, row: Row) -> torch.Tensor:
        """The row's next uniform, (1, 1) on the device: the one a rejected draft left waiting, else one
        from its generator (the global one for an unseeded row)."""
        if row.pending is not None:
            u, row.pending = row.pending, None
            return u
        return torch.rand((1, 1), generator=row.generator, device=self.device)
