"""The continuous-batching scheduler without HTTP: batched rows reproduce the engine run alone, rows share
decode steps, seeds, stored logprobs, weight updates that never mix versions, shutdown."""

from __future__ import annotations

import time

import pytest
import torch

from lmforge.rollout import SamplingParams, generate
from lmforge.serve import BatchScheduler, GenerationRequest, ServeError

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 13, 14], [1, 15, 16, 17, 18], [1, 19]]  # lengths differ on purpose


def _scheduler(model, tokenizer, **kwargs) -> BatchScheduler:
    return BatchScheduler(model, tokenizer.pad_token_id, lambda ids: tokenizer.decode(ids), **kwargs)


def test_staggered_greedy_rows_match_the_engine_alone(make_tiny):
    """Requests joining a running batch at different steps (so their KV caches are left-padded and merged,
    and finished rows leave) decode exactly what ``generate`` decodes for each prompt on its own."""
    model, tokenizer = make_tiny()
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[tokenizer.eos_token_id])
    scheduler = _scheduler(model, tokenizer, gather_s=0.0)
    try:
        futures = []
        for prompt in PROMPTS:
            futures.append(scheduler.submit(GenerationRequest(prompt, params, n=2)))
            steps = scheduler.num_steps
            while scheduler.num_steps < steps + 3 and not futures[-1].done():  # join while earlier rows decode
                time.sleep(0.001)
        results = [f.result(60) for f in futures]
    finally:
        scheduler.shutdown()
    # the requests overlapped: fewer shared model calls than the calls of the requests one by one
    assert scheduler.num_steps < sum(len(r.samples[0].token_ids) - 1 for r in results)
    for prompt, result in zip(PROMPTS, results):
        alone = generate(model, [prompt], params, pad_token_id=tokenizer.pad_token_id)
        length = int(alone.completion_lens[0])
        for sample in result.samples:
            assert sample.token_ids == alone.completion_ids[0, :length].tolist()
            torch.testing.assert_close(torch.tensor(sample.logprobs), alone.logprobs[0, :length], rtol=0, atol=2e-5)
            assert sample.finish_reason == ("length" if bool(alone.truncated[0]) else "stop")
        assert result.weight_version == 0


def test_simultaneous_requests_share_decode_steps(make_tiny):
    """8 requests of 10 tokens each that arrive together are admitted in one prefill and run in 9 shared
    model calls (the 10th token needs no further call); one after another they would take 8 x 9 = 72."""
    model, tokenizer = make_tiny()
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=None)  # no stop tokens: exactly 10 each
    scheduler = _scheduler(model, tokenizer, gather_s=0.5)
    try:
        futures = [scheduler.submit(GenerationRequest(PROMPTS[i % 4], params)) for i in range(8)]
        results = [f.result(60) for f in futures]
    finally:
        scheduler.shutdown()
    assert [len(r.samples[0].token_ids) for r in results] == [10] * 8
    assert scheduler.num_steps == 9


def test_seeded_request_is_reproducible_inside_any_batch(make_tiny):
    model, tokenizer = make_tiny()
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8, seed=123)
    other = SamplingParams(temperature=0.7, max_new_tokens=8)
    scheduler = _scheduler(model, tokenizer, gather_s=0.2)
    try:
        alone = scheduler.submit(GenerationRequest(PROMPTS[0], seeded, n=2)).result(60)
        crowd = [scheduler.submit(GenerationRequest(p, other, n=3)) for p in PROMPTS]
        again = scheduler.submit(GenerationRequest(PROMPTS[0], seeded, n=2))
        for f in crowd:
            f.result(60)
        again = again.result(60)
    finally:
        scheduler.shutdown()
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in alone.samples]
    assert alone.samples[0].token_ids != alone.samples[1].token_ids  # the n samples are distinct draws


def test_requests_with_one_prompt_are_prefilled_once_and_each_samples_as_alone(make_tiny):
    """An agent run's group of episodes opens with one question: requests admitted together with equal prompt
    ids are prefilled as one row, and rows of equal settings with seeds of their own share one sampling call
    while each draws from its own generator: every request samples what it samples alone."""
    model, tokenizer = make_tiny()
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=8, seed=s) for s in (1, 2, 3, 4)]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    prefills = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: (
            prefills.append(tuple(kwargs["input_ids"].shape)) if kwargs["input_ids"].shape[1] > 1 else None
        ),
        with_kwargs=True,
    )
    scheduler = _scheduler(model, tokenizer, gather_s=0.5)
    try:
        together = [scheduler.submit(GenerationRequest(p, q)) for p, q in zip(prompts, params)]
        together = [f.result(60).samples[0] for f in together]
        assert prefills == [(2, len(PROMPTS[0]))]  # one prefill, two distinct prompts
        alone = [scheduler.submit(GenerationRequest(p, q)).result(60).samples[0] for p, q in zip(prompts, params)]
    finally:
        hook.remove()
        scheduler.shutdown()
    for a, t in zip(alone, together):
        assert a.token_ids == t.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(t.logprobs), rtol=0, atol=2e-5)
    assert len({tuple(t.token_ids) for t, p in zip(together, prompts) if p == PROMPTS[0]}) == 3  # own seeds


