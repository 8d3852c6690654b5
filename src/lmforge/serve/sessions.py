"""Agent sessions: ``lmforge serve`` as the model server of an agent that is being trained (docs/agents.md).

A server built with a :class:`SessionRecorder` (``ServedModel(..., sessions=...)``; the agent rollout
source makes one) also answers under per-episode base URLs: ``/sessions/<id>/v1/chat/completions``,
``/v1/completions``, ``/v1/responses``, ``/inference/v1/generate`` and the rest of the routes, the
prefix taken off by :class:`SessionPaths`. Every call under an open session is recorded as it was
sampled (:class:`Call`): the prompt ids the server built, the sampled ids, their logprobs, the weight
version. Three rules make the record exact by construction:

1. **Earlier turns from their ids.** A chat request whose conversation holds an assistant message that
   this session's server returned -- the same content and tool calls (``canonical``), after the same
   history with the same tools -- has its prompt built from that call's prompt + sampled ids, and only
   the messages after it rendered as text (``tools.continue_prompt``): the reply is never decoded and
   tokenized again. Where no recorded reply matches (the agent edited or summarised the history, wrote
   its own assistant message), the conversation is rendered from its text as any request's is, and the
   assistant messages so rendered are counted (``text_rendered_turns``). A completions request whose
   prompt text starts with an earlier call's prompt text + returned text continues that call's ids the
   same way.
2. **The run's sampling.** ``temperature``, ``top_p``, ``top_k`` and the per-call token budget come
   from the run (:class:`RunSampling`), and so does the seed (one per call, from the episode's); the
   logit changes a trainer cannot score (``min_p``, the penalties, ``logit_bias``) are switched off.
   A request that set any of these otherwise is served with the run's value, counted per field in
   ``overrides``. Honoured as sent: stop strings and ids, ``min_tokens``, ``ignore_eos``, tools and
   ``tool_choice``, ``response_format`` (a grammar masks the distribution: docs/serving.md), what is
   returned (logprobs, token ids). ``n > 1`` is a 400: an episode is one trajectory per call. Every 400 a
   session's call gets (``n > 1``, a malformed request) is counted in its ``refused_calls``.
3. **Nothing after the end.** :meth:`SessionRecorder.close` ends a session: its calls still decoding
   are cancelled, a later call is a 404 and counted in ``late_calls``, a call that finishes after the
   end is not recorded (``late_calls`` too). A call the client abandoned (a stream it hung up on) is
   not recorded either (``cancelled_calls``): the agent never saw that reply. Session ids are random
   (``secrets.token_hex``): an agent cannot name another episode's session by chance; an unknown id is
   a 404 counted in ``unknown_session_calls``.

How calls become training samples is the trainer's business (``lmforge.rl.sources.agent``).
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import secrets
import threading
from collections import Counter
from typing import Any, Callable

from .protocol import RequestError
from .tools import continue_prompt

PREFIX = "/sessions/"
_SESSION: contextvars.ContextVar[str | None] = contextvars.ContextVar("lmforge_session", default=None)
_CALL: contextvars.ContextVar[dict | None] = contextvars.ContextVar("lmforge_session_call", default=None)
FORGOTTEN_KEPT = 65536  # ended sessions' ids a recorder remembers after forgetting them (SessionRecorder.forget)
# The logit changes a session's calls run without (their trainer scores logits / T only), and their off values.
NEUTRAL = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {}}
# Every count a session or the recorder keeps (Session.counts, SessionRecorder.counts): a trainer logs each at
# every step, so that under torchrun all ranks log the same metric keys.
COUNTS = (
    "text_rendered_turns",
    "cancelled_calls",
    "refused_calls",
    "late_calls",
    "unknown_session_calls",
    *(f"override_{field}" for field in ("temperature", "top_p", "top_k", *NEUTRAL, "seed", "max_tokens")),
)


class SessionNotFound(LookupError):
    """A request under ``/sessions/<id>/`` that names no open session: 404."""


class SessionPaths:
    """ASGI middleware: ``/sessions/<id>/<route>`` runs ``/<route>`` with ``<id>`` as the request's session;
    a 400 answered to it is counted on the session (``SessionRecorder.refused``)."""

    def __init__(self, app, recorder: SessionRecorder | None = None):
        self.app, self.recorder = app, recorder

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            return await self.app(scope, receive, send)
        session, _, route = scope["path"][len(PREFIX) :].partition("/")
        scope = {**scope, "path": "/" + route, "raw_path": ("/" + route).encode()}
        token = _SESSION.set(session)

        async def sending(message):
            if message["type"] == "http.response.start" and message["status"] == 400 and self.recorder is not None:
                self.recorder.refused(session)
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            _SESSION.reset(token)


def call_context(**meta) -> None:
    """What the route knows about the call it is making (``endpoint``; chat: ``history`` and ``reply``;
    completions: ``text`` and ``reply``), read when the scheduler's request is made (``Session.attach``)."""
    _CALL.set(meta)


