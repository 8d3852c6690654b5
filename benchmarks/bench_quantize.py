"""Size and quality of every quantized format: one row per format, printed as a Markdown table.

    python benchmarks/bench_quantize.py --model RUN/sft/final --task addition --num-eval 200
    python benchmarks/bench_quantize.py --model smollm2-135m-instruct --task arith_chat --chat \
        --ppl-file docs/training.md --num-eval 32

Per format: bits per weight of the quantized matrices (nominal), the size of the written files
against the fp32 and bf16 safetensors of the same model, the time to quantize (writing only, the
source already loaded), the time to load it back for evaluation, perplexity on held-out text
(--ppl-file, the first --ppl-tokens tokens) and greedy exact-match accuracy on a built-in task.
How each format is loaded for evaluation (the "loaded by" column): compressed-tensors with plain
transformers (weights dequantized at load); GGUF F16/BF16/Q8_0/Q4_0 with transformers' GGUF loader;
GGUF TQ1_0/TQ2_0 and the lmforge ternary formats through ``lmforge dequantize`` (transformers cannot
read them). Evaluation runs in fp32 in every case: the columns measure the weights, not kernels.
"""

from __future__ import annotations

import argparse
import copy
import math
import shutil
import tempfile
import time
from pathlib import Path

import torch

from lmforge.data.tasks import get_task
from lmforge.quantize import FORMATS, QuantizeError, dequantize, quantize_model
from lmforge.quantize.common import load_source
from lmforge.rollout.evaluation import task_accuracy


@torch.no_grad()
def perplexity(model, tokenizer, text: str, num_tokens: int, window: int = 512) -> float:
    ids = tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start : start + window + 1]])
        if chunk.shape[1] < 2:
            break
        logits = model(chunk[:, :-1]).logits
        total += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    return math.exp(total / count)


def load_for_eval(fmt: str, out_dir: Path, scratch: Path):
    """``(model, how)``: the quantized checkpoint loaded by the runtime that reads it (see docstring)."""
    from transformers import AutoModelForCausalLM

    family = FORMATS[fmt].family
    if family == "compressed-tensors":
        from lmforge.quantize.ct_formats import load_compressed

        return load_compressed(out_dir), "transformers"
    gguf_files = sorted(out_dir.glob("*.gguf"))
    if gguf_files and not fmt.startswith("gguf-tq"):
        return AutoModelForCausalLM.from_pretrained(
            out_dir, gguf_file=gguf_files[0].name, dtype=torch.float32
        ), "transformers GGUF"
    hf_dir = scratch / f"{fmt}-hf"
    dequantize(out_dir, hf_dir)
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), "lmforge dequantize"


def evaluate(model, tokenizer, args, task, problems, text) -> tuple[str, str]:
    model.eval()
    ppl = f"{perplexity(model, tokenizer, text, args.ppl_tokens):.3f}" if text else "-"
    acc = "-"
    if task is not None:
        value, _ = task_accuracy(model, tokenizer, task, problems, args.max_new_tokens, chat=args.chat)
        acc = f"{value:.1%}"
    return ppl, acc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated format names")
    parser.add_argument("--task", default=None, help="built-in task for accuracy (addition, arith_chat)")
    parser.add_argument("--chat", action="store_true", help="prompt through the chat template")
    parser.add_argument("--num-eval", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--ppl-file", default=None, help="held-out text for perplexity")
    parser.add_argument("--ppl-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model, tokenizer = load_source(args.model)
    task = get_task(args.task) if args.task else None
    problems = task.make_problems(args.num_eval, args.seed, "test") if task else []
    text = Path(args.ppl_file).read_text() if args.ppl_file else ""
    scratch = Path(tempfile.mkdtemp(prefix="bench_quantize-"))
    try:
        ref_dir = scratch / "fp32"
        model.save_pretrained(ref_dir, safe_serialization=True)
        fp32_bytes = sum(f.stat().st_size for f in ref_dir.glob("*.safetensors"))
        copy.deepcopy(model).to(torch.bfloat16).save_pretrained(scratch / "bf16", safe_serialization=True)
        bf16_bytes = sum(f.stat().st_size for f in (scratch / "bf16").glob("*.safetensors"))
        start = time.perf_counter()
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
        load_s = time.perf_counter() - start
        ppl, acc = evaluate(model, tokenizer, args, task, problems, text)
        print(
            f"model {args.model}: fp32 {fp32_bytes / 2**20:.2f} MiB, bf16 {bf16_bytes / 2**20:.2f} MiB; "
            f"task {args.task} ({len(problems)} held-out), ppl text {args.ppl_file} ({args.ppl_tokens} tokens)"
        )
        print("| format | bits/weight | MiB | vs fp32 | vs bf16 | ppl | accuracy | quantize s | load s | loaded by |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        print(
            f"| fp32 (reference) | 32 | {fp32_bytes / 2**20:.2f} | 1.00 | {fp32_bytes / bf16_bytes:.2f} | {ppl} | "
            f"{acc} | - | {load_s:.2f} | transformers |",
            flush=True,
        )
        for fmt in args.formats.split(","):
            out_dir = scratch / fmt
            try:
                result = quantize_model(copy.deepcopy(model), tokenizer, fmt, out_dir)
            except QuantizeError as exc:
                print(f"| {fmt} | {FORMATS[fmt].bits:g} | not written: {str(exc)[:90]} |", flush=True)
                continue
            start = time.perf_counter()
            loaded, how = load_for_eval(fmt, out_dir, scratch)
            load_s = time.perf_counter() - start
            ppl, acc = evaluate(loaded, tokenizer, args, task, problems, text)
            size = result.num_bytes
            print(
                f"| {fmt} | {FORMATS[fmt].bits:g} | {size / 2**20:.2f} | {size / fp32_bytes:.3f} | "
                f"{size / bf16_bytes:.3f} | {ppl} | {acc} | {result.seconds:.2f} | {load_s:.2f} | {how} |",
                flush=True,
            )
            del loaded
            shutil.rmtree(out_dir, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
