"""In-process batched sampling with a KV cache, for any Hugging Face causal LM.

``generate`` prefills each prompt once, shares its KV cache among the prompt's ``num_samples``
samples, then decodes all B = num_prompts * num_samples rows in lockstep. The step-level pieces
(``prefill``, ``decode_step``, ``process_logits``, ``sample_token``) and the loop itself
(``lockstep_decode``) are public so that other samplers (antidistillation decodes a teacher and two
proxies in lockstep) reuse them. ``CastEngine`` runs the same sampler on a bf16 / fp16 copy.

Which distribution the stored logprobs belong to
------------------------------------------------
For temperature T > 0, token t is drawn from ``p = softmax(logits / T)``, restricted to the top-k
set (if ``top_k > 0``) and then to the top-p nucleus (if ``top_p < 1``) and renormalised over what
is left. ``RolloutBatch.logprobs`` holds ``log p[t]`` of that same processed distribution. With
``top_k=0, top_p=1`` this is exactly ``log_softmax(logits / T)[t]``: a trainer that recomputes
logprobs with the same temperature (and no truncation) gets matching values. With truncation on,
the stored values are of the *renormalised truncated* distribution, which a trainer's plain
``log_softmax(logits / T)`` will not reproduce (it is lower by log of the kept mass).
For T = 0 (greedy) the token is the argmax and the stored logprob is ``log_softmax(logits)[t]``
(the untempered model distribution), since the point mass greedy "samples" from carries no signal.

Shapes: N = number of prompts, G = samples per prompt, B = N * G rows, P = padded prompt length,
C = completion length (decode steps run, <= max_new_tokens), V = vocabulary size.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from ..model import lora


@dataclass
class SamplingParams:
    """How to sample. temperature 0 means greedy; top_k 0 and top_p 1 mean no truncation."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 32
    stop_token_ids: list[int] = field(default_factory=list)  # e.g. [eos]; the stop token is kept and masked in
    stop_strings: list[str] = field(default_factory=list)  # needs ``decode_fn`` in ``generate``
    seed: int | None = None  # same seed -> same tokens (same model, prompts, threads)

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings must not contain the empty string")


@dataclass
class RolloutBatch:
    """Sampled completions. Row b belongs to prompt ``group_index[b]``; rows of a group are adjacent.

    A completion is every token after the prompt. From this engine they are all sampled; a
    multi-turn row (an Atropos environment's, a tool-using episode's) interleaves the policy's turns
    with environment tokens it did not sample, and ``trained_mask`` marks the policy's: one or
    several separate spans per row.
    """

    prompt_ids: torch.Tensor  # (B, P) long, left-padded with pad_token_id
    prompt_mask: torch.Tensor  # (B, P) long, 1 on real prompt tokens
    completion_ids: torch.Tensor  # (B, C) long, right-padded with pad_token_id
    completion_mask: torch.Tensor  # (B, C) long, 1 on the completion's tokens (up to and including the stop token)
    logprobs: torch.Tensor | None  # (B, C) float32, log p(token) under the sampling distribution (module doc);
    # 0 off the trained mask; None from a source that reports none
    group_index: torch.Tensor  # (B,) long, index of the prompt each row was sampled for
    prompt_lens: torch.Tensor  # (B,) long
    completion_lens: torch.Tensor  # (B,) long, = completion_mask.sum(1)
    truncated: torch.Tensor  # (B,) bool, hit max_new_tokens without a stop token / string
    # (B, C) long, 1 on the policy's tokens, within completion_mask; None: every completion token (single-turn
    # sampling). Keyword-only, so that subclasses (antidistill's batch) add required fields after it.
    trained_mask: torch.Tensor | None = field(default=None, kw_only=True)
    # (B,) long, the episode each row belongs to, where an episode may give several rows (an agent's:
    # rl/sources/agent_samples.py); advantages are then an episode's, shared by its rows (-1: a padding
    # row of no episode). None: each row is its own episode.
    episode_index: torch.Tensor | None = field(default=None, kw_only=True)

    @property
    def trained(self) -> torch.Tensor:
        """(B, C) long: the tokens the policy sampled, the ones a trainer trains on."""
        return self.completion_mask if self.trained_mask is None else self.trained_mask


