"""What standard clients send back is accepted and changes nothing; what would change the output and is
not implemented stays a 400 naming the field; an unknown model is a 404 (``serve/protocol.py``)."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

QUESTION = {"role": "user", "content": "1+2="}
REPLY = {"role": "assistant", "content": "3"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}


@pytest.fixture
def roomy(serve_model):
    """A server on a tiny model with room for a rendered tool call (the default test model has 64 positions)."""
    from lmforge.core.config import ModelConfig
    from lmforge.model.load import load_model

    model, tokenizer = load_model(
        ModelConfig(name="tiny:llama", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=512)
    )
    return serve_model(model.eval(), tokenizer)


def chat(server, messages, **extra) -> httpx.Response:
    body = {"model": "tiny-test", "messages": messages, "max_tokens": 3, "temperature": 0, **extra}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def prompt_ids(server, messages, **extra) -> list[int]:
    response = chat(server, messages, **extra)
    assert response.status_code == 200, response.text
    return response.json()["prompt_token_ids"]


def test_a_message_from_the_sdks_model_dump_is_taken_back(server):
    """The openai SDK's ChatCompletionMessage.model_dump() (refusal, annotations, audio, function_call and
    tool_calls all null) and its streamed accumulation (tool_calls[].index) render as the plain message."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    message = (
        client.chat.completions.create(model="tiny-test", messages=[QUESTION], max_tokens=3, temperature=0)
        .choices[0]
        .message
    )
    dumped = message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= set(dumped)
    plain = {"role": "assistant", "content": message.content}
    follow_up = {"role": "user", "content": "4+4="}
    want = prompt_ids(server, [QUESTION, plain, follow_up])
    assert prompt_ids(server, [QUESTION, dumped, follow_up]) == want
    assert prompt_ids(server, [QUESTION, message.model_dump(exclude_none=True), follow_up]) == want
    echoed = {**plain, "refusal": None, "annotations": [], "audio": {"id": "audio_1"}, "parsed": {"x": 1}}
    assert prompt_ids(server, [QUESTION, echoed, follow_up]) == want


def test_accumulated_tool_calls_with_index_render_as_without(roomy):
    tool_answer = {"role": "tool", "tool_call_id": "call_1", "content": "3"}
    plain = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    streamed = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [{**CALL, "index": 0, "function": {**CALL["function"], "parsed_arguments": {"a": 1}}}],
    }
    want = prompt_ids(roomy, [QUESTION, plain, tool_answer])
    assert prompt_ids(roomy, [QUESTION, streamed, tool_answer]) == want


def test_text_parts_are_joined(server):
    parts = [{"type": "text", "text": "1+2"}, {"type": "text", "text": "="}]
    assert prompt_ids(server, [{"role": "user", "content": parts}]) == prompt_ids(
        server, [{"role": "user", "content": "1+2\n="}]
    )
    system = {"role": "system", "content": [{"type": "text", "text": "2+2=4"}]}  # smolagents' system prompt
    assert prompt_ids(server, [system, QUESTION]) == prompt_ids(
        server, [{"role": "system", "content": "2+2=4"}, QUESTION]
    )


@pytest.mark.parametrize(
    "message, param, needle",
    [
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]},
            "messages.0.content",
            "reads text only",
        ),
        (
            {"role": "user", "content": [{"type": "text", "text": "1"}, {"type": "input_audio", "input_audio": {}}]},
            "messages.0.content",
            'part 1 is "input_audio"',
        ),
        ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages.0.content", "part 0 must be"),
        ({"role": "user", "content": 5}, "messages.0.content", "a string, a list of text parts or null"),
        (
            {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
            "messages.0.function_call",
            "send the call as tool_calls",
        ),
        ({"role": "user", "content": "1", "refusal": 5}, "messages.0.refusal", "valid string"),
    ],
)
def test_what_the_model_cannot_read_is_a_400_naming_the_field(server, message, param, needle):
    response = chat(server, [message])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"], error


def test_fields_that_change_nothing_are_ignored(server):
    want = chat(server, [QUESTION]).json()["choices"][0]["token_ids"]
    ignored = {
        "store": True,
        "metadata": {"run": "7"},
        "user": "u",
        "service_tier": "auto",
        "return_token_ids": True,
        "stream_options": None,
    }
    got = chat(server, [QUESTION], **ignored)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["token_ids"] == want
    completion = httpx.post(
        server.url + "/v1/completions", json={"prompt": "1+2=", "max_tokens": 2, **ignored}, timeout=60
    )
    assert completion.status_code == 200, completion.text


