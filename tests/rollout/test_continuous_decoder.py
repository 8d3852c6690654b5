"""rollout.continuous.ContinuousDecoder: rows joining and leaving a running batch decode what the
engine decodes for each alone; a kept KV cache prefills only the new ids; a seeded row's tokens do
not depend on its batch mates."""

import pytest
import torch
from decoding import drive, encode

from lmforge.core.config import ModelConfig
from lmforge.model.load import load_model
from lmforge.rollout import SamplingParams, generate
from lmforge.rollout.continuous import ContinuousDecoder


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model, tok = load_model(
        ModelConfig(
            name="tiny:llama", tokenizer="char", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=256
        )
    )
    return model.eval(), tok


def alone(model, tok, ids, params):
    rollout = generate(model, [ids], params, pad_token_id=tok.pad_token_id)
    n = int(rollout.completion_lens[0])
    return rollout.completion_ids[0, :n].tolist(), rollout.logprobs[0, :n]


def test_staggered_rows_and_later_turns_decode_what_each_decodes_alone(tiny):
    model, tok = tiny
    greedy = SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=[tok.eos_token_id])
    prompts = [encode(tok, t) for t in ("hello world", "ab", "xyz 123 45")]
    decoder = ContinuousDecoder(model, tok.pad_token_id)
    first = drive(decoder, {0: [(0, prompts[0], greedy)], 2: [(1, prompts[1], greedy)], 3: [(2, prompts[2], greedy)]})
    histories = []
    for key, prompt in enumerate(prompts):
        tokens, logprobs = alone(model, tok, prompt, greedy)
        assert first[key].token_ids == tokens
        torch.testing.assert_close(torch.tensor(first[key].logprobs), logprobs, rtol=0, atol=2e-5)
        histories.append(prompt + tokens + encode(tok, f"again {key}"))
    # the next turns: each history extends the row's kept tokens, so only the new ids are prefilled
    prefilled = decoder.num_prefilled_tokens
    second = drive(decoder, {0: [(2, histories[2], greedy), (0, histories[0], greedy)], 1: [(1, histories[1], greedy)]})
    new_ids = sum(len(h) - len(p) - len(first[k].token_ids) + 1 for k, (h, p) in enumerate(zip(histories, prompts)))
    assert decoder.num_prefilled_tokens - prefilled == new_ids < sum(map(len, histories))
    for key, history in enumerate(histories):
        tokens, logprobs = alone(model, tok, history, greedy)
        assert second[key].token_ids == tokens
        torch.testing.assert_close(torch.tensor(second[key].logprobs), logprobs, rtol=0, atol=2e-5)


def test_ids_that_do_not_extend_the_kept_ones_are_prefilled_whole(tiny):
    model, tok = tiny
    greedy = SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=[tok.eos_token_id])
    decoder = ContinuousDecoder(model, tok.pad_token_id)
    drive(decoder, {0: [(0, encode(tok, "hello"), greedy)]})
    other = encode(tok, "a different start")
    prefilled = decoder.num_prefilled_tokens
    (row,) = drive(decoder, {0: [(0, other, greedy)]}).values()
    assert decoder.num_prefilled_tokens - prefilled == len(other)
    assert row.token_ids == alone(model, tok, other, greedy)[0]


def test_a_seeded_rows_tokens_do_not_depend_on_its_batch_mates(tiny):
    model, tok = tiny
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7)
    prompt = encode(tok, "sample me")
    solo = drive(ContinuousDecoder(model, tok.pad_token_id), {0: [("me", prompt, params)]})["me"]
    mates = {
        0: [
            (i, encode(tok, "x" * (3 + i)), SamplingParams(temperature=1.0, max_new_tokens=5 + i, seed=i))
            for i in range(3)
        ],
        2: [("me", prompt, params)],
        4: [(9, encode(tok, "late"), params)],
    }
    crowded = drive(ContinuousDecoder(model, tok.pad_token_id), mates)["me"]
    assert crowded.token_ids == solo.token_ids and crowded.truncated and len(solo.token_ids) == 12
    torch.testing.assert_close(torch.tensor(crowded.logprobs), torch.tensor(solo.logprobs), rtol=0, atol=2e-5)
    other_seed = drive(
        ContinuousDecoder(model, tok.pad_token_id),
        {0: [("me", prompt, SamplingParams(temperature=1.0, max_new_tokens=12, seed=8))]},
    )["me"]
    assert other_seed.token_ids != solo.token_ids  # the seed, not the batch, decides


def test_stop_strings_are_refused(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="stop_strings"):
        ContinuousDecoder(model, tok.pad_token_id).admit(0, [1], SamplingParams(stop_strings=["x"]))


def test_rows_with_the_same_first_ids_are_prefilled_once_and_sample_apart(tiny):
    model, tok = tiny
    prompt = encode(tok, "a group's prompt")
    rows = {0: [(i, prompt, SamplingParams(temperature=1.0, max_new_tokens=8, seed=i)) for i in range(4)]}
    decoder = ContinuousDecoder(model, tok.pad_token_id)
    shared = drive(decoder, rows)
    assert decoder.num_prefilled_tokens == len(prompt)  # one prefill for the four rows
    for i in range(4):
        alone_row = drive(ContinuousDecoder(model, tok.pad_token_id), {0: [rows[0][i]]})[i]
        assert shared[i].token_ids == alone_row.token_ids
        torch.testing.assert_close(
            torch.tensor(shared[i].logprobs), torch.tensor(alone_row.logprobs), rtol=0, atol=2e-5
        )
    assert len({tuple(shared[i].token_ids) for i in range(4)}) > 1  # each row its own seed


def test_a_sliding_window_model_plays_its_episodes_in_rounds(tiny, caplog):
    # continuous batching merges full-attention caches only; env.continuous (the default) must not make
    # a Mistral-style model (sliding_window set) fail: its episodes run in rounds, with one warning
    from transformers import MistralConfig, MistralForCausalLM

    from lmforge.rl.sources import episodes as source
    from lmforge.rollout.continuous import has_full_attention_caches

    windowed = MistralForCausalLM(
        MistralConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            sliding_window=16,
        )
    ).eval()
    assert has_full_attention_caches(tiny[0]) and not has_full_attention_caches(windowed)

    class Runner:
        def __init__(self):
            self.calls = []

        def run(self, generate_fn, problems, group_size, params):
            self.calls.append("rounds")
            return [], {}

        def run_continuous(self, decoder, problems, group_size, params):
            self.calls.append("continuous")
            return [], {}

    runner = Runner()
    params = SamplingParams(temperature=0.0, max_new_tokens=2)
    source._FELL_BACK.discard("mistral")
    for model in (windowed, windowed, tiny[0]):
        source.run_episodes(runner, True, model, None, [], 1, params, 0)
    assert runner.calls == ["rounds", "rounds", "continuous"]
    assert sum("run in rounds" in r.getMessage() for r in caplog.records) == 1  # told once per model type
