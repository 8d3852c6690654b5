"""Tools in chat completions, and token-in prompts for an external driver (docs/serving.md, "Tools").

``tools`` go to the chat template through ``envs.toolcalls.render_messages`` (the template's own tool
format where it has one, lmforge's documented default otherwise); the reply is parsed for Hermes-style
``<tool_call>`` blocks and returned as OpenAI ``tool_calls`` with ``finish_reason: "tool_calls"``.
``tool_choice`` may be ``"auto"`` (the default with tools) or ``"none"`` (tools are still shown to the
model; its reply is returned as text). ``"required"`` and a named function would need constrained
decoding, which this server does not do, so they are a 400 that names ``tool_choice``.

``prefix_token_ids`` (an extension, sent with the ``openai`` client as ``extra_body``) makes the prompt
token-in/token-out: the ids of the conversation through its last assistant message, as this server
returned them (the previous response's ``prompt_token_ids`` + the choice's ``token_ids``). The server
renders only the messages after that assistant message, as the template's text after it, and appends
their tokens: the sampled ids are never decoded and tokenized again, so a trainer fed from this
server's ``prompt_token_ids`` / ``token_ids`` scores exactly the tokens that were sampled.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from ..envs.toolcalls import ParsedReply, parse_tool_calls, render_messages

# Stands in for the last assistant message's content when finding the text a template writes after it.
_SENTINEL = "LMFORGE_END_OF_CONTENT_SENTINEL"


class ToolRequestError(ValueError):
    """A request the tool layer refuses; ``param`` names the field (app.py turns it into a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def request_tools(body) -> tuple[list[dict] | None, bool]:
    """(the tool schemas to render, whether to parse the reply for calls) of a ChatRequest."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice
    if choice is not None and not tools:
        raise ToolRequestError("tool_choice needs tools: send tools, or leave tool_choice out", "tool_choice")
    if choice not in (None, "auto", "none"):
        raise ToolRequestError(
            f"tool_choice {json.dumps(choice)} is not supported: lmforge serve cannot force a tool call (that "
            "needs constrained decoding); use \"auto\" (the model decides) or \"none\"", "tool_choice")
    if body.parallel_tool_calls is False:  # true is what the parser does anyway: every call of a reply
        raise ToolRequestError("parallel_tool_calls=false is not supported: lmforge serve cannot hold a reply to "
                               "one call (that needs constrained decoding); leave it out or true",
                               "parallel_tool_calls")
    for i, tool in enumerate(tools):
        if tool["function"].get("strict"):
            raise ToolRequestError("strict function schemas are not supported: lmforge serve does not constrain "
                                   "decoding to a schema; leave strict out or false", f"tools.{i}.function.strict")
    return tools or None, bool(tools) and choice != "none"


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    """The prompt text of ``messages`` with ``tools`` and the generation prompt; template errors are
    the request's."""
    try:
        return render_messages(tokenizer, messages, tools, add_generation_prompt=True)
    except Exception as exc:  # jinja errors, bad tool-call arguments: about the request's messages
        raise ToolRequestError(f"the chat template could not render these messages: {exc}", "messages") from exc


def continue_prompt(tokenizer, messages: list[dict], tools: list[dict] | None, prefix_ids: list[int],
                    stop_token_ids: list[int], encode) -> list[int]:
    """``prefix_ids`` + the tokens of the messages after the last assistant message (module doc).

    The new text is the full rendering minus the rendering of the conversation through the last
    assistant message (a template that rewrites earlier turns fails this: a 400), preceded by what the
    template writes after an assistant message's content that the sampled ids do not already hold
    (e.g. the newline after ``<|im_end|>``; all of it when the reply did not end in a stop token).
    """
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is None:
        raise ToolRequestError("prefix_token_ids stand for the conversation through its last assistant message, "
                               "but messages has none; send the first turn without prefix_token_ids",
                               "prefix_token_ids")
    if not prefix_ids:
        raise ToolRequestError("prefix_token_ids is empty", "prefix_token_ids")
    history = messages[:last + 1]
    head = _render(tokenizer, history, tools)
    full = render_chat(tokenizer, messages, tools)
    if not full.startswith(head):
        raise ToolRequestError("this chat template does not render the conversation prefix by prefix (it rewrites "
                               "earlier turns), so new messages have no token delta; send the whole conversation "
                               "without prefix_token_ids", "prefix_token_ids")
    closing = _assistant_closing(tokenizer, history, tools)
    if prefix_ids[-1] in stop_token_ids:
        stop_text = tokenizer.decode(prefix_ids[-1:], skip_special_tokens=False)
        if closing.startswith(stop_text):
            closing = closing[len(stop_text):]
    return list(prefix_ids) + encode(closing + full[len(head):])


def _render(tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    try:
        return render_messages(tokenizer, messages, tools, add_generation_prompt=False)
    except Exception as exc:  # as render_chat
        raise ToolRequestError(f"the chat template could not render these messages: {exc}", "messages") from exc


def _assistant_closing(tokenizer, history: list[dict], tools: list[dict] | None) -> str:
    """The text the template writes after the last assistant message's content (its end-of-turn)."""
    stand_in = [*history[:-1], {"role": "assistant", "content": _SENTINEL}]
    text = _render(tokenizer, stand_in, tools)
    if _SENTINEL not in text:
        raise ToolRequestError("this chat template does not write an assistant message's content as given, so "
                               "the end of the last turn cannot be found; send the conversation without "
                               "prefix_token_ids", "prefix_token_ids")
    return text[text.rindex(_SENTINEL) + len(_SENTINEL):]


def tool_reply(text: str, finish_reason: str) -> tuple[dict[str, Any], str, list[str]]:
    """(the choice's message, its finish_reason, parse errors) for a reply ``text`` when tools are on.

    Well-formed calls become ``tool_calls`` (arguments as a JSON string, as OpenAI sends them; ids unique
    to the response), the
    text around them ``content`` (None when empty), and a reply that stopped normally gets
    ``finish_reason: "tool_calls"``. A reply with any malformed block is returned as text, untouched,
    with the errors: taking only part of it would answer a call the model did not make as written.
    """
    parsed: ParsedReply = parse_tool_calls(text)
    if parsed.errors or not parsed.calls:
        return {"role": "assistant", "content": text}, finish_reason, parsed.errors
    # Fresh ids, not parse_tool_calls' text-derived ones: a model that repeats a call in a later turn would
    # repeat its id, and clients match results to calls by id across the conversation.
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
             for c in parsed.calls]
    message = {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}
    return message, "tool_calls" if finish_reason == "stop" else finish_reason, []

