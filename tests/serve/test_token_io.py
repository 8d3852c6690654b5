"""Token in, token out (``serve/generate.py``) on the tiny model: ``/inference/v1/generate`` as verifiers'
training client calls it, checked against ``/v1/completions`` on the same ids; ``/tokenize``,
``/detokenize`` and ``/tokenizer_info`` against the tokenizer, the chat route and lm-eval's remote tokenizer."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")

PROMPT = [1, 5, 6, 7, 8]
CONVERSATION = [{"role": "system", "content": "add"}, {"role": "user", "content": "12+34="}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
]


def _post(server, path: str, headers: dict | None = None, **body):
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def _generate(server, token_ids=PROMPT, headers=None, **sampling):
    return _post(
        server, "/inference/v1/generate", headers, model="tiny-test", token_ids=token_ids, sampling_params=sampling
    )


def test_generate_equals_completions_on_the_same_ids(server):
    """Same ids, seed and options: the same tokens and logprobs; the logprob entries name token ids
    (verifiers' parser requires "token_id:<id>", one per token), with the N alternatives completions gives."""
    sampling = {
        "temperature": 1.0,
        "top_p": 0.9,
        "max_tokens": 8,
        "seed": 3,
        "n": 2,
        "logprobs": 2,
        "skip_special_tokens": False,
    }
    response = _generate(server, **sampling)
    assert response.status_code == 200 and response.headers["x-weight-version"] == "0"
    body = response.json()
    completion = _post(
        server, "/v1/completions", prompt=PROMPT, **{k: v for k, v in sampling.items() if k != "skip_special_tokens"}
    ).json()
    assert body["prompt_token_ids"] == PROMPT and body["model"] == "tiny-test" and body["weight_version"] == 0
    assert body["request_id"] and len(body["choices"]) == 2
    for ours, theirs in zip(body["choices"], completion["choices"]):
        ids = theirs["token_ids"]
        assert ours["token_ids"] == ids and ours["finish_reason"] == theirs["finish_reason"]
        content = ours["logprobs"]["content"]
        assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
        assert [e["logprob"] for e in content] == theirs["logprobs"]["token_logprobs"]
        for entry, alternatives in zip(content, theirs["logprobs"]["top_logprobs"]):
            assert [a["logprob"] for a in entry["top_logprobs"]] == list(alternatives.values())
            assert all(a["token"].startswith("token_id:") for a in entry["top_logprobs"])
    completion_tokens = sum(len(c["token_ids"]) for c in body["choices"])
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": completion_tokens,
        "total_tokens": 5 + completion_tokens,
    }


def test_generate_finish_reasons_and_stop_token_ids(server):
    greedy = _generate(server, temperature=0, max_tokens=4).json()["choices"][0]
    assert greedy["finish_reason"] == "length" and len(greedy["token_ids"]) == 4
    assert greedy["logprobs"] is None  # none asked for
    first = greedy["token_ids"][0]
    stopped = _generate(server, temperature=0, max_tokens=4, stop_token_ids=[first], logprobs=0).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["token_ids"] == [first]  # the stop id is kept
    assert [e["top_logprobs"] for e in stopped["logprobs"]["content"]] == [[]]
    # no max_tokens: vLLM's default, the rest of the context
    rest = _generate(server, temperature=0, ignore_eos=True).json()["choices"][0]
    assert rest["finish_reason"] == "length" and len(rest["token_ids"]) == 64 - len(PROMPT)


def test_generate_records_the_session_id(server):
    served, seen = server.served, []
    submit = served.submit
    served.submit = lambda request: (seen.append(request), submit(request))[1]
    _generate(server, headers={"X-Session-ID": "rollout-7"}, max_tokens=2)
    _generate(server, max_tokens=2)
    assert [r.session_id for r in seen] == ["rollout-7", None]


