"""Tools in chat completions, and token-in prompts for an external driver (docs/serving.md, "Tools").

``tools`` go to the chat template through ``envs.toolcalls.render_messages`` (the template's own tool
format where it has one, lmforge's documented default otherwise); the reply is parsed for Hermes-style
``<tool_call>`` blocks and returned as OpenAI ``tool_calls`` with ``finish_reason: "tool_calls"``.
``tool_choice`` may be ``"auto"`` (the default with tools), ``"none"`` (tools are still shown to the
model; its reply is returned as text), ``"required"`` (one call or more) or a named function (exactly
that call). A forced call, ``parallel_tool_calls: false`` and ``strict`` tools are decoded under a
grammar of the reply (``grammar.py``), which :func:`call_format` describes in lmforge's call format:
each call is ``<tool_call>\n{"name": <a tool's name>, "arguments": <JSON>}\n</tool_call>``, exactly what
``parse_tool_calls`` reads and what the tools system block shows the model. The arguments follow the
tool's ``parameters`` schema when the call is forced or the tool is strict, and are any JSON object
otherwise.

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

from ..envs.toolcalls import CALL_CLOSE, CALL_OPEN, ParsedReply, parse_tool_calls, render_messages
from ..model.safe_encode import ControlTextError, Rendered, as_template, encode_rendered, render_marked

# Stands in for the last assistant message's content when finding the text a template writes after it.
_SENTINEL = "LMFORGE_END_OF_CONTENT_SENTINEL"


class ToolRequestError(ValueError):
    """A request the tool layer refuses; ``param`` names the field (app.py turns it into a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def request_tools(body) -> tuple[list[dict] | None, bool]:
    """(the tool schemas to render, whether to parse the reply for calls) of a ChatRequest; a
    ``tool_choice`` that is not one of the four forms, or names no tool, is a ToolRequestError."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    names = [t["function"]["name"] for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:  # which one a call names would be ambiguous
            raise ToolRequestError(
                f"two tools are named {name!r}: tools {names.index(name)} and {i}", f"tools.{i}.function.name"
            )
    choice = body.tool_choice
    if choice is not None and not tools:
        raise ToolRequestError("tool_choice needs tools: send tools, or leave tool_choice out", "tool_choice")
    if isinstance(choice, dict):
        _named_tool(choice, tools)
    elif choice not in (None, "auto", "none", "required"):
        raise ToolRequestError(
            f'tool_choice {json.dumps(choice)} is not one of "auto", "none", "required" '
            'or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return tools or None, bool(tools) and choice != "none"


def _named_tool(choice: dict, tools: list[dict]) -> str:
    """The name a ``{"type": "function", "function": {"name": ...}}`` tool_choice forces; it must be a tool's."""
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or set(choice) != {"type", "function"} or not isinstance(name, str):
        raise ToolRequestError(
            'a named tool_choice is {"type": "function", "function": {"name": ...}}, '
            f"got {json.dumps(choice)[:200]}",
            "tool_choice",
        )
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        raise ToolRequestError(
            f"tool_choice names the function {name!r}, which is not among the tools {names}",
            "tool_choice.function.name",
        )
    return name


def forces_call(body) -> bool:
    """Whether ``body``'s tool_choice forces a call ("required" or a named function)."""
    return body.tool_choice == "required" or isinstance(body.tool_choice, dict)


def call_format(tools: list[dict], body, text: bool, force: bool | None = None) -> tuple[dict, list[tuple[str, dict]]]:
    """(the reply's calls as an xgrammar structural-tag format, [(field, arguments schema)] it uses).

    ``text``: free text in which every ``<tool_call>`` block must be a well-formed call (tool_choice
    "auto"); otherwise calls only, at least one, separated by newlines. A named tool_choice allows that
    one call; ``parallel_tool_calls: false`` at most one call. Arguments follow the tool's
    ``parameters`` when ``force`` (default: whether the call is forced) or the tool is strict.
    """
    force = forces_call(body) if force is None else force
    named = _named_tool(body.tool_choice, tools) if isinstance(body.tool_choice, dict) else None
    tags, schemas = [], []
    for i, tool in enumerate(tools):
        function = tool["function"]
        if named is not None and function["name"] != named:
            continue
        arguments = {"type": "object"}
        if force or function.get("strict"):
            arguments = {**{"type": "object"}, **(function.get("parameters") or {"properties": {}})}
            schemas.append((f"tools.{i}.function.parameters", arguments))
        tags.append(
            {
                "type": "tag",
                "begin": f'{CALL_OPEN}\n{{"name": {json.dumps(function["name"])}, "arguments": ',
                "content": {"type": "json_schema", "json_schema": arguments, "max_whitespace_cnt": 1},
                "end": f"}}\n{CALL_CLOSE}",
            }
        )
    single = named is not None or body.parallel_tool_calls is False
    if text:
        fmt = {"type": "triggered_tags", "triggers": [CALL_OPEN], "tags": tags, "stop_after_first": single}
    elif named is not None:
        fmt = tags[0]
    else:
        fmt = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": single,
        }
    return fmt, schemas


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None, **template) -> str:
    """The prompt text of ``messages`` with ``tools`` and the generation prompt (``template``: more
    arguments of ``apply_chat_template``, e.g. ``add_generation_prompt=False``, template variables);
    template errors are the request's."""
    template = {"add_generation_prompt": True, **template}
    try:
        return render_messages(tokenizer, messages, tools, **template)
    except Exception as exc:  # jinja errors, bad tool-call arguments: about the request's messages
        raise ToolRequestError(f"the chat template could not render these messages: {exc}", "messages") from exc


