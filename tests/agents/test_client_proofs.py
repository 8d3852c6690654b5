"""Issue 36 item 4 (a): three agent clients nobody here wrote -- the ``openai`` package's tool loop (the
example agent, and the SDK's streaming helper), LangChain's ``ChatOpenAI(...).bind_tools(...)`` loop and
the OpenAI Agents SDK -- run unmodified as agent functions through lmforge's gateway (``AgentRunner``
on a ``PolicyServer`` with a ``SessionRecorder``). For each: every call recorded, each call's prompt the
conversation it sent with the earlier replies as their sampled ids, each call's sampled ids and logprobs
trained verbatim in ONE sample per episode, and the GRPO trainer's fp32 logprobs on the packed batch
equal to the recorded ones within 1e-5 (``agent_exactness.check_exact``). The model (conftest.py) calls
the calculator on every turn, so each episode runs the clients' whole loop: 3 calls, 2 tool results.
"""

from __future__ import annotations

import json

import pytest
from agent_exactness import ROOT, TOOLS, calculator, check_exact

from lmforge.rl.sources.agent import load_agent

openai = pytest.importorskip("openai")

PROBLEMS = [{"prompt": "12*34=", "answer": "408"}, {"prompt": "What is 7+58?", "answer": "65"}]
TURNS = 3  # each client's max turns: the model calls the tool on each


def _proof(gateway, function, seed: int) -> dict:
    """Two problems, two episodes each, all at once; the check, and each episode a full 3-call loop."""
    episodes = gateway.run(function, PROBLEMS, group_size=2, seed=seed)
    figures = check_exact(gateway, episodes)
    # The model's calls parse nearly always (conftest.py); an episode whose reply did not parse ends early.
    assert sorted(figures["calls"])[1:] == [TURNS] * 3, figures  # the whole loop: calls sent back and answered
    assert figures["samples_per_episode"] == 1.0
    counts = figures["counts"]
    assert counts.get("num_text_rendered_turns", 0) == 0 and counts["num_agent_errors"] == 0, counts
    print(f"max |trainer - recorded| logprob: {figures['max_abs_diff']:.3g}")
    return figures


def test_openai_example_tool_loop(recording_gateway):
    """examples/agent_calculator.py's ``run``, as ``rollout.agent_entry`` names it."""
    _proof(recording_gateway, load_agent(f"{ROOT}/examples/agent_calculator.py:run"), seed=1)


def run_streaming(base_url: str, problem: dict, max_turns: int = TURNS) -> str:
    """The same loop over the SDK's streaming helper; the accumulated message sent back as ``model_dump()``
    (tool calls with ``index``, ``refusal``, ``parsed``: what such loops send)."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": problem["prompt"]}]
    for _ in range(max_turns):
        with client.chat.completions.stream(model="policy", messages=messages, tools=TOOLS) as stream:
            message = stream.get_final_completion().choices[0].message
        messages.append(message.model_dump())
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            expression = json.loads(call.function.arguments).get("expression", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(str(expression))})
    return ""


def test_openai_streaming_tool_loop(recording_gateway):
    _proof(recording_gateway, run_streaming, seed=2)


def run_langchain(base_url: str, problem: dict, max_turns: int = TURNS) -> str:
    """LangChain's tool loop: ``bind_tools`` with the example's schema, ``ToolMessage`` results."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(model="policy", base_url=base_url, api_key="unused", max_retries=0).bind_tools(TOOLS)
    messages = [HumanMessage(problem["prompt"])]
    for _ in range(max_turns):
        reply = model.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            return str(reply.content)
        for call in reply.tool_calls:
            messages.append(ToolMessage(calculator(str(call["args"].get("expression", ""))), tool_call_id=call["id"]))
    return ""


def test_langchain_bind_tools_loop(recording_gateway):
    pytest.importorskip("langchain_openai")
    _proof(recording_gateway, run_langchain, seed=3)


async def run_agents_sdk(base_url: str, problem: dict, max_turns: int = TURNS) -> float:
    """The OpenAI Agents SDK: an ``Agent`` with a function tool on ``OpenAIChatCompletionsModel`` over an
    ``AsyncOpenAI`` client at the episode's URL; its ``Runner`` drives the loop (an async agent function)."""
    import agents

    agents.set_tracing_disabled(True)

    @agents.function_tool(name_override="calculator", strict_mode=False)
    def calculator_tool(expression: str) -> str:
        """Evaluate an integer arithmetic expression with + - * and parentheses."""
        return calculator(expression)

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    agent = agents.Agent(
        name="calculator",
        tools=[calculator_tool],
        model=agents.OpenAIChatCompletionsModel(model="policy", openai_client=client),
    )
    try:
        result = await agents.Runner.run(agent, problem["prompt"], max_turns=max_turns)
    except agents.MaxTurnsExceeded:  # the model calls the tool on every turn
        return 0.0
    return float(str(result.final_output).strip() == problem["answer"])


def test_openai_agents_sdk_runner(recording_gateway):
    pytest.importorskip("agents")
    _proof(recording_gateway, run_agents_sdk, seed=4)
