"""Structured outputs by constrained decoding: ``response_format``, forced and ``strict`` tool calls.

A request that asks for a structure gets one grammar, compiled once per (tokenizer, grammar) and kept;
each sample row gets a :class:`GrammarProcessor` (the scheduler's ``RowProcessor`` seam), which advances
a matcher by the tokens the row sampled since its last call and sets the logits of every token the
grammar does not allow next to ``-inf``. Once the grammar is complete only the stop tokens remain
allowed, so the reply ends there. It runs after ``logit_bias`` and the penalties, before temperature
and top-p: the logprobs returned are those of the masked distribution, the one each token was drawn
from (docs/serving.md, "Structured outputs", says what that means for training on such samples).

What asks for a grammar (:func:`chat_constraint`):

* ``response_format`` ``{"type": "json_object"}`` (any JSON object) or ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}``; ``{"type": "text"}`` asks for nothing. The JSON is
  written on one line with ``", "`` and ``": "`` separators (no free whitespace for a small model to
  loop in), and holds no property the schema does not allow (xgrammar's strict mode: a schema that
  wants other keys says so with ``additionalProperties``).
* ``tool_choice`` ``"required"`` or a named function, ``parallel_tool_calls: false`` and ``strict``
  tools: the reply's shape in lmforge's call format (``tools.call_format``).
* both: with tools that the model may call (``tool_choice`` "auto") and a ``response_format``, the
  reply is either the JSON or calls.

The library is xgrammar, chosen by what was measured here (docs/serving.md has the figures and the
machine): with SmolLM2's 49,152-token vocabulary it fills and applies a JSON-schema mask in about
0.2 ms per token on 2 CPU cores, where llguidance 1.9.1 took about 4.5 ms (and 23 s for its first
mask); outlines-core 0.2 compiles a regex index per schema up front and has no tool-call (structural
tag) format. Install size: the xgrammar wheel is 1.3 MB (llguidance 3.1 MB, outlines-core 2.3 MB),
but on Linux x86-64 it requires ``triton``, which PyTorch's own Linux wheels from PyPI already
require; only an install of PyTorch's CPU-only wheels pays for it (about 1 GB unpacked). Its
structural tags express free text in which every tool call must follow a schema, which ``strict``
tools under ``tool_choice: "auto"`` need. It is an optional extra, imported when a request first needs
it: ``pip install 'lmforge[grammar]'``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
from typing import Any, Callable

from .tools import ToolRequestError, call_format, forces_call, request_tools

INSTALL_HINT = "pip install 'lmforge[grammar]' (or: pip install xgrammar)"
MAX_CACHED_GRAMMARS = 256  # compiled grammars kept per tokenizer, least recently used dropped first
log = logging.getLogger(__name__)


class ConstraintError(ValueError):
    """A structure the server cannot decode to; ``param`` names the request field (a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What a reply must match: a JSON schema, or an xgrammar structural tag (``kind``), as JSON (``spec``,
    the cache key; keys in the request's order, since properties are generated in the schema's order); ``param`` is
    the request field that asked for it, ``schemas`` the fields
    whose schemas a structural tag holds (an error names the one that does not compile)."""

    kind: str  # "json_schema" | "structural_tag"
    spec: str
    param: str
    schemas: tuple[tuple[str, str], ...] = ()  # (field, JSON schema) of the schemas a structural tag holds


def _xgrammar(param: str):
    try:
        import xgrammar
    except ImportError as exc:
        raise ConstraintError(
            f"{param} needs constrained decoding, which needs the xgrammar package on the server: {INSTALL_HINT}", param
        ) from exc
    return xgrammar


# ---------------------------------------------------------------------------------------------------
# What a chat request asks for
# ---------------------------------------------------------------------------------------------------


def reply_schema(response_format) -> dict | None:
    """The JSON schema a ``response_format`` asks the reply to match (None: plain text)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "object"}
    schema = response_format.json_schema.schema_
    return {} if schema is None else schema  # OpenAI: no schema, any JSON


