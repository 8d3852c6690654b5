"""Gradient checkpointing: peak memory and step time with and without it, measured here.

Each setting runs in its own subprocess so that the peak resident memory (ru_maxrss) belongs to that
setting alone. Prints median step time, peak memory and the ratios.

    python benchmarks/bench_checkpointing.py [--hidden 256 --layers 8 --seq 512 --batch 8 --steps 4]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def one_setting(args) -> dict:
    import torch

    from lmforge.core.config import ModelConfig, OptimConfig
    from lmforge.model.load import build_tiny
    from lmforge.model.tokenizer import char_tokenizer
    from lmforge.runtime.optim import Precision, build_optimizer, build_scheduler, optimizer_step

    torch.set_num_threads(args.threads)
    cfg = ModelConfig(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=max(args.hidden // 64, 1),
        max_position_embeddings=args.seq + 1,
    )
    model = build_tiny("llama", cfg, char_tokenizer())
    if args.checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    model.train()
    optim_cfg = OptimConfig()
    opt = build_optimizer(model, optim_cfg)
    sched = build_scheduler(opt, optim_cfg, args.steps + 1)
    precision = Precision(torch.device("cpu"), torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.seq))
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    times = []
    for _ in range(args.steps + 1):  # first step is warm-up
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer_step(model, opt, sched, precision, 1.0)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"median_step_s": statistics.median(times[1:]), "peak_rss_gb": peak, "rss_before_gb": base_rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_setting(args)))
        return
    results = {}
    for flag in (False, True):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            *[f"--{k}={getattr(args, k)}" for k in ("hidden", "layers", "seq", "batch", "steps", "threads")],
        ] + (["--checkpointing"] if flag else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[flag] = json.loads(out.stdout.strip().splitlines()[-1])
    off, on = results[False], results[True]
    print(f"model hidden={args.hidden} layers={args.layers}, batch {args.batch} x {args.seq} tokens, fp32 CPU")
    for name, r in (("off", off), ("on", on)):
        print(
            f"checkpointing {name:>3}: median step {r['median_step_s']:.3f} s, peak RSS {r['peak_rss_gb']:.2f} GB "
            f"(before training {r['rss_before_gb']:.2f} GB)"
        )
    act_off = off["peak_rss_gb"] - off["rss_before_gb"]
    act_on = on["peak_rss_gb"] - on["rss_before_gb"]
    print(
        f"ratios (on / off): step time {on['median_step_s'] / off['median_step_s']:.2f}x, "
        f"training memory growth {act_on / act_off:.2f}x"
    )


if __name__ == "__main__":
    main()
