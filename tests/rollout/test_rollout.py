"""Rollout engine: logprob/temperature consistency, truncation, greedy vs transformers, seeds, stops,
group sharing, left padding, and an empirical check of the sampling distribution."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.rollout import (
    CastEngine,
    SamplingParams,
    decode_step,
    generate,
    make_cache,
    prefill,
    process_logits,
    sample_token,
)

transformers = pytest.importorskip("transformers")

VOCAB, PAD, EOS = 40, 0, 2
PROMPTS = [[1, 5, 6, 7, 8, 9, 10], [1, 11, 12], [1, 13, 14, 15, 16]]  # different lengths on purpose


def _tiny(arch: str = "llama", sharpness: float = 10.0, **overrides):
    """A 2-layer random model; lm_head scaled so next-token distributions are far from uniform."""
    torch.manual_seed(0)
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=EOS,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    config = transformers.LlamaConfig(**kwargs) if arch == "llama" else transformers.Qwen2Config(**kwargs)
    model = (transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM)(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return _tiny()


def _full_logits(model, batch, row: int) -> torch.Tensor:
    """Logits (C, V) predicting each completion token of ``row``, from one unpadded forward pass."""
    prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()]
    completion = batch.completion_ids[row][: batch.completion_lens[row]]
    seq = torch.cat([prompt, completion])[None]
    with torch.no_grad():
        logits = model(seq).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)]


def _incremental_logprobs(model, batch, row: int) -> torch.Tensor:
    """(C,) logprobs of ``row``'s completion tokens from an unpadded token-by-token decode (KV cache)."""
    prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()]
    completion = batch.completion_ids[row][: batch.completion_lens[row]]
    out, logprobs = None, []
    with torch.no_grad():
        out = model(prompt[None], use_cache=True)
        for token in completion:
            logprobs.append(torch.log_softmax(out.logits[0, -1].float(), -1)[token])
            out = model(token.view(1, 1), cache=out.cache, use_cache=True)
    return torch.stack(logprobs)


def _hf_greedy(model, prompt: list[int], num_new: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=num_new,
        min_new_tokens=num_new,
        eos_token_id=None,
        pad_token_id=PAD,
    )
    return out[0, len(prompt) :].tolist()


# ----------------------------------------------------------------------------- input validation


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(max_new_tokens=0),
        dict(stop_strings=[""]),
    ],
)
def test_sampling_params_reject_bad_values(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_generate_rejects_bad_input(model):
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[1, 2], []], SamplingParams())
    with pytest.raises(ValueError, match="decode_fn"):
        generate(model, [[1, 2]], SamplingParams(stop_strings=["x"]))
    with pytest.raises(ValueError, match="num_samples"):
        generate(model, [[1, 2]], SamplingParams(), num_samples=0)


# ----------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_logprobs_equal_tempered_log_softmax_of_full_forward(model, temperature):
    """The temperature-consistency check: a trainer computing log_softmax(logits / T) gets the same values."""
    params = SamplingParams(temperature=temperature, max_new_tokens=8, seed=1)
    batch = generate(model, PROMPTS, params, num_samples=3, pad_token_id=PAD)
    for row in range(batch.completion_ids.shape[0]):
        n = int(batch.completion_lens[row])
        logits = _full_logits(model, batch, row)
        tokens = batch.completion_ids[row, :n]
        expected = torch.log_softmax(logits / temperature, -1).gather(-1, tokens[:, None]).squeeze(-1)
        torch.testing.assert_close(batch.logprobs[row, :n], expected, rtol=0, atol=1e-5)
        if temperature != 1.0:  # the check can fail: untempered logprobs are far off
            untempered = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
            assert (batch.logprobs[row, :n] - untempered).abs().max() > 1e-2


def test_process_logits_hand_values():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top2 = process_logits(logits, SamplingParams(top_k=2)).exp()
    torch.testing.assert_close(top2, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), rtol=0, atol=1e-6)
    nucleus = process_logits(logits, SamplingParams(top_p=0.7)).exp()  # {0.5, 0.3}: mass 0.8 >= 0.7
    torch.testing.assert_close(nucleus, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), rtol=0, atol=1e-6)
    only_top = process_logits(logits, SamplingParams(top_p=0.45)).exp()  # the top token alone has mass 0.5
    torch.testing.assert_close(only_top, torch.tensor([[1.0, 0.0, 0.0, 0.0]]), rtol=0, atol=1e-6)
    tempered = process_logits(logits, SamplingParams(temperature=0.5)).exp()  # p^2 renormalised
    expected = torch.tensor([[0.25, 0.09, 0.0225, 0.0025]]) / 0.365
    torch.testing.assert_close(tempered, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.6), (6, 0.8)])
