"""Speculative decoding in rollout.continuous.ContinuousDecoder (env.draft_tokens): drafted tokens are
checked in one forward and kept only where the row's own draw (the same uniform, the same logits)
gives them, so a row decodes exactly the tokens it decodes one at a time -- greedy or sampled, with
rejections, cache holes and their compaction, rows that end inside a verify step, and later turns on
kept caches. Also the n-gram drafter's rules and the config checks."""

import pytest
import torch
from decoding import drive, encode

from lmforge.core.config import ModelConfig
from lmforge.model.load import load_model
from lmforge.rollout import SamplingParams, continuous
from lmforge.rollout.continuous import ContinuousDecoder, NgramDrafter, RunningBatch


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model, tok = load_model(
        ModelConfig(
            name="tiny:llama", tokenizer="char", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=256
        )
    )
    with torch.no_grad():  # sharper distributions than a fresh init: drafts get kept and rejected both
        model.lm_head.weight.mul_(8.0)
    return model.eval(), tok


class Spoiled(NgramDrafter):
    """An n-gram drafter whose every third proposal has its first token replaced: rejections on purpose."""

    def __init__(self, vocab: int, **kwargs):
        super().__init__(**kwargs)
        self.vocab, self.calls = vocab, 0

    def propose(self, context, limit, stop_ids, ids=None, index=None):
        draft = super().propose(context, limit, stop_ids, ids, index)
        self.calls += 1
        if draft and self.calls % 3 == 0:
            draft[0] = (draft[0] + 1) % self.vocab
        return draft


def spied(decoder, monkeypatch) -> dict:
    """Count ``decoder``'s cache compactions and the rows it retired after a verify step, record the
    highest position it feeds, and check every verify step's positions: a row's fed tokens count on from
    its cached ones, and its padding columns never go past its last fed position."""
    seen = {"compactions": 0, "retired_after_verify": 0, "max_position": -1}
    compact, keep = RunningBatch.compact, decoder._keep
    verify = continuous.verify_step

    def checking_verify(model, token_ids, cache, attention_mask, position_ids):
        fed = attention_mask[:, -token_ids.shape[1] :]  # (B, T)
        for b in range(len(fed)):
            count, base = int(fed[b].sum()), int(attention_mask[b, : -token_ids.shape[1]].sum())
            assert fed[b, :count].all() and not fed[b, count:].any()
            assert position_ids[b, :count].tolist() == list(range(base, base + count))
            assert int(position_ids[b].max()) == base + count - 1
        seen["max_position"] = max(seen["max_position"], int(position_ids.max()))
        return verify(model, token_ids, cache, attention_mask, position_ids)

    monkeypatch.setattr(continuous, "verify_step", checking_verify)

    def counting_compact(self):
        seen["compactions"] += 1
        compact(self)

    def counting_keep(b, row, fed_all=False):
        seen["retired_after_verify"] += fed_all
        keep(b, row, fed_all)

    monkeypatch.setattr(RunningBatch, "compact", counting_compact)
    decoder._keep = counting_keep
    return seen


def check_same_rows(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].token_ids == want[key].token_ids, key
        assert got[key].truncated == want[key].truncated, key
        torch.testing.assert_close(torch.tensor(got[key].logprobs), torch.tensor(want[key].logprobs), rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_new_tokens=40),
        SamplingParams(temperature=1.0, max_new_tokens=40, seed=5),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=40, seed=9),
    ],
    ids=["greedy", "sampled", "top-k-top-p"],
)
def test_drafted_rows_decode_the_tokens_they_decode_one_at_a_time(tiny, params, monkeypatch):
    model, tok = tiny
    texts = ["12+34=", "7*8=", "999-1 = 5 5", "12+43="]  # (the char tokenizer's alphabet)
    admissions = {
        0: [(i, encode(tok, t), params) for i, t in enumerate(texts[:2])],
        2: [(2, encode(tok, texts[2]), params)],
        3: [(3, encode(tok, texts[3]), params)],
    }
    plain = ContinuousDecoder(model, tok.pad_token_id)
    want = drive(plain, admissions)
    # the drafter has seen the rows' own text, so most drafts are right; every third is spoiled
    drafter = Spoiled(len(tok), max_tokens=6, n=2, min_count=1, min_share=0.5)
    for key, ids, _ in (a for step in admissions.values() for a in step):
        drafter.observe(ids + want[key].token_ids)
    decoder = ContinuousDecoder(model, tok.pad_token_id, drafter=drafter)
    seen = spied(decoder, monkeypatch)
    got = drive(decoder, admissions)
    check_same_rows(got, want)
    assert 0 < decoder.num_accepted_tokens < decoder.num_draft_tokens  # kept and rejected drafts both
    assert seen["compactions"] > 0
    assert decoder.num_model_calls < plain.num_model_calls
    # later turns on the kept caches: each history extends what the row fed, so only the new ids are
    # prefilled, and the drafted decoder still decodes what the plain one does
    histories = {
        key: ids + want[key].token_ids + encode(tok, f" 0{key}=")
        for key, ids, _ in (a for step in admissions.values() for a in step)
    }
    second = {0: [(key, history, params) for key, history in histories.items()]}
    prefilled = decoder.num_prefilled_tokens
    got_second = drive(decoder, second)
    assert decoder.num_prefilled_tokens - prefilled < sum(map(len, histories.values())) - 20
    check_same_rows(got_second, drive(ContinuousDecoder(model, tok.pad_token_id), second))


