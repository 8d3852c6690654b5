"""Tools in ``lmforge serve``, driven by the ``openai`` client: ``tools`` / ``tool_choice`` in, OpenAI
``tool_calls`` out (streamed too), and the token-in extension ``prefix_token_ids`` that keeps a
multi-turn conversation's sampled ids verbatim.

The model is a "bigram" Llama built here: attention and MLP outputs are zero, so each next token depends
only on the current one, through a table. It answers the generation prompt's last token (a newline)
with a tool call written as three added tokens, then the end of sequence: a real model, through the real
engine, whose replies are known in advance.
"""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.envs.toolcalls import function_schema, render_messages
from lmforge.model.tokenizer import char_tokenizer

openai = pytest.importorskip("openai")

CALL_TOKENS = ["<tool_call>", '{"name": "multiply", "arguments": {"a": 12, "b": 34}}', "</tool_call>"]


def multiply(a: int, b: int) -> int:
    """Multiply two whole numbers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


TOOLS = [function_schema(multiply)]
QUESTION = [{"role": "user", "content": "12*34="}]


def bigram_model(script: dict[str, str]):
    """(model, tokenizer): greedy decoding goes from token ``a`` to ``script[a]``, and from any token not
    in ``script`` to the end of sequence."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = char_tokenizer()
    tok.add_tokens(CALL_TOKENS)
    vocab = len(tok)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=vocab + 6,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
    )
    model = LlamaForCausalLM(config)
    ids = {t: tok.convert_tokens_to_ids(t) for t in {*script, *script.values()}}
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, config.hidden_size))  # token t -> unit vector e_t
        head = torch.zeros(vocab, config.hidden_size)
        head[tok.eos_token_id, :vocab] = 1.0
        for current, following in script.items():
            head[:, ids[current]] = 0.0
            head[ids[following], ids[current]] = 1.0
        model.lm_head.weight.copy_(head * 20)
    return model.eval(), tok


CALLER = {"\n": CALL_TOKENS[0], CALL_TOKENS[0]: CALL_TOKENS[1], CALL_TOKENS[1]: CALL_TOKENS[2]}


@pytest.fixture
def caller(serve_model):
    """(client, tokenizer) of a server whose model answers every turn with the multiply call."""
    model, tok = bigram_model(CALLER)
    server = serve_model(model, tok)
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0), tok


@pytest.mark.parametrize("parallel", [{}, {"parallel_tool_calls": True}])  # true: OpenAI's default, accepted
def test_tool_call_comes_back_as_openai_tool_calls(caller, parallel):
    client, tok = caller
    reply = client.chat.completions.create(
        model="tiny-test", messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=8, **parallel
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function",
        "multiply",
        {"a": 12, "b": 34},
    )
    assert call.id.startswith("call_")
    assert choice.model_extra["token_ids"] == [*tok.convert_tokens_to_ids(CALL_TOKENS), tok.eos_token_id]
    # the prompt is the default tool format (lmforge's default template has no tool support)
    expected = render_messages(tok, QUESTION, TOOLS, add_generation_prompt=True)
    assert reply.model_extra["prompt_token_ids"] == tok.encode(expected, add_special_tokens=False)


def test_tool_choice_none_returns_the_reply_as_text(caller):
    client, _ = caller
    reply = client.chat.completions.create(
        model="tiny-test", messages=QUESTION, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8
    )
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == "".join(CALL_TOKENS)


def test_without_tools_the_reply_is_text(caller):
    client, _ = caller
    reply = client.chat.completions.create(model="tiny-test", messages=QUESTION, temperature=0, max_tokens=8)
    assert reply.choices[0].message.content == "".join(CALL_TOKENS) and reply.choices[0].finish_reason == "stop"


def test_streamed_tool_call_is_the_non_streamed_one(caller):
    client, _ = caller
    kwargs = dict(model="tiny-test", messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=8)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert [t for c in chunks for t in c.choices[0].model_extra.get("token_ids", [])] == whole.model_extra["token_ids"]
    last = chunks[-1].choices[0]
    assert last.finish_reason == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    [call] = last.delta.tool_calls
    assert (call.index, call.type, call.function.name, call.function.arguments) == (
        0,
        "function",
        "multiply",
        whole.message.tool_calls[0].function.arguments,
    )
    assert call.id.startswith("call_") and call.id != whole.message.tool_calls[0].id  # each response's own


