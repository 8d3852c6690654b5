"""Streaming (``"stream": true``): server-sent events in OpenAI's chunk format, one chunk per sampled
token, sent as the continuous batch decodes it.

The scheduler thread calls each request's ``on_token`` after every token (``scheduler.py``); the
callback hands the event to the request's asyncio queue, and :func:`sse_events` turns events into
``data: {...}`` lines: a ``text_completion`` chunk (completions) or a ``chat.completion.chunk`` (chat,
whose first chunk per choice carries ``delta.role``), then, with ``stream_options.include_usage``, a
chunk with the usage and no choices, then ``data: [DONE]``. Each chunk carries lmforge's extensions
too: the token's id (``token_ids``) and ``weight_version``.

Text. A choice's text is decoded from all its tokens so far and the new part sent. Held back: a
character still incomplete in UTF-8 (a multi-byte character split over tokens), and, when the
request has stop strings, the last ``len(longest stop) - 1`` characters, which may yet start a stop
string; the text the client ends with is the non-streamed response's (cut before the stop string).

Tools (chat with ``tools`` and ``tool_choice`` "auto"). Whether a reply is text or tool calls is known
only at its end, so each token's chunk carries its id and logprob with an empty delta, and the choice's
last chunk carries the whole reply as the non-streamed response has it: ``delta.content`` and/or
``delta.tool_calls`` (each with its ``index``), ``finish_reason: "tool_calls"``.

A client that disconnects closes the generator: its requests are cancelled and their rows leave the
batch at the next step. A generation failure mid-stream ends the stream with an ``error`` event.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from .protocol import chat_choice, chat_logprobs, completion_logprobs, reply_text, usage
from .scheduler import GenerationRequest


class ChoiceText:
    """Incremental text of one streamed choice (module doc); ``body`` and ``stop_ids`` as
    ``protocol.reply_text`` takes them."""

    def __init__(self, decode: Callable[[list[int]], str], body, stop_ids: list[int] = ()):
        self.decode, self.body, self.stop_ids = decode, body, stop_ids
        self.hold = max(map(len, body.stop)) - 1 if body.stop else 0
        self.tokens: list[int] = []
        self.sent = 0  # characters of the text sent so far

    def final(self, finish: str) -> str:
        """The whole text, as the non-streamed response has it."""
        return reply_text(self.tokens, finish, self.body, self.decode, self.stop_ids)

    def push(self, token: int, finish: str | None) -> str:
        """Add ``token`` (the last of the choice when ``finish`` is set); the text to send now."""
        self.tokens.append(token)
        text = self.decode(self.tokens)
        if finish is not None:
            final = self.final(finish)
            delta, self.sent = final[self.sent :], max(self.sent, len(final))
            return delta
        safe = len(text) - self.hold
        if text.endswith("\ufffd"):  # a character whose remaining bytes come with the next token
            safe = min(safe, len(text.rstrip("\ufffd")))
        if safe <= self.sent:
            return ""
        delta, self.sent = text[self.sent : safe], safe
        return delta


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def tool_delta(index: int, text: ChoiceText, finish: str) -> dict[str, Any]:
    """A tools choice's last chunk piece: the whole reply as ``delta`` (module doc), and its finish."""
    choice = chat_choice(index, text.final(finish), finish, parse_tools=True)
    message = choice.pop("message")
    delta = {"content": message["content"]}
    if "tool_calls" in message:
        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
    return {"delta": delta, **{k: v for k, v in choice.items() if k != "index"}}


def _error_chunk(error: BaseException) -> dict:
    """The stream's last event when generation failed after the stream began (its status is already 200)."""
    message = f"generation failed: {type(error).__name__}: {error}"
    return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}