def test_truncated_sampling_stays_in_set_and_stores_renormalised_logprobs(model, top_k, top_p):
    temperature = 0.9
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=6, seed=3)
    batch = generate(model, PROMPTS, params, num_samples=4, pad_token_id=PAD)
    for row in range(batch.completion_ids.shape[0]):
        n = int(batch.completion_lens[row])
        probs = torch.softmax(_full_logits(model, batch, row).double() / temperature, -1)  # (C, V)
        for t in range(n):
            order = torch.argsort(probs[t], descending=True)
            keep = order[:top_k] if top_k else order
            kept = probs[t, keep] / probs[t, keep].sum()
            mass_before = torch.cumsum(kept, 0) - kept
            keep = keep[mass_before < top_p]  # smallest prefix reaching top_p
            token = int(batch.completion_ids[row, t])
            assert token in keep.tolist(), f"row {row} step {t}: token outside the top-k/top-p set"
            expected = math.log(probs[t, token] / probs[t, keep].sum())
            assert abs(float(batch.logprobs[row, t]) - expected) < 1e-5


# ----------------------------------------------------------------------------- greedy, seeds, padding


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_transformers_generate(arch):
    model = _tiny(arch)
    batch = generate(model, PROMPTS, SamplingParams(temperature=0, max_new_tokens=12), pad_token_id=PAD)
    for row, prompt in enumerate(PROMPTS):
        assert batch.completion_ids[row].tolist() == _hf_greedy(model, prompt, 12)


def test_left_padding_does_not_change_greedy_output(model):
    short = [[1, 11, 12]]
    alone = generate(model, short, SamplingParams(temperature=0, max_new_tokens=12), pad_token_id=PAD)
    batched = generate(
        model,
        [PROMPTS[0], short[0], [1] + list(range(3, 30))],
        SamplingParams(temperature=0, max_new_tokens=12),
        pad_token_id=PAD,
    )
    assert batched.prompt_mask[1].tolist()[: 28 - 3] == [0] * 25  # really left-padded
    assert batched.completion_ids[1].tolist() == alone.completion_ids[0].tolist()
    torch.testing.assert_close(batched.logprobs[1], alone.logprobs[0], rtol=0, atol=1e-5)


def test_same_seed_same_tokens_different_seed_different_tokens(model):
    def run(seed):
        return generate(model, PROMPTS, SamplingParams(max_new_tokens=10, seed=seed), num_samples=4, pad_token_id=PAD)

    a, b, c = run(7), run(7), run(8)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.completion_ids, c.completion_ids)


def test_group_sharing_layout_and_greedy_samples_identical(model):
    single = generate(model, PROMPTS, SamplingParams(temperature=0, max_new_tokens=10), pad_token_id=PAD)
    grouped = generate(
        model, PROMPTS, SamplingParams(temperature=0, max_new_tokens=10), num_samples=4, pad_token_id=PAD
    )
    assert grouped.group_index.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert grouped.prompt_lens.tolist() == [7] * 4 + [3] * 4 + [5] * 4
    for row in range(12):
        group = row // 4
        assert torch.equal(grouped.completion_ids[row], single.completion_ids[group])
        assert torch.equal(grouped.prompt_ids[row], single.prompt_ids[group])
        torch.testing.assert_close(grouped.logprobs[row], single.logprobs[group], rtol=0, atol=1e-5)
    sampled = generate(model, PROMPTS, SamplingParams(max_new_tokens=10, seed=0), num_samples=4, pad_token_id=PAD)
    assert len({tuple(r) for r in sampled.completion_ids[:4].tolist()}) > 1  # samples of a group differ


def test_generate_samples_without_dropout_and_restores_train_mode():
    model = _tiny(attention_dropout=0.5)
    params = SamplingParams(temperature=0, max_new_tokens=10)
    expected = generate(model.eval(), PROMPTS, params, pad_token_id=PAD)
    model.train()
    got = generate(model, PROMPTS, params, pad_token_id=PAD)
    assert model.training
    assert torch.equal(got.completion_ids, expected.completion_ids)
    torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=0, atol=0)


