"""Ring all-reduce over ``torch.distributed`` point-to-point messages, and DDP communication hooks
that sum gradients (with the ring, or with the native collective) instead of averaging them.

The algorithm (derivation and cost model: ``docs/algorithms/all-reduce.md``). ``W`` ranks each hold a
tensor of ``n`` elements; afterwards every rank holds the elementwise sum of all ``W`` tensors.

1. **Pad and chunk.** Flatten to ``(n,)``, pad with zeros to ``(W * c,)`` where ``c = ceil(n / W)``,
   and view it as ``W`` chunks of ``c`` elements: chunk ``k`` is ``buf[k*c : (k+1)*c]``.
2. **Reduce-scatter, ``W - 1`` steps.** At step ``s = 0 .. W-2`` rank ``r`` sends chunk
   ``(r - s) mod W`` (``c`` elements) to its right neighbour ``r + 1`` and receives chunk
   ``(r - s - 1) mod W`` from its left neighbour ``r - 1``, which it adds into its own copy of that
   chunk. A chunk travels once round the ring, picking up one rank's contribution per hop, so after
   step ``W - 2`` rank ``r`` holds the full sum of chunk ``(r + 1) mod W``. (Each chunk goes in
   segments of at most ``SEGMENT_BYTES``, so adding one segment overlaps with receiving the next;
   this changes neither the result nor the bytes.)
3. **All-gather, ``W - 1`` steps.** At step ``s`` rank ``r`` sends chunk ``(r + 1 - s) mod W`` (which
   is complete) to ``r + 1`` and receives the complete chunk ``(r - s) mod W`` from ``r - 1``,
   straight into its copy (no staging buffer). After step ``W - 2`` every rank holds all ``W``
   summed chunks.
4. **Unpad**: copy the first ``n`` elements back into the caller's tensor.

Each rank sends ``2 (W - 1)`` chunks of ``c`` elements: ``2 (W - 1) / W * M`` bytes for a padded
message of ``M = W * c * element_size`` bytes, the lower bound for any all-reduce (see the doc).
The sends and receives of one step are posted together with ``batch_isend_irecv``, so a rank never
waits on its right neighbour's receive before posting its own receive from the left.

Summation order differs from the native collective's, so for floating point inputs the results
agree to rounding (the bound is derived in ``tests/parallel/test_ring.py``), exactly for integers.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hooks' evaluated
# annotations with dist.GradBucket and torch.futures.Future[torch.Tensor], and rejects strings.
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Reduce-scatter messages travel in segments of at most this many bytes, so that adding one segment
# overlaps with receiving the next (gloo's own C++ ring pipelines its segments too). 1 MiB keeps the
# per-message cost (tens of microseconds on loopback) small next to a segment's transfer time.
SEGMENT_BYTES = 1 << 20


@dataclass
class RingStats:
    """What the ring sent from this rank: filled in by ``ring_all_reduce(..., stats=)``.

    Also accepted as the ``state`` of ``ring_hook``, with the process group to reduce over
    (``None``: the default group); then every bucket's traffic is added here.
    """

    group: dist.ProcessGroup | None = None
    bytes_sent: int = 0  # payload bytes handed to isend, summed over calls
    calls: int = 0  # ring_all_reduce calls that reached the network (W > 1, n > 0)


def _group_layout(group: dist.ProcessGroup | None) -> tuple[int, int, int, int]:
    """``(group_rank, group_size, global rank of the right neighbour, global rank of the left)``."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ring_all_reduce needs an initialised process group: call "
            "torch.distributed.init_process_group (torchrun sets the environment) first"
        )
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the group "
            f"passed to ring_all_reduce; call it only on the group's ranks"
        )
    right = dist.get_global_rank(group, (rank + 1) % world)
    left = dist.get_global_rank(group, (rank - 1) % world)
    return rank, world, right, left


