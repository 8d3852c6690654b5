"""The calculator task as an agent of its own: a plain ``openai`` tool loop, nothing lmforge-specific.

lmforge trains it unmodified with ``rollout.backend=agent`` (examples/grpo_agent_calculator.yaml,
docs/agents.md): each episode calls ``run(base_url, problem)`` with its own base URL on the served policy.
The same function runs against any OpenAI-compatible endpoint:

    python examples/agent_calculator.py http://127.0.0.1:8000/v1 "123*456="
"""

import ast
import json
import sys

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an integer arithmetic expression with + - * and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "the expression, e.g. 123*456"}},
                "required": ["expression"],
            },
        },
    }
]
# One HTTP client for all episodes: building one (its TLS context) took ~0.15 s of CPU on the shared 2-core
# test machine, paid per episode otherwise (docs/benchmarks.md, "Agent path vs the built-in environment").
HTTP = openai.DefaultHttpxClient()


def calculator(expression: str) -> str:
    """+ - * and parentheses on integers, nothing else."""

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Sub, ast.Mult):
            a, b = value(node.left), value(node.right)
            return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        raise ValueError(f"unsupported: {ast.unparse(node)}")

    try:
        return str(value(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError) as exc:
        return f"error: {exc}"


def run(base_url: str, problem: dict, max_turns: int = 3) -> str:
    """Answer ``problem["prompt"]`` with the calculator's help; the final answer's text (scored by the run's
    rewards.functions, here the task's exact-answer check)."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", http_client=HTTP)
    messages = [{"role": "user", "content": problem["prompt"]}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return reply.content or ""
        for call in reply.tool_calls:
            arguments = json.loads(call.function.arguments)
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "name": call.function.name,
                    "content": calculator(str(arguments.get("expression", ""))),
                }
            )
    return ""


if __name__ == "__main__":
    print(run(sys.argv[1], {"prompt": sys.argv[2]}))
