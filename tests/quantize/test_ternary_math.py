"""Absmean ternary, the packings and the fake-quant STE, against hand-derived values."""

import pytest
import torch

from lmforge.quantize.ternary import (
    absmean_ternary,
    pack_2bit,
    pack_5trit,
    ternary_fake_quant,
    unpack_2bit,
    unpack_5trit,
)


def test_absmean_hand_values():
    w = torch.tensor([[0.5, -1.5], [0.1, 2.0]])
    q, scale = absmean_ternary(w)
    # mean|W| = 4.1 / 4 = 1.025; W / s = [0.49, -1.46, 0.10, 1.95] -> round [0, -1, 0, 2] -> clip [0, -1, 0, 1]
    torch.testing.assert_close(scale, torch.tensor(1.025), rtol=0, atol=1e-7)
    assert q.tolist() == [[0, -1], [0, 1]] and q.dtype == torch.int8


def test_pack_2bit_hand_values_and_roundtrip():
    q = torch.tensor([-1, 0, 1, 1, 0], dtype=torch.int8)
    # codes 0,1,2,2 | 1,(pad 0,0,0): 0 + 1*4 + 2*16 + 2*64 = 164, then 1
    assert pack_2bit(q).tolist() == [164, 1]
    for n in range(1, 23):
        q = torch.randint(-1, 2, (n,), dtype=torch.int8)
        assert torch.equal(unpack_2bit(pack_2bit(q), n), q)


def test_pack_5trit_hand_values_and_roundtrip():
    q = torch.tensor([-1, 0, 1, 1, 0, 1], dtype=torch.int8)
    # codes 0,1,2,2,1 -> 0 + 3 + 18 + 54 + 81 = 156; then code 2 padded with zeros -> 2
    assert pack_5trit(q).tolist() == [156, 2]
    for n in range(1, 23):
        q = torch.randint(-1, 2, (n,), dtype=torch.int8)
        assert torch.equal(unpack_5trit(pack_5trit(q), n), q)
    assert pack_5trit(torch.ones(5, dtype=torch.int8)).tolist() == [242]  # the largest valid byte


def test_unpack_rejects_bytes_that_are_not_trits():
    with pytest.raises(ValueError, match="code 3"):
        unpack_2bit(torch.tensor([255], dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="> 242"):
        unpack_5trit(torch.tensor([243], dtype=torch.uint8), 5)


def test_fake_quant_forward_is_ternary_and_gradient_is_straight_through():
    torch.manual_seed(0)
    w = torch.randn(6, 8, requires_grad=True)
    upstream = torch.randn(6, 8)
    out = ternary_fake_quant(w)
    q, scale = absmean_ternary(w)
    torch.testing.assert_close(out.detach(), q.float() * scale, rtol=0, atol=0)
    (out * upstream).sum().backward()
    torch.testing.assert_close(w.grad, upstream, rtol=0, atol=0)  # d W_hat / d W = identity


def test_stored_scale_is_idempotent_on_ternary_weights():
    from lmforge.quantize.ternary import stored_scale

    w = torch.tensor([[0.5, -1.5], [0.1, 2.0]])
    q, _ = absmean_ternary(w)  # [[0, -1], [0, 1]]
    torch.testing.assert_close(stored_scale(w, q), torch.tensor(1.75), rtol=0, atol=1e-7)  # (1.5 + 2.0) / 2
    baked = torch.tensor([[0.0, -0.3], [0.3, 0.0]])  # s * q with s = 0.3; absmean would give 0.15
    q2, absmean = absmean_ternary(baked)
    assert q2.tolist() == [[0, -1], [1, 0]]
    torch.testing.assert_close(absmean, torch.tensor(0.15), rtol=0, atol=1e-7)
    torch.testing.assert_close(stored_scale(baked, q2), torch.tensor(0.3), rtol=0, atol=1e-7)


def test_memory_plan_hand_values():
    from lmforge.quantize.tiers import memory_plan

    rows = {(use, name): (gib, fits) for use, name, gib, fits in memory_plan(2**30, 3 * 2**30)}
    assert rows[("inference", "fp32")] == (4.0, False) and rows[("inference", "bf16")] == (2.0, True)
    assert rows[("inference", "gguf-q4_0")] == (4.5 / 8, True)  # 18 bytes per block of 32 weights
    assert rows[("training", "fp32 AdamW")] == (16.0, False)
    assert rows[("training", "LoRA on a bf16 base")] == (2.16, True)
