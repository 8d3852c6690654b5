"""``lmforge serve``'s API key check and its ``GET /metrics`` (Prometheus text format).

:class:`Guard` is a plain ASGI middleware (not Starlette's ``BaseHTTPMiddleware``, which would hold a
streamed response's disconnect back from the route: ``stream.py`` frees a departed client's rows on
it). It counts every answered request by route and status, and, when the server has an API key
(``--api-key`` or ``LMFORGE_API_KEY``), answers 401 in OpenAI's error shape to a request without
``Authorization: Bearer <key>``, except on the open paths: ``/health`` (load balancers' probes)
and ``/metrics`` (counts only, no request content).

It also notices a client that hangs up before its (non-streamed) answer: once the request's body has
been read, a watcher waits on the connection, and a disconnect sets the request's ``client_gone()``
event, which ``ServedModel.wait`` (app.py) races against the generation so that the rows of a request
nobody will read leave the batch at the next step.

The exposition is written by hand (a dozen lines; no ``prometheus_client`` dependency): counters of
requests (``route``, ``status``), prompt and generated tokens and decode steps; gauges of the
waiting requests, the running rows, the batch's row limit and occupancy, and the weight version.
A route is labelled by its path template (``/v1/models/{model_id:path}``), a path no route matches
by ``other``, so the label set stays bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import json
import threading
from collections import Counter

OPEN_PATHS = frozenset({"/health", "/metrics"})
_CLIENT_GONE: contextvars.ContextVar[asyncio.Event | None] = contextvars.ContextVar("client_gone", default=None)


def client_gone() -> asyncio.Event | None:
    """The current request's disconnect event (set when its client hangs up), or None outside a request."""
    return _CLIENT_GONE.get()


class RequestCounts:
    """Requests answered, by (route, status); updated from the event loop, read by /metrics."""

    def __init__(self):
        self._counts: Counter = Counter()
        self._lock = threading.Lock()

    def add(self, route: str, status: int) -> None:
        with self._lock:
            self._counts[(route, status)] += 1

    def snapshot(self) -> dict[tuple[str, int], int]:
        with self._lock:
            return dict(self._counts)


class Guard:
    """ASGI middleware: the API key check and the request counts (module doc)."""

    def __init__(self, app, counts: RequestCounts, router, api_key: str | None = None):
        self.app, self.counts, self.router = app, counts, router  # router: its routes label the counts
        self.expected = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # what the request counts as if the app fails before it answers
        if self.expected is not None and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            await _unauthorized(send)
            self.counts.add(self._route(scope), 401)
            return

        async def counting_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        gone, watcher = asyncio.Event(), None

        async def watching_receive():
            nonlocal watcher
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            elif message["type"] == "http.request" and not message.get("more_body") and watcher is None:
                watcher = asyncio.ensure_future(_watch(receive, gone))  # the body is in: wait on the connection
            return message

        token = _CLIENT_GONE.set(gone)
        try:
            await self.app(scope, watching_receive, counting_send)
        finally:
            _CLIENT_GONE.reset(token)
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            self.counts.add(self._route(scope), status)

    def _route(self, scope) -> str:
        from starlette.routing import Match

        for route in self.router.routes:
            if route.matches(scope)[0] == Match.FULL:
                return getattr(route, "path", "other")
        return "other"

    def _authorized(self, scope) -> bool:
        scheme, _, key = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
        # the scheme is case-insensitive (RFC 7235); the key is compared in constant time, not byte by byte
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.expected)


async def _watch(receive, gone: asyncio.Event) -> None:
    """After the body: the next message is ``http.disconnect``, when the client hangs up (or the reply is sent)."""
    if (await receive())["type"] == "http.disconnect":
        gone.set()


async def _unauthorized(send) -> None:
    body = json.dumps(
        {
            "error": {
                "message": "missing or wrong API key: send the header 'Authorization: Bearer "
                "<key>' with the key lmforge serve was started with (--api-key)",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def exposition(counts: RequestCounts, scheduler) -> str:
    """The Prometheus text format (version 0.0.4) of the request counts and the scheduler's state."""
    lines = [
        "# HELP lmforge_requests_total HTTP requests answered, by route template and status.",
        "# TYPE lmforge_requests_total counter",
    ]
    for (route, status), number in sorted(counts.snapshot().items()):
        lines.append(f'lmforge_requests_total{{route="{_escape(route)}",status="{status}"}} {number}')
    running, limit = scheduler.num_running, scheduler.max_batch_rows
    metrics = [
        (
            "prompt_tokens_total",
            "counter",
            "Prompt tokens prefilled (once per request, whatever its n).",
            scheduler.num_prompt_tokens,
        ),
        (
            "cached_prompt_tokens_total",
            "counter",
            "Prompt tokens whose KV entries an agent session's previous call left (not prefilled again).",
            scheduler.num_cached_tokens,
        ),
        ("generation_tokens_total", "counter", "Tokens sampled, over all rows.", scheduler.num_generated_tokens),
        (
            "decode_steps_total",
            "counter",
            "Decode steps run (one model call for all running rows).",
            scheduler.num_steps,
        ),
        ("requests_waiting", "gauge", "Requests submitted and not yet decoding (the queue).", scheduler.num_waiting),
        ("rows_running", "gauge", "Sequences decoding now.", running),
        ("batch_rows_max", "gauge", "Most sequences decoded in one step (--max-batch-rows).", limit),
        ("batch_occupancy", "gauge", "rows_running / batch_rows_max.", running / limit),
        ("weight_version", "gauge", "Version of the weights serving now.", scheduler.weight_version),
    ]
    for name, kind, text, value in metrics:
        lines += [f"# HELP lmforge_{name} {text}", f"# TYPE lmforge_{name} {kind}", f"lmforge_{name} {value}"]
    return "\n".join(lines) + "\n"
