"""``lmforge antidistill <stage> CONFIG``: the antidistillation sampling pipeline (Savani et al. 2025).

One config, one work directory (``run.workdir``); each stage reads what the previous one wrote
(layout in lmforge/antidistill/pipeline.py):

    traces   the teacher answers held-out prompts (greedy by default); scored; JSONL + accuracy
    grad     the proxy's average completion-only NLL gradient on those traces (torchrun: rank 0 writes)
    sample   the teacher samples the distillation prompts at every (T, lam) of the sweep; lam = 0 is
             plain temperature sampling, lam > 0 adds the ADS term (paper convention, after 1/T)
    distill  a fresh student is fine-tuned (the SFT recipe) on each setting's traces
    eval     teacher, undistilled student and every distilled student on the test split
    report   markdown table + PNG: student accuracy vs teacher accuracy, ADS vs temperature sampling
    all      the six stages in order

The math and the core functions are in lmforge/antidistill/ads.py and docs/antidistillation.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from pathlib import Path
from typing import Literal

import torch

from ..antidistill import pipeline as pipe
from ..antidistill.ads import (
    ads_generate,
    check_same_tokenizer,
    load_gradient,
    perturbed_copies,
    proxy_gradient,
    random_direction,
    save_gradient,
)
from ..core.config import LoggingConfig, ModelConfig, OptimConfig, TrainConfig, opt, refuse_ignored, section, to_dict
from ..core.errors import ConfigError
from ..data.rows_task import COLUMN_NAMES as ROWS_COLUMNS
from ..data.sft import encode_prompt, tokenize_sft, uses_chat_format
from ..data.tasks import SPLITS, get_task
from ..model.load import load_model, load_tokenizer_for
from ..parallel.context import init_parallel, torchrun_world
from ..recipes.sft import SFTConfig, run_sft
from ..rollout.engine import SamplingParams, generate
from ..rollout.evaluation import task_accuracy
from ..runtime import hardware
from ..runtime.metrics import make_console
from ..runtime.run import local_world_size
from ..supervised.sft_data import SFTDataConfig

Split = Literal["train", "val", "test"]


@dataclasses.dataclass
class AdsDataConfig:
    task: str = opt(
        "addition",
        "task with a verifier: built-in (addition, addition:digits=3, ...) or a "
        "reasoning-gym dataset, rg:<name>[:key=value,...] (docs/rewards.md)",
    )
    path: str = opt(
        "",
        "instead of data.task: rows with a 'prompt' and an 'answer' from any source of docs/data.md "
        "(JSONL, Parquet, CSV, Arrow, a save_to_disk dir, a cached hub id); each row's split is a "
        "hash of its prompt (80/10/10)",
    )
    source_split: str = opt("train", "path: the split of the source to read")
    subset: str = opt("", "path: the hub dataset's config name")
    columns: dict[str, str] = opt(
        {}, "path: lmforge name -> the data's column, e.g. {prompt: question, answer: solution}", keys=ROWS_COLUMNS
    )
    reward: str = opt(
        "exact",
        "path: how a trace is scored: exact (stripped completion == answer), math (math-verify: "
        "boxed or last number) or package.module:function; correct = 1",
    )
    heldout_split: Split = opt("val", "split of the held-out prompts whose teacher traces give the proxy gradient")
    num_heldout: int = opt(256, "held-out prompts (traces stage)")
    prompt_split: Split = opt("train", "split of the prompts the teacher samples for distillation")
    num_prompts: int = opt(1024, "distillation prompts (sample stage)")
    samples_per_prompt: int = opt(1, "sampled traces per distillation prompt")
    test_split: Split = opt("test", "split the eval stage scores teacher and students on")
    num_test: int = opt(256, "test prompts (eval stage)")
    max_new_tokens: int = opt(32, "longest completion (every stage that generates)")
    max_len: int = opt(256, "longest tokenized prompt + completion (proxy gradient and distillation)")
    use_chat_template: Literal["auto", "on", "off"] = opt(
        "auto", "wrap prompts in the chat template (auto: if the tokenizer has its own)"
    )
    seed: int = opt(0, "seed of the problem draws and of sampling")

    def validate(self) -> None:
        if not self.path:
            refuse_ignored(
                self,
                "data",
                ("source_split", "subset", "columns", "reward"),
                f"without data.path (the task {self.task!r} brings its own problems and scorer)",
            )
        splits = (self.heldout_split, self.prompt_split, self.test_split)
        if len(set(splits)) != 3:
            raise ConfigError(
                f"data.heldout_split, data.prompt_split and data.test_split must be three different "
                f"splits of {SPLITS}, got {splits}"
            )
        for name in ("num_heldout", "num_prompts", "samples_per_prompt", "num_test", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"data.{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass
class TracesConfig:
    temperature: float = opt(0.0, "teacher temperature for the held-out traces (0 = greedy)")
    batch_size: int = opt(64, "prompts per generation batch")


@dataclasses.dataclass
class GradConfig:
    batch_size: int = opt(16, "traces per forward/backward (does not change the gradient)")


@dataclasses.dataclass
class SampleConfig:
    temperatures: list[float] = opt([1.0], "sampling temperatures T (> 0); every T is run with every lam")
    lams: list[float] = opt(
        [0.0, 0.1],
        "ADS weights lam, paper convention: the term is added after dividing "
        "the teacher logits by T (reference-code lam_ref = lam * T); lam = 0 is plain "
        "temperature sampling",
    )
    eps: float = opt(1e-2, "finite-difference step: proxies at theta +- eps * g (keep eps * |g| ~ 1e-2)")
    direction: Literal["proxy", "random"] = opt(
        "proxy",
        "proxy: perturb the proxies along the proxy gradient g (ADS); random: along a seeded random "
        "direction with g's norm (the control; settings are named T<T>-lam<lam>-random)",
    )
    direction_seed: int = opt(0, "seed of the random direction (sample.direction=random)")
    top_k: int = opt(0, "sample only among the k most likely tokens of the (adjusted) distribution (0 = off)")
    top_p: float = opt(1.0, "nucleus sampling on the (adjusted) distribution (1 = off; the reference used 0.95)")
    seed: int = opt(
        -1,
        "seed of the sampling (traces and sample stages); -1 = data.seed. Changes the random "
        "numbers only, not the prompts, so seeds can be repeated on the same problems",
    )
    batch_size: int = opt(64, "prompts per generation batch")

    def validate(self) -> None:
        if not self.temperatures or not self.lams:
            raise ConfigError("sample.temperatures and sample.lams must each hold at least one value")
        if any(not t > 0 for t in self.temperatures):
            raise ConfigError(
                f"sample.temperatures must all be > 0 (ADS tilts a distribution), got {self.temperatures}"
            )
        if len(set(self.temperatures)) != len(self.temperatures) or len(set(self.lams)) != len(self.lams):
            raise ConfigError("sample.temperatures and sample.lams must not repeat values")
        if not self.eps > 0:
            raise ConfigError(f"sample.eps must be > 0 (the paper uses 1e-2), got {self.eps}")
        if self.top_k < 0:
            raise ConfigError(f"sample.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"sample.top_p must be in (0, 1] (1 = off), got {self.top_p}")


@dataclasses.dataclass
class DistillConfig:
    optim: OptimConfig = section(OptimConfig, "student optimizer and LR schedule")
    max_steps: int = opt(200, "optimizer steps per student")
    batch_size: int = opt(32, "rows per optimizer step")
    micro_batch_size: int = opt(32, "rows per forward pass (splits the batch; 0 = chosen by hardware tier)")
    val_fraction: float = opt(0.05, "fraction of each trace set held out for the student's validation loss")
    seed: int = opt(-1, "seed of the student's training (data order); -1 = data.seed")

    def validate(self) -> None:
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(
                f"distill.val_fraction must be in [0, 1) (a fraction: 0.05 holds out 5%), got {self.val_fraction}"
            )


@dataclasses.dataclass
class RunConfig:
    workdir: str = opt("runs/antidistill", "directory every stage writes its outputs to and reads its inputs from")
    device: str = opt("auto", "auto | cpu | cuda | cuda:N | mps")
    threads: int = opt(0, "CPU threads for torch (0 = all usable cores)")
    dtype: Literal["fp32", "bf16"] = opt(
        "fp32",
        "dtype of the teacher and the perturbed proxies while sampling (traces and sample stages); "
        "the proxy gradient is always computed in fp32 and the proxies perturbed in fp32 before the cast",
    )
    progress: bool = opt(True, "show progress bars")


@dataclasses.dataclass
class AntidistillConfig:
    teacher: ModelConfig = section(ModelConfig, "the teacher whose traces are protected (trained elsewhere)")
    proxy: ModelConfig = section(ModelConfig, "the proxy student: small, same tokenizer as the teacher")
    student: ModelConfig = section(ModelConfig, "the student distilled from each trace set (fresh each time)")
    data: AdsDataConfig = section(AdsDataConfig, "task, splits and sizes")
    traces: TracesConfig = section(TracesConfig, "held-out teacher traces (for the proxy gradient)")
    grad: GradConfig = section(GradConfig, "proxy gradient")
    sample: SampleConfig = section(SampleConfig, "the (T, lam) sweep")
    distill: DistillConfig = section(DistillConfig, "student fine-tuning on each trace set")
    run: RunConfig = section(RunConfig, "work directory and hardware")

    def validate(self) -> None:
        for role in ("teacher", "proxy"):  # (ModelConfig has a lora section; only the student trains)
            if getattr(self, role).lora.r:
                raise ConfigError(
                    f"{role}.lora.r: the {role} is not trained here; LoRA is for the student (student.lora.r)"
                )


# ----------------------------------------------------------------------------- shared pieces

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _seed(seed: int, cfg: AntidistillConfig) -> int:
    """A stage's own seed, or data.seed when it is -1."""
    return cfg.data.seed if seed == -1 else seed


