"""Token-in/token-out routes, as vLLM defines them (docs/serving.md, "Token in, token out").

``POST /inference/v1/generate``: token ids in, token ids, per-token logprobs and finish reason out; the
shape verifiers' training client (``renderers.client.generate``) sends and reads. It renders the
conversation itself and posts ``{"model", "token_ids", "sampling_params": {...}}``;
``sampling_params`` is vLLM's: every sampling option ``/v1/completions`` takes, vLLM's extras included
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``,
``skip_special_tokens``, ...), checked by the same model (``protocol.CompletionRequest``) and sampled
the same way, so the two routes accept and refuse the same options and give the same tokens and
logprobs for the same ids and seed; ``logprobs`` = N alternatives per token, as in completions;
``max_tokens`` defaults to the rest of the context, as in vLLM. Also accepted, with no effect:
``routed_experts_prompt_start`` (mixture-of-experts routing data verifiers asks for on a continued
turn: there is none here) and, at the top level, ``cache_salt`` (there is no prefix cache to salt).
The reply's logprob entries name tokens as ``"token_id:<id>"``, as vLLM's do, so a client never decodes
a token to find which one was sampled; it carries ``prompt_token_ids``, ``usage`` and ``weight_version``
(the ``x-weight-version`` header too). Not implemented (a 400 naming the field): ``stream``, multimodal
``features``, ``prompt_logprobs`` (``/v1/completions`` returns them for ids), ``priority`` other than 0.
The ``X-Session-ID`` header (one per verifiers rollout) is recorded on the
scheduler's request (``GenerationRequest.session_id``); nothing schedules by it yet.

``POST /tokenize`` (``{"prompt"}``, or ``{"messages"}`` rendered as the chat route renders them),
``POST /detokenize`` (``{"tokens"}``) and ``GET /tokenizer_info`` (the special tokens and the chat
template): what lm-eval's remote tokenizer (``tokenizer_backend="remote"``) calls.
"""

# No ``from __future__ import annotations``: FastAPI reads the route signatures at runtime (app.py).
# ``served`` below is app.py's ServedModel, not imported: app.py imports this module (no import cycles).
import time
import uuid
from typing import Any

from pydantic import Field, ValidationError

from .protocol import ChatMessage, ChatRequest, CompletionRequest, RequestError, ToolSpec, _Strict, usage
from .tools import ToolRequestError, encode_chat, request_tools

# Fields of CompletionRequest that are not sampling options, refused in sampling_params, and why.
_NOT_SAMPLING = {
    "model": "send it at the top level",
    "prompt": "the prompt is token_ids",
    "echo": "this route returns no text",
    "stream": "this route does not stream",
    "stream_options": "this route does not stream",
    "prompt_logprobs": "not computed on this route; /v1/completions returns them for a prompt of token ids",
}


class GenerateRequest(_Strict):
    """vLLM's ``/inference/v1/generate`` body (the fields this server implements)."""

    model: str | None = None  # another name than the served model's is a 404, as in the other routes
    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)  # checked by generate_params
    request_id: str | None = None  # echoed; a fresh one when absent
    cache_salt: str | None = None  # salts vLLM's prefix cache; there is no prefix cache here to salt
    priority: int = 0  # vLLM refuses any other value unless it schedules by priority; so does this server


