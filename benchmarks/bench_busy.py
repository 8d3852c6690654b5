"""Step times of lmforge's recipes on a quiet machine and under a standard background load, for each
torch-thread / OpenMP wait-policy setting, printed with their ratios from one run (issue 38, item 1).

    python benchmarks/bench_busy.py                          # sft and grpo, quiet and busy, every setting
    python benchmarks/bench_busy.py --recipes sft --rounds 2 --hogs-per-core 1
    python benchmarks/bench_busy.py --quickstart "sft_steps=150 grpo_steps=30 num_eval=50"

The background load ("busy"): ``--hogs-per-core`` x cores processes that each spin in pure Python (a
CPU-bound job each, as a build or another training run would be), started before the busy block and
stopped after it; the block waits until the 1-minute load average has risen to the hogs' count (at most
``--settle`` seconds), as it would be on a machine that has been busy for a while.

Each (recipe, load, setting) is a fresh ``lmforge <recipe> ... train.max_steps=N`` process: the OpenMP
wait policy is read once, when torch loads its OpenMP runtime. Its median step time (steps after the first
``--warmup``) comes from the run's metrics.jsonl. Settings:
  t<N>          train.threads=N, OpenMP's default wait policy (spin a while, then sleep; written out as
                GOMP_SPINCOUNT=300000, else lmforge would set PASSIVE itself on a busy machine)
  t<N>-passive  train.threads=N, OMP_WAIT_POLICY=PASSIVE (a waiting thread sleeps at once)
  auto          neither set: what lmforge chooses itself (lmforge.runtime.hardware.choose_threads)
with N = 1, 2 and the core count. ``--rounds`` > 1 repeats every setting, in reverse order every other
round, and takes the median: the machine's own load drifts while the benchmark runs.

The recipes: sft = examples/sft_addition.yaml (a tiny char-level Llama, 32 rows per step); grpo =
examples/grpo_addition.yaml on the same tiny model, freshly initialised (8 prompts x 8 samples of 6 tokens;
algo.skip_zero_advantage=false, so each step trains on all 64 rows although the rewards are 0).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "sft": [
        "sft",
        "examples/sft_addition.yaml",
        "train.eval_every=0",
        "train.save_every=0",
        "train.num_samples=0",
        "data.num_val=8",
        "data.num_eval=0",
    ],
    "grpo": [
        "grpo",
        "examples/grpo_addition.yaml",
        "model.name=tiny:llama",
        "model.tokenizer=char",
        "model.max_position_embeddings=64",
        "algo.skip_zero_advantage=false",
        "train.eval_every=0",
        "train.save_every=0",
        "train.num_samples=0",
        "data.num_eval=0",
    ],
}
HOG = "while True:\n    pass\n"
WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
# OpenMP's default wait policy, written out: libgomp's own spin count when OMP_WAIT_POLICY is unset (its
# manual, GOMP_SPINCOUNT). Set, it keeps lmforge from choosing PASSIVE by itself on a busy machine.
DEFAULT_WAIT = {"GOMP_SPINCOUNT": "300000"}


def loadavg() -> str:
    with open("/proc/loadavg") as handle:
        return " ".join(handle.read().split()[:3])


def default_settings(cores: int) -> list[str]:
    return [f"t{n}{wait}" for n in sorted({1, min(2, cores), cores}) for wait in ("", "-passive")] + ["auto"]


def setting(name: str) -> tuple[int, dict[str, str]]:
    """``auto``, ``t<N>``, ``t<N>-passive``, ``t<N>-unset`` (no wait variable written: on a quiet machine
    exactly what a user got before lmforge chose its threads) or ``t<N>-spin<K>`` (GOMP_SPINCOUNT=K: spin K
    rounds, then sleep) -> (train.threads, 0 = lmforge's choice; environment settings)."""
    if name == "auto":
        return 0, {}
    threads, _, wait = name[1:].partition("-")
    if (
        not name.startswith("t")
        or not threads.isdigit()
        or not (wait in ("", "passive", "unset") or wait.startswith("spin"))
    ):
        raise SystemExit(f"--settings: {name!r} is not auto, t<N>, t<N>-passive, t<N>-unset or t<N>-spin<K>")
    if wait == "unset":  # nothing written: on a busy machine lmforge then sets PASSIVE itself
        return int(threads), {}
    env = (
        {"OMP_WAIT_POLICY": "PASSIVE"} if wait == "passive" else {"GOMP_SPINCOUNT": wait[4:]} if wait else DEFAULT_WAIT
    )
    return int(threads), env


def run_recipe(recipe: str, steps: int, warmup: int, threads: int, env_extra: dict[str, str], budget: float) -> dict:
    """One fresh lmforge process; its median step time after the warm-up and its wall time. A run still
    going ``budget`` seconds after its first step is stopped with SIGINT (its metrics so far are kept):
    under load the worst settings take many seconds per step (and the start, imports, a minute)."""
    with tempfile.TemporaryDirectory(prefix="bench_busy_") as tmp:
        argv = [
            sys.executable,
            "-m",
            "lmforge.cli",
            *RECIPES[recipe],
            f"train.max_steps={steps}",
            f"train.output_dir={tmp}/run",
            "logging.progress=false",
        ]
        if threads:
            argv.append(f"train.threads={threads}")
        env = {k: v for k, v in os.environ.items() if k not in WAIT_KEYS}
        env.update(env_extra, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
        metrics = Path(tmp, "run", "metrics.jsonl")
        start = time.perf_counter()
        with open(Path(tmp, "out"), "w+") as out_file, open(Path(tmp, "err"), "w+") as err_file:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out_file, stderr=err_file, text=True)
            first_step = None
            while proc.poll() is None:
                time.sleep(1)
                if first_step is None and metrics.is_file() and metrics.stat().st_size:
                    first_step = time.perf_counter()
                if first_step is not None and time.perf_counter() - first_step > budget:
                    proc.send_signal(signal.SIGINT)
                    proc.wait()
            wall = time.perf_counter() - start
            out, err = Path(tmp, "out").read_text(), Path(tmp, "err").read_text()
        if proc.returncode not in (0, 130) or not metrics.is_file():
            raise RuntimeError(f"{' '.join(argv[3:])} failed ({proc.returncode}):\n{err[-2000:]}")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    times = [r["step_time"] for r in records if r.get("kind") == "train" and "step_time" in r]
    if len(times) < 2:
        raise RuntimeError(f"{recipe}: {len(times)} step(s) in {budget:.0f} s; raise --budget")
    chosen = next((line for line in out.splitlines() if line.startswith("[hardware] threads")), "")
    kept = times[warmup:] if len(times) > warmup else times[1:]  # a stopped run: all but the first step
    return {
        "median": statistics.median(kept),
        "steps": times,
        "wall": wall,
        "chosen": chosen,
        "stopped": proc.returncode == 130,
    }


def run_quickstart(args) -> dict:
    """``lmforge quickstart`` (small) with lmforge's own choice: wall time and each stage's median step."""
    with tempfile.TemporaryDirectory(prefix="bench_busy_") as tmp:
        argv = [
            sys.executable,
            "-m",
            "lmforge.cli",
            "quickstart",
            f"output_dir={tmp}/qs",
            "progress=false",
            *args.quickstart.split(),
        ]
        env = {k: v for k, v in os.environ.items() if k not in WAIT_KEYS}
        start = time.perf_counter()
        proc = subprocess.run(argv, cwd=ROOT, env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"quickstart failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        stages = {}
        for stage in ("sft", "grpo"):
            lines = Path(tmp, "qs", stage, "metrics.jsonl").read_text().splitlines()
            times = [r["step_time"] for r in map(json.loads, lines) if r.get("kind") == "train" and "step_time" in r]
            stages[stage] = statistics.median(times[args.warmup :])
    chosen = next((line for line in proc.stdout.splitlines() if line.startswith("[hardware] threads")), "")
    return {"wall": wall, "stages": stages, "chosen": chosen, "loadavg": loadavg()}


class Hogs:
    """``count`` spinning Python processes, stopped on exit (also when the benchmark fails)."""

    def __init__(self, count: int):
        self.count = count
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Hogs":
        self.procs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(self.count)]
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()

    def settle(self, seconds: float) -> None:
        """Wait until the 1-minute load average counts the hogs (or ``seconds`` pass)."""
        wait_for_load(lambda load: load >= self.count, seconds)


def wait_for_quiet(below: float, seconds: float) -> None:
    """Wait until the 1-minute load average is under ``below`` (at most ``seconds``): the previous run's
    own work stays in the average for a minute, and lmforge reads it when it chooses its threads."""
    wait_for_load(lambda load: load < below, seconds)


def wait_for_load(reached: Callable[[float], bool], seconds: float) -> None:
    """Poll the 1-minute load average every 2 s until ``reached(load)`` or ``seconds`` have passed."""
    end = time.time() + seconds
    while time.time() < end and not reached(os.getloadavg()[0]):
        time.sleep(2)


def measure(args, load: str, table: dict) -> dict[str, dict[str, dict]]:
    """{recipe: {setting: result}} for one load, settings interleaved over ``args.rounds`` rounds."""
    results: dict[str, dict[str, list]] = {r: {s: [] for s in table} for r in args.recipes}
    names = list(table)
    for round_index in range(args.rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for recipe in args.recipes:
            for name in order:
                threads, env = table[name]
                if load == "quiet" and args.quiet_below:
                    wait_for_quiet(args.quiet_below, args.settle)
                at_start = loadavg()
                result = run_recipe(recipe, args.steps[recipe], args.warmup, threads, env, args.budget)
                result["loadavg"] = loadavg()
                results[recipe][name].append(result)
                stopped = f", stopped after {len(result['steps'])} steps" if result["stopped"] else ""
                print(
                    f"  {load:<5} {recipe:<5} {name:<13} median step {result['median']:.3f} s  "
                    f"(wall {result['wall']:.0f} s{stopped}, load {at_start} -> {result['loadavg']})  "
                    f"{result['chosen']}",
                    flush=True,
                )
    return {
        recipe: {
            name: {"median": statistics.median(r["median"] for r in runs), "runs": runs}
            for name, runs in by_setting.items()
        }
        for recipe, by_setting in results.items()
    }


def report(found: dict, table: dict) -> list[str]:
    lines = []
    for recipe in next(iter(found.values())):
        lines.append(f"\n{recipe}: median step time (s), ratio to the best setting of the same load")
        lines.append(f"  {'setting':<12}" + "".join(f"{load:>22}" for load in found))
        best = {load: min(v["median"] for v in found[load][recipe].values()) for load in found}
        for name in table:
            cells = "".join(
                f"{found[load][recipe][name]['median']:>13.3f} "
                f"({found[load][recipe][name]['median'] / best[load]:4.2f}x)"
                for load in found
            )
            lines.append(f"  {name:<12}{cells}")
        if "quiet" in found and "busy" in found:
            default = f"t{len(os.sched_getaffinity(0))}"
            if "auto" not in table or default not in table:
                continue
            lines.append(
                f"  auto busy / best busy: {found['busy'][recipe]['auto']['median'] / best['busy']:.2f}x "
                f"(target <= 1.5x); auto quiet / {default} quiet (today's default): "
                f"{found['quiet'][recipe]['auto']['median'] / found['quiet'][recipe][default]['median']:.2f}x "
                "(target <= 1.03x)"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default="sft,grpo", help="comma-separated: sft, grpo")
    parser.add_argument("--loads", default="quiet,busy", help="comma-separated: quiet, busy")
    parser.add_argument(
        "--settings",
        default="",
        help="comma-separated: auto, t<N>, t<N>-passive, t<N>-unset, t<N>-spin<K> "
        "(default: auto and t<N>, t<N>-passive for N = 1, 2, cores)",
    )
    parser.add_argument("--sft-steps", type=int, default=20)
    parser.add_argument("--grpo-steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out of the median")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--hogs-per-core", type=int, default=2)
    parser.add_argument("--settle", type=float, default=60.0, help="longest wait for the load average (s)")
    parser.add_argument(
        "--budget",
        type=float,
        default=90.0,
        help="a run still going this many seconds after its "
        "first step is stopped (SIGINT) and its steps so far are used",
    )
    parser.add_argument(
        "--quiet-below",
        type=float,
        default=0.0,
        help="quiet runs start once the 1-minute load average is under this (at most --settle s each; "
        "0: at once). On a quiet machine the previous run's own load otherwise decides auto's choice",
    )
    parser.add_argument("--json", default="", help="also write every step time here")
    parser.add_argument(
        "--quickstart",
        default="",
        help="instead: time `lmforge quickstart` with these key=value "
        "settings (e.g. 'sft_steps=150 grpo_steps=30 num_eval=50'), lmforge's own choice, per load",
    )
    args = parser.parse_args()
    args.recipes = args.recipes.split(",")
    args.steps = {"sft": args.sft_steps, "grpo": args.grpo_steps}
    cores = len(os.sched_getaffinity(0))
    table = {name: setting(name) for name in (args.settings.split(",") if args.settings else default_settings(cores))}
    print(
        f"bench_busy: {cores} cores, load average {loadavg()} at start; busy = {args.hogs_per_core * cores} "
        f"spinning processes; settings {', '.join(table)}",
        flush=True,
    )
    if args.quickstart:
        walls = {}
        for load in args.loads.split(","):
            with Hogs(args.hogs_per_core * cores if load == "busy" else 0) as hogs:
                hogs.settle(args.settle)
                result = walls[load] = run_quickstart(args)
            print(
                f"  {load:<5} quickstart {args.quickstart}: {result['wall']:.0f} s (median step: sft "
                f"{result['stages']['sft']:.3f} s, grpo {result['stages']['grpo']:.3f} s; load {result['loadavg']})  "
                f"{result['chosen']}",
                flush=True,
            )
        if len(walls) == 2:
            print(f"quickstart busy / quiet: {walls['busy']['wall'] / walls['quiet']['wall']:.2f}x (target <= 3x)")
        return
    found = {}
    for load in args.loads.split(","):
        if load == "busy":
            with Hogs(args.hogs_per_core * cores) as hogs:
                hogs.settle(args.settle)
                print(f"busy block: load average {loadavg()}", flush=True)
                found[load] = measure(args, load, table)
        else:
            found[load] = measure(args, load, table)
    print("\n".join(report(found, table)))
    print(f"load average at the end: {loadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
