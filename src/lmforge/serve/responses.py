"""The Responses API's core: ``POST /v1/responses`` and ``GET /v1/responses/{id}`` (docs/serving.md, "Responses").

A Responses request is turned into the chat request it stands for (``protocol.ChatRequest``: input items
become messages, ``instructions`` a first system message, Responses function tools chat tools,
``max_output_tokens`` ``max_completion_tokens``) and run through the chat route's own path
(``app.chat_completion``, handed in by ``build_app``, so that this module does not import ``app.py``), so
the chat template, tool parsing, structured outputs, sampling options and every check of
``/v1/chat/completions`` hold here too; the chat result is then written as a Responses object: an
``output`` of a ``message`` item (``output_text``) and/or ``function_call`` items, ``usage`` in
input/output tokens, ``status`` ("incomplete" when ``max_output_tokens`` cut the reply), and lmforge's
extensions (``weight_version``, ``prompt_token_ids``, ``token_ids``). A chat error's ``param`` is renamed
to the Responses field it came from (``messages`` -> ``input``, ``tools.0.function.strict`` -> ``tools.0.strict``).

Streaming turns the chat route's chunks into Responses events, each with its ``sequence_number``:
``response.created``, ``response.in_progress``, then per output item ``response.output_item.added``,
``response.content_part.added`` / ``response.output_text.delta`` (per token) / ``response.output_text.done`` /
``response.content_part.done``, or ``response.function_call_arguments.delta`` / ``.done``, then
``response.output_item.done``; last ``response.completed`` (or ``response.incomplete``) with the whole
response. As in the chat stream, a reply with tools is parsed at its end, so its text and calls arrive then.

State: the last ``STORE_SIZE`` responses with ``store`` true (the default) are kept in this server's memory,
with the conversation they ended, for ``previous_response_id`` and ``GET /v1/responses/{id}``; nothing is
written to disk and a restart forgets them.
"""

from __future__ import annotations

import collections
import json
import time
import uuid
from typing import Any, AsyncIterator, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .protocol import ChatRequest, RequestError

STORE_SIZE = 256  # responses kept per server for previous_response_id
LOGPROBS = "message.output_text.logprobs"
# include values about output items this server never produces (web search, files, images, reasoning):
# accepted, and they change nothing
INCLUDE_IGNORED = {
    "reasoning.encrypted_content",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
}
# Responses fields this server cannot honour, and why
UNSUPPORTED = {
    "conversation": "server-side conversations are not kept; send the items in input, or previous_response_id",
    "prompt": "stored prompt templates are not kept; send instructions and input",
    "max_tool_calls": "the number of tool calls is not limited; leave max_tool_calls out",
    "context_management": "the context is not compacted; leave context_management out",
}
# Chat Completions spellings: the Responses field to use instead
CHAT_ONLY = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "logprobs": f"include: ['{LOGPROBS}']",
    "n": None,
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _text_parts(value):
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


class _TextPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None  # an output_text sent back: ignored
    logprobs: list | None = None


class _Message(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[_TextPart]  # a string is one input_text part
    id: str | None = None  # the fields of an output message sent back: ignored
    status: str | None = None
    phase: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value):
        return _text_parts(value)


class _FunctionCall(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str  # a JSON object, as a string
    id: str | None = None
    status: str | None = None


class _FunctionCallOutput(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: list[_TextPart]  # a string is one input_text part
    id: str | None = None
    status: str | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _parts(cls, value):
        return _text_parts(value)


ITEMS = {"message": _Message, "function_call": _FunctionCall, "function_call_output": _FunctionCallOutput}


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None  # accepted: nothing is obfuscated


class ResponsesRequest(BaseModel):
    """A ``POST /v1/responses`` body. Fields it does not declare are chat sampling options (``seed``,
    ``stop``, vLLM's extras, ...): they go to the ChatRequest, which refuses what it does not know."""

    model_config = ConfigDict(extra="allow", strict=True)

    input: Any  # a string, or a list of items (checked by input_messages)
    model: str | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)  # with include: ["message.output_text.logprobs"]
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    include: list[str] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None  # echoed
    user: str | None = None  # hints that change nothing here: accepted
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None

    @field_validator("input")
    @classmethod
    def _input(cls, value):
        if isinstance(value, str) or (isinstance(value, list) and all(isinstance(i, dict) for i in value)):
            return value
        raise ValueError("input must be a string or a list of items (JSON objects)")


def _validated(model: type[BaseModel], value: Any, param: str) -> BaseModel:
    """``model`` validated from ``value``; an error is a 400 naming ``param`` + the field."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join([param, *(str(p) for p in first["loc"])])
        if first["type"] == "extra_forbidden":
            raise RequestError(f"unknown or unsupported field '{where}'", param=where) from exc
        raise RequestError(f"{where}: {first['msg']}", param=where) from exc


def input_messages(items: str | list[dict], call_ids: set[str], param: str = "input") -> list[dict]:
    """Chat messages of Responses input ``items``. A ``function_call`` joins the assistant message before it
    (one reply: text, then calls); a ``function_call_output`` must answer a call in ``call_ids`` or
    earlier in ``items`` (``call_ids`` gets the calls added)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, raw in enumerate(items):
        kind = raw.get("type", "message")
        if kind not in ITEMS:
            raise RequestError(
                f"input item type {kind!r} is not supported: send message, function_call and "
                "function_call_output items",
                param=f"{param}.{i}.type",
            )
        item = _validated(ITEMS[kind], raw, f"{param}.{i}")
        if isinstance(item, _Message):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": "\n".join(p.text for p in item.content)})
        elif isinstance(item, _FunctionCall):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            call_ids.add(item.call_id)
        else:
            if item.call_id not in call_ids:
                raise RequestError(
                    f"no function_call with call_id {item.call_id!r} precedes this output", param=f"{param}.{i}.call_id"
                )
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": "\n".join(p.text for p in item.output)}
            )
    return messages


