"""GRPO step time: lmforge's ``grpo_step`` vs TRL's ``GRPOTrainer``, side by side in one process.

Workload (the issue's): SmolLM2-135M-Instruct, fp32, CPU, 2 prompts x 8 samples = 16 completions of
exactly 32 new tokens per step, one optimizer update per step. Prompts: the built-in ``arith_chat``
task through the model's chat template, the same prompts in the same order on both sides (TRL gets a
dataset laid out in lmforge's ``BatchOrder`` and ``shuffle_dataset=False``; the script checks that
TRL's chat-template token ids equal lmforge's). Reward: the task's ``exact`` scorer on both sides.

The same work by default: lmforge trains every row as TRL does (``algo.skip_zero_advantage=false``;
``--shipped-defaults`` turns lmforge's default skip of zero-advantage groups back on, and the ratio then
counts rows lmforge did not train). Same loss settings on both sides: no KL term (lmforge ``algo.kl_coef=0``, TRL
``beta=0``: no
reference model), one iteration / one mini-batch (on-policy: both take old logprobs from the
update's own forward, ratio 1), clip 0.2 / 0.2, temperature 1, no top-k / top-p, group-std
normalised advantages (Bessel std; eps 1e-6 lmforge, 1e-4 TRL), per-sequence token mean then mean
over sequences (lmforge ``aggregation=seq_mean_token_mean`` = TRL ``loss_type="grpo"``), AdamW
lr 1e-6 constant, betas (0.9, 0.999), eps 1e-8, no weight decay, global-norm clip 1.0, one
micro-batch of 16 rows, no gradient checkpointing, no dropout (SmolLM2 has none).

Exactly 32 tokens on both sides: TRL gets ``generation_kwargs={"min_new_tokens": 32}`` (EOS
suppressed for 32 steps, so its EOS mask keeps all 32); lmforge's step gets a tokenizer view whose
``eos_token_id`` is -1 (no stop token: the engine runs its full ``max_new_tokens``; EOS can be sampled
and is then an ordinary token). The script prints the completion lengths each side trained on.

lmforge's step is the recipe's own: ``recipes.grpo.grpo_step`` (sample_and_score -> advantages ->
pack_rollout -> the rl.Updates loop with micro_loss), on the state ``rl.prepare`` builds from a GRPOConfig, so
optimizer, precision, threads and the on-policy shortcut are what ``lmforge grpo`` uses. Its time
split (generation / scoring / training) is the step's own metrics.

Timing: TRL drives (``trainer.train()``); a callback at TRL's ``on_step_end`` runs one lmforge step,
so the two alternate step by step and share whatever load other processes put on the machine. A
TRL step is the wall time between two ``on_step_end`` calls minus the lmforge step, i.e. everything
TRL does per step; its generation time is measured by wrapping ``_generate_single_turn``. The
first ``--warmup`` steps of each are not timed.

    python benchmarks/bench_grpo.py                  # SmolLM2-135M-Instruct, 1 warm-up + 3 timed steps each
    python benchmarks/bench_grpo.py --steps 5
    python benchmarks/bench_grpo.py --quick          # tiny random Llama (SmolLM2 tokenizer), seconds
    python benchmarks/bench_grpo.py --no-trl --profile   # lmforge only, + torch.profiler of one step
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import os
import statistics
import tempfile
import time
import types
import warnings

import torch

from lmforge import rl
from lmforge.core.config import ModelConfig, load_config
from lmforge.model.load import count_parameters, load_model, resolve_pretrained
from lmforge.recipes.grpo import GRPOConfig, make_step
from lmforge.rl import config as rl_config

LR, BETA2, MAX_GRAD_NORM, CLIP_EPS, TEMPERATURE = 1e-6, 0.999, 1.0, 0.2, 1.0


class NoStopTokenizer:
    """The tokenizer, except ``eos_token_id`` = -1: the engine gets no stop token that can be sampled,
    so every completion is exactly ``max_new_tokens`` long (equal work to TRL with min_new_tokens)."""

    eos_token_id = -1

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


# ----------------------------------------------------------------------------- lmforge


def lmforge_state(model, tokenizer, args, out_dir: str, total_steps: int):
    """The state ``run_grpo`` builds (``rl.prepare``) for the benchmark's settings, and the resolved algo."""
    overrides = [
        "data.task=arith_chat",
        "data.num_train=256",
        "data.num_eval=0",
        "data.use_chat_template='on'",
        f"rollout.num_prompts={args.prompts}",
        f"rollout.group_size={args.samples}",
        f"rollout.temperature={TEMPERATURE}",
        "rollout.top_k=0",
        "rollout.top_p=1.0",
        f"rollout.max_new_tokens={args.new_tokens}",
        "rewards.functions=[exact]",
        "algo.advantage=group_norm",
        "algo.loss_type=token_clip",
        "algo.aggregation=seq_mean_token_mean",
        f"algo.eps_low={CLIP_EPS}",
        f"algo.eps_high={CLIP_EPS}",
        "algo.kl_coef=0.0",
        "algo.entropy_coef=0.0",
        "algo.num_iterations=1",
        "algo.num_mini_batches=1",
        # the same work as TRL, which trains every row: lmforge's default skips zero-advantage rows
        f"algo.skip_zero_advantage={'true' if args.shipped_defaults else 'false'}",
        f"optim.lr={LR}",
        "optim.schedule=constant",
        "optim.warmup_steps=0",
        "optim.weight_decay=0.0",
        "optim.beta1=0.9",
        f"optim.beta2={BETA2}",
        "optim.eps=1e-8",
        f"optim.max_grad_norm={MAX_GRAD_NORM}",
        f"train.micro_batch_size={args.prompts * args.samples}",
        "train.gradient_checkpointing='off'",
        "train.dtype=fp32",
        "train.device=cpu",
        f"train.max_steps={total_steps}",
        f"train.output_dir={out_dir}",
        "train.save_every=0",
        "logging.progress=false",
        f"train.threads={args.threads}",
        f"rollout.dtype={args.rollout_dtype}",
    ]
    if args.rollout_dtype != "same":  # samples from the bf16 copy: weight by pi_fp32 / pi_bf16 per token
        overrides.append("algo.is_level=token")
    cfg = load_config(GRPOConfig, None, overrides)
    algo = cfg.algo.resolved()
    state = rl.prepare(cfg, "bench_grpo", algo, model=model, tokenizer=tokenizer)
    # The sampler reads its stop token from the source's setup (rl.sources.SourceSetup), built by prepare.
    state.source.setup = dataclasses.replace(state.source.setup, tokenizer=NoStopTokenizer(tokenizer))
    return state, algo