@dataclasses.dataclass(frozen=True)
class RunSampling:
    """What the run imposes on every call of a session (module doc, rule 2)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64  # a call's token budget (less where the context has less room)
    seed: int | None = None  # the episode's seed: call k samples with seed_of(seed, k); None: unseeded
    seed_of: Callable[[int, int], int] | None = None


@dataclasses.dataclass(frozen=True)
class Call:
    """One recorded call: what was sampled, token for token."""

    index: int  # its place among the session's calls (in the order they were made)
    endpoint: str  # chat, completions, generate
    prompt_ids: list[int]  # the prompt as this server built it
    token_ids: list[int]  # the sampled ids, the stop token included
    logprobs: list[float]  # of each sampled id, under the distribution it was sampled from
    finish_reason: str
    weight_version: int
    history: tuple | None = None  # chat: the canonical conversation (and tools) its prompt was rendered from
    reply: tuple | None = None  # chat: the canonical reply the client received
    text: str | None = None  # completions: the prompt text + the returned text
    text_ids: list[int] | None = None  # completions: the ids ``text`` stands for after the prompt (no stop id)


def _arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def canonical(message: dict) -> tuple:
    """A chat message as compared with a recorded one: role, content (stripped), the calls' names and
    arguments (parsed JSON), and a tool message's call id. Call ids of assistant messages are not
    compared (each response makes new ones); what the template renders from them is in the history."""
    calls = tuple(
        (c.get("function", c).get("name"), _arguments(c.get("function", c).get("arguments") or {}))
        for c in message.get("tool_calls") or []
    )
    return (
        message.get("role"),
        (message.get("content") or "").strip(),
        calls,
        message.get("tool_call_id") or "",
        message.get("name") or "" if message.get("role") != "assistant" else "",
    )


def _text_ids(sample, stop_ids) -> list[int]:
    """The sampled ids a completion's returned text stands for: a stop id that ended it left out."""
    ids = list(sample.token_ids)
    return ids[:-1] if sample.finish_reason == "stop" and ids and ids[-1] in stop_ids else ids


