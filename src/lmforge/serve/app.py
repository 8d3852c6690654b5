"""The HTTP layer of ``lmforge serve`` (FastAPI): routes, request checks, error bodies, lifecycle.

Endpoints: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (both also streamed: ``stream.py``),
``GET /v1/weights`` (current version), ``POST /v1/weights`` (load a checkpoint directory),
``POST /v1/weights/tensors`` (safetensors body), ``GET /health``, ``GET /metrics`` (Prometheus,
``middleware.py``, which also checks ``--api-key``). The wire format is in ``protocol.py``, the
batching in ``scheduler.py``, vLLM's sampling extras in ``extras.py``, the weight loading in ``weights.py``.

Every error is JSON in OpenAI's shape with a 4xx status for a bad request (400: malformed body,
unknown field, prompt over the context length, weights that do not fit; 401: no or a wrong API key;
404: unknown path, or a ``model`` the server does not answer to: ``ServedModel.check_model``) and 503
when the server is shutting down. Handlers never run the model: they tokenise, check, submit to the
scheduler thread and await its future, so the event loop keeps accepting requests that join the
running batch.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route signatures at runtime, and
# ``Request``, imported lazily inside the functions that add the routes, could not be resolved from a
# string annotation.
import asyncio
import contextlib
import time
from typing import Any

from .extras import extra_processors
from .grammar import ConstraintError, Grammars, chat_processors
from .middleware import Guard, RequestCounts, client_gone, exposition
from .protocol import (
    ChatRequest,
    CompletionRequest,
    RequestError,
    chat_body,
    chat_choice,
    completion_body,
    error_body,
    prompts_of,
    reply_text,
    sampling_params,
    stop_ids_of,
)
from .responses import add_responses_routes
from .scheduler import BatchScheduler, GenerationRequest, GenerationResult, Sample, ServeError
from .scoring import PromptScores, add_prompt_logprobs, prompt_logprobs_entries, score_prompts
from .sessions import SessionNotFound, SessionPaths, SessionRecorder, call_context
from .stream import feed, sse_events
from .tools import ToolRequestError, continue_prompt, encode_chat, request_tools
from .weights import WeightsError, check_state, copy_state, read_checkpoint_dir, read_tensor_bytes

INSTALL_HINT = "lmforge serve needs FastAPI and uvicorn: pip install 'lmforge[serve]' (or: pip install fastapi uvicorn)"
MAX_RETRIES = 3  # attempts at a multi-prompt request whose prompts straddle a weight update
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


class ClientGone(ConnectionError):
    """The client hung up before its reply; its request was cancelled (logged as 499, nginx's 'client closed')."""


class ModelNotFound(LookupError):
    """A request names a model this server does not serve: 404, OpenAI's ``model_not_found``."""


def _require_fastapi():
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc


class ServedModel:
    """The model, its tokenizer and the scheduler, plus the checks that need the model's limits."""

    def __init__(
        self,
        model,
        tokenizer,
        name: str,
        max_batch_rows: int = 64,
        gather_s: float = 0.005,
        aliases: tuple[str, ...] = (),
        sessions: SessionRecorder | None = None,
    ):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.sessions = sessions  # an agent gateway's: calls under /sessions/<id>/ are recorded (sessions.py)
        self.aliases = {name, *aliases}  # the names a request's `model` may give (check_model)
        self.created = int(time.time())  # the model object's `created`: when this server loaded it
        self.max_model_len = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        eos = getattr(model.generation_config, "eos_token_id", None) if hasattr(model, "generation_config") else None
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.stop_token_ids = sorted({*eos, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])})
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.scheduler = BatchScheduler(model, pad, self.decode_text, max_batch_rows=max_batch_rows, gather_s=gather_s)
        self.grammars = Grammars(tokenizer, self.vocab_size, self.stop_token_ids)  # compiled on first use

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode_text(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decoder(self, body):
        """The text of a request's samples: special tokens skipped unless ``skip_special_tokens`` is false."""
        return self.decode_text if body.skip_special_tokens else lambda ids: self.decode_text(ids, False)

    def session(self):
        """The open agent session of the request being handled (``sessions.py``), or None."""
        return None if self.sessions is None else self.sessions.current()

    def check_model(self, model: str | None) -> None:
        """A request's ``model`` must be absent or one of this server's names (``aliases``): a 404 otherwise.
        An agent session takes any name (the agent's own configuration names some model)."""
        if model is not None and model not in self.aliases and self.session() is None:
            raise ModelNotFound(f"the model '{model}' does not exist; this server serves '{self.name}'")

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def check_prompt(
        self, prompt: list[int], max_tokens: int | None, default_max_tokens: int | None, index: int = 0
    ) -> int:
        """Validate one prompt; return its max_tokens (the default filled in; an explicit 0, echo's
        scoring-only request, stays 0)."""
        where = "" if index == 0 else f" (prompt {index})"
        least = 0 if max_tokens == 0 else 1
        session = self.session()
        if session is not None:  # the run's budget per call (sessions.py)
            max_tokens = session.budget(max_tokens, self.max_model_len - len(prompt))
        if not prompt:
            raise RequestError(f"the prompt{where} is empty", param="prompt")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(
                f"prompt{where} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}", param="prompt"
            )
        room = self.max_model_len - len(prompt)
        if max_tokens is None:
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        if len(prompt) + max_tokens > self.max_model_len or max_tokens < least:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(prompt) + max(max_tokens, least)} tokens ({len(prompt)} in the prompt{where}, "
                f"{max(max_tokens, least)} "
                f"for the completion). Shorten the prompt or lower max_tokens.",
                param="max_tokens" if room > 0 else "prompt",
                code="context_length_exceeded",
            )
        return max_tokens

    def request(self, prompt: list[int], body, max_tokens: int, on_token=None) -> GenerationRequest:
        """The scheduler's request for one prompt of ``body`` (a CompletionRequest or ChatRequest).
        A chat reply's structure (response_format, forced or strict tool calls) is a grammar's mask
        (``grammar.py``); it runs before vLLM's sampling extras (``extras.py``). In an agent session the
        run's sampling replaces the request's and the call is recorded (``sessions.py``)."""
        session = self.session()
        if session is not None:
            body = session.impose(body)
        try:
            processors = chat_processors(self.grammars, body)
        except ConstraintError as exc:
            raise RequestError(str(exc), param=exc.param) from exc
        for field in ("logit_bias", "stop_token_ids"):
            bad = [t for t in getattr(body, field) if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(
                    f"{field} names token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}", param=field
                )
        if body.min_tokens > max_tokens:
            raise RequestError(
                f"min_tokens ({body.min_tokens}) is more than max_tokens ({max_tokens})", param="min_tokens"
            )
        request = GenerationRequest(
            prompt,
            sampling_params(body, max_tokens, self.stop_token_ids),
            n=body.n,
            frequency_penalty=body.frequency_penalty,
            presence_penalty=body.presence_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=dict(body.logit_bias),
            top_logprobs=body.top_logprobs or 0,
            processors=[*processors, *extra_processors(body, self.stop_ids(body))],
            min_tokens=body.min_tokens,
            on_token=on_token,
        )
        if session is not None:
            session.attach(request)
        return request

    def stop_ids(self, body) -> list[int]:
        """The ids that end a sample of ``body`` (``protocol.stop_ids_of``)."""
        return stop_ids_of(body, self.stop_token_ids)

    def submit(self, request: GenerationRequest):
        try:
            return self.scheduler.submit(request)
        except ValueError as exc:  # n larger than the batch
            raise RequestError(str(exc), param="n") from exc

    async def generate(self, prompt: list[int], body, max_tokens: int):
        return await self.wait(self.request(prompt, body, max_tokens))

    async def wait(self, request: GenerationRequest) -> GenerationResult:
        """Submit ``request`` and await its result; if the HTTP client hangs up first (``middleware.client_gone``),
        cancel it, so that its rows leave the batch at the next step instead of decoding for nobody."""
        result = asyncio.wrap_future(self.submit(request))
        gone = client_gone()
        if gone is None:
            return await result
        hung_up = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait({result, hung_up}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hung_up.cancel()
        if not result.done():
            request.cancel()
            raise ClientGone("the client disconnected before the reply")
        return result.result()

    async def score(self, prompts: list[list[int]], top_n: int) -> tuple[list[PromptScores], int]:
        """The prompts' own logprobs with ``top_n`` alternatives each (``scoring.py``), and the weight version."""
        job = self.scheduler.run_job(lambda model: score_prompts(model, prompts, top_n))
        return await asyncio.wrap_future(job)

    async def generate_all(
        self, prompts: list[list[int]], budgets: list[int], body, score_top: int | None = None
    ) -> tuple[list[GenerationResult], list[PromptScores] | None]:
        """Every prompt's samples (none where its budget is 0: finish_reason "length") and, unless
        ``score_top`` is None, the prompts' own logprobs, all from one weight version: the prompts run
        as separate rows (and the scoring as a job), so if a weight update fell between them the whole
        request runs again."""
        for _ in range(MAX_RETRIES):
            jobs = [self.generate(p, body, m) for p, m in zip(prompts, budgets) if m]
            if score_top is not None:
                jobs.append(self.score(prompts, score_top))
            done = list(await asyncio.gather(*jobs))
            scores, version = done.pop() if score_top is not None else (None, None)
            versions = {r.weight_version for r in done} | ({version} if scores is not None else set())
            if not versions:  # echo with max_tokens 0 and no logprobs: nothing ran, nothing to disagree
                versions = {self.scheduler.weight_version}
            if len(versions) == 1:
                break
        else:
            raise ServeError(f"weights changed during each of {MAX_RETRIES} attempts at this request; retry it")
        version, generated = versions.pop(), iter(done)
        nothing = [Sample([], [], "length") for _ in range(body.n)]
        return [next(generated) if m else GenerationResult(nothing, version) for m in budgets], scores

    def stream(self, kind: str, prompts: list[list[int]], budgets: list[int], body, parse_tools: bool = False):
        """A StreamingResponse of server-sent events for ``prompts`` (``stream.py``)."""
        from fastapi.responses import StreamingResponse

        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        callbacks = [feed(queue, loop, index, self.scheduler) for index in range(len(prompts))]
        requests = [
            self.request(prompt, body, budget, on_token)
            for prompt, budget, (on_token, _) in zip(prompts, budgets, callbacks)
        ]
        for request, (_, on_done) in zip(requests, callbacks):  # all checked before any is submitted
            self.submit(request).add_done_callback(on_done)
        events = sse_events(
            kind,
            self.name,
            requests,
            body,
            prompts,
            self.decoder(body),
            self.decode_token,
            queue,
            parse_tools,
            self.stop_ids(body),
        )
        return StreamingResponse(events, media_type="text/event-stream", headers={"cache-control": "no-cache"})


def build_app(served: ServedModel, api_key: str | None = None):
    """The FastAPI application serving ``served``; the scheduler thread stops when the app shuts down.
    With ``api_key`` every route but /health and /metrics needs ``Authorization: Bearer <api_key>``
    (``middleware.py``)."""
    _require_fastapi()
    from fastapi import FastAPI
    from starlette.concurrency import run_in_threadpool

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        # uvicorn has already let the open requests finish: stop the thread that served them
        await run_in_threadpool(served.scheduler.shutdown)

    app = FastAPI(title="lmforge serve", lifespan=lifespan)
    counts = RequestCounts()
    app.add_middleware(Guard, counts=counts, router=app.router, api_key=api_key)
    if served.sessions is not None:  # an agent gateway: /sessions/<id>/... (added last: it runs first)
        app.add_middleware(SessionPaths, recorder=served.sessions)

    add_error_handlers(app)
    add_metrics_route(app, served, counts)
    add_generation_routes(app, served)
    add_weight_routes(app, served)
    from .generate import add_token_routes  # here: generate.py builds on this module

    add_token_routes(app, served)
    add_responses_routes(app, served, chat_completion)  # /v1/responses runs through the chat path
    return app


def _reply(body: dict[str, Any]):
    """A JSON response whose ``x-weight-version`` header names the weights that produced it."""
    from fastapi.responses import JSONResponse

    return JSONResponse(body, headers={"x-weight-version": str(body["weight_version"])})


def add_error_handlers(app) -> None:
    """Every error as an OpenAI-style JSON body: 400 for a bad request, 404, 503 while the server
    cannot answer, 500 (with the traceback in the server log) for anything else."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return JSONResponse(
                error_body(f"the request body is not valid JSON ({message}, at character {loc[0] if loc else '?'})"),
                status_code=400,
            )
        if first.get("type") == "missing" and param is None:  # no body at all
            needs = "'messages'" if request.url.path.endswith("/chat/completions") else "'prompt'"
            return JSONResponse(
                error_body(f"the request body is missing: send a JSON object with {needs}", param=needs.strip("'")),
                status_code=400,
            )
        if first.get("type") == "extra_forbidden":
            message = f"unknown or unsupported field '{param}'"
        elif param:
            message = f"{param}: {message}"
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return JSONResponse(
            error_body(str(exc.detail), kind="not_found_error" if exc.status_code == 404 else "invalid_request_error"),
            status_code=exc.status_code,
        )

    @app.exception_handler(RequestError)
    async def _bad_request(request: Request, exc: RequestError):
        return JSONResponse(error_body(str(exc), param=exc.param, code=exc.code), status_code=400)

    @app.exception_handler(SessionNotFound)
    async def _no_session(request: Request, exc: SessionNotFound):
        return JSONResponse(error_body(str(exc), kind="not_found_error", code="session_not_found"), status_code=404)

    @app.exception_handler(ModelNotFound)
    async def _no_model(request: Request, exc: ModelNotFound):
        return JSONResponse(error_body(str(exc), param="model", code="model_not_found"), status_code=404)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone):  # nobody reads it; the status is for the log and /metrics
        return JSONResponse(error_body(str(exc), kind="client_closed_request"), status_code=499)

    @app.exception_handler(ServeError)
    async def _unavailable(request: Request, exc: ServeError):
        return JSONResponse(error_body(str(exc), kind="server_error"), status_code=503)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):  # still JSON, and the server log has the traceback
        return JSONResponse(
            error_body(f"internal error: {type(exc).__name__}: {exc}", kind="server_error"), status_code=500
        )


def add_generation_routes(app, served: ServedModel) -> None:
    """/health, /v1/models, /v1/completions and /v1/chat/completions."""

    @app.get("/health")
    async def health():
        if not served.scheduler.alive:  # a probe must see that nothing will be generated any more
            raise ServeError("the generation thread has stopped (see the server log): restart the server")
        return {
            "status": "ok",
            "weight_version": served.scheduler.weight_version,
            "running_rows": served.scheduler.num_running,
        }

    def model_object() -> dict:
        return {
            "id": served.name,
            "object": "model",
            "created": served.created,
            "owned_by": "lmforge",
            "max_model_len": served.max_model_len,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        served.check_model(model_id)
        return model_object()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        served.check_model(body.model)
        try:
            prompts = prompts_of(body, served.encode)
        except ValueError as exc:
            raise RequestError(str(exc), param="prompt") from exc
        session = served.session()
        if session is not None:
            prompts = session_completion_prompts(served, session, body, prompts)
        if body.max_tokens == 0 and not body.echo:
            raise RequestError(
                "max_tokens 0 needs echo=true (it scores the prompt and generates nothing)", param="max_tokens"
            )
        budgets = [
            served.check_prompt(p, body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, i) for i, p in enumerate(prompts)
        ]
        if body.stream and body.scores_prompt:
            raise RequestError(
                "prompt logprobs (echo with logprobs, prompt_logprobs) are not streamed; send stream=false",
                param="stream",
            )
        if body.stream:  # one version per request is not retried here: each chunk names its weight_version
            return served.stream("completion", prompts, budgets, body)
        top = max(body.prompt_logprobs or 0, body.logprobs or 0) if body.scores_prompt else None
        results, scores = await served.generate_all(prompts, budgets, body, top)
        reply = completion_body(
            served.name, prompts, results, body, served.decoder(body), served.decode_token, served.stop_ids(body)
        )
        if scores is not None:
            add_prompt_logprobs(reply, scores, body, served.decoder(body), served.decode_token)
        return _reply(reply)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        reply = await chat_completion(served, body)
        return reply if body.stream else _reply(reply)


async def chat_completion(served: ServedModel, body: ChatRequest):
    """The chat route's work, shared with ``/v1/responses`` (``responses.py``, which builds a ChatRequest):
    the response body as a dict, or with ``body.stream`` the StreamingResponse of chat chunks."""
    served.check_model(body.model)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]  # echoed fields left out (protocol.py)
    if body.continue_final_message and body.add_generation_prompt and "add_generation_prompt" in body.model_fields_set:
        raise RequestError(
            "continue_final_message and add_generation_prompt cannot both be true (the last message "
            "is either continued or closed and answered)",
            param="continue_final_message",
        )
    if body.continue_final_message and body.prefix_token_ids is not None:
        raise RequestError(
            "continue_final_message with prefix_token_ids: the ids already end the last assistant "
            "message; send its continuation as a completion of those ids instead",
            param="continue_final_message",
        )
    try:
        tools, parse_tools = request_tools(body)
        session = served.session()
        if session is not None:
            prompt = session_chat_prompt(served, session, body, messages, tools, parse_tools)
        elif body.prefix_token_ids is None:
            prompt = encode_chat(served.tokenizer, messages, tools, **body.template_kwargs)  # text as text
        else:  # token-in: the conversation so far as ids, only the new messages rendered (tools.py)
            prompt = continue_prompt(
                served.tokenizer,
                messages,
                tools,
                body.prefix_token_ids,
                served.stop_token_ids,
                served.encode,
                body.template_kwargs,
            )
    except ToolRequestError as exc:
        raise RequestError(str(exc), param=exc.param) from exc
    max_tokens = served.check_prompt(prompt, body.max_completion_tokens or body.max_tokens, None)
    if body.stream and body.prompt_logprobs is not None:
        raise RequestError("prompt_logprobs are not streamed; send stream=false", param="stream")
    if body.stream:
        return served.stream("chat", [prompt], [max_tokens], body, parse_tools)
    results, scores = await served.generate_all([prompt], [max_tokens], body, body.prompt_logprobs)
    reply = chat_body(
        served.name,
        prompt,
        results[0],
        body,
        served.decoder(body),
        served.decode_token,
        parse_tools,
        served.stop_ids(body),
    )
    if scores is not None:  # vLLM's extension, for the rendered prompt
        reply["prompt_logprobs"] = prompt_logprobs_entries(scores[0], body.prompt_logprobs, served.decode_token)
    return reply


def session_chat_prompt(
    served: ServedModel, session, body: ChatRequest, messages: list[dict], tools: list[dict] | None, parse_tools: bool
) -> list[int]:
    """A chat call's prompt in an agent session: earlier replies of the session from their sampled ids
    (``sessions.py``, rule 1); the call recorded with its conversation and its reply as the client gets it."""
    stop_ids, decode = served.stop_ids(body), served.decoder(body)
    call_context(
        endpoint="chat",
        reply=lambda ids, finish: chat_choice(0, reply_text(ids, finish, body, decode, stop_ids), finish, parse_tools)[
            "message"
        ],
    )
    if body.prefix_token_ids is not None:  # token-in: the client's ids, as without a session
        session.note_history(messages, tools, body.template_kwargs)
        return continue_prompt(
            served.tokenizer,
            messages,
            tools,
            body.prefix_token_ids,
            served.stop_token_ids,
            served.encode,
            body.template_kwargs,
        )
    prompt = session.chat_prompt(
        messages, tools, body.template_kwargs, served.tokenizer, served.stop_token_ids, served.encode
    )
    return prompt if prompt is not None else encode_chat(served.tokenizer, messages, tools, **body.template_kwargs)


def session_completion_prompts(
    served: ServedModel, session, body: CompletionRequest, prompts: list[list[int]]
) -> list[list[int]]:
    """A completions call's prompt in an agent session: one prompt; text that continues an earlier call's
    prompt and returned text continues its ids (``sessions.py``, rule 1)."""
    if len(prompts) != 1:
        raise RequestError(
            f"a training session takes one prompt per completions call, got {len(prompts)}", param="prompt"
        )
    stop_ids, decode = served.stop_ids(body), served.decoder(body)
    if not isinstance(body.prompt, str) and not (
        isinstance(body.prompt, list) and len(body.prompt) == 1 and isinstance(body.prompt[0], str)
    ):
        call_context(endpoint="completions")  # token ids: as sent
        return prompts
    text = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    call_context(
        endpoint="completions",
        text=text,
        stop_ids=stop_ids,
        reply=lambda ids, finish: reply_text(ids, finish, body, decode, stop_ids),
    )
    return [session.completion_prompt(text, served.encode) or prompts[0]]


def add_weight_routes(app, served: ServedModel) -> None:
    """/v1/weights: the version (GET), a checkpoint directory to load (POST); /v1/weights/tensors:
    a serialised state dict (POST). Each update waits for the rows sampled with the old weights."""
    from fastapi import Request
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool

    @app.get("/v1/weights")
    async def weights_version():
        return {"weight_version": served.scheduler.weight_version}

    async def _update(state: dict, version: int | None) -> JSONResponse:
        try:
            check_state(served.model, state)
            new_version = await asyncio.wrap_future(
                served.scheduler.update_weights(lambda model: copy_state(model, state), version)
            )
        except (WeightsError, ValueError) as exc:
            raise RequestError(str(exc), param="weights") from exc
        return _reply({"weight_version": new_version})

    @app.post("/v1/weights")
    async def load_checkpoint(request: Request):
        try:
            body = await request.json()
        except ValueError as exc:
            raise RequestError(f'the body must be JSON {{"checkpoint_dir": ..., "version": ...}}: {exc}') from exc
        if not isinstance(body, dict) or not isinstance(body.get("checkpoint_dir"), str):
            raise RequestError("the body must be a JSON object with a string 'checkpoint_dir'", param="checkpoint_dir")
        version = body.get("version")
        if version is not None and not isinstance(version, int):
            raise RequestError(f"version must be an integer, got {version!r}", param="version")
        try:
            state = await run_in_threadpool(read_checkpoint_dir, body["checkpoint_dir"])
        except WeightsError as exc:
            raise RequestError(str(exc), param="checkpoint_dir") from exc
        return await _update(state, version)

    @app.post("/v1/weights/tensors")
    async def load_tensors(request: Request, version: int | None = None):
        payload = await request.body()
        try:
            state = await run_in_threadpool(read_tensor_bytes, payload)
        except WeightsError as exc:
            raise RequestError(str(exc), param="body") from exc
        return await _update(state, version)


def add_metrics_route(app, served: ServedModel, counts: RequestCounts) -> None:
    """GET /metrics: Prometheus' text format (``middleware.exposition``)."""
    from fastapi.responses import PlainTextResponse

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(exposition(counts, served.scheduler), media_type="text/plain; version=0.0.4")


class ThreadedServer:
    """``build_app(served)`` under uvicorn in a daemon thread on 127.0.0.1 and a free port: a server inside
    another program (the verifiers rollout source serves its policy so; the tests' servers). Raises
    RuntimeError when it has not started within ``start_timeout_s``."""

    def __init__(self, served: ServedModel, name: str = "lmforge-serve", start_timeout_s: float = 60.0):
        import threading

        import uvicorn

        from ..parallel.context import free_port

        self.served, self.port = served, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(build_app(served), host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, name=name, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server in thread {name} did not start within {start_timeout_s:.0f} s")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 60.0) -> bool:
        """Let the requests in flight finish and stop; whether the thread has ended."""
        self.server.should_exit = True
        self.thread.join(timeout_s)
        return not self.thread.is_alive()


def run_server(
    served: ServedModel, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", api_key: str | None = None
) -> None:
    """Serve until SIGINT / SIGTERM; open requests finish first, then the scheduler thread stops and the
    process exits 0 on either signal.

    uvicorn catches both, shuts down gracefully, then raises the signal again under the handler it found.
    SIGINT's is Python's (a KeyboardInterrupt, which ``uvicorn.run`` swallows); SIGTERM's default would kill
    the process there (status -15 after a clean shutdown), so SIGTERM is made a KeyboardInterrupt too."""
    import signal
    import threading

    _require_fastapi()
    import uvicorn

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, interrupt) if main else None
    try:
        uvicorn.run(build_app(served, api_key), host=host, port=port, log_level=log_level)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