# ----------------------------------------------------------------------------- TRL


def trl_trainer(model, tokenizer, state, args, out_dir: str, callback, total_steps: int):
    """TRL's GRPOTrainer on the prompts lmforge will sample, in lmforge's order, with matching settings."""
    from datasets import Dataset
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    hf_logging.set_verbosity_error()
    prompts = state.prompts
    order = copy.deepcopy(state.train.order)  # the rows lmforge's steps will take, before it takes any
    rows = [i for _ in range(total_steps) for i in order.next()]
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": prompts.problems[i].prompt}], "answer": prompts.problems[i].answer}
            for i in rows
        ]
    )
    task = prompts.task

    def exact(completions, answer, **_):
        return [task.score(c[0]["content"], types.SimpleNamespace(answer=a)) for c, a in zip(completions, answer)]

    config = TRLConfig(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=args.prompts * args.samples,
        gradient_accumulation_steps=1,
        num_generations=args.samples,
        max_completion_length=args.new_tokens,
        generation_kwargs={"min_new_tokens": args.new_tokens},
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        epsilon=CLIP_EPS,
        loss_type="grpo",
        scale_rewards="group",
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=BETA2,
        adam_epsilon=1e-8,
        max_grad_norm=MAX_GRAD_NORM,
        max_steps=total_steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
        shuffle_dataset=False,
        log_completions=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[exact],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[callback],
    )
    trl_ids = trainer._tokenize_prompts([dataset[0]["prompt"]])[0][0]
    same = list(trl_ids) == list(prompts.prompt_ids[rows[0]])
    print(f"[bench] prompt token ids identical on both sides: {same} ({len(trl_ids)} tokens)", flush=True)
    return trainer


def time_trl_generation(trainer) -> dict:
    """Wrap TRL's generation call: per-call seconds and completion lengths (recorded into the dict)."""
    record = {"seconds": [], "lengths": []}
    original = trainer._generate_single_turn

    def timed(*a, **k):
        start = time.perf_counter()
        out = original(*a, **k)
        record["seconds"].append(time.perf_counter() - start)
        record["lengths"].append([len(ids) for ids in out[0]])
        return out

    trainer._generate_single_turn = timed
    return record


