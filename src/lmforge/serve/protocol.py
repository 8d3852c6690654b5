"""The OpenAI wire format that ``lmforge serve`` speaks: request models, validation, response bodies.

Requests are pydantic models that forbid unknown fields: a sampling option the server would silently
ignore (``best_of``, ``suffix``, ``reasoning_effort``, ...) would give a trainer samples from a
distribution other than the one it asked for, so it is a 400 that names the field instead. Types are strict: a
string where a number belongs (``"max_tokens": "4"``) is a 400 too, not coerced. What standard clients
send that changes nothing here is accepted and ignored: ``store``, ``metadata``, ``user``,
``service_tier``, ``return_token_ids``; in messages, the fields the openai SDK's ``model_dump()`` of a
reply carries (``refusal``, ``annotations``, ``audio``, null ``function_call``, ``tool_calls[].index``,
``parse()``'s values), never given to the chat template; content as a list of text parts is joined
with newlines (any other part is a 400: the model reads text only).

Supported OpenAI sampling options: ``n``, ``temperature``, ``top_p``, ``max_tokens`` /
``max_completion_tokens``, ``stop``, ``seed``, ``frequency_penalty`` and ``presence_penalty``
(OpenAI's definition, ``scheduler.py``), ``logit_bias``, ``logprobs`` / ``top_logprobs`` (the N most
likely alternatives of the distribution each token was drawn from), ``echo`` (completions; with
``logprobs``, the prompt's logprobs too, and ``max_tokens`` 0 scores the prompt only: ``scoring.py``),
``stream`` with ``stream_options.include_usage`` (server-sent events in OpenAI's chunk
format, ``stream.py``), ``tools`` with ``tool_choice`` "auto" / "none" / "required" / named (``tools.py``),
``response_format`` json_object / json_schema (constrained decoding: ``grammar.py``).

vLLM's sampling extras, top-level fields: ``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``
(``extras.py``: their definitions and order), and for chat ``chat_template_kwargs``,
``add_generation_prompt``, ``continue_final_message``. The returned logprobs (and top alternatives,
less those the truncation removed) are of the distribution each token was drawn from.

Extensions to the OpenAI format, all additive (the ``openai`` client ignores them, or exposes them as
extra attributes): every response carries ``weight_version``; every choice carries ``token_ids``
(the sampled ids, stop token included) and the response ``prompt_token_ids``, so that a trainer
gets exactly the tokens that were scored, without re-tokenising text; completions' ``logprobs`` and
chat's ``logprobs.content`` hold the logprob of each sampled token under the sampling distribution
(see ``rollout/engine.py``). A chat request may carry ``prefix_token_ids``: the conversation's ids
through its last assistant message, to which only the newer messages' tokens are added (``tools.py``).
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..rollout.engine import SamplingParams
from .scheduler import GenerationResult
from .tools import tool_reply


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# apply_chat_template's own arguments: not template variables a request may set in chat_template_kwargs
RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "messages",
    "tools",
    "documents",
    "chat_template",
    "tokenize",
    "add_generation_prompt",
    "continue_final_message",
    "return_dict",
    "return_tensors",
    "padding",
    "truncation",
    "max_length",
    "tokenizer_kwargs",
    "return_assistant_tokens_mask",
}


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with the usage and no choices
    include_obfuscation: bool | None = None  # accepted, ignored: chunks never carry padding here


class _Sampling(_Strict):
    model: str | None = None  # accepted and echoed; the server serves one model
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: Union[str, list[str], None] = Field(default_factory=list)  # validated into a list
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator.manual_seed takes
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(
        default_factory=dict
    )  # token id (as a string, OpenAI's JSON) -> added to its logit
    ignore_eos: bool = False  # vLLM's extension: the model's end-of-sequence ids do not stop a sample
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's sampling extras (extras.py; docs/serving.md): each changes the sampling as vLLM's does
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)  # 1: off
    min_tokens: int = Field(0, ge=0)  # no stop token or stop string ends a sample before this many tokens
    stop_token_ids: list[int] | None = Field(default_factory=list)  # more ids that end a sample (as the EOS)
    skip_special_tokens: bool = True  # false: the text keeps special tokens
    include_stop_str_in_output: bool = False  # the text runs through the stop string instead of before it
    # Accepted and ignored: they change nothing this server returns (docs/serving.md, "Ignored fields")
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    return_token_ids: bool | None = None  # vLLM's switch for what this server always returns

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

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value):
        if any(t < 0 for t in value or []):
            raise ValueError("token ids are >= 0")
        return value or []

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


# Fields marked ``exclude=True`` are what clients echo back from a response (the openai SDK's
# ``model_dump()`` of a message, its accumulated streamed message, ``parse()``'s parsed values):
# accepted, never given to the chat template.
class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's format)
    parsed_arguments: Any = Field(None, exclude=True)  # the openai SDK's parse() result, echoed


class ToolCallPart(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = Field(None, exclude=True)  # a streamed call's position, kept by accumulating clients


ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class ChatMessage(_Strict):
    role: str
    content: Any = None  # a string, a list of text parts (joined, validated below) or None
    name: str | None = None
    tool_calls: list[ToolCallPart] | None = None  # an assistant's calls, sent back in the conversation
    tool_call_id: str | None = None  # a role "tool" message: the call it answers
    refusal: str | None = Field(None, exclude=True)
    annotations: list[Any] | None = Field(None, exclude=True)
    audio: dict[str, Any] | None = Field(None, exclude=True)
    parsed: Any = Field(None, exclude=True)
    function_call: Any = Field(None, exclude=True)  # only null: the legacy form of a call (validated below)

    @field_validator("content")
    @classmethod
    def _text(cls, value):
        """A string as is; a list of ``{"type": "text", "text": ...}`` parts joined with newlines (as
        vLLM does); anything else, or a part that is not text, refused: the model reads text only."""
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(f"content must be a string, a list of text parts or null, got {type(value).__name__}")
        texts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(
                    f"part {i} is {json.dumps(kind) if kind else 'not a content part'}: this model "
                    'reads text only, so content parts must be {"type": "text", "text": ...}'
                )
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise ValueError(f'part {i} must be {{"type": "text", "text": <string>}}, got keys {sorted(part)}')
            texts.append(part["text"])
        return "\n".join(texts)

    @field_validator("role")
    @classmethod
    def _known_role(cls, value):
        """OpenAI's roles; ``developer`` (its newer name for the system message) is rendered as ``system``, which
        is what chat templates know. Anything else is a 400, not a turn the template would render verbatim."""
        if value not in ROLES:
            raise ValueError(f"unknown role {value!r}: send one of {', '.join(sorted(ROLES))}")
        return "system" if value == "developer" else value

    @field_validator("function_call")
    @classmethod
    def _no_legacy_call(cls, value):
        if value is not None:
            raise ValueError("the legacy function_call is not supported: send the call as tool_calls")
        return value

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        return self


TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names


class FunctionSpec(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema, given to the chat template as is
    strict: bool | None = None  # true: calls of this tool follow its parameters, by constrained decoding (grammar.py)

    @field_validator("name")
    @classmethod
    def _name(cls, value):
        if not TOOL_NAME.fullmatch(value):
            raise ValueError(f"function names must match ^[a-zA-Z0-9_-]{{1,64}}$ (OpenAI's rule), got {value!r}")
        return value

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value):
        """An object schema that is valid JSON Schema (checked against its metaschema by ``jsonschema``, part
        of the serve extra; skipped where it is not installed): the model is shown it and calls are parsed
        as objects, so a broken schema is the request's error, not a confused model's."""
        if value is None:
            return value
        if value.get("type", "object") != "object":
            raise ValueError(
                f'a function\'s parameters are an object schema (type "object"), got type {json.dumps(value["type"])}'
            )
        error = _schema_error(json.dumps(value, sort_keys=True))
        if error:
            raise ValueError(error)
        return value


@functools.lru_cache(maxsize=256)
def _schema_error(schema: str) -> str | None:
    """Why the JSON Schema ``schema`` (its JSON text) is invalid, or None. Cached: an agent sends the same
    tools with every call, and the metaschema check took ~3 ms a request here."""
    try:
        import jsonschema
    except ImportError:
        return None
    value = json.loads(schema)
    try:
        jsonschema.validators.validator_for(value).check_schema(value)
    except jsonschema.SchemaError as exc:
        where = "/".join(map(str, exc.absolute_path)) or "the top level"
        return f"not a valid JSON Schema at {where}: {exc.message}"
    return None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


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
            raise ValueError('json_schema is required with type "json_schema", and only with it')
        return self


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
    # vLLM's chat-template extras: more variables for the template (e.g. {"enable_thinking": false}); the
    # assistant turn's opening (off: the template ends after the last message); the last (assistant)
    # message continued rather than closed (then no generation prompt, unless asked for: a 400)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value):
        taken = sorted(set(value or {}) & RESERVED_TEMPLATE_KWARGS)
        if taken:
            raise ValueError(
                f"{taken} are set by the server (send add_generation_prompt, continue_final_message "
                "or tools as request fields)"
            )
        return value or {}

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template gets besides messages and tools (module doc)."""
        opening = self.add_generation_prompt and not (
            self.continue_final_message and "add_generation_prompt" not in self.model_fields_set
        )
        extra = {"continue_final_message": True} if self.continue_final_message else {}
        return {**(self.chat_template_kwargs or {}), "add_generation_prompt": opening, **extra}

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