def test_a_call_that_continues_the_last_one_under_its_key_prefills_only_what_it_adds(make_tiny):
    """An agent session's next call (``cache_key``): its prompt is the last call's prompt + sampled ids + the
    tool result, so only the tool result is prefilled, after the kept KV entries -- and it decodes what it
    decodes prefilled whole. A prompt that does not continue them, or a weight update, prefills whole."""
    model, tokenizer = make_tiny()
    params = SamplingParams(temperature=0.0, max_new_tokens=6)  # no stop token: 6 tokens each
    scheduler = _scheduler(model, tokenizer, gather_s=0.0)
    try:
        first = scheduler.submit(GenerationRequest(PROMPTS[0], params, cache_key="s")).result(60).samples[0]
        following = PROMPTS[0] + first.token_ids + [20, 21, 22]
        kept = scheduler.submit(GenerationRequest(following, params, cache_key="s")).result(60).samples[0]
        assert scheduler.num_cached_tokens == len(PROMPTS[0]) + len(first.token_ids) - 1  # the last never fed
        whole = scheduler.submit(GenerationRequest(following, params)).result(60).samples[0]
        assert scheduler.submit(GenerationRequest([1, 2, 3] + following, params, cache_key="s")).result(60)
        assert scheduler.num_cached_tokens == len(PROMPTS[0]) + len(first.token_ids) - 1  # not a continuation
        after = following + kept.token_ids + [19]
        scheduler.submit(GenerationRequest(following, params, cache_key="t")).result(60)
        scheduler.update_weights(lambda m: None).result(60)
        scheduler.submit(GenerationRequest(after, params, cache_key="t")).result(60)
        assert scheduler.num_cached_tokens == len(PROMPTS[0]) + len(first.token_ids) - 1  # entries of old weights
    finally:
        scheduler.shutdown()
    assert kept.token_ids == whole.token_ids
    torch.testing.assert_close(torch.tensor(kept.logprobs), torch.tensor(whole.logprobs), rtol=0, atol=2e-5)


def test_stored_logprobs_are_of_the_tempered_distribution(make_tiny):
    """Each stored logprob equals log_softmax(logits / T) of a plain forward pass over prompt + completion."""
    model, tokenizer = make_tiny()
    temperature = 0.7
    scheduler = _scheduler(model, tokenizer, gather_s=0.0)
    try:
        result = scheduler.submit(
            GenerationRequest(PROMPTS[2], SamplingParams(temperature=temperature, max_new_tokens=10, seed=0), n=3)
        ).result(60)
    finally:
        scheduler.shutdown()
    for sample in result.samples:
        ids = torch.tensor([PROMPTS[2] + sample.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(PROMPTS[2]) - 1 : -1]  # (C, V)
        expected = torch.log_softmax(logits / temperature, -1).gather(-1, ids[0, len(PROMPTS[2]) :, None])[:, 0]
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, rtol=0, atol=2e-5)


def test_weight_update_waits_for_running_rows_and_never_mixes(make_tiny):
    """A request running when an update arrives finishes entirely on the old weights (version 0); the
    update is applied only after it, and the next request runs entirely on the new weights (version 7)."""
    model, tokenizer = make_tiny(seed=0)
    old_reference, _ = make_tiny(seed=0)
    new_reference, _ = make_tiny(seed=1)
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    scheduler = _scheduler(model, tokenizer, gather_s=0.0)
    new_state = {k: v.clone() for k, v in new_reference.state_dict().items()}
    try:
        running = scheduler.submit(GenerationRequest(PROMPTS[0], params))
        while scheduler.num_steps < 2:  # the request is decoding
            time.sleep(0.005)
        update = scheduler.update_weights(lambda m: m.load_state_dict(new_state), version=7)
        queued = scheduler.submit(GenerationRequest(PROMPTS[0], params))  # arrives after the update
        old, version, new = running.result(60), update.result(60), queued.result(60)
        with pytest.raises(ValueError, match="must increase: the server is at 7"):
            scheduler.update_weights(lambda m: None, version=7).result(60)
    finally:
        scheduler.shutdown()
    assert (old.weight_version, version, new.weight_version) == (0, 7, 7)
    for result, reference in ((old, old_reference), (new, new_reference)):  # every token from one model
        expected = generate(reference, [PROMPTS[0]], params)
        assert result.samples[0].token_ids == expected.completion_ids[0].tolist()
        torch.testing.assert_close(torch.tensor(result.samples[0].logprobs), expected.logprobs[0], rtol=0, atol=2e-5)
    gap = (torch.tensor(old.samples[0].logprobs) - torch.tensor(new.samples[0].logprobs)).abs()
    assert gap.min() > 0.05  # the two models really differ at every position


def test_shutdown_fails_unfinished_requests(make_tiny):
    model, tokenizer = make_tiny()
    scheduler = _scheduler(model, tokenizer, gather_s=0.0)
    future = scheduler.submit(GenerationRequest(PROMPTS[0], SamplingParams(max_new_tokens=50)))
    scheduler.shutdown()
    if not future.done() or future.exception() is not None:  # it may have finished first on a fast machine
        with pytest.raises(ServeError, match="shut down"):
            future.result(10)
    with pytest.raises(ServeError, match="shutting down"):
        scheduler.submit(GenerationRequest(PROMPTS[0], SamplingParams()))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread re-raises, for the log
def test_a_failing_model_fails_its_requests_and_refuses_new_ones(make_tiny):
    model, tokenizer = make_tiny()
    scheduler = _scheduler(model, tokenizer, gather_s=0.0)

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    model.forward = broken
    future = scheduler.submit(GenerationRequest(PROMPTS[0], SamplingParams(max_new_tokens=5)))
    with pytest.raises(ServeError, match="generation thread stopped: RuntimeError: out of memory"):
        future.result(30)
    scheduler._thread.join(30)
    with pytest.raises(ServeError, match="generation thread stopped"):
        scheduler.submit(GenerationRequest(PROMPTS[0], SamplingParams()))