def render_chat_marked(tokenizer, messages: list[dict], tools: list[dict] | None, **template) -> Rendered:
    """:func:`render_chat`'s text and where the messages' special-token strings landed in it
    (``model.safe_encode``); one the template does not write as given is the request's error."""
    try:
        return render_marked(
            tokenizer, lambda msgs, tls: render_chat(tokenizer, msgs, tls, **template), messages, tools
        )
    except ControlTextError as exc:
        raise ToolRequestError(str(exc), exc.field) from exc


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None, **template) -> list[int]:
    """The prompt ids of :func:`render_chat`'s text: the messages' text is encoded as text, so only the
    template's own special tokens are control tokens (``model.safe_encode``; docs/serving.md)."""
    return encode_rendered(tokenizer, render_chat_marked(tokenizer, messages, tools, **template))


def continue_prompt(
    tokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    prefix_ids: list[int],
    stop_token_ids: list[int],
    encode,
    template: dict | None = None,
    last: int | None = None,
) -> list[int]:
    """``prefix_ids`` + the tokens of the messages after the last assistant message (module doc), or
    after message ``last`` (an assistant message) when given: the agent gateway's (``sessions.py``).

    The new text is the full rendering minus the rendering of the conversation through the last
    assistant message (a template that rewrites earlier turns fails this: a 400), preceded by what the
    template writes after an assistant message's content that the sampled ids do not already hold
    (e.g. the newline after ``<|im_end|>``; all of it when the reply did not end in a stop token).
    """
    if last is None:
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is None:
        raise ToolRequestError(
            "prefix_token_ids stand for the conversation through its last assistant message, "
            "but messages has none; send the first turn without prefix_token_ids",
            "prefix_token_ids",
        )
    if not prefix_ids:
        raise ToolRequestError("prefix_token_ids is empty", "prefix_token_ids")
    history, template = messages[: last + 1], template or {}
    variables = {k: v for k, v in template.items() if k != "add_generation_prompt"}
    head = _render(tokenizer, history, tools, **variables)
    full = render_chat_marked(tokenizer, messages, tools, **template)
    if not full.text.startswith(head):
        raise ToolRequestError(
            "this chat template does not render the conversation prefix by prefix (it rewrites "
            "earlier turns), so new messages have no token delta; send the whole conversation "
            "without prefix_token_ids",
            "prefix_token_ids",
        )
    closing = _assistant_closing(tokenizer, history, tools, variables)
    if prefix_ids[-1] in stop_token_ids:
        stop_text = tokenizer.decode(prefix_ids[-1:], skip_special_tokens=False)
        if closing.startswith(stop_text):
            closing = closing[len(stop_text) :]
    return list(prefix_ids) + encode_rendered(tokenizer, as_template(tokenizer, closing) + full.cut(len(head)), encode)


def _render(tokenizer, messages: list[dict], tools: list[dict] | None, **variables) -> str:
    try:
        return render_messages(tokenizer, messages, tools, add_generation_prompt=False, **variables)
    except Exception as exc:  # as render_chat
        raise ToolRequestError(f"the chat template could not render these messages: {exc}", "messages") from exc


def _assistant_closing(tokenizer, history: list[dict], tools: list[dict] | None, variables: dict) -> str:
    """The text the template writes after the last assistant message's content (its end-of-turn)."""
    stand_in = [*history[:-1], {"role": "assistant", "content": _SENTINEL}]
    text = _render(tokenizer, stand_in, tools, **variables)
    if _SENTINEL not in text:
        raise ToolRequestError(
            "this chat template does not write an assistant message's content as given, so "
            "the end of the last turn cannot be found; send the conversation without "
            "prefix_token_ids",
            "prefix_token_ids",
        )
    return text[text.rindex(_SENTINEL) + len(_SENTINEL) :]


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
    calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in parsed.calls
    ]
    message = {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}
    return message, "tool_calls" if finish_reason == "stop" else finish_reason, []
