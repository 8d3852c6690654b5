"""Observability: console lines, a progress bar, metrics.jsonl, optional TensorBoard / wandb,
the end-of-run summary and ``lmforge plot``."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from ..core.config import LoggingConfig
from ..core.errors import DataError
from ..core.fileio import text_lines


def _scalar(value):
    if isinstance(value, torch.Tensor):
        return value.detach().float().item()
    return value


def _fmt(key: str, value) -> str:
    if isinstance(value, float):
        if key in ("lr",):
            return f"{key}={value:.2e}"
        return f"{key}={value:.4g}"
    return f"{key}={value}"


def make_console():
    """A rich console that never wraps metric lines (logs stay one line per record)."""
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True)


class RunLogger:
    """Writes every metric record to ``metrics.jsonl`` and echoes a compact line to the console."""

    CONSOLE_KEYS = ("loss", "val_loss", "accuracy", "reward", "lr", "grad_norm", "tokens_per_s", "step_time")

    def __init__(self, run_dir: Path, cfg: LoggingConfig, total_steps: int, console=None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.console = console or make_console()
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self.logging = cfg
        self.total_steps = total_steps
        self.tb = self._tensorboard() if cfg.tensorboard else None
        self.wandb = self._wandb() if cfg.wandb else None
        self.progress = None
        self.task = None

    def _tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError("logging.tensorboard=true needs tensorboard: pip install tensorboard") from exc
        return SummaryWriter(str(self.run_dir / "tb"))

    def _wandb(self):
        try:
            import wandb
        except ImportError as exc:
            raise ImportError("logging.wandb=true needs wandb: pip install wandb") from exc
        return wandb.init(project=self.logging.wandb_project, dir=str(self.run_dir))

    def start_progress(self, description: str, completed: int = 0) -> None:
        if not self.logging.progress:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
        )
        self.progress.start()
        self.task = self.progress.add_task(description, total=self.total_steps, completed=completed)

    def advance(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def print(self, text: str) -> None:
        self.console.print(text, markup=False)

    def log(self, step: int, metrics: dict, echo: bool = True, kind: str = "train") -> None:
        record = {"step": step, "kind": kind, "time": time.time()}
        record.update({k: _scalar(v) for k, v in metrics.items()})
        self.jsonl.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if isinstance(value, (int, float)) and key not in ("step", "time"):
                if self.tb is not None:
                    self.tb.add_scalar(f"{kind}/{key}", value, step)
        if self.wandb is not None:
            self.wandb.log({f"{kind}/{k}": v for k, v in record.items() if isinstance(v, (int, float))}, step=step)
        if echo:
            shown = [_fmt(k, record[k]) for k in self.CONSOLE_KEYS if k in record]
            shown += [
                _fmt(k, v)
                for k, v in record.items()
                if k not in self.CONSOLE_KEYS
                and k not in ("step", "kind", "time")
                and kind != "train"
                and isinstance(v, (int, float))
            ]
            self.print(f"[{kind} {step:>5}/{self.total_steps}] " + " ".join(shown))

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


class StepTimer:
    """Collects per-step wall time, data time, tokens and (where the recipe counts them) the matmul
    FLOPs the step executed, for the end-of-run summary."""

    def __init__(self):
        self.start = time.perf_counter()
        self.step_times: list[float] = []
        self.data_times: list[float] = []
        self.tokens = 0
        self.flops = 0.0
        self.train_time = 0.0

    def record(self, step_time: float, data_time: float, tokens: int, flops: float = 0.0) -> None:
        self.step_times.append(step_time)
        self.data_times.append(data_time)
        self.tokens += tokens
        self.flops += flops
        self.train_time += step_time

    def state_dict(self) -> dict:
        """What a checkpoint keeps, so that a resumed run's summary covers the whole run."""
        return {
            "step_times": list(self.step_times),
            "data_times": list(self.data_times),
            "tokens": self.tokens,
            "flops": self.flops,
            "train_time": self.train_time,
            "elapsed": time.perf_counter() - self.start,
        }

    def load_state_dict(self, state: dict) -> None:
        self.step_times, self.data_times = list(state["step_times"]), list(state["data_times"])
        self.tokens, self.flops, self.train_time = state["tokens"], state["flops"], state["train_time"]
        self.start = time.perf_counter() - state["elapsed"]


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the records of steps <= ``step`` (a resumed run logs the later ones again; a fresh run
    keeps nothing), dropping a partial last line left by a crash."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step and step > 0:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    except ImportError:
        return 0.0


