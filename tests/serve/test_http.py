"""The HTTP server for real (uvicorn on 127.0.0.1, a free port): OpenAI wire format through httpx and the
``openai`` client, concurrent requests batched, 4xx JSON errors, weight updates with versions."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from lmforge.rollout import SamplingParams, generate
from lmforge.serve import push_weights

httpx = pytest.importorskip("httpx")

PROMPT = [1, 5, 6, 7, 8]


def _post(server, path: str, **body):
    return httpx.post(server.url + path, json=body, timeout=60)


def test_models_and_completion_with_token_ids_and_logprobs(server, make_tiny):
    models = httpx.get(server.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == "tiny-test" and models["data"][0]["max_model_len"] == 64
    response = _post(server, "/v1/completions", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
    assert response.status_code == 200 and response.headers["x-weight-version"] == "0"
    body = response.json()
    assert body["weight_version"] == 0 and body["prompt_token_ids"] == [PROMPT]
    model, tokenizer = make_tiny()
    alone = generate(
        model, [PROMPT], SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=[tokenizer.eos_token_id])
    )
    length = int(alone.completion_lens[0])
    choice = body["choices"][0]
    assert choice["token_ids"] == alone.completion_ids[0, :length].tolist()
    torch.testing.assert_close(
        torch.tensor(choice["logprobs"]["token_logprobs"]), alone.logprobs[0, :length], rtol=0, atol=2e-5
    )
    assert choice["text"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": length, "total_tokens": 5 + length}


def test_openai_client_completions_and_chat(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(
        model="tiny-test", prompt=["12+34=", "7+8="], n=3, max_tokens=5, temperature=1.0, top_p=0.9, seed=1, stop=["9"]
    )
    assert len(completion.choices) == 6 and all("9" not in c.text for c in completion.choices)
    assert completion.model_extra["weight_version"] == 0
    chat = client.chat.completions.create(
        model="tiny-test", messages=[{"role": "user", "content": "1+2="}], max_tokens=4, logprobs=True
    )
    choice = chat.choices[0]
    assert len(choice.logprobs.content) == len(choice.model_extra["token_ids"]) <= 4
    assert all(item.logprob <= 0 for item in choice.logprobs.content)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 64"):
        client.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": "1" * 70}])


def test_concurrent_requests_share_model_steps(server):
    """16 clients at once, 12 tokens each: one after another that is 16 x 11 = 176 model calls; batched,
    they share calls (the exact count depends on arrival times, so the bound is loose but far below 176)."""

    def one(i: int):
        return _post(
            server, "/v1/completions", prompt=[1, 5 + i % 10], max_tokens=12, temperature=1.0, seed=i, stop=None
        )

    scheduler = server.served.scheduler
    before = scheduler.num_steps
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(one, range(16)))
    assert all(r.status_code == 200 for r in responses)
    tokens = sum(len(c["token_ids"]) for r in responses for c in r.json()["choices"])
    assert scheduler.num_steps - before < tokens / 2


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"prompt": [1, 2], "suffix": "x"}, 400, "unknown or unsupported field 'suffix'"),
        ({"prompt": [1, 2], "stream": "yes"}, 400, "stream: Input should be a valid boolean"),
        ({"prompt": [1, 2], "temperature": -1}, 400, "temperature"),
        ({"prompt": [1, 2], "n": 0}, 400, "n: "),
        ({"prompt": [1, 2], "n": 33}, 400, "n must be in [1, 32] (the server's max batch rows), got 33"),
        ({"prompt": [1, 999]}, 400, "outside the vocabulary [0, 23)"),
        ({"prompt": [], "max_tokens": 3}, 400, "prompt is empty"),
        (
            {"prompt": [1] * 60, "max_tokens": 10},
            400,
            "maximum context length is 64 tokens. However, you requested 70 tokens (60 in the prompt, 10 for",
        ),
    ],
)
def test_bad_requests_get_400_json(server, body, status, needle):
    response = _post(server, "/v1/completions", **body)
    assert response.status_code == status
    assert needle in response.json()["error"]["message"]


def test_malformed_json_and_unknown_path(server):
    response = httpx.post(
        server.url + "/v1/completions", content=b'{"prompt": ', timeout=10, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = httpx.get(server.url + "/v1/nothing", timeout=10)
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


def test_weight_updates_by_tensors_and_by_checkpoint_dir(server, make_tiny, tmp_path):
    from lmforge.model.load import save_model

    greedy = dict(prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1)
    before = _post(server, "/v1/completions", **greedy).json()
    new_model, tokenizer = make_tiny(seed=1)
    assert push_weights(server.url, new_model, version=5) == 5
    after = _post(server, "/v1/completions", **greedy).json()
    assert after["weight_version"] == 5
    expected = generate(
        new_model, [PROMPT], SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=[tokenizer.eos_token_id])
    )
    torch.testing.assert_close(
        torch.tensor(after["choices"][0]["logprobs"]["token_logprobs"]),
        expected.logprobs[0, : int(expected.completion_lens[0])],
        rtol=0,
        atol=2e-5,
    )
    assert before["choices"][0]["logprobs"] != after["choices"][0]["logprobs"]

    old_model, _ = make_tiny(seed=0)
    save_model(old_model, tokenizer, tmp_path / "step-000006" / "model")  # an lmforge checkpoint layout
    assert push_weights(server.url, checkpoint_dir=tmp_path / "step-000006") == 6  # no version: +1
    again = _post(server, "/v1/completions", **greedy).json()
    assert again["weight_version"] == 6 and again["choices"][0]["logprobs"] == before["choices"][0]["logprobs"]
    assert httpx.get(server.url + "/v1/weights", timeout=10).json() == {"weight_version": 6}


@pytest.mark.parametrize(
    "path, kwargs, needle",
    [
        ("/v1/weights", {"json": {"checkpoint_dir": "/nonexistent/dir"}}, "'/nonexistent/dir' is not a directory"),
        ("/v1/weights", {"json": {"path": "x"}}, "string 'checkpoint_dir'"),
        ("/v1/weights/tensors", {"content": b"not safetensors"}, "not a safetensors state dict"),
        ("/v1/weights/tensors?version=0", {"content": None}, "must increase: the server is at 0"),
    ],
)
def test_bad_weight_updates_get_400_and_keep_serving(server, make_tiny, path, kwargs, needle):
    from lmforge.serve.weights import state_dict_bytes

    if kwargs.get("content", b"") is None:
        kwargs = {"content": state_dict_bytes(make_tiny()[0])}
    response = httpx.post(server.url + path, timeout=60, **kwargs)
    assert response.status_code == 400 and needle in response.json()["error"]["message"]
    assert _post(server, "/v1/completions", prompt=PROMPT, max_tokens=2).json()["weight_version"] == 0


def test_weights_of_another_shape_are_refused(server, make_tiny):
    from safetensors.torch import save

    state = {k: v.clone() for k, v in make_tiny()[0].state_dict().items()}
    state["model.norm.weight"] = torch.ones(7)
    response = httpx.post(server.url + "/v1/weights/tensors", content=save(state), timeout=60)
    assert response.status_code == 400
    assert "model.norm.weight has shape (7,), the served model's is (32,)" in response.json()["error"]["message"]