@pytest.mark.parametrize(
    "path, field, value",
    [
        ("/v1/completions", "best_of", 2),
        ("/v1/completions", "suffix", "x"),
        ("/v1/completions", "use_beam_search", True),
        ("/v1/chat/completions", "reasoning_effort", "high"),
        ("/v1/chat/completions", "prediction", {"type": "content", "content": "3"}),
        ("/v1/chat/completions", "length_penalty", 2.0),
        ("/v1/chat/completions", "metadata", {"run": 7}),  # OpenAI's metadata values are strings: types stay strict
    ],
)
def test_what_would_change_the_output_stays_a_400(server, path, field, value):
    body = {"prompt": "1"} if path == "/v1/completions" else {"messages": [QUESTION]}
    response = httpx.post(server.url + path, json={**body, field: value, "max_tokens": 1}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].split(".")[0] == field


def test_an_unknown_model_is_a_404_naming_the_served_one(server):
    for path, body in (("/v1/completions", {"prompt": "1"}), ("/v1/chat/completions", {"messages": [QUESTION]})):
        response = httpx.post(server.url + path, json={**body, "model": "gpt-4o", "max_tokens": 1}, timeout=30)
        assert response.status_code == 404, response.text
        error = response.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "'gpt-4o'" in error["message"] and "'tiny-test'" in error["message"]
        no_model = httpx.post(server.url + path, json={**body, "max_tokens": 1}, timeout=30)
        assert no_model.status_code == 200, no_model.text  # an absent model field is the served one
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[QUESTION], max_tokens=1)


def test_aliases_are_accepted(server):
    """`lmforge serve MODEL --name NAME` answers to both NAME and MODEL (command.py passes MODEL as an alias)."""
    server.served.aliases.add("tiny:llama")
    for name in ("tiny-test", "tiny:llama"):
        response = httpx.post(
            server.url + "/v1/completions", json={"model": name, "prompt": "1", "max_tokens": 1}, timeout=30
        )
        assert response.status_code == 200, response.text
        assert httpx.get(server.url + f"/v1/models/{name}", timeout=30).json()["id"] == "tiny-test"


def test_an_unknown_role_is_a_400_and_developer_is_the_system_message(server):
    response = chat(server, [{"role": "wizard", "content": "Hi"}])
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages.0.role"
    developer = prompt_ids(server, [{"role": "developer", "content": "Be brief."}, QUESTION])
    assert developer == prompt_ids(server, [{"role": "system", "content": "Be brief."}, QUESTION])


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_torch_cannot_take_is_a_400_and_the_server_keeps_serving(server, seed):
    """A seed outside torch.Generator's range once stopped the generation thread (every later request a 503)."""
    response = chat(server, [QUESTION], seed=seed)
    assert response.status_code == 400 and response.json()["error"]["param"] == "seed"
    assert chat(server, [QUESTION], seed=2**64 - 1).status_code == 200
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_health_fails_once_the_generation_thread_has_stopped(server):
    server.served.scheduler.shutdown()
    response = httpx.get(server.url + "/health", timeout=10)
    assert response.status_code == 503 and "generation thread" in response.json()["error"]["message"]


TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    },
}


@pytest.mark.parametrize(
    "tools, param, needle",
    [
        (
            [{**TOOL, "function": {**TOOL["function"], "name": "my tool"}}],
            "tools.0.function.name",
            "^[a-zA-Z0-9_-]{1,64}$",
        ),
        ([{**TOOL, "function": {**TOOL["function"], "name": "x" * 65}}], "tools.0.function.name", "OpenAI's rule"),
        ([TOOL, TOOL], "tools.1.function.name", "two tools are named 'add'"),
        (
            [
                {
                    **TOOL,
                    "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "int"}}}},
                }
            ],
            "tools.0.function.parameters",
            "not a valid JSON Schema at properties/a/type",
        ),
        (
            [{**TOOL, "function": {"name": "add", "parameters": {"type": "object", "required": "a"}}}],
            "tools.0.function.parameters",
            "not a valid JSON Schema at required",
        ),
        (
            [{**TOOL, "function": {"name": "add", "parameters": {"type": "string"}}}],
            "tools.0.function.parameters",
            "object schema",
        ),
    ],
)
def test_tool_definitions_openai_refuses_are_a_400_naming_the_field(roomy, tools, param, needle):
    pytest.importorskip("jsonschema")
    response = chat(roomy, [QUESTION], tools=tools)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"], error
    assert chat(roomy, [QUESTION], tools=[TOOL]).status_code == 200  # the well-formed one is served