# ----------------------------------------------------------------------------- timing

_SYNCED: dict[int, object] = {}  # id(state) -> its step function


def run_lmforge(state, algo, step: int) -> dict:
    """One ``grpo_step`` with the rollout source's weight syncs, as ``lmforge grpo`` runs it (``rl.synced_steps``)."""
    if id(state) not in _SYNCED:
        _SYNCED[id(state)] = rl.synced_steps(state, make_step(state, algo))
    start = time.perf_counter()
    metrics = _SYNCED[id(state)](step)
    metrics["step_time"] = time.perf_counter() - start
    return metrics


def describe(step: int, metrics: dict) -> str:
    return (
        f"lmforge {metrics['step_time']:6.1f}s (gen {metrics['time_generation']:.1f} score "
        f"{metrics['time_scoring']:.2f} train {metrics['time_training']:.1f}; len "
        f"{float(metrics['completion_len_mean']):.0f}, reward {float(metrics['reward']):.2f}, "
        f"loss {float(metrics['loss']):+.4f})"
    )


def alternate(trainer_factory, state, algo, args) -> tuple[list[float], list[float], list[dict]]:
    """TRL for warmup + steps steps; one lmforge step after each. Returns TRL step seconds, TRL
    generation seconds and lmforge's step metrics (timed steps only)."""
    from transformers import TrainerCallback

    trl_times, trl_gen, lm = [], [], []
    mark = {"t": 0.0, "step": 0}
    gen_record: dict = {}

    class Alternate(TrainerCallback):
        def on_train_begin(self, *a, **k):
            mark["t"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            trl_time = time.perf_counter() - mark["t"]
            step = mark["step"]
            timed = step >= args.warmup
            gen = gen_record["seconds"][-1] if gen_record.get("seconds") else float("nan")
            lengths = gen_record["lengths"][-1] if gen_record.get("lengths") else []
            metrics = run_lmforge(state, algo, step + 1)
            if timed:
                trl_times.append(trl_time)
                trl_gen.append(gen)
                lm.append(metrics)
            trl_len = statistics.mean(lengths) if lengths else float("nan")
            print(
                f"step {step}{'' if timed else ' (warm-up)'}: trl {trl_time:6.1f}s (gen {gen:.1f}; len "
                f"{trl_len:.0f})  " + describe(step, metrics),
                flush=True,
            )
            mark["step"] += 1
            mark["t"] = time.perf_counter()

    trainer = trainer_factory(Alternate())
    gen_record.update(time_trl_generation(trainer))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print("[bench] trl losses: " + " ".join(f"{x:+.4f}" for x in losses), flush=True)
    return trl_times, trl_gen, lm


def lmforge_only(state, algo, args) -> list[dict]:
    lm = []
    for step in range(args.warmup + args.steps):
        metrics = run_lmforge(state, algo, step + 1)
        timed = step >= args.warmup
        print(f"step {step}{'' if timed else ' (warm-up)'}: " + describe(step, metrics), flush=True)
        if timed:
            lm.append(metrics)
    return lm


def profile_lmforge(state, algo, step: int, rows_limit: int = 25) -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with record_function("grpo_step"):
            metrics = run_lmforge(state, algo, step)
    print(
        f"\n[profile] lmforge grpo_step: gen {metrics['time_generation']:.2f}s score "
        f"{metrics['time_scoring']:.2f}s train {metrics['time_training']:.2f}s (profiler overhead included)"
    )
    print(
        prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=rows_limit),
        flush=True,
    )


