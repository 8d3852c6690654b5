"""Agent frameworks nobody here wrote, unmodified, against a real ``lmforge serve``: the rows of the client
compatibility table in docs/serving.md that no other test file drives (openai tool loops that send the
streamed or ``model_dump()``-ed reply back, smolagents' ``ToolCallingAgent``, the OpenAI Agents SDK over
chat completions with its default strict tools). Each skips when its package is absent; CI installs them.

The model is a tiny random Llama on the ASCII character tokenizer with a context long enough for the
frameworks' system prompts (smolagents' is about 8,000 characters). Left to itself it writes noise, so
every tool call below comes from constrained decoding (``tool_choice`` "required" or a forced call, the
frameworks' defaults), and what is checked is that each framework's own loop completes against the server:
no request refused, every call parsed by the framework, the tool run with arguments of its schema.
"""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two small numbers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 9},
                "b": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def long_context_model(make_ascii):
    return make_ascii(context=32768, seed=1)


@pytest.fixture
def server(serve_model, long_context_model):
    return serve_model(*long_context_model)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


MAX_TOKENS = 400  # a random model's free-text argument (final_answer's) can outrun a smaller budget


def _tool_result(call) -> dict:
    args = json.loads(call.function.arguments)
    return {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}


def test_openai_tool_loop_sends_back_the_streamed_reply_with_its_indices(client):
    """The openai SDK's stream helper accumulates the deltas into a message whose tool calls carry
    ``index``; a tool loop appends ``model_dump()`` of it (``refusal``, ``parsed`` and all) and the result."""
    messages = [{"role": "user", "content": "2+3?"}]
    with client.chat.completions.stream(
        model="tiny-test",
        messages=messages,
        tools=[ADD_TOOL],
        tool_choice="required",
        temperature=1.0,
        seed=0,
        max_tokens=200,
    ) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and message.tool_calls
    sent_back = message.model_dump()
    assert "refusal" in sent_back and all("index" in c for c in sent_back["tool_calls"])  # what the server must take
    messages += [sent_back] + [_tool_result(call) for call in message.tool_calls]
    second = client.chat.completions.create(
        model="tiny-test",
        messages=messages,
        tools=[ADD_TOOL],
        tool_choice="required",
        temperature=1.0,
        seed=1,
        max_tokens=200,
    )
    assert second.choices[0].finish_reason == "tool_calls"
    for call in second.choices[0].message.tool_calls:
        assert set(json.loads(call.function.arguments)) == {"a", "b"}


def test_openai_tool_loop_sends_back_model_dump_of_the_plain_reply(client, long_context_model):
    messages = [{"role": "user", "content": [{"type": "text", "text": "2+3?"}]}]  # content as parts
    first = client.chat.completions.create(
        model="tiny-test",
        messages=messages,
        tools=[ADD_TOOL],
        tool_choice={"type": "function", "function": {"name": "add"}},
        temperature=1.0,
        seed=0,
        max_tokens=200,
    )
    message = first.choices[0].message
    [call] = message.tool_calls
    messages += [message.model_dump(), _tool_result(call)]
    second = client.chat.completions.create(
        model="tiny-test",
        messages=messages,
        temperature=1.0,
        seed=0,
        max_tokens=8,
        store=False,
        metadata={"run": "test"},
        user="me",
    )
    assert second.choices[0].finish_reason in ("stop", "length")
    rendered = long_context_model[1].decode(second.model_extra["prompt_token_ids"])
    assert _tool_result(call)["content"] in rendered  # the tool's answer reached the model's prompt


def test_smolagents_tool_calling_agent_runs_its_loop(server):
    """smolagents' ToolCallingAgent sends content as text parts and ``tool_choice: "required"`` on every
    step; each step's reply is parsed by smolagents itself and its tool run. It ends with ``final_answer``
    or, at ``max_steps``, with its own plain final-answer call."""
    smolagents = pytest.importorskip("smolagents")
    ran = []

    @smolagents.tool
    def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: the first number
            b: the second number
        """
        ran.append((a, b))
        return a + b

    model = smolagents.OpenAIServerModel(
        model_id="tiny-test",
        api_base=server.url + "/v1",
        api_key="unused",
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        seed=0,
    )
    agent = smolagents.ToolCallingAgent(tools=[add], model=model, max_steps=3, verbosity_level=0)
    agent.run("What is 2+3?")
    steps = [s for s in agent.memory.steps if isinstance(s, smolagents.memory.ActionStep)]
    called = [s for s in steps if s.tool_calls]
    assert called, "no step made a tool call"
    for step in steps:  # a refused request would be an AgentGenerationError, an unparsable reply a parse error
        cut = step.token_usage is not None and step.token_usage.output_tokens >= MAX_TOKENS  # a string ran long
        expected = (smolagents.utils.AgentToolExecutionError, smolagents.utils.AgentMaxStepsError)
        assert step.error is None or cut or isinstance(step.error, expected), step.error
        assert all(call.name in ("add", "final_answer") for call in step.tool_calls or [])
    assert all(type(a) is int and type(b) is int for a, b in ran)


def test_openai_agents_sdk_over_chat_completions_with_a_strict_tool(server):
    """The Agents SDK's ``OpenAIChatCompletionsModel`` with its default ``@function_tool`` (strict schema)
    and ``tool_choice="required"`` for the first turn: the SDK runs the tool and completes the run."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    ran = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        ran.append((a, b))
        return a + b

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = agents.OpenAIChatCompletionsModel(model="tiny-test", openai_client=client)
    agent = agents.Agent(
        name="adder",
        instructions="Use the tool.",
        tools=[add],
        model=model,
        model_settings=agents.ModelSettings(
            tool_choice="required", temperature=1.0, max_tokens=200, extra_args={"seed": 0}
        ),
        reset_tool_choice=True,
    )
    result = agents.Runner.run_sync(agent, "What is 2+3?", max_turns=3)
    assert ran, [item.raw_item for item in result.new_items]
    assert all(type(a) is int and type(b) is int for a, b in ran)
    assert isinstance(result.final_output, str)
