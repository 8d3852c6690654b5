"""The parallel context of a run: which process this is, how many there are, and the few collectives
the runtime needs (sums of counts and metrics, an error flag, a config check).

Under ``torchrun`` (``WORLD_SIZE`` > 1) :func:`init_parallel` starts the default process group (gloo on
CPU, NCCL on CUDA) with a timeout, so a rank that dies can never leave the others waiting forever.
One process alone gets a context with ``world_size == 1`` whose collectives are the identity: the
single-process run executes exactly the code it executed before there was a parallel runtime.

Data parallelism only: every rank holds (a shard of) the same model and its own slice of each global
batch. ``mesh`` is the 1-D device mesh FSDP2 shards over; ``group`` the data-parallel process group.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import signal
import socket
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError, TrainingError


@dataclasses.dataclass
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    strategy: str = "none"  # none | ddp | fsdp2
    mesh: Any = None  # torch.distributed.device_mesh.DeviceMesh (FSDP2), else None
    group: Any = None  # the data-parallel process group (None = the default group)

    @property
    def is_main(self) -> bool:
        """Rank 0: the only process that prints and writes run files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    # -------------------------------------------------------------- collectives (identity on 1 rank)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In place over the data-parallel group; returns ``tensor``."""
        if self.distributed:
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def sum_counts(self, *counts: int) -> list[int]:
        """Integer counts summed over ranks in one collective (exact: int64)."""
        if not self.distributed:
            return list(counts)
        return self.all_reduce(torch.tensor(counts, dtype=torch.int64)).tolist()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def gather_objects(self, obj) -> list:
        """``obj`` of every rank, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def check_all_ok(self, error: BaseException | None) -> None:
        """Collective error flag, for work where one rank may fail alone (data, rewards, a save).

        Every rank calls this at the same point; if any rank passes an error, every rank raises: the
        failing rank re-raises its own error, the others a TrainingError naming the failed ranks. So
        no rank is left waiting in the next collective.
        """
        if not self.distributed:
            if error is not None:
                raise error
            return
        flags = torch.zeros(self.world_size, dtype=torch.int32)
        flags[self.rank] = int(error is not None)
        failed = self.all_reduce(flags).nonzero().flatten().tolist()
        if error is not None:
            error.lmforge_report = self.rank == min(failed)  # printed once, by the lowest failing rank
            raise error
        if failed:
            raise PeerFailed(f"stopping: rank(s) {failed} failed (the error is printed by rank {min(failed)})")

    def check_same_config(self, text: str) -> None:
        """Every rank must run the same resolved config; a difference is an error naming the ranks."""
        if not self.distributed:
            return
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        digests = self.gather_objects(digest)
        if len(set(digests)) > 1:
            groups: dict[str, list[int]] = {}
            for rank, d in enumerate(digests):
                groups.setdefault(d, []).append(rank)
            raise ConfigError(f"the ranks resolved different configs (ranks grouped by config: "
                              f"{list(groups.values())}); give every rank the same config file and overrides")


def torchrun_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) outside torchrun."""
    return (int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
            int(os.environ.get("LOCAL_RANK", "0")))


def init_parallel(strategy: str, device: torch.device, timeout_s: float = 600.0) -> tuple[ParallelContext, torch.device]:
    """The run's parallel context (starting the process group under torchrun) and its device.

    ``strategy``: ``ddp`` or ``fsdp2`` (used only when there is more than one process). On CUDA each
    rank takes the GPU ``LOCAL_RANK``.
    """
    rank, world, local_rank = torchrun_world()
    if world == 1:
        return ParallelContext(), device
    if strategy not in ("ddp", "fsdp2"):
        raise ConfigError(f"parallel.strategy must be ddp or fsdp2, got {strategy!r}")
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                **({"device_id": device} if device.type == "cuda" else {}))
    mesh = None
    if strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    install_signal_handlers()
    return ParallelContext(rank, world, local_rank, strategy, mesh, None), device


def free_port() -> int:
    """A TCP port no one listens on at 127.0.0.1 now: a rendezvous (``MASTER_PORT``) or a local server
    for ranks and services started on this machine (tests, benchmarks, one-machine launches)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def end_process_group() -> None:
    """Destroy the default process group if this process started one (end of a command)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class PeerFailed(TrainingError):
    """Another rank failed; this one stops with it (the other rank reports the error)."""


def should_report(error: BaseException) -> bool:
    """Whether this process prints ``error``: once per run, not once per rank. An error raised through
    :meth:`ParallelContext.check_all_ok` is printed by the lowest failing rank; one every rank hits
    alike (a config error at start-up, an interrupt) by rank 0; ``PeerFailed`` by nobody."""
    if isinstance(error, PeerFailed):
        return False
    if hasattr(error, "lmforge_report"):
        return error.lmforge_report
    return torchrun_world()[0] == 0


def rank_prefix() -> str:
    rank, world, _ = torchrun_world()
    return f"[rank {rank}] " if world > 1 else ""


class Interrupted(TrainingError):
    """SIGTERM / SIGINT: raised between operations, so no checkpoint is ever half-written by us."""


def install_signal_handlers() -> None:
    """torchrun forwards SIGTERM (and SIGINT) to every rank: turn it into an exception raised in the
    main thread. Checkpoints are written to a temporary directory and renamed, so a signal during a
    save leaves the last good checkpoint as it was."""

    def handler(signum, _frame):
        raise Interrupted(f"received {signal.Signals(signum).name}; the last complete checkpoint is intact "
                          "(resume with train.resume=auto)")

    signal.signal(signal.SIGTERM, handler)
