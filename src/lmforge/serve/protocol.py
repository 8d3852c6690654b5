"""The OpenAI wire format that ``lmforge serve`` speaks: request models, validation, response bodies.

Requests are pydantic models that forbid unknown fields: a sampling option the server would silently
ignore (``best_of``, ``suffix``, ``top_k``, ...) would give a trainer samples from a
distribution other than the one it asked for, so it is a 400 that names the field instead. Types are strict: a
string where a number belongs (``"max_tokens": "4"``) is a 400 too, not coerced.

Supported OpenAI sampling options: ``n``, ``temperature``, ``top_p``, ``max_tokens`` /
``max_completion_tokens``, ``stop``, ``seed``, ``frequency_penalty`` and ``presence_penalty``
(OpenAI's definition, ``scheduler.py``), ``logit_bias``, ``logprobs`` / ``top_logprobs`` (the N most
likely alternatives of the distribution each token was drawn from), ``echo`` (completions; with
``logprobs``, the prompt's logprobs too, and ``max_tokens`` 0 scores the prompt only: ``scoring.py``),
``stream`` with ``stream_options.include_usage`` (server-sent events in OpenAI's chunk
format, ``stream.py``), ``tools`` with ``tool_choice`` "auto" / "none" / "required" / named (``tools.py``),
``response_format`` json_object / json_schema (constrained decoding: ``grammar.py``).

Extensions to the OpenAI format, all additive (the ``openai`` client ignores them, or exposes them as
extra attributes): every response carries ``weight_version``; every choice carries ``token_ids``
(the sampled ids, stop token included) and the response ``prompt_token_ids``, so that a trainer
gets exactly the tokens that were scored, without re-tokenising text; completions' ``logprobs`` and
chat's ``logprobs.content`` hold the logprob of each sampled token under the sampling distribution
(see ``rollout/engine.py``). A chat request may carry ``prefix_token_ids``: the conversation's ids
through its last assistant message, to which only the newer messages' tokens are added (``tools.py``).
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..rollout.engine import SamplingParams
from .scheduler import GenerationResult
from .tools import tool_reply


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with the usage and no choices


class _Sampling(_Strict):
    model: str | None = None  # accepted and echoed; the server serves one model
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: Union[str, list[str], None] = Field(default_factory=list)  # validated into a list
    seed: int | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default_factory=dict)  # token id (as a string, OpenAI's JSON) -> added to its logit
    ignore_eos: bool = False  # vLLM's extension: decode max_tokens tokens (benchmarks, fixed-length tests)
    stream: bool = False
    stream_options: StreamOptions | None = None
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

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value):
        if not value:
            return {}
        bias = {}
        for key, amount in value.items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids (as strings), got {key!r}")
            if not -100 <= amount <= 100:
                raise ValueError(f"biases must be in [-100, 100] (OpenAI's range), got {amount} for token {key}")
            bias[int(key)] = float(amount)
        return bias

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(None, ge=0, le=20)  # the sampled tokens' logprobs and N alternatives each
    echo: bool = False  # the prompt's text before the completion's; with logprobs, the prompt's logprobs too
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: score the prompt, generate nothing
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's extension (scoring.py)

    @property
    def top_logprobs(self) -> int:
        return self.logprobs or 0

    @property
    def scores_prompt(self) -> bool:
        """Whether the prompt's own logprobs are asked for (scoring.py)."""
        return self.prompt_logprobs is not None or (self.echo and self.logprobs is not None)


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's format)


class ToolCallPart(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: str
    content: str | None = None  # None: an assistant message that only calls tools
    name: str | None = None
    tool_calls: list[ToolCallPart] | None = None  # an assistant's calls, sent back in the conversation
    tool_call_id: str | None = None  # a role "tool" message: the call it answers

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        return self


class FunctionSpec(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema, given to the chat template as is
    strict: bool | None = None  # true: calls of this tool follow its parameters, by constrained decoding (grammar.py)


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)  # needs logprobs=true (as OpenAI)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None  # "auto", "none", "required" or a named function (tools.py)
    parallel_tool_calls: bool | None = None  # true (OpenAI's default); false: at most one call, by a grammar
    response_format: ResponseFormat | None = None  # a JSON reply by constrained decoding (grammar.py)
    prefix_token_ids: list[int] | None = None  # extension: the conversation's ids through its last reply
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's extension: the rendered prompt's (scoring.py)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value, info):
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return value


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


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(token_ids: list[int], logprobs: list[float], top: list[list[tuple[int, float]]],
                        request: CompletionRequest, decode_token) -> dict[str, Any] | None:
    """A completion choice's ``logprobs`` object (None unless the request asked for logprobs)."""
    if request.logprobs is None:
        return None
    return {"tokens": [decode_token(t) for t in token_ids], "token_logprobs": logprobs,
            "top_logprobs": [{decode_token(i): lp for i, lp in alternatives} for alternatives in top]
            if request.logprobs else None, "text_offset": None}


