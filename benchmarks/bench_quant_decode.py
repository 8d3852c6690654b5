"""Decode speed of SmolLM2-135M on CPU: fp32, bf16 and torchao int8 weight-only, with transformers'
``generate`` or (``--engine``) lmforge's rollout engine.

    pip install torchao==0.18.0      # optional; without it the int8 row is skipped
    python benchmarks/bench_quant_decode.py --new-tokens 64 --batch 1 --repeats 3
    python benchmarks/bench_quant_decode.py --engine --new-tokens 32 --batch 16 --repeats 2

torchao 0.18's int4 weight-only does not run on this CPU (``int4_packing_format="opaque"``: "Unsupported
int4 packing format"; the default format needs the ``mslk`` kernel library), so there is no int4 row.

Greedy decoding of --new-tokens tokens after a short prompt, --batch identical rows, KV cache on;
the contestants alternate within one process (fp32, bf16, int8, fp32, ...) and the best of
--repeats runs is reported. The compressed-tensors checkpoints are dequantized at load on CPU, so
they decode at fp32 speed by construction; torchao's int8 weight-only is the CPU int8 kernel path.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import time

import torch

from lmforge.core.config import ModelConfig
from lmforge.model.load import load_model


def tokens_per_s(model, ids, new_tokens: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return ids.shape[0] * new_tokens / (time.perf_counter() - start)


def engine_tokens_per_s(model, ids, new_tokens: int) -> float:
    from lmforge.rollout.engine import SamplingParams, generate

    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)  # greedy, no stop token: full length
    start = time.perf_counter()
    batch = generate(model, [row.tolist() for row in ids], params)
    assert int(batch.completion_mask.sum()) == ids.shape[0] * new_tokens
    return ids.shape[0] * new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", action="store_true", help="time lmforge's rollout engine, not transformers")
    args = parser.parse_args()
    timer = engine_tokens_per_s if args.engine else tokens_per_s
    model, tok = load_model(ModelConfig(name="smollm2-135m-instruct"))
    ids = torch.tensor(
        [tok.encode("The three most useful things to know about", add_special_tokens=False)] * args.batch
    )
    contestants = {"fp32": model.eval(), "bf16": copy.deepcopy(model).to(torch.bfloat16).eval()}
    if importlib.util.find_spec("torchao") is not None:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        int8 = copy.deepcopy(model).eval()
        quantize_(int8, Int8WeightOnlyConfig())
        contestants["int8 (torchao weight-only)"] = int8
    else:
        print("torchao not installed: no int8 row (pip install torchao==0.18.0)")
    for m in contestants.values():
        timer(m, ids, 4)  # warm-up
    best = {name: 0.0 for name in contestants}
    for _ in range(args.repeats):
        for name, m in contestants.items():
            best[name] = max(best[name], timer(m, ids, args.new_tokens))
    print(
        f"{'lmforge rollout engine' if args.engine else 'transformers generate'}, "
        f"threads {torch.get_num_threads()}, batch {args.batch}, {args.new_tokens} new tokens, best of {args.repeats}"
    )
    for name, value in best.items():
        print(f"| {name} | {value:.1f} tokens/s | {value / best['fp32']:.2f}x fp32 |")


if __name__ == "__main__":
    main()