@pytest.mark.parametrize("end", ["limit", "stop"])
def test_a_row_ends_on_a_kept_stop_or_at_its_limit_and_its_next_turn_reuses_every_fed_position(tiny, end, monkeypatch):
    model, tok = tiny
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    prompt = encode(tok, "12+34= 31*17=")
    if end == "stop":  # a stop token the row reaches partway, the first token it did not sample before
        tokens = drive(ContinuousDecoder(model, tok.pad_token_id), {0: [(0, prompt, params)]})[0].token_ids
        stop = next(t for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])
        params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3, stop_token_ids=[stop])
    want = drive(ContinuousDecoder(model, tok.pad_token_id), {0: [(0, prompt, params)]})[0]
    assert want.truncated == (end == "limit")
    drafter = NgramDrafter(max_tokens=8, n=9, min_count=1, min_share=0.0)  # (n: every context of the row unique)
    drafter.observe(prompt + want.token_ids + [0] * 8)  # right drafts, and more past the limit / the stop token
    decoder = ContinuousDecoder(model, tok.pad_token_id, drafter=drafter)
    seen = spied(decoder, monkeypatch)
    got = drive(decoder, {0: [(0, prompt, params)]})[0]
    check_same_rows({0: got}, {0: want})
    # no position past the plain loop's last: the prompt's, then every sampled token but the last
    assert seen["max_position"] <= len(prompt) + params.max_new_tokens - 2
    if end == "stop":  # it ended inside the verify step, on a kept draft: every token it sampled was fed
        assert seen["retired_after_verify"] == 1
        assert decoder.num_draft_tokens == decoder.num_accepted_tokens == len(want.token_ids) - 1
    else:  # drafts stop one short of the limit; the last token is sampled after them and never fed
        assert seen["retired_after_verify"] == 0
        assert decoder.num_draft_tokens == decoder.num_accepted_tokens == len(want.token_ids) - 2
    # its next turn starts with everything the row fed: only the rest prefills
    history = prompt + want.token_ids + encode(tok, " 42=")
    prefilled = decoder.num_prefilled_tokens
    second = drive(decoder, {0: [(0, history, params)]})
    assert decoder.num_prefilled_tokens - prefilled == len(" 42=") + (end == "limit")
    check_same_rows(second, drive(ContinuousDecoder(model, tok.pad_token_id), {0: [(0, history, params)]}))


def test_a_kept_stop_token_ends_the_row_whatever_a_drafter_proposes_after_it(tiny, monkeypatch):
    model, tok = tiny
    prompt = encode(tok, "12+34= 31*17=")
    free = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    tokens = drive(ContinuousDecoder(model, tok.pad_token_id), {0: [(0, prompt, free)]})[0].token_ids
    stop = next(t for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3, stop_token_ids=[stop])
    want = drive(ContinuousDecoder(model, tok.pad_token_id), {0: [(0, prompt, params)]})[0]

    class PastTheStop(NgramDrafter):  # the tokens the row draws, on past the stop token
        past = 0

        def propose(self, context, limit, stop_ids, ids=None, index=None):
            done = len(context) - len(prompt)  # (context: the prompt and the row's tokens, n large)
            draft = (tokens[done:] + [0] * limit)[:limit]
            self.past += stop in draft[:-1]
            return draft

    drafter = PastTheStop(max_tokens=10, n=64)
    decoder = ContinuousDecoder(model, tok.pad_token_id, drafter=drafter)
    got = drive(decoder, {0: [(0, prompt, params)]})[0]
    assert drafter.past  # a draft went on past the stop token, with the tokens the row would draw there
    check_same_rows({0: got}, {0: want})
    assert got.token_ids[-1] == stop and decoder.num_accepted_tokens == len(want.token_ids) - 1


def test_a_drafter_that_guesses_past_its_limit_is_cut_to_it(tiny, monkeypatch):
    model, tok = tiny
    prompt = encode(tok, "12+34= 31*17=")
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    want = drive(ContinuousDecoder(model, tok.pad_token_id), {0: [(0, prompt, params)]})[0]

    class Overrun(NgramDrafter):  # the tokens the row draws, then 20 more, whatever the limit
        def propose(self, context, limit, stop_ids, ids=None, index=None):
            done = len(context) - len(prompt)  # (context: the prompt and the row's tokens, n large)
            return want.token_ids[done:] + [0] * 20

    decoder = ContinuousDecoder(model, tok.pad_token_id, drafter=Overrun(max_tokens=10, n=64))
    seen = spied(decoder, monkeypatch)
    got = drive(decoder, {0: [(0, prompt, params)]})[0]
    check_same_rows({0: got}, {0: want})
    assert len(got.token_ids) == params.max_new_tokens
    assert seen["max_position"] <= len(prompt) + params.max_new_tokens - 2
    assert decoder.num_accepted_tokens == params.max_new_tokens - 2  # every guess inside the limit kept