# ----------------------------------------------------------------------------- model calls

_FORWARD_ARGS: dict[type, tuple[str, str | None]] = {}


def _forward_args(model: torch.nn.Module) -> tuple[str, str | None]:
    """(cache kwarg name, last-logits-only kwarg name or None) accepted by ``model.forward``."""
    key = type(model)
    if key not in _FORWARD_ARGS:
        params = inspect.signature(model.forward).parameters
        cache_arg = "cache" if "cache" in params else "past_key_values"  # transformers >= 5.x renamed it
        keep_arg = next((a for a in ("logits_to_keep", "num_logits_to_keep") if a in params), None)
        _FORWARD_ARGS[key] = (cache_arg, keep_arg)
    return _FORWARD_ARGS[key]


def _forward(model, input_ids, attention_mask, position_ids, cache, last_only: bool, every: bool = False):
    cache_arg, keep_arg = _forward_args(model)
    kwargs: dict[str, Any] = {cache_arg: cache, "use_cache": True}
    if last_only and keep_arg is not None:
        kwargs[keep_arg] = 1
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    new_cache = out.cache if "cache" in out else out.past_key_values
    return (out.logits if every else out.logits[:, -1, :]).float(), new_cache


def prefill(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: Any = None):
    """Run left-padded prompts through ``model`` and return ``(last_logits, cache)``.

    input_ids: (N, P), left-padded; attention_mask: (N, P), 1 on real tokens, or (N, L + P) when
    ``cache`` already holds L positions (its own mask first). Returns last_logits (N, V) float32 at
    the last position (the last real token of every row) and the model's KV cache. Position ids
    count real tokens only (the cached ones too), so padding does not shift RoPE.
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1] :]  # (N, P)
    return _forward(model, input_ids, attention_mask, position_ids, cache, last_only=True)


def decode_step(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    cache: Any,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
):
    """Feed one token per row and return ``(logits, cache)``.

    token_ids: (B,) long; attention_mask: (B, L + 1) covering the cached L positions plus this one;
    position_ids: (B,) long, the position of this token (= number of real tokens before it).
    Returns logits (B, V) float32 for the next token and the updated cache.
    """
    return _forward(model, token_ids[:, None], attention_mask, position_ids[:, None], cache, last_only=False)


def verify_step(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    cache: Any,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
):
    """Feed T tokens per row after the cached ones and return the logits after each: ``(logits, cache)``
    (speculative decoding checks drafted tokens this way).

    token_ids: (B, T) long; attention_mask: (B, L + T), 0 on any of the T that are padding;
    position_ids: (B, T) long. Returns logits (B, T, V) float32 and the updated cache.
    """
    return _forward(model, token_ids, attention_mask, position_ids, cache, last_only=False, every=True)


class _PreallocatedLayer(DynamicLayer):
    """A DynamicLayer that writes into buffers of ``capacity`` positions instead of concatenating.

    ``keys``/``values`` stay views of the filled part, so attention, masks and ``get_seq_length``
    behave exactly as for a DynamicLayer; each decode step copies one position instead of the cache.
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        batch, heads, _, _ = key_states.shape
        self.key_buffer = key_states.new_empty((batch, heads, self.capacity, key_states.shape[-1]))
        self.value_buffer = value_states.new_empty((batch, heads, self.capacity, value_states.shape[-1]))
        self.keys, self.values = self.key_buffer[:, :, :0], self.value_buffer[:, :, :0]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.keys.shape[-2], self.keys.shape[-2] + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache capacity {self.capacity} exceeded ({end} positions); make a larger cache")
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda buf: buf.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda buf: buf[indices])

    def _select(self, fn) -> None:
        if self.is_initialized:
            length = self.keys.shape[-2]
            self.key_buffer, self.value_buffer = fn(self.key_buffer), fn(self.value_buffer)
            self.keys, self.values = self.key_buffer[:, :, :length], self.value_buffer[:, :, :length]


def make_cache(model: torch.nn.Module, capacity: int | None = None) -> DynamicCache:
    """A KV cache for ``model``: a DynamicCache whose full-attention layers are preallocated to
    ``capacity`` positions (prompt + new tokens). Sliding-window or other special layers, and
    ``capacity=None``, keep transformers' own layers."""
    cache = DynamicCache(config=model.config)
    if capacity is not None and cache.layers:
        cache.layers = [
            _PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers
        ]
    return cache