def report(trl_times, trl_gen, lm, args) -> None:
    med = statistics.median
    lm_step = med([m["step_time"] for m in lm])
    split = {k: med([m[k] for m in lm]) for k in ("time_generation", "time_scoring", "time_training")}
    work = f"{args.prompts} x {args.samples} x {args.new_tokens} new tokens"
    print(f"\nmedian over {len(lm)} timed steps ({work}):")
    print(
        f"  lmforge {lm_step:7.2f} s/step   generation {split['time_generation']:.2f} s | scoring "
        f"{split['time_scoring']:.3f} s | training {split['time_training']:.2f} s   (steps: "
        + " ".join(f"{m['step_time']:.1f}" for m in lm)
        + ")"
    )
    if trl_times:
        trl_step, gen = med(trl_times), med(trl_gen)
        print(
            f"  trl     {trl_step:7.2f} s/step   generation {gen:.2f} s | rest (scoring + training + "
            f"overhead) {trl_step - gen:.2f} s   (steps: " + " ".join(f"{t:.1f}" for t in trl_times) + ")"
        )
        print(
            f"  ratio trl / lmforge: {trl_step / lm_step:.2f}x   (generation {gen / split['time_generation']:.2f}x, "
            f"rest {(trl_step - gen) / (split['time_scoring'] + split['time_training']):.2f}x)"
        )
        print(
            f"RESULT lmforge_s={lm_step:.2f} trl_s={trl_step:.2f} ratio={trl_step / lm_step:.2f} "
            f"lm_gen_s={split['time_generation']:.2f} lm_score_s={split['time_scoring']:.3f} "
            f"lm_train_s={split['time_training']:.2f} trl_gen_s={gen:.2f}",
            flush=True,
        )


# ----------------------------------------------------------------------------- main


def load(quick: bool):
    smollm2 = resolve_pretrained("smollm2-135m-instruct")
    if quick:  # random tiny Llama with SmolLM2's tokenizer (chat template, 49k vocab)
        return load_model(
            ModelConfig(
                name="tiny:llama",
                tokenizer=str(smollm2),
                hidden_size=64,
                num_layers=2,
                num_heads=4,
                max_position_embeddings=1024,
            )
        )
    return load_model(ModelConfig(name=str(smollm2)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contestant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per contestant first")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt (group size)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads for both (one process): 0 = what lmforge's hardware tier picks "
        "(= usable cores); 1 is far faster when other jobs load the cores",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny random Llama: a smoke run in seconds (1 thread unless --threads says otherwise)",
    )
    parser.add_argument("--no-trl", action="store_true", help="lmforge steps only (no comparison)")
    parser.add_argument(
        "--rollout-dtype",
        default="same",
        choices=["same", "bf16"],
        help="lmforge's rollout.dtype; bf16 (a bf16 sampler copy, synced every step) also sets "
        "algo.is_level=token, so the loss differs from TRL's by the importance weights",
    )
    parser.add_argument("--profile", action="store_true", help="after timing, profile one lmforge step")
    parser.add_argument(
        "--shipped-defaults",
        action="store_true",
        help="lmforge skips the rows of zero-advantage groups, as `lmforge grpo` does by default "
        "(less work than TRL's step); without it both sides train every row (the same work)",
    )
    args = parser.parse_args()
    if args.steps < 1 or args.samples < 2:
        parser.error("need --steps >= 1 and --samples >= 2")
    if args.quick and not args.threads:
        args.threads = 1  # a smoke run should take seconds even on a loaded machine
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    torch.manual_seed(0)
    model, tokenizer = load(args.quick)
    total = args.warmup + args.steps
    import transformers

    trl_version = "-" if args.no_trl else importlib.import_module("trl").__version__  # --no-trl runs without trl

    with tempfile.TemporaryDirectory() as out_dir:
        trl_model = None if args.no_trl else copy.deepcopy(model)
        state, algo = lmforge_state(model, tokenizer, args, os.path.join(out_dir, "lmforge"), total + int(args.profile))
        print(
            f"[bench] model={'tiny' if args.quick else 'SmolLM2-135M-Instruct'} "
            f"params={count_parameters(model) / 1e6:.1f}M fp32 threads={torch.get_num_threads()} "
            f"torch={torch.__version__} transformers={transformers.__version__} trl={trl_version} "
            f"rows={args.prompts}x{args.samples} new_tokens={args.new_tokens} steps={args.warmup}+{args.steps} "
            f"lmforge rollout.dtype={args.rollout_dtype} "
            f"work={'shipped defaults (zero-advantage rows skipped)' if args.shipped_defaults else 'same'}",
            flush=True,
        )
        print(f"[bench] lmforge algo: {rl_config.describe_algo(algo)}", flush=True)
        if args.no_trl:
            trl_times, trl_gen, lm = [], [], lmforge_only(state, algo, args)
        else:
            trl_times, trl_gen, lm = alternate(
                lambda cb: trl_trainer(trl_model, tokenizer, state, args, os.path.join(out_dir, "trl"), cb, total),
                state,
                algo,
                args,
            )
        report(trl_times, trl_gen, lm, args)
        if args.profile:
            profile_lmforge(state, algo, total + 1)


if __name__ == "__main__":
    main()
