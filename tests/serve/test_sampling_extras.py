"""vLLM's sampling extras on ``lmforge serve`` (``serve/extras.py``), each against a hand computation on
the tiny model: the sampled tokens are replayed through the model, and each returned logprob must be
that token's under the distribution written out here (penalties, temperature, min_p, top-k, top-p, in
vLLM's order); greedy runs must pick the hand-computed argmax."""

from __future__ import annotations

import json
import math

import pytest
import torch

httpx = pytest.importorskip("httpx")

PROMPT = [5, 6, 14, 7, 8]  # "12+34" in the char tokenizer
EOS = 2  # the char tokenizer's <eos>


def post(server, path: str, body: dict) -> dict:
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def complete(server, **body) -> dict:
    return post(server, "/v1/completions", {"prompt": PROMPT, **body})["choices"][0]


def next_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def processed(
    logits: torch.Tensor, temperature: float, min_p: float = 0.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Log-probabilities of vLLM's sampling distribution, written out: temperature, min_p on the tempered
    probabilities, top-k, then top-p on what is left (renormalised)."""
    probs = torch.softmax(logits / temperature, -1)
    keep = probs >= min_p * probs.max()
    if top_k:
        keep &= probs >= torch.topk(probs, top_k).values[-1]
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum()
    if top_p < 1:
        order = torch.argsort(probs, descending=True)
        before = torch.cumsum(probs[order], 0) - probs[order]  # mass of the strictly better tokens
        drop = torch.zeros_like(keep)
        drop[order] = before >= top_p
        probs = torch.where(drop, 0.0, probs)
        probs = probs / probs.sum()
    return probs.log()


@pytest.mark.parametrize(
    "settings",
    [
        {"top_k": 3},
        {"min_p": 0.3},
        {"min_p": 0.05, "top_k": 6, "top_p": 0.8},
        {"top_k": -1, "min_p": 0.0},  # both off: the plain tempered distribution
    ],
)
def test_truncation_extras_sample_from_the_hand_computed_distribution(server, make_tiny, settings):
    model, _ = make_tiny()
    choice = complete(server, max_tokens=24, temperature=1.7, seed=11, logprobs=0, ignore_eos=True, **settings)
    tokens, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    hand = {
        "top_k": max(settings.get("top_k", 0), 0),
        "min_p": settings.get("min_p", 0.0),
        "top_p": settings.get("top_p", 1.0),
    }
    truncated = 0
    for i, token in enumerate(tokens):
        want = processed(next_logits(model, PROMPT + tokens[:i]), 1.7, **hand)
        assert want[token] > -math.inf  # never a token the truncation removed
        assert logprobs[i] == pytest.approx(float(want[token]), abs=1e-4)
        truncated += int(torch.isinf(want).sum() > 0)
    if hand != {"top_k": 0, "min_p": 0.0, "top_p": 1.0}:
        assert truncated > len(tokens) // 2  # the distributions really were cut


def test_top_logprobs_are_the_truncated_distributions_best(server, make_tiny):
    model, _ = make_tiny()
    choice = complete(server, max_tokens=6, temperature=1.0, seed=2, logprobs=5, top_k=3, ignore_eos=True)
    for i, alternatives in enumerate(choice["logprobs"]["top_logprobs"]):  # 5 asked, 3 possible: those 3
        want = processed(next_logits(model, PROMPT + choice["token_ids"][:i]), 1.0, top_k=3)
        assert sorted(alternatives.values(), reverse=True) == pytest.approx(
            torch.sort(want, descending=True).values[:3].tolist(), abs=1e-4
        )


def test_repetition_penalty_is_vllms_over_prompt_and_output_before_frequency(server, make_tiny):
    """Tokens seen in the prompt or the output: positive logits divided by the penalty, others
    multiplied; then OpenAI's frequency penalty over the output's counts (vLLM's order). Greedy replay."""
    model, _ = make_tiny()
    got = complete(
        server, max_tokens=12, temperature=0, repetition_penalty=1.8, frequency_penalty=0.3, ignore_eos=True, logprobs=0
    )
    plain = complete(server, max_tokens=12, temperature=0, ignore_eos=True)
    counts, want, want_logprobs = torch.zeros(model.config.vocab_size), [], []
    for _ in range(12):
        logits = next_logits(model, PROMPT + want)
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[PROMPT + want] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / 1.8, logits * 1.8), logits)
        logits = logits - 0.3 * counts
        token = int(logits.argmax())
        want_logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        want.append(token)
        counts[token] += 1
    assert got["token_ids"] == want
    assert got["logprobs"]["token_logprobs"] == pytest.approx(want_logprobs, abs=1e-5)
    assert got["token_ids"] != plain["token_ids"]  # the penalty changed what greedy decoding picks