def expand_cache(cache: Cache, repeats: int) -> Cache:
    """Repeat every row of a KV cache ``repeats`` times along the batch (row i -> rows i*r .. i*r+r-1)."""
    if repeats > 1:
        cache.batch_repeat_interleave(repeats)
    return cache


# ----------------------------------------------------------------------------- sampling


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution ``sample_token`` draws from (see the module doc).

    logits: (B, V). Returns (B, V) float32: log_softmax(logits / T), with tokens outside the top-k set
    and then outside the top-p nucleus set to -inf and the rest renormalised. Ties at the k-th value
    are all kept. T = 0 (greedy) is the untempered, untruncated log_softmax(logits): the distribution
    ``sample_token`` reports a greedy token's logprob from.
    """
    if params.temperature == 0:
        return torch.log_softmax(logits.float(), dim=-1)
    scaled = logits.float()
    if params.temperature not in (0.0, 1.0):
        scaled = scaled / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]  # (B, 1)
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    logprobs = torch.log_softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
        mass_before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()  # (B, V) mass of strictly better tokens
        drop_sorted = mass_before >= params.top_p  # never drops the top token (mass_before = 0)
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logprobs = torch.log_softmax(logprobs.masked_fill(drop, float("-inf")), dim=-1)
    return logprobs


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. logits: (B, V). Returns (tokens (B,) long, logprobs (B,) float32).

    Inverse-CDF sampling: one uniform per row from ``generator`` (reproducible) and a binary search in
    the cumulative probabilities. On CPU this is ~100x cheaper than ``torch.multinomial`` or an
    exponential race, which both spend most of a step drawing (B, V) random numbers. ``uniforms``
    (B, 1) float32 in [0, 1), when given, are the draws (rows with generators of their own).
    """
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    if params.top_k == 0 and params.top_p == 1.0:
        scaled = logits.float() if params.temperature == 1.0 else logits.float() / params.temperature
        probs = torch.softmax(scaled, dim=-1)  # (B, V); one fused pass instead of log_softmax + exp
    else:
        probs = process_logits(logits, params).exp()  # 0 outside the top-k / top-p set
    cdf = probs.cumsum(-1)  # (B, V)
    total = cdf[:, -1:].contiguous()  # (B, 1), 1 up to rounding
    u = (
        torch.rand(total.shape, generator=generator, device=cdf.device, dtype=cdf.dtype)
        if uniforms is None
        else uniforms.to(cdf.dtype)
    )
    tokens = torch.searchsorted(cdf, u * total, right=True)  # first index with cdf > u * total: p > 0
    # u * total can round up to total; the last token with p > 0 is then the right answer.
    last_positive = torch.searchsorted(cdf, total)  # first index with cdf >= total
    tokens = torch.minimum(tokens, last_positive).squeeze(-1)
    # log of the softmax probability: accurate to ~1e-7 absolute for any token that can be drawn.
    return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1).log()


