"""SFT data: rows of chat messages or prompt/completion pairs -> (input_ids, loss_mask) examples.

Row formats (JSONL, one object per line, or any table source of docs/data.md with the same columns,
mapped with ``data.columns`` where they are named otherwise; other keys are ignored):

    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    {"prompt": "37+48=", "completion": "58"}

How rows become tokens:

- Text is text: a special-token string inside a message, a tool schema, a prompt or a completion (say
  ``<|im_end|>`` in a user's message) is encoded as the characters it is made of, never as the control
  token; only the chat template's own special tokens are control tokens (``model.safe_encode``). A
  template that rewrites such a string so that it cannot be located is the row's error.
- ``messages`` rows are rendered with the tokenizer's chat template (or :data:`DEFAULT_CHAT_TEMPLATE`
  when it has none) and encoded without adding special tokens (the template adds what it wants). A
  row's optional ``tools`` (OpenAI tool schemas) go to the template too (``apply_chat_template(...,
  tools=...)``; a template without tool support ignores them).
- ``prompt``/``completion`` rows use the chat format (as one user and one assistant message) when
  :func:`uses_chat_format` says so, else the raw format ``ids(prompt) + ids(completion) + [eos]``,
  each piece encoded without special tokens.

Loss mask (``completion_only=True``): exactly the assistant tokens. In the raw format, the completion
tokens and the final eos. In the chat format, every assistant turn's content plus the end-of-turn
token that closes it (``<eos>`` in the default template, ``<|im_end|>`` in ChatML), but not the
whitespace a template puts after that token. The assistant text spans are found by rendering the
conversation prefix by prefix (the text before turn i with the generation prompt, and the text
through turn i); a token belongs to the mask when its first character lies in such a span, using the
tokenizer's offset mapping. With ``completion_only=False`` every token is trained on.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from ..core.errors import DataError
from ..model.safe_encode import (
    ControlTextError,
    encode_rendered,
    encode_rendered_starts,
    encode_text,
    holds_special,
    render_marked,
)
from ..model.tokenizer import DEFAULT_CHAT_TEMPLATE
from .source import read_rows

_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
# A small chat dataset (320 rows of short arithmetic, unit, capital and spelling Q&A) shipped with
# lmforge for the SFT examples: load_sft_rows(CHAT_SMALL).
CHAT_SMALL = Path(__file__).resolve().parent.parent / "assets" / "chat_small.jsonl"
# The names SFT reads from a row: what data.columns may map (lmforge.core.config.opt's keys).
COLUMN_NAMES = ("messages", "prompt", "completion")
_ROW_FORMATS = "each row needs either 'messages' (a list of {role, content}) or 'prompt' and 'completion' (strings)"


# ----------------------------------------------------------------------------- loading rows


def _check_row(row: object, where: str) -> dict:
    """Return ``row`` if it is a valid SFT row, else raise DataError naming ``where`` (file:line)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}; {_ROW_FORMATS}")
    has_messages, has_pair = "messages" in row, "prompt" in row or "completion" in row
    if has_messages and has_pair:
        raise DataError(f"{where}: row has both 'messages' and 'prompt'/'completion'; use one format")
    if has_messages:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise DataError(f"{where}: messages[{i}] must be an object with 'role' and 'content'")
            for key in ("role", "content"):
                if not isinstance(message.get(key), str):
                    if key not in message:
                        raise DataError(f"{where}: messages[{i}].{key} is missing")
                    kind = type(message[key]).__name__
                    raise DataError(f"{where}: messages[{i}].{key} must be a string, got {kind}")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: 'messages' has no assistant message, so there is nothing to train on")
        tools = row.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise DataError(f"{where}: 'tools' must be a list of OpenAI tool schemas (objects), got {tools!r:.80}")
        return row
    if has_pair:
        for key in ("prompt", "completion"):
            if key not in row:
                raise DataError(f"{where}: row has no '{key}' key; {_ROW_FORMATS}")
            if not isinstance(row[key], str):
                raise DataError(f"{where}: '{key}' must be a string, got {type(row[key]).__name__}")
        return row
    raise DataError(f"{where}: row has keys {sorted(row)}; {_ROW_FORMATS}")


def load_sft_rows(
    path: str | Path, split: str = "train", subset: str = "", columns: dict[str, str] | None = None
) -> list[dict]:
    """Read and validate the SFT rows of any source (:func:`lmforge.data.source.read_rows`): JSONL
    (``.jsonl``/``.json``/``.ndjson``), Parquet, CSV, Arrow, a ``save_to_disk`` directory or a cached
    hub id; ``columns`` maps ``messages`` / ``prompt`` / ``completion`` to the data's column names.

    Blank JSONL lines are skipped. Any malformed row raises DataError with ``file:line`` (JSONL) or
    ``source:row N`` (1-based) and what is wrong; a source without rows is an error too.
    """
    local = Path(path).expanduser()
    if local.suffix in (*_JSONL_SUFFIXES, ".parquet") and not local.is_file():
        raise DataError(f"{local}: SFT data file not found")
    found = read_rows(str(path), split, subset, columns, what="SFT data file")
    return [_check_row(row, where) for row, where in zip(found.rows, found.where)]


