"""Tool calls through the chat template: schemas from typed functions, Hermes-style parsing, rendering.

A tool is a typed Python function. :func:`function_schema` turns its signature and docstring into the
OpenAI tool schema that chat templates take (``apply_chat_template(..., tools=...)``). The model calls
tools in the Hermes format, one JSON object per block::

    <tool_call>
    {"name": "multiply", "arguments": {"a": 12, "b": 34}}
    </tool_call>

:func:`parse_tool_calls` reads those blocks back; a malformed block is an entry in ``errors`` (a message
the model can read), never an exception, because the text comes from a policy that is still learning.

:func:`render_messages` renders a conversation with tools. A template that renders ``tools`` gets them;
a template that does not (lmforge's ``DEFAULT_CHAT_TEMPLATE``, SmolLM2's) gets the default format: a
system block (:data:`TOOLS_SYSTEM_HEADER`, the schemas one per line, :data:`TOOLS_SYSTEM_FOOTER`),
assistant ``tool_calls`` written into the content as ``<tool_call>`` blocks, and role "tool" messages
passed as they are (or, if the template refuses that role, as user messages wrapped in
``<tool_response>`` tags). docs/environments.md, "Tool calls through the chat template".
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Union

from ..core.errors import ConfigError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

# The default format's system block, for templates that do not render ``tools`` themselves.
TOOLS_SYSTEM_HEADER = "You can call these tools (JSON schemas, one per line):\n<tools>"
TOOLS_SYSTEM_FOOTER = (
    "</tools>\n"
    "To call a tool, reply with one block per call:\n"
    f'{CALL_OPEN}\n{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}\n{CALL_CLOSE}\n'
    "Each result comes back in a message from the tool. Reply without a tool call to give your answer."
)

_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean"}
_ARGS_HEADERS = ("args:", "arguments:", "parameters:")


# ---------------------------------------------------------------------------------------------------
# Schemas from typed functions
# ---------------------------------------------------------------------------------------------------


def function_schema(fn: Callable) -> dict:
    """The OpenAI tool schema of ``fn``: ``{"type": "function", "function": {"name", "description",
    "parameters"}}``.

    ``name`` is ``fn.__name__``; ``description`` the docstring's text before its ``Args:`` section;
    each parameter's description comes from a Google-style ``Args:`` section (``name: text`` or
    ``name (type): text``, continued on more-indented lines). Annotations supported: ``int``, ``float``,
    ``str``, ``bool``, ``list`` / ``list[X]``, ``dict`` / ``dict[str, X]``, ``Literal[...]`` and
    ``Optional[X]`` / ``X | None`` of those. A parameter with a default is optional and its schema
    carries the default. Anything else -- no annotation, another type, ``*args``, no docstring, an
    ``Args:`` entry for a parameter that does not exist -- is a ConfigError naming the function and
    the parameter.
    """
    name = getattr(fn, "__name__", None)
    if not callable(fn) or not name:
        raise ConfigError(f"function_schema: expected a named function, got {fn!r}")
    doc = inspect.getdoc(fn)
    if not doc:
        raise ConfigError(f"tool {name!r}: no docstring; add one saying what the tool does (the model reads it)")
    description, arg_docs = _parse_docstring(doc)
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # NameError / TypeError from an annotation that does not resolve
        raise ConfigError(f"tool {name!r}: cannot resolve its annotations ({exc})") from exc
    params = inspect.signature(fn).parameters
    stale = sorted(set(arg_docs) - set(params))
    if stale:
        raise ConfigError(
            f"tool {name!r}: the docstring describes {stale}, which are not parameters of it; fix the Args: section"
        )
    properties, required = {}, []
    for pname, param in params.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ConfigError(
                f"tool {name!r}, parameter {pname!r}: *args / **kwargs cannot be described "
                "by a JSON schema; name each parameter"
            )
        if pname not in hints:
            raise ConfigError(
                f"tool {name!r}, parameter {pname!r}: no type annotation; annotate it "
                "(int, float, str, bool, list[...], dict, Literal[...], Optional[...])"
            )
        schema = _type_schema(hints[pname], f"tool {name!r}, parameter {pname!r}")
        if pname in arg_docs:
            schema["description"] = arg_docs[pname]
        if param.default is param.empty:
            required.append(pname)
        else:
            schema["default"] = _json_default(param.default, f"tool {name!r}, parameter {pname!r}")
        properties[pname] = schema
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _type_schema(annotation: Any, where: str) -> dict:
    """JSON schema of one annotation; ``where`` names the function and parameter in errors."""
    if annotation in _SCALARS:
        return {"type": _SCALARS[annotation]}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is list or origin is list:
        return {"type": "array", **({"items": _type_schema(args[0], where)} if args else {})}
    if annotation is dict or origin is dict:
        if args and args[0] is not str:
            raise ConfigError(f"{where}: dict keys must be str in JSON, got {annotation}")
        return {"type": "object", **({"additionalProperties": _type_schema(args[1], where)} if args else {})}
    if origin is Literal:
        kinds = {_SCALARS.get(type(v)) for v in args}
        if None in kinds or len(kinds) != 1:
            raise ConfigError(f"{where}: Literal values must all be str, or all int, float or bool; got {args}")
        return {"type": kinds.pop(), "enum": list(args)}
    if origin in (Union, types.UnionType) and type(None) in args and len(args) == 2:
        inner = _type_schema(next(a for a in args if a is not type(None)), where)
        inner["type"] = [inner["type"], "null"]
        if "enum" in inner:
            inner["enum"] = [*inner["enum"], None]
        return inner
    raise ConfigError(
        f"{where}: unsupported annotation {annotation!r}; use int, float, str, bool, "
        "list[...], dict[str, ...], Literal[...] or Optional[...] of those"
    )


def _json_default(value: Any, where: str) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: default {value!r} is not JSON ({exc}); use a JSON value or None") from exc
    return value


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a Google-style docstring."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().lower() in _ARGS_HEADERS), len(lines))
    description = "\n".join(lines[:start]).strip()
    arg_docs: dict[str, str] = {}
    current, indent = None, None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        if indent is None:
            indent = width
        if width < indent:  # the Args: section ended (a Returns: header at the outer level)
            break
        entry = re.match(r"\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line) if width == indent else None
        if entry:
            current = entry.group(1)
            arg_docs[current] = entry.group(2).strip()
        elif current is not None:  # a continuation line
            arg_docs[current] = f"{arg_docs[current]} {line.strip()}".strip()
    return description, arg_docs


# ---------------------------------------------------------------------------------------------------
# Parsing and formatting calls
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name, its arguments, and an id that answers refer to (``tool_call_id``)."""

    name: str
    arguments: dict
    id: str


