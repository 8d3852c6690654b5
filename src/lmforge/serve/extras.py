"""vLLM's sampling extras as per-sample logits processors (``scheduler.RowProcessor``).

Clients written for vLLM send these as top-level request fields (the ``openai`` client's
``extra_body``); ``protocol.py`` declares them, :func:`extra_processors` turns a request's into the
factories ``GenerationRequest.processors`` takes. ``top_k`` needs no processor: it is the engine's
own (``SamplingParams.top_k``), applied after temperature and before top-p, as vLLM does. The
penalties need none either: the scheduler runs :class:`Penalties` on every penalised row, after
``logit_bias`` and before any request processor.

Order of operations per sampled token, vLLM's (``vllm/v1/sample/sampler.py``): raw logits ->
``min_tokens`` (stop ids to -inf) -> ``logit_bias`` -> penalties (``repetition_penalty``, then
``frequency_penalty``, ``presence_penalty``) -> temperature -> ``min_p`` -> top-k -> top-p -> draw.
``min_tokens`` and a grammar mask set logits to -inf, which the penalties leave at -inf, so their
place after the penalties changes nothing.

``min_p`` keeps the tokens with ``p_i >= min_p * p_max`` of the tempered distribution. Since
``p_i / p_max = exp((z_i - z_max) / T)``, that is ``z_i - z_max >= T * log(min_p)`` on the logits
before temperature: :class:`MinP` masks there, as a processor, so the engine's sampling code (which
the RL recipes share) stays as it was, bit for bit. It runs after every other processor (a grammar
mask must come first: the most likely token it forbids must not set the threshold), and it is the
first truncation, so top-k and top-p then cut what it left, as in vLLM. Greedy requests skip it: it
never changes the argmax (vLLM's greedy path skips it too).
"""

from __future__ import annotations

import math
from typing import Callable

import torch


class MinTokens:
    """The stop ids cannot be sampled before the row has ``min_tokens`` tokens."""

    def __init__(self, min_tokens: int, stop_ids: list[int]):
        self.min_tokens, self.stop_ids = min_tokens, list(stop_ids)

    def process(self, logits: torch.Tensor, prompt_ids: list[int], tokens: list[int]) -> None:
        if len(tokens) < self.min_tokens:
            logits[self.stop_ids] = float("-inf")


class LogitBias:
    """OpenAI's ``logit_bias``: each listed token's bias added to its logit."""

    def __init__(self, bias: dict[int, float]):
        self.ids, self.values = list(bias), list(bias.values())

    def process(self, logits: torch.Tensor, prompt_ids: list[int], tokens: list[int]) -> None:
        ids = torch.tensor(self.ids, device=logits.device)
        logits[ids] += torch.tensor(self.values, device=logits.device, dtype=logits.dtype)


class Penalties:
    """vLLM's ``repetition_penalty`` (tokens seen in the prompt or the output: a positive logit is
    divided by it, any other multiplied), then OpenAI's frequency and presence penalties over the
    output's counts, in that order (module doc)."""

    def __init__(self, repetition: float, frequency: float, presence: float):
        self.repetition, self.frequency, self.presence = repetition, frequency, presence
        self.counts: torch.Tensor | None = None  # (V,) float32: how often each token was sampled
        self.seen: torch.Tensor | None = None  # (V,) bool: in the prompt or the output so far (repetition only)
        self.num_counted = 0  # tokens of the output already in ``counts`` / ``seen``

    def process(self, logits: torch.Tensor, prompt_ids: list[int], tokens: list[int]) -> None:
        if self.counts is None:
            self.counts = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device)
            if self.repetition != 1.0:
                self.seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
                self.seen[prompt_ids] = True
        for token in tokens[self.num_counted :]:
            self.counts[token] += 1
            if self.seen is not None:
                self.seen[token] = True
        self.num_counted = len(tokens)
        if self.seen is not None:
            scale = torch.where(logits > 0, 1.0 / self.repetition, self.repetition)
            logits.copy_(torch.where(self.seen, logits * scale, logits))
        if self.frequency or self.presence:
            logits -= self.frequency * self.counts + self.presence * (self.counts > 0)


class MinP:
    """Masks the tokens whose tempered probability is below ``min_p`` times the best one's (module doc)."""

    def __init__(self, min_p: float, temperature: float):
        self.margin = temperature * math.log(min_p)  # <= 0; -inf for min_p 0 is never built (no processor)

    def process(self, logits: torch.Tensor, prompt_ids: list[int], tokens: list[int]) -> None:
        logits.masked_fill_(logits - logits.max() < self.margin, float("-inf"))


def extra_processors(body, stop_ids: list[int]) -> list[Callable[[], object]]:
    """The processor factories for a request's vLLM extras (``body``: a protocol request), in the
    module doc's order, to follow any processor that masks (structured outputs). ``stop_ids``: the
    ids that would end the sample (``min_tokens`` keeps them out until then)."""
    made: list[Callable[[], object]] = []
    if body.min_tokens and stop_ids:
        made.append(lambda: MinTokens(body.min_tokens, stop_ids))
    if body.min_p > 0 and body.temperature > 0:
        made.append(lambda: MinP(body.min_p, body.temperature))
    return made
