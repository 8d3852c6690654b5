"""The packed pair forward (lmforge.supervised.pair_forward): the layout of a pair by hand, and each
side's log-probabilities and their gradients equal to those of the side run alone through the full
model (all positions, full LM head) in fp64, for every packing of the pairs into rows, for shared
and unshared prompts, several trained spans, untrained trailing tokens, SDPA and eager attention.

Tolerance: transformers' RMSNorm computes in fp32 whatever the model's dtype, so an "fp64" model
rounds at ~6e-8 relative there; two fp64 runs of the same sides differ by up to 4.5e-7 in a
gradient entry of size ~7 (the side run alone with SDPA against eager attention: 3.7e-7). The
bounds (1e-6) are far below what a wrong mask does (a rejected token that sees the chosen branch
moves a side's log-probability by 2e-2)."""

from __future__ import annotations

import pytest
import torch

from lmforge.core.config import ModelConfig
from lmforge.data.preference import PreferencePair
from lmforge.data.sft import SFTExample
from lmforge.model.load import load_model
from lmforge.supervised import pair_forward
from lmforge.supervised.pair_forward import pack_pairs, pair_logits, side_logps


def side(ids, mask):
    return SFTExample(list(ids), list(mask))


def test_layout_of_one_pair_by_hand():
    # prompt 5 6 7; chosen 8 9; rejected 10 11 12
    pair = PreferencePair(side([5, 6, 7, 8, 9], [0, 0, 0, 1, 1]), side([5, 6, 7, 10, 11, 12], [0, 0, 0, 1, 1, 1]))
    pack = pack_pairs([pair])
    # the prompt once, then each branch without its last token (only a target)
    assert pack.input_ids[0].tolist() == [5, 6, 7, 8, 10, 11]
    assert pack.position_ids[0].tolist() == [0, 1, 2, 3, 3, 4]
    # 8 and 10 are predicted by the last prompt token (index 2); 9 by 8 (3); 11 by 10 (4); 12 by 11 (5)
    assert pack.predict_at.tolist() == [2, 3, 2, 4, 5]
    assert pack.targets.tolist() == [8, 9, 10, 11, 12]
    assert pack.side_of.tolist() == [0, 0, 1, 1, 1]
    assert (pack.num_sides, pack.num_tokens) == (2, 11)
    assert pair_forward.segment_length(pair) == 6
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],  # chosen: the prompt and itself
            [1, 1, 1, 0, 1, 0],  # rejected: the prompt and its own branch, never the chosen
            [1, 1, 1, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(pack.attend[0], expected)


def test_pairs_share_rows_up_to_the_budget_and_never_see_each_other():
    shared = PreferencePair(side([1, 2, 3], [0, 0, 1]), side([1, 2, 4], [0, 0, 1]))  # 2 prompt tokens, no branch input
    unshared = PreferencePair(side([7, 8, 9], [0, 1, 1]), side([6, 8, 9], [0, 1, 1]))  # different prompts: 2 + 2
    pack = pack_pairs([shared, unshared, shared], row_tokens=6)
    assert [ids.tolist() for ids in pack.input_ids] == [[1, 2, 7, 8, 6, 8], [1, 2]]
    assert pack.position_ids[0].tolist() == [0, 1, 0, 1, 0, 1]  # unshared: each side from position 0
    # per pair, chosen then rejected: pair 0 at offset 0, pair 1 at 2, pair 2 first in row 2 (offset 6)
    assert pack.predict_at.tolist() == [1, 1, 2 + 0, 2 + 1, 2 + 2, 2 + 3, 6 + 1, 6 + 1]
    assert pack.side_of.tolist() == [0, 3, 1, 1, 4, 4, 2, 5]  # sides: chosen 0..2, rejected 3..5
    attend = pack.attend[0]
    assert not attend[2:, :2].any() and not attend[4:, 2:4].any()  # no pair sees another, nor its other side
    assert [len(ids) for ids in pack_pairs([shared, unshared, shared], row_tokens=1).input_ids] == [2, 4, 2]


def pairs_of_every_kind() -> list[PreferencePair]:
    return [
        PreferencePair(side([1, 5, 9, 3, 7, 2], [0, 0, 0, 1, 1, 1]), side([1, 5, 9, 4, 2], [0, 0, 0, 1, 1])),
        # different prompts: the branches are the whole sides
        PreferencePair(side([1, 6, 6, 8, 2], [0, 0, 0, 1, 1]), side([1, 6, 7, 8, 9, 2], [0, 0, 0, 1, 1, 1])),
        # two trained spans around untrained tokens, and an untrained last token
        PreferencePair(
            side([1, 3, 4, 5, 6, 7, 8, 9], [0, 0, 1, 1, 0, 0, 1, 0]),
            side([1, 3, 9, 9, 6, 7, 5, 2], [0, 0, 1, 1, 0, 0, 1, 1]),
        ),
        PreferencePair(
            side([1, 2, 2, 2, 2, 2, 4, 2], [0, 0, 0, 0, 0, 0, 1, 1]), side([1, 2, 2, 2, 2, 2, 5], [0] * 6 + [1])
        ),
    ]


def alone_logps(model, pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """Each side run alone through the full model; sum of log p(token k) over k >= 1 on its mask (fp64)."""
    sums, counts = [], []
    for which in ("chosen", "rejected"):
        for pair in pairs:
            example = getattr(pair, which)
            ids = torch.tensor([example.input_ids])
            logits = model(input_ids=ids).logits[0, :-1].double()
            token_logps = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            mask = torch.tensor(example.loss_mask[1:], dtype=torch.float64)
            sums.append((token_logps * mask).sum())
            counts.append(int(mask.sum()))
    return torch.stack(sums), torch.tensor(counts)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_logps_and_gradients_equal_each_side_run_alone(arch, attention):
    model, _ = load_model(
        ModelConfig(
            name=f"tiny:{arch}", tokenizer="char", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32
        )
    )
    model = model.double()
    model.config._attn_implementation = attention
    pairs = pairs_of_every_kind()
    weights = torch.linspace(-1.0, 1.5, 2 * len(pairs), dtype=torch.float64)  # any loss of the 2b sums
    expected, counts = alone_logps(model, pairs)
    (expected * weights).sum().backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    for row_tokens in (1, 12, 10**6):  # a pair a row, some pairs a row, all pairs in one row
        model.zero_grad()
        pack = pack_pairs(pairs, row_tokens)
        logps, lens = side_logps(pair_logits(model, pack), pack)
        assert lens.tolist() == counts.tolist()
        torch.testing.assert_close(logps, expected, rtol=0, atol=1e-6)
        (logps * weights).sum().backward()
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, expected_grads[name], rtol=1e-6, atol=1e-6, msg=name)


def test_fp32_and_full_logits_path_match_fp64(monkeypatch):
    model, _ = load_model(
        ModelConfig(tokenizer="char", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32)
    )
    pairs = pairs_of_every_kind()
    pack = pack_pairs(pairs)
    with torch.no_grad():
        expected, _ = alone_logps(model.double(), pairs)
        model.float()
        sliced = side_logps(pair_logits(model, pack), pack)[0]
        monkeypatch.setattr(pair_forward, "PLAIN_HEAD_MODELS", set())  # the full-logits path of other models
        full = side_logps(pair_logits(model, pack), pack)[0]
    assert sliced.dtype == torch.float32
    torch.testing.assert_close(sliced.double(), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(full.double(), expected, rtol=0, atol=1e-5)


def test_an_attention_without_a_tree_mask_is_refused():
    model, _ = load_model(ModelConfig(tokenizer="char", hidden_size=32, num_layers=1, num_heads=2))
    model.config._attn_implementation = "flash_attention_2"
    pack = pack_pairs(pairs_of_every_kind()[:1])
    with pytest.raises(ValueError, match="SDPA or eager"):
        pair_logits(model, pack)


def test_pack_flops_count_the_laid_out_tokens_and_the_head_on_predicting_positions_only():
    # the summary's MFU for lmforge dpo: 6N x the pairs' tokens overstated it (a shared prompt counted on
    # both sides, the head on every position: 118% "MFU" on SmolLM2 arith_chat pairs)
    from lmforge.recipes.dpo import pack_forward_flops

    model, _ = load_model(ModelConfig(tokenizer="char", hidden_size=32, num_layers=2, num_heads=2))
    pair = PreferencePair(side([5, 6, 7, 8, 9], [0, 0, 0, 1, 1]), side([5, 6, 7, 10, 11, 12], [0, 0, 0, 1, 1, 1]))
    pack = pack_pairs([pair])
    cfg = model.config
    inner, kv = cfg.intermediate_size, cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    per_layer = cfg.hidden_size * (2 * cfg.hidden_size + 2 * kv) + 3 * cfg.hidden_size * inner  # q o, k v, mlp
    body, head = cfg.num_hidden_layers * per_layer, cfg.hidden_size * cfg.vocab_size
    # 6 laid-out tokens through the body (prompt once), the head on the 5 predicting positions
    assert pack_forward_flops(model, pack) == 2.0 * (body * 6 + head * 5)


def test_sides_longer_than_a_sliding_window_are_refused():
    model, _ = load_model(ModelConfig(tokenizer="char", hidden_size=32, num_layers=1, num_heads=2))
    pair = pairs_of_every_kind()[2]  # sides of 8 tokens: inputs up to position 6 (7 positions)
    model.config.sliding_window = 7
    pair_logits(model, pack_pairs([pair]))  # the window never binds: the mask is the model's own
    model.config.sliding_window = 6
    with pytest.raises(ValueError, match="sliding attention window"):
        pair_logits(model, pack_pairs([pair]))
