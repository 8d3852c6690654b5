"""rollout.continuous.ContinuousDecoder as the one continuous-batching engine: rows admitted into a running
batch, a kept KV prefix reused, retirement (stop token, stop string after min_tokens, length, cancel), and
the same seeded requests giving the same tokens whether the episode runner's way (``admit`` + ``step``) or
``lmforge serve``'s scheduler drives it."""

from __future__ import annotations

import threading

import pytest
import torch

from lmforge.core.config import ModelConfig
from lmforge.model.load import load_model
from lmforge.rollout import SamplingParams, generate
from lmforge.rollout.continuous import ContinuousDecoder
from lmforge.rollout.drafts import NgramDrafter
from lmforge.serve import BatchScheduler, GenerationRequest


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model, tok = load_model(
        ModelConfig(
            name="tiny:llama", tokenizer="char", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=256
        )
    )
    return model.eval(), tok


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def run(engine, admissions: dict[int, list[tuple]], on_token=None) -> dict:
    """Step ``engine`` until idle, admitting ``admissions[step]`` ((key, ids, params, n[, admit's keywords]))
    before that step; returns each row's (tokens, logprobs, finish reason) by (key, sample index)."""
    out, step = {}, 0
    while engine.busy or step <= max(admissions):
        for key, ids, params, n, *options in admissions.get(step, []):
            for row in engine.admit(key, ids, params, n, **(options[0] if options else {})):
                out[key, row.index] = row
        engine.step(on_token)
        step += 1
    return {k: (row.tokens, row.logprobs, row.finish_reason) for k, row in out.items()}


def test_rows_admitted_into_a_running_batch_decode_what_each_decodes_alone(tiny):
    model, tok = tiny
    greedy = SamplingParams(temperature=0.0, max_new_tokens=9)
    prompts = [encode(tok, t) for t in ("hello world", "ab", "xyz 12")]
    engine = ContinuousDecoder(model, tok.pad_token_id)
    rows = engine.admit(0, prompts[0], greedy)
    engine.step()
    engine.step()
    assert engine.num_running == 1 and engine.num_model_calls == 3  # a prefill, two decode steps
    rows += engine.admit(1, prompts[1], greedy) + engine.admit(2, prompts[2], greedy)
    assert engine.num_running == 1 and len(engine.rows) == 3  # queued until the next step
    engine.step()
    assert engine.num_running == 3 and engine.num_model_calls == 5  # one prefill for both, one decode step
    while engine.busy:
        engine.step()
    for row, prompt in zip(rows, prompts):
        alone = generate(model, [prompt], greedy, pad_token_id=tok.pad_token_id)
        assert row.tokens == alone.completion_ids[0].tolist() and row.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(row.logprobs), alone.logprobs[0], rtol=0, atol=2e-5)


@pytest.mark.parametrize("explicit_key", [False, True], ids=["row-key", "cache-key"])
def test_a_kept_prefix_is_reused_and_a_bounded_store_drops_the_oldest_key(tiny, explicit_key):
    model, tok = tiny
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=4)
    prompt = encode(tok, "12+34=")
    engine = ContinuousDecoder(model, tok.pad_token_id, keep_cache=not explicit_key, max_kept=1)
    options = (lambda key: {"cache_key": f"session {key}"}) if explicit_key else (lambda key: {})
    first = {}
    for key in ("s", "t"):  # "t" finishes after "s" and pushes it out of a store of one
        first[key] = run(engine, {0: [(key, prompt, params, 1, options(key))]})[key, 0][0]
    histories = {key: prompt + tokens + encode(tok, " 7=") for key, tokens in first.items()}
    prefilled = engine.num_prefilled_tokens
    got = run(engine, {0: [(key, ids, params, 1, options(key)) for key, ids in histories.items()]})
    assert engine.num_cached_tokens == len(prompt) + len(first["t"]) - 1  # "t" only; its last token never fed
    assert engine.num_prefilled_tokens - prefilled == len(histories["s"]) + len(" 7=") + 1
    for key, ids in histories.items():  # the reused prefix decodes what the whole ids decode
        whole = run(ContinuousDecoder(model, tok.pad_token_id), {0: [(key, ids, params, 1)]})[key, 0]
        assert got[key, 0][0] == whole[0]
        torch.testing.assert_close(torch.tensor(got[key, 0][1]), torch.tensor(whole[1]), rtol=0, atol=2e-5)


