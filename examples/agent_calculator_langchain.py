"""examples/agent_calculator.py's calculator agent written with LangChain: ``ChatOpenAI(...).bind_tools``
and ``ToolMessage`` replies, nothing lmforge-specific (the same tool, the same limits).

lmforge trains it unmodified with ``rollout.backend=agent`` (examples/grpo_agent_calculator_langchain.yaml,
docs/agents.md). Needs ``pip install langchain-openai``. Against any OpenAI-compatible endpoint:

    python examples/agent_calculator_langchain.py http://127.0.0.1:8000/v1 "123*456="
"""

import os
import sys

from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the plain agent's tool and HTTP client:
from agent_calculator import HTTP, TOOLS, calculator


def run(base_url: str, problem: dict, max_turns: int = 3) -> str:
    """Answer ``problem["prompt"]`` with the calculator's help; the final answer's text."""
    llm = ChatOpenAI(model="policy", base_url=base_url, api_key="unused", max_retries=0, http_client=HTTP)
    llm = llm.bind_tools(TOOLS)
    messages = [HumanMessage(problem["prompt"])]
    for _ in range(max_turns):
        reply = llm.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            return str(reply.text)
        for call in reply.tool_calls:
            result = calculator(str(call["args"].get("expression", "")))
            messages.append(ToolMessage(result, tool_call_id=call["id"], name=call["name"]))
    return ""


if __name__ == "__main__":
    print(run(sys.argv[1], {"prompt": sys.argv[2]}))
