"""SFT throughput: lmforge's training step vs TRL's ``SFTTrainer``, side by side in one process.

Workload: SmolLM2-135M-Instruct, fp32, CPU, no gradient checkpointing, batch 8 x 256 tokens.
Data: the chat rows of ``lmforge/assets/chat_small.jsonl``, tokenized once with lmforge's
``tokenize_sft`` (SmolLM2 chat template, completion-only mask = assistant turns + ``<|im_end|>``)
and packed back to back into rows of exactly ``--seq-len`` tokens (no padding, plain causal
attention across the packed conversations). Both trainers get these identical rows: TRL as a
pre-tokenized dataset with ``input_ids`` + ``completion_mask`` and ``completion_only_loss=True``,
lmforge as ``SFTExample`` rows. Loss on both sides: mean next-token NLL over the completion tokens
of the step. Tokens/s counts every token of the packed rows (batch x seq-len per step, all real,
none padding); the loss-token count per step is printed as well.

Timing: TRL drives the run (``trainer.train()``); a callback at TRL's ``on_step_end`` runs one
lmforge step (and the optional contestants, order reversed every step), so the contestants
alternate step by step and share whatever load other processes put on the machine. A TRL step is
the wall time from the end of the other contestants' turn to TRL's next ``on_step_end``, i.e.
everything TRL does per step (data loading, forward/backward, optimizer, logging). The first
``--warmup`` steps of each are not timed. Printed per contestant: median and best s/step, tokens/s
at the median, the speed ratio vs TRL from the medians, from the best steps, paired (median over
steps of TRL's step / the contestant's step right after it: the most load-robust figure) and from
process CPU time. MFU = (6 x matmul params x tokens/s, ``Run.flops_per_token``) / fp32 matmul
peak, the peak measured (``lmforge.runtime.hardware.matmul_peak_gflops``) right before each timed lmforge
step; also the FLOPs lmforge actually executes (LM head on the loss positions only) / peak.

    python benchmarks/bench_sft.py                 # SmolLM2-135M-Instruct, 1 warm-up + 3 timed steps
    python benchmarks/bench_sft.py --steps 5 --plain --bf16
    python benchmarks/bench_sft.py --trl-defaults  # + TRL with its own defaults (bf16, checkpointing)
    python benchmarks/bench_sft.py --quick         # tiny random Llama, seconds (smoke check)
    python benchmarks/bench_sft.py --profile       # + torch.profiler breakdown of one step of each

Optional contestants (not part of the headline): ``plain`` (``model(**batch).loss``, full logits,
default AdamW), ``lmforge_bf16`` (the same lmforge step with ``train.dtype=bf16`` autocast).

The lmforge step is the recipe's own step, ``supervised/step.py: supervised_step`` (one
micro-batch per step), on the state that ``runtime.run.start_run`` / ``runtime.loop.build_state``
build for ``lmforge sft`` (Root module, fused AdamW, LR schedule, global-norm clip 1.0, precision,
threads); only the row order is the benchmark's (consecutive, as TRL's sequential sampler).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
import warnings

import torch

from lmforge.core.config import ModelConfig, OptimConfig, TrainConfig
from lmforge.data.sft import CHAT_SMALL, SFTExample, collate_sft, load_sft_rows, tokenize_sft
from lmforge.model.load import count_parameters, load_model
from lmforge.recipes.sft import SFTConfig
from lmforge.runtime import hardware
from lmforge.runtime.loop import build_state
from lmforge.runtime.optim import count_loss_tokens
from lmforge.runtime.run import Run, start_run
from lmforge.supervised.step import SupervisedData, supervised_step

LR, MAX_GRAD_NORM = 2e-5, 1.0


# ----------------------------------------------------------------------------- data


def packed_rows(tokenizer, seq_len: int, max_len: int = 4096) -> list[SFTExample]:
    """chat_small.jsonl -> rows of exactly ``seq_len`` tokens: conversations (completion-only mask)
    concatenated in file order and cut every ``seq_len`` tokens; the incomplete tail is dropped."""
    data = tokenize_sft(load_sft_rows(CHAT_SMALL), tokenizer, max_len, completion_only=True)
    ids = [t for ex in data.examples for t in ex.input_ids]
    mask = [m for ex in data.examples for m in ex.loss_mask]
    return [SFTExample(ids[i : i + seq_len], mask[i : i + seq_len]) for i in range(0, len(ids) - seq_len + 1, seq_len)]


# ----------------------------------------------------------------------------- contestants


def batch_rows(rows: list, step: int, batch: int) -> list:
    """The rows of step ``step``: consecutive, in order, dropping the incomplete batch of each epoch
    (TRL gets the same: sequential sampler, ``dataloader_drop_last``)."""
    start = (step % (len(rows) // batch)) * batch
    return rows[start : start + batch]


class SequentialOrder:
    """The benchmark's row order for lmforge's step: consecutive batches (``batch_rows``)."""

    def __init__(self, num_rows: int, batch: int):
        self.num_rows, self.batch, self.step = num_rows, batch, 0

    def next(self) -> list[int]:
        start = (self.step % (self.num_rows // self.batch)) * self.batch
        self.step += 1
        return list(range(start, start + self.batch))


class Quiet:
    def print(self, *args, **kwargs):
        pass


class LmforgeStep:
    """One optimizer step of ``lmforge sft``: ``supervised_step`` on the recipe's own training state."""

    def __init__(
        self, model, tokenizer, rows, batch: int, pad_id: int, max_steps: int, out_dir: str, dtype: str = "fp32"
    ):
        cfg = SFTConfig(
            optim=OptimConfig(lr=LR, weight_decay=0.0, warmup_steps=0, schedule="linear", max_grad_norm=MAX_GRAD_NORM),
            train=TrainConfig(
                output_dir=out_dir,
                max_steps=max_steps,
                batch_size=batch,
                micro_batch_size=batch,
                dtype=dtype,
                threads=torch.get_num_threads(),
                gradient_checkpointing="off",
                device="cpu",
            ),
        )
        run = start_run(cfg, "bench", model, seq_len=len(rows[0].input_ids), console=Quiet())
        self.state = build_state(run, model, tokenizer, SequentialOrder(len(rows), batch), max_steps)
        self.data = SupervisedData(rows, [], lambda part: collate_sft(part, pad_id))
        self.step = 0

    def __call__(self) -> tuple[int, int, float]:
        """-> (tokens, loss tokens, loss)."""
        self.step += 1
        metrics = supervised_step(self.state, self.data, self.step)
        return metrics["num_tokens"], metrics["loss_tokens"], float(metrics["loss"])


