"""The OpenAI wire format that ``lmforge serve`` speaks: request models, validation, response bodies.

Requests are pydantic models that forbid unknown fields: a sampling option the server would silently
ignore (``presence_penalty``, ``logit_bias``, ...) would give a trainer samples from a distribution
other than the one it asked for, so it is a 400 that names the field instead.

Extensions to the OpenAI format, all additive (the ``openai`` client ignores them, or exposes them as
extra attributes): every response carries ``weight_version``; every choice carries ``token_ids``
(the sampled ids, stop token included) and the response ``prompt_token_ids``, so that a trainer
gets exactly the tokens that were scored, without re-tokenising text; completions' ``logprobs`` and
chat's ``logprobs.content`` hold the logprob of each sampled token under the sampling distribution
(see ``rollout/engine.py``). ``top_logprobs`` are not computed and are returned empty.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..rollout.engine import SamplingParams
from .scheduler import GenerationResult


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Sampling(_Strict):
    model: str | None = None  # accepted and echoed; the server serves one model
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: Union[str, list[str], None] = Field(default_factory=list)  # validated into a list
    seed: int | None = None
    ignore_eos: bool = False  # vLLM's extension: decode max_tokens tokens (benchmarks, fixed-length tests)
    stream: bool = False
    user: str | None = None  # accepted (clients send it), unused

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop strings (OpenAI's limit), got {len(stops)}")
        return stops

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, value):
        if value:
            raise ValueError("streaming is not supported by lmforge serve; send stream=false")
        return value


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(None, ge=0, le=20)  # any value returns the sampled tokens' logprobs
    echo: Literal[False] = False


class ChatMessage(_Strict):
    role: str
    content: str
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)


def prompts_of(request: CompletionRequest, encode) -> list[list[int]]:
    """The prompt(s) of a completion request as token id lists (text goes through ``encode``)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [encode(prompt)]
    if not prompt:
        raise ValueError("prompt is empty")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [encode(p) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]
    raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of id lists")


def sampling_params(request: _Sampling, max_tokens: int, stop_token_ids: list[int]) -> SamplingParams:
    stop_token_ids = [] if request.ignore_eos else list(stop_token_ids)
    return SamplingParams(temperature=request.temperature, top_p=request.top_p, max_new_tokens=max_tokens,
                          stop_token_ids=stop_token_ids, stop_strings=list(request.stop), seed=request.seed)


def cut_at_stop(text: str, stops: list[str]) -> str:
    """OpenAI returns the text before the first stop string (the stop string itself is not included)."""
    cuts = [text.find(s) for s in stops if s in text]
    return text[:min(cuts)] if cuts else text


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(model_name: str, prompts: list[list[int]], results: list[GenerationResult],
                    request: CompletionRequest, decode, decode_token) -> dict[str, Any]:
    """The /v1/completions response for ``results[i]`` = the n samples of ``prompts[i]``."""
    choices, completion_tokens = [], 0
    for prompt_index, result in enumerate(results):
        for sample in result.samples:
            completion_tokens += len(sample.token_ids)
            choice = {"index": len(choices), "text": cut_at_stop(decode(sample.token_ids), request.stop),
                      "finish_reason": sample.finish_reason, "token_ids": sample.token_ids,
                      "prompt_index": prompt_index, "logprobs": None}
            if request.logprobs is not None:
                choice["logprobs"] = {"tokens": [decode_token(t) for t in sample.token_ids],
                                      "token_logprobs": sample.logprobs, "top_logprobs": None,
                                      "text_offset": None}
            choices.append(choice)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model_name, "choices": choices, "prompt_token_ids": prompts,
            "usage": _usage(sum(map(len, prompts)), completion_tokens),
            "weight_version": results[0].weight_version}


def chat_body(model_name: str, prompt: list[int], result: GenerationResult, request: ChatRequest,
              decode, decode_token) -> dict[str, Any]:
    """The /v1/chat/completions response for the n samples of one conversation."""
    choices = []
    for sample in result.samples:
        choice = {"index": len(choices), "finish_reason": sample.finish_reason, "token_ids": sample.token_ids,
                  "message": {"role": "assistant", "content": cut_at_stop(decode(sample.token_ids), request.stop)},
                  "logprobs": None}
        if request.logprobs:
            choice["logprobs"] = {"content": [
                {"token": decode_token(t), "logprob": lp, "bytes": list(decode_token(t).encode()), "top_logprobs": []}
                for t, lp in zip(sample.token_ids, sample.logprobs)]}
        choices.append(choice)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model_name, "choices": choices, "prompt_token_ids": prompt,
            "usage": _usage(len(prompt), sum(len(s.token_ids) for s in result.samples)),
            "weight_version": result.weight_version}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
