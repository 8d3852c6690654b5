"""Detect the machine and choose dtype, threads, micro-batch size and gradient checkpointing.

Each automatic choice comes with the reason it was made; every choice can be overridden in config
(``train.device``, ``train.dtype``, ``train.threads``, ``train.micro_batch_size``,
``train.gradient_checkpointing``).

Importing this module does not import torch: the CLI asks :func:`prepare_process` for the OpenMP wait
policy before torch loads its OpenMP runtime, which reads the policy once.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import TYPE_CHECKING

from ..core.errors import ConfigError

if TYPE_CHECKING:  # the annotations only: importing this module must not import torch (module doc)
    import torch

# The 1-minute load average at or above this fraction of the cores makes the machine busy (thread choice)
BUSY_LOAD_FRACTION = 0.5
WAIT_POLICY_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # a user who sets either chooses the wait policy


@dataclasses.dataclass
class Hardware:
    device: str  # "cpu", "cuda", "mps"
    accelerator: str  # e.g. "NVIDIA H200" or "none"
    num_cores: int
    ram_gb: float
    accel_mem_gb: float  # 0 on CPU
    bf16_supported: bool  # native bf16 matmul: CUDA's own check, or AVX512-BF16 / AMX on a CPU
    load: float = 0.0  # the 1-minute load average when this process started (start_load)

    @property
    def tier(self) -> str:
        """laptop-cpu < workstation-cpu < small-gpu (< 24 GB) < large-gpu."""
        if self.device == "cpu":
            return "laptop-cpu" if self.num_cores <= 8 else "workstation-cpu"
        return "small-gpu" if self.accel_mem_gb < 24 else "large-gpu"


BF16_HERE = ": this one has it, and train.dtype=bf16 is faster on models the size of SmolLM2"


@dataclasses.dataclass
class Choices:
    device: torch.device
    dtype: torch.dtype
    threads: int
    micro_batch_size: int
    gradient_checkpointing: bool
    reasons: dict[str, str]

    def report(self, printer=print) -> None:
        for key, reason in self.reasons.items():
            printer(f"[hardware] {key} = {_fmt(getattr(self, key))}: {reason}")


@dataclasses.dataclass(frozen=True)
class ThreadChoice:
    threads: int  # torch's intra-op threads
    passive: bool  # the load calls for OMP_WAIT_POLICY=PASSIVE (an idle OpenMP thread sleeps at once)
    reason: str


def choose_threads(cores: int, load: float, local_ranks: int = 1, threads: int = 0, wait: str = "") -> ThreadChoice:
    """Threads and OpenMP wait policy for a process that shares ``cores`` with ``local_ranks - 1`` other
    ranks (torchrun) and with whatever made the 1-minute load average ``load`` before it started.

    Threads: the cores the load leaves (cores - floor(load), at least one), a rank's share of them.
    Wait policy: busy (load >= BUSY_LOAD_FRACTION x cores) is PASSIVE, so an idle OpenMP thread sleeps
    at once; OpenMP's default spins a while first, the fastest on a quiet machine, but on a busy one a
    spinning thread holds a core the others need and each parallel op waits for its slowest thread: SFT
    steps ran 8-60x slower than with PASSIVE or one thread (docs/benchmarks.md, bench_busy.py).
    ``threads`` > 0 (train.threads) wins; the wait policy still follows the load. ``wait``: the wait
    policy the environment sets (:func:`wait_setting`; "" = none), which wins too. Pure: reads nothing."""
    ranks = max(local_ranks, 1)
    busy = load >= BUSY_LOAD_FRACTION * cores
    free = max(1, cores - int(load))
    state = f"load average {load:.1f} on {cores} cores: {'busy' if busy else 'quiet'}"
    if wait == "OMP_WAIT_POLICY=PASSIVE" and busy:
        wait = ", OpenMP threads sleep while they wait (OMP_WAIT_POLICY=PASSIVE)"
    elif wait:
        wait = f", OpenMP wait policy {wait} from the environment"
    elif busy:  # torch started without the lmforge command's prepare_process
        wait = ", OpenMP's default wait policy (OMP_WAIT_POLICY=PASSIVE before torch starts is faster here)"
    if threads > 0:
        return ThreadChoice(threads, busy, f"set in config (train.threads); {state}{wait}")
    share = f", shared by the {ranks} ranks on this machine" if ranks > 1 else ""
    return ThreadChoice(
        max(1, free // ranks),
        busy,
        f"{state}, {free} core{'s' * (free > 1)} to use{share}{wait} (train.threads sets it)",
    )


@functools.lru_cache(maxsize=None)
def start_load() -> float:
    """The 1-minute load average when this process first asked (the CLI asks as it starts): the choice
    is made once per process, so a run's own work (the quickstart's SFT before its GRPO) never counts
    as another process's load. 0 where the platform has no load average."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return 0.0