def test_min_tokens_holds_back_the_stop_token(server, make_tiny):
    model, _ = make_tiny()
    forced = {"logit_bias": {str(EOS): 100}, "temperature": 0, "max_tokens": 10}
    assert complete(server, **forced)["token_ids"] == [EOS]  # without min_tokens the EOS comes first
    got = complete(server, **forced, min_tokens=4, logprobs=0)
    want = []
    for _ in range(4):  # the EOS (biased to the top) masked: greedy over the rest
        logits = next_logits(model, PROMPT + want)
        logits[EOS] = -math.inf
        want.append(int(logits.argmax()))
    assert got["token_ids"] == want + [EOS] and got["finish_reason"] == "stop"
    assert got["logprobs"]["token_logprobs"][-1] == pytest.approx(0.0, abs=1e-6)  # the biased EOS, once allowed


def test_min_tokens_ignores_stop_strings_in_its_first_tokens(server, make_tiny):
    _, tokenizer = make_tiny()
    greedy = complete(server, max_tokens=20, temperature=0, ignore_eos=True)["token_ids"]
    stop = tokenizer.decode([greedy[0]])  # the first character: a plain request stops at once
    assert complete(server, max_tokens=20, temperature=0, ignore_eos=True, stop=[stop])["text"] == ""
    got = complete(server, max_tokens=20, temperature=0, ignore_eos=True, stop=[stop], min_tokens=3)
    later = [k for k in range(3, len(greedy)) if tokenizer.decode([greedy[k]]) == stop]
    if later:  # stops at the first occurrence past the first 3 tokens, cut before it
        assert got["token_ids"] == greedy[: later[0] + 1] and got["finish_reason"] == "stop"
        assert got["text"] == tokenizer.decode(greedy[: later[0]])
    else:
        assert got["token_ids"] == greedy and got["finish_reason"] == "length"
        assert got["text"] == tokenizer.decode(greedy)


def test_stop_token_ids_and_include_stop_str_in_output(server, make_tiny):
    _, tokenizer = make_tiny()
    greedy = complete(server, max_tokens=12, temperature=0, ignore_eos=True)["token_ids"]
    stop_id = greedy[2]
    first = greedy.index(stop_id)
    got = complete(server, max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    assert got["token_ids"] == greedy[: first + 1] and got["finish_reason"] == "stop"
    assert got["text"] == tokenizer.decode(greedy[:first])  # the stop token's text left out, as vLLM
    kept = complete(
        server, max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop_id], include_stop_str_in_output=True
    )
    assert kept["text"] == tokenizer.decode(greedy[: first + 1])
    stop = tokenizer.decode(greedy[2:4])
    cut = complete(server, max_tokens=12, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    text = tokenizer.decode(greedy)
    assert cut["text"] == text[: text.index(stop) + len(stop)]


def test_skip_special_tokens_false_keeps_them_in_the_text(server):
    body = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {str(EOS): 100}}
    assert complete(server, **body)["text"] == ""
    assert complete(server, **body, skip_special_tokens=False)["text"] == "<eos>" * 3


def test_extras_stream_as_they_complete(server):
    """Streamed chunks add up to the non-streamed text and ids with every text-shaping extra on."""
    body = {
        "prompt": PROMPT,
        "max_tokens": 16,
        "temperature": 1.3,
        "seed": 4,
        "min_p": 0.1,
        "top_k": 8,
        "repetition_penalty": 1.2,
        "min_tokens": 3,
        "stop": ["3"],
        "include_stop_str_in_output": True,
        "stop_token_ids": [9],
        "ignore_eos": True,
    }
    whole = post(server, "/v1/completions", body)["choices"][0]
    text, ids = "", []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text, ids = text + choice["text"], ids + choice["token_ids"]
    assert (text, ids) == (whole["text"], whole["token_ids"])


