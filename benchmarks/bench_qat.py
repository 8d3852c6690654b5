"""Ternary on the addition task: post-training ternary vs ternary QAT (from scratch and from SFT).

    python benchmarks/bench_qat.py --sft-model RUN/sft/final --steps 400 --out runs/bench_qat

Rows (held-out exact-match accuracy, greedy, the quickstart's 200 test problems):
  * the SFT model in fp32, and after post-training ternary (``lmforge quantize --format ternary``);
  * ternary QAT (``train.qat=ternary``) continued from the SFT model for --steps SFT steps (the
    quickstart's SFT settings): the accuracy of the fake-quantized model at the end of training, and
    of the packed ternary copy the run wrote itself (``train.save_quantized=[ternary]``, in
    ``final/quantized-ternary``) read back through ``lmforge dequantize`` (the two must agree);
  * a control: the SFT model trained --steps more steps the same way without QAT;
  * the same from scratch (a fresh tiny model with QAT from step 0, --scratch-steps steps).
QAT is the SFT recipe's own ``train.qat`` setting; nothing else differs from the control.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from lmforge.data.tasks import get_task
from lmforge.model.load import load_model
from lmforge.model.tokenizer import char_tokenizer
from lmforge.pipelines.quickstart import QuickstartConfig, sft_config
from lmforge.quantize import dequantize, quantize_model
from lmforge.quantize.common import load_source
from lmforge.recipes.sft import run_sft
from lmforge.rollout.evaluation import task_accuracy


def accuracy(model, tokenizer, problems, task) -> float:
    return task_accuracy(model.eval(), tokenizer, task, problems, 6)[0]


def exported_accuracy(tokenizer, problems, task, out: Path) -> float:
    """The run's own packed ternary copy of sft/final/, read back as a plain HF model, measured."""
    from transformers import AutoModelForCausalLM

    dequantize(out / "sft" / "final" / "quantized-ternary", out / "ternary-hf")
    return accuracy(
        AutoModelForCausalLM.from_pretrained(out / "ternary-hf", dtype=torch.float32), tokenizer, problems, task
    )


def qat_run(model, tokenizer, steps: int, lr: float, out: Path, problems, task, qat: bool = True):
    """``(accuracy of the trained model, accuracy of its ternary export, seconds)``; qat=False: control."""
    cfg = sft_config(QuickstartConfig(sft_steps=steps, sft_lr=lr, progress=False), out)
    if qat:
        cfg.train.qat, cfg.train.save_quantized = "ternary", ["ternary"]
    start = time.perf_counter()
    run_sft(cfg, model, tokenizer, name=f"qat {out.name}")
    seconds = time.perf_counter() - start
    fake = accuracy(model, tokenizer, problems, task)
    if not qat:
        return fake, float("nan"), seconds
    return fake, exported_accuracy(tokenizer, problems, task, out), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft-model", required=True, help="the quickstart's sft/final directory")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--scratch-steps", type=int, default=None, help="steps from scratch (default --steps)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default="runs/bench_qat")
    args = parser.parse_args()
    out = Path(args.out)
    task = get_task("addition")
    problems = task.make_problems(200, 0, "test")

    sft, tokenizer = load_source(args.sft_model)
    rows = [("SFT model, fp32", accuracy(sft, tokenizer, problems, task))]
    quantize_model(sft, tokenizer, "ternary", out / "ptq")
    dequantize(out / "ptq", out / "ptq-hf")
    ptq, _ = load_source(str(out / "ptq-hf"))
    rows.append(("SFT model, post-training ternary", accuracy(ptq, tokenizer, problems, task)))
    for line in rows:
        print(f"| {line[0]} | {line[1]:.1%} |", flush=True)

    sft, tokenizer = load_source(args.sft_model)
    control, _, seconds = qat_run(
        sft, tokenizer, args.steps, args.lr, out / "control-from-sft", problems, task, qat=False
    )
    print(
        f"| control: SFT continued {args.steps} steps without QAT, fp32 | {control:.1%} | ({seconds:.0f} s)", flush=True
    )

    sft, tokenizer = load_source(args.sft_model)
    fake, exported, seconds = qat_run(sft, tokenizer, args.steps, args.lr, out / "qat-from-sft", problems, task)
    print(f"| ternary QAT from SFT, {args.steps} steps: fake-quantized | {fake:.1%} |")
    print(
        f"| ternary QAT from SFT, {args.steps} steps: exported ternary | {exported:.1%} | ({seconds:.0f} s)", flush=True
    )

    tokenizer = char_tokenizer(task.alphabet)
    scratch_cfg = sft_config(QuickstartConfig(), out)
    scratch, tokenizer = load_model(scratch_cfg.model, tokenizer)
    steps = args.scratch_steps or args.steps
    fake, exported, seconds = qat_run(scratch, tokenizer, steps, args.lr, out / "qat-scratch", problems, task)
    print(f"| ternary QAT from scratch, {steps} steps: fake-quantized | {fake:.1%} |")
    print(
        f"| ternary QAT from scratch, {steps} steps: exported ternary | {exported:.1%} | ({seconds:.0f} s)", flush=True
    )


if __name__ == "__main__":
    main()