def local_ranks() -> int:
    """Processes of this run on this machine: torchrun's LOCAL_WORLD_SIZE, 1 outside torchrun."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))))


def wait_setting(environ=os.environ) -> str:
    """The OpenMP wait policy the environment sets, e.g. "OMP_WAIT_POLICY=PASSIVE"; "" when none."""
    return ", ".join(f"{key}={environ[key]}" for key in WAIT_POLICY_KEYS if key in environ)


def prepare_process(environ=os.environ) -> ThreadChoice:
    """At a command's start, before torch loads OpenMP (which reads its wait policy once): note the load
    and set OMP_WAIT_POLICY=PASSIVE in ``environ`` when the machine is busy, unless the user set
    OMP_WAIT_POLICY or GOMP_SPINCOUNT. Returns the choice made for ``train.threads=0``."""
    choice = choose_threads(_num_cores(), start_load(), local_ranks(), wait=wait_setting(environ))
    if choice.passive and not wait_setting(environ):
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return choice


def _fmt(value) -> str:
    return str(value).replace("torch.", "")


def _ram_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 0.0


def _num_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_has_bf16() -> bool:
    """Whether the CPU has native bf16 dot products (AVX512-BF16 or AMX); Linux only."""
    try:
        with open("/proc/cpuinfo") as handle:
            flags = handle.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def detect(device: str = "auto") -> Hardware:
    """Inspect the machine. ``device`` narrows the choice ("auto", "cpu", "cuda[:N]", "mps")."""
    import torch

    want = device.split(":")[0]
    if want not in ("auto", "cpu", "cuda", "mps"):
        raise ConfigError(f"train.device must be auto, cpu, cuda, cuda:N or mps; got '{device}'")
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
    if want in ("auto", "cuda") and torch.cuda.is_available():
        index = int(device.split(":")[1]) if ":" in device else 0
        props = torch.cuda.get_device_properties(index)
        return Hardware(
            f"cuda:{index}",
            props.name,
            _num_cores(),
            _ram_gb(),
            props.total_memory / 2**30,
            torch.cuda.is_bf16_supported(),
            start_load(),
        )
    if want in ("auto", "mps") and getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return Hardware("mps", "Apple GPU", _num_cores(), _ram_gb(), _ram_gb() / 2, False, start_load())
    if want == "mps":
        raise ConfigError("train.device=mps but MPS is not available; use train.device=cpu")
    return Hardware("cpu", "none", _num_cores(), _ram_gb(), 0.0, cpu_has_bf16(), start_load())


def estimate_train_memory_gb(
    num_params: int, seq_len: int, hidden: int, layers: int, batch: int, checkpointing: bool, bytes_per_act: int = 4
) -> float:
    """Rough training memory: fp32 weights + grads + 2 AdamW moments, plus activations.

    Activations per layer and token are ~ 34 * hidden values without checkpointing (attention
    and MLP intermediates) and ~ 2 * hidden with it (only the layer inputs are kept).
    """
    states = num_params * 16
    per_token = (2 if checkpointing else 34) * hidden * layers * bytes_per_act
    return (states + per_token * seq_len * batch) / 2**30


def choose(
    hw: Hardware,
    *,
    dtype: str = "auto",
    threads: int = 0,
    micro_batch_size: int = 0,
    gradient_checkpointing: str = "auto",
    num_params: int = 0,
    seq_len: int = 256,
    hidden: int = 128,
    layers: int = 4,
    local_ranks: int = 1,
) -> Choices:
    """Pick settings for ``hw``; explicit (non-auto) arguments always win. ``local_ranks``: processes of
    the run sharing this machine's cores (torchrun)."""
    import torch

    reasons: dict[str, str] = {}
    if dtype == "auto":
        if hw.device.startswith("cuda") and hw.bf16_supported:
            chosen_dtype, reasons["dtype"] = torch.bfloat16, "CUDA with bf16 support: bf16 autocast"
        elif hw.device.startswith("cuda"):
            chosen_dtype, reasons["dtype"] = torch.float16, "CUDA without bf16: fp16 autocast + grad scaler"
        else:
            chosen_dtype, reasons["dtype"] = (
                torch.float32,
                (
                    f"{hw.device}: fp32, the safe default (bf16 matmul is fast only on CPUs with AVX512-BF16 "
                    f"or AMX{BF16_HERE if hw.bf16_supported else ''}; "
                    "on 11 seeds of the addition SFT example bf16 autocast reached >= 98.5% on 5, fp32 on 10, "
                    "docs/training.md)"
                ),
            )
    else:
        chosen_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        reasons["dtype"] = "set in config"
    if hw.device == "cpu" and (dtype == "fp16" or (dtype == "bf16" and not hw.bf16_supported)):
        reasons["dtype"] += " (warning: this CPU has no native units for it: far slower than fp32)"

    thread_choice = choose_threads(hw.num_cores, hw.load, local_ranks, threads, wait_setting())
    chosen_threads, reasons["threads"] = thread_choice.threads, thread_choice.reason

    budget_gb = (hw.accel_mem_gb if hw.device != "cpu" else hw.ram_gb) * 0.7
    ckpt_fixed = gradient_checkpointing != "auto"
    ckpt = gradient_checkpointing == "on"
    if micro_batch_size > 0:
        batch, reasons["micro_batch_size"] = micro_batch_size, "set in config"
    else:
        # CPU: small batches keep the step short and the progress visible; GPUs: fill memory.
        cap = 8 if hw.device == "cpu" else 64
        batch = cap
        while batch > 1 and estimate_train_memory_gb(num_params, seq_len, hidden, layers, batch, ckpt) > budget_gb:
            batch //= 2
        reasons["micro_batch_size"] = (
            f"largest power of two <= {cap} fitting 70% of {budget_gb / 0.7:.0f} GB ({hw.tier})"
        )
    if not ckpt_fixed:
        need = estimate_train_memory_gb(num_params, seq_len, hidden, layers, batch, False)
        ckpt = need > budget_gb
        reasons["gradient_checkpointing"] = f"estimated {need:.1f} GB {'>' if ckpt else '<='} budget {budget_gb:.1f} GB"
    else:
        reasons["gradient_checkpointing"] = "set in config"
    return Choices(torch.device(hw.device), chosen_dtype, chosen_threads, batch, ckpt, reasons)


def apply(choices: Choices) -> None:
    """Apply process-wide settings (threads)."""
    import torch

    if choices.device.type == "cpu":
        torch.set_num_threads(choices.threads)


def describe(hw: Hardware) -> str:
    return (
        f"device={hw.device} accelerator={hw.accelerator} cores={hw.num_cores} load={hw.load:.2f} "
        f"ram={hw.ram_gb:.1f}GB accel_mem={hw.accel_mem_gb:.1f}GB bf16={hw.bf16_supported} tier={hw.tier} "
        f"omp_wait={wait_setting() or 'default'}"
    )


def matmul_peak_gflops(dtype=None, size: int = 1024, reps: int = 5, device: str = "cpu") -> float:
    """Measured dense matmul rate of this machine (GFLOP/s), the denominator of MFU (``dtype``: default fp32)."""
    import time

    import torch

    dtype = dtype or torch.float32
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    a @ b  # warm-up
    times = []
    for _ in range(reps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return 2 * size**3 / times[len(times) // 2] / 1e9