def test_chat_takes_the_extras_too(server, make_tiny):
    model, tokenizer = make_tiny()
    body = {
        "messages": [{"role": "user", "content": "1+2="}],
        "max_tokens": 8,
        "temperature": 0.9,
        "seed": 1,
        "top_k": 2,
        "logprobs": True,
    }
    reply = post(server, "/v1/chat/completions", body)
    prompt, choice = reply["prompt_token_ids"], reply["choices"][0]
    for i, (token, item) in enumerate(zip(choice["token_ids"], choice["logprobs"]["content"])):
        want = processed(next_logits(model, prompt + choice["token_ids"][:i]), 0.9, top_k=2)
        assert item["logprob"] == pytest.approx(float(want[token]), abs=1e-4)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"stop_token_ids": [999]}, "stop_token_ids"),
        ({"stop_token_ids": "5"}, "stop_token_ids"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ],
)
def test_bad_extras_are_a_400_naming_them(server, body, param):
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "1", **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def chat_server(serve_model, make_tiny):
    """A server whose chat template reads a variable, so that chat_template_kwargs shows in the prompt."""
    model, tokenizer = make_tiny()
    tokenizer.chat_template = (
        "{% if enable_thinking is defined and not enable_thinking %}=+=\n{% endif %}" + tokenizer.chat_template
    )
    return serve_model(model, tokenizer), tokenizer


def test_chat_template_extras_shape_the_prompt(serve_model, make_tiny):
    running, tokenizer = chat_server(serve_model, make_tiny)
    turns = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]

    def prompt_text(**extra) -> str:
        body = {"messages": turns, "max_tokens": 1, "temperature": 0, **extra}
        return tokenizer.decode(post(running, "/v1/chat/completions", body)["prompt_token_ids"])

    assert prompt_text() == "<|user|>\n1+2=<eos>\n<|assistant|>\n3<eos>\n<|assistant|>\n"
    assert prompt_text(chat_template_kwargs={"enable_thinking": False}).startswith("=+=\n<|user|>")
    assert prompt_text(add_generation_prompt=False) == "<|user|>\n1+2=<eos>\n<|assistant|>\n3<eos>\n"
    assert prompt_text(continue_final_message=True) == "<|user|>\n1+2=<eos>\n<|assistant|>\n3"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ],
)
def test_chat_template_extras_that_conflict_are_a_400(server, extra, param):
    body = {"messages": [{"role": "user", "content": "1"}], "max_tokens": 1, **extra}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.smollm2
def test_smollm2_continues_a_reply_and_keeps_special_tokens_on_request(serve_model, smollm2):
    """SmolLM2's own template through the openai client's extra_body: continue_final_message leaves the
    assistant's prefix open; with skip_special_tokens false the text of an EOS-ended reply still leaves
    the EOS out, unless include_stop_str_in_output asks for it (vLLM's behaviour)."""
    openai = pytest.importorskip("openai")
    model, tokenizer = smollm2
    client = openai.OpenAI(base_url=serve_model(model, tokenizer).url + "/v1", api_key="unused", max_retries=0)
    prefix = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    reply = client.chat.completions.create(
        model="tiny-test", messages=prefix, max_tokens=8, temperature=0, extra_body={"continue_final_message": True}
    )
    assert tokenizer.decode(reply.model_extra["prompt_token_ids"]).endswith(
        "<|im_start|>assistant\nThe capital of France is"
    )
    assert "Paris" in reply.choices[0].message.content
    question = [{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}]  # smolagents' content shape
    kept = {}
    for include in (False, True):
        answer = client.chat.completions.create(
            model="tiny-test",
            messages=question,
            max_tokens=40,
            temperature=0,
            extra_body={"skip_special_tokens": False, "include_stop_str_in_output": include},
        )
        assert answer.choices[0].finish_reason == "stop"
        kept[include] = answer.choices[0].message.content
    assert kept[True] == kept[False] + "<|im_end|>" and "<|im_end|>" not in kept[False]


@pytest.mark.parametrize("truncation", [{"top_k": 2}, {"top_p": 0.5}])
def test_greedy_top_logprobs_follow_the_sampled_tokens_convention(server, make_tiny, truncation):
    """At temperature 0 the sampled token's logprob is the untempered, untruncated log-softmax; its
    alternatives are of that same distribution (once the truncated one: the same token had two values)."""
    model, _ = make_tiny()
    choice = complete(server, max_tokens=5, temperature=0, logprobs=3, ignore_eos=True, **truncation)
    for i, (token, logprob) in enumerate(zip(choice["token_ids"], choice["logprobs"]["token_logprobs"])):
        want = torch.log_softmax(next_logits(model, PROMPT + choice["token_ids"][:i]), -1)
        assert logprob == pytest.approx(want[token].item(), abs=1e-4)
        best = choice["logprobs"]["top_logprobs"][i]
        assert sorted(best.values(), reverse=True) == pytest.approx(torch.topk(want, 3).values.tolist(), abs=1e-4)
        assert max(best.values()) == pytest.approx(logprob, abs=1e-4)  # greedy: the best is the sampled one
