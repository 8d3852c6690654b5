"""Tests for lmforge.parallel.ring: the point-to-point ring all-reduce and the DDP sum hooks.

One spawn of W gloo ranks per world size (2, 3, 4) runs every check in ``_worker`` and saves what it
saw; the test process then asserts, so a failure names the case instead of hanging the other ranks.

Tolerances. Every rank's input is regenerated from a seed, so each rank also computes the sum itself,
in fp64 (exact for the integer-valued inputs, within gamma64_{W-1} S of exact for the random ones).
An all-reduce of W floating point values per element, in any order, is a sum of W terms with W - 1
roundings, so its error is at most gamma_{W-1} * S, with S = sum_r |x_r| (the elementwise sum of
absolute values) and gamma_k = k u / (1 - k u), u = 2^-24 (fp32) or 2^-53 (fp64) [Higham,
Accuracy and Stability of Numerical Algorithms, ch. 4]. The ring and the native collective sum in
different orders, so they may differ by up to 2 gamma_{W-1} S. At W = 2 both compute one rounded
a + b (addition commutes), so there they must agree bit for bit, as must every integer-valued input.
A bug that drops or doubles one rank's chunk is off by about |x_r|, far outside these bounds.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
from torch import nn

from lmforge.parallel.context import free_port as _free_port

WORLD_SIZES = (2, 3, 4)
PRIMES = (2, 3, 5, 7, 13, 101, 1009)
LARGE = 1 << 18
KINDS = ("int_f32", "int64", "rand_f32", "rand_f64")
DDP_STEPS, DDP_ROWS_PER_RANK, LR = 3, 4, 0.1


def _sizes(world: int) -> list[int]:
    return sorted({0, 1, world - 1, world, world + 1, *PRIMES, LARGE, LARGE + 3})


def _inputs(kind: str, n: int, rank: int) -> torch.Tensor:
    """This rank's input for one case; seeded by (kind, n, rank) so any rank can rebuild any other's."""
    g = torch.Generator().manual_seed(1000 * n + 10 * rank + KINDS.index(kind))
    if kind == "int_f32":  # integers up to 2^10 in fp32: every partial sum is exact
        return torch.randint(-1024, 1025, (n,), generator=g).float()
    if kind == "int64":
        return torch.randint(-(1 << 40), 1 << 40, (n,), generator=g)
    dtype = torch.float32 if kind == "rand_f32" else torch.float64
    # Magnitudes spread over ~6 decades so that the summation order matters.
    scale = 10.0 ** torch.randint(-3, 4, (n,), generator=g)
    return (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _global_batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    rows = world * DDP_ROWS_PER_RANK
    return (
        torch.randn(rows, 5, generator=g, dtype=torch.float64),
        torch.randn(rows, 3, generator=g, dtype=torch.float64),
    )


def _train(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_values_global: int, reduce_loss=None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """3 steps of SGD with momentum on the loss sum((f(x) - y)^2) / num_values_global; returns the
    global loss before each step and the final weights. SGD, not Adam: its update is linear in the
    gradient, so a gradient off by a factor W shows (Adam's update is nearly scale-invariant)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for _ in range(DDP_STEPS):
        loss = (model(x) - y).pow(2).sum() / num_values_global
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss_global = loss.detach().clone()
        if reduce_loss is not None:
            reduce_loss(loss_global)
        losses.append(float(loss_global))
    inner = model.module if hasattr(model, "module") else model
    return losses, {k: v.detach().clone() for k, v in inner.state_dict().items()}


def _gamma(k: int, element_size: int) -> float:
    """gamma_k = k u / (1 - k u): the relative error bound of a sum of k + 1 terms."""
    u = 2.0**-24 if element_size == 4 else 2.0**-53
    return k * u / (1 - k * u)


def _worst_ratio(result: torch.Tensor, reference: torch.Tensor, bound: torch.Tensor) -> float:
    err = (result.double() - reference.double()).abs()
    ratio = torch.where(err == 0, torch.zeros_like(err), err / bound)  # err > 0 = bound: inf, fails
    return float(ratio.max()) if ratio.numel() else 0.0


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from lmforge.parallel.ring import RingStats, ring_all_reduce, ring_hook, sum_hook

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    seen: dict = {"cases": []}
    try:
        for kind in KINDS:
            for n in _sizes(world):
                x = _inputs(kind, n, rank)
                native = x.clone()
                dist.all_reduce(native)
                stats = RingStats()
                ring = x.clone()
                returned = ring_all_reduce(ring, stats=stats)
                everyone = torch.stack([_inputs(kind, n, r) for r in range(world)])  # (W, n)
                exact = everyone.sum(0) if kind == "int64" else everyone.double().sum(0)
                abs_sum = everyone.double().abs().sum(0)  # S, elementwise
                gamma = _gamma(world - 1, x.element_size())
                # Elementwise: |ring - reference| <= (gamma_{W-1} + gamma64_{W-1}) S, the reference
                # being the fp64 sum (exact to gamma64_{W-1} S), and |ring - native| <= 2 gamma_{W-1} S.
                # Saved as the worst ratio error / bound (<= 1 passes; 0 / 0 counts as 0).
                seen["cases"].append(
                    dict(
                        kind=kind,
                        n=n,
                        element_size=x.element_size(),
                        bytes_sent=stats.bytes_sent,
                        same_object=returned is ring,
                        equal_native=torch.equal(ring, native),
                        equal_exact=torch.equal(ring.to(exact.dtype), exact),
                        worst_vs_reference=_worst_ratio(ring, exact, (gamma + _gamma(world - 1, 8)) * abs_sum),
                        worst_vs_native=_worst_ratio(ring, native, 2 * gamma * abs_sum),
                    )
                )

        # Pipelined segments of 3 fp32 elements: the same messages in smaller pieces, so the same bits.
        seen["segmented"] = []
        for n in (1, world + 1, 101, 1009):
            x = _inputs("rand_f32", n, rank)
            whole, pieces = ring_all_reduce(x.clone()), ring_all_reduce(x.clone(), segment_bytes=12)
            seen["segmented"].append((n, torch.equal(whole, pieces)))

        # Any shape, non-contiguous: reduced in place through a flat copy.
        x = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * (rank + 1)  # (4, 3), non-contiguous
        ring_all_reduce(x)
        seen["transposed"] = x.clone()

        # A subgroup whose group ranks differ from the global ranks: members are ranks 0, 2, 3, ...
        members = [0, *range(2, world)]
        sub = dist.new_group(members)
        if rank in members:
            x = torch.full((5,), float(rank + 1))
            ring_all_reduce(x, group=sub)
            seen["subgroup"] = x.clone()
        else:
            try:
                ring_all_reduce(torch.ones(3), group=sub)
            except ValueError as err:
                seen["subgroup_error"] = str(err)

        # DDP: the same 3 steps with the ring hook and with the native sum hook. Each rank owns
        # DDP_ROWS_PER_RANK rows of the global batch and divides its loss by the GLOBAL number of
        # loss values; both hooks sum the gradients, so the synced gradient is the gradient of the
        # global mean loss, the 1-process run's gradient on the concatenated batch.
        x_all, y_all = _global_batch(world)
        rows = slice(rank * DDP_ROWS_PER_RANK, (rank + 1) * DDP_ROWS_PER_RANK)
        for name, hook, state in (("ring", ring_hook, RingStats()), ("sum", sum_hook, None)):
            ddp = nn.parallel.DistributedDataParallel(_model())
            ddp.register_comm_hook(state, hook)
            seen[name] = _train(ddp, x_all[rows], y_all[rows], y_all.numel(), reduce_loss=dist.all_reduce)
            if name == "ring":
                seen["ring_hook_stats"] = (state.bytes_sent, state.calls)
        seen["num_params"] = sum(p.numel() for p in _model().parameters())
    finally:
        torch.save(seen, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"W{w}")
def spawned(request, tmp_path_factory) -> tuple[int, list[dict]]:
    """Run ``_worker`` on W gloo ranks (spawn, not fork: a forked child of a process whose OpenMP pool
    has started can deadlock) and return what each rank saw."""
    import torch.multiprocessing as mp

    world, out = request.param, tmp_path_factory.mktemp(f"ring{request.param}")
    mp.start_processes(_worker, args=(world, _free_port(), str(out)), nprocs=world, join=True, start_method="spawn")
    return world, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def test_ring_equals_native_all_reduce(spawned):
    world, ranks = spawned
    for rank, seen in enumerate(ranks):
        assert len(seen["cases"]) == 4 * len(_sizes(world))
        for case in seen["cases"]:
            where = f"W={world} rank={rank} {case['kind']} n={case['n']}"
            assert case["same_object"], where
            if case["kind"] in ("int_f32", "int64") or world == 2:
                assert case["equal_native"], where
            if case["kind"] in ("int_f32", "int64"):
                assert case["equal_exact"], where
                continue
            # The bounds of the module docstring, checked elementwise in the worker.
            assert case["worst_vs_reference"] <= 1, where
            assert case["worst_vs_native"] <= 1, where


def test_bytes_sent_per_rank_is_two_w_minus_one_over_w_of_padded_message(spawned):
    world, ranks = spawned
    for seen in ranks:
        for case in seen["cases"]:
            n, size = case["n"], case["element_size"]
            padded_bytes = world * -(-n // world) * size  # M: n rounded up to a multiple of W
            # bytes_sent == 2 (W - 1) / W * M, compared in integers.
            assert case["bytes_sent"] * world == 2 * (world - 1) * padded_bytes, (world, case["kind"], n)
    large = next(c for c in ranks[0]["cases"] if c["kind"] == "rand_f32" and c["n"] == LARGE)
    # By hand, 2^18 fp32 values: W=2: 2*1*131072*4; W=3: 2*2*87382*4 (87382 = ceil(262144/3)); W=4: 2*3*65536*4.
    assert large["bytes_sent"] == {2: 1_048_576, 3: 1_398_112, 4: 1_572_864}[world]


def test_segmenting_changes_no_bit(spawned):
    world, ranks = spawned
    for seen in ranks:
        assert seen["segmented"] == [(n, True) for n in (1, world + 1, 101, 1009)]


def test_any_shape_and_subgroups(spawned):
    world, ranks = spawned
    total = sum(range(1, world + 1))
    expected = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * total
    members = [0, *range(2, world)]
    for rank, seen in enumerate(ranks):
        assert torch.equal(seen["transposed"], expected)
        if rank in members:
            assert torch.equal(seen["subgroup"], torch.full((5,), float(sum(r + 1 for r in members))))
        else:
            assert "not a member of the group" in seen["subgroup_error"]


def test_ddp_ring_hook_matches_sum_hook_and_one_process(spawned):
    world, ranks = spawned
    x_all, y_all = _global_batch(world)
    # One process, all W * DDP_ROWS_PER_RANK rows, the same loss normaliser: the reference.
    ref_losses, ref_weights = _train(_model(), x_all, y_all, y_all.numel())
    untrained = _model().state_dict()
    # fp64, O(1) weights, O(100) roundings per value: differences of order 1e-15. A gradient off by a
    # factor W (an averaging hook, a per-rank normaliser) changes the first SGD update, lr * grad with
    # |grad| ~ 0.1, by ~1e-2: ten orders of magnitude above the tolerance.
    tol = dict(rtol=0, atol=1e-12)
    for seen in ranks:
        for name in ("ring", "sum"):
            losses, weights = seen[name]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
            for key in ref_weights:
                torch.testing.assert_close(weights[key], ref_weights[key], **tol)
                assert not torch.equal(weights[key], untrained[key])  # it trained
        ring_w, sum_w = seen["ring"][1], seen["sum"][1]
        if world == 2:
            assert all(torch.equal(ring_w[k], sum_w[k]) for k in ring_w)
        # The ring really carried the gradients: one bucket (all parameters) per step.
        num_params = seen["num_params"]
        assert seen["ring_hook_stats"] == (DDP_STEPS * 2 * (world - 1) * -(-num_params // world) * 8, DDP_STEPS)
