"""Step time with each side's own defaults: lmforge against TRL 1.16, SFT and GRPO, side by side.

The comparison a user makes: both tools as shipped, on the same machine and the same work, with
only the workload set. What each side chooses by itself is printed (dtype, activation
checkpointing, threads): lmforge through ``lmforge.runtime.hardware.choose`` (``train.dtype=auto``,
``train.gradient_checkpointing=auto``), TRL through its config defaults (``bf16=None`` -> bf16
autocast where the device allows it, ``gradient_checkpointing=True``).

- SFT (``--sft``): SmolLM2-135M-Instruct, 8 packed rows x 256 tokens of ``chat_small.jsonl`` per
  step (``bench_sft.py``'s data), lr 2e-5 linear, clip 1.0. lmforge: ``supervised_step`` on the
  state ``lmforge sft`` builds with ``train.dtype=auto`` and ``gradient_checkpointing=auto``; TRL:
  ``SFTTrainer`` with SFTConfig's precision / checkpointing defaults.
- GRPO (``--grpo``): ``examples/grpo_smollm2.yaml``'s step (8 prompts x 8 completions, <= 8 new
  tokens, DAPO, beta 0). lmforge: ``grpo_step`` on the state ``lmforge grpo`` builds from the example
  with its defaults; TRL: ``GRPOTrainer`` with ``per_device_train_batch_size=8``,
  ``gradient_accumulation_steps=8`` (one update per 64 completions), ``max_completion_length=8``,
  ``learning_rate=1e-5``, ``beta=0``, ``loss_type="dapo"``, the rest TRL's defaults.

Timing alternates step by step in one process (TRL drives ``trainer.train()``; a callback at each
TRL ``on_step_end`` runs one lmforge step), so both see the same background load. The first
``--warmup`` steps are not timed; medians of the rest. Threads: ``--threads`` for both (default 0 =
lmforge's choice for this machine, applied to the whole process).

    python benchmarks/bench_defaults_vs_trl.py --sft --grpo --steps 3
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_sft
import bench_vs_trl

from lmforge import rl
from lmforge.core.config import (
    ModelConfig,
    OptimConfig,
    TrainConfig,
)
from lmforge.data.sft import collate_sft
from lmforge.model.load import load_model
from lmforge.recipes.grpo import make_step
from lmforge.recipes.sft import SFTConfig
from lmforge.runtime import hardware
from lmforge.runtime.loop import build_state
from lmforge.runtime.run import start_run
from lmforge.supervised.step import SupervisedData, supervised_step


def make_callback(lmforge_step, warmup: int, record: dict):
    from transformers import TrainerCallback

    state = {"mark": 0.0, "step": 0}

    class Alternate(TrainerCallback):
        def on_train_begin(self, *a, **k):
            state["mark"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            trl = time.perf_counter() - state["mark"]
            start = time.perf_counter()
            lmforge_step()
            lm = time.perf_counter() - start
            timed = state["step"] >= warmup
            if timed:
                record["trl"].append(trl)
                record["lmforge"].append(lm)
            print(
                f"  step {state['step']}{'' if timed else ' (warm-up)'}: trl {trl:6.1f} s  lmforge {lm:6.1f} s",
                flush=True,
            )
            state["step"] += 1
            state["mark"] = time.perf_counter()

    return Alternate()


def summary(name: str, record: dict, lm_choice: str, trl_choice: str) -> dict:
    trl, lm = statistics.median(record["trl"]), statistics.median(record["lmforge"])
    paired = statistics.median(t / m for t, m in zip(record["trl"], record["lmforge"]))
    print(
        f"RESULT {name}: trl {trl:.2f} s/step ({trl_choice}), lmforge {lm:.2f} s/step ({lm_choice}); "
        f"trl / lmforge median {trl / lm:.2f}x, paired {paired:.2f}x",
        flush=True,
    )
    return {
        "workload": name,
        "trl_s": trl,
        "lmforge_s": lm,
        "ratio_median": trl / lm,
        "ratio_paired": paired,
        "trl_settings": trl_choice,
        "lmforge_settings": lm_choice,
    }


# ----------------------------------------------------------------------------- SFT


def sft(args, out_dir: str) -> dict:
    model, tokenizer = load_model(ModelConfig(name="smollm2-135m-instruct"))
    rows = bench_sft.packed_rows(tokenizer, args.seq_len)
    total = args.warmup + args.steps
    cfg = SFTConfig(
        optim=OptimConfig(
            lr=bench_sft.LR, weight_decay=0.0, warmup_steps=0, schedule="linear", max_grad_norm=bench_sft.MAX_GRAD_NORM
        ),
        train=TrainConfig(
            output_dir=f"{out_dir}/sft",
            max_steps=2 * total,
            batch_size=args.batch,
            micro_batch_size=args.batch,
            threads=args.threads,
            device="cpu",
        ),
    )
    lm_model = copy.deepcopy(model)
    run = start_run(cfg, "bench", lm_model, seq_len=args.seq_len, console=bench_sft.Quiet())
    choice = f"dtype={str(run.choices.dtype).replace('torch.', '')}, checkpointing={run.choices.gradient_checkpointing}"
    state = build_state(run, lm_model, tokenizer, bench_sft.SequentialOrder(len(rows), args.batch), 2 * total)
    data = SupervisedData(rows, [], lambda part: collate_sft(part, tokenizer.pad_token_id))
    counter = {"step": 0}

    def lm_step():
        counter["step"] += 1
        supervised_step(state, data, counter["step"])

    record = {"trl": [], "lmforge": []}
    trainer = bench_sft.trl_trainer(
        model,
        tokenizer,
        rows,
        args,
        f"{out_dir}/trl_sft",
        make_callback(lm_step, args.warmup, record),
        total,
        defaults=True,
    )
    trl_choice = f"bf16={trainer.args.bf16}, gradient_checkpointing={trainer.args.gradient_checkpointing}"
    trainer.train()
    return summary("sft", record, choice, trl_choice)


# ----------------------------------------------------------------------------- GRPO


def grpo(args, out_dir: str) -> dict:
    from trl import GRPOTrainer

    total = args.warmup + args.steps
    cfg = bench_vs_trl.lmforge_config(0, 2 * total, 10**6, f"{out_dir}/grpo", args.threads, [])
    model, tokenizer = load_model(cfg.model)
    algo = cfg.algo.resolved()
    state = rl.prepare(cfg, "bench", algo, copy.deepcopy(model), tokenizer)
    choice = f"dtype={str(state.updater.precision.dtype).replace('torch.', '')}"
    counter = {"step": 0}
    step = rl.synced_steps(state, make_step(state, algo))  # as rl.train_rl runs it

    def lm_step():
        counter["step"] += 1
        step(counter["step"])

    record = {"trl": [], "lmforge": []}
    trl_args = argparse.Namespace(trl_settings="defaults")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[bench_vs_trl.task_reward(state.prompts.task)],
        args=bench_vs_trl.trl_config(trl_args, 0, total, f"{out_dir}/trl_grpo"),
        train_dataset=bench_vs_trl.trl_dataset(state.prompts.problems),
        processing_class=tokenizer,
        callbacks=[make_callback(lm_step, args.warmup, record)],
    )
    trl_choice = f"bf16={trainer.args.bf16}, gradient_checkpointing={trainer.args.gradient_checkpointing}"
    trainer.train()
    return summary("grpo", record, choice, trl_choice)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft", action="store_true")
    parser.add_argument("--grpo", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="0 = lmforge's choice (applied to the process)")
    args = parser.parse_args()
    if not (args.sft or args.grpo):
        parser.error("choose --sft and/or --grpo")
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    hw = hardware.detect("cpu")
    print(f"[bench] cpu bf16 native: {hw.bf16_supported}; cores {hw.num_cores}", flush=True)
    with tempfile.TemporaryDirectory() as out_dir:
        results = []
        if args.sft:
            results.append(sft(args, out_dir))
        if args.grpo:
            results.append(grpo(args, out_dir))
    print("\n| workload | TRL defaults s/step | lmforge defaults s/step | TRL / lmforge (median, paired) |")
    print("|---|---|---|---|")
    for r in results:
        print(
            f"| {r['workload']} | {r['trl_s']:.2f} ({r['trl_settings']}) | {r['lmforge_s']:.2f} "
            f"({r['lmforge_settings']}) | {r['ratio_median']:.2f}x, {r['ratio_paired']:.2f}x |"
        )


if __name__ == "__main__":
    main()