# ----------------------------------------------------------------------------- generate


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids (N, P), mask (N, P)), left-padded."""
    if not prompts:
        raise ValueError("generate needs at least one prompt")
    lengths = [len(p) for p in prompts]
    if min(lengths) == 0:
        raise ValueError(f"prompt {lengths.index(0)} is empty; every prompt needs at least one token (e.g. BOS)")
    width = max(lengths)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


def _hits_stop_string(
    rows: list[int],
    completion_ids: torch.Tensor,
    step: int,
    stop_strings: list[str],
    decode_fn: Callable[[list[int]], str],
) -> list[int]:
    """Rows (of ``rows``) whose completion text now contains a stop string.

    Rows are checked every step, so a match must end in the newest token; decoding only a tail
    window of (longest stop string + 8) tokens keeps the cost per step independent of the length.
    """
    window = max(map(len, stop_strings)) + 8
    tails = completion_ids[rows, max(0, step + 1 - window) : step + 1].tolist()
    return [b for b, tail in zip(rows, tails) if any(s in decode_fn(tail) for s in stop_strings)]


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    num_samples: int = 1,
    pad_token_id: int = 0,
    decode_fn: Callable[[list[int]], str] | None = None,
    check_every: int = 4,
) -> RolloutBatch:
    """Sample ``num_samples`` completions for each prompt (token id lists) with a shared-prefix KV cache.

    The model runs in eval mode (no dropout) and inference mode; its train/eval mode is restored.
    Every prompt is prefilled once; its cache and last logits are repeated for its samples. Rows that
    hit a stop token or stop string are finished: later positions hold ``pad_token_id`` with mask 0.
    Decoding stops when every row has finished (checked every ``check_every`` steps) or after
    ``max_new_tokens``. ``decode_fn(ids) -> str`` is required when ``params.stop_strings`` is set.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if params.stop_strings and decode_fn is None:
        raise ValueError("stop_strings need decode_fn (e.g. lambda ids: tokenizer.decode(ids)) to match text")
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id)  # (N, P)
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed)

    was_training = model.training
    model.eval()  # no dropout while sampling; the caller's mode is restored below
    try:
        cache = make_cache(model, capacity=prompt_ids.shape[1] + params.max_new_tokens)
        last_logits, cache = prefill(model, prompt_ids.to(device), prompt_mask.to(device), cache)  # (N, V)
        cache = expand_cache(cache, num_samples)
        last_logits = last_logits.repeat_interleave(num_samples, dim=0)  # (B, V)
        prompt_ids = prompt_ids.repeat_interleave(num_samples, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(num_samples, dim=0)
        completion_ids, completion_mask, logprobs, finished = _decode_loop(
            model, cache, last_logits, prompt_mask.to(device), params, pad_token_id, generator, decode_fn, check_every
        )
    finally:
        model.train(was_training)

    group_index = torch.arange(len(prompts)).repeat_interleave(num_samples)
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids.cpu(),
        completion_mask=completion_mask.cpu(),
        logprobs=logprobs.cpu(),
        group_index=group_index,
        prompt_lens=prompt_mask.sum(1),
        completion_lens=completion_mask.sum(1).cpu(),
        truncated=~finished.cpu(),
    )


def _decode_loop(
    model, cache, logits, prompt_mask, params: SamplingParams, pad_token_id: int, generator, decode_fn, check_every: int
):
    """Sample tokens until every row stopped or max_new_tokens. Returns (ids, mask, logprobs, finished)."""
    state = {"logits": logits, "cache": cache}

    def pick(step: int):
        tokens, token_logprobs = sample_token(state["logits"], params, generator)
        return tokens, token_logprobs, ()

    def advance(tokens, attention_mask, positions):
        state["logits"], state["cache"] = decode_step(model, tokens, state["cache"], attention_mask, positions)

    ids, mask, logprobs, _, finished = lockstep_decode(
        pick, advance, prompt_mask, params, pad_token_id, decode_fn, check_every
    )
    return ids, mask, logprobs, finished


