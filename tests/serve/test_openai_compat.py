"""``lmforge serve`` as an OpenAI drop-in, driven by the ``openai`` client: streaming (completions and
chat, usage, cancellation), the sampling parameters (penalties, logit bias, top logprobs, echo),
``model.load.retrieve``, strict types and errors that name the parameter."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from lmforge.rollout import SamplingParams
from lmforge.serve.scheduler import BatchScheduler, GenerationRequest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_streamed_completion_is_the_non_streamed_one_in_pieces(client):
    kwargs = dict(model="tiny-test", prompt="12+34=", max_tokens=12, temperature=1.0, seed=3, logprobs=2)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    pieces = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in pieces) == whole.choices[0].text
    assert [c.choices[0].model_extra["token_ids"] for c in pieces] == [
        [t] for t in whole.choices[0].model_extra["token_ids"]
    ]
    assert pieces[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in pieces[:-1])
    streamed = [lp for c in pieces for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-6)
    assert [len(c.choices[0].logprobs.top_logprobs[0]) for c in pieces] == [2] * len(pieces)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(pieces)
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_streamed_chat_with_n_and_stop(client):
    kwargs = dict(
        model="tiny-test",
        messages=[{"role": "user", "content": "7+8="}],
        max_tokens=10,
        n=2,
        temperature=1.0,
        seed=5,
        stop=["1"],
    )
    whole = client.chat.completions.create(**kwargs)
    texts, roles, finish = {0: "", 1: ""}, set(), {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            roles.add(choice.delta.role)
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert "assistant" in roles
    assert [texts[i] for i in (0, 1)] == [c.message.content for c in whole.choices]
    assert all("1" not in t for t in texts.values())  # cut before the stop string, as the non-streamed text
    assert finish == {c.index: c.finish_reason for c in whole.choices}


def test_tokens_arrive_while_the_request_still_decodes(server):
    """The first chunk comes long before the last: tokens are sent as decoded, not after the request."""
    body = {"prompt": "1+2=", "max_tokens": 40, "ignore_eos": True, "stream": True, "temperature": 1.0}
    arrivals = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
    assert len(arrivals) == 40
    assert arrivals[-1] - arrivals[0] > 5 * (arrivals[1] - arrivals[0])  # spread over the decode


def test_a_client_that_disconnects_frees_its_rows(server):
    body = {"prompt": "1+2=", "max_tokens": 50, "ignore_eos": True, "stream": True, "n": 4}
    scheduler = server.served.scheduler
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["token_ids"]:
                break  # the first token: the 4 rows are decoding; now hang up
    deadline = time.monotonic() + 20
    while scheduler.num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scheduler.num_running == 0
    steps = scheduler.num_steps
    time.sleep(0.3)
    assert scheduler.num_steps == steps  # nothing left decoding for the departed client


def test_models_retrieve_and_created(client):
    listed = client.models.list().data[0]
    assert listed.id == "tiny-test" and listed.created > 1_700_000_000
    assert client.models.retrieve("tiny-test").id == "tiny-test"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")


def test_top_logprobs_are_the_best_alternatives_of_the_sampling_distribution(client):
    chat = client.chat.completions.create(
        model="tiny-test",
        messages=[{"role": "user", "content": "3+4="}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    for item in chat.choices[0].logprobs.content:
        alternatives = [a.logprob for a in item.top_logprobs]
        assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
        assert item.logprob == pytest.approx(alternatives[0], abs=1e-6)  # greedy picks the best one
        assert item.top_logprobs[0].token == item.token
    completion = client.completions.create(model="tiny-test", prompt="3+4=", max_tokens=4, temperature=0, logprobs=5)
    for position in completion.choices[0].logprobs.top_logprobs:
        assert len(position) == 5 and sum(math.exp(v) for v in position.values()) <= 1 + 1e-5


def test_echo_prepends_the_prompt(client):
    plain = client.completions.create(model="tiny-test", prompt="5+5=", max_tokens=4, temperature=0)
    echoed = client.completions.create(model="tiny-test", prompt="5+5=", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "5+5=" + plain.choices[0].text


def test_langchain_style_zero_penalties_and_empty_bias_are_accepted(client):
    """What langchain's OpenAI completions class sends on every call."""
    out = client.completions.create(
        model="tiny-test",
        prompt="1+1=",
        max_tokens=3,
        temperature=0.7,
        top_p=1,
        n=1,
        frequency_penalty=0.0,
        presence_penalty=0.0,
        logit_bias={},
    )
    assert len(out.choices) == 1