class PlainStep:
    """Reference: the textbook loop, ``model(input_ids, labels).loss`` (full logits), default AdamW."""

    def __init__(self, model, rows, batch: int, pad_id: int):
        self.model = model.train()
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        self.rows, self.batch, self.pad_id, self.step = rows, batch, pad_id, 0

    def __call__(self) -> tuple[int, int, float]:
        batch = collate_sft(batch_rows(self.rows, self.step, self.batch), self.pad_id)
        loss = self.model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return int(batch["attention_mask"].sum()), count_loss_tokens(batch["labels"]), float(loss)


def trl_trainer(model, tokenizer, rows, args, out_dir: str, callback, max_steps: int, defaults: bool = False):
    """TRL's SFTTrainer on the packed rows. ``defaults=False``: the benchmark's settings (fp32, no
    activation checkpointing); ``defaults=True``: SFTConfig's own precision / checkpointing defaults
    (bf16 autocast, activation checkpointing on), everything else the same."""
    from datasets import Dataset
    from transformers.utils import logging as hf_logging
    from trl import SFTConfig, SFTTrainer

    hf_logging.set_verbosity_error()
    dataset = Dataset.from_dict(
        {"input_ids": [r.input_ids for r in rows], "completion_mask": [r.loss_mask for r in rows]}
    )
    precision = {} if defaults else dict(bf16=False, fp16=False, activation_checkpointing=False)
    config = SFTConfig(
        output_dir=out_dir,
        use_cpu=True,
        **precision,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        max_steps=max_steps,
        max_length=args.seq_len,
        packing=False,
        completion_only_loss=True,
        learning_rate=LR,
        weight_decay=0.0,
        warmup_steps=0,
        lr_scheduler_type="linear",
        max_grad_norm=MAX_GRAD_NORM,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        dataloader_drop_last=True,
        disable_tqdm=True,
        seed=0,
        train_sampling_strategy="sequential",  # the same rows in the same order as lmforge
    )
    return SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[callback])