def chat_constraint(body) -> Constraint | None:
    """The grammar a ChatRequest's reply must follow, or None (module doc)."""
    tools, parse_tools = request_tools(body)
    schema = reply_schema(body.response_format)
    reply_param = "response_format.json_schema.schema"
    if parse_tools and forces_call(body):  # the reply is calls only: a response_format has nothing to shape
        return _tag(*call_format(tools, body, text=False), "tool_choice")
    if schema is not None and parse_tools:  # the JSON answer, or calls
        calls, schemas = call_format(tools, body, text=False, force=False)
        either = {
            "type": "or",
            "elements": [{"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}, calls],
        }
        return _tag(either, [(reply_param, schema), *schemas], "response_format")
    if schema is not None:
        return Constraint("json_schema", json.dumps(schema), reply_param)
    if parse_tools and (body.parallel_tool_calls is False or any(t["function"].get("strict") for t in tools)):
        param = "parallel_tool_calls" if body.parallel_tool_calls is False else "tools"
        return _tag(*call_format(tools, body, text=True), param)
    return None


def _tag(fmt: dict, schemas: list[tuple[str, dict]], param: str) -> Constraint:
    spec = json.dumps({"type": "structural_tag", "format": fmt})
    return Constraint("structural_tag", spec, param, tuple((p, json.dumps(s)) for p, s in schemas))


# ---------------------------------------------------------------------------------------------------
# Compiling, per tokenizer
# ---------------------------------------------------------------------------------------------------


class Grammars:
    """The compiled grammars of one tokenizer (thread-safe): xgrammar's vocabulary description is built
    on first use; compiled grammars are kept per :class:`Constraint` (``MAX_CACHED_GRAMMARS``)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, list(stop_token_ids)
        self._compiler = None
        self._compiled: collections.OrderedDict[Constraint, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def compiled(self, constraint: Constraint):
        """The compiled grammar of ``constraint``; a schema xgrammar cannot compile is a ConstraintError."""
        with self._lock:
            if constraint in self._compiled:
                self._compiled.move_to_end(constraint)
                return self._compiled[constraint]
            compiler = self._compiler or self._make_compiler(constraint.param)
            try:
                if constraint.kind == "json_schema":
                    grammar = _compile_schema(compiler, constraint.spec, constraint.param)
                else:
                    for param, schema in constraint.schemas:  # name the field whose schema is at fault
                        _compile_schema(compiler, schema, param)
                    grammar = compiler.compile_structural_tag(constraint.spec)
            except ConstraintError:
                raise
            except Exception as exc:  # xgrammar raises RuntimeError / its own errors
                raise ConstraintError(
                    f"{constraint.param}: this cannot be compiled to a grammar: {_reason(exc)}", constraint.param
                ) from exc
            self._compiled[constraint] = grammar
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
            return grammar

    def processors(self, constraint: Constraint) -> list[Callable[[], "GrammarProcessor"]]:
        """``GenerationRequest.processors`` for ``constraint``: one fresh matcher per sample row."""
        grammar = self.compiled(constraint)
        return [lambda: GrammarProcessor(grammar, self.vocab_size)]

    def _make_compiler(self, param: str):
        xgr = _xgrammar(param)
        self._compiler = xgr.GrammarCompiler(tokenizer_info(xgr, self.tokenizer, self.vocab_size, self.stop_token_ids))
        return self._compiler


def _compile_schema(compiler, schema: str, param: str):
    try:
        return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
    except Exception as exc:  # RuntimeError for a schema xgrammar does not support or cannot resolve
        raise ConstraintError(
            f"{param}: this JSON schema cannot be compiled to a grammar: {_reason(exc)}", param
        ) from exc


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


def tokenizer_info(xgr, tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's description of ``tokenizer``'s vocabulary (size ``vocab_size``, the model's), with the
    special tokens (``<|im_start|>``, ``<pad>``, ...) as empty strings: xgrammar then never allows them.
    Left as their text, they would be allowed wherever their characters are (inside a JSON string)."""
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    vocab = [""] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if index < vocab_size:
            vocab[index] = token
    special = {*tokenizer.all_special_ids, *(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)}
    for index in special:
        if index < vocab_size:
            vocab[index] = ""
    return xgr.TokenizerInfo(
        vocab,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids,
        add_prefix_space=detected.add_prefix_space,
    )


# ---------------------------------------------------------------------------------------------------
# The per-row processor
# ---------------------------------------------------------------------------------------------------


class GrammarProcessor:
    """A ``RowProcessor``: masks one row's logits (V,) to the tokens ``grammar`` allows next.

    Each call first feeds the matcher the tokens sampled since the last call. A token the grammar
    rejects cannot be sampled while the mask is applied; should one come anyway (another processor
    undoing the mask), the row goes on unconstrained with a warning in the server log, rather than
    failing the whole batch from the scheduler thread.
    """

    def __init__(self, grammar, vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(grammar)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # (1, ceil(V / 32)) int32
        self.seen = 0  # tokens of the row fed to the matcher
        self.broken = False

    def process(self, logits, prompt_ids: list[int], tokens: list[int]) -> None:
        for token in tokens[self.seen :]:
            if not self.broken and not self.matcher.accept_token(token):
                self.broken = True
                log.warning(
                    "a sampled token (%d) does not follow the request's grammar; the rest of this sample "
                    "is not constrained",
                    token,
                )
        self.seen = len(tokens)
        if self.broken or self.matcher.is_terminated():
            return
        self.mask(logits)

    def mask(self, logits) -> None:
        """Set the logits of the tokens the grammar does not allow next to -inf (in place)."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        bitmask = self.bitmask if logits.device.type == "cpu" else self.bitmask.to(logits.device, non_blocking=True)
        self._xgr.apply_token_bitmask_inplace(logits.unsqueeze(0), bitmask)


def chat_processors(grammars: Grammars, body) -> list[Callable[[], GrammarProcessor]]:
    """The processors a chat request's structure needs ([] for none, and for completion requests)."""
    if not hasattr(body, "response_format"):
        return []
    try:
        constraint = chat_constraint(body)
    except ToolRequestError as exc:
        raise ConstraintError(str(exc), exc.param) from exc
    if constraint is None:
        return []
    if body.ignore_eos:
        raise ConstraintError(
            "ignore_eos cannot be combined with a structured reply (response_format, a forced "
            "or strict tool call): the grammar ends the reply with a stop token",
            "ignore_eos",
        )
    if getattr(body, "continue_final_message", False):
        raise ConstraintError(
            "continue_final_message cannot be combined with a structured reply: the grammar "
            "starts at the reply's first token, not inside the message continued",
            "continue_final_message",
        )
    if getattr(body, "min_tokens", 0):
        raise ConstraintError(
            "min_tokens cannot be combined with a structured reply (response_format, a forced "
            "or strict tool call): a complete reply may be shorter",
            "min_tokens",
        )
    return grammars.processors(constraint)