def _settings(cfg: AntidistillConfig) -> list[tuple[float, float]]:
    """(T, lam) for every sweep setting, temperature-major."""
    return [(t, lam) for t in cfg.sample.temperatures for lam in cfg.sample.lams]


def _start(cfg: AntidistillConfig, console, stage: str):
    """Console, device, threads and the parallel context of a stage (under torchrun: the process
    group of the runtime, one per command); prints what was chosen, from rank 0 only."""
    hw = hardware.detect(cfg.run.device)
    ctx, device = init_parallel("ddp", torch.device(hw.device))
    threads = cfg.run.threads or (max(hw.num_cores // local_world_size(), 1) if ctx.distributed else 0)
    choices = hardware.choose(hw, threads=threads)
    hardware.apply(choices)
    console = console or make_console()
    if not ctx.is_main:
        console.quiet = True
    console.print(
        f"[antidistill {stage}] device={device} threads={choices.threads} "
        f"workdir={cfg.run.workdir}" + (f" ranks={ctx.world_size}" if ctx.distributed else ""),
        markup=False,
    )
    return console, device, ctx


def _load(model_cfg: ModelConfig, device, role: str, dtype: torch.dtype = torch.float32):
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a "Loading weights" bar per model is noise
    model, tokenizer = load_model(model_cfg)
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ConfigError(f"the {role} tokenizer needs eos and pad tokens")
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def _check_tokenizers(teacher_tok, proxy_tok) -> None:
    try:
        check_same_tokenizer(teacher_tok, proxy_tok)
    except ValueError as exc:
        raise ConfigError(f"{exc} (set teacher.tokenizer / proxy.tokenizer, or pick another proxy)") from exc


@contextlib.contextmanager
def _progress(console, enabled: bool, description: str, total: int):
    """Yields ``advance(n)``: a transient rich progress bar, or a no-op when disabled."""
    if not enabled:
        yield lambda n=1: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task_id = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task_id, n)


def _sample_traces(
    cfg,
    ctx,
    teacher,
    tokenizer,
    task,
    problems,
    temperature: float,
    lam: float,
    proxies,
    num_samples: int,
    batch_size: int,
    console,
    description: str,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[list[dict], dict]:
    """Sample the teacher (ADS when lam != 0, else plain) on ``problems``; returns (rows, stats).

    ``stats["kl_per_token"]`` is the mean over sampled tokens of KL(ADS || tempered teacher) of each
    step's full distributions (0 for plain sampling), so settings can be compared at matched KL.

    Under torchrun each rank samples a contiguous share of the problems with its own seeds; every
    rank gets all rows back in problem order (rank 0 writes them).
    """
    chat = uses_chat_format(tokenizer, cfg.data.use_chat_template)
    bounds = [len(problems) * r // ctx.world_size for r in range(ctx.world_size + 1)]
    problems = problems[bounds[ctx.rank] : bounds[ctx.rank + 1]]
    rows, kl_sum, num_tokens = [], 0.0, 0
    start = time.perf_counter()
    with _progress(console, cfg.run.progress and ctx.is_main, description, len(problems)) as advance:
        for index, first in enumerate(range(0, len(problems), batch_size)):
            chunk = problems[first : first + batch_size]
            prompts = [encode_prompt(tokenizer, p.prompt, chat) for p in chunk]
            params = SamplingParams(
                temperature=temperature,
                max_new_tokens=cfg.data.max_new_tokens,
                top_k=top_k,
                top_p=top_p,
                stop_token_ids=[tokenizer.eos_token_id],
                seed=_seed(cfg.sample.seed, cfg) + index + 1_000_003 * ctx.rank,
            )
            if lam == 0:
                batch = generate(teacher, prompts, params, num_samples=num_samples, pad_token_id=tokenizer.pad_token_id)
            else:
                batch = ads_generate(
                    teacher,
                    *proxies,
                    prompts,
                    params,
                    lam,
                    cfg.sample.eps,
                    num_samples=num_samples,
                    pad_token_id=tokenizer.pad_token_id,
                    vocab_size=len(tokenizer),
                )
            rows += pipe.trace_rows(batch, chunk, tokenizer, task)
            kl, tokens = pipe.kl_sums(batch)
            kl_sum, num_tokens = kl_sum + kl, num_tokens + tokens
            advance(len(chunk))
    seconds = time.perf_counter() - start
    if ctx.distributed:
        parts = ctx.gather_objects((rows, kl_sum, num_tokens, seconds))
        rows = [row for part in parts for row in part[0]]
        kl_sum, num_tokens = sum(p[1] for p in parts), sum(p[2] for p in parts)
        seconds = max(p[3] for p in parts)
    stats = {
        "teacher_accuracy": pipe.accuracy(rows),
        "num_traces": len(rows),
        "num_truncated": sum(r["truncated"] for r in rows),
        "kl_per_token": kl_sum / max(num_tokens, 1),
        "num_completion_tokens": num_tokens,
        "seconds": seconds,
        "tokens_per_s": num_tokens / seconds,
    }
    return rows, stats


REWARD_TIMEOUT_S = 30.0  # data.path rows: the longest one scoring call may take


def _task(cfg: AntidistillConfig):
    """The problems' source: data.path rows (scored by data.reward) or the task data.task."""
    if not cfg.data.path:
        return get_task(cfg.data.task)
    from ..data.rows_task import RowsTask
    from ..rollout.rewards import RewardSet

    # through a RewardSet: the reward's own executor (a process pool for math) and a per-call timeout,
    # so a pathological completion cannot hang a stage
    rewards = RewardSet([(cfg.data.reward, 1.0)], max_failure_fraction=1.0, timeout_s=REWARD_TIMEOUT_S, workers=1)

    def score(text: str, problem) -> float:
        out = rewards([text], [problem])
        if int(out.num_failed.sum()):
            timed_out = int(out.num_timed_out.sum()) if out.num_timed_out.numel() else 0
            raise RuntimeError(
                "timed out after {:g} s".format(REWARD_TIMEOUT_S)
                if timed_out
                else "it raised (the error is logged above)"
            )
        return float(out.total[0])

    return RowsTask.load(
        cfg.data.path,
        cfg.data.source_split,
        cfg.data.subset,
        cfg.data.columns,
        score_fn=score,
        score_name=cfg.data.reward,
    )


# ----------------------------------------------------------------------------- stages


def run_traces(cfg: AntidistillConfig, console=None) -> dict:
    """Teacher traces on the held-out split, scored: traces/heldout.jsonl + traces/summary.json."""
    console, device, ctx = _start(cfg, console, "traces")
    task = _task(cfg)
    teacher, tokenizer = _load(cfg.teacher, device, "teacher", _DTYPES[cfg.run.dtype])
    problems = task.make_problems(cfg.data.num_heldout, cfg.data.seed, cfg.data.heldout_split)
    rows, stats = _sample_traces(
        cfg,
        ctx,
        teacher,
        tokenizer,
        task,
        problems,
        cfg.traces.temperature,
        0.0,
        None,
        1,
        cfg.traces.batch_size,
        console,
        "held-out traces",
        cfg.sample.top_k,
        cfg.sample.top_p,
    )
    path = pipe.heldout_path(Path(cfg.run.workdir))
    summary = {"split": cfg.data.heldout_split, "temperature": cfg.traces.temperature, **stats, "config": to_dict(cfg)}
    if ctx.is_main:
        pipe.write_jsonl(path, rows)
        pipe.write_json(path.with_name("summary.json"), summary)
    ctx.barrier()
    console.print(
        f"[antidistill traces] teacher accuracy {100 * stats['teacher_accuracy']:.1f}% on "
        f"{len(rows)} {cfg.data.heldout_split} prompts -> {path}",
        markup=False,
    )
    return summary


def run_grad(cfg: AntidistillConfig, console=None) -> dict:
    """Proxy gradient on the held-out traces: grad/proxy_grad.safetensors (+ summary.json), rank 0 writes."""
    console, device, ctx = _start(cfg, console, "grad")
    workdir = Path(cfg.run.workdir)
    rows = pipe.read_jsonl(pipe.require(pipe.heldout_path(workdir), "traces"))
    rank, world = ctx.rank, ctx.world_size
    proxy, proxy_tok = _load(cfg.proxy, device, "proxy")
    _check_tokenizers(load_tokenizer_for(cfg.teacher), proxy_tok)
    shard = rows[rank::world]
    examples = (
        tokenize_sft(
            shard, proxy_tok, cfg.data.max_len, completion_only=True, use_chat_template=cfg.data.use_chat_template
        ).examples
        if shard
        else []
    )
    batches = pipe.gradient_batches(examples, proxy_tok.pad_token_id, cfg.grad.batch_size)
    num_batches = -(-len(examples) // cfg.grad.batch_size)
    with _progress(console, cfg.run.progress and rank == 0, "proxy gradient", num_batches) as advance:
        grads, meta = proxy_gradient(
            proxy.requires_grad_(True), batches, model_id=cfg.proxy.name, progress=lambda done, _: advance(1)
        )
    summary = {**meta, "config": to_dict(cfg)}
    if rank == 0:
        path = pipe.grad_path(workdir)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_gradient(grads, meta, path)
        pipe.write_json(path.with_name("summary.json"), summary)
        console.print(
            f"[antidistill grad] {meta['num_sequences']} traces, {meta['num_tokens']} completion tokens, "
            f"world size {world}, |g| = {meta['grad_norm']:.4g} (eps * |g| = "
            f"{cfg.sample.eps * meta['grad_norm']:.3g}) -> {path}",
            markup=False,
        )
    ctx.barrier()
    return summary


def run_sample(cfg: AntidistillConfig, console=None) -> list[dict]:
    """Teacher traces on the distillation prompts for every (T, lam): samples/<setting>/traces.jsonl."""
    console, device, ctx = _start(cfg, console, "sample")
    workdir = Path(cfg.run.workdir)
    grads, meta = load_gradient(pipe.require(pipe.grad_path(workdir), "grad"))
    direction = cfg.sample.direction
    if direction == "random":
        grads = random_direction(grads, cfg.sample.direction_seed)
    dtype = _DTYPES[cfg.run.dtype]
    teacher, tokenizer = _load(cfg.teacher, device, "teacher", dtype)
    proxies = None
    if any(lam != 0 for lam in cfg.sample.lams):
        proxy, proxy_tok = _load(cfg.proxy, device, "proxy")  # fp32: perturbed in fp32, then cast once
        _check_tokenizers(tokenizer, proxy_tok)
        proxies = tuple(copy.to(dtype) for copy in perturbed_copies(proxy, grads, cfg.sample.eps))
        del proxy
    task = _task(cfg)
    problems = task.make_problems(cfg.data.num_prompts, cfg.data.seed, cfg.data.prompt_split)
    summaries = []
    for temperature, lam in _settings(cfg):
        name = pipe.setting_name(temperature, lam, direction)
        rows, stats = _sample_traces(
            cfg,
            ctx,
            teacher,
            tokenizer,
            task,
            problems,
            temperature,
            lam,
            proxies,
            cfg.data.samples_per_prompt,
            cfg.sample.batch_size,
            console,
            f"sample {name}",
            cfg.sample.top_k,
            cfg.sample.top_p,
        )
        out = pipe.sample_dir(workdir, temperature, lam, direction)
        summary = {
            "name": name,
            "temperature": temperature,
            "lam": lam,
            "direction": "none" if lam == 0 else direction,
            "eps": cfg.sample.eps,
            "top_k": cfg.sample.top_k,
            "top_p": cfg.sample.top_p,
            "dtype": cfg.run.dtype,
            "grad_norm": meta.get("grad_norm"),
            **stats,
            "config": to_dict(cfg),
        }
        if ctx.is_main:
            pipe.write_jsonl(out / "traces.jsonl", rows)
            pipe.write_json(out / "summary.json", summary)
        ctx.barrier()
        summaries.append(summary)
        console.print(
            f"[antidistill sample] {name}: teacher accuracy {100 * stats['teacher_accuracy']:.1f}%, "
            f"KL/token {stats['kl_per_token']:.4f}, {stats['tokens_per_s']:.0f} tok/s -> {out}",
            markup=False,
        )
    return summaries


def _sft_config(cfg: AntidistillConfig, traces: Path, out: Path) -> SFTConfig:
    d = cfg.distill
    data = SFTDataConfig(
        path=str(traces),
        max_len=cfg.data.max_len,
        use_chat_template=cfg.data.use_chat_template,
        val_fraction=d.val_fraction,
    )
    train = TrainConfig(
        output_dir=str(out),
        max_steps=d.max_steps,
        batch_size=d.batch_size,
        micro_batch_size=d.micro_batch_size,
        seed=_seed(d.seed, cfg),
        device=cfg.run.device,
        threads=cfg.run.threads,
        eval_every=0,
        save_every=0,
        keep_last=1,
        log_every=max(d.max_steps // 5, 1),
        max_new_tokens=cfg.data.max_new_tokens,
    )
    student = cfg.student  # a LoRA student (student.lora.r > 0) also writes final/merged, which eval loads
    if student.lora.r:
        student = dataclasses.replace(student, lora=dataclasses.replace(student.lora, save_merged=True))
    return SFTConfig(
        model=student, data=data, optim=d.optim, train=train, logging=LoggingConfig(progress=cfg.run.progress)
    )


def run_distill(cfg: AntidistillConfig, console=None) -> list[dict]:
    """A fresh student fine-tuned on each setting's traces: students/<setting>/final (replaced if present)."""
    console, _, ctx = _start(cfg, console, "distill")
    workdir = Path(cfg.run.workdir)
    direction = cfg.sample.direction
    inputs = [
        (t, lam, pipe.require(pipe.sample_dir(workdir, t, lam, direction) / "traces.jsonl", "sample"))
        for t, lam in _settings(cfg)
    ]
    results = []
    for temperature, lam, traces in inputs:
        name = pipe.setting_name(temperature, lam, direction)
        out = pipe.student_dir(workdir, temperature, lam, direction)
        if out.exists() and ctx.is_main:  # a stage re-run replaces its outputs; the SFT recipe refuses a used run dir
            shutil.rmtree(out)
        ctx.barrier()
        metrics = run_sft(_sft_config(cfg, traces, out), console=console, name=f"distill {name}")
        result = {
            "name": name,
            "temperature": temperature,
            "lam": lam,
            "val_loss": metrics.get("val_loss"),
            "model_dir": str(out / "final"),
        }
        if ctx.is_main:
            pipe.write_json(out / "distill.json", result)
        results.append(result)
    return results


def _accuracy(model_cfg: ModelConfig, cfg: AntidistillConfig, task, problems, device, role: str) -> float:
    model, tokenizer = _load(model_cfg, device, role)
    chat = uses_chat_format(tokenizer, cfg.data.use_chat_template)
    accuracy, _ = task_accuracy(model, tokenizer, task, problems, cfg.data.max_new_tokens, chat)
    return accuracy


def run_eval(cfg: AntidistillConfig, console=None) -> dict:
    """Greedy test accuracy of the teacher, the undistilled student and each student: eval/results.json."""
    console, device, ctx = _start(cfg, console, "eval")
    workdir = Path(cfg.run.workdir)
    direction = cfg.sample.direction
    students = [
        (t, lam, pipe.require(pipe.student_dir(workdir, t, lam, direction) / "final", "distill"))
        for t, lam in _settings(cfg)
    ]
    task = _task(cfg)
    problems = task.make_problems(cfg.data.num_test, cfg.data.seed, cfg.data.test_split)
    results = {"split": cfg.data.test_split, "num_test": len(problems)}
    with _progress(console, cfg.run.progress, "evaluate", len(students) + 2) as advance:
        results["teacher_accuracy"] = _accuracy(cfg.teacher, cfg, task, problems, device, "teacher")
        advance()
        results["student_baseline_accuracy"] = _accuracy(cfg.student, cfg, task, problems, device, "student")
        advance()
        results["students"] = []
        for temperature, lam, model_dir in students:
            merged = model_dir / "merged"  # a LoRA student: its merged model
            spec = dataclasses.replace(cfg.student, name=str(merged if merged.is_dir() else model_dir), tokenizer="")
            results["students"].append(
                {
                    "name": pipe.setting_name(temperature, lam, direction),
                    "temperature": temperature,
                    "lam": lam,
                    "student_accuracy": _accuracy(spec, cfg, task, problems, device, "student"),
                }
            )
            advance()
    if ctx.is_main:  # every rank evaluated the same greedy generations; rank 0 writes
        pipe.write_json(pipe.results_path(workdir), {**results, "config": to_dict(cfg)})
    console.print(
        f"[antidistill eval] teacher {100 * results['teacher_accuracy']:.1f}%, undistilled student "
        f"{100 * results['student_baseline_accuracy']:.1f}% on {len(problems)} {cfg.data.test_split} "
        f"prompts",
        markup=False,
    )
    for s in results["students"]:
        console.print(f"  student {s['name']}: {100 * s['student_accuracy']:.1f}%", markup=False)
    return results


def run_report(cfg: AntidistillConfig, console=None) -> dict:
    """report/report.md, report/report.json and report/student_vs_teacher.png from the eval results
    (written by rank 0 alone under torchrun)."""
    if torchrun_world()[0] != 0:
        return {}
    console = console or make_console()
    workdir = Path(cfg.run.workdir)
    results = pipe.read_json(pipe.require(pipe.results_path(workdir), "eval"))
    by_name = {s["name"]: s for s in results["students"]}
    settings = []
    direction = cfg.sample.direction
    for temperature, lam in _settings(cfg):
        name = pipe.setting_name(temperature, lam, direction)
        sampled = pipe.read_json(
            pipe.require(pipe.sample_dir(workdir, temperature, lam, direction) / "summary.json", "sample")
        )
        if name not in by_name:
            raise pipe.StageInputMissing(
                f"{pipe.results_path(workdir)} has no student {name}: run "
                "`lmforge antidistill distill` and `eval` with this config first"
            )
        settings.append(
            {
                "name": name,
                "temperature": temperature,
                "lam": lam,
                "direction": direction,
                "teacher_accuracy": sampled["teacher_accuracy"],
                "kl_per_token": sampled["kl_per_token"],
                "student_accuracy": by_name[name]["student_accuracy"],
            }
        )
    temperature_curve = [(s["teacher_accuracy"], s["student_accuracy"]) for s in settings if s["lam"] == 0]
    for s in settings:
        if s["lam"] != 0:
            s["temperature_student_at_same_teacher"] = pipe.interpolate(temperature_curve, s["teacher_accuracy"])
    table = pipe.report_markdown(settings, results["teacher_accuracy"], results["student_baseline_accuracy"])
    out_dir = workdir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.md").write_text(table)
    png = pipe.plot_report(
        settings, results["teacher_accuracy"], results["student_baseline_accuracy"], out_dir / "student_vs_teacher.png"
    )
    report = {
        "teacher_accuracy": results["teacher_accuracy"],
        "student_baseline_accuracy": results["student_baseline_accuracy"],
        "settings": settings,
    }
    pipe.write_json(out_dir / "report.json", report)
    console.print(table, markup=False)
    console.print(f"[antidistill report] {out_dir / 'report.md'}, {png}", markup=False)
    return report


def run_all(cfg: AntidistillConfig, console=None) -> dict:
    """traces -> grad -> sample -> distill -> eval -> report."""
    console = console or make_console()
    for stage in (run_traces, run_grad, run_sample, run_distill, run_eval):
        stage(cfg, console)
    return run_report(cfg, console)


STAGES = {
    "traces": ("teacher traces on the held-out split, scored (JSONL + accuracy)", run_traces),
    "grad": ("proxy gradient on the held-out traces (safetensors; works under torchrun)", run_grad),
    "sample": ("teacher sampling for every (T, lam) of the sweep; lam = 0 is plain temperature sampling", run_sample),
    "distill": ("fine-tune a fresh student on each sampled trace set", run_distill),
    "eval": ("test accuracy of the teacher, the undistilled student and every distilled student", run_eval),
    "report": ("markdown table + PNG: student vs teacher accuracy, ADS vs temperature sampling", run_report),
    "all": ("run traces, grad, sample, distill, eval and report in order", run_all),
}