# ----------------------------------------------------------------------------- profile

HEAD_DIMS = {49152, 32768, 16384}  # SmolLM2 vocab and TRL's 32768-wide vocab tiles


def category(name: str, shapes) -> str:
    dims = {d for shape in shapes or [] for d in (shape or []) if isinstance(d, int)}
    is_mm = name in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm")
    if is_mm and dims & HEAD_DIMS:
        return "LM head matmuls"
    if is_mm:
        return "decoder matmuls"
    if dims & HEAD_DIMS:
        return "LM head / loss elementwise (softmax, exp, ...)"
    if "scaled_dot_product" in name:
        return "attention (sdpa fwd + bwd)"
    if "adam" in name or "foreach" in name or "vector_norm" in name:
        return "optimizer + grad clip"
    if name in (
        "aten::copy_",
        "aten::fill_",
        "aten::zero_",
        "aten::cat",
        "aten::index_put_",
        "aten::index",
        "aten::embedding_dense_backward",
        "aten::index_add_",
        "aten::nonzero",
    ):
        return "copies / fills / indexing"
    return "elementwise (norm, rotary, SiLU, residual, ...)"


def print_profile(name: str, prof, rows_limit: int) -> None:
    events = prof.key_averages(group_by_input_shape=True)
    totals: dict[str, float] = {}
    for e in events:
        if e.key.startswith("aten::") or e.key.startswith("mkldnn"):
            cat = category(e.key, e.input_shapes)
            totals[cat] = totals.get(cat, 0.0) + e.self_cpu_time_total / 1e6
    total = sum(totals.values())
    print(f"\n[profile] {name}: one step, {total:.1f} s of aten op self time", flush=True)
    for cat, secs in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {cat:48s} {secs:7.2f} s  {secs / total:6.1%}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows_limit), flush=True)


def profile_one(name: str, fn, rows_limit: int = 15) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    print_profile(name, prof, rows_limit)


def profile_trl(model, tokenizer, rows, args, out_dir: str, rows_limit: int = 15) -> None:
    """Profile TRL's second step (the first one warms up) of a fresh 2-step ``trainer.train()``."""
    from torch.profiler import ProfilerActivity, profile, schedule
    from transformers import TrainerCallback

    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True, schedule=schedule(wait=1, warmup=0, active=1))

    class Step(TrainerCallback):
        def on_step_end(self, *a, **k):
            prof.step()

    prof.start()
    trl_trainer(model, tokenizer, rows, args, out_dir, Step(), max_steps=2).train()
    prof.stop()
    print_profile("trl", prof, rows_limit)


# ----------------------------------------------------------------------------- timing


