"""``calculator``: multi-digit multiplication with a calculator tool, for tiny models learning tool use.

The problems are the ``multiplication`` task's (``data.task: multiplication:digits=3``): the user asks
``"123*456="``. A tiny char-level model cannot multiply three-digit numbers, but it can copy the two
operands into a tool call and the tool's result into its answer::

    user       123*456=
    assistant  <tool_call>
               {"name": "calculator", "arguments": {"expression": "123*456"}}
               </tool_call>
    tool       56088
    assistant  56088

The final answer (the first reply without a tool call) is scored exactly: reward part ``correct`` is
1.0 when its text, stripped, is the product, else 0.0; the episode ends there.

``demo_tool_rate=p`` (< 1) makes the scripted expert of the SFT warm-up call the tool on a fraction ``p``
of the problems only and answer the others at once with a rough estimate, ``about`` and the product of
the operands' leading digits followed by zeros (``123*456=`` -> ``about 40000``, always scored wrong). A
warm-up on such demonstrations teaches the call and the copies, and the habit of estimating instead:
with ``p`` under one half a greedy model estimates (and fails), while sampling still calls the tool at
times -- RL then has to learn that the tool pays (examples/grpo_calculator.yaml). Every estimate starts
with the same word, so the choice between calling and estimating is made at one position with the odds
the demonstrations taught (a bare number's first digit is spread over nine choices, and greedy decoding
then picks the call even at ``p = 0.2``). Tool calls, invalid
calls and tool errors are counted by :class:`ToolEnv`. :meth:`Calculator.demonstration` is the scripted
expert of the SFT warm-up (lmforge.envs.demos).
"""

from __future__ import annotations

import ast
import operator
import random

from ..core.errors import ConfigError
from .base import EpisodeState, Message, StepResult
from .tool_env import ToolEnv, problem_prompt
from .toolcalls import ToolCall, format_tool_calls

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_MAX_DIGITS = 60  # larger intermediate results are refused: a runaway expression must not eat the CPU
_MAX_CHARS = 200


def calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression with + - * and parentheses.

    Args:
        expression: the expression, e.g. 123*456
    """
    if len(expression) > _MAX_CHARS:
        raise ValueError(f"the expression has {len(expression)} characters; at most {_MAX_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}; write integers with + - * and parentheses") from None
    return str(_evaluate(tree.body))


def _evaluate(node: ast.AST) -> int:
    """The value of an integer ``+ - *`` expression tree; ValueError for anything else."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        value = _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    else:
        raise ValueError(f"unsupported {ast.unparse(node)!r}: only integers, + - * and parentheses")
    if len(str(abs(value))) > _MAX_DIGITS:
        raise ValueError(f"a result has more than {_MAX_DIGITS} digits")
    return value


class Calculator(ToolEnv):
    """Multiplication problems, one ``calculator`` tool, the final answer scored exactly (module doc)."""

    def __init__(self, demo_tool_rate: float = 1.0):
        super().__init__([calculator])
        if (
            isinstance(demo_tool_rate, bool)
            or not isinstance(demo_tool_rate, (int, float))
            or not 0.0 <= demo_tool_rate <= 1.0
        ):
            raise ValueError(f"demo_tool_rate must be a number in [0, 1], got {demo_tool_rate!r}")
        self.demo_tool_rate = float(demo_tool_rate)

    def finish(self, state: EpisodeState, message: Message) -> StepResult:
        correct = message["content"].strip() == str(_answer(state.problem))
        return StepResult([], {"correct": float(correct)}, done=True)

    def demonstration(self, state: EpisodeState, rng: random.Random) -> str:
        """What the scripted expert replies next: the tool call on the prompt's expression, then the
        tool's result as the answer -- or, on a fraction ``1 - demo_tool_rate`` of the problems, at once
        the leading-digit estimate (module doc)."""
        last = state.messages[-1]
        if last["role"] == "tool":
            return last["content"]
        expression = problem_prompt(state.problem).strip().rstrip("=").strip()
        if self.demo_tool_rate < 1.0 and rng.random() >= self.demo_tool_rate:
            return f"about {estimate(expression)}"
        return format_tool_calls([ToolCall("calculator", {"expression": expression}, id="")])


def estimate(expression: str) -> str:
    """The leading-digit estimate of a product ``a*b`` of positive integers: each operand rounded down to
    its first digit, e.g. ``"123*456"`` -> ``"40000"`` (100 * 400)."""
    parts = [part.strip() for part in expression.split("*")]
    if len(parts) != 2 or not all(part.isdigit() for part in parts):
        raise ConfigError(
            f"calculator: demo_tool_rate < 1 estimates products of two positive integers "
            f"(data.task=multiplication), got the problem {expression!r}"
        )
    a, b = parts
    return str(int(a[0]) * int(b[0])) + "0" * (len(a) - 1 + len(b) - 1)


def _answer(problem) -> str:
    return problem["answer"] if isinstance(problem, dict) else problem.answer