def chat_logprobs(token_ids: list[int], logprobs: list[float], top: list[list[tuple[int, float]]],
                  request: ChatRequest, decode_token) -> dict[str, Any] | None:
    """A chat choice's ``logprobs`` object (None unless the request asked for logprobs)."""
    if not request.logprobs:
        return None
class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON
    strict: bool | None = None  # the reply follows the schema either way (grammar.py)


class ResponseFormat(_Strict):
    """``response_format``: "text" (nothing), "json_object" (any JSON object), "json_schema" (grammar.py)."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type \"json_schema\", and only with it")
        return self


    entry = lambda t, lp: {"token": decode_token(t), "logprob": lp, "bytes": list(decode_token(t).encode())}  # noqa: E731
    alternatives = top if request.top_logprobs else [[] for _ in token_ids]
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in alt]}
                        for t, lp, alt in zip(token_ids, logprobs, alternatives)]}


def completion_body(model_name: str, prompts: list[list[int]], results: list[GenerationResult],
                    request: CompletionRequest, decode, decode_token) -> dict[str, Any]:
    """The /v1/completions response for ``results[i]`` = the n samples of ``prompts[i]``."""
    choices, completion_tokens = [], 0
    for prompt_index, result in enumerate(results):
        echoed = decode(prompts[prompt_index]) if request.echo else ""
        for sample in result.samples:
            completion_tokens += len(sample.token_ids)
            choice = {"index": len(choices), "text": echoed + cut_at_stop(decode(sample.token_ids), request.stop),
                      "finish_reason": sample.finish_reason, "token_ids": sample.token_ids,
                      "prompt_index": prompt_index,
                      "logprobs": completion_logprobs(sample.token_ids, sample.logprobs, sample.top_logprobs,
                                                      request, decode_token)}
            choices.append(choice)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model_name, "choices": choices, "prompt_token_ids": prompts,
            "usage": usage(sum(map(len, prompts)), completion_tokens),
            "weight_version": results[0].weight_version}


def chat_body(model_name: str, prompt: list[int], result: GenerationResult, request: ChatRequest,
              decode, decode_token, parse_tools: bool = False) -> dict[str, Any]:
    """The /v1/chat/completions response for the n samples of one conversation; with ``parse_tools``
    each reply's ``<tool_call>`` blocks become ``tool_calls`` (``tools.tool_reply``)."""
    choices = []
    for sample in result.samples:
        choice = chat_choice(len(choices), cut_at_stop(decode(sample.token_ids), request.stop),
                             sample.finish_reason, parse_tools)
        choice["token_ids"] = sample.token_ids
        choice["logprobs"] = chat_logprobs(sample.token_ids, sample.logprobs, sample.top_logprobs, request,
                                           decode_token)
        choices.append(choice)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model_name, "choices": choices, "prompt_token_ids": prompt,
            "usage": usage(len(prompt), sum(len(s.token_ids) for s in result.samples)),
            "weight_version": result.weight_version}


def chat_choice(index: int, text: str, finish_reason: str, parse_tools: bool) -> dict[str, Any]:
    """A chat choice's ``index``, ``message`` and ``finish_reason`` (and ``tool_call_errors``, an
    extension, when a reply's tool call was malformed)."""
    if not parse_tools:
        return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
    message, finish_reason, errors = tool_reply(text, finish_reason)
    choice = {"index": index, "message": message, "finish_reason": finish_reason}
    if errors:
        choice["tool_call_errors"] = errors
    return choice


class RequestError(ValueError):
    """A request the server refuses with 400; ``param`` names the offending field (app.py's handler
    writes it as ``error_body``). Defined here, below every route module, so that each can raise it."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