@pytest.mark.parametrize(
    "body, param, needle",
    [
        ({"sampling_params": {"best_of": 2}}, "sampling_params.best_of", "unknown or unsupported field"),
        ({"sampling_params": {"temperature": "1"}}, "sampling_params.temperature", "valid number"),
        ({"sampling_params": {"stream": True}}, "sampling_params.stream", "does not stream"),
        ({"sampling_params": {"prompt": [1]}}, "sampling_params.prompt", "the prompt is token_ids"),
        ({"sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens", ">= 1"),
        ({"sampling_params": {"max_tokens": 60}}, "sampling_params.max_tokens", "maximum context length is 64"),
        ({"sampling_params": {"n": 33}}, "sampling_params.n", "n must be in [1, 32]"),
        ({"sampling_params": {"logit_bias": {"99": 1}}}, "sampling_params.logit_bias", "outside the vocabulary"),
        (
            {"sampling_params": {"routed_experts_prompt_start": "3"}},
            "sampling_params.routed_experts_prompt_start",
            "integer",
        ),
        ({"token_ids": [1, 99]}, "token_ids", "outside the vocabulary [0, 23)"),
        ({"token_ids": [1] * 64}, "token_ids", "maximum context length is 64"),
        ({"token_ids": []}, "token_ids", "at least 1 item"),
        ({"stream": True}, "stream", "unknown or unsupported field 'stream'"),
        ({"priority": 1}, "priority", "priority scheduling"),
    ],
)
def test_generate_errors_name_the_field(server, body, param, needle):
    response = _post(server, "/inference/v1/generate", **{"token_ids": PROMPT, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"]


def test_generate_accepts_what_verifiers_sends(server):
    """renderers.client.generate's body: logprobs=1, stop_token_ids, skip_special_tokens=false, a
    cache_salt, the header; on a continued turn routed_experts_prompt_start (no effect here)."""
    response = _generate(
        server,
        headers={"X-Session-ID": "s"},
        temperature=1.0,
        top_p=1.0,
        max_tokens=5,
        stop_token_ids=[2],
        logprobs=1,
        skip_special_tokens=False,
        routed_experts_prompt_start=4,
    )
    assert response.status_code == 200
    models = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny-test", 64)]


@pytest.mark.parametrize("text", ["12+34=46", "7*8=<eos>", "<bos>x y\n"])
def test_tokenize_detokenize_round_trip(server, make_tiny, text):
    _, tokenizer = make_tiny()
    for special in (False, True):
        body = _post(server, "/tokenize", prompt=text, add_special_tokens=special, return_token_strs=True).json()
        ids = tokenizer.encode(text, add_special_tokens=special)
        assert body == {
            "tokens": ids,
            "count": len(ids),
            "max_model_len": 64,
            "token_strs": tokenizer.convert_ids_to_tokens(ids),
        }
    plain = _post(server, "/tokenize", model="tiny-test", prompt=text).json()
    assert "token_strs" not in plain
    detokenized = _post(server, "/detokenize", model="tiny-test", tokens=plain["tokens"]).json()
    assert detokenized == {"prompt": tokenizer.decode(plain["tokens"], skip_special_tokens=False)}
    if "x" not in text:  # the char tokenizer maps letters to <unk>: only digits and symbols come back as written
        assert detokenized["prompt"] == text


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_tokenize_messages_equals_the_chat_routes_prompt(serve_model, tools):
    from lmforge.core.config import ModelConfig
    from lmforge.model.load import load_model

    # a longer context than the test model's 64: the tools' system block alone is ~480 characters
    server = serve_model(
        *load_model(
            ModelConfig(name="tiny:llama", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=1024)
        )
    )
    extra = {"tools": tools} if tools else {}
    chat = _post(server, "/v1/chat/completions", messages=CONVERSATION, max_tokens=1, **extra).json()
    body = _post(server, "/tokenize", model="tiny-test", messages=CONVERSATION, **extra).json()
    assert body["tokens"] == chat["prompt_token_ids"] and body["count"] == len(body["tokens"])


def test_tokenize_messages_takes_the_chat_routes_template_options(server):
    """continue_final_message and chat_template_kwargs render as they do for the chat route."""
    partial = [*CONVERSATION, {"role": "assistant", "content": "4"}]
    options = {"continue_final_message": True, "chat_template_kwargs": {"unused_variable": 1}}
    chat = _post(server, "/v1/chat/completions", messages=partial, max_tokens=1, **options).json()
    body = _post(server, "/tokenize", messages=partial, **options).json()
    assert body["tokens"] == chat["prompt_token_ids"]
    closed = _post(server, "/tokenize", messages=partial, add_generation_prompt=False).json()["tokens"]
    assert closed[: len(body["tokens"])] == body["tokens"] and len(closed) > len(body["tokens"])


def test_tokenize_messages_without_the_generation_prompt(server, make_tiny):
    _, tokenizer = make_tiny()
    opened = _post(server, "/tokenize", messages=CONVERSATION).json()["tokens"]
    closed = _post(server, "/tokenize", messages=CONVERSATION, add_generation_prompt=False).json()["tokens"]
    assert closed == tokenizer.encode(
        tokenizer.apply_chat_template(CONVERSATION, tokenize=False), add_special_tokens=False
    )
    assert opened[: len(closed)] == closed and len(opened) > len(closed)


@pytest.mark.parametrize(
    "path, body, param, needle",
    [
        ("/tokenize", {"prompt": "1", "foo": 1}, "foo", "unknown or unsupported field 'foo'"),
        ("/tokenize", {"prompt": 5}, "prompt", "valid string"),
        ("/tokenize", {"messages": [{"role": "user"}]}, "messages.0", "content is required"),
        ("/tokenize", {"messages": [], "add_generation_prompt": True}, "messages", "at least 1 item"),
        ("/tokenize", ["1"], None, "a JSON object"),
        (
            "/tokenize",
            {"messages": CONVERSATION, "continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
            "cannot both be true",
        ),
        (
            "/tokenize",
            {"messages": CONVERSATION, "chat_template_kwargs": {"tools": []}},
            "chat_template_kwargs",
            "set by the server",
        ),
        (
            "/tokenize",
            {"messages": CONVERSATION, "tools": TOOLS, "temperature": 1},
            "temperature",
            "unknown or unsupported field",
        ),
        ("/detokenize", {"tokens": [1, 500]}, "tokens", "outside the vocabulary [0, 23)"),
        ("/detokenize", {"tokens": "12"}, "tokens", "valid list"),
    ],
)
def test_tokenize_errors_name_the_field(server, path, body, param, needle):
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/inference/v1/generate", {"model": "other", "token_ids": PROMPT}),
        ("/tokenize", {"model": "other", "prompt": "1"}),
        ("/tokenize", {"model": "other", "messages": CONVERSATION}),
        ("/detokenize", {"model": "other", "tokens": [1]}),
    ],
)
def test_unknown_model_is_404(server, path, body):
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 404 and "'other' does not exist" in response.json()["error"]["message"]


def test_tokenizer_info(server, make_tiny):
    _, tokenizer = make_tiny()
    info = httpx.get(server.url + "/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == "<eos>" and info["bos_token"] == "<bos>" and info["pad_token"] == "<pad>"
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] == 64
    assert info["tokenizer_class"] == type(tokenizer).__name__


def test_lm_eval_remote_tokenizer(server, make_tiny):
    """lm-eval's ``local-completions`` detects the remote tokenizer (``/tokenizer_info``, ``/tokenize``),
    reads the special tokens through it and runs a generation task with it."""
    utils = pytest.importorskip("lm_eval.utils")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    _, tokenizer = make_tiny()
    base_url = server.url + "/v1/completions"
    remote = utils.RemoteTokenizer(base_url)
    assert remote.encode("12+34=<eos>") == tokenizer.encode("12+34=<eos>", add_special_tokens=False)
    assert remote.decode([5, 6, 2]) == "12<eos>"
    assert remote.eos_token_id == tokenizer.eos_token_id and remote.bos_token_id == tokenizer.bos_token_id
    lm = LocalCompletionsAPI(base_url=base_url, model="tiny-test", max_length=64)  # tokenizer_backend "auto"
    assert lm.tokenizer_backend == "remote"
    request = Instance(
        request_type="generate_until",
        doc={},
        idx=0,
        arguments=("12+34=", {"until": ["\n"], "max_gen_toks": 5, "do_sample": False}),
    )
    expected = _post(
        server, "/v1/completions", prompt="12+34=", max_tokens=5, temperature=0, stop=["\n", "<eos>"]
    ).json()["choices"][0]["text"]
    assert lm.generate_until([request]) == [expected]


@pytest.mark.smollm2
def test_smollm2_tokenize_and_lm_eval_remote_tokenizer(serve_model, smollm2):
    """On the real tokenizer: chat tokenize equals the chat route's prompt, special tokens survive
    tokenize/detokenize, and lm-eval's remote tokenizer finds the ids and renders the chat template."""
    utils = pytest.importorskip("lm_eval.utils")
    model, tokenizer = smollm2
    server = serve_model(model, tokenizer, name="smollm2")
    chat = _post(server, "/v1/chat/completions", messages=CONVERSATION, max_tokens=1).json()
    assert _post(server, "/tokenize", messages=CONVERSATION).json()["tokens"] == chat["prompt_token_ids"]
    text = "<|im_start|>user\nWhat is 12+34?<|im_end|>\n"
    ids = _post(server, "/tokenize", prompt=text, add_special_tokens=False).json()["tokens"]
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert _post(server, "/detokenize", tokens=ids).json()["prompt"] == text
    remote = utils.RemoteTokenizer(server.url + "/v1/completions")
    assert remote.eos_token_id == tokenizer.eos_token_id
    assert remote.apply_chat_template(CONVERSATION) == tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )
