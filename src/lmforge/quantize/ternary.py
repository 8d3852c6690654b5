"""Ternary weights (BitNet b1.58 absmean) and lmforge's packed ternary checkpoint.

Math (Ma et al. 2024, "The Era of 1-bit LLMs", eq. 1-3), per weight matrix W (out, in):
    scale = mean(|W|)                                  one fp32 number per matrix
    q     = clip(round(W / (scale + eps)), -1, 1)      q in {-1, 0, +1}
    W_hat = q * scale
Only weights are ternary here; activations stay in the model's dtype (the paper also quantizes
activations to 8 bits per token; that needs kernels, not a checkpoint format).

Packing (what makes the file small), codes c = q + 1 in {0, 1, 2}:
    "2bit"   four codes per byte, c0 | c1 << 2 | c2 << 4 | c3 << 6        2 bits per weight
    "5trit"  five codes per byte, c0 + 3 c1 + 9 c2 + 27 c3 + 81 c4 <= 242 1.6 bits per weight
The flattened codes are zero-padded (code 0) to a multiple of 4 or 5; the true shape is stored.
"""

from __future__ import annotations

import torch

EPS = 1e-8
_POW3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32)
_SHIFT2 = torch.tensor([0, 2, 4, 6], dtype=torch.int32)


def absmean_ternary(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: q (same shape as ``weight``, int8 in {-1, 0, 1}) and scale (fp32 scalar tensor)."""
    w = weight.detach().float()
    scale = w.abs().mean()
    q = torch.clamp(torch.round(w / (scale + EPS)), -1, 1).to(torch.int8)
    return q, scale


def stored_scale(weight: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The scale a checkpoint stores for trits ``q``: mean |W| over the non-zero trits (fp32 scalar).

    This is the least-squares scale for fixed ``q`` and, unlike mean |W|, it is idempotent: for a
    weight that is already ``s * q`` (a model trained with ternary QAT and baked) it returns ``s``
    exactly, so the exported checkpoint computes what the training forward computed. (Re-applying
    absmean to ``s * q`` would give ``s * fraction_nonzero``.)
    """
    nonzero = q.abs().float()
    return (weight.detach().float().abs() * nonzero).sum() / nonzero.sum().clamp_min(1.0)


class StraightThrough(torch.autograd.Function):
    """Forward: ``quantized`` exactly (no ``W + (W_hat - W)`` rounding); backward: identity to ``weight``."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
        return quantized

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def ternary_fake_quant(weight: torch.Tensor) -> torch.Tensor:
    """``W_hat = q * mean|W|`` in ``weight``'s dtype, with a straight-through gradient (dW_hat/dW = 1).

    The forward value is exactly the ternary weight; the backward passes the gradient to the
    full-precision master weight unchanged.
    """
    w = weight.detach()
    scale = w.abs().mean()
    w_hat = torch.clamp(torch.round(w / (scale + EPS)), -1, 1) * scale
    return StraightThrough.apply(weight, w_hat)


def pack_2bit(q: torch.Tensor) -> torch.Tensor:
    """Ternary ``q`` (any shape) -> uint8 (ceil(numel / 4),): four 2-bit codes per byte."""
    codes = q.reshape(-1).to(torch.int32) + 1
    codes = torch.nn.functional.pad(codes, (0, (-codes.numel()) % 4)).reshape(-1, 4)
    return (codes << _SHIFT2).sum(dim=1).to(torch.uint8)


def unpack_2bit(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_2bit`: int8 (numel,) in {-1, 0, 1}. Raises ValueError on code 3."""
    codes = (packed.to(torch.int32).reshape(-1, 1) >> _SHIFT2) & 3
    codes = codes.reshape(-1)[:numel]
    if bool((codes == 3).any()):
        raise ValueError("2-bit ternary data holds the code 3, which is not a trit (corrupt file?)")
    return (codes - 1).to(torch.int8)


def pack_5trit(q: torch.Tensor) -> torch.Tensor:
    """Ternary ``q`` (any shape) -> uint8 (ceil(numel / 5),): five base-3 codes per byte."""
    codes = q.reshape(-1).to(torch.int32) + 1
    codes = torch.nn.functional.pad(codes, (0, (-codes.numel()) % 5)).reshape(-1, 5)
    return (codes * _POW3).sum(dim=1).to(torch.uint8)


def unpack_5trit(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_5trit`: int8 (numel,) in {-1, 0, 1}. Raises ValueError on bytes > 242."""
    values = packed.to(torch.int32).reshape(-1, 1)
    if bool((values > 242).any()):
        raise ValueError("5-trit ternary data holds a byte > 242, which is not 5 trits (corrupt file?)")
    codes = (values // _POW3) % 3
    return (codes.reshape(-1)[:numel] - 1).to(torch.int8)


PACKINGS = {
    "2bit": (pack_2bit, unpack_2bit, 4),  # name -> (pack, unpack, weights per byte)
    "5trit": (pack_5trit, unpack_5trit, 5),
}