class Session:
    """One episode's calls (module doc); thread-safe (the scheduler thread records, the event loop reads)."""

    def __init__(self, session_id: str, sampling: RunSampling, late: Callable[[], None]):
        self.id, self.sampling, self._late = session_id, sampling, late  # late(): count a call after the end
        self.calls: list[Call] = []
        self.counts: Counter = Counter()
        self.open = True
        self._started = 0  # calls submitted (their seeds and indices)
        self._pending: dict[int, Any] = {}  # id -> a request still decoding
        self._lock = threading.Lock()

    def impose(self, body):
        """A copy of ``body`` (a CompletionRequest or ChatRequest) with the run's sampling (module doc,
        rule 2); the fields that differed counted in ``overrides``."""
        if body.n != 1:  # counted with the other 400s (SessionRecorder.refused)
            raise RequestError(
                f"n={body.n}: a training session samples one reply per call (send n=1 and call again for more)",
                param="n",
            )
        run = self.sampling
        wanted = {"temperature": run.temperature, "top_p": run.top_p, "top_k": run.top_k, **NEUTRAL}
        with self._lock:
            for field, value in wanted.items():
                if (
                    field in body.model_fields_set
                    and getattr(body, field) != value
                    and not (field == "top_k" and value == 0 and getattr(body, field) == -1)
                ):
                    self.counts[f"override_{field}"] += 1
            if body.seed is not None:
                self.counts["override_seed"] += 1
            seed = None if run.seed is None else run.seed_of(run.seed, self._started)
        return body.model_copy(update={**wanted, "seed": seed})

    def budget(self, requested: int | None, room: int) -> int:
        """A call's token budget: the run's, within the context's ``room``; a request that asked for
        another counted in ``override_max_tokens``."""
        if requested not in (None, 0) and requested != self.sampling.max_tokens:
            with self._lock:
                self.counts["override_max_tokens"] += 1
        return requested if requested == 0 else min(self.sampling.max_tokens, room)

    def attach(self, request, decode_reply: Callable[[list[int], str], Any] | None = None) -> None:
        """Record the scheduler's ``request`` when it finishes (module doc, rule 3)."""
        meta = _CALL.get() or {}
        with self._lock:
            if not self.open:
                self._late()
                raise SessionNotFound(f"session {self.id} has ended (its episode is over)")
            index, self._started = self._started, self._started + 1
            self._pending[id(request)] = request
        request.session_id = self.id
        request.cache_key = ("session", self.id)  # the scheduler keeps its KV entries for the session's next call
        request.future.add_done_callback(lambda future: self._finished(request, future, index, meta))

    def _finished(self, request, future, index: int, meta: dict) -> None:
        with self._lock:
            self._pending.pop(id(request), None)
            if future.cancelled() or future.exception() is not None:
                self.counts["cancelled_calls"] += 1
                return
            sample = future.result().samples[0]
            if sample.finish_reason == "cancelled":
                self.counts["cancelled_calls"] += 1
                return
            if not self.open:
                self._late()
                return
        reply = meta.get("reply")
        returned = None if reply is None else reply(sample.token_ids, sample.finish_reason)
        call = Call(
            index,
            meta.get("endpoint", "generate"),
            list(request.prompt_ids),
            list(sample.token_ids),
            list(sample.logprobs),
            sample.finish_reason,
            future.result().weight_version,
            history=meta.get("history"),
            reply=canonical(returned) if isinstance(returned, dict) else None,
            text=meta["text"] + returned if isinstance(returned, str) and "text" in meta else None,
            text_ids=_text_ids(sample, meta.get("stop_ids", ())),
        )
        with self._lock:
            self.calls.append(call)

    def close(self) -> list[Call]:
        """End the session: cancel its calls still running; its calls in the order they were made."""
        with self._lock:
            self.open = False
            pending, self._pending = list(self._pending.values()), {}
        for request in pending:
            request.cancel()
        return sorted(self.calls, key=lambda c: c.index)

    def chat_prompt(
        self, messages: list[dict], tools: list[dict] | None, template: dict, tokenizer, stop_ids: list[int], encode
    ) -> list[int] | None:
        """The prompt ids of a chat request whose conversation continues a recorded reply (module doc,
        rule 1), or None (render the whole conversation from text). Sets the call's ``history``."""
        key, history = self.note_history(messages, tools, template)
        assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        with self._lock:
            calls = list(self.calls)
        for i in reversed(assistant):
            match = next(
                (
                    c
                    for c in reversed(calls)
                    if c.endpoint == "chat" and c.history == (key, history[:i]) and c.reply == history[i]
                ),
                None,
            )
            if match is not None:
                self._count_text_rendered(sum(j > i for j in assistant))
                return continue_prompt(
                    tokenizer, messages, tools, match.prompt_ids + match.token_ids, stop_ids, encode, template, last=i
                )
        self._count_text_rendered(len(assistant))
        return None

    def note_history(self, messages: list[dict], tools: list[dict] | None, template: dict) -> tuple[str, tuple]:
        """The call's conversation as later requests are matched against it: (tools and template, canonical
        messages); set as the call's ``history``."""
        key = json.dumps([tools, template], sort_keys=True, default=str)
        history = tuple(canonical(m) for m in messages)
        meta = _CALL.get()
        if meta is not None:
            meta["history"] = (key, history)
        return key, history

    def completion_prompt(self, text: str, encode) -> list[int] | None:
        """The prompt ids of completions text that starts with a recorded call's prompt + returned text
        (that call's ids, then the rest encoded), or None."""
        with self._lock:
            calls = [c for c in self.calls if c.text is not None and text.startswith(c.text)]
        if not calls:
            return None
        match = max(calls, key=lambda c: (len(c.text), c.index))
        return match.prompt_ids + match.text_ids + encode(text[len(match.text) :])

    def _count_text_rendered(self, number: int) -> None:
        if number:
            with self._lock:
                self.counts["text_rendered_turns"] += number


