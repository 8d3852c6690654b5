"""Prompt logprobs for ``lmforge serve``: how likely the model finds each prompt token given the ones before it.

Two wire shapes use them. Completions with ``echo`` and ``logprobs: N`` (OpenAI's legacy API, which
lm-eval's ``local-completions`` reads for every loglikelihood task) return the prompt's tokens before the
completion's in ``logprobs``: ``tokens``, ``token_logprobs`` and ``top_logprobs`` (``null`` for the first
prompt token, which has no context), and ``text_offset``. vLLM's ``prompt_logprobs: N`` extension
(completions and chat) returns per prompt position ``{token id: {"logprob", "rank", "decoded_token"}}``
for the prompt token and the N most likely tokens, ``null`` first. ``max_tokens: 0`` with ``echo``
scores the prompt and generates nothing (``finish_reason`` "length", as vLLM answers).

The distribution is the model's own: ``log_softmax`` of the raw logits at each position, without the
request's temperature, top-p, logit_bias or penalties (vLLM's default ``raw_logprobs`` is the same for
prompt tokens, which never pass its sampler). The completion's tokens keep the logprobs of the
distribution they were drawn from (``scheduler.py``). ``rank`` is 1 + the number of tokens strictly more
likely, counting ties as vLLM does (tokens at least as likely, the token included).

Scoring is one plain forward pass per prompt (``model(ids).logits``: no KV cache, prompts of a chunk
right-padded, which causal attention never sees), run on the scheduler thread between two decode steps
(``BatchScheduler.run_job``), since that thread owns the model. Prompts are chunked so that one chunk's
logits stay under ``LOGITS_BUDGET`` floats; a prompt longer than that is scored alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

LOGITS_BUDGET = 1 << 26  # floats of logits per forward (256 MiB in float32): prompts x padded length x vocab
OFFSET_WINDOW = 4  # tokens decoded before each one when measuring its text (merges split UTF-8 and leading spaces)
MIN_LOGPROB = -9999.0  # what -inf becomes in JSON (OpenAI's and vLLM's floor)


@dataclasses.dataclass
class PromptScores:
    """One prompt's logprobs; index 0 is the first prompt token, which has none (``None`` everywhere)."""

    token_ids: list[int]
    logprobs: list[float | None]  # log p(token_i | tokens before it)
    ranks: list[int | None]  # 1 = the most likely token at that position
    top: list[list[tuple[int, float]] | None]  # the N most likely (id, logprob), best first


def _chunks(prompts: list[list[int]], vocab_size: int, budget: int) -> list[list[int]]:
    """Indices of ``prompts`` in groups whose padded logits (group x longest x vocab) fit ``budget``."""
    groups: list[list[int]] = []
    for index in sorted(range(len(prompts)), key=lambda i: len(prompts[i])):
        group = groups[-1] if groups else None
        if group and (len(group) + 1) * len(prompts[index]) * vocab_size <= budget:
            group.append(index)
        else:
            groups.append([index])
    return groups