def test_the_ngram_drafter_follows_confident_continuations_only():
    drafter = NgramDrafter(max_tokens=5, n=2, min_count=2, min_share=0.75)
    for _ in range(3):
        drafter.observe([1, 2, 3, 4, 5, 6])
    assert drafter.propose([9, 1, 2], 5, stop_ids=[]) == [3, 4, 5, 6]  # ends where nothing followed
    assert drafter.propose([1, 2], 2, stop_ids=[]) == [3, 4]  # the limit
    assert drafter.propose([1, 2], 5, stop_ids=[4]) == [3, 4]  # a stop token ends the draft
    assert drafter.propose([2], 5, stop_ids=[]) == []  # shorter than n
    assert drafter.propose([7, 7], 5, stop_ids=[]) == []  # never seen
    drafter.observe([3, 4, 9])  # (3, 4) -> 5 three times, -> 9 once: 3 / 4 = 0.75, still confident
    assert drafter.propose([1, 2], 5, stop_ids=[]) == [3, 4, 5, 6]
    drafter.observe([3, 4, 9])  # 3 of 5: not
    assert drafter.propose([1, 2], 5, stop_ids=[]) == [3, 4]
    once = NgramDrafter(max_tokens=5, n=2, min_count=2)
    once.observe([1, 2, 3])
    assert once.propose([1, 2], 5, stop_ids=[]) == []  # seen once: below min_count
    # counts are halved past max_count, so a new habit takes over
    fading = NgramDrafter(max_tokens=1, n=1, min_count=1, min_share=0.75, max_count=8)
    fading.observe([1, 2] * 8)
    assert fading.propose([1], 1, stop_ids=[]) == [2]
    for _ in range(40):
        fading.observe([1, 3])
    assert fading.propose([1], 1, stop_ids=[]) == [3] and 2 not in fading.table[(1,)]
    with pytest.raises(ValueError, match="max_tokens >= 1"):
        NgramDrafter(max_tokens=0)


def test_a_full_ngram_table_drops_what_never_drafts_before_it_starts_again():
    drafter = NgramDrafter(max_tokens=3, n=1, min_count=2, max_contexts=8)
    drafter.observe([1, 2, 3] * 2)  # (1,) -> 2 and (2,) -> 3 twice, (3,) -> 1 once
    drafter.observe(list(range(10, 17)))  # six contexts seen once: nine in all
    drafter.observe([1, 2])  # past max_contexts: those seen once go, the confident ones stay
    assert set(drafter.table) == {(1,), (2,)} and drafter.propose([1], 3, stop_ids=[]) == [2, 3]
    drafter.observe(list(range(20, 30)))  # ten new ones
    drafter.observe(list(range(30, 40)) * 2)  # seen twice: they stay, more than half of max_contexts
    drafter.observe([5, 6])  # so the table starts again
    assert drafter.table == {(5,): {6: 1}}


def test_without_a_confident_continuation_the_drafter_copies_from_the_rows_own_ids():
    drafter = NgramDrafter(max_tokens=4, n=3)
    ids = [5, 9, 5, 8, 7, 6, 2, 1, 5, 8]  # "... 5 8 7 6 <stop> 1 5 8": the pair (5, 8) last seen at 2..3
    index = drafter.index(ids)
    assert index[(5, 8)] == 3 and (1, 5) in index and (5, 8, 7) not in index
    assert drafter.propose([0, 5, 8], 4, stop_ids=[], ids=ids, index=index) == [7, 6, 2, 1]
    assert drafter.propose([0, 5, 8], 2, stop_ids=[], ids=ids, index=index) == [7, 6]  # the limit
    assert drafter.propose([0, 5, 8], 4, stop_ids=[2], ids=ids, index=index) == [7, 6, 2]  # up to a stop token
    assert drafter.propose([0, 8, 5], 4, stop_ids=[], ids=ids, index=index) == []  # (8, 5) never in ids
    assert drafter.propose([0, 5, 8], 4, stop_ids=[]) == []  # no ids given: the table alone
    for _ in range(2):
        drafter.observe([0, 5, 8, 3, 3])
    assert drafter.propose([0, 5, 8], 4, stop_ids=[], ids=ids, index=index) == [3, 3]  # the table comes first


@pytest.mark.parametrize(
    "override, match",
    [
        (["env.draft_tokens=-1"], r"env.draft_tokens must be >= 0 \(0 = off\)"),
        (["env.draft_tokens=4", "env.continuous=false"], "env.continuous=false nothing would use it"),
    ],
)
def test_draft_tokens_config_errors(override, match):
    from lmforge.core.config import load_config
    from lmforge.core.errors import ConfigError
    from lmforge.recipes.grpo import GRPOConfig

    with pytest.raises(ConfigError, match=match):
        load_config(GRPOConfig, None, ["data.task=addition", "env.name=calculator"] + override)
