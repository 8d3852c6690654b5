"""LoRA against full fine-tuning for GRPO on SmolLM2-135M-Instruct: peak memory and step time, side by
side, plus the cost of syncing the bf16 sampler copy (merged weights) once per step.

Each configuration runs ``lmforge grpo`` in its own fresh Python process (so that peak resident memory,
``resource.getrusage(RUSAGE_SELF).ru_maxrss``, is that configuration's alone), with the settings of
``examples/grpo_smollm2.yaml`` (arith_chat, DAPO, groups of 8 samples of <= 8 tokens, fp32) but
``--num-prompts`` prompts per step (default 2, the workload of bench_grpo.py; the example has 8), a
few steps, a small held-out set and no periodic checkpoints. By default the two processes run at the
same time (``--sequential``: one after the other), so that on a machine shared with other work both
see the same load; ``--repeats`` times. Step time is the median of the steps after the first.

Memory of full fine-tuning: weights + gradients + two AdamW moments, ~4 x 135M x 4 bytes = 2.2 GB
on top of activations. LoRA (r=8, all linear layers but the LM head): 2.4M adapter parameters, so
gradients and optimizer state are ~30 MB; the frozen weights still need their 540 MB.

The sync figure: ``CastEngine.sync_weights`` (the bf16 sampler copy, rollout.dtype=bf16) for the
plain model (a cast-copy of every weight) and for the LoRA model (W + scale * B A computed per
adapted matrix, then cast-copied), median of ``--sync-repeats`` calls in this process.

    python benchmarks/bench_lora.py                    # 3 GRPO steps of 2 prompts x 8 per configuration
    python benchmarks/bench_lora.py --num-prompts 8 --steps 6 --sequential
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GRPO = [
    "model.name=smollm2-135m-instruct",
    "data.task=arith_chat",
    "data.num_train=400",
    "data.num_eval=8",
    "rollout.group_size=8",
    "rollout.max_new_tokens=8",
    "rewards.functions=[exact]",
    "algo.preset=dapo",
    "optim.schedule=constant",
    "optim.weight_decay=0.0",
    "train.micro_batch_size=8",
    "train.eval_every=0",
    "train.save_every=0",
    "train.max_new_tokens=8",
    "train.num_samples=0",
    "train.dtype=fp32",
    "train.gradient_checkpointing='off'",
    "logging.progress=false",
]
CONFIGS = {
    "full": ["optim.lr=1e-5"],
    "lora": ["optim.lr=2e-4", "model.lora.r=8", "model.lora.alpha=16"],
}


def child(name: str, steps: int, threads: int, num_prompts: int, out: str) -> None:
    """One GRPO run in this process; prints a JSON line with its step times and peak RSS."""
    from lmforge.core.config import load_config
    from lmforge.recipes.grpo import GRPOConfig, run_grpo

    args = (
        GRPO
        + CONFIGS[name]
        + [
            f"train.max_steps={steps}",
            f"train.threads={threads}",
            f"train.output_dir={out}",
            f"rollout.num_prompts={num_prompts}",
        ]
    )
    run_grpo(load_config(GRPOConfig, None, args))
    rows = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time"] for r in rows if r["kind"] == "train"]
    maxrss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kB
    print("RESULT " + json.dumps({"config": name, "step_times": times, "maxrss_mb": maxrss_mb}), flush=True)


def sync_cost(repeats: int, threads: int) -> dict:
    """Median seconds of one bf16 sampler-copy sync: plain model vs LoRA model (merged weights)."""
    import torch

    from lmforge.core.config import LoraConfig, ModelConfig
    from lmforge.model import lora
    from lmforge.model.load import load_model
    from lmforge.rollout import CastEngine

    torch.set_num_threads(threads)
    model, _ = load_model(ModelConfig(name="smollm2-135m-instruct"))
    out = {}
    for name in ("plain", "lora"):
        if name == "lora":
            lora.apply_lora(model, LoraConfig(r=8, alpha=16))
        engine = CastEngine(model, torch.bfloat16)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            engine.sync_weights(model)
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
        del engine
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--sequential", action="store_true", help="run the configurations one after the other")
    parser.add_argument("--sync-repeats", type=int, default=5)
    parser.add_argument("--child", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.threads, args.num_prompts, args.out)
        return
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            procs = []
            for name in CONFIGS:
                cmd = [
                    sys.executable,
                    __file__,
                    "--child",
                    name,
                    "--steps",
                    str(args.steps),
                    "--threads",
                    str(args.threads),
                    "--num-prompts",
                    str(args.num_prompts),
                    "--out",
                    os.path.join(tmp, f"{name}-{repeat}"),
                ]
                procs.append((name, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
                if args.sequential:
                    procs[-1] = (name, procs[-1][1], procs[-1][1].communicate())
            for entry in procs:
                name, proc = entry[0], entry[1]
                stdout, stderr = entry[2] if len(entry) == 3 else proc.communicate()
                line = next((text for text in stdout.splitlines() if text.startswith("RESULT ")), None)
                if proc.returncode or line is None:
                    sys.exit(f"{name} run failed:\n{stderr[-3000:]}")
                results[name].append(json.loads(line[len("RESULT ") :]))
    print(
        f"GRPO on SmolLM2-135M-Instruct, fp32, CPU ({args.threads} thread(s) per process, "
        f"{'one after the other' if args.sequential else 'both at the same time'}), {args.num_prompts} prompts x 8 "
        f"samples, <= 8 new tokens, {args.steps} steps per run, {args.repeats} run(s) per configuration, "
        f"{time.perf_counter() - start:.0f} s"
    )
    print(f"{'config':<6} {'peak RSS (MB)':>14} {'median step (s)':>16}  step times (s)")
    summary = {}
    for name, runs in results.items():
        rss = max(r["maxrss_mb"] for r in runs)
        later = [t for r in runs for t in r["step_times"][1:]] or [t for r in runs for t in r["step_times"]]
        summary[name] = (rss, statistics.median(later))
        print(
            f"{name:<6} {rss:>14.0f} {summary[name][1]:>16.2f}  "
            + " | ".join(", ".join(f"{t:.2f}" for t in r["step_times"]) for r in runs)
        )
    print(
        f"LoRA / full: peak RSS {summary['lora'][0] / summary['full'][0]:.2f}x, "
        f"step time {summary['lora'][1] / summary['full'][1]:.2f}x"
    )
    sync = sync_cost(args.sync_repeats, args.threads)
    print(
        f"bf16 sampler-copy sync (CastEngine.sync_weights), median of {args.sync_repeats}: plain "
        f"{sync['plain']:.3f} s, "
        f"LoRA r=8 merged {sync['lora']:.3f} s"
    )


if __name__ == "__main__":
    main()