def test_prefix_token_ids_keep_the_sampled_ids_and_add_only_the_new_messages(caller):
    client, tok = caller
    first = client.chat.completions.create(
        model="tiny-test", messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=8
    )
    sampled = first.choices[0].model_extra["token_ids"]
    prefix = first.model_extra["prompt_token_ids"] + sampled
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    conversation = [
        *QUESTION,
        assistant,
        {"role": "tool", "tool_call_id": assistant["tool_calls"][0]["id"], "content": "408"},
    ]
    second = client.chat.completions.create(
        model="tiny-test",
        messages=conversation,
        tools=TOOLS,
        temperature=0,
        max_tokens=8,
        extra_body={"prefix_token_ids": prefix},
    )
    prompt = second.model_extra["prompt_token_ids"]
    assert prompt[: len(prefix)] == prefix  # the sampled ids verbatim
    # the default template writes "<eos>\n" after a turn: the sampled ids hold the <eos>, the newline is added
    assert prompt[len(prefix) :] == tok.encode("\n<|tool|>\n408<eos>\n<|assistant|>\n", add_special_tokens=False)
    # rendering the whole conversation instead would have re-written the call ("<tool_call>\n{...}\n</tool_call>")
    rerendered = tok.encode(
        render_messages(tok, conversation, TOOLS, add_generation_prompt=True), add_special_tokens=False
    )
    assert rerendered != prompt and len(rerendered) > len(prompt)
    assert second.choices[0].finish_reason == "tool_calls"
    # the same call again: a new id, so a client matching results to calls by id keeps the two apart
    assert second.choices[0].message.tool_calls[0].id != assistant["tool_calls"][0]["id"]


def test_a_reply_cut_by_max_tokens_gets_the_whole_end_of_turn(caller):
    client, tok = caller
    first = client.chat.completions.create(
        model="tiny-test", messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=2
    )
    assert first.choices[0].finish_reason == "length"
    assert first.choices[0].message.content == "".join(CALL_TOKENS[:2])  # an unclosed block stays text
    assert first.choices[0].model_extra["tool_call_errors"] == [
        "tool call 1: <tool_call> is never closed by </tool_call>"
    ]
    prefix = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
    conversation = [
        *QUESTION,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "1"},
    ]
    second = client.chat.completions.create(
        model="tiny-test", messages=conversation, tools=TOOLS, max_tokens=1, extra_body={"prefix_token_ids": prefix}
    )
    added = second.model_extra["prompt_token_ids"][len(prefix) :]
    assert added == tok.encode("<eos>\n<|user|>\n1<eos>\n<|assistant|>\n", add_special_tokens=False)


@pytest.mark.parametrize(
    "kwargs, param, message",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "divide"}}},
            "tool_choice.function.name",
            "not among the tools",
        ),  # forced calls themselves: test_structured.py
        ({"tool_choice": "auto"}, "tool_choice", "tool_choice needs tools"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "tools.0.type"),
        ({"extra_body": {"prefix_token_ids": [5, 6]}}, "prefix_token_ids", "messages has none"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_parameter(caller, kwargs, param, message):
    client, _ = caller
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-test", messages=QUESTION, max_tokens=2, **kwargs)
    error = info.value.body
    assert error["param"] == param
    assert message in error["message"]


def test_a_template_that_rewrites_earlier_turns_refuses_prefix_token_ids(serve_model):
    model, tok = bigram_model(CALLER)
    # a template that shows only the last assistant turn, as some templates drop earlier reasoning
    tok.chat_template = (
        "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
        "{{ '<|' + m.role + '|>\n' + m.content + eos_token + '\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    )
    server = serve_model(model, tok)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    conversation = [*QUESTION, {"role": "assistant", "content": "1"}, {"role": "user", "content": "2"}]
    with pytest.raises(openai.BadRequestError, match="does not render the conversation prefix by prefix"):
        client.chat.completions.create(
            model="tiny-test", messages=conversation, max_tokens=2, extra_body={"prefix_token_ids": [5, 6, 2]}
        )
