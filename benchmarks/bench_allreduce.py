"""All-reduce on gloo: lmforge's point-to-point ring (``lmforge.parallel.ring.ring_all_reduce``)
against the native collective (``dist.all_reduce``), plus the communication volume per optimizer
step of DDP and FSDP2 on paper.

Measured part: W spawned gloo ranks on this machine (loopback TCP, one thread each), fp32 tensors of
each ``--sizes`` byte count (the sizes are payload bytes M; the ring pads M up to a multiple of W
elements). Per repetition both contestants run once, in alternating order (ring first on even
repetitions, native first on odd ones), each call preceded by a barrier and timed on every rank;
the time of a call is the slowest rank's (an all-reduce is done when the last rank has its result).
Printed: median time over the repetitions, algorithm bandwidth M / t, bus bandwidth
2 (W-1)/W * M / t (the bytes each rank actually sends per second, comparable across W), the
ratio of medians native / ring (above 1: the ring is faster), and the best (minimum) times and their
ratio, which a loaded machine disturbs least. Before timing, each size is checked:
the ring's result must equal the native one to fp32 rounding.

Paper part: bytes each rank sends per optimizer step (the derivation is in
docs/algorithms/all-reduce.md):
  DDP    all-reduce of the gradients                     2 (W-1)/W * N * b
  FSDP2  all-gather of the parameters in forward,
         again in backward (reshard_after_forward=True),
         reduce-scatter of the gradients                 3 (W-1)/W * N * b
for N parameters of b bytes each.

    python benchmarks/bench_allreduce.py                       # W = 2 and 4, 1 KB .. 64 MB, 7 reps
    python benchmarks/bench_allreduce.py --world 2 --reps 15 --sizes 4096 67108864
    python benchmarks/bench_allreduce.py --paper-only
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch

from lmforge.parallel.context import free_port as _free_port

DEFAULT_SIZES = (1 << 10, 16 << 10, 256 << 10, 4 << 20, 64 << 20)
PAPER_PARAMS = (("135M", 135e6), ("1B", 1e9), ("7B", 7e9))
PAPER_WORLDS = (2, 8, 64)


def _human(num_bytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1024 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.4g} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def _timed(fn, tensor: torch.Tensor, source: torch.Tensor) -> float:
    """Seconds for ``fn(tensor)`` on the slowest rank, from a common barrier."""
    import torch.distributed as dist

    tensor.copy_(source)
    dist.barrier()
    start = time.perf_counter()
    fn(tensor)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _worker(rank: int, world: int, port: int, sizes: list[int], reps: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from lmforge.parallel.ring import ring_all_reduce

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    contestants = {"ring": ring_all_reduce, "native": dist.all_reduce}
    try:
        for size in sizes:
            source = torch.randn(size // 4, generator=torch.Generator().manual_seed(rank))
            tensor = source.clone()
            results = {}
            for name, fn in contestants.items():  # correctness check, doubles as the warm-up
                tensor.copy_(source)
                fn(tensor)
                results[name] = tensor.clone()
            # Two summation orders of W fp32 terms differ by at most 2 gamma_{W-1} sum_r |x_r| per element.
            abs_sum = source.abs()
            dist.all_reduce(abs_sum)
            gamma = (world - 1) * 2.0**-24 / (1 - (world - 1) * 2.0**-24)
            if not bool(((results["ring"] - results["native"]).abs() <= 2 * gamma * abs_sum).all()):
                raise RuntimeError(f"ring and native all-reduce disagree beyond fp32 rounding at {size} bytes")
            times: dict[str, list[float]] = {name: [] for name in contestants}
            for rep in range(reps):
                order = list(contestants) if rep % 2 == 0 else list(reversed(contestants))
                for name in order:
                    times[name].append(_timed(contestants[name], tensor, source))
            if rank == 0:
                ring_t, native_t = statistics.median(times["ring"]), statistics.median(times["native"])
                ring_best, native_best = min(times["ring"]), min(times["native"])
                bus = 2 * (world - 1) / world * size
                print(
                    f"| {world} | {_human(size)} | {ring_t * 1e3:.3f} | {native_t * 1e3:.3f} "
                    f"| {size / ring_t / 1e6:.1f} | {size / native_t / 1e6:.1f} "
                    f"| {bus / ring_t / 1e6:.1f} | {bus / native_t / 1e6:.1f} | {native_t / ring_t:.2f} "
                    f"| {ring_best * 1e3:.3f} / {native_best * 1e3:.3f} = {native_best / ring_best:.2f} |",
                    flush=True,
                )
    finally:
        dist.destroy_process_group()


def ddp_bytes_per_step(num_params: float, world: int, bytes_per_value: int) -> float:
    """Bytes one rank sends per step under DDP: a ring all-reduce of all gradients."""
    return 2 * (world - 1) / world * num_params * bytes_per_value


def fsdp2_bytes_per_step(num_params: float, world: int, bytes_per_value: int) -> float:
    """Bytes one rank sends per step under FSDP2 with resharding after forward: two all-gathers of
    the parameters (forward, backward) and one reduce-scatter of the gradients, (W-1)/W * N * b each."""
    return 3 * (world - 1) / world * num_params * bytes_per_value


def print_paper_table() -> None:
    print("\nCommunication volume per optimizer step, bytes sent by each rank (GB = 1e9 bytes)")
    print("| params | W | DDP fp32 | DDP bf16 | FSDP2 fp32 | FSDP2 bf16 | FSDP2 bf16 params + fp32 grads |")
    print("|---|---|---|---|---|---|---|")
    for label, n in PAPER_PARAMS:
        for w in PAPER_WORLDS:
            mixed = (2 * 2 + 4) * (w - 1) / w * n  # two bf16 all-gathers, one fp32 reduce-scatter
            cells = [
                ddp_bytes_per_step(n, w, 4),
                ddp_bytes_per_step(n, w, 2),
                fsdp2_bytes_per_step(n, w, 4),
                fsdp2_bytes_per_step(n, w, 2),
                mixed,
            ]
            print(f"| {label} | {w} | " + " | ".join(f"{c / 1e9:.3g}" for c in cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4], help="world sizes to measure")
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=list(DEFAULT_SIZES),
        help="payload sizes in bytes (multiples of 4: fp32)",
    )
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per contestant and size")
    parser.add_argument("--paper-only", action="store_true", help="print only the analytic table")
    args = parser.parse_args()
    bad = [s for s in args.sizes if s <= 0 or s % 4]
    if bad:
        parser.error(f"--sizes must be positive multiples of 4 bytes (fp32 elements); got {bad}")
    if any(w < 2 for w in args.world):
        parser.error(f"--world sizes must be at least 2; got {args.world}")

    if not args.paper_only:
        import torch.multiprocessing as mp

        print(
            f"torch {torch.__version__}, gloo over loopback, 1 thread per rank, fp32, "
            f"median of {args.reps} alternating repetitions; times are the slowest rank's"
        )
        print(
            "| W | size M | ring ms | native ms | ring MB/s (M/t) | native MB/s (M/t) "
            "| ring bus MB/s | native bus MB/s | native t / ring t | best ms: ring / native = ratio |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for world in args.world:
            # spawn, not fork: a forked child of a process whose OpenMP pool has started can deadlock.
            mp.start_processes(
                _worker,
                args=(world, _free_port(), args.sizes, args.reps),
                nprocs=world,
                join=True,
                start_method="spawn",
            )
    print_paper_table()


if __name__ == "__main__":
    main()