def stop_ids_of(request: _Sampling, eos_ids: list[int]) -> list[int]:
    """The ids that end a sample of ``request``: the model's end-of-sequence ids (unless ``ignore_eos``)
    and the request's ``stop_token_ids``."""
    return sorted({*([] if request.ignore_eos else eos_ids), *request.stop_token_ids})


def sampling_params(request: _Sampling, max_tokens: int, stop_token_ids: list[int]) -> SamplingParams:
    """The engine's settings for ``request``; ``stop_token_ids``: the model's end-of-sequence ids."""
    return SamplingParams(
        temperature=request.temperature,
        top_k=max(request.top_k, 0),
        top_p=request.top_p,
        max_new_tokens=max_tokens,
        stop_token_ids=stop_ids_of(request, stop_token_ids),
        stop_strings=list(request.stop),
        seed=request.seed,
    )


def cut_at_stop(text: str, stops: list[str], after: int = 0, include: bool = False) -> str:
    """OpenAI returns the text before the first stop string (``include``: through it, vLLM's
    ``include_stop_str_in_output``). Only a stop string that ends past character ``after`` counts
    (``min_tokens``: the text of the first min_tokens tokens cannot stop a sample)."""
    found = [(i, len(s)) for s in stops if (i := text.find(s, max(0, after - len(s) + 1))) >= 0]
    if not found:
        return text
    start, length = min(found)
    return text[: start + length] if include else text[:start]