def clock() -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads)."""
    return time.perf_counter(), time.process_time()


def alternate(trainer_factory, others: dict, args, label: str):
    """Run TRL for warmup + steps steps; after each TRL step run each of ``others`` once (order
    reversed every step). Returns {name: [(wall s, cpu s, loss tokens) per timed step]} and the
    matmul peaks."""
    from transformers import TrainerCallback

    times: dict[str, list[tuple[float, float]]] = {label: [], **{n: [] for n in others}}
    peaks: list[float] = []
    state = {"mark": (0.0, 0.0), "step": 0}

    def since(mark):
        now = clock()
        return now[0] - mark[0], now[1] - mark[1]

    class Alternate(TrainerCallback):
        def on_train_begin(self, *a, **k):
            state["mark"] = clock()

        def on_step_end(self, *a, **k):
            trl_time = since(state["mark"])
            timed = state["step"] >= args.warmup
            line = [
                f"step {state['step']}{'' if timed else ' (warm-up)'}: "
                f"{label} {trl_time[0]:6.1f}s (cpu {trl_time[1]:5.1f}s)"
            ]
            if timed:
                times[label].append((*trl_time, 0))
            names = list(others) if state["step"] % 2 == 0 else list(reversed(others))
            for name in names:
                if name == "lmforge" and timed:
                    peaks.append(hardware.matmul_peak_gflops())
                start = clock()
                tokens, loss_tokens, loss = others[name]()
                elapsed = since(start)
                assert tokens == args.batch * args.seq_len, tokens
                if timed:
                    times[name].append((*elapsed, loss_tokens))
                line.append(
                    f"{name} {elapsed[0]:6.1f}s (cpu {elapsed[1]:5.1f}s, loss {loss:.3f}, {loss_tokens} loss tokens)"
                )
            print("  ".join(line), flush=True)
            state["step"] += 1
            state["mark"] = clock()

    trainer = trainer_factory(Alternate())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(f"[bench] {label} losses: " + " ".join(f"{x:.3f}" for x in losses), flush=True)
    return times, peaks


def report(times, base: str, args, model, peaks: list[float]) -> None:
    """Per contestant: median and best wall time per step, tokens/s at the median, the paired ratio
    (median over steps of base-step time / the time of this contestant's step right after it: the
    headline, as adjacent steps see the same load), the CPU-time ratio and MFU."""
    tokens = args.batch * args.seq_len
    wall = {name: statistics.median(t[0] for t in steps) for name, steps in times.items()}
    best = {name: min(t[0] for t in steps) for name, steps in times.items()}
    cpu = {name: statistics.median(t[1] for t in steps) for name, steps in times.items()}
    paired = {name: statistics.median(b[0] / s[0] for b, s in zip(times[base], steps)) for name, steps in times.items()}
    rate = {name: tokens / t for name, t in wall.items()}
    peak = statistics.median(peaks)
    flops_per_token = Run.flops_per_token(model)
    print(
        f"\n{args.steps} timed steps of {args.batch} x {args.seq_len} = {tokens} tokens each; "
        f"x = speed vs {base}; paired = median of per-step ratios; "
        f"cpu = process CPU s/step ({torch.get_num_threads()} threads)"
    )
    print(
        f"  {'':13s} {'median s':>9s} {'best s':>7s} {'tokens/s':>9s} {'x median':>9s} {'x best':>7s} "
        f"{'x paired':>9s} {'cpu s':>6s} {'x cpu':>6s}  steps"
    )
    for name, steps in times.items():
        print(
            f"  {name:13s} {wall[name]:9.2f} {best[name]:7.2f} {rate[name]:9.1f} {wall[base] / wall[name]:9.2f} "
            f"{best[base] / best[name]:7.2f} {paired[name]:9.2f} {cpu[name]:6.1f} {cpu[base] / cpu[name]:6.2f}  "
            + " ".join(f"{t[0]:.3g}" for t in steps)
        )
    # MFU, the convention of runtime/run.py: 6 x matmul params per token; lmforge runs the tied
    # LM head only on loss positions, so also the FLOPs it executes (attention scores included).
    cfg = model.config
    head = model.get_output_embeddings().weight.numel()
    loss_positions = statistics.mean(t[2] for t in times["lmforge"])
    attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * args.seq_len * tokens / 2  # causal half
    executed = 6 * (flops_per_token / 6 - head) * tokens + 6 * head * loss_positions + attention
    achieved = flops_per_token * rate["lmforge"] / 1e9
    print(
        f"lmforge MFU (6 x {flops_per_token / 6 / 1e6:.1f}M params x tokens/s, runtime/run.py): "
        f"{achieved:.1f} GFLOP/s / {peak:.1f} GFLOP/s fp32 matmul peak (median of {len(peaks)} measured "
        f"before each lmforge step) = {achieved / peak:.1%}; FLOPs actually executed "
        f"({executed / 1e12:.2f} TFLOP/step: head on {loss_positions:.0f} loss positions only) / peak = "
        f"{executed / wall['lmforge'] / 1e9 / peak:.1%}"
    )
    print(
        f"RESULT vs={base} lmforge_tok_s={rate['lmforge']:.1f} {base}_tok_s={rate[base]:.1f} "
        f"ratio_paired={paired['lmforge']:.2f} ratio_median={wall[base] / wall['lmforge']:.2f} "
        f"ratio_best={best[base] / best['lmforge']:.2f} ratio_cpu={cpu[base] / cpu['lmforge']:.2f} "
        f"mfu={achieved / peak:.3f}",
        flush=True,
    )


# ----------------------------------------------------------------------------- main


def load(quick: bool):
    if quick:
        return load_model(
            ModelConfig(name="tiny:llama", hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=1024)
        )
    return load_model(ModelConfig(name="smollm2-135m-instruct"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contestant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per contestant first")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="tiny random Llama: a smoke run in seconds")
    parser.add_argument("--plain", action="store_true", help="add a plain PyTorch loop as a contestant")
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="add lmforge with train.dtype=bf16 (autocast) as a contestant (not in the headline)",
    )
    parser.add_argument(
        "--trl-defaults",
        action="store_true",
        help="then a second phase: TRL with SFTConfig's defaults (bf16 autocast + activation "
        "checkpointing) vs lmforge fp32",
    )
    parser.add_argument("--profile", action="store_true", help="after timing, profile one step of each")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads for all contestants (default: lmforge's choice, the usable cores)",
    )
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    hw = hardware.detect("cpu")
    choices = hardware.choose(
        hw, dtype="fp32", threads=args.threads, micro_batch_size=args.batch, gradient_checkpointing="off"
    )
    hardware.apply(choices)  # what start_run does: torch threads = usable cores (one process: TRL too)
    torch.manual_seed(0)
    model, tokenizer = load(args.quick)
    rows = packed_rows(tokenizer, args.seq_len)
    if len(rows) < args.batch:
        raise SystemExit(f"only {len(rows)} packed rows of {args.seq_len} tokens; lower --seq-len or --batch")
    mask_frac = sum(sum(r.loss_mask) for r in rows) / (len(rows) * args.seq_len)
    total = args.warmup + args.steps
    pad_id = tokenizer.pad_token_id
    import trl

    print(
        f"[bench] model={'tiny' if args.quick else 'SmolLM2-135M-Instruct'} "
        f"params={count_parameters(model) / 1e6:.1f}M fp32 threads={torch.get_num_threads()} "
        f"cores={hw.num_cores} torch={torch.__version__} trl={trl.__version__} batch={args.batch} "
        f"seq_len={args.seq_len} packed_rows={len(rows)} completion_tokens={mask_frac:.1%} "
        f"steps={args.warmup}+{args.steps}",
        flush=True,
    )

    trl_model = copy.deepcopy(model)
    trl_defaults_model = copy.deepcopy(model) if args.trl_defaults else None
    with tempfile.TemporaryDirectory() as out_dir:
        contestants = {
            "lmforge": LmforgeStep(
                copy.deepcopy(model), tokenizer, rows, args.batch, pad_id, 2 * total, f"{out_dir}/lmforge"
            )
        }
        if args.plain:
            contestants["plain"] = PlainStep(copy.deepcopy(model), rows, args.batch, pad_id)
        if args.bf16:
            contestants["lmforge_bf16"] = LmforgeStep(
                copy.deepcopy(model), tokenizer, rows, args.batch, pad_id, 2 * total, f"{out_dir}/lmforge_bf16", "bf16"
            )
        times, peaks = alternate(
            lambda cb: trl_trainer(trl_model, tokenizer, rows, args, out_dir, cb, total), contestants, args, "trl"
        )
        report(times, "trl", args, model, peaks)
        if args.trl_defaults:
            print("\n[bench] phase 2: TRL with SFTConfig defaults (bf16 autocast, activation checkpointing)")
            times, peaks = alternate(
                lambda cb: trl_trainer(trl_defaults_model, tokenizer, rows, args, out_dir, cb, total, True),
                {"lmforge": contestants["lmforge"]},
                args,
                "trl_defaults",
            )
            report(times, "trl_defaults", args, model, peaks)
        if args.profile:
            profile_one("lmforge", contestants["lmforge"])
            if "plain" in contestants:
                profile_one("plain", contestants["plain"])
            profile_trl(trl_model, tokenizer, rows, args, out_dir)


if __name__ == "__main__":
    main()
