"""Text is text: the strings of a conversation are encoded as plain text, never as control tokens.

A chat template writes a conversation's structure with the tokenizer's special tokens
(``<|im_start|>``, ``<|im_end|>``, ``<eos>``), and the rendered text is tokenized with special-token
matching. The same strings inside a message -- a tool's output, an environment's observation, a
``user`` or ``tool`` message sent to ``lmforge serve`` -- would then become those tokens as well: a
tool result that prints ``<|im_end|>\\n<|im_start|>assistant\\n`` would close the tool turn and open an
assistant turn the model never wrote. Here only the template's own special tokens are special:

1. every string of the messages and tools is searched for the tokenizer's special-token strings
   (:func:`special_strings`); when none holds one (the usual case) nothing changes and the
   rendering is encoded as it always was, so the ids are exactly ``tokenizer(text)``'s;
2. otherwise the conversation is rendered once more with each such occurrence replaced by a unique
   ASCII marker. The special strings of that rendering are the template's own; putting the
   occurrences back in place of the markers must give the first rendering, which locates each one
   (a template that rewrites the text around them is refused: :class:`ControlTextError`);
3. the text between two of the template's special tokens that holds an occurrence is encoded as
   plain text (the tokenizer's ``split_special_tokens``), the rest as before. The tokenizer splits
   its input at special tokens anyway, so the pieces are cut where it cuts them; a tokenizer that
   marks a string's start (SentencePiece's prefix space, "first") gets such a piece after an anchor
   whose ids are cut off again (:func:`_after_control`).

Only tokens the tokenizer marks special are control tokens here (what ``split_special_tokens``
splits); non-special added tokens (e.g. Qwen's ``<tool_call>``) stay ordinary vocabulary.
transformers >= 5.25 has the same idea in ``apply_chat_template(..., sanitize_control_tokens=True)``,
which returns ids only; the episode runner and the token-in server also need the text and the
ids of a part of it (the delta after a prefix), hence this module.
"""

from __future__ import annotations

import functools
import re
import secrets
import weakref
from dataclasses import dataclass
from typing import Any, Callable

Span = tuple[int, int]  # [start, end) character offsets in a rendered text
Render = Callable[[list[dict], "list[dict] | None"], str]  # (messages, tools) -> the template's text

_cache: "weakref.WeakKeyDictionary[Any, _Plain]" = weakref.WeakKeyDictionary()
_PROBE = "\nab, cd"  # text that follows a special token in the probe of _Plain.marks_start
_ANCHOR = "\n"  # encoded before a piece and cut off again, so that the piece is not a string's start


class ControlTextError(ValueError):
    """A string of the conversation holds a special-token string and the chat template does not write
    it as given, so it cannot be told from the template's own tokens. ``field`` names the string, as
    ``messages.2.content`` or ``tools.0.function.description``."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Rendered:
    """A rendered conversation: its ``text``, where the messages' special-token strings landed in it
    (``forged``) and where the template's own special tokens are (``control``), both sorted."""

    text: str
    forged: tuple[Span, ...] = ()
    control: tuple[Span, ...] = ()

    def cut(self, start: int) -> "Rendered":
        """The rendering of ``text[start:]`` (a span that starts before ``start`` is cut with it; a
        control token cut in two is no longer one)."""

        def shift(spans, keep):
            return tuple((max(a, start) - start, b - start) for a, b in spans if keep(a, b))

        return Rendered(
            self.text[start:], shift(self.forged, lambda a, b: b > start), shift(self.control, lambda a, b: a >= start)
        )

    def __add__(self, other: "Rendered") -> "Rendered":
        n = len(self.text)

        def moved(spans):
            return tuple((a + n, b + n) for a, b in spans)

        return Rendered(self.text + other.text, self.forged + moved(other.forged), self.control + moved(other.control))


class _Plain:
    """What encoding text as text needs of one tokenizer (cached per tokenizer by :func:`_plain`). The
    backend copy and the probe are built on first use: a conversation without control strings needs
    neither (copying SmolLM2's backend took 0.5 s on the busy 2-core test machine)."""

    def __init__(self, tokenizer):
        self._tokenizer = weakref.ref(tokenizer)  # the cache holds this entry as long as the tokenizer lives
        self.size = len(tokenizer)  # added tokens make the entry stale
        strings = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
        strings |= set(getattr(tokenizer, "all_special_tokens", ()))
        self.strings = tuple(sorted((s for s in strings if s and not s.isspace()), key=len, reverse=True))
        self.pattern = re.compile("|".join(map(re.escape, self.strings)) or "(?!)")  # (?!) never matches

    @property
    def tokenizer(self):
        return self._tokenizer()

    @functools.cached_property
    def backend(self):
        """A copy of the tokenizers backend that splits special tokens, or None (a Python tokenizer). A
        copy of its own: flipping the shared one's flag per call would race other threads' encodes."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(backend.to_str())
        backend.encode_special_tokens = True
        return backend

    @functools.cached_property
    def marks_start(self) -> bool:
        """Whether a piece encoded alone gets a start mark it has not after a special token (a Metaspace
        "first" prefix space)."""
        if not self.strings:
            return False
        special = self.strings[-1]
        after = encode_plain(self.tokenizer, special + _PROBE)[len(encode_plain(self.tokenizer, special)) :]
        return after != encode_text(self.tokenizer, _PROBE)


def _plain(tokenizer) -> _Plain:
    """The tokenizer's :class:`_Plain`, rebuilt when its vocabulary grows (added tokens)."""
    plain = _cache.get(tokenizer)
    if plain is None or plain.size != len(tokenizer):
        plain = _cache[tokenizer] = _Plain(tokenizer)
    return plain


