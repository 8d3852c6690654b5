"""Continuous batching for ``lmforge serve``: one thread owns the model and runs every request's rows
in shared decode steps.

The rows, their KV cache and their sampling are the engine's (``rollout.continuous.ContinuousDecoder``,
which the multi-turn episode runner drives too); this module is its driver for HTTP requests: a queue,
weight updates, jobs, streaming and metrics. A request is ``n`` rows of the engine. Between two decode
steps the scheduler admits the requests that arrived meanwhile and fit in ``max_batch_rows``; the
engine prefills their prompts (each distinct prompt once: its KV cache rows are repeated for its ``n``
samples and for the other requests of the same admission with the same prompt ids, e.g. an agent run's
group of episodes opening with one question) and merges them into the running batch by left-padding
the shorter KV cache, exactly as the rollout engine left-pads prompts (attention mask 0 on padding,
position ids counting real tokens). Finished rows leave the batch at once, and columns that are
padding in every remaining row are cut from the cache. So a request never waits for a whole batch to
drain, and a long request never holds short ones back.

Sampling is the engine's ``sample_token``, with the same logprobs (``rollout/engine.py``, module doc):
``log p(token)`` of the processed distribution (temperature, then top-p) the token was drawn from;
for temperature 0 the untempered model logprob. Rows with different sampling settings share the model
call and are sampled in groups of equal settings; a request's samples draw from one generator seeded
by its ``seed``. OpenAI's logit adjustments come first, per row, on the raw logits, as the row's first
logits processors: ``logit_bias[j]`` is added (``extras.LogitBias``), then the penalties
(``extras.Penalties``): vLLM's ``repetition_penalty`` over the prompt and the output, then
``frequency_penalty * c[j] + presence_penalty * (c[j] > 0)`` subtracted, where c[j] counts token j
among the row's sampled tokens so far; the stored logprobs (and ``top_logprobs`` alternatives) are of the
distribution after
them, the one the token was drawn from. A request's ``processors`` (``RowProcessor``: structured
outputs, vLLM's sampling extras) run after them, per sample row, on the same raw logits. A request's
``min_tokens`` keeps stop tokens and stop strings from ending a sample before it has that many tokens.

Streaming: a request's ``on_token(sample, token, logprob, top, finish_reason)`` is called from this
thread after every token of every sample (``finish_reason`` is None until its last), from the engine's
``on_token``, which also resolves a request once its last sample has finished. A request whose
client left is ``cancel()``-ed: a waiting one is never admitted, running rows leave the batch at the
next step, so its slots go to other requests.

Kept entries (``GenerationRequest.cache_key``: an agent session's calls, ``sessions.py``): when such a
request finishes, its KV entries (its prompt and its sampled tokens but the last, which was never fed) are
kept under its key by the engine, the oldest key dropped past ``max_batch_rows`` keys. A later request
with that key whose prompt ids start with exactly those ids (the session's next call: the last call's
prompt, its sampled ids, the tool result) prefills only the ids after them (the engine's kept caches, as
for an episode's next turn). A weight update drops every kept entry.

Weight updates are never mixed into a sequence: an update waits until the running rows have finished
(no new request is admitted meanwhile), is applied between steps, and raises the version. Every
result carries the version of the weights that produced all of its tokens.

A forward pass outside the batch (prompt logprobs, ``scoring.py``) is a job: ``run_job(fn)`` runs
``fn(model)`` on this thread between two decode steps, one job per step while rows decode.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
import time
from typing import Callable, Hashable, Protocol

import torch

from ..core.ops import adopt_thread_count
from ..rollout.continuous import ContinuousDecoder, Row, has_full_attention_caches
from ..rollout.engine import SamplingParams
from .extras import LogitBias, Penalties


class ServeError(RuntimeError):
    """The scheduler cannot serve a request (shut down, model failure); the HTTP layer maps it to 5xx."""


TokenCallback = Callable[[int, int, float, list, "str | None"], None]  # (sample, token, logprob, top, finish)


class RowProcessor(Protocol):
    """A per-sample logits processor (structured outputs, repetition penalty, min_tokens, ...).

    ``process(logits, prompt_ids, tokens)`` changes one row's raw logits (V,) float32 in place before
    temperature and truncation, given the row's prompt ids and the tokens it sampled so far (the newest
    last). It is called once per sampled token, in order, so a stateful processor (a grammar matcher)
    can advance by the tokens it has not seen yet. The stored logprobs are of the processed distribution.
    """

    def process(self, logits: torch.Tensor, prompt_ids: list[int], tokens: list[int]) -> None: ...


@dataclasses.dataclass
class GenerationRequest:
    """``n`` samples for one prompt. ``params.max_new_tokens`` is the per-sample token budget.

    ``logit_bias`` maps token ids to what is added to their logits; the penalties are OpenAI's
    (module doc); ``top_logprobs`` asks for that many most likely alternatives at each position.
    """

    prompt_ids: list[int]
    params: SamplingParams
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's (extras.Penalties); 1: off
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    top_logprobs: int = 0
    processors: list[Callable[[], RowProcessor]] = dataclasses.field(default_factory=list)  # one of each per sample
    min_tokens: int = 0  # vLLM's: no stop token or stop string ends a sample before it has this many tokens
    session_id: str | None = None  # the client's X-Session-ID (generate.py): recorded for a gateway, not used here
    cache_key: Hashable | None = None  # keep this call's KV entries under this key for the next one (module doc)
    on_token: TokenCallback | None = None
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)

    @property
    def penalised(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    def cancel(self) -> None:
        """The client is gone: never start, or free the running rows at the next step."""
        self.cancelled.set()
        self.future.cancel()


@dataclasses.dataclass
class Sample:
    token_ids: list[int]  # generated tokens, the stop token (if any) included
    logprobs: list[float]  # one per token, of the sampling distribution (module doc)
    finish_reason: str  # "stop" (stop token or string), "length" (max_new_tokens) or "cancelled"
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)  # per token, best first


@dataclasses.dataclass
class GenerationResult:
    samples: list[Sample]
    weight_version: int  # the weights that produced every token of every sample


@dataclasses.dataclass(eq=False)
class _Admitted:
    """A request whose samples are the engine's rows (each row's ``key``)."""

    request: GenerationRequest
    rows: list[Row] = dataclasses.field(default_factory=list)  # its samples, in order


@dataclasses.dataclass
class _WeightUpdate:
    load: Callable[[torch.nn.Module], None]  # copies new weights into the model
    version: int | None  # requested version (None: current + 1)
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)


@dataclasses.dataclass
class _Job:
    run: Callable[[torch.nn.Module], object]  # a forward pass outside the batch (prompt scoring: scoring.py)
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)


class BatchScheduler:
    """Owns ``model``; ``submit`` requests from any thread, get a future of a ``GenerationResult``.

    ``max_batch_rows`` bounds the running rows (prompt rows x n); ``gather_s`` is how long an idle
    scheduler waits after the first request for others to arrive, so that a burst of clients starts
    in one prefill. ``decode_fn(ids) -> str`` is needed for stop strings.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        decode_fn: Callable[[list[int]], str],
        max_batch_rows: int = 64,
        gather_s: float = 0.005,
        weight_version: int = 0,
    ):
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        self.model = model.eval().requires_grad_(False)
        self.device = next(model.parameters()).device
        self._full_attention = has_full_attention_caches(model)  # else every admission is refused (_admit)
        self.pad_token_id, self.decode_fn = pad_token_id, decode_fn
        self.max_batch_rows, self.gather_s = max_batch_rows, gather_s
        self.weight_version = weight_version
        self.num_prompt_tokens = 0  # prompt tokens prefilled (once per request, whatever its n)
        # the rows, their KV cache, sampling and kept entries (rollout/continuous.py); cache keys are the requests'
        self._engine = ContinuousDecoder(
            self.model, pad_token_id, keep_cache=False, decode_fn=decode_fn, max_kept=max_batch_rows
        )
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: list[GenerationRequest] = []
        self._updates: list[_WeightUpdate] = []
        self._jobs: list[_Job] = []
        self._admitting: list[GenerationRequest] = []  # taken from _waiting, not yet the engine's rows
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmforge-serve-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public, any thread

    @property
    def alive(self) -> bool:
        """Whether the generation thread still runs and takes requests (False after a model failure or shutdown)."""
        return self._thread.is_alive() and not self._stopping.is_set()

    @property
    def num_running(self) -> int:
        """Rows decoding now (a snapshot read from another thread)."""
        return self._engine.num_running

    @property
    def num_steps(self) -> int:
        """Decode steps run (shared by all rows of a step)."""
        return self._engine.num_steps

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose kept KV entries spared their prefill (``cache_key``)."""
        return self._engine.num_cached_tokens

    @property
    def num_generated_tokens(self) -> int:
        """Tokens sampled, every row's."""
        return self._engine.num_sampled_tokens

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet decoding (a snapshot read from another thread)."""
        return len(self._waiting) + self._inbox.qsize()

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future:
        if self._stopping.is_set():
            raise ServeError("the server is shutting down (or its generation thread stopped: see the server log)")
        if request.n < 1 or request.n > self.max_batch_rows:
            raise ValueError(f"n must be in [1, {self.max_batch_rows}] (the server's max batch rows), got {request.n}")
        self._inbox.put(request)
        return request.future

    def update_weights(
        self, load: Callable[[torch.nn.Module], None], version: int | None = None
    ) -> concurrent.futures.Future:
        """Queue a weight update; the future gives the new version once no row of the old weights runs."""
        if self._stopping.is_set():
            raise ServeError("the server is shutting down (or its generation thread stopped: see the server log)")
        update = _WeightUpdate(load, version)
        self._inbox.put(update)
        return update.future

    def run_job(self, run: Callable[[torch.nn.Module], object]) -> concurrent.futures.Future:
        """Run ``run(model)`` on this thread between two decode steps (one job per step while rows
        decode); the future gives ``(its result, the weight version it ran with)``."""
        if self._stopping.is_set():
            raise ServeError("the server is shutting down (or its generation thread stopped: see the server log)")
        job = _Job(run)
        self._inbox.put(job)
        return job.future

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread; requests not yet finished fail with ``ServeError``."""
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ scheduler thread

    def _run(self) -> None:
        adopt_thread_count()  # this thread's OpenMP team as torch.set_num_threads set it (core/ops.py)
        try:
            while not self._stopping.is_set():
                busy = self._engine.busy
                self._collect(block=not busy and not self._waiting and not self._updates and not self._jobs)
                if self._stopping.is_set():
                    break
                if self._jobs:
                    self._run_job(self._jobs.pop(0))
                if self._updates and not self._engine.busy:
                    self._apply_update(self._updates.pop(0))
                    continue
                if not self._updates:
                    self._admit()
                if self._engine.busy:
                    self._step()
        except BaseException as exc:  # the model failed: fail everything instead of hanging clients
            self._stopping.set()  # and refuse new requests (submit raises) rather than queue them forever
            self._fail_all(ServeError(f"the generation thread stopped: {type(exc).__name__}: {exc}"))
            raise
        self._fail_all(ServeError("the server shut down before this request finished"))

    def _collect(self, block: bool) -> None:
        """Move what arrived into the waiting lists; when idle, block for one item, then gather briefly."""
        items = []
        if block:
            items.append(self._inbox.get())
            deadline = time.monotonic() + self.gather_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    items.append(self._inbox.get(timeout=left))
                except queue.Empty:
                    break
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if isinstance(item, GenerationRequest):
                self._waiting.append(item)
            elif isinstance(item, _WeightUpdate):
                self._updates.append(item)
            elif isinstance(item, _Job):
                self._jobs.append(item)

    def _fail_all(self, exc: Exception) -> None:
        self._collect(block=False)
        pending = [row.key.request for row in self._engine.rows] + self._admitting + self._waiting
        for item in pending + [u for u in self._updates] + self._jobs:
            if not item.future.done():
                item.future.set_exception(exc)
        self._admitting, self._waiting, self._updates, self._jobs = [], [], [], []

    def _run_job(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result((job.run(self.model), self.weight_version))
        except Exception as exc:  # noqa: BLE001 - a job that fails (a bad prompt, out of memory) fails its request only
            job.future.set_exception(exc)

    def _apply_update(self, update: _WeightUpdate) -> None:
        if not update.future.set_running_or_notify_cancel():
            return
        try:
            if update.version is not None and update.version <= self.weight_version:
                raise ValueError(
                    f"weight version must increase: the server is at {self.weight_version}, "
                    f"the update asks for {update.version}"
                )
            update.load(self.model)
            self._engine.release_all()  # entries of the old weights
            self.weight_version = self.weight_version + 1 if update.version is None else update.version
            update.future.set_result(self.weight_version)
        except Exception as exc:  # noqa: BLE001 - a bad checkpoint leaves the old weights serving; the caller sees why
            update.future.set_exception(exc)

    def _admit(self) -> None:
        """Queue the waiting requests that fit as the engine's rows; the next ``_step`` prefills them (each
        distinct prompt once, after its kept entries) and merges them into the running batch."""
        room = self.max_batch_rows - len(self._engine.rows)
        batch = []
        while self._waiting and self._waiting[0].n <= room:
            request = self._waiting.pop(0)
            if request.future.set_running_or_notify_cancel():
                batch.append(request)
                room -= request.n
        if not batch:
            return
        self._admitting = batch
        self.num_prompt_tokens += sum(len(r.prompt_ids) for r in batch)
        if not self._full_attention:
            raise ServeError(
                "lmforge serve batches requests by merging full-attention KV caches; this model "
                "has sliding-window or other special cache layers, which are not supported"
            )
        for request in batch:
            admitted = _Admitted(request)
            admitted.rows = self._engine.admit(
                admitted,
                request.prompt_ids,
                request.params,
                request.n,
                cache_key=request.cache_key,
                processors=lambda r=request: _processors(r),
                min_tokens=request.min_tokens,
                top_logprobs=request.top_logprobs,
                cancelled=request.cancelled,
            )
        self._admitting = []

    def _step(self) -> None:
        """Prefill the rows just admitted, sample a token for every row, retire finished rows, run the model
        once on the rest (``ContinuousDecoder.step``), streaming and resolving as rows go (``_on_token``)."""
        self._engine.step(on_token=self._on_token)

    def _on_token(self, row: Row) -> None:
        """A row's new token: stream it, and resolve its request once every sample of it has finished."""
        admitted: _Admitted = row.key
        request = admitted.request
        if request.on_token is not None and row.finish_reason != "cancelled":
            top = row.top_logprobs[-1] if row.top_logprobs else []
            request.on_token(row.index, row.tokens[-1], row.logprobs[-1], top, row.finish_reason)
        if row.finish_reason is None or request.future.done():
            return
        if all(r.finish_reason is not None for r in admitted.rows):  # (a request's rows run in order: this is its last)
            samples = [Sample(r.tokens, r.logprobs, r.finish_reason, r.top_logprobs) for r in admitted.rows]
            request.future.set_result(GenerationResult(samples, self.weight_version))


def _processors(request: GenerationRequest) -> list[RowProcessor]:
    """One sample's logits processors, in the module doc's order: logit bias, penalties, the request's own."""
    made: list[RowProcessor] = []
    if request.logit_bias:
        made.append(LogitBias(request.logit_bias))
    if request.penalised:
        made.append(Penalties(request.repetition_penalty, request.frequency_penalty, request.presence_penalty))
    return made + [make() for make in request.processors]
