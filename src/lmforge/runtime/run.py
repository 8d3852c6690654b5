"""What every recipe does first: start the parallel context, pick hardware settings, split the
batch, make the run directory, write the resolved config, seed every rank's RNG."""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import random
import socket
from pathlib import Path

import torch
import yaml

from ..core.config import LoggingConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, save_config, to_dict
from ..core.errors import ConfigError
from ..model import lora
from ..model.load import count_parameters
from ..parallel.context import ParallelContext, init_parallel
from . import hardware
from .checkpoint import list_checkpoints, pid_alive
from .metrics import make_console
from .quant_hooks import check_quant_settings
from .resume_check import check_resume_settings

DEFAULT_BATCH_SIZE = 32


@dataclasses.dataclass
class Run:
    """A started run: its directory, hardware choices, parallel context and the sections the runtime reads.

    The runtime gets the sections every run config has, resolved (``train`` holds the chosen micro-batch
    size, threads, dtype and checkpointing), never the recipe's whole config."""

    name: str
    model_cfg: ModelConfig
    train: TrainConfig
    optim: OptimConfig
    parallel: ParallelConfig
    logging: LoggingConfig
    dir: Path
    hw: hardware.Hardware
    choices: hardware.Choices
    console: object
    ctx: ParallelContext = dataclasses.field(default_factory=ParallelContext)
    grad_accum: int = 1  # micro-batches per rank per optimizer update
    _peak: float = 0.0

    @property
    def micro_batch_size(self) -> int:
        """Rows per forward pass on this rank (the resolved ``train.micro_batch_size``)."""
        return self.train.micro_batch_size

    @property
    def device(self) -> torch.device:
        return self.choices.device

    def print(self, text: str) -> None:
        """Console output, from rank 0 only."""
        if self.ctx.is_main:
            self.console.print(text, markup=False, highlight=False)

    def peak_gflops(self) -> float:
        """Measured matmul peak of this machine in the run's dtype (cached)."""
        if not self._peak:
            self._peak = hardware.matmul_peak_gflops(self.choices.dtype, device=str(self.device))
        return self._peak

    @staticmethod
    def matmul_params(model) -> tuple[int, int]:
        """(body, head): parameters multiplied per token in the transformer body and in the LM head.

        The input-embedding lookup does no matmul; a tied embedding counts once, as the head.
        """
        head = model.get_output_embeddings().weight.numel()
        body = count_parameters(model) - head
        if not getattr(model.config, "tie_word_embeddings", False):
            body -= model.get_input_embeddings().weight.numel()
        return body, head

    @staticmethod
    def flops_per_token(model) -> float:
        """Training FLOPs per token, 6 x the parameters that do matmuls (forward 2N, backward 4N).

        The input-embedding lookup does no matmul; with tied embeddings the same matrix is the LM
        head, which does. Attention-score FLOPs (~ 12 x layers x hidden x seq) are left out.
        """
        params = count_parameters(model)
        if not getattr(model.config, "tie_word_embeddings", False):
            params -= model.get_input_embeddings().weight.numel()
        return 6.0 * params


def split_batch(global_rows: int, micro_batch_size: int, world_size: int, what: str) -> int:
    """Micro-batches per rank (the accumulation) for ``global_rows`` rows per update over ``world_size`` ranks.

    The batch is the user's: the micro-batch size and the world size only change how it is split,
    ``accumulation = global_rows / (micro x world)``; a micro-batch larger than a rank's share means
    one micro-batch of the share. A split that does not divide evenly is an error naming the numbers.
    """
    if global_rows % world_size:
        raise ConfigError(f"{what}={global_rows} rows cannot be split evenly over {world_size} ranks")
    per_rank = global_rows // world_size
    micro = min(micro_batch_size, per_rank)
    if per_rank % micro:
        raise ConfigError(
            f"{what}={global_rows} rows is not divisible by micro_batch_size={micro} x "
            f"world size={world_size}; choose numbers with {what} = micro x ranks x accumulation"
        )
    return per_rank // micro


def largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, max(cap, 1)) + 1) if n % d == 0)


def start_run(
    cfg,
    name: str,
    model=None,
    seq_len: int = 256,
    console=None,
    update_rows: int | None = None,
    update_label: str = "train.batch_size",
    rollout_backend: str | None = None,
) -> Run:
    """Start the parallel context, choose hardware settings (printing each with its reason), split the
    batch, prepare ``train.output_dir``, write the resolved config.

    ``cfg`` is the recipe's whole config, read here only to check it against a resumed run's and to save
    it; the run keeps its sections (:class:`Run`). ``update_rows``: rows of one optimizer update over all
    ranks (RL: a mini-batch of the rollout); default ``train.batch_size``. ``rollout_backend``: the RL
    run's ``rollout.backend`` (``train.qat`` needs an in-process sampler). The resolved values (batch size,
    micro-batch size, dtype, threads, checkpointing) go into the run's copy of ``train`` and into the saved
    config.yaml, so that it reproduces the run on another machine; ``cfg`` itself is not changed.
    """
    console = console or make_console()
    tcfg = cfg.train
    check_quant_settings(tcfg, rollout_backend)  # formats; train.qat with the rollout backend
    run_dir = Path(tcfg.output_dir)
    if not tcfg.resume and list_checkpoints(run_dir):
        raise ConfigError(
            f"{run_dir} already holds checkpoints of an earlier run. Resume it with train.resume=auto "
            f"or choose another train.output_dir (nothing was overwritten)."
        )
    hw = hardware.detect(tcfg.device)
    ctx, device = init_parallel(cfg.parallel.strategy, torch.device(hw.device), cfg.parallel.timeout_s)
    lora.check_settings(cfg.model.lora, tcfg, ctx)  # before the run directory is locked or written
    mcfg = getattr(model, "config", None)
    # Several ranks on one CPU share its cores: each gets its part unless threads are set.
    ranks = local_world_size() if hw.device == "cpu" and ctx.distributed else 1
    choices = hardware.choose(
        hw,
        dtype=tcfg.dtype,
        threads=tcfg.threads,
        local_ranks=ranks,
        micro_batch_size=tcfg.micro_batch_size,
        gradient_checkpointing=tcfg.gradient_checkpointing,
        num_params=count_parameters(model) if model is not None else 0,
        seq_len=seq_len,
        hidden=getattr(mcfg, "hidden_size", 128),
        layers=getattr(mcfg, "num_hidden_layers", 4),
    )
    choices.device = device
    train, update_rows, accum = resolve_train(tcfg, choices, ctx, update_rows, update_label)
    resolved = dataclasses.replace(cfg, train=train)  # what config.yaml holds
    run = Run(name, cfg.model, train, cfg.optim, cfg.parallel, cfg.logging, run_dir, hw, choices, console, ctx, accum)
    ctx.check_same_config(yaml.safe_dump({k: v for k, v in to_dict(resolved).items()}, sort_keys=True))
    error = None
    if ctx.is_main:
        try:
            check_resume_settings(resolved, run_dir, run.print)  # before config.yaml is overwritten below
            acquire_run_lock(run_dir, run.print)
        except (ConfigError, OSError) as exc:
            error = (
                exc
                if isinstance(exc, ConfigError)
                else ConfigError(f"train.output_dir={run_dir}: cannot be used as a run directory ({exc})")
            )
    ctx.check_all_ok(error)
    if ctx.is_main:
        report_choices(run, update_label, update_rows)
        save_config(resolved, run_dir / "config.yaml")
    ctx.barrier()
    seed_everything(tcfg.seed, ctx.rank)
    return run


