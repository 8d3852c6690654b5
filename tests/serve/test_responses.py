"""``POST /v1/responses`` (``serve/responses.py``), driven by the clients that call it: the ``openai``
client (``responses.create``, ``responses.stream``), the OpenAI Agents SDK's default model and LangChain's
``ChatOpenAI(use_responses_api=True)``.

The served model is steered: a tiny Llama whose every sample is forced, token by token, by a
``RowProcessor`` (the scheduler's per-sample seam) to a reply chosen from the prompt text: the
``multiply`` call while the prompt has no tool result, a sentence with the result once it has one. So a
tool round trip goes through the real engine, chat template, tool parser and Responses conversion, with
replies known in advance.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

from lmforge.envs.toolcalls import function_schema, render_messages

openai = pytest.importorskip("openai")

CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>'  # lmforge's call format
ANSWER = "12*34 = 408."
QUESTION = "What is 12*34?"
JSON = '{"product": 408}'


def multiply(a: int, b: int) -> int:
    """Multiply two whole numbers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


CHAT_TOOLS = [function_schema(multiply)]
TOOLS = [{"type": "function", **CHAT_TOOLS[0]["function"]}]  # the Responses shape: no "function" wrapper


def script(prompt: str) -> str:
    """The reply to a prompt: JSON when asked for it; else the call until a tool result (408) is in the
    conversation, then the answer."""
    if "Answer in JSON." in prompt:
        return JSON
    if "Go on and on." in prompt:
        return "la " * 1300
    return ANSWER if "408" in prompt else CALL


class Forced:
    """A RowProcessor that makes a row sample ``script(prompt)``'s tokens, then the end of sequence."""

    def __init__(self, tokenizer, eos: int):
        self.tokenizer, self.eos, self.reply = tokenizer, eos, None

    def process(self, logits: torch.Tensor, prompt_ids: list[int], tokens: list[int]) -> None:
        if self.reply is None:
            self.reply = self.tokenizer.encode(script(self.tokenizer.decode(prompt_ids)), add_special_tokens=False)
        target = self.reply[len(tokens)] if len(tokens) < len(self.reply) else self.eos
        logits.fill_(-1e4)
        logits[target] = 0.0


@pytest.fixture
def server(serve_model, monkeypatch):
    """A server whose every sample is forced to ``script``'s reply (module doc)."""
    pytest.importorskip("fastapi")
    from lmforge.core.config import ModelConfig
    from lmforge.model.load import build_tiny
    from lmforge.model.tokenizer import char_tokenizer
    from lmforge.serve.app import ServedModel

    tokenizer = char_tokenizer("".join(chr(c) for c in range(32, 127)))
    model = build_tiny(
        "llama",
        ModelConfig(name="tiny:llama", hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=4096),
        tokenizer,
    )
    plain_request = ServedModel.request

    def steered_request(self, *args, **kwargs):
        request = plain_request(self, *args, **kwargs)
        request.processors.append(lambda: Forced(self.tokenizer, self.stop_token_ids[0]))
        return request

    monkeypatch.setattr(ServedModel, "request", steered_request)
    running = serve_model(model.eval(), tokenizer)
    running.tokenizer = tokenizer
    return running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def rendered(server, messages: list[dict], tools=None) -> list[int]:
    """The prompt ids the chat path makes of ``messages`` (what /v1/responses must send to the model)."""
    text = render_messages(server.tokenizer, messages, tools, add_generation_prompt=True)
    return server.tokenizer.encode(text, add_special_tokens=False)