def special_strings(tokenizer) -> tuple[str, ...]:
    """The strings of ``tokenizer``'s special tokens (whitespace-only ones left out), longest first."""
    return _plain(tokenizer).strings


def holds_special(tokenizer, obj: Any) -> bool:
    """Whether a string of ``obj`` (a string, or lists and dicts of them: a row, its messages) holds one of
    ``tokenizer``'s special-token strings."""
    pattern = _plain(tokenizer).pattern
    return any(pattern.search(s) for s in _strings(obj))


def encode_text(tokenizer, text: str) -> list[int]:
    """The ids of ``text`` as plain text: a special token's string is encoded as the characters it is
    made of (the tokenizer's ``split_special_tokens``), never as the special token."""
    backend = _plain(tokenizer).backend
    if backend is None:  # a Python (slow) tokenizer takes split_special_tokens per call
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    return list(backend.encode(text, add_special_tokens=False).ids)


def encode_plain(tokenizer, text: str) -> list[int]:
    """The ids of ``text`` as the tokenizer encodes it by default (special-token strings matched)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def as_template(tokenizer, text: str) -> Rendered:
    """``text`` written by the template alone: each special-token string in it is a control token."""
    return Rendered(text, (), tuple(_spans(_plain(tokenizer).pattern, text)))


def _spans(pattern: re.Pattern, text: str, offset: int = 0) -> list[Span]:
    return [(m.start() + offset, m.end() + offset) for m in pattern.finditer(text)]


def _fields(obj: Any, pattern: re.Pattern, path: str) -> list[tuple[str, str]]:
    """(path, the first match) of each string in ``obj`` (dicts and lists, walked; keys too: a tool's
    parameter names) that holds a match of ``pattern``."""
    if isinstance(obj, str):
        match = pattern.search(obj)
        return [(path, match.group())] if match else []
    if isinstance(obj, dict):
        return [
            f
            for key, value in obj.items()
            for f in _fields(key, pattern, f"{path}.{key}") + _fields(value, pattern, f"{path}.{key}")
        ]
    if isinstance(obj, (list, tuple)):
        return [f for i, value in enumerate(obj) for f in _fields(value, pattern, f"{path}.{i}")]
    return []


def _map_strings(obj: Any, fn: Callable[[str], str]) -> Any:
    if isinstance(obj, str):
        return fn(obj)
    if isinstance(obj, dict):
        return {_map_strings(key, fn): _map_strings(value, fn) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_map_strings(value, fn) for value in obj]
    return obj


def render_marked(tokenizer, render: Render, messages: list[dict], tools: list[dict] | None = None) -> Rendered:
    """``render(messages, tools)`` with the places of the messages' and tools' special-token strings
    (module doc). Raises :class:`ControlTextError` when the template does not write them as given."""
    text = render(messages, tools)
    pattern = _plain(tokenizer).pattern
    fields = _fields(messages, pattern, "messages") + _fields(tools, pattern, "tools")
    if not fields:
        return as_template(tokenizer, text)
    nonce = secrets.token_hex(8)
    while any(nonce in s for s in _strings((messages, tools))):
        nonce = secrets.token_hex(8)
    originals: list[str] = []

    def mark(match: re.Match) -> str:
        originals.append(match.group())
        return f"LMFORGE{nonce}X{len(originals) - 1}Y"

    marked = render(
        _map_strings(messages, lambda s: pattern.sub(mark, s)), _map_strings(tools, lambda s: pattern.sub(mark, s))
    )
    rebuilt, forged, control = _rebuild(marked, re.compile(f"LMFORGE{nonce}X([0-9]+)Y"), originals, pattern)
    if rebuilt == text:
        return Rendered(text, forged, control)
    found = [text[a:b] for a, b in _spans(pattern, text)]
    if found == [rebuilt[a:b] for a, b in control]:  # e.g. escaped by the template: none reached the text
        return as_template(tokenizer, text)
    field, string = fields[0]
    raise ControlTextError(
        f"{field} holds the control string {string!r} of the tokenizer, and the chat template does not write it "
        "as given (it changes the text around it), so it cannot be told from the template's own control tokens; "
        "remove it from the text",
        field,
    )


def _rebuild(
    marked: str, markers: re.Pattern, originals: list[str], pattern: re.Pattern
) -> tuple[str, tuple[Span, ...], tuple[Span, ...]]:
    """(``marked`` with each marker replaced by its original string, where those strings are, where the
    special strings of the rest are)."""
    pieces, forged, control, at, last = [], [], [], 0, 0
    for match in markers.finditer(marked):
        for piece, is_forged in ((marked[last : match.start()], False), (originals[int(match.group(1))], True)):
            if is_forged:
                forged.append((at, at + len(piece)))
            else:
                control += _spans(pattern, piece, at)
            pieces.append(piece)
            at += len(piece)
        last = match.end()
    control += _spans(pattern, marked[last:], at)
    pieces.append(marked[last:])
    return "".join(pieces), tuple(forged), tuple(control)


def _strings(obj: Any) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    values = [*obj, *obj.values()] if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return [s for value in values for s in _strings(value)]


def _pieces(rendered: Rendered) -> list[tuple[int, int, str]]:
    """``rendered.text`` cut into (start, end, how) pieces that cover it in order: ``"template"`` where no
    forged string is (encoded as the tokenizer encodes it), ``"text"`` for the gap between the two
    control tokens around a forged string (plain text), ``"text_after"`` for such a gap that follows a
    control token."""
    text, pieces, done = rendered.text, [], 0
    starts = [0] + [b for _, b in rendered.control]
    ends = [a for a, _ in rendered.control] + [len(text)]
    for start, end in zip(starts, ends):  # the gaps between control tokens
        if start >= done and any(a < end and b > start for a, b in rendered.forged):
            if start > done:
                pieces.append((done, start, "template"))
            pieces.append((start, end, "text_after" if start else "text"))
            done = end
    return pieces + ([(done, len(text), "template")] if done < len(text) else [])


def encode_rendered(tokenizer, rendered: Rendered, encode: Callable[[str], list[int]] | None = None) -> list[int]:
    """The ids of ``rendered.text``: ``encode`` (default :func:`encode_plain`) where no forged special
    string is, plain text (:func:`encode_text`) between the two control tokens around each forged one."""
    encode = encode or (lambda text: encode_plain(tokenizer, text))
    if not rendered.forged:
        return list(encode(rendered.text))
    ids = []
    for start, end, how in _pieces(rendered):
        piece = rendered.text[start:end]
        if how == "template":
            ids += encode(piece)
        elif how == "text_after":
            ids += _after_control(tokenizer, piece)
        else:
            ids += encode_text(tokenizer, piece)
    return ids


def encode_rendered_starts(tokenizer, rendered: Rendered) -> tuple[list[int], list[int]]:
    """:func:`encode_rendered`'s ids (the default encoding) and the offset in ``rendered.text`` where each
    id's text starts: what a loss mask over character spans needs (the SFT rows' assistant spans). A
    fast tokenizer's; a Python tokenizer has no offsets."""
    pieces = _pieces(rendered) if rendered.forged else [(0, len(rendered.text), "template")]
    ids: list[int] = []
    starts: list[int] = []
    for start, end, how in pieces:
        piece = rendered.text[start:end]
        if how == "template":
            enc = tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)
            piece_ids, piece_starts = list(enc["input_ids"]), [a for a, _ in enc["offset_mapping"]]
        else:
            piece_ids, piece_starts = _text_offsets(tokenizer, piece, after_control=how == "text_after")
        ids += piece_ids
        starts += [start + a for a in piece_starts]
    return ids, starts


