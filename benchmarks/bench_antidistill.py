"""Cost of antidistillation sampling: decode throughput with and without the ADS term, side by side.

Same teacher, same proxy, same prompts, same number of tokens (no stop tokens, so every row decodes
exactly --new-tokens tokens), temperature 1, no top-k/top-p, fp32. Each repetition runs every
contestant once, in alternating order, so that load from other processes hits them alike; the
script prints medians and compares the measured ratio with two predictions:

    FLOPs:         cost(ADS) / cost(plain) ~ 1 + 2 * F_proxy / F_teacher
                   (F = forward FLOPs per token = 2 x the parameters that do matmuls: everything but the
                   input-embedding lookup; a tied LM head counts)
    measured time: 1 + 2 * t_proxy / t_teacher, with t the plain decode time of each model alone
                   (includes per-call overheads that FLOPs ignore; they dominate for tiny models)

Contestants:
    plain   rollout.generate(teacher)                    temperature sampling
    ads     antidistill.ads.ads_generate(teacher, +, -)      teacher and two perturbed proxies in lockstep
    proxy   rollout.generate(proxy)                      only to measure t_proxy for the second prediction

    python benchmarks/bench_antidistill.py                               # random Llamas: 35M teacher, 4.7M proxy
    python benchmarks/bench_antidistill.py --teacher smollm2 --proxy truncate:6   # SmolLM2-135M, its first 6 layers
    python benchmarks/bench_antidistill.py --teacher DIR --proxy DIR     # any two HF dirs with one tokenizer
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from lmforge.antidistill.ads import ads_generate, perturbed_copies
from lmforge.rollout import SamplingParams, generate


def random_llama(vocab: int, hidden: int, layers: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).eval()


def load_teacher(args):
    from transformers import AutoModelForCausalLM

    if args.teacher == "random":
        return random_llama(args.vocab, args.teacher_hidden, args.teacher_layers, seed=0)
    spec = args.teacher
    if spec == "smollm2":
        from lmforge.model.load import resolve_pretrained

        spec = resolve_pretrained("smollm2-135m-instruct")  # cached safetensors copy after the first run
    return AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32).eval()


def load_proxy(args, teacher):
    from transformers import AutoModelForCausalLM

    vocab = teacher.get_input_embeddings().num_embeddings
    if args.proxy == "random":
        return random_llama(vocab, args.proxy_hidden, args.proxy_layers, seed=1)
    if args.proxy.startswith("truncate:"):  # the teacher's first K layers: a same-tokenizer proxy for free
        proxy = copy.deepcopy(teacher)
        keep = int(args.proxy.split(":", 1)[1])
        proxy.model.layers = proxy.model.layers[:keep]
        proxy.config.num_hidden_layers = keep
        if hasattr(proxy.config, "layer_types") and proxy.config.layer_types:
            proxy.config.layer_types = proxy.config.layer_types[:keep]
        return proxy
    return AutoModelForCausalLM.from_pretrained(args.proxy, dtype=torch.float32).eval()


def forward_flops_per_token(model) -> float:
    """2 x parameters doing matmuls: all but the input-embedding lookup (a tied LM head counts)."""
    params = sum(p.numel() for p in model.parameters())
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return 2.0 * (params if tied else params - model.get_input_embeddings().weight.numel())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", default="random", help="'random' (sizes below), 'smollm2', or an HF dir")
    parser.add_argument("--proxy", default="random", help="'random' (sizes below), 'truncate:K', or an HF dir")
    parser.add_argument("--vocab", type=int, default=2048, help="random teacher: vocabulary")
    parser.add_argument("--teacher-hidden", type=int, default=512)
    parser.add_argument("--teacher-layers", type=int, default=8)
    parser.add_argument("--proxy-hidden", type=int, default=256)
    parser.add_argument("--proxy-layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (rows = prompts x samples)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--lam", type=float, default=0.1, help="ADS weight (does not change the cost)")
    parser.add_argument("--eps", type=float, default=1e-2)
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per contestant (>= 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    teacher = load_teacher(args)
    proxy = load_proxy(args, teacher)
    vocab = teacher.get_input_embeddings().num_embeddings
    if proxy.get_input_embeddings().num_embeddings != vocab:
        raise SystemExit("teacher and proxy embed different vocabularies; ADS needs one tokenizer")
    # The gradient's values do not change the cost: a random direction of the right shapes.
    torch.manual_seed(2)
    grads = {name: torch.randn_like(p) / p.numel() ** 0.5 for name, p in proxy.named_parameters()}
    plus, minus = perturbed_copies(proxy, grads, args.eps)
    prompts = [torch.randint(3, vocab, (args.prompt_len,)).tolist() for _ in range(args.prompts)]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)  # no stop tokens: fixed length

    f_teacher, f_proxy = forward_flops_per_token(teacher), forward_flops_per_token(proxy)
    print(
        f"teacher={args.teacher} {sum(p.numel() for p in teacher.parameters()) / 1e6:.1f}M params, "
        f"proxy={args.proxy} {sum(p.numel() for p in proxy.parameters()) / 1e6:.1f}M params, vocab={vocab}; "
        f"forward FLOPs/token {f_teacher / 1e6:.1f}M vs {f_proxy / 1e6:.1f}M"
    )
    print(
        f"rows={args.prompts}x{args.samples} prompt_len={args.prompt_len} new_tokens={args.new_tokens} "
        f"threads={torch.get_num_threads()} torch={torch.__version__}"
    )

    def run(name: str, seed: int) -> int:
        p = SamplingParams(**{**params.__dict__, "seed": seed})
        if name == "ads":
            batch = ads_generate(
                teacher, plus, minus, prompts, p, args.lam, args.eps, num_samples=args.samples, vocab_size=vocab
            )
        else:
            batch = generate(teacher if name == "plain" else proxy, prompts, p, num_samples=args.samples)
        return int(batch.completion_mask.sum())

    contestants = ["plain", "ads", "proxy"]
    expected = args.prompts * args.samples * args.new_tokens
    for name in contestants:  # warm-up: allocator, thread pools, lazy imports
        run(name, 0)
    rates: dict[str, list[float]] = {name: [] for name in contestants}
    for rep in range(args.reps):
        for name in contestants if rep % 2 == 0 else reversed(contestants):
            start = time.perf_counter()
            num_tokens = run(name, rep + 1)
            elapsed = time.perf_counter() - start
            assert num_tokens == expected, f"{name} generated {num_tokens} tokens, expected {expected}"
            rates[name].append(num_tokens / elapsed)
        print(f"rep {rep}: " + "  ".join(f"{n}={rates[n][-1]:.0f} tok/s" for n in contestants), flush=True)
    med = {name: statistics.median(r) for name, r in rates.items()}
    measured = med["plain"] / med["ads"]
    by_flops = 1 + 2 * f_proxy / f_teacher
    by_time = 1 + 2 * med["plain"] / med["proxy"]
    print("\ntokens/s, median over reps (generated tokens / wall time incl. prefill)")
    print(f"  plain (temperature sampling)  {med['plain']:9.1f}")
    print(f"  ads   (antidistillation)      {med['ads']:9.1f}")
    print(f"  proxy alone (calibration)     {med['proxy']:9.1f}")
    print(
        f"cost ratio ADS / plain: measured {measured:.2f}; predicted from FLOPs 1 + 2*F_proxy/F_teacher = "
        f"{by_flops:.2f}; from measured times 1 + 2*t_proxy/t_teacher = {by_time:.2f}"
    )


if __name__ == "__main__":
    main()