def _exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int, group: dist.ProcessGroup | None) -> None:
    """Send ``send`` to ``right`` and receive ``recv`` from ``left``, both posted before either waits."""
    ops = [dist.P2POp(dist.isend, send, right, group), dist.P2POp(dist.irecv, recv, left, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _exchange_and_add(
    send: torch.Tensor,
    acc: torch.Tensor,
    recv: torch.Tensor,
    seg: int,
    right: int,
    left: int,
    group: dist.ProcessGroup | None,
) -> None:
    """One reduce-scatter step: send ``send`` (c,) to ``right``, receive ``left``'s partial sum of the
    chunk ``acc`` (c,) into ``recv`` (c,) and add it to ``acc``. The chunks travel as segments of
    ``seg`` elements, all posted at once and added in arrival order, so adding segment j overlaps
    with segments j+1, ... still in flight. ``acc`` never overlaps ``send`` (W > 1)."""
    starts = range(0, send.numel(), seg)
    ops = []
    for tag, start in enumerate(starts):  # a tag per segment: message j can only match receive j
        ops.append(dist.P2POp(dist.isend, send[start : start + seg], right, group, tag=tag))
        ops.append(dist.P2POp(dist.irecv, recv[start : start + seg], left, group, tag=tag))
    works = dist.batch_isend_irecv(ops)
    for j, start in enumerate(starts):
        works[2 * j + 1].wait()
        acc[start : start + seg].add_(recv[start : start + seg])
    for work in works[0::2]:
        work.wait()


def ring_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    stats: RingStats | None = None,
    segment_bytes: int = SEGMENT_BYTES,
) -> torch.Tensor:
    """In-place SUM all-reduce of ``tensor`` (any shape, same shape and dtype on every rank) over
    ``group`` (``None``: the default group), by reduce-scatter then all-gather round the ring of
    group ranks ``0 -> 1 -> ... -> W-1 -> 0``. Returns ``tensor``.

    Only point-to-point messages are used (no collective). If ``stats`` is given, the bytes this rank
    sends are added to ``stats.bytes_sent``: ``2 (W-1) * ceil(n/W) * element_size``. Reduce-scatter
    messages are split into segments of at most ``segment_bytes`` (same value on every rank).
    """
    if segment_bytes < 1:
        raise ValueError(f"ring_all_reduce: segment_bytes must be a positive byte count, got {segment_bytes}")
    rank, world, right, left = _group_layout(group)
    n = tensor.numel()
    if world == 1 or n == 0:
        return tensor
    c = -(-n // world)  # chunk length, ceil(n / W)
    in_place = tensor.is_contiguous() and n == world * c
    buf = tensor.view(-1) if in_place else torch.zeros(world * c, dtype=tensor.dtype, device=tensor.device)
    if not in_place:
        buf[:n] = tensor.reshape(-1)
    chunks = buf.view(world, c)  # (W, c): row k is chunk k, a contiguous slice of buf
    recv = torch.empty(c, dtype=tensor.dtype, device=tensor.device)

    seg = max(1, segment_bytes // tensor.element_size())  # elements per pipelined segment
    for s in range(world - 1):  # reduce-scatter
        _exchange_and_add(chunks[(rank - s) % world], chunks[(rank - s - 1) % world], recv, seg, right, left, group)
    for s in range(world - 1):  # all-gather: chunk (rank + 1) % W is complete here
        # The received chunk replaces ours whole, so it lands in place (no staging buffer).
        _exchange(chunks[(rank + 1 - s) % world], chunks[(rank - s) % world], right, left, group)

    if stats is not None:
        stats.bytes_sent += 2 * (world - 1) * c * tensor.element_size()
        stats.calls += 1
    if not in_place:
        tensor.copy_(buf[:n].view(tensor.shape))
    return tensor


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def ring_hook(
    state: dist.ProcessGroup | RingStats | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: SUM the bucket's flat gradient buffer ``(bucket_numel,)`` across the
    ranks with ``ring_all_reduce``; no division by the world size (lmforge divides the loss by the
    global token count, so the gradients must be summed, not averaged).

    ``ddp_model.register_comm_hook(state, ring_hook)`` with ``state`` the process group, ``None`` (the
    default group) or a ``RingStats`` that names the group and counts the traffic. The ring runs
    synchronously inside the hook: unlike the native collective it does not overlap with the rest
    of the backward pass. DDP reduces buckets in the same order on every rank, so the rings match.
    """
    stats = state if isinstance(state, RingStats) else None
    group = stats.group if stats is not None else state
    return _completed(ring_all_reduce(bucket.buffer(), group, stats))


def sum_hook(state: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: SUM the bucket's gradients with the native ``dist.all_reduce``.

    DDP's default hook divides by the world size (a mean); this one does not. ``state`` is the
    process group or ``None`` (the default group).
    """
    work = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, group=state, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
