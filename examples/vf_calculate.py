"""A verifiers v1 environment, written as a verifiers user writes one (nothing lmforge in it): arithmetic
with a ``calculate`` tool. Taskset id ``vf-calculate`` (this module on ``PYTHONPATH``, e.g.
``PYTHONPATH=examples``); docs/verifiers.md runs it with ``vf-eval`` against ``lmforge serve`` and
trains on it with ``lmforge grpo examples/grpo_verifiers.yaml``.

Each task asks for a product or sum of two numbers, generated in code from a seed (no dataset is
downloaded). The model may call ``calculate`` (an MCP tool server, run by verifiers in its own
process) and then answers with ``<answer>N</answer>``; the reward is 1 when N (or, without the tags, the
reply's last number) is the right value.
A second signal, ``used_tool``, is recorded as a metric.
"""

import ast
import operator
import random
import re

import verifiers.v1 as vf

_ANSWER = re.compile(r"<answer>\s*(-?[\d,]+)\s*</answer>")
_NUMBER = re.compile(r"-?\d[\d,]*")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int:
    """The value of an integer expression of + - * and parentheses (nothing else is evaluated)."""

    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not an integer expression of + - *: {expression!r}")

    return value(ast.parse(expression.replace(",", ""), mode="eval"))


class CalculateToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the model sees the bare name `calculate`

    @vf.tool
    def calculate(self, expression: str) -> str:
        """Evaluate an integer arithmetic expression (+, -, *, parentheses), e.g. "347 * 29"."""
        try:
            return str(evaluate(expression))
        except (ValueError, SyntaxError) as exc:
            return f"error: {exc}"


class CalculateData(vf.TaskData):
    answer: int


class CalculateTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalculateTask(vf.Task[CalculateData, vf.State, CalculateTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalculateTaskConfig) -> list[vf.Toolset]:
        return [CalculateToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """The <answer> value, else the reply's last number, is the right one."""
        found = _ANSWER.findall(trace.last_reply) or _NUMBER.findall(trace.last_reply)
        return float(bool(found) and found[-1].replace(",", "") == str(self.data.answer))

    @vf.metric
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))


class CalculateConfig(vf.TasksetConfig):
    num_tasks: int = 200
    """How many problems to generate."""
    digits: int = 3
    """Digits of each operand."""
    seed: int = 0
    """Seed of the generated problems."""
    task: CalculateTaskConfig = CalculateTaskConfig()


# Small models call a tool more often when shown a call; the Hermes format shown is the common one (lmforge
# serve's default, Qwen's and Hermes' templates).
SYSTEM_PROMPT = (
    "You can call the tool `calculate` to do arithmetic, like this:\n"
    '<tool_call>{"name": "calculate", "arguments": {"expression": "12 * 34"}}</tool_call>\n'
    "When you know the result, reply with it as <answer>N</answer>."
)


class CalculateTaskset(vf.Taskset[CalculateTask, CalculateConfig]):
    def load(self) -> list[CalculateTask]:
        rng = random.Random(self.config.seed)
        low, high = 10 ** (self.config.digits - 1), 10**self.config.digits - 1
        tasks = []
        for i in range(self.config.num_tasks):
            a, b = rng.randint(low, high), rng.randint(low, high)
            op = "*" if i % 2 == 0 else "+"
            tasks.append(
                CalculateTask(
                    CalculateData(
                        id=f"calc-{i}",
                        prompt=f"Use the calculate tool: what is {a} {op} {b}?",
                        system_prompt=SYSTEM_PROMPT,
                        answer=evaluate(f"{a} {op} {b}"),
                    ),
                    self.config.task,
                )
            )
        return tasks


__all__ = ["CalculateTaskset"]


if __name__ == "__main__":
    CalculateToolset.run()