class TokenizePrompt(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # vLLM's default; lm-eval sends false
    return_token_strs: bool = False


class TokenizeChat(_Strict):
    """vLLM's chat form of ``/tokenize``: the conversation rendered as the chat route renders it."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # on top of what the chat template writes (vLLM's default: no)
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def _invalid(exc: ValidationError, *prefix: str):
    """A pydantic error of a body part as the 400 the app's validation handler writes (app.py)."""
    from fastapi.exceptions import RequestValidationError

    return RequestValidationError([{**e, "loc": (*prefix, *e["loc"])} for e in exc.errors()])


def generate_params(body: GenerateRequest) -> CompletionRequest:
    """``sampling_params`` as the completion request with the same sampling options (module doc)."""
    params = dict(body.sampling_params)
    for name in _NOT_SAMPLING:
        if name in params:
            raise RequestError(
                f"unknown or unsupported field 'sampling_params.{name}': {_NOT_SAMPLING[name]}",
                param=f"sampling_params.{name}",
            )
    start = params.pop("routed_experts_prompt_start", None)  # accepted, no effect (module doc)
    if start is not None and type(start) is not int:
        raise RequestError(
            "sampling_params.routed_experts_prompt_start must be an integer",
            param="sampling_params.routed_experts_prompt_start",
        )
    if type(params.get("max_tokens")) is int and params["max_tokens"] == 0:  # completions' scoring-only request
        raise RequestError("sampling_params.max_tokens must be >= 1", param="sampling_params.max_tokens")
    try:
        return CompletionRequest.model_validate({**params, "prompt": body.token_ids})
    except ValidationError as exc:
        raise _invalid(exc, "sampling_params") from exc


def token_logprobs(
    token_ids: list[int], logprobs: list[float], top: list[list[tuple[int, float]]], wanted: int | None
) -> dict[str, Any] | None:
    """A choice's ``logprobs``: ``{"content": [{"token": "token_id:<id>", "logprob", "top_logprobs"}]}``."""
    if wanted is None:
        return None
    alternatives = top if wanted else [[] for _ in token_ids]
    return {
        "content": [
            {
                "token": f"token_id:{t}",
                "logprob": lp,
                "top_logprobs": [{"token": f"token_id:{i}", "logprob": v} for i, v in alt],
            }
            for t, lp, alt in zip(token_ids, logprobs, alternatives)
        ]
    }


async def generate_tokens(served, body: GenerateRequest, session_id: str | None) -> dict[str, Any]:
    """The ``/inference/v1/generate`` response body for ``body``."""
    served.check_model(body.model)
    if body.priority != 0:
        raise RequestError(
            f"priority {body.priority} needs priority scheduling, which this server does not do; "
            "send 0 or leave it out",
            param="priority",
        )
    sampling = generate_params(body)
    prompt = list(body.token_ids)
    try:  # the same checks as completions, naming this route's fields
        max_tokens = served.check_prompt(prompt, sampling.max_tokens, None)
        request = served.request(prompt, sampling, max_tokens)
        request.session_id = request.session_id or session_id  # a gateway session's id comes first
        result = await served.wait(request)  # submits (n over the batch is a RequestError) and awaits
    except RequestError as exc:
        exc.param = "token_ids" if exc.param == "prompt" else exc.param and f"sampling_params.{exc.param}"
        raise
    choices = [
        {
            "index": i,
            "token_ids": s.token_ids,
            "finish_reason": s.finish_reason,
            "logprobs": token_logprobs(s.token_ids, s.logprobs, s.top_logprobs, sampling.logprobs),
        }
        for i, s in enumerate(result.samples)
    ]
    return {
        "request_id": body.request_id or f"generate-{uuid.uuid4().hex}",
        "object": "generate",
        "created": int(time.time()),
        "model": served.name,
        "choices": choices,
        "prompt_token_ids": prompt,
        "usage": usage(len(prompt), sum(len(s.token_ids) for s in result.samples)),
        "weight_version": result.weight_version,
    }


def tokenize(served, raw: Any) -> dict[str, Any]:
    """The ``/tokenize`` response for a ``{"prompt"}`` or a ``{"messages"}`` body."""
    if not isinstance(raw, dict):
        raise RequestError("the body must be a JSON object with 'prompt' (text) or 'messages' (a conversation)")
    try:
        body = (TokenizeChat if "messages" in raw else TokenizePrompt).model_validate(raw)
    except ValidationError as exc:
        raise _invalid(exc) from exc
    served.check_model(body.model)
    if isinstance(body, TokenizeChat):
        ids = chat_ids(served, body)
        ids = _around(served.tokenizer, ids) if body.add_special_tokens else ids
    else:
        ids = served.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    reply = {"tokens": ids, "count": len(ids), "max_model_len": served.max_model_len}
    if body.return_token_strs:
        reply["token_strs"] = served.tokenizer.convert_ids_to_tokens(ids)
    return reply


def _around(tokenizer, ids: list[int]) -> list[int]:
    """``ids`` between the special tokens the tokenizer adds around a text (e.g. a Llama-style BOS)."""
    plain, full = tokenizer.encode("a", add_special_tokens=False), tokenizer.encode("a", add_special_tokens=True)
    start = next(i for i in range(len(full)) if full[i : i + len(plain)] == plain)
    return full[:start] + ids + full[start + len(plain) :]


def chat_ids(served, body: TokenizeChat) -> list[int]:
    """The chat route's prompt ids of ``body``'s conversation: its fields as the ChatRequest's (protocol.py),
    the messages' text encoded as text (``tools.encode_chat``)."""
    if body.continue_final_message and body.add_generation_prompt and "add_generation_prompt" in body.model_fields_set:
        raise RequestError(
            "continue_final_message and add_generation_prompt cannot both be true (the last message "
            "is either continued or closed and answered)",
            param="continue_final_message",
        )
    fields = body.model_fields_set & {
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
    }
    try:
        chat = ChatRequest.model_validate({"messages": body.messages, **{f: getattr(body, f) for f in fields}})
    except ValidationError as exc:
        raise _invalid(exc) from exc
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    try:
        return encode_chat(served.tokenizer, messages, request_tools(chat)[0], **chat.template_kwargs)
    except ToolRequestError as exc:
        raise RequestError(str(exc), param=exc.param) from exc


def tokenizer_info(served) -> dict[str, Any]:
    """What ``/tokenizer_info`` reports: the tokenizer's class, special tokens and chat template."""
    tokenizer = served.tokenizer
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__, "model_max_length": served.max_model_len}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = getattr(tokenizer, name, None)
        info[name] = None if token is None else str(token)
    template = getattr(tokenizer, "chat_template", None)
    info["chat_template"] = template if isinstance(template, str) else None
    return info


def add_token_routes(app, served) -> None:
    """/inference/v1/generate, /tokenize, /detokenize and /tokenizer_info (module doc)."""
    from fastapi import Request, Response

    @app.post("/inference/v1/generate")
    async def generate(body: GenerateRequest, request: Request, response: Response):
        reply = await generate_tokens(served, body, request.headers.get("x-session-id"))
        response.headers["x-weight-version"] = str(reply["weight_version"])  # as every generating route
        return reply

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        try:
            raw = await request.json()
        except ValueError as exc:
            raise RequestError(f"the request body is not valid JSON ({exc})") from exc
        return tokenize(served, raw)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        served.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < served.vocab_size]
        if bad:
            raise RequestError(
                f"tokens has token ids outside the vocabulary [0, {served.vocab_size}): {bad[:5]}", param="tokens"
            )
        return {"prompt": served.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info_route():
        return tokenizer_info(served)
