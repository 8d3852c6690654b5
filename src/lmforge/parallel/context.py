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

import contextlib
import dataclasses
import datetime
import hashlib
import os
import re
import signal
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..core.errors import ConfigError, Interrupted, TrainingError


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

    def mark(self, phase: str) -> None:
        """Record where this rank is, worded to follow "did not reach" ("the checkpoint barrier at step
        4"): a rank whose collective times out names the ranks that never reached it and their last
        mark (:func:`stall_note`). Under torchrun one small write to the rendezvous store."""
        _WHERE["phase"] = phase
        if self.distributed and (store := _store()) is not None:
            store.set(f"lmforge/where/{self.rank}", phase)

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
            raise ConfigError(
                f"the ranks resolved different configs (ranks grouped by config: "
                f"{list(groups.values())}); give every rank the same config file and overrides"
            )


def torchrun_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) outside torchrun."""
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
        int(os.environ.get("LOCAL_RANK", "0")),
    )


def init_parallel(
    strategy: str, device: torch.device, timeout_s: float = 600.0
) -> tuple[ParallelContext, torch.device]:
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
    _WHERE["timeout_s"] = timeout_s
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            **({"device_id": device} if device.type == "cuda" else {}),
        )
    mesh = None
    if strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    ctx = ParallelContext(rank, world, local_rank, strategy, mesh, None)
    record_peers(ctx)
    return ctx, device


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
    alike (a config error at start-up, an interrupt, a lost peer) by rank 0, or by the lowest rank still
    running when rank 0 is gone; ``PeerFailed`` by nobody."""
    if isinstance(error, PeerFailed):
        return False
    if hasattr(error, "lmforge_report"):
        return error.lmforge_report
    gone = {rank for rank, _, _ in gone_peers()}  # rank 0 killed: the next rank still running reports
    return torchrun_world()[0] == min((r for r in range(len(_PEERS)) if r not in gone), default=0)


def rank_prefix() -> str:
    rank, world, _ = torchrun_world()
    return f"[rank {rank}] " if world > 1 else ""


# ------------------------------------------------------------------ signals and lost peers
# SIGINT and SIGTERM raise Interrupted in the main thread, in one process and under torchrun alike.
# Inside deferred_signals() (renames that must happen together) the signal is held until the block
# ends; once the command is reporting an error (disarm_signals), a signal no longer raises, so exit
# handlers never print a traceback of their own. A second signal after an Interrupted (a user who
# insists while a long native call, e.g. BPE training, holds the first) ends the process at once.
_SIGNALS = {"armed": False, "deferring": 0, "pending": None, "stopping": False}
_PEERS: list[tuple[str, int]] = []  # (host, PID) of every rank, gathered at start under torchrun


def _on_signal(signum, _frame) -> None:
    if not _SIGNALS["armed"]:
        if _SIGNALS["stopping"] and not _SIGNALS["deferring"]:  # a second signal: the user insists, stop now
            os.write(
                2,
                f"lmforge: {signal.Signals(signum).name} again: stopping now, without cleaning up "
                "(the next run clears what is left)\n".encode(),
            )
            os._exit(128 + signum)
        return
    if _SIGNALS["deferring"]:
        _SIGNALS["pending"] = signum
        return
    _SIGNALS.update(armed=False, stopping=True)  # one Interrupted per run: its cleanup is not interrupted again
    raise Interrupted(signum)


def install_signal_handlers() -> dict:
    """Route SIGINT and SIGTERM to :class:`Interrupted` (main thread only); returns the previous
    handlers for :func:`restore_signal_handlers`. torchrun forwards SIGTERM to every rank."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    _SIGNALS.update(armed=True, deferring=0, pending=None, stopping=False)
    return previous


def restore_signal_handlers(previous: dict) -> None:
    _SIGNALS["armed"] = False
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def ignore_signals() -> None:
    """SIGINT / SIGTERM ignored from now on: a rank whose command is over exits with its own code
    (Python restores the default action of a handled signal while it shuts down, not of an ignored one)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def disarm_signals() -> None:
    """From now on a signal is noted, not raised (the command is already stopping)."""
    _SIGNALS["armed"] = False


@contextlib.contextmanager
def deferred_signals():
    """Hold SIGINT / SIGTERM until the block ends (a few renames, or a deletion, that must finish together),
    then raise."""
    _SIGNALS["deferring"] += 1
    try:
        yield
    finally:
        _SIGNALS["deferring"] -= 1
    if not _SIGNALS["deferring"] and _SIGNALS["pending"] is not None and _SIGNALS["armed"]:
        signum = _SIGNALS["pending"]
        _SIGNALS.update(pending=None, armed=False, stopping=True)
        raise Interrupted(signum)