def test_step_primitives_reproduce_full_forward(model):
    """prefill + decode_step with left padding give the logits of unpadded full forwards."""
    ids = torch.tensor([[PAD, PAD, 1, 5, 6], [1, 7, 8, 9, 10]])
    mask = (ids != PAD).long()
    cache = make_cache(model, capacity=8)
    logits, cache = prefill(model, ids, mask, cache)
    nxt = torch.tensor([20, 21])
    mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    step_logits, cache = decode_step(model, nxt, cache, mask, mask.sum(1) - 1)
    with torch.no_grad():
        for row in range(2):
            seq = torch.cat([ids[row][ids[row] != PAD], nxt[row : row + 1]])[None]
            full = model(seq).logits[0]
            torch.testing.assert_close(logits[row], full[-2], rtol=0, atol=1e-5)
            torch.testing.assert_close(step_logits[row], full[-1], rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- stops and masks


def _check_row_invariants(batch, row: int, stop_ids: set[int], max_new: int):
    n, width = int(batch.completion_lens[row]), batch.completion_ids.shape[1]
    mask = batch.completion_mask[row].tolist()
    assert mask == [1] * n + [0] * (width - n)
    assert batch.completion_ids[row, n:].eq(PAD).all() and batch.logprobs[row, n:].eq(0).all()
    tokens = batch.completion_ids[row, :n].tolist()
    assert not stop_ids & set(tokens[:-1]), "a stop token inside the completion"
    if bool(batch.truncated[row]):
        assert n == max_new and tokens[-1] not in stop_ids
    else:
        assert tokens[-1] in stop_ids


def test_stop_token_masks_lengths_and_truncation(model):
    free = generate(model, PROMPTS, SamplingParams(temperature=0, max_new_tokens=12), pad_token_id=PAD)
    row0 = free.completion_ids[0].tolist()
    stop = row0[3] if row0[3] not in row0[:3] else row0[4]
    stopped = generate(
        model, PROMPTS, SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=[stop]), pad_token_id=PAD
    )
    for row in range(len(PROMPTS)):
        tokens = free.completion_ids[row].tolist()
        expected_len = tokens.index(stop) + 1 if stop in tokens else 12
        assert int(stopped.completion_lens[row]) == expected_len
        assert bool(stopped.truncated[row]) == (stop not in tokens)
        assert stopped.completion_ids[row, :expected_len].tolist() == tokens[:expected_len]
        _check_row_invariants(stopped, row, {stop}, 12)
    assert not bool(stopped.truncated[0])


def test_sampled_rows_respect_stop_invariants_and_stop_early(model):
    stop_ids = {3, 4, 5, 6, 7, 8}
    params = SamplingParams(max_new_tokens=40, stop_token_ids=sorted(stop_ids), seed=0)
    batch = generate(model, PROMPTS, params, num_samples=16, pad_token_id=PAD)
    for row in range(batch.completion_ids.shape[0]):
        _check_row_invariants(batch, row, stop_ids, 40)
    assert batch.truncated.any() or batch.completion_ids.shape[1] < 40  # decoding ended when all rows stopped
    assert (~batch.truncated).sum() > 0


@pytest.mark.parametrize("start", [4, 15])  # 15: the stop string ends past the decoded tail window
def test_stop_strings_end_at_the_completing_token(model, start):
    def decode(ids):  # one character per token, so a 2-character stop string spans two tokens
        return "".join(chr(ord("A") + i % 26) for i in ids)

    free = generate(model, PROMPTS, SamplingParams(temperature=0, max_new_tokens=24), pad_token_id=PAD)
    stop = decode(free.completion_ids[0].tolist())[start : start + 2]
    params = SamplingParams(temperature=0, max_new_tokens=24, stop_strings=[stop])
    batch = generate(model, PROMPTS, params, pad_token_id=PAD, decode_fn=decode)
    for row in range(len(PROMPTS)):
        text = decode(free.completion_ids[row].tolist())
        expected_len = text.find(stop) + len(stop) if stop in text else 24
        assert int(batch.completion_lens[row]) == expected_len
        assert bool(batch.truncated[row]) == (stop not in text)
        width = batch.completion_mask.shape[1]
        assert batch.completion_mask[row].tolist() == [1] * expected_len + [0] * (width - expected_len)
    completion0 = batch.completion_ids[0, : batch.completion_lens[0]].tolist()
    assert len(completion0) <= start + 2 and decode(completion0).endswith(stop)