def summary(timer: StepTimer, flops_per_token: float, peak_gflops: float, device: torch.device) -> dict:
    """End-of-run figures: total time, median step, data time, tokens/s, MFU, peak memory.

    The FLOPs are the ones the steps recorded (RL: what sampling and training executed), else the
    usual model-FLOPs convention, ``flops_per_token`` (6N) x tokens.
    """
    tokens_per_s = timer.tokens / timer.train_time if timer.train_time else 0.0
    flops = timer.flops or timer.tokens * flops_per_token
    achieved = flops / timer.train_time / 1e9 if timer.train_time else 0.0
    return {
        "total_time_s": time.perf_counter() - timer.start,
        "steps": len(timer.step_times),
        "median_step_s": statistics.median(timer.step_times) if timer.step_times else 0.0,
        "data_time_s": sum(timer.data_times),
        "tokens_per_s": tokens_per_s,
        "achieved_gflops": achieved,
        "peak_gflops": peak_gflops,
        "mfu": achieved / peak_gflops if peak_gflops else 0.0,
        "peak_memory_gb": peak_memory_gb(device),
    }


def print_summary(logger: RunLogger, figures: dict) -> None:
    logger.print(
        "[summary] time {total_time_s:.1f}s | steps {steps} | median step {median_step_s:.3f}s | "
        "data {data_time_s:.2f}s | {tokens_per_s:.0f} tok/s | {achieved_gflops:.1f} GFLOP/s of "
        "{peak_gflops:.0f} measured peak (MFU {mfu:.1%}) | peak mem {peak_memory_gb:.2f} GB".format(**figures)
    )
    (logger.run_dir / "summary.json").write_text(json.dumps(figures, indent=2))


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl``. A last line cut short (a killed run) is left out with a
    note; any other line that is not a JSON object is a DataError naming ``file:line``."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}: is it an lmforge run directory?")
    lines = [(number, line) for number, line in text_lines(path, "metrics log") if line.strip()]
    records = []
    for number, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == lines[-1][0] and not line.endswith("\n"):
                print(f"[lmforge] {path}:{number}: leaving out the last line, cut short ({err.msg})")
                continue
            raise DataError(f"{path}:{number}: invalid JSON ({err.msg}); each line must be one record") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


PLOT_KEYS = ("loss", "val_loss", "lr", "accuracy", "pass_at_k", "eval_reward", "reward", "grad_norm")
# An RL run's loss panel: near 0 by construction, which reads like a bug without a word.
RL_LOSS_NOTE = (
    "RL: the policy loss is ~0 by construction (advantages are centred per group and the ratio is 1 "
    "on-policy);\nits gradient is not. Follow reward and accuracy."
)


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """PNG of loss / lr / accuracy / reward curves from ``metrics.jsonl``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    keys = [k for k in PLOT_KEYS if any(k in r for r in records)]
    if not keys:
        raise DataError(f"{run_dir}/metrics.jsonl has none of {PLOT_KEYS} to plot")
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        for kind in sorted({r.get("kind", "train") for r in records if key in r}):
            points = [(r["step"], r[key]) for r in records if key in r and r.get("kind", "train") == kind]
            ax.plot(*zip(*points), marker="." if len(points) < 30 else None, label=kind)
        ax.set_ylabel(key)
        ax.legend(loc="best", fontsize=7)
        ax.grid(alpha=0.3)
        if key == "loss" and "reward" in keys:
            ax.set_title(RL_LOSS_NOTE, fontsize=7, loc="left")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
