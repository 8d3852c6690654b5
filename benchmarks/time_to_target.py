"""Time to a held-out accuracy from lmforge run directories: a table per run and the median per setting.

Reads each run's metrics.jsonl: the training seconds (the sum of ``step_time`` up to a step; evaluations
excluded) and the held-out ``accuracy`` at each evaluation. A run directory's setting is its name without
the trailing ``-<seed>`` part, or what ``--label`` maps it to. Used for issue 38 item 3 (the bf16 sampler
on the shipped GRPO examples, docs/rl-recipes.md):

    python benchmarks/time_to_target.py /tmp/bf16/sm-*-same /tmp/bf16/sm-*-bf16 --target 0.8 0.9
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path


def read(run: Path) -> dict:
    """{'evals': [(step, accuracy, training seconds)], 'seconds': total, 'generation': total, 'steps': n}."""
    seconds, generation, steps, evals = {0: 0.0}, 0.0, 0, []
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    total = 0.0
    for r in records:
        if r.get("kind") == "train":
            total += r["step_time"]
            generation += r.get("time_generation", 0.0)
            seconds[r["step"]], steps = total, max(steps, r["step"])
    for r in records:
        if r.get("kind") == "eval" and "accuracy" in r:
            evals.append((r["step"], r["accuracy"], seconds.get(r["step"], float("nan"))))
    return {"evals": sorted(evals), "seconds": total, "generation": generation, "steps": steps}


def reached(run: dict, target: float) -> tuple[float, int] | None:
    return next(((s, step) for step, acc, s in run["evals"] if acc >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--target", type=float, nargs="+", default=[0.8])
    args = parser.parse_args()
    runs = {path: read(path) for path in args.runs}
    steps = sorted({e[0] for r in runs.values() for e in r["evals"]})
    print(
        "| run | "
        + " | ".join(f"step {s}" for s in steps)
        + " | s/step | sampling s/step | "
        + " | ".join(f"time to {t:.0%}" for t in args.target)
        + " |"
    )
    print("|" + "---|" * (len(steps) + 3 + len(args.target)))
    by_setting: dict[str, list[dict]] = {}
    for path, run in runs.items():
        by_setting.setdefault(re.sub(r"-\d+(?=-|$)", "", path.name), []).append(run)
        accuracy = {step: acc for step, acc, _ in run["evals"]}
        cells = [f"{accuracy[s]:.0%}" if s in accuracy else "" for s in steps]
        times = []
        for t in args.target:
            hit = reached(run, t)
            times.append(f"{hit[0]:.0f} s (step {hit[1]})" if hit else "not reached")
        print(
            f"| {path.name} | " + " | ".join(cells) + f" | {run['seconds'] / max(run['steps'], 1):.2f} | "
            f"{run['generation'] / max(run['steps'], 1):.2f} | " + " | ".join(times) + " |"
        )
    for setting, group in by_setting.items():
        parts = []
        for t in args.target:
            hits = [reached(r, t) for r in group]
            done = [h[0] for h in hits if h]
            parts.append(
                f"{t:.0%}: {len(done)} of {len(group)} reached"
                + (f", median {statistics.median(done):.0f} s" if done else "")
            )
        print(
            f"[{setting}] {len(group)} runs; " + "; ".join(parts) + "; median s/step "
            f"{statistics.median(r['seconds'] / max(r['steps'], 1) for r in group):.2f}"
        )


if __name__ == "__main__":
    main()