def test_retirement_stop_token_stop_string_after_min_tokens_length_and_cancel(tiny):
    model, tok = tiny
    prompt = encode(tok, "12+34=")
    free = SamplingParams(temperature=1.0, max_new_tokens=20, seed=3)
    tokens = run(ContinuousDecoder(model, tok.pad_token_id), {0: [(0, prompt, free, 1)]})[0, 0][0]
    engine = ContinuousDecoder(model, tok.pad_token_id, keep_cache=False, decode_fn=tok.decode)
    stop_token = SamplingParams(temperature=1.0, max_new_tokens=20, seed=3, stop_token_ids=[tokens[4]])
    late = tokens.index(tokens[4], 5) + 1 if tokens[4] in tokens[5:] else len(tokens)  # past min_tokens=5
    stop = tok.decode(tokens[5:7])
    stop_string = SamplingParams(temperature=1.0, max_new_tokens=20, seed=3, stop_strings=[stop])
    cancelled = threading.Event()
    rows = [
        engine.admit("stop", prompt, stop_token)[0],
        engine.admit("min", prompt, stop_token, min_tokens=5)[0],
        engine.admit("string", prompt, stop_string)[0],
        engine.admit("length", prompt, free)[0],
        engine.admit("cancel", prompt, free, cancelled=cancelled, cache_key="c")[0],
    ]
    seen = []
    engine.step(on_token=lambda row: seen.append((row.key, len(row.tokens), row.finish_reason)))
    cancelled.set()
    while engine.busy:
        engine.step()
    by_key = {row.key: row for row in rows}
    assert seen == [(row.key, 1, None) for row in rows]  # every row, in order, after its first token
    assert by_key["stop"].tokens == tokens[:5] and by_key["stop"].finish_reason == "stop"
    assert by_key["min"].tokens == tokens[:late]
    assert by_key["min"].finish_reason == ("stop" if late < len(tokens) or tokens[-1] == tokens[4] else "length")
    string = by_key["string"].tokens
    assert string == tokens[: len(string)] and len(string) <= 7 and by_key["string"].finish_reason == "stop"
    assert stop in tok.decode(string) and stop not in tok.decode(string[:-1])  # ends where the string appears
    assert by_key["length"].tokens == tokens and by_key["length"].finish_reason == "length"
    assert by_key["cancel"].tokens == tokens[:2] and by_key["cancel"].finish_reason == "cancelled"
    assert engine.num_running == 0
    run(engine, {0: [("again", prompt + tokens[:2] + encode(tok, "1"), free, 1, {"cache_key": "c"})]})
    assert engine.num_cached_tokens == 0  # a cancelled row's entries are not kept


def test_the_scheduler_and_the_episode_way_of_driving_it_give_the_same_tokens(tiny):
    """The same seeded requests, admitted together: the engine driven directly (``admit`` + ``step``, as
    the episode runner does) and through ``BatchScheduler`` give the same tokens and logprobs, bit for bit."""
    model, tok = tiny
    model.requires_grad_(False)  # as the scheduler sets it (with grads on, a forward rounds differently)
    requests = [
        (encode(tok, "12+34="), SamplingParams(temperature=1.0, max_new_tokens=10, seed=5), 1),
        (encode(tok, "7*8="), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=12, seed=9), 2),
        (encode(tok, "12+34="), SamplingParams(temperature=0.0, max_new_tokens=7), 1),
        (encode(tok, "hello"), SamplingParams(temperature=1.0, max_new_tokens=8, seed=5), 3),
    ]
    direct = run(
        ContinuousDecoder(model, tok.pad_token_id, keep_cache=False),
        {0: [(i, ids, params, n) for i, (ids, params, n) in enumerate(requests)]},
    )
    scheduler = BatchScheduler(model, tok.pad_token_id, tok.decode, gather_s=1.0)
    try:
        futures = [scheduler.submit(GenerationRequest(ids, params, n=n)) for ids, params, n in requests]
        results = [f.result(60) for f in futures]
    finally:
        scheduler.shutdown()
    served = {
        (i, j): (s.token_ids, s.logprobs, s.finish_reason)
        for i, result in enumerate(results)
        for j, s in enumerate(result.samples)
    }
    assert served == direct
    assert direct[3, 0][0] != direct[3, 1][0]  # a request's samples draw one generator in turn, not one seed each


def test_a_drafter_refuses_what_it_cannot_check(tiny):
    model, tok = tiny
    engine = ContinuousDecoder(model, tok.pad_token_id, drafter=NgramDrafter(max_tokens=2), decode_fn=tok.decode)
    with pytest.raises(ValueError, match="drafter"):
        engine.admit(0, [1, 2], SamplingParams(), top_logprobs=2)
    engine.admit(0, [1, 2], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="on_token"):
        engine.step(on_token=print)
