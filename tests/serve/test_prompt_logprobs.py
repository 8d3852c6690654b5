"""Prompt logprobs (``serve/scoring.py``) over HTTP: completions' ``echo`` + ``logprobs`` (with ``max_tokens`` 0
or a completion after the prompt) and vLLM's ``prompt_logprobs`` (completions and chat), checked against a
plain full forward of the same tiny model; the errors that go with them."""

from __future__ import annotations

import pytest
import torch

from lmforge.serve.scoring import score_prompts, text_offsets

CONTEXT = 64  # the test model's max_position_embeddings (tests/serve/conftest.py)

httpx = pytest.importorskip("httpx")

ATOL = 1e-5


def _post(server, path: str, **body):
    return httpx.post(server.url + path, json=body, timeout=60)


def _reference(model, ids: list[int]) -> torch.Tensor:
    """(len(ids) - 1, V): log_softmax of ``model(ids).logits``, position i predicting token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def test_echo_with_max_tokens_0_scores_each_prompt_exactly(server, make_tiny):
    """Two prompts of different lengths, one as text, in one request: every prompt token's logprob and the
    best alternatives equal a plain forward's, nothing is generated."""
    model, tokenizer = make_tiny()
    prompts = ["12+34=46", "7*8=56 9*9=81"]
    response = _post(server, "/v1/completions", prompt=prompts, echo=True, logprobs=2, max_tokens=0, temperature=0)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == 0
    assert len(body["choices"]) == 2
    for choice, text in zip(body["choices"], prompts):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert choice["text"] == text and choice["finish_reason"] == "length" and choice["token_ids"] == []
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [tokenizer.decode([t]) for t in ids]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        reference = _reference(model, ids)
        want = reference.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs["token_logprobs"][1:]), want, rtol=0, atol=ATOL)
        best = torch.topk(reference, 2, dim=-1)
        for position, top in enumerate(logprobs["top_logprobs"][1:]):
            expected = {
                tokenizer.decode([i]): v
                for i, v in zip(best.indices[position].tolist(), best.values[position].tolist())
            }
            expected[logprobs["tokens"][position + 1]] = want[position].item()
            assert top.keys() == expected.keys()
            torch.testing.assert_close(
                torch.tensor([top[k] for k in expected]), torch.tensor(list(expected.values())), rtol=0, atol=ATOL
            )
        assert logprobs["text_offset"] == list(range(len(ids)))  # the char tokenizer: one character a token


def test_echo_with_a_completion_appends_its_tokens(server, make_tiny):
    """echo + logprobs + max_tokens 5 (lm-eval sends max_tokens 1): the prompt's scores, then the completion's
    tokens with the logprobs a plain request returns; text_offset indexes the returned text."""
    model, tokenizer = make_tiny()
    prompt = [1, 5, 6, 7, 8, 9]
    plain = _post(server, "/v1/completions", prompt=prompt, max_tokens=5, temperature=0, logprobs=1).json()
    echoed = _post(server, "/v1/completions", prompt=prompt, max_tokens=5, temperature=0, logprobs=1, echo=True)
    assert echoed.status_code == 200, echoed.text
    plain_choice, choice = plain["choices"][0], echoed.json()["choices"][0]
    completion = plain_choice["token_ids"]
    assert choice["token_ids"] == completion and len(completion) >= 1
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt) + len(completion) == len(logprobs["text_offset"])
    assert logprobs["token_logprobs"][len(prompt) :] == plain_choice["logprobs"]["token_logprobs"]
    want = _reference(model, prompt).gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs["token_logprobs"][1 : len(prompt)]), want, rtol=0, atol=ATOL)
    assert choice["text"] == tokenizer.decode(prompt, skip_special_tokens=True) + plain_choice["text"]
    for token, offset, top, lp in zip(
        logprobs["tokens"][1:],
        logprobs["text_offset"][1:],
        logprobs["top_logprobs"][1:],
        logprobs["token_logprobs"][1:],
    ):
        assert top[token] == lp  # each position's dict holds its own token, as lm-eval's is_greedy reads
        assert token == "" or choice["text"][offset : offset + len(token)] == token