def row_texts(rows: list[dict]) -> list[str]:
    """The text of validated SFT rows as the data gives it: every message's content, or the prompt
    and completion (for the tokenizer check, :func:`lmforge.model.tokenizer.check_unknown_tokens`)."""
    return [
        text
        for row in rows
        for text in (
            [m["content"] for m in row["messages"]] if "messages" in row else [row["prompt"], row["completion"]]
        )
    ]


def sft_rows_from_task(task, n: int, seed: int, split: str) -> list[dict]:
    """``n`` prompt/completion rows (plus the ``answer``) from a synthetic task (lmforge.data.tasks)."""
    return [
        {"prompt": p.prompt, "completion": p.completion, "answer": p.answer} for p in task.make_problems(n, seed, split)
    ]


# ----------------------------------------------------------------------------- tokenizing


class SFTExample(NamedTuple):
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is trained on, aligned with input_ids


@dataclass
class SFTData:
    """Tokenized SFT examples and what happened to the rows that did not fit ``max_len``."""

    examples: list[SFTExample] = field(default_factory=list)
    num_truncated: int = 0  # cut to max_len, kept
    num_dropped: int = 0  # too long for "drop", or nothing left to train on after "right" truncation
    num_special_text: int = 0  # rows whose text held special-token strings, encoded as text

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def num_loss_tokens(self) -> int:
        return sum(sum(ex.loss_mask) for ex in self.examples)


def uses_chat_format(tokenizer, use_chat_template: str = "auto") -> bool:
    """Whether prompt/completion rows (and RL prompts) are wrapped in the chat template.

    ``"on"``: yes; ``"off"``: no; ``"auto"``: yes exactly when the tokenizer has its own chat template,
    i.e. one that is set and is not lmforge's :data:`DEFAULT_CHAT_TEMPLATE`. So an instruct model's
    tokenizer gets its chat format, while the char tokenizer and freshly trained BPE tokenizers (which
    carry the default template) get the raw ``prompt + completion + eos`` format.
    """
    if use_chat_template not in ("auto", "on", "off"):
        raise ValueError(f"use_chat_template must be 'auto', 'on' or 'off', got {use_chat_template!r}")
    if use_chat_template == "auto":
        template = getattr(tokenizer, "chat_template", None)
        return bool(template) and template != DEFAULT_CHAT_TEMPLATE
    return use_chat_template == "on"


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
    template = getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools
    )


@contextlib.contextmanager
def row_errors(where: str):
    """A chat template that rewrites a special-token string of a row (``ControlTextError``: it cannot be
    told from the template's own tokens) as that row's :class:`DataError`, ``where`` naming the row."""
    try:
        yield
    except ControlTextError as exc:
        raise DataError(f"{where}: {exc}") from None


def special_text_note(count: int, kind: str = "rows") -> str:
    """The line a command prints for the ``count`` (> 0) rows whose text held special-token strings."""
    return (
        f"[data] {count} {kind} hold special-token strings (like <|endoftext|>) in their text; they are "
        "encoded as the characters they are made of, not as control tokens (docs/data.md)"
    )


def _renderer(tokenizer, add_generation_prompt: bool):
    def render(messages: list[dict], tools: list[dict] | None) -> str:
        return _render(tokenizer, messages, add_generation_prompt, tools)

    return render


def _encode(tokenizer, text: str) -> list[int]:
    """A raw-format piece (a prompt, a completion) as text: a special-token string inside it is encoded
    as the characters it is made of, never as the control token (``model.safe_encode``)."""
    if holds_special(tokenizer, text):
        return encode_text(tokenizer, text)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    """The prompt ids exactly as SFT saw them before the completion (for sampling and RL)."""
    if chat:
        return encode_chat_prompt(tokenizer, [{"role": "user", "content": prompt}])
    return _encode(tokenizer, prompt)


def encode_prompts(tokenizer, texts: list[str], chat: bool, what: str = "prompt") -> list[list[int]]:
    """:func:`encode_prompt` of each text; a template that rewrites a special-token string of one is the
    :class:`DataError` of that ``what`` (1-based)."""
    ids = []
    for number, text in enumerate(texts, start=1):
        with row_errors(f"{what} {number}"):
            ids.append(encode_prompt(tokenizer, text, chat))
    return ids


def encode_chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """``messages`` through the chat template with the generation prompt, their text as text: the ids
    :func:`chat_example` has before the next assistant turn."""
    return encode_rendered(tokenizer, render_marked(tokenizer, _renderer(tokenizer, True), messages, tools))