def _score_one(logits: torch.Tensor, prompt: list[int], top_n: int) -> PromptScores:
    """logits: (P, V) at the prompt's P positions; position i predicts token i + 1."""
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)  # (P-1, V)
    targets = torch.tensor(prompt[1:], dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(-1, targets[:, None])  # (P-1, 1)
    ranks = (logprobs >= chosen).sum(-1)  # (P-1,)
    top: list[list[tuple[int, float]] | None] = [[] for _ in prompt[1:]]
    if top_n:
        values, ids = torch.topk(logprobs, top_n, dim=-1)  # (P-1, N)
        top = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return PromptScores(list(prompt), [None, *chosen[:, 0].tolist()], [None, *ranks.tolist()], [None, *top])


@torch.inference_mode()
def score_prompts(
    model: torch.nn.Module, prompts: list[list[int]], top_n: int, budget: int = LOGITS_BUDGET
) -> list[PromptScores]:
    """The prompt logprobs of ``prompts`` (each at least one token) with their ``top_n`` best alternatives."""
    device = next(model.parameters()).device
    vocab_size = int(model.config.vocab_size)  # for the budget only: the logits' last dimension may be padded
    scores: list[PromptScores | None] = [None] * len(prompts)
    for group in _chunks(prompts, vocab_size, budget):
        width = max(len(prompts[i]) for i in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)  # right-padded with token 0
        for row, i in enumerate(group):
            ids[row, : len(prompts[i])] = torch.tensor(prompts[i], dtype=torch.long)
        logits = model(input_ids=ids.to(device), use_cache=False).logits  # (G, width, V)
        for row, i in enumerate(group):
            scores[i] = _score_one(logits[row, : len(prompts[i])], prompts[i], top_n)
    return scores  # type: ignore[return-value]


def text_offsets(token_ids: list[int], decode: Callable[[list[int]], str], start: int = 0) -> list[int]:
    """Where each token's text starts in ``decode(token_ids)`` (shifted by ``start``): each token's
    length is what it adds to the text of the few tokens before it, so a character split over two
    tokens counts once and a tokenizer's leading-space rule does not shift the rest."""
    offsets, at = [], start
    for i in range(len(token_ids)):
        offsets.append(at)
        window = token_ids[max(0, i - OFFSET_WINDOW) : i]
        at += len(decode([*window, token_ids[i]])) - len(decode(window)) if window else len(decode([token_ids[i]]))
    return offsets


def _floor(value: float) -> float:
    return max(value, MIN_LOGPROB)


def echo_logprobs(
    scores: PromptScores,
    sampled: dict[str, Any] | None,
    top_n: int,
    text: str,
    decode_text: Callable[[list[int]], str],
    decode_token: Callable[[int], str],
    completion_ids: list[int],
) -> dict[str, Any]:
    """A completion choice's ``logprobs`` with the prompt's tokens first (``echo`` with ``logprobs``).

    ``sampled`` is the completion's own logprobs object (``protocol.completion_logprobs``; None when
    nothing was generated). Each position's ``top_logprobs`` holds its token and the ``top_n`` most
    likely tokens, as vLLM's do. ``text_offset`` indexes ``text``, the choice's text.
    """
    tokens = [decode_token(t) for t in scores.token_ids]
    top = [None] + [
        {decode_token(t): _floor(lp) for t, lp in [(tid, lp), *alternatives[:top_n]]}
        for tid, lp, alternatives in zip(scores.token_ids[1:], scores.logprobs[1:], scores.top[1:])
    ]
    token_logprobs = [None, *(_floor(lp) for lp in scores.logprobs[1:])]
    offsets = text_offsets(scores.token_ids, decode_text)
    echoed = len(decode_text(scores.token_ids))
    if sampled:
        tokens += sampled["tokens"]
        token_logprobs += sampled["token_logprobs"]
        alternatives = sampled["top_logprobs"] or [{} for _ in sampled["tokens"]]
        top += [
            {token: lp, **alts} for token, lp, alts in zip(sampled["tokens"], sampled["token_logprobs"], alternatives)
        ]
        offsets += text_offsets(completion_ids, decode_text, echoed)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": [min(o, len(text)) for o in offsets],
    }


def prompt_logprobs_entries(
    scores: PromptScores, top_n: int, decode_token: Callable[[int], str]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per position ``{str(id): {"logprob", "rank", "decoded_token"}}``, the
    prompt token first, then the ``top_n`` best (ranks 1..N); ``None`` for the first token."""
    entries: list[dict[str, dict[str, Any]] | None] = [None]
    for i in range(1, len(scores.token_ids)):
        token = scores.token_ids[i]
        entry = {
            str(token): {
                "logprob": _floor(scores.logprobs[i]),
                "rank": scores.ranks[i],
                "decoded_token": decode_token(token),
            }
        }
        for rank, (tid, lp) in enumerate(scores.top[i][:top_n], start=1):
            entry.setdefault(str(tid), {"logprob": _floor(lp), "rank": rank, "decoded_token": decode_token(tid)})
        entries.append(entry)
    return entries


def add_prompt_logprobs(
    response: dict[str, Any],
    scores: list[PromptScores],
    request: Any,
    decode_text: Callable[[list[int]], str],
    decode_token: Callable[[int], str],
) -> None:
    """Put the prompts' logprobs into a /v1/completions ``response`` (``protocol.completion_body``'s):
    the echoed prompt's in ``logprobs`` with ``echo`` and ``logprobs``, vLLM's ``prompt_logprobs`` when
    asked. ``scores[i]`` is of prompt i (each choice's ``prompt_index``)."""
    for choice in response["choices"]:
        prompt_scores = scores[choice["prompt_index"]]
        if request.echo and request.logprobs is not None:
            choice["logprobs"] = echo_logprobs(
                prompt_scores,
                choice["logprobs"],
                request.logprobs,
                choice["text"],
                decode_text,
                decode_token,
                choice["token_ids"],
            )
        if request.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_entries(prompt_scores, request.prompt_logprobs, decode_token)