def test_prompt_logprobs_on_completions_and_chat(server, make_tiny):
    """vLLM's shape: per position {str(id): {logprob, rank, decoded_token}}, the prompt token and the N best."""
    model, tokenizer = make_tiny()
    prompt = [1, 5, 6, 7, 8, 9, 10]
    body = _post(server, "/v1/completions", prompt=prompt, max_tokens=2, prompt_logprobs=3).json()
    entries = body["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    assert body["choices"][0]["logprobs"] is None  # the completion's own logprobs were not asked for
    reference = _reference(model, prompt)
    for position, entry in enumerate(entries[1:]):
        token, row = prompt[position + 1], reference[position]
        mine = entry[str(token)]
        assert mine["decoded_token"] == tokenizer.decode([token])
        assert mine["rank"] == 1 + int((row > row[token]).sum())
        assert abs(mine["logprob"] - row[token].item()) < ATOL
        best = torch.topk(row, 3)
        assert set(entry) == {str(token), *map(str, best.indices.tolist())}
        for rank, (i, value) in enumerate(zip(best.indices.tolist(), best.values.tolist()), start=1):
            assert abs(entry[str(i)]["logprob"] - value) < ATOL
            assert entry[str(i)]["rank"] == rank or i == token
    chat = _post(
        server, "/v1/chat/completions", messages=[{"role": "user", "content": "1+2="}], max_tokens=2, prompt_logprobs=0
    ).json()
    rendered = chat["prompt_token_ids"]
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(rendered)
    reference = _reference(model, rendered)
    for position, entry in enumerate(chat["prompt_logprobs"][1:]):
        token = rendered[position + 1]
        assert list(entry) == [str(token)]  # N = 0: the prompt token alone
        assert abs(entry[str(token)]["logprob"] - reference[position, token].item()) < ATOL


def test_scoring_is_the_same_however_prompts_are_chunked(make_tiny):
    """score_prompts right-pads a chunk of prompts into one forward; a budget that forces one prompt per
    forward gives the same numbers, and both match each prompt's own forward."""
    model, _ = make_tiny()
    prompts = [[1, 5, 6], [1, 7, 8, 9, 10, 11, 12], [2, 3], [1] + list(range(4, 20))]
    together = score_prompts(model, prompts, top_n=2)
    alone = score_prompts(model, prompts, top_n=2, budget=1)
    for prompt, a, b in zip(prompts, together, alone):
        want = _reference(model, prompt).gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(a.logprobs[1:]), want, rtol=0, atol=ATOL)
        torch.testing.assert_close(torch.tensor(b.logprobs[1:]), want, rtol=0, atol=ATOL)
        assert a.token_ids == prompt and a.ranks == b.ranks and a.ranks[0] is None


def test_text_offsets_count_a_split_character_once():
    """A character whose bytes two tokens share: the first token adds the replacement character, the second
    nothing, so the offsets after it still index the decoded text."""
    pieces = {0: b"a", 1: b"\xc3", 2: b"\xa9", 3: b"b"}  # 1 + 2 spell "é"

    def decode(ids):
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    ids = [0, 1, 2, 3, 0]
    offsets = text_offsets(ids, decode, start=10)
    assert decode(ids) == "aéba" and offsets == [10, 11, 12, 12, 13]  # "b" at 10 + 2, the last "a" at 10 + 3


@pytest.mark.parametrize(
    "body, param, needle",
    [
        (
            {"prompt": [1] * (CONTEXT + 1), "echo": True, "logprobs": 1, "max_tokens": 0},
            "prompt",
            f"maximum context length is {CONTEXT} tokens. However, you requested {CONTEXT + 1} tokens",
        ),
        ({"prompt": [1] * CONTEXT, "echo": True, "logprobs": 1, "max_tokens": 1}, "prompt", "maximum context length"),
        ({"prompt": [1, 2], "echo": True, "logprobs": 1, "stream": True}, "stream", "not streamed"),
        ({"prompt": [1, 2], "prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
        ({"prompt": [1, 2], "max_tokens": -1, "echo": True}, "max_tokens", "greater than or equal to 0"),
    ],
)
def test_bad_scoring_requests_are_a_400_naming_the_field(server, body, param, needle):
    response = _post(server, "/v1/completions", **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"], error


def test_a_prompt_filling_the_context_can_be_scored(server):
    response = _post(server, "/v1/completions", prompt=[1] + [5] * (CONTEXT - 1), echo=True, logprobs=0, max_tokens=0)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["logprobs"]["token_logprobs"]) == CONTEXT


def test_echo_with_max_tokens_0_and_no_logprobs_echoes_the_prompt(server):
    """Nothing to generate and nothing to score: once a false 'weights changed' 503."""
    response = _post(server, "/v1/completions", prompt=["1+2=", "3+4="], echo=True, max_tokens=0, n=2)
    assert response.status_code == 200, response.text
    body = response.json()
    assert [c["text"] for c in body["choices"]] == ["1+2=", "1+2=", "3+4=", "3+4="]
    assert {c["finish_reason"] for c in body["choices"]} == {"length"} and body["usage"]["completion_tokens"] == 0