def test_text_response_is_the_chat_reply_as_a_responses_object(server, client):
    response = client.responses.create(
        model="tiny-test", input="Say it.", instructions="Be brief.", temperature=0, metadata={"run": "7"}
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say it."}]
    chat = client.chat.completions.create(model="tiny-test", messages=messages, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.incomplete_details is None
    [item] = response.output
    assert (item.type, item.role, item.status, item.content[0].type) == (
        "message",
        "assistant",
        "completed",
        "output_text",
    )
    assert response.output_text == chat.choices[0].message.content == CALL  # no tools: the reply is text
    assert (
        response.model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"] == rendered(server, messages)
    )
    assert response.model_extra["token_ids"] == chat.choices[0].model_extra["token_ids"]
    assert response.model_extra["weight_version"] == 0
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert (response.instructions, response.metadata, response.model) == ("Be brief.", {"run": "7"}, "tiny-test")


def test_max_output_tokens_cut_makes_an_incomplete_response(client):
    response = client.responses.create(model="tiny-test", input="Say it.", max_output_tokens=4)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == CALL[:4] and response.output[0].status == "incomplete"
    assert response.usage.output_tokens == 4


def test_input_items_become_the_chat_messages(server, client):
    items = [
        {"role": "developer", "content": "Be brief."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Hi."}, {"type": "input_text", "text": "Count."}],
        },
        {"role": "assistant", "content": [{"type": "output_text", "text": "1 2", "annotations": []}]},
        {"role": "user", "content": "More."},
    ]
    response = client.responses.create(model="tiny-test", input=items)
    assert response.model_extra["prompt_token_ids"] == rendered(
        server,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi.\nCount."},
            {"role": "assistant", "content": "1 2"},
            {"role": "user", "content": "More."},
        ],
    )


def test_streamed_events_in_order_end_with_the_whole_response(client):
    whole = client.responses.create(model="tiny-test", input="Say it.", temperature=0)
    with client.responses.stream(model="tiny-test", input="Say it.", temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert deltas >= len(CALL) // 2  # one per token (a held-back partial character may merge two)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4 + 0].text == final.output_text == whole.output_text == CALL
    assert events[2].item.id == events[-2].item.id == final.output[0].id
    assert final.model_extra["token_ids"] == whole.model_extra["token_ids"]
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        whole.usage.input_tokens,
        whole.usage.output_tokens,
    )


def test_a_client_that_leaves_a_stream_cancels_its_generation(server, client):
    import httpx

    with client.responses.stream(model="tiny-test", input="Go on and on.") as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                break  # 3900 tokens to go (about 50 s here): the server must not decode them for nobody
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health").json()["running_rows"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(server.url + "/health").json()["running_rows"] == 0


def test_function_call_round_trip_puts_the_result_in_the_next_prompt(server, client):
    first = client.responses.create(model="tiny-test", input=QUESTION, tools=TOOLS, temperature=0)
    [call] = first.output
    assert (call.type, call.name, json.loads(call.arguments), call.status) == (
        "function_call",
        "multiply",
        {"a": 12, "b": 34},
        "completed",
    )
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert first.output_text == "" and first.status == "completed"
    items = [
        {"role": "user", "content": QUESTION},
        *[o.model_dump(exclude_none=True) for o in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "408"},
    ]
    second = client.responses.create(model="tiny-test", input=items, tools=TOOLS, temperature=0)
    assert second.output_text == ANSWER and [o.type for o in second.output] == ["message"]
    conversation = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": "multiply", "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "408"},
    ]
    prompt = second.model_extra["prompt_token_ids"]
    assert prompt == rendered(server, conversation, CHAT_TOOLS)
    assert "408" in server.tokenizer.decode(prompt)


def test_previous_response_id_continues_the_stored_conversation(server, client):
    first = client.responses.create(model="tiny-test", input=QUESTION, tools=TOOLS, instructions="Use tools.")
    call = first.output[0]
    result = [{"type": "function_call_output", "call_id": call.call_id, "output": "408"}]
    second = client.responses.create(model="tiny-test", input=result, tools=TOOLS, previous_response_id=first.id)
    assert second.output_text == ANSWER and second.previous_response_id == first.id
    # the first turn's instructions are not carried over (as OpenAI): only the items and the output
    conversation = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": "multiply", "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "408"},
    ]
    assert second.model_extra["prompt_token_ids"] == rendered(server, conversation, CHAT_TOOLS)
    assert client.responses.retrieve(second.id).output_text == ANSWER
    unstored = client.responses.create(model="tiny-test", input="Say it.", store=False, max_output_tokens=2)
    for missing in (unstored.id, "resp_nonexistent"):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="tiny-test", input="Go on.", previous_response_id=missing)
        assert info.value.body["param"] == "previous_response_id"
        assert info.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "multiply"}])
def test_tool_choice_required_and_named_become_the_chat_ones(client, choice):
    response = client.responses.create(model="tiny-test", input=QUESTION, tools=TOOLS, tool_choice=choice)
    assert [o.type for o in response.output] == ["function_call"] and response.output[0].name == "multiply"
    assert response.tool_choice == choice if isinstance(choice, str) else response.tool_choice.name == "multiply"