def chat_example(
    tokenizer, messages: list[dict], completion_only: bool, tools: list[dict] | None = None, trained_from: int = 0
) -> SFTExample:
    """One conversation through the chat template; with ``completion_only`` the mask holds the
    assistant messages from index ``trained_from`` on (a preference pair's completion after its
    prompt's history: lmforge.data.preference)."""
    rendered = render_marked(tokenizer, _renderer(tokenizer, False), messages, tools)
    text = rendered.text
    input_ids, starts = encode_rendered_starts(tokenizer, rendered)  # the messages' strings as text
    if not completion_only:
        return SFTExample(input_ids, [1] * len(input_ids))
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < trained_from:
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
        through = _render(tokenizer, messages[: i + 1], add_generation_prompt=False, tools=tools)
        if not (text.startswith(before) and text.startswith(through) and through.startswith(before)):
            raise ValueError(
                "the chat template does not render conversations prefix by prefix (rendering the first "
                f"{i} message(s) is not a prefix of the whole), so assistant tokens cannot be located; "
                "use completion_only=False or a template without history rewriting"
            )
        spans.append((len(before), len(through.rstrip())))  # rstrip: not the newline after end-of-turn
    loss_mask = [int(any(lo <= start < hi for lo, hi in spans)) for start in starts]
    return SFTExample(input_ids, loss_mask)


def raw_example(tokenizer, prompt: str, completion: str, completion_only: bool) -> SFTExample:
    prompt_ids = _encode(tokenizer, prompt)
    completion_ids = _encode(tokenizer, completion) + [tokenizer.eos_token_id]
    mask = [int(not completion_only)] * len(prompt_ids) + [1] * len(completion_ids)
    return SFTExample(prompt_ids + completion_ids, mask)


def tokenize_sft(
    rows: list[dict],
    tokenizer,
    max_len: int,
    completion_only: bool = True,
    use_chat_template: str = "auto",
    truncation: str = "right",
) -> SFTData:
    """Tokenize validated rows (see module doc); ``truncation`` is ``"right"`` or ``"drop"``.

    ``"right"`` keeps the first ``max_len`` tokens (counted in ``num_truncated``) unless no trained
    token is left, in which case the row is dropped; ``"drop"`` drops every row longer than
    ``max_len``. Dropped rows are counted in ``num_dropped``; if every row is dropped that is an error.
    """
    if truncation not in ("right", "drop"):
        raise ValueError(f"truncation must be 'right' or 'drop', got {truncation!r}")
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {max_len}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; SFT ends every completion with it")
    if not rows:
        raise DataError("no SFT rows to tokenize")
    chat = uses_chat_format(tokenizer, use_chat_template)
    data = SFTData()
    for number, row in enumerate(rows, start=1):
        row = _check_row(row, f"row {number}")
        with row_errors(f"row {number}"):
            if "messages" in row:
                example = chat_example(tokenizer, row["messages"], completion_only, row.get("tools"))
            elif chat:
                messages = [
                    {"role": "user", "content": row["prompt"]},
                    {"role": "assistant", "content": row["completion"]},
                ]
                example = chat_example(tokenizer, messages, completion_only)
            else:
                example = raw_example(tokenizer, row["prompt"], row["completion"], completion_only)
        data.num_special_text += holds_special(
            tokenizer, [row.get(k) for k in ("messages", "tools", "prompt", "completion")]
        )
        if len(example.input_ids) > max_len:
            if truncation == "drop":
                data.num_dropped += 1
                continue
            example = SFTExample(example.input_ids[:max_len], example.loss_mask[:max_len])
            if not any(example.loss_mask):
                data.num_dropped += 1
                continue
            data.num_truncated += 1
        data.examples.append(example)
    if not data.examples:
        raise DataError(
            f"all {len(rows)} SFT rows were dropped as longer than max_len={max_len} tokens "
            f"(truncation={truncation!r}); raise max_len"
        )
    return data


def collate_sft(examples: list[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch. Returns ``input_ids``, ``labels`` and ``attention_mask``, each (B, T) long.

    ``labels`` equals ``input_ids`` where the loss mask is 1 and is -100 elsewhere (prompt tokens and
    padding). Labels are aligned with inputs, not shifted: the loss compares logits[:, t] with
    labels[:, t + 1].
    """
    if not examples:
        raise ValueError("collate_sft: empty batch")
    batch, max_len = len(examples), max(len(ex.input_ids) for ex in examples)
    input_ids = torch.full((batch, max_len), pad_id, dtype=torch.long)  # (B, T)
    labels = torch.full((batch, max_len), -100, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((batch, max_len), dtype=torch.long)  # (B, T)
    for b, (ids, mask) in enumerate(examples):
        ids_t, mask_t = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)
        input_ids[b, : len(ids)] = ids_t
        labels[b, : len(ids)] = torch.where(mask_t, ids_t, torch.full_like(ids_t, -100))
        attention_mask[b, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
