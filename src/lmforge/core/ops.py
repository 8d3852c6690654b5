"""Small tensor ops shared by losses, rollouts and recipes. Imports only torch.

Shapes: B = batch, T = sequence positions, V = vocabulary.
"""

from __future__ import annotations

import torch


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[..., index] without materialising the full (…, V) log-prob tensor twice.

    logits: (..., V) float; index: (...) long. Returns (...) in the dtype of ``logits`` (fp32 math
    for fp32 input; half-precision input is upcast row by row to keep the logsumexp exact).
    """
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, -1, index.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    # bf16/fp16: logsumexp in fp32, one row block at a time to bound memory.
    out = []
    for row_logits, row_index in zip(logits, index):
        row = row_logits.float()
        picked = torch.gather(row, -1, row_index.unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(row, dim=-1))
    return torch.stack(out)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1. values, mask: same shape."""
    masked = values * mask
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1; 0 where the mask is empty (never NaN)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim. (..., V) -> (...)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def adopt_thread_count() -> None:
    """Give the calling thread the intra-op thread count that ``torch.set_num_threads`` set. OpenMP keeps
    that count per thread: a thread that Python starts afterwards gets OpenMP's default (``OMP_NUM_THREADS``,
    else one per core) while ``torch.get_num_threads()`` still reports the set value. Measured on the
    2-core machine after ``set_num_threads(1)``: a loop of (64, 128) @ (128, 512) matmuls ran 1.4-8x
    slower in such a thread than in the main thread, and as fast once the thread called this. Call it
    first in every thread that runs torch ops (serve's scheduler, reward workers, overlapped rollouts)."""
    torch.set_num_threads(torch.get_num_threads())