def resolve_train(tcfg, choices, ctx, update_rows: int | None, update_label: str):
    """The run's ``train`` section with what was chosen (batch size, micro-batch size, threads, dtype,
    checkpointing), the rows of one update and the accumulation: ``(train, update_rows, accumulation)``.
    ``choices.micro_batch_size`` becomes the micro-batch used, and the choices are applied to the process."""
    batch_size = tcfg.batch_size or DEFAULT_BATCH_SIZE
    if update_rows is None:
        update_rows = batch_size
    per_rank = update_rows // ctx.world_size if update_rows % ctx.world_size == 0 else update_rows
    wanted = tcfg.micro_batch_size or largest_divisor_at_most(per_rank, choices.micro_batch_size)
    accum = split_batch(update_rows, wanted, ctx.world_size, update_label)
    micro = min(wanted, update_rows // ctx.world_size)  # a micro-batch is at most a rank's share
    choices.micro_batch_size = micro
    hardware.apply(choices)
    train = dataclasses.replace(
        tcfg,
        batch_size=batch_size,
        micro_batch_size=micro,
        threads=choices.threads,
        dtype={torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[choices.dtype],
        gradient_checkpointing="on" if choices.gradient_checkpointing else "off",
    )
    return train, update_rows, accum


def report_choices(run: Run, update_label: str, update_rows: int) -> None:
    """The hardware and its choices, each with its reason, and under torchrun the batch's split (rank 0)."""
    ctx = run.ctx
    run.console.print(f"[hardware] {hardware.describe(run.hw)}", markup=False)
    run.choices.report(lambda text: run.console.print(text, markup=False))
    if ctx.distributed:
        run.console.print(
            f"[parallel] {ctx.world_size} ranks, {ctx.strategy}; {update_label}={update_rows} rows "
            f"= {run.micro_batch_size} per micro-batch x {ctx.world_size} ranks x {run.grad_accum} accumulation",
            markup=False,
        )


LOCK_NAME = ".lmforge.lock"


def acquire_run_lock(run_dir: Path, printer=print) -> Path:
    """One run per directory: ``run_dir/.lmforge.lock`` holds the PID and host of the run that owns it.

    A live lock of another process is an error naming it; a stale one (its process is gone, on this
    host) is taken over with a note; this process's own lock (a second recipe in one process) is reused.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / LOCK_NAME
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner = json.loads(lock.read_text())
                pid, host = int(owner["pid"]), str(owner["host"])
            except (OSError, ValueError, KeyError, TypeError):
                pid, host = -1, me["host"]  # unreadable: a crash while writing it
            if pid == me["pid"] and host == me["host"]:
                return lock
            if host != me["host"]:
                raise ConfigError(
                    f"{run_dir} is locked by process {pid} on host {host} ({lock}); if that run is "
                    f"over, delete {lock}, or choose another train.output_dir"
                )
            if pid_alive(pid):
                raise ConfigError(
                    f"{run_dir} is in use by a running lmforge process (PID {pid}, lock {lock}); "
                    "wait for it to finish or choose another train.output_dir"
                )
            printer(f"[run] taking over the stale lock of process {pid} (no longer running): {lock}")
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as handle:
            json.dump(me, handle)
        atexit.register(_release_lock_file, lock)  # also when the run fails before its loop
        return lock
    raise ConfigError(f"could not lock {run_dir}: {lock} keeps reappearing (another run starting at the same time?)")


def release_run_lock(run: "Run") -> None:
    """Remove the run directory's lock if this process holds it."""
    if run.ctx.is_main:
        _release_lock_file(Path(run.dir) / LOCK_NAME)


def _release_lock_file(lock: Path) -> None:
    try:
        if json.loads(lock.read_text()).get("pid") == os.getpid():
            lock.unlink()
    except (OSError, ValueError):
        pass


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def seed_everything(seed: int, rank: int = 0) -> None:
    """Seed Python's and torch's RNGs; each rank gets its own stream (rank 0 the single-process one)."""
    seed = seed + 1_000_003 * rank
    random.seed(seed)
    torch.manual_seed(seed)