def reply_text(token_ids: list[int], finish_reason: str, request: _Sampling, decode, stop_ids: list[int] = ()) -> str:
    """A sample's text as returned: the text of a stop id that ended it left out (unless
    ``include_stop_str_in_output``, as vLLM), then cut at the first stop string (``cut_at_stop``)."""
    if finish_reason == "stop" and token_ids and token_ids[-1] in stop_ids and not request.include_stop_str_in_output:
        token_ids = token_ids[:-1]
    after = len(decode(token_ids[: request.min_tokens])) if request.min_tokens and request.stop else 0
    return cut_at_stop(decode(token_ids), request.stop, after, request.include_stop_str_in_output)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def possible(alternatives: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The alternatives the sampling distribution gives a chance: a token that top-k, top-p or min_p
    cut has logprob -inf, which JSON cannot carry, and is left out (so a position may list fewer)."""
    return [(i, lp) for i, lp in alternatives if lp > -math.inf]


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[float],
    top: list[list[tuple[int, float]]],
    request: CompletionRequest,
    decode_token,
) -> dict[str, Any] | None:
    """A completion choice's ``logprobs`` object (None unless the request asked for logprobs)."""
    if request.logprobs is None:
        return None
    return {
        "tokens": [decode_token(t) for t in token_ids],
        "token_logprobs": logprobs,
        "top_logprobs": [{decode_token(i): lp for i, lp in possible(alternatives)} for alternatives in top]
        if request.logprobs
        else None,
        "text_offset": None,
    }


def chat_logprobs(
    token_ids: list[int], logprobs: list[float], top: list[list[tuple[int, float]]], request: ChatRequest, decode_token
) -> dict[str, Any] | None:
    """A chat choice's ``logprobs`` object (None unless the request asked for logprobs)."""
    if not request.logprobs:
        return None
    entry = lambda t, lp: {"token": decode_token(t), "logprob": lp, "bytes": list(decode_token(t).encode())}  # noqa: E731
    alternatives = top if request.top_logprobs else [[] for _ in token_ids]
    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in possible(alt)]}
            for t, lp, alt in zip(token_ids, logprobs, alternatives)
        ]
    }