@dataclass(frozen=True)
class ParsedReply:
    """An assistant reply split into its text (``content``, the blocks removed), the well-formed calls in
    order, and one readable message per malformed block."""

    content: str
    calls: list[ToolCall]
    errors: list[str]


_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


def parse_tool_calls(text: str) -> ParsedReply:
    """Read every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block of ``text``.

    A block whose JSON does not parse, is not an object, has no non-empty string ``name``, or whose
    ``arguments`` is not an object, becomes an entry of ``errors`` (numbered by its position among the
    blocks, 1-based); so does a ``<tool_call>`` left unclosed. ``arguments`` may be left out (a call
    without arguments), or be a string holding a JSON object (OpenAI's wire format). Ids are ``call_`` + a hash of
    the text and the block's position: the same
    reply always gets the same ids.
    """
    calls, errors, pieces = [], [], []
    position, number = 0, 0
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]
    for match in _BLOCK.finditer(text):
        pieces.append(text[position : match.start()])
        position = match.end()
        number += 1
        call, error = _parse_block(match.group(1), number)
        if error:
            errors.append(error)
        else:
            calls.append(ToolCall(name=call[0], arguments=call[1], id=f"call_{digest}_{number}"))
    rest = text[position:]
    if CALL_OPEN in rest:
        number += 1
        errors.append(f"tool call {number}: {CALL_OPEN} is never closed by {CALL_CLOSE}")
        rest = rest[: rest.index(CALL_OPEN)]
    pieces.append(rest)
    return ParsedReply(content="".join(pieces).strip(), calls=calls, errors=errors)


def _parse_block(body: str, number: int) -> tuple[tuple[str, dict] | None, str | None]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"tool call {number}: invalid JSON ({exc.msg} at character {exc.pos}): {body.strip()[:200]}"
    if not isinstance(obj, dict):
        return None, (
            f'tool call {number}: expected a JSON object with "name" and "arguments", got {body.strip()[:200]}'
        )
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, f'tool call {number}: "name" is missing or not a non-empty string'
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI's wire format, which models trained on it copy: a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # reported below as not an object
    if not isinstance(arguments, dict):
        return None, (
            f'tool call {number} ({name}): "arguments" must be a JSON object, got {json.dumps(arguments)[:200]}'
        )
    return (name, arguments), None


def format_tool_calls(calls: list[ToolCall]) -> str:
    """The assistant text for ``calls``: one ``<tool_call>`` block per call, newline-separated;
    :func:`parse_tool_calls` reads back the same names and arguments."""
    return "\n".join(
        f"{CALL_OPEN}\n{json.dumps({'name': c.name, 'arguments': c.arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"
        for c in calls
    )


# ---------------------------------------------------------------------------------------------------
# Rendering conversations with tools
# ---------------------------------------------------------------------------------------------------