class SessionRecorder:
    """The sessions of a gateway server: opened and closed by the trainer, looked up per request."""

    def __init__(self):
        self._sessions: dict[str, Session] = {}
        self.counts: Counter = Counter()  # calls no open session could take (unknown ids, ended sessions)
        self._forgotten: dict[str, None] = {}  # ids of forgotten sessions, oldest first (at most FORGOTTEN_KEPT)
        self._lock = threading.Lock()

    def open(self, sampling: RunSampling) -> Session:
        session = Session(secrets.token_hex(12), sampling, self._count_late)
        with self._lock:
            self._sessions[session.id] = session
        return session

    def _count_late(self) -> None:
        with self._lock:
            self.counts["late_calls"] += 1

    def close(self, session: Session) -> list[Call]:
        """End ``session`` (module doc, rule 3); its recorded calls. Its id stays known, as ended."""
        return session.close()

    def forget(self, sessions: list[Session]) -> None:
        """Drop ended ``sessions``; their ids are kept (the last ``FORGOTTEN_KEPT``), so that a later call
        naming one (a timed-out agent still running) still counts as late, not as an unknown id."""
        with self._lock:
            for session in sessions:
                self._sessions.pop(session.id, None)
                self._forgotten[session.id] = None
            while len(self._forgotten) > FORGOTTEN_KEPT:
                del self._forgotten[next(iter(self._forgotten))]

    def refused(self, session_id: str) -> None:
        """Count a call the server refused with a 400 (malformed, ``n > 1``) on its session, if known."""
        with self._lock:
            session = self._sessions.get(session_id)
        if session is not None:
            with session._lock:
                session.counts["refused_calls"] += 1

    def drain(self) -> Counter:
        """The calls no open session could take (``late_calls``, ``unknown_session_calls``) since the last drain."""
        with self._lock:
            counts, self.counts = self.counts, Counter()
        return counts

    def current(self) -> Session | None:
        """The open session of the request being handled, None outside ``/sessions/``; SessionNotFound
        (a 404) for an unknown or ended one."""
        session_id = _SESSION.get()
        if session_id is None:
            return None
        with self._lock:
            session = self._sessions.get(session_id)
            ended = session_id in self._forgotten if session is None else not session.open
            if session is None or ended:
                self.counts["late_calls" if ended else "unknown_session_calls"] += 1
        if ended:
            raise SessionNotFound(f"session {session_id} has ended (its episode is over)")
        if session is None:
            raise SessionNotFound(f"no session {session_id!r} on this server: use the base URL your episode was given")
        return session