def completion_body(
    model_name: str,
    prompts: list[list[int]],
    results: list[GenerationResult],
    request: CompletionRequest,
    decode,
    decode_token,
    stop_ids: list[int] = (),
) -> dict[str, Any]:
    """The /v1/completions response for ``results[i]`` = the n samples of ``prompts[i]``; ``stop_ids``
    as ``stop_ids_of`` gives them (``reply_text``)."""
    choices, completion_tokens = [], 0
    for prompt_index, result in enumerate(results):
        echoed = decode(prompts[prompt_index]) if request.echo else ""
        for sample in result.samples:
            completion_tokens += len(sample.token_ids)
            text = reply_text(sample.token_ids, sample.finish_reason, request, decode, stop_ids)
            choice = {
                "index": len(choices),
                "text": echoed + text,
                "finish_reason": sample.finish_reason,
                "token_ids": sample.token_ids,
                "prompt_index": prompt_index,
                "logprobs": completion_logprobs(
                    sample.token_ids, sample.logprobs, sample.top_logprobs, request, decode_token
                ),
            }
            choices.append(choice)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "prompt_token_ids": prompts,
        "usage": usage(sum(map(len, prompts)), completion_tokens),
        "weight_version": results[0].weight_version,
    }


def chat_body(
    model_name: str,
    prompt: list[int],
    result: GenerationResult,
    request: ChatRequest,
    decode,
    decode_token,
    parse_tools: bool = False,
    stop_ids: list[int] = (),
) -> dict[str, Any]:
    """The /v1/chat/completions response for the n samples of one conversation; with ``parse_tools``
    each reply's ``<tool_call>`` blocks become ``tool_calls`` (``tools.tool_reply``)."""
    choices = []
    for sample in result.samples:
        text = reply_text(sample.token_ids, sample.finish_reason, request, decode, stop_ids)
        choice = chat_choice(len(choices), text, sample.finish_reason, parse_tools)
        choice["token_ids"] = sample.token_ids
        choice["logprobs"] = chat_logprobs(
            sample.token_ids, sample.logprobs, sample.top_logprobs, request, decode_token
        )
        choices.append(choice)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "prompt_token_ids": prompt,
        "usage": usage(len(prompt), sum(len(s.token_ids) for s in result.samples)),
        "weight_version": result.weight_version,
    }


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


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