def _tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice  # "auto", "none", "required": the chat path checks them
    if choice.get("type") == "function" and set(choice) == {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError(
        f'tool_choice {json.dumps(choice)} is not supported: send "auto", "none", "required" '
        'or {"type": "function", "name": ...}',
        param="tool_choice",
    )


def _text_format(text: dict | None) -> dict | None:
    """The chat ``response_format`` of Responses ``text`` (None: plain text)."""
    text = dict(text or {})
    if text.pop("verbosity", None) not in (None, "medium"):
        raise RequestError(
            'text.verbosity other than "medium" is not supported: the model is not steered to a length; leave it out',
            param="text.verbosity",
        )
    fmt = text.pop("format", None)
    if text:
        raise RequestError(f"unknown or unsupported field 'text.{next(iter(text))}'", param=f"text.{next(iter(text))}")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt  # json_object, or what the chat request refuses
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def _check_unsupported(body: ResponsesRequest) -> None:
    """A 400 for a field this server cannot honour (docs/serving.md lists them)."""
    for name, why in UNSUPPORTED.items():
        if (body.model_extra or {}).get(name) is not None:
            raise RequestError(f"{name} is not supported: {why}", param=name)
    for name, instead in CHAT_ONLY.items():
        if name in (body.model_extra or {}):
            hint = f"; the Responses API's is {instead}" if instead else ""
            raise RequestError(f"'{name}' is a Chat Completions field{hint}", param=name)
    if body.background:
        raise RequestError("background responses are not supported; leave background out or false", param="background")
    if body.truncation == "auto":
        raise RequestError(
            'truncation "auto" (dropping input items to fit the context) is not supported: an '
            'input over the context length is a 400; leave truncation out or "disabled"',
            param="truncation",
        )
    for key, value in (body.reasoning or {}).items():
        if value is not None and not (key == "effort" and value == "none"):
            raise RequestError(
                f"reasoning.{key} is not supported: the model is not a reasoning model here; leave reasoning out",
                param=f"reasoning.{key}",
            )
    for i, name in enumerate(body.include or []):
        if name != LOGPROBS and name not in INCLUDE_IGNORED:
            raise RequestError(f"include value {name!r} is not known", param=f"include.{i}")


def chat_request(body: ResponsesRequest, messages: list[dict]) -> ChatRequest:
    """The ChatRequest that ``body`` stands for, over ``messages`` (instructions and history included)."""
    _check_unsupported(body)
    logprobs = LOGPROBS in (body.include or [])
    fields: dict[str, Any] = {
        **(body.model_extra or {}),
        "model": body.model,
        "messages": messages,
        "stream": body.stream,
        "stream_options": {"include_usage": True} if body.stream else None,
        "max_completion_tokens": body.max_output_tokens,
        "user": body.user,
        "tools": [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in body.tools
        ]
        if body.tools
        else None,
        "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "logprobs": logprobs,
        "top_logprobs": body.top_logprobs if logprobs else None,
        "response_format": _text_format(body.text),
    }
    if body.temperature is not None:
        fields["temperature"] = body.temperature
    if body.top_p is not None:
        fields["top_p"] = body.top_p
    try:
        return ChatRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        param = responses_param(".".join(str(p) for p in first["loc"]))
        if first["type"] == "extra_forbidden":
            raise RequestError(f"unknown or unsupported field '{param}'", param=param) from exc
        raise RequestError(f"{param}: {first['msg']}", param=param) from exc


def responses_param(param: str | None) -> str | None:
    """The Responses field a chat request's field came from."""
    if not param:
        return param
    head = param.partition(".")[0]
    if head in ("messages", "prompt"):
        return "input"
    if head in ("max_tokens", "max_completion_tokens"):
        return "max_output_tokens"
    if head == "response_format":  # json_schema's fields sit in text.format itself
        return "text.format" + param[len("response_format") :].replace(".json_schema", "", 1)
    if head == "tools":
        return param.replace(".function.", ".", 1)
    return param


def message_item(text: str, finish_reason: str, logprobs: list | None) -> dict:
    """A ``message`` output item holding one ``output_text``."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "status": "incomplete" if finish_reason == "length" else "completed",
        "content": [part],
    }


def call_items(calls: list[dict]) -> list[dict]:
    """``function_call`` output items of chat ``tool_calls`` (the chat call's id is the ``call_id``)."""
    return [
        {
            "id": f"fc_{uuid.uuid4().hex}",
            "type": "function_call",
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
            "status": "completed",
        }
        for call in calls
    ]


def output_items(message: dict, finish_reason: str, logprobs: list | None) -> list[dict]:
    """Responses output items of a chat reply ``message``: its text as a ``message`` (when there is
    text, or no call), then one ``function_call`` per tool call."""
    calls = message.get("tool_calls") or []
    text = [message_item(message["content"] or "", finish_reason, logprobs)] if message["content"] or not calls else []
    return [*text, *call_items(calls)]


def response_shell(body: ResponsesRequest, model_name: str) -> dict[str, Any]:
    """The Responses object of ``body`` before its output: status in_progress, the request's settings."""
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "metadata": body.metadata or {},
        "model": model_name,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "tool_choice": body.tool_choice or "auto",
        "tools": [t.model_dump() for t in body.tools or []],
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "text": {"format": {"type": "text"}, **(body.text or {})},
        "truncation": "disabled",
        "reasoning": {"effort": None, "summary": None},
        "background": False,
        "user": body.user,
        "usage": None,
    }


def finish(response: dict, output: list[dict], finish_reason: str, usage: dict | None, extras: dict) -> dict:
    """``response`` (a shell) completed with its ``output``, ``usage`` (chat's) and lmforge's ``extras``."""
    incomplete = finish_reason == "length"
    response.update(
        status="incomplete" if incomplete else "completed",
        output=output,
        incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
        **extras,
    )
    if usage is not None:
        response["usage"] = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        }
    return response