def _token_piece(
    chat: bool, parse_tools: bool, index: int, text: ChoiceText, sampled: tuple, body, decode_token: Callable
) -> tuple[dict, str | None]:
    """One sampled token's choice fields and its finish reason (a tool call parsed at the end may change it):
    ``sampled`` = (token, logprob, top alternatives, finish); ``text`` is the choice's text so far."""
    token, logprob, top, finish = sampled
    delta = text.push(token, finish)
    if not chat:
        return {"text": delta, "logprobs": completion_logprobs([token], [logprob], [top], body, decode_token)}, finish
    piece = {
        "delta": {"content": "" if parse_tools else delta},
        "logprobs": chat_logprobs([token], [logprob], [top], body, decode_token),
    }
    if parse_tools and finish is not None:
        piece.update(tool_delta(index, text, finish))
        finish = piece.pop("finish_reason")
    return piece, finish


async def sse_events(
    kind: str,
    model_name: str,
    requests: list[GenerationRequest],
    body,
    prompts: list[list[int]],
    decode: Callable,
    decode_token: Callable,
    queue: asyncio.Queue,
    parse_tools: bool = False,
    stop_ids: list[int] = (),
) -> AsyncIterator[str]:
    """The event stream of ``requests`` (one per prompt, each with ``body.n`` samples), whose
    ``on_token`` callbacks feed ``queue`` with ``(prompt, sample, token, logprob, top, finish, version)``
    and whose futures add ``("done", prompt, future)`` when they end. ``parse_tools``: chat replies
    are parsed for tool calls (module doc); ``stop_ids`` as ``protocol.reply_text`` takes them."""
    chat = kind == "chat"
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    n = body.n
    texts = {(p, i): ChoiceText(decode, body, stop_ids) for p in range(len(requests)) for i in range(n)}
    open_choices, completion_tokens, finished_requests = set(texts), 0, 0

    def head() -> dict:
        kind_name = "chat.completion.chunk" if chat else "text_completion"
        return {"id": ident, "object": kind_name, "created": created, "model": model_name}

    def chunk(index: int, piece: dict, finish: str | None, token: int | None, version: int) -> dict:
        choice = {"index": index, **piece, "finish_reason": finish}
        if token is not None:
            choice["token_ids"] = [token]
        return {**head(), "choices": [choice], "weight_version": version}

    try:
        if chat:
            for p, i in texts:  # OpenAI opens each choice with its role
                yield _sse(
                    chunk(p * n + i, {"delta": {"role": "assistant", "content": ""}, "logprobs": None}, None, None, 0)
                )
        elif body.echo:
            for p, i in texts:
                yield _sse(chunk(p * n + i, {"text": decode(prompts[p]), "logprobs": None}, None, None, 0))
        version = 0
        while open_choices or finished_requests < len(requests):
            event = await queue.get()
            if event[0] == "done":
                _, p, future = event
                finished_requests += 1
                if not future.cancelled() and future.exception() is not None:
                    yield _sse(_error_chunk(future.exception()))
                    return
                continue
            p, i, token, logprob, top, finish, version = event
            completion_tokens += 1
            sampled = (token, logprob, top, finish)
            piece, finish = _token_piece(chat, parse_tools, p * n + i, texts[(p, i)], sampled, body, decode_token)
            yield _sse(chunk(p * n + i, piece, finish, token, version))
            if finish is not None:
                open_choices.discard((p, i))
        if body.include_usage:
            yield _sse(
                {
                    **head(),
                    "choices": [],
                    "weight_version": version,
                    "usage": usage(sum(map(len, prompts)), completion_tokens),
                }
            )
        yield _sse("[DONE]")
    finally:  # the client left (or the stream ended): free whatever still runs
        for request in requests:
            if not request.future.done():
                request.cancel()


def feed(queue: asyncio.Queue, loop: asyncio.AbstractEventLoop, prompt_index: int, scheduler) -> tuple:
    """(on_token callback, future done-callback) that put a prompt's events on ``queue`` from the
    scheduler thread."""

    def on_token(sample: int, token: int, logprob: float, top: list, finish: str | None) -> None:
        loop.call_soon_threadsafe(
            queue.put_nowait, (prompt_index, sample, token, logprob, top, finish, scheduler.weight_version)
        )

    def on_done(future) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, ("done", prompt_index, future))

    return on_token, on_done
