"""Data parallelism on one CPU: 1 rank x T threads against T gloo ranks x 1 thread, same global batch.

Workload: ``lmforge pretrain`` of a random tiny Llama (hidden 512, 4 layers, char vocabulary) on
packed blocks of synthetic text, fp32, global batch 16 x 256 tokens per optimizer step, no
accumulation (1 rank: micro-batch 16; T ranks: micro-batch 16 / T each). Both contestants run the
same recipe through ``torchrun`` with ``train.threads`` fixed, alternating run by run so that they
share whatever load the machine carries. The figure is tokens/s at the median step time of each
run's ``summary.json`` (rank 0's wall time per step, which includes the gradient all-reduce; the
median is not moved by the slower first step), then the median over the repeats.

Target (issue: "the gradient synchronisation is nearly free"): T ranks reach at least 90% of the
1-rank throughput.

    python benchmarks/bench_ddp.py                  # 2 ranks vs 1 rank x 2 threads, 3 repeats
    python benchmarks/bench_ddp.py --repeats 5 --steps 30 --strategy fsdp2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from lmforge.parallel.context import free_port


def corpus(path: Path, num_chars: int = 2_000_000) -> Path:
    rng = random.Random(0)
    lines = []
    while sum(map(len, lines)) < num_chars:
        a, b = rng.randrange(10**6), rng.randrange(10**6)
        lines.append(f"{a}+{b}={a + b} {a}*{b % 97}={a * (b % 97)}\n")
    path.write_text("".join(lines))
    return path


def one_run(out: Path, text: Path, ranks: int, threads: int, args) -> dict:
    batch = args.batch
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        f"--master_port={free_port()}",
        "-m",
        "lmforge",
        "pretrain",
        "model.name=tiny:llama",
        "model.tokenizer=char",
        f"model.hidden_size={args.hidden}",
        f"model.num_layers={args.layers}",
        "model.num_heads=8",
        "model.max_position_embeddings=512",
        f"data.files=[{text}]",
        "data.seq_len=256",
        "data.cache=false",
        f"train.batch_size={batch}",
        f"train.micro_batch_size={batch // ranks}",
        f"train.max_steps={args.steps}",
        f"train.threads={threads}",
        "train.dtype=fp32",
        "train.gradient_checkpointing='off'",
        "train.eval_every=0",
        "train.save_every=0",
        "train.num_samples=0",
        "logging.progress=false",
        f"parallel.strategy={args.strategy}",
        f"train.output_dir={out}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({ranks} ranks):\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    tokens_per_step = batch * 256
    return {"median_step_s": summary["median_step_s"], "tokens_per_s": tokens_per_step / summary["median_step_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--ranks", type=int, default=2, help="T: ranks of the parallel contestant = threads of the other"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run (median step time)")
    parser.add_argument("--batch", type=int, default=16, help="global batch (rows of 256 tokens)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp2"])
    args = parser.parse_args()
    if args.batch % args.ranks:
        parser.error("--batch must be divisible by --ranks")
    results: dict[str, list[dict]] = {"1 rank": [], f"{args.ranks} ranks": []}
    with tempfile.TemporaryDirectory() as tmp:
        text = corpus(Path(tmp) / "corpus.txt")
        for repeat in range(args.repeats):
            order = [(1, args.ranks), (args.ranks, 1)]
            for ranks, threads in order if repeat % 2 == 0 else order[::-1]:
                name = "1 rank" if ranks == 1 else f"{args.ranks} ranks"
                result = one_run(Path(tmp) / f"run-{repeat}-{ranks}", text, ranks, threads, args)
                results[name].append(result)
                print(
                    f"[bench] repeat {repeat}: {name} x {threads} thread(s): median step "
                    f"{result['median_step_s']:.3f} s, {result['tokens_per_s']:.0f} tok/s",
                    flush=True,
                )
    medians = {name: statistics.median(r["tokens_per_s"] for r in runs) for name, runs in results.items()}
    single, multi = medians["1 rank"], medians[f"{args.ranks} ranks"]
    print(
        f"\n{args.strategy}: {args.ranks} ranks x 1 thread: {multi:.0f} tok/s; 1 rank x {args.ranks} threads: "
        f"{single:.0f} tok/s (medians of {args.repeats})"
    )
    print(f"RESULT ratio={multi / single:.3f} target>=0.90 {'met' if multi / single >= 0.9 else 'NOT met'}")


if __name__ == "__main__":
    main()