def record_peers(ctx: "ParallelContext") -> None:
    """Remember every rank's host and PID, so that a rank whose peer vanished can say which one."""
    _PEERS[:] = ctx.gather_objects((socket.gethostname(), os.getpid()))


def gone_peers() -> list[tuple[int, int, str]]:
    """``(rank, PID, how)`` of the ranks on this host whose process no longer runs; ``how`` says how it
    ended when the process is still a zombie ("killed by SIGKILL", "exit code 1"), else "stopped"."""
    host, gone = socket.gethostname(), []
    for rank, (peer_host, pid) in enumerate(_PEERS):
        if peer_host == host and pid != os.getpid():
            how = _how_it_ended(pid)
            if how is not None:
                gone.append((rank, pid, how))
    return gone


def _how_it_ended(pid: int) -> str | None:
    """None while ``pid`` runs; else how it ended, as far as /proc still tells."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "stopped"
    except PermissionError:
        return None
    try:  # a zombie (ended, not yet reaped by torchrun): the kernel still holds its exit status
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] != "Z":
        return None
    status = int(fields[49]) if len(fields) > 49 else None  # exit_code, field 52 of proc(5)
    if status is None:
        return "stopped"
    if status & 0x7F:
        return f"killed by {signal.Signals(status & 0x7F).name}"
    return f"exited with code {status >> 8}"


def peers_note(wait_s: float = 0.0) -> str:
    """'rank 1 (PID 4242) killed by SIGKILL' for each vanished rank on this host ('' when none is
    known). ``wait_s``: how long to wait for one to show: a killed process closes its sockets, which
    is what the survivors notice, a little before it ends."""
    import time

    deadline = time.monotonic() + wait_s
    while not (gone := gone_peers()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return "; ".join(f"rank {rank} (PID {pid}) {how}" for rank, pid, how in gone)


# what gloo / NCCL / the store raise when a peer's process is gone
_PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Connection refused|"
    r"NCCL communicator was aborted|Socket Timeout|timed out|Timeout|"
    r"failed to recv|failed to send|read error|Connection reset",
    re.IGNORECASE,
)


# ------------------------------------------------------------------ stalled ranks
# Each rank marks its phase (ParallelContext.mark); a collective that times out (parallel.timeout_s) is
# either a rank that never came (stalled: a hung call, a deadlock, a rank that sleeps) or one that is gone.
_WHERE: dict = {"phase": "the start-up collectives", "timeout_s": 600.0}
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def _store():
    """The process group's rendezvous store (torchrun's TCPStore), or None."""
    try:
        return dist.distributed_c10d._get_default_store()  # private, but the group's own store
    except Exception:  # noqa: BLE001 - no group, or a torch without it: no marks
        return None


def stall_note(exc: BaseException, grace_s: float = 3.0) -> str:
    """For a collective that timed out: 'rank 1 (PID 4242) did not reach the checkpoint barrier at step
    4 within 300 s (parallel.timeout_s); its last mark: the collectives of training step 4' ('' when
    ``exc`` is not a timeout or no rank is missing). Every rank that timed out says so in the store and
    waits up to ``grace_s`` for the others; the ranks that never did are the stalled ones, and the
    lowest rank that did reports (``exc.lmforge_report``)."""
    store, (rank, world, _) = _store(), torchrun_world()
    if world <= 1 or store is None or not _TIMED_OUT.search(str(exc)):
        return ""
    import time

    try:
        store.set_timeout(datetime.timedelta(seconds=grace_s))
        store.set(f"lmforge/timed-out/{rank}", _WHERE["phase"])
        deadline, stalled = time.monotonic() + grace_s, []
        while time.monotonic() < deadline:
            stalled = [r for r in range(world) if not store.check([f"lmforge/timed-out/{r}"])]
            if not stalled:
                return ""
            time.sleep(0.05)
        last = {
            r: store.get(f"lmforge/where/{r}").decode() if store.check([f"lmforge/where/{r}"]) else "" for r in stalled
        }
    except Exception:  # noqa: BLE001 - the store went with rank 0: say what is known without it
        return ""
    exc.lmforge_report = rank == min(set(range(world)) - set(stalled))
    notes = []
    for r in stalled:
        pid = f" (PID {_PEERS[r][1]})" if r < len(_PEERS) else ""
        was = f"; its last mark: {last[r]}" if last[r] else ""
        notes.append(
            f"rank {r}{pid} did not reach {_WHERE['phase']} within {_WHERE['timeout_s']:g} s (parallel.timeout_s){was}"
        )
    return "; ".join(notes)


def is_peer_loss(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because another rank went away (under torchrun)."""
    if torchrun_world()[1] <= 1:
        return False
    if dist.is_available() and isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and bool(_PEER_LOST.search(str(exc)))
