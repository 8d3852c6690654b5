"""``ToolEnv``: an environment built from typed Python functions (tools).

Each ``<tool_call>`` block of an assistant message is answered by a role "tool" message holding the
function's result; a call that cannot be made (malformed block, unknown tool, wrong arguments) or a
tool that raises is answered with an error message the model can read, and counted in
``state.counts`` (the runner ends the episode after ``env.max_invalid_calls`` invalid calls). A
reply without a tool call is the final answer: :meth:`ToolEnv.finish` scores it and ends the
episode. Subclasses pass their tools and override ``reset`` (the first messages) and ``finish``::

    def multiply(a: int, b: int) -> int:
        \"\"\"Multiply two integers.\"\"\"
        return a * b

    class Multiply(ToolEnv):
        def __init__(self):
            super().__init__([multiply])
        def finish(self, state, message):
            right = message["content"].strip().endswith(str(state.problem.answer))
            return StepResult([], {"correct": float(right)}, done=True)
"""

from __future__ import annotations

from typing import Any, Callable

from ..core.errors import ConfigError
from .base import EpisodeState, Message, StepResult
from .toolcalls import function_schema, parse_tool_calls

# state.counts keys a ToolEnv increments (the runner sums them into the step's metrics)
TOOL_CALLS, INVALID_CALLS, TOOL_ERRORS = "tool_calls", "invalid_tool_calls", "tool_errors"


def problem_prompt(problem: Any) -> str:
    """A task problem's ``prompt`` (or a data row's ``"prompt"``)."""
    return problem["prompt"] if isinstance(problem, dict) else problem.prompt


class ToolEnv:
    """An environment whose tools are ``functions`` (module doc). One instance serves every episode."""

    def __init__(self, functions: list[Callable]):
        self.functions = {fn.__name__: fn for fn in functions}
        if len(self.functions) != len(functions):
            raise ConfigError(f"ToolEnv: two tools share a name in {[fn.__name__ for fn in functions]}")
        self.tools = [function_schema(fn) for fn in functions]

    def reset(self, problem: Any, state: EpisodeState) -> list[Message]:
        """One user message: the problem's prompt."""
        return [{"role": "user", "content": problem_prompt(problem)}]

    def finish(self, state: EpisodeState, message: Message) -> StepResult:
        """Score the final answer ``message`` (a reply without tool calls)."""
        raise NotImplementedError(f"{type(self).__name__} must define finish(state, message) -> StepResult")

    def step(self, state: EpisodeState, message: Message) -> StepResult:
        parsed = parse_tool_calls(message["content"])
        if not parsed.calls and not parsed.errors:
            return self.finish(state, message)
        replies = [self._invalid(state, error) for error in parsed.errors]
        for call in parsed.calls:
            state.counts[TOOL_CALLS] = state.counts.get(TOOL_CALLS, 0) + 1
            replies.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "name": call.name,
                    "content": self._call(state, call.name, call.arguments),
                }
            )
        return StepResult(replies, {}, done=False)

    def _invalid(self, state: EpisodeState, error: str) -> Message:
        state.counts[INVALID_CALLS] = state.counts.get(INVALID_CALLS, 0) + 1
        return {"role": "tool", "content": f"error: {error}"}

    def _call(self, state: EpisodeState, name: str, arguments: dict) -> str:
        """The tool's result as text, or an error the model can read (counted)."""
        fn = self.functions.get(name)
        if fn is None:
            state.counts[INVALID_CALLS] = state.counts.get(INVALID_CALLS, 0) + 1
            return f"error: no tool named {name!r}; the tools are {', '.join(self.functions)}"
        try:
            return str(fn(**arguments))
        except TypeError as exc:  # wrong or missing arguments (or a TypeError inside the tool)
            state.counts[INVALID_CALLS] = state.counts.get(INVALID_CALLS, 0) + 1
            return f"error: {name}: {exc}"
        except Exception as exc:  # noqa: BLE001 -- the tool's own failure is the model's to read
            state.counts[TOOL_ERRORS] = state.counts.get(TOOL_ERRORS, 0) + 1
            return f"error: {name} raised {type(exc).__name__}: {exc}"