def lockstep_decode(
    pick: Callable,
    advance: Callable,
    prompt_mask: torch.Tensor,
    params: SamplingParams,
    pad_token_id: int,
    decode_fn=None,
    check_every: int = 4,
    num_extras: int = 0,
):
    """The sampling loop every sampler here shares: all B rows advance one token per step.

    ``pick(step) -> (tokens (B,), logprobs (B,), extras)`` chooses this step's tokens from the current
    logits; ``extras`` is a tuple of ``num_extras`` (B,) float tensors stored like the logprobs (e.g.
    antidistillation's teacher logprobs). ``advance(tokens, attention_mask, positions)`` then runs the
    model(s) on them; attention_mask (B, P + step + 1) covers the prompt and the tokens so far,
    positions (B,) is each new token's position. Rows that hit a stop token or stop string are
    finished: later positions hold ``pad_token_id`` with mask 0 and logprob 0. The loop ends when every
    row has finished (checked every ``check_every`` steps, to avoid a host sync per step) or after
    ``max_new_tokens``. Returns (ids, mask, logprobs, extras list, finished), each (B, C) but finished (B,).
    """
    num_rows, prompt_width = prompt_mask.shape
    device, max_new = prompt_mask.device, params.max_new_tokens
    completion_ids = torch.full((num_rows, max_new), pad_token_id, dtype=torch.long, device=device)
    completion_mask = torch.zeros((num_rows, max_new), dtype=torch.long, device=device)
    logprobs = torch.zeros((num_rows, max_new), dtype=torch.float32, device=device)
    extras = [torch.zeros_like(logprobs) for _ in range(num_extras)]
    # Attention mask for prompt + generated positions, sliced per step (finished rows keep attending:
    # their outputs are discarded, and a constant mask shape avoids per-row bookkeeping).
    attention_mask = torch.cat([prompt_mask, torch.ones((num_rows, max_new), dtype=torch.long, device=device)], 1)
    positions = prompt_mask.sum(1)  # (B,) position of the first generated token
    stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
    finished = torch.zeros(num_rows, dtype=torch.bool, device=device)
    num_steps = max_new
    for step in range(max_new):
        tokens, token_logprobs, token_extras = pick(step)  # (B,), (B,), num_extras x (B,)
        alive = ~finished
        completion_ids[:, step] = torch.where(alive, tokens, pad_token_id)
        completion_mask[:, step] = alive.long()
        logprobs[:, step] = token_logprobs.float().masked_fill(finished, 0.0)
        for store, value in zip(extras, token_extras):
            store[:, step] = value.float().masked_fill(finished, 0.0)
        if len(stop_ids):
            finished |= torch.isin(tokens, stop_ids)
        if params.stop_strings:
            rows = alive.nonzero().flatten().tolist()
            finished[_hits_stop_string(rows, completion_ids, step, params.stop_strings, decode_fn)] = True
        if step + 1 == max_new or ((step + 1) % check_every == 0 and bool(finished.all())):
            num_steps = step + 1
            break
        advance(tokens, attention_mask[:, : prompt_width + step + 1], positions + step)
    return (
        completion_ids[:, :num_steps],
        completion_mask[:, :num_steps],
        logprobs[:, :num_steps],
        [e[:, :num_steps] for e in extras],
        finished,
    )


# ----------------------------------------------------------------------------- a sampler in another dtype


class CastEngine:
    """The in-process sampler on a copy of the policy whose weights are cast to ``dtype`` (e.g. bf16
    rollouts for an fp32 trainer, the arrangement of vLLM-fed trainers, here without a second engine).

    Decoding a small batch streams every weight from memory once per token, so halving the weight
    bytes nearly halves the decode time where the hardware multiplies bf16 natively (CUDA, and CPUs
    with AVX512-BF16 or AMX: ``runtime.hardware.cpu_has_bf16``). Only the parameters are cast; buffers (the
    rotary frequencies) keep their dtype, and the logits are upcast to float32 before sampling.

    The samples then come from the bf16 model and their logprobs differ from the trainer's float32
    recomputation by rounding: ``algo.is_level`` (truncated importance sampling against these
    logprobs) corrects for that, and the alignment metrics show how large it is. Same interface as the
    vLLM backend: ``sync_weights(model)`` before every rollout, then ``generate``.
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        if lora.has_adapters(self.model):  # a LoRA policy: the copy is the plain model, fed merged weights
            lora.strip_adapters(self.model)
        for param in self.model.parameters():
            param.grad = None
            param.data = param.data.to(dtype)
        self._names = None

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Copy (and cast) ``model``'s current parameters into the sampler's copy. For a LoRA policy
        these are the merged weights ``W + scale * B A``, computed out of place, one adapted matrix alive at a
        time (``model.lora.merged_named_parameters``): the policy keeps its adapters unmerged."""
        mine = dict(self.model.named_parameters())  # (a tied weight once)
        if self._names is None:
            theirs = {name for name, _ in lora.merged_named_parameters(model)}
            every = {name for name, _ in self.model.named_parameters(remove_duplicate=False)}
            if every != theirs:
                missing = sorted(every ^ theirs)[:3]
                raise ValueError(f"CastEngine.sync_weights: parameter names differ from the copy's ({missing})")
            self._names = set(mine)
        for name, src in lora.merged_named_parameters(model):
            if name in self._names:
                mine[name].copy_(src)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        num_samples: int = 1,
        pad_token_id: int = 0,
        decode_fn: Callable[[list[int]], str] | None = None,
    ) -> RolloutBatch:
        return generate(
            self.model, prompts, params, num_samples=num_samples, pad_token_id=pad_token_id, decode_fn=decode_fn
        )