# ----------------------------------------------------------------------------- empirical distribution


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z = 3.719 is the 1 - 1e-4 normal quantile."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic over bins with expected count >= 5 (the rest pooled into one bin)."""
    expected = probs.double() * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def reference_distribution(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """softmax(logits / T), cut to the k likeliest tokens and then to the smallest set of likeliest
    tokens whose mass reaches top_p, renormalised; written out here, independently of process_logits."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(probs, descending=True).tolist()
    keep = order[:top_k] if top_k else order
    kept = probs[keep] / probs[keep].sum()
    mass, chosen = 0.0, []
    for token, p in zip(keep, kept.tolist()):
        chosen.append(token)
        mass += p
        if mass >= top_p:
            break
    out = torch.zeros_like(probs)
    out[chosen] = probs[chosen] / probs[chosen].sum()
    return out


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.0, 4, 1.0), (0.8, 0, 0.7)])
def test_first_token_frequencies_match_the_sampling_distribution(model, temperature, top_k, top_p):
    num = 6000
    prompt = [1, 5, 6]
    batch = generate(
        model,
        [prompt],
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1, seed=0),
        num_samples=num,
        pad_token_id=PAD,
    )
    counts = torch.bincount(batch.completion_ids[:, 0], minlength=VOCAB)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    probs = reference_distribution(logits, temperature, top_k, top_p)
    assert (probs > 0.01).sum() >= 3  # a distribution with several likely tokens, not a point mass
    stat, df = _chi2(counts, probs)
    assert stat < _chi2_critical(df), f"chi2 {stat:.1f} with {df} dof"
    # The test has power: the same counts reject a slightly different temperature.
    wrong = reference_distribution(logits, temperature * 1.25, top_k, top_p)
    wrong_stat, wrong_df = _chi2(counts, wrong)
    assert wrong_stat > _chi2_critical(wrong_df)


def test_sample_token_never_draws_zero_probability_tokens():
    logits = torch.full((4096, 8), float("-inf"))
    logits[:, 7] = 0.0  # only the last token is allowed: the top-edge rounding case of inverse-CDF sampling
    logits[:2048, 3] = 0.0
    tokens, logprobs = sample_token(logits, SamplingParams(), torch.Generator().manual_seed(0))
    assert set(tokens[2048:].tolist()) == {7} and set(tokens[:2048].tolist()) == {3, 7}
    assert torch.isfinite(logprobs).all()


# ----------------------------------------------------------------------------- CastEngine (rollout.dtype)


def test_cast_engine_samples_from_a_synced_bf16_copy():
    policy = _tiny(tie_word_embeddings=True, sharpness=1.0)  # tied, as SmolLM2: the copy must stay tied
    engine = CastEngine(policy, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in engine.model.parameters())
    assert all(b.dtype == torch.float32 for b in engine.model.buffers())  # rotary frequencies stay fp32
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    assert all(p.dtype == torch.float32 for p in policy.parameters())  # the policy is untouched

    with torch.no_grad():  # the trainer steps; the copy follows only after sync_weights
        policy.lm_head.weight.mul_(4.0)  # also sharpens the distributions: mean logprob about -2
    stale = engine.model.lm_head.weight.float().clone()
    engine.sync_weights(policy)
    assert not torch.equal(stale, engine.model.lm_head.weight.float())
    torch.testing.assert_close(
        engine.model.lm_head.weight.float(), policy.lm_head.weight, rtol=2**-8, atol=0
    )  # bf16 rounding only

    params = SamplingParams(max_new_tokens=6, seed=3)
    batch = engine.generate(PROMPTS, params, num_samples=2, pad_token_id=PAD)
    assert batch.completion_ids.shape == (6, 6) and batch.logprobs.dtype == torch.float32
    # the stored logprobs are of the bf16 model (what it sampled from) and close to the fp32 policy's.
    # bf16 forwards round differently along different kernel paths: on an AVX-512 CPU with native
    # bf16 a full unpadded pass matched the engine's padded, batched decode to ~5e-7; on an AVX2-only
    # CPU a full pass was up to 2.4e-2 away on one row and a token-by-token decode 1.8e-3 on another,
    # but each row lay within 2.2e-4 of one of the two, while the fp32 policy was 7.9e-3 or more away
    for row in range(len(batch.completion_ids)):
        target = batch.completion_ids[row][: batch.completion_lens[row]]
        stored = batch.logprobs[row][: len(target)]
        with torch.no_grad():
            full = torch.log_softmax(_full_logits(engine.model, batch, row), -1).gather(-1, target[:, None])[:, 0]
            fp32 = torch.log_softmax(_full_logits(policy, batch, row), -1).gather(-1, target[:, None])[:, 0]
        incremental = _incremental_logprobs(engine.model, batch, row)
        own_err = min((full - stored).abs().max(), (incremental - stored).abs().max())
        gap = (fp32 - stored).abs().max()
        assert own_err < 2e-3 and gap > 5 * own_err, (own_err, gap)
        assert 1e-4 < gap < 0.1, gap  # bf16 rounding moves them, but not far


def test_cast_engine_refuses_a_model_with_other_parameters():
    engine = CastEngine(_tiny(), torch.bfloat16)
    with pytest.raises(ValueError, match="parameter names differ"):
        engine.sync_weights(_tiny(arch="qwen2"))