class ResponseStore:
    """The last ``size`` stored responses of one server, each with the conversation it ended (chat
    messages, without the instructions: as OpenAI, a follow-up's instructions replace them)."""

    def __init__(self, size: int = STORE_SIZE):
        self.size, self.entries = size, collections.OrderedDict()

    def keep(self, response: dict, messages: list[dict]) -> None:
        call_ids: set[str] = set()
        self.entries[response["id"]] = (response, [*messages, *input_messages(response["output"], call_ids)])
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        return self.entries.get(response_id)


def _event(kind: str, seq: int, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **fields})}\n\n"


class EventStream:
    """Responses events from the chat route's stream of chunks (module doc)."""

    def __init__(self, response: dict, with_logprobs: bool):
        self.response, self.with_logprobs = response, with_logprobs
        self.seq, self.text, self.message, self.output = 0, "", None, []
        self.token_ids: list[int] = []
        self.logprobs: list[dict] = []
        self.calls: list[dict] = []
        self.finish_reason, self.usage, self.version, self.errors = "stop", None, 0, None

    def event(self, kind: str, **fields) -> str:
        self.seq += 1
        return _event(kind, self.seq - 1, **fields)

    def open_message(self) -> list[str]:
        self.message = {**message_item("", "stop", None), "status": "in_progress", "content": []}
        self.output.append(self.message)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self.event("response.output_item.added", output_index=len(self.output) - 1, item=self.message),
            self.event(
                "response.content_part.added",
                item_id=self.message["id"],
                output_index=len(self.output) - 1,
                content_index=0,
                part=part,
            ),
        ]

    def chunk(self, chunk: dict) -> list[str]:
        """The events of one chat chunk."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        self.version = chunk.get("weight_version", self.version)
        events = []
        for choice in chunk.get("choices", []):
            self.token_ids += choice.get("token_ids", [])
            token_logprobs = (choice.get("logprobs") or {}).get("content") or []
            self.logprobs += token_logprobs
            delta = choice.get("delta") or {}
            self.calls += delta.get("tool_calls") or []
            self.errors = choice.get("tool_call_errors", self.errors)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            if delta.get("content"):
                if self.message is None:
                    events += self.open_message()
                self.text += delta["content"]
                events.append(
                    self.event(
                        "response.output_text.delta",
                        item_id=self.message["id"],
                        output_index=len(self.output) - 1,
                        content_index=0,
                        delta=delta["content"],
                        logprobs=token_logprobs if self.with_logprobs else [],
                    )
                )
        return events

    def close(self) -> list[str]:
        """The events after the last chunk: the items closed, the calls, the whole response."""
        events = self.open_message() if self.message is None and not self.calls else []
        if self.message is not None:
            index, item_id = self.output.index(self.message), self.message["id"]
            logprobs = self.logprobs if self.with_logprobs else []
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": logprobs}
            self.message.update(content=[part], status="incomplete" if self.finish_reason == "length" else "completed")
            events += [
                self.event(
                    "response.output_text.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=self.text,
                    logprobs=logprobs,
                ),
                self.event(
                    "response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part
                ),
                self.event("response.output_item.done", output_index=index, item=self.message),
            ]
        for item in call_items(self.calls):
            self.output.append(item)
            index, added = len(self.output) - 1, {**item, "arguments": "", "status": "in_progress"}
            events += [
                self.event("response.output_item.added", output_index=index, item=added),
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=item["arguments"],
                ),
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                ),
                self.event("response.output_item.done", output_index=index, item=item),
            ]
        extras = {"weight_version": self.version, "token_ids": self.token_ids}
        if self.with_logprobs:
            extras["logprobs"] = self.logprobs
        if self.errors:
            extras["tool_call_errors"] = self.errors
        finish(self.response, self.output, self.finish_reason, self.usage, extras)
        kind = "response.incomplete" if self.response["status"] == "incomplete" else "response.completed"
        return [*events, self.event(kind, response=self.response)]


async def stream_events(chunks: AsyncIterator[str], stream: EventStream, on_done) -> AsyncIterator[str]:
    """Server-sent Responses events from the chat route's SSE ``chunks``; ``on_done(response)`` at the end.
    Closing this generator (the client left) closes ``chunks``, which cancels the generation."""
    try:
        yield stream.event("response.created", response=stream.response)
        yield stream.event("response.in_progress", response=stream.response)
        async for line in chunks:
            payload = line.removeprefix("data: ").strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:  # the generation failed mid-stream
                error = chunk["error"]
                stream.response.update(status="failed", error={"code": "server_error", "message": error["message"]})
                yield stream.event("error", code="server_error", message=error["message"], param=None)
                yield stream.event("response.failed", response=stream.response)
                return
            for event in stream.chunk(chunk):
                yield event
        for event in stream.close():
            yield event
        on_done(stream.response)
    finally:
        await chunks.aclose()


def add_responses_routes(app, served, chat_completion) -> None:
    """``POST /v1/responses`` and ``GET /v1/responses/{id}`` on ``served`` (app.ServedModel), running each
    request through ``chat_completion(served, chat_request)`` (app.py's chat path; module doc)."""
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    store = ResponseStore()

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest):
        history: list[dict] = []
        if body.previous_response_id is not None:
            stored = store.get(body.previous_response_id)
            if stored is None:
                raise RequestError(
                    f"previous response {body.previous_response_id!r} is not stored here (this "
                    f"server keeps its last {store.size} responses with store true, in memory)",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            history = stored[1]
        call_ids = {c["id"] for m in history for c in m.get("tool_calls") or []}
        messages = input_messages(body.input, call_ids)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        chat = chat_request(body, [*system, *history, *messages])
        try:
            reply = await chat_completion(served, chat)
        except RequestError as exc:
            raise RequestError(str(exc), param=responses_param(exc.param), code=exc.code) from exc

        def keep(response: dict) -> None:
            if body.store:
                store.keep(response, [*history, *messages])

        response = response_shell(body, served.name)
        if body.stream:
            events = stream_events(reply.body_iterator, EventStream(response, chat.logprobs), keep)
            return StreamingResponse(events, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        choice = reply["choices"][0]
        logprobs = (choice.get("logprobs") or {}).get("content")
        extras = {
            "weight_version": reply["weight_version"],
            "prompt_token_ids": reply["prompt_token_ids"],
            "token_ids": choice["token_ids"],
        }
        if logprobs is not None:
            extras["logprobs"] = logprobs
        if choice.get("tool_call_errors"):
            extras["tool_call_errors"] = choice["tool_call_errors"]
        output = output_items(choice["message"], choice["finish_reason"], logprobs)
        keep(finish(response, output, choice["finish_reason"], reply["usage"], extras))
        return JSONResponse(response, headers={"x-weight-version": str(reply["weight_version"])})

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        stored = store.get(response_id)
        if stored is None:
            raise HTTPException(404, f"response {response_id!r} is not stored here")
        return stored[0]