def test_logit_bias_forces_and_forbids_tokens(client, make_tiny):
    _, tokenizer = make_tiny()
    nine = tokenizer.encode("9", add_special_tokens=False)[0]
    forced = client.completions.create(
        model="tiny-test",
        prompt="1+1=",
        max_tokens=6,
        temperature=1.0,
        seed=0,
        logit_bias={str(nine): 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].model_extra["token_ids"] == [nine] * 6
    banned = client.completions.create(
        model="tiny-test",
        prompt="1+1=",
        max_tokens=30,
        temperature=1.0,
        seed=0,
        logit_bias={str(nine): -100},
        extra_body={"ignore_eos": True},
    )
    assert nine not in banned.choices[0].model_extra["token_ids"]


def test_penalties_are_openais_definition(make_tiny):
    """logits - frequency_penalty * count - presence_penalty * (count > 0), counts over the sampled
    tokens so far: replayed by hand with greedy decoding against the model's own logits."""
    model, tokenizer = make_tiny()
    scheduler = BatchScheduler(model, tokenizer.pad_token_id, tokenizer.decode)
    try:
        prompt, steps = [1, 5, 6], 8
        request = GenerationRequest(
            prompt, SamplingParams(temperature=0, max_new_tokens=steps), frequency_penalty=0.7, presence_penalty=0.4
        )
        got = scheduler.submit(request).result(60).samples[0]
    finally:
        scheduler.shutdown()
    counts, ids = torch.zeros(model.config.vocab_size), list(prompt)
    want = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            adjusted = logits - 0.7 * counts - 0.4 * (counts > 0)
            token = int(adjusted.argmax())
            want.append(token)
            counts[token] += 1
            ids.append(token)
    assert got.token_ids == want
    plain = [int(t) for t in got.token_ids]
    assert len(set(plain)) > 1  # the penalties moved greedy decoding off a single repeated token


@pytest.mark.parametrize(
    "body, param, needle",
    [
        ({"prompt": "1", "max_tokens": "4"}, "max_tokens", "valid integer"),
        ({"prompt": "1", "frequency_penalty": 3}, "frequency_penalty", "less than or equal to 2"),
        ({"prompt": "1", "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
        ({"prompt": "1", "logit_bias": {"99999": 1}}, "logit_bias", "outside the vocabulary"),
        ({"prompt": "1", "max_tokens": 0}, "max_tokens", "needs echo=true"),
        ({"prompt": "1", "best_of": 2}, "best_of", "unknown or unsupported field"),
    ],
)
def test_unsupported_or_bad_parameters_are_a_400_naming_them(server, body, param, needle):
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"]


def test_an_empty_body_names_what_is_missing(server):
    for path, field in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")):
        response = httpx.post(server.url + path, timeout=30)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == field and f"'{field}'" in response.json()["error"]["message"]


def test_langchain_clients_complete_and_stream(server):
    """langchain-openai's completions class (it sends frequency_penalty=0 and friends on every call) and
    its chat class streaming. Optional: skips unless langchain-openai is installed."""
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", model="tiny-test", max_tokens=5, temperature=0, max_retries=0
    )
    text = llm.invoke("1+2=")
    assert isinstance(text, str)
    chat = langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1", api_key="unused", model="tiny-test", max_tokens=6, temperature=0, max_retries=0
    )
    pieces = [chunk.content for chunk in chat.stream("3+4=")]
    assert "".join(pieces) == chat.invoke("3+4=").content
    assert len(pieces) > 1  # streamed, not one piece


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi", "n": 2}),
        ("/inference/v1/generate", {"token_ids": [5, 6, 7]}),
        ("/v1/responses", {"input": "hi"}),
    ],
)
def test_a_non_streamed_request_whose_client_left_is_cancelled(serve_model, path, body):
    """A client that times out and hangs up frees its rows; before, they decoded on to max_tokens for nobody
    (on /inference/v1/generate's default, the rest of the context)."""
    from lmforge.core.config import ModelConfig
    from lmforge.model.load import load_model

    model, tokenizer = load_model(
        ModelConfig(name="tiny:llama", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=4096)
    )
    server = serve_model(model.eval(), tokenizer)
    scheduler = server.served.scheduler
    budget = (
        {"sampling_params": {"max_tokens": 4000, "ignore_eos": True}}
        if "token_ids" in body
        else {"max_output_tokens": 4000, "ignore_eos": True}
        if "input" in body
        else {"max_tokens": 4000, "ignore_eos": True}
    )
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + path, json={**body, **budget}, timeout=1.0)
    deadline = time.monotonic() + 20
    while scheduler.num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scheduler.num_running == 0 and scheduler.num_steps < 3000