def _text_offsets(tokenizer, piece: str, after_control: bool) -> tuple[list[int], list[int]]:
    """The ids of ``piece`` as plain text, with each id's start offset in ``piece``: :func:`encode_text`,
    or after a control token :func:`_after_control`'s (the same anchor rule)."""
    plain = _plain(tokenizer)
    if plain.backend is None:
        raise ValueError("offsets of text holding special-token strings need a fast (tokenizers) tokenizer")
    if after_control and plain.marks_start:
        anchor = plain.backend.encode(_ANCHOR, add_special_tokens=False).ids
        whole = plain.backend.encode(_ANCHOR + piece, add_special_tokens=False)
        if whole.ids[: len(anchor)] == anchor:
            cut = len(anchor)
            return list(whole.ids[cut:]), [max(a - len(_ANCHOR), 0) for a, _ in whole.offsets[cut:]]
    whole = plain.backend.encode(piece, add_special_tokens=False)
    return list(whole.ids), [a for a, _ in whole.offsets]


def _after_control(tokenizer, text: str) -> list[int]:
    """:func:`encode_text` of a piece that follows a control token, as the tokenizer encodes text there: a
    tokenizer that marks a string's start (SentencePiece's prefix space, "first") gets the piece after
    :data:`_ANCHOR`, whose ids are then cut off (unless the two merged: then the piece alone)."""
    if not _plain(tokenizer).marks_start:
        return encode_text(tokenizer, text)
    anchor, ids = encode_text(tokenizer, _ANCHOR), encode_text(tokenizer, _ANCHOR + text)
    return ids[len(anchor) :] if ids[: len(anchor)] == anchor else encode_text(tokenizer, text)