def test_streamed_function_call(client):
    whole = client.responses.create(model="tiny-test", input=QUESTION, tools=TOOLS)
    with client.responses.stream(model="tiny-test", input=QUESTION, tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, done = events[2].item, events[5].item
    assert (added.type, added.arguments, added.status) == ("function_call", "", "in_progress")
    assert (done.id, done.call_id) == (added.id, added.call_id) and done.status == "completed"
    assert events[3].delta == events[4].arguments == done.arguments == whole.output[0].arguments
    [call] = final.output
    assert (call.name, json.loads(call.arguments)) == ("multiply", {"a": 12, "b": 34})
    assert final.model_extra["token_ids"] == whole.model_extra["token_ids"]


def test_logprobs_through_include(client):
    response = client.responses.create(
        model="tiny-test",
        input="Say it.",
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        max_output_tokens=3,
    )
    logprobs = response.output[0].content[0].logprobs
    assert [lp.token for lp in logprobs] == list(CALL[:3])
    assert all(lp.logprob == pytest.approx(0.0, abs=1e-4) and len(lp.top_logprobs) == 2 for lp in logprobs)
    plain = client.responses.create(model="tiny-test", input="Say it.", max_output_tokens=3)
    assert plain.output[0].content[0].logprobs == [] and "logprobs" not in plain.model_extra


def test_text_format_json_schema_is_the_chat_response_format(client):
    schema = {"type": "object", "properties": {"product": {"type": "integer"}}, "required": ["product"]}
    fmt = {"type": "json_schema", "name": "product", "schema": schema, "strict": True}
    response = client.responses.create(model="tiny-test", input="Answer in JSON.", text={"format": fmt})
    assert json.loads(response.output_text) == {"product": 408} and response.text.format.type == "json_schema"
    with pytest.raises(openai.BadRequestError) as info:  # the chat request's check, under the Responses name
        client.responses.create(
            model="tiny-test", input="Answer in JSON.", text={"format": {"type": "json_schema", "schema": schema}}
        )
    assert info.value.body["param"] == "text.format.name"


@pytest.mark.parametrize(
    "kwargs, param, message",
    [
        ({"reasoning": {"effort": "high"}}, "reasoning.effort", "not a reasoning model"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type", "'reasoning' is not supported"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.type",
            "input_text",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
            "input.0.call_id",
            "no function_call with call_id",
        ),
        ({"input": [{"role": "user", "content": "hi", "color": "red"}]}, "input.0.color", "unknown or unsupported"),
        ({"input": 5}, "input", "a string or a list of items"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "'function'"),
        ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "is not supported"),
        ({"truncation": "auto"}, "truncation", "not supported"),
        ({"background": True}, "background", "not supported"),
        ({"text": {"verbosity": "high"}}, "text.verbosity", "not supported"),
        ({"include": ["nonsense.field"]}, "include.0", "not known"),
        ({"extra_body": {"conversation": "conv_1"}}, "conversation", "not supported"),
        ({"extra_body": {"max_tokens": 3}}, "max_tokens", "max_output_tokens"),
        ({"extra_body": {"best_of": 2}}, "best_of", "unknown or unsupported field 'best_of'"),
        ({"max_output_tokens": 5000}, "max_output_tokens", "maximum context length"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_responses_field(client, kwargs, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**{"model": "tiny-test", "input": "hi", **kwargs})
    assert info.value.body["param"] == param
    assert message in info.value.body["message"]


def test_an_unknown_model_is_the_chat_routes_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="gpt-4o", input="hi")
    assert info.value.body["param"] == "model" and "tiny-test" in info.value.body["message"]


def test_accepted_fields_that_change_nothing(client):
    plain = client.responses.create(model="tiny-test", input="Say it.", max_output_tokens=3)
    same = client.responses.create(
        model="tiny-test",
        input="Say it.",
        max_output_tokens=3,
        user="u",
        store=True,
        truncation="disabled",
        reasoning={},
        text={"format": {"type": "text"}},
        include=["reasoning.encrypted_content"],
        parallel_tool_calls=True,
        safety_identifier="s",
        prompt_cache_key="k",
        service_tier="auto",
    )
    assert same.model_extra["token_ids"] == plain.model_extra["token_ids"]


def agents_round_trip(server, strict: bool, streamed: bool = False) -> tuple[str, list]:
    """Run an Agents SDK agent (its default model: OpenAIResponsesModel) whose tool is ``multiply``."""
    agents = pytest.importorskip("agents")
    calls = []

    @agents.function_tool(name_override="multiply", strict_mode=strict)
    def multiply_tool(a: int, b: int) -> int:
        """Multiply two whole numbers."""
        calls.append((a, b))
        return a * b

    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(
        openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0), use_for_tracing=False
    )
    agents.set_default_openai_api("responses")
    agent = agents.Agent(name="calculator", instructions="Use the tool.", model="tiny-test", tools=[multiply_tool])
    if not streamed:
        return agents.Runner.run_sync(agent, QUESTION, max_turns=3).final_output, calls

    async def run() -> str:
        result = agents.Runner.run_streamed(agent, QUESTION, max_turns=3)
        async for _ in result.stream_events():
            pass
        return result.final_output

    return asyncio.run(run()), calls


def test_openai_agents_sdk_tool_round_trip(server):
    final, calls = agents_round_trip(server, strict=False)
    assert calls == [(12, 34)] and final == ANSWER


def test_openai_agents_sdk_default_strict_tool_round_trip(server):
    final, calls = agents_round_trip(server, strict=True)  # @function_tool's default: a strict schema
    assert calls == [(12, 34)] and final == ANSWER


def test_openai_agents_sdk_streamed_tool_round_trip(server):
    final, calls = agents_round_trip(server, strict=True, streamed=True)  # the Responses events, parsed by the SDK
    assert calls == [(12, 34)] and final == ANSWER


def test_langchain_use_responses_api_tool_round_trip(server):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model="tiny-test",
        base_url=server.url + "/v1",
        api_key="unused",
        use_responses_api=True,
        temperature=0,
        max_retries=0,
    )
    with_tools = llm.bind_tools([multiply])
    messages = [HumanMessage(QUESTION)]
    reply = with_tools.invoke(messages)
    [call] = reply.tool_calls
    assert (call["name"], call["args"]) == ("multiply", {"a": 12, "b": 34})
    messages += [reply, ToolMessage(str(multiply(**call["args"])), tool_call_id=call["id"])]
    final = with_tools.invoke(messages)
    assert final.text == ANSWER and not final.tool_calls
    streamed = None
    for chunk in with_tools.stream(messages[:1]):  # the streamed call, chunks added up
        streamed = chunk if streamed is None else streamed + chunk
    [call] = streamed.tool_calls
    assert (call["name"], call["args"]) == ("multiply", {"a": 12, "b": 34})


