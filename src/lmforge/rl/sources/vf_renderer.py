"""A ``renderers`` renderer that renders and parses chat as ``lmforge serve`` does, for models verifiers
has no renderer for (``rollout.backend=verifiers``, docs/verifiers.md).

renderers' fallback, ``DefaultRenderer``, refuses tools unless given a tool parser, and its parsers need
``<tool_call>`` to be one token: with a local model (SmolLM2, a char-level tiny model) every call of a
tool environment failed ("DefaultRenderer does not support tools"). :class:`LmforgeRenderer` is
``DefaultRenderer`` with lmforge's rendering (``envs.toolcalls.render_messages``: the template's tool
format where it has one, lmforge's default tools block otherwise) and lmforge's Hermes-style parser
(``parse_tool_calls`` on the decoded reply). verifiers loads it by name through renderers' custom
renderer config, ``{name: custom, import_path: lmforge.rl.sources.vf_renderer.LmforgeRenderer}``.

The classes are built on first access (module ``__getattr__``), so this module imports without renderers.
"""

from __future__ import annotations

from functools import cache

from ...envs.toolcalls import parse_tool_calls, render_messages
from ...model.safe_encode import encode_rendered, render_marked

IMPORT_PATH = "lmforge.rl.sources.vf_renderer.LmforgeRenderer"


@cache
def _classes() -> dict[str, type]:
    """The renderer and its config, built on first use (renderers is optional: every lmforge module imports
    without it)."""
    from renderers import DefaultRenderer, DefaultRendererConfig
    from renderers.base import ParsedResponse, ParsedToolCall, ToolCallParseStatus

    class LmforgeRendererConfig(DefaultRendererConfig):
        """No fields beyond DefaultRendererConfig's (template kwargs pass through to the chat template)."""

    class LmforgeRenderer(DefaultRenderer):
        """``DefaultRenderer`` rendering with ``render_messages`` and parsing ``<tool_call>`` blocks as text."""

        config_class = LmforgeRendererConfig

        @property
        def supports_tools(self) -> bool:
            return True

        def _apply(self, messages, *, tools=None, add_generation_prompt=False) -> list[int]:
            # the messages' text is encoded as text: only the template's own special tokens are control
            # tokens (a tool result printing "<|im_end|>" cannot close its turn; model.safe_encode)
            extra = dict(self.config.model_extra or {})
            rendered = render_marked(
                self._tokenizer,
                lambda msgs, tls: render_messages(
                    self._tokenizer, msgs, tls, add_generation_prompt=add_generation_prompt, **extra
                ),
                list(messages),
                tools or None,
            )
            return encode_rendered(self._tokenizer, rendered)

        def parse_response(self, token_ids: list[int], *, tools=None, prompt_ids=None) -> ParsedResponse:
            stops = set(self.get_stop_token_ids())
            ids = list(token_ids)
            while ids and ids[-1] in stops:
                ids.pop()
            reply = parse_tool_calls(self._tokenizer.decode(ids, skip_special_tokens=True))
            calls = [ParsedToolCall(raw="", name=c.name, arguments=c.arguments, id=c.id) for c in reply.calls]
            calls += [ParsedToolCall(raw=e, status=ToolCallParseStatus.INVALID_JSON) for e in reply.errors]
            return ParsedResponse(content=reply.content, tool_calls=calls)

    LmforgeRenderer.__module__ = LmforgeRendererConfig.__module__ = __name__
    return {"LmforgeRenderer": LmforgeRenderer, "LmforgeRendererConfig": LmforgeRendererConfig}


def __getattr__(name: str):
    """``LmforgeRenderer`` / ``LmforgeRendererConfig``, as renderers' custom loader asks for them by name."""
    if name in ("LmforgeRenderer", "LmforgeRendererConfig"):
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