_PROBE_NAME = "lmforge_probe_tool_q7x"
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": _PROBE_NAME, "description": "probe", "parameters": {"type": "object", "properties": {}}},
}
_supports_cache: dict[str, bool] = {}


def supports_tools(tokenizer) -> bool:
    """Whether ``tokenizer``'s chat template renders ``tools``: a probe tool's name appears in its
    rendering of a one-message conversation. A template that raises on ``tools`` does not support them.
    Cached per template text."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return False
    key = repr(template)
    if key not in _supports_cache:
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True
            )
        except Exception:  # noqa: BLE001 - jinja errors, or a template that cannot take these messages: no tool support
            text = ""
        _supports_cache[key] = _PROBE_NAME in text
    return _supports_cache[key]


def render_messages(
    tokenizer, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool, **template_kwargs
) -> str:
    """The chat template's text for ``messages`` with ``tools`` (OpenAI schemas; ``None`` or ``[]`` for
    none).

    A template that renders tools (:func:`supports_tools`) receives them through
    ``apply_chat_template(..., tools=tools)``, and assistant ``tool_calls`` with their ``arguments``
    as objects (a JSON string is decoded; templates expect objects), also when ``tools`` is empty.
    Otherwise the default format of
    the module docstring. ``content: None`` (an OpenAI assistant message that only calls tools) renders
    as "". An assistant message carries its calls either as ``<tool_call>`` text in its content or as
    ``tool_calls``: a message with both keeps its content and its ``tool_calls`` are not rendered again.
    ``template_kwargs`` go to ``apply_chat_template`` as they are (``continue_final_message``, template
    variables such as ``enable_thinking``).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "render_messages: the tokenizer has no chat template; give it one "
            "(lmforge.model.tokenizer.ensure_chat_template adds the default)"
        )
    has_calls = any(m.get("tool_calls") for m in messages)
    native = bool(tools or has_calls) and supports_tools(tokenizer)
    msgs = [_normalize(m, calls_as_text=not native) for m in messages]
    kwargs = {"tokenize": False, "add_generation_prompt": add_generation_prompt, **template_kwargs}
    if native:
        return tokenizer.apply_chat_template(msgs, tools=tools, **kwargs)
    if tools:
        msgs = _with_tools_block(msgs, tools)
    try:
        return tokenizer.apply_chat_template(msgs, **kwargs)
    except Exception:  # a template that refuses role "tool": pass results as wrapped user messages
        if not any(m["role"] == "tool" for m in msgs):
            raise
        return tokenizer.apply_chat_template([_tool_as_user(m) for m in msgs], **kwargs)


def tools_system_block(tools: list[dict]) -> str:
    """The default format's system text listing ``tools``."""
    lines = [json.dumps(t, ensure_ascii=False) for t in tools]
    return "\n".join([TOOLS_SYSTEM_HEADER, *lines, TOOLS_SYSTEM_FOOTER])


def _with_tools_block(msgs: list[dict], tools: list[dict]) -> list[dict]:
    block = tools_system_block(tools)
    if msgs and msgs[0]["role"] == "system":
        return [{**msgs[0], "content": f"{msgs[0]['content']}\n\n{block}"}, *msgs[1:]]
    return [{"role": "system", "content": block}, *msgs]


def _tool_as_user(message: dict) -> dict:
    if message["role"] != "tool":
        return message
    return {"role": "user", "content": f"{RESPONSE_OPEN}\n{message['content']}\n{RESPONSE_CLOSE}"}


def _normalize(message: dict, calls_as_text: bool) -> dict:
    """A copy of ``message`` with content a string and tool_calls as templates (or the default format)
    expect them."""
    out = {**message, "content": message.get("content") or ""}
    raw_calls = out.get("tool_calls") or []
    if not raw_calls:
        out.pop("tool_calls", None)
        return out
    if CALL_OPEN in out["content"]:  # the calls are already in the text (token-in/token-out replies)
        out.pop("tool_calls")
        return out
    calls = [_call_from_openai(c) for c in raw_calls]
    if calls_as_text:
        text = format_tool_calls(calls)
        out["content"] = f"{out['content']}\n{text}" if out["content"] else text
        out.pop("tool_calls")
    else:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
        ]
    return out


def _call_from_openai(call: dict) -> ToolCall:
    """A ToolCall from an OpenAI ``tool_calls`` entry (``{"id", "type", "function": {"name",
    "arguments"}}``, arguments a JSON string or an object)."""
    fn = call.get("function", call)
    arguments = fn.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"tool call {fn.get('name')!r}: arguments are not valid JSON ({exc})") from exc
    return ToolCall(name=fn.get("name", ""), arguments=arguments, id=call.get("id", ""))