# ------------------------------------------------------------------------------------------ SmolLM2


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_agents_sdk_and_langchain_tool_round_trips(serve_model, smollm2):
    """The real model, unsteered: a forced call (tool_choice "required", one call) with the Agents SDK's
    default strict tool, then its answer; and LangChain's tool_choice "any" round trip."""
    agents = pytest.importorskip("agents")
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    server = serve_model(*smollm2)
    calls = []

    @agents.function_tool
    def multiply_tool(a: int, b: int) -> int:
        """Multiply two integers."""
        calls.append((a, b))
        return a * b

    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(
        openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0), use_for_tracing=False
    )
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=64)
    agent = agents.Agent(
        name="calculator",
        instructions="You are a calculator. Use the tool, then state the result.",
        model="tiny-test",
        tools=[multiply_tool],
        model_settings=settings,
    )
    result = agents.Runner.run_sync(agent, "What is 12 times 34?", max_turns=4)
    assert calls == [(12, 34)] and isinstance(result.final_output, str) and result.final_output.strip()

    llm = ChatOpenAI(
        model="tiny-test",
        base_url=server.url + "/v1",
        api_key="unused",
        use_responses_api=True,
        temperature=0,
        max_tokens=64,
        max_retries=0,
    )
    messages = [HumanMessage("What is 12 times 34? Use the tool.")]
    reply = llm.bind_tools([multiply], tool_choice="any", parallel_tool_calls=False).invoke(messages)
    [call] = reply.tool_calls
    assert (call["name"], call["args"]) == ("multiply", {"a": 12, "b": 34})
    messages += [reply, ToolMessage(str(multiply(**call["args"])), tool_call_id=call["id"])]
    final = llm.bind_tools([multiply]).invoke(messages)
    assert not final.tool_calls and final.text.strip()
