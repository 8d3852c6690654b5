"""Shared pieces of the RL recipes (``lmforge grpo``, ``lmforge ppo``).

One RL step: take the next prompts -> sample ``group_size`` completions each -> score them ->
(recipe: advantages) -> lay the rollout out for the trainer -> for each pass and mini-batch:
forward/backward on the completion tokens, one optimizer update. This module holds what both
recipes use -- config sections, prompts, sampling + scoring, the trainer's layout of a rollout,
completion logprobs, and the outer step loop with logging, evaluation and checkpoints; the update
loop over passes / mini-batches / micro-batches is ``rl_update`` (its names are re-exported here).
Each recipe keeps its own loss and step.

Layout of a rollout for the trainer (:class:`RLBatch`). The engine returns left-padded prompts
(B, P) and right-padded completions (B, C). Each row is re-packed as ``prompt tokens, completion
tokens, padding`` (B, L): positions are then plain 0..L-1, exactly the position ids the engine
used (it counts real tokens only), so the model needs no position ids. ``positions`` (B, L)
selects the logits that predict completion tokens; since every completion mask is a prefix of its
row, those N logits, taken in row-major order, line up with ``completion_mask`` (B, C).
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import time
from pathlib import Path
from typing import Any, Callable

import torch
from transformers.cache_utils import DynamicCache

from . import lora
from .data.prompts import held_out_split, load_prompt_rows
from .data.sft import encode_prompt, uses_chat_format
from .data.tasks import get_task
from .errors import ConfigError, DataError, TrainingError
from .evaluation import completion_texts, held_out_evaluator, save_samples
from .models import context_length, load_model
from .parallel.context import ParallelContext
from .parallel.wrap import run_forward
from .rl_config import RLDataConfig, RolloutConfig, check_rl_config
from .rl_update import (LossFn, global_counts, informative_rows, mini_batch_rows,  # noqa: F401 (re-exported)
                        reduce_metrics, reduce_rollout_metrics, update)
from .rollout import CastEngine, RewardOutput, RewardSet, RolloutBatch, generate
from .runtime.loop import Trainer, TrainState, build_state, full_model, train_loop
from .runtime.run import Run, start_run
from .train import PLAIN_HEAD_MODELS, BatchOrder, Precision, decoder_of, logits_at

Tensor = torch.Tensor

# ----------------------------------------------------------------------------- prompts


@dataclasses.dataclass
class PromptSet:
    """Training prompts as token ids, what the reward functions see for each, held-out problems."""

    prompt_ids: list[list[int]]
    problems: list  # one per prompt: a task Problem, or the JSONL row (a dict)
    task: Any  # the Task (passed to rewards as task=...), or None for a prompts file
    eval_problems: list
    chat: bool
    num_dropped: int = 0  # prompts longer than data.max_prompt_len, dropped
    num_truncated: int = 0  # ... or cut to their last max_prompt_len tokens
    eval_note: str = ""  # prompts files: what was held out for evaluation, or why nothing was


def build_prompts(data: RLDataConfig, tokenizer, seed: int, max_prompt_len: int = 0) -> PromptSet:
    """Prompts of the task or file, tokenized; those longer than ``max_prompt_len`` (0 = no limit)
    dropped or left-truncated as ``data.prompt_truncation`` says, and counted."""
    chat = uses_chat_format(tokenizer, data.use_chat_template)
    if data.task:
        task = get_task(data.task)
        problems = task.make_problems(data.num_train, seed, "train")
        eval_problems = task.make_problems(data.num_eval, seed, "test")
        texts = [p.prompt for p in problems]
    else:
        task, eval_problems = None, []
        problems = load_prompt_rows(data.path, data.split, data.subset, data.columns)
        texts = [row["prompt"] for row in problems]
    prompt_ids = [encode_prompt(tokenizer, text, chat) for text in texts]
    dropped = truncated = 0
    if max_prompt_len:
        long = [len(ids) > max_prompt_len for ids in prompt_ids]
        if data.prompt_truncation == "left":
            truncated = sum(long)
            prompt_ids = [ids[-max_prompt_len:] for ids in prompt_ids]
        else:
            dropped = sum(long)
            problems = [p for p, too_long in zip(problems, long) if not too_long]
            prompt_ids = [ids for ids, too_long in zip(prompt_ids, long) if not too_long]
        if not prompt_ids:
            raise DataError(f"every one of the {len(long)} prompts is longer than data.max_prompt_len="
                            f"{max_prompt_len} tokens; raise it (with a longer-context model) or use "
                            "data.prompt_truncation=left")
    prompts = PromptSet(prompt_ids, problems, task, eval_problems, chat, dropped, truncated)
    if not data.task:
        hold_out_rows(prompts, data, seed)
    return prompts


def hold_out_rows(prompts: PromptSet, data: RLDataConfig, seed: int) -> None:
    """Fill ``prompts.eval_problems`` from a prompts source (``lmforge.data.prompts`` module doc):
    a named split, or rows moved out of the training prompts."""
    if data.eval_split:
        rows = load_prompt_rows(data.path, data.eval_split, data.subset, data.columns)[:data.num_eval]
        prompts.eval_problems = rows
        prompts.eval_note = f"{len(rows)} held-out rows from split {data.eval_split!r}"
        return
    has_answers = any("answer" in row for row in prompts.problems)
    train, held, prompts.eval_note = held_out_split(data, len(prompts.problems), has_answers, seed)
    prompts.eval_problems = [prompts.problems[i] for i in held]
    prompts.problems = [prompts.problems[i] for i in train]
    prompts.prompt_ids = [prompts.prompt_ids[i] for i in train]


def prompt_budget(cfg, model) -> int:
    """``data.max_prompt_len`` resolved against the model's context: prompt + rollout.max_new_tokens must fit."""
    context, new = context_length(model), cfg.rollout.max_new_tokens
    if context is None:
        return cfg.data.max_prompt_len
    if new >= context:
        raise ConfigError(f"rollout.max_new_tokens={new} leaves no room for a prompt in the model's context of "
                          f"{context} tokens")
    if cfg.data.max_prompt_len and cfg.data.max_prompt_len + new > context:
        raise ConfigError(f"data.max_prompt_len={cfg.data.max_prompt_len} + rollout.max_new_tokens={new} exceeds the "
                          f"model's context of {context} tokens; lower one of them")
    return cfg.data.max_prompt_len or context - new


# ----------------------------------------------------------------------------- sample and score


def sample_and_score(model, tokenizer, prompts: PromptSet, rows: list[int], cfg: RolloutConfig,
                     reward_set: RewardSet, seed: int, engine=None) -> tuple[RolloutBatch, RewardOutput, dict]:
    """Sample ``cfg.group_size`` completions for each prompt in ``rows``; score them.

    Returns the rollout (B = len(rows) * G rows, a prompt's samples adjacent), the rewards and
    detached metrics: reward mean/std overall and per function, lengths, timings. ``engine`` is a
    sampler with its own weights (vLLM, or a bf16 ``CastEngine`` copy): it gets the current weights
    before every rollout.
    """
    start = time.perf_counter()
    was_training = model.training
    model.eval()  # sampling is inference: no dropout, and the KV cache stays on
    params = cfg.sampling([tokenizer.eos_token_id], seed)
    prompt_ids = [prompts.prompt_ids[i] for i in rows]
    if engine is None:
        rollout = generate(model, prompt_ids, params, num_samples=cfg.group_size,
                           pad_token_id=tokenizer.pad_token_id)
    else:  # syncing before each rollout covers "after every optimizer step" and resumed runs
        engine.sync_weights(model)
        rollout = engine.generate(prompt_ids, params, num_samples=cfg.group_size,
                                  pad_token_id=tokenizer.pad_token_id)
    model.train(was_training)
    generated = time.perf_counter()
    texts = completion_texts(tokenizer, rollout)
    problems = [prompts.problems[i] for i in rows for _ in range(cfg.group_size)]
    shared = {} if prompts.task is None else {"task": prompts.task}
    rewards = reward_set(texts, problems, completion_lens=rollout.completion_lens.tolist(),
                         max_new_tokens=cfg.max_new_tokens, **shared)
    lengths = rollout.completion_lens.float()
    metrics = {
        "reward": rewards.total.mean(),
        "reward_std": rewards.total.std(correction=0),
        **{f"reward_{name}": rewards.per_function[:, f].mean() for f, name in enumerate(rewards.names)},
        "reward_failures": rewards.num_failed.sum(),
        "reward_timeouts": rewards.num_timed_out.sum(),
        "completion_len_mean": lengths.mean(),
        "completion_len_max": lengths.max(),
        "truncated_frac": rollout.truncated.float().mean(),
        "time_generation": generated - start,
        "time_scoring": time.perf_counter() - generated,
    }
    return rollout, rewards, metrics


# ----------------------------------------------------------------------------- trainer layout


@dataclasses.dataclass
class RLBatch:
    """A rollout laid out for the trainer (module doc). B rows, L packed length, C completion width."""

    input_ids: Tensor  # (B, L) long: prompt tokens, completion tokens, then padding
    attention_mask: Tensor  # (B, L) long
    positions: Tensor  # (B, L) bool: the logits here predict the completion tokens
    completion_ids: Tensor  # (B, C) long
    completion_mask: Tensor  # (B, C) long, a prefix of ones in each row
    rollout_logprobs: Tensor | None  # (B, C) the sampler's logprobs (None if it reports none)
    group_index: Tensor | None = None  # (B,) long: rows with one value share their prompt (a rollout group)
    prompt_lens: Tensor | None = None  # (B,) long: prompt tokens at the start of each packed row
    advantages: Tensor | None = None  # (B,) per sequence (GRPO) or (B, C) per token (PPO)
    old_logprobs: Tensor | None = None  # (B, C) trainer logprobs at the rollout's weights
    ref_logprobs: Tensor | None = None  # (B, C) reference model logprobs
    old_values: Tensor | None = None  # (B, C) PPO critic at rollout time
    returns: Tensor | None = None  # (B, C) PPO value targets

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device) -> "RLBatch":
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device)
                                            for f in dataclasses.fields(self) if getattr(self, f.name) is not None})

    def select(self, rows: Tensor) -> "RLBatch":
        """The rows ``rows`` (1-D index tensor), with packed columns that are padding in all of them cut."""
        picked = {f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[rows]
                  for f in dataclasses.fields(self)}
        width = int(picked["attention_mask"].sum(1).max())
        for name in ("input_ids", "attention_mask", "positions"):
            picked[name] = picked[name][:, :width]
        return RLBatch(**picked)


def pack_rollout(rollout: RolloutBatch, pad_token_id: int, need_rollout_logprobs: bool) -> RLBatch:
    """Re-pack a rollout as ``prompt, completion, padding`` rows (module doc)."""
    if need_rollout_logprobs and rollout.logprobs is None:
        raise TrainingError(
            "algo.is_level weights by the sampler's logprobs, but this rollout carries none "
            "(RolloutBatch.logprobs is None); use a rollout engine that reports them, or set "
            "algo.is_level=none")
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], dim=1)  # (B, P + C)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], dim=1)
    is_completion = torch.cat([torch.zeros_like(rollout.prompt_mask), rollout.completion_mask], dim=1)
    # A stable sort on "is padding" moves each row's real tokens to the front, keeping their order.
    order = torch.sort((mask == 0).long(), dim=1, stable=True).indices
    ids, mask, is_completion = ids.gather(1, order), mask.gather(1, order), is_completion.gather(1, order)
    positions = torch.zeros_like(mask, dtype=torch.bool)
    positions[:, :-1] = is_completion[:, 1:].bool()  # logits at t predict token t + 1
    width = int(mask.sum(1).max())
    return RLBatch(input_ids=ids[:, :width], attention_mask=mask[:, :width], positions=positions[:, :width],
                   completion_ids=rollout.completion_ids, completion_mask=rollout.completion_mask,
                   rollout_logprobs=rollout.logprobs, group_index=rollout.group_index,
                   prompt_lens=rollout.prompt_lens)


def scatter_completion(flat: Tensor, mask: Tensor) -> Tensor:
    """(N,) values of the mask's true entries, row-major -> (B, C), 0 elsewhere (differentiable)."""
    return flat.new_zeros(mask.shape).masked_scatter(mask, flat)


def completion_logprobs(logits: Tensor, batch: RLBatch, temperature: float,
                        entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
    """Logits (N, V) at ``batch.positions`` -> logprobs and entropy (B, C) of softmax(logits / T).

    T is the sampling temperature: the ratio and the entropy must be of the distribution the
    completions were drawn from. The entropy carries a gradient only if ``entropy_grad``.
    """
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
    mask = batch.completion_mask.bool()
    # One log_softmax over the (N, V) logits serves both the picked logprobs and the entropy: fewer
    # full-vocabulary passes than a logsumexp for one and a second log_softmax for the other.
    all_logprobs = torch.log_softmax(scaled, dim=-1)  # (N, V)
    logprobs = all_logprobs.gather(-1, batch.completion_ids[mask][:, None]).squeeze(-1)  # (N,)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(all_logprobs.exp() * all_logprobs).sum(-1)  # (N,)
    return scatter_completion(logprobs, mask), scatter_completion(entropy, mask)


def shares_prompts(model, batch: RLBatch) -> bool:
    """Whether :func:`shared_prompt_logits` applies: a plain-head model without gradient checkpointing
    (which turns the KV cache off in training), and rows that share a prompt."""
    return (batch.group_index is not None and batch.prompt_lens is not None
            and getattr(getattr(model, "config", None), "model_type", "") in PLAIN_HEAD_MODELS
            and decoder_of(model) is not None and not getattr(model, "is_gradient_checkpointing", False)
            and len(torch.unique(batch.group_index)) < batch.num_rows)


def shared_prompt_logits(model, batch: RLBatch) -> Tensor:
    """Logits (N, V) that predict the completion tokens, as ``logits_at`` on the packed rows, with each
    prompt run once per group instead of once per row.

    The distinct prompts go through the model body once, left-padded with positions counting real
    tokens (as in the sampler); their KV cache is repeated for each group's rows; then each row's
    completion tokens (but the last) run against it. The last prompt position and the completion
    positions predict the completion tokens. Attention is causal, so a prompt position never sees a
    completion and this is the packed forward's computation, in fewer rows; autograd sums the
    gradient of a shared prompt over its rows. The LM head runs on completion positions only.
    """
    body = decoder_of(model)
    _, inverse = torch.unique(batch.group_index, return_inverse=True)  # (B,) row -> its distinct prompt
    first = torch.zeros(int(inverse.max()) + 1, dtype=torch.long, device=inverse.device)
    first.scatter_(0, inverse, torch.arange(len(inverse), device=inverse.device))  # a row of each prompt
    lens = batch.prompt_lens
    width = int(lens.max())
    source = torch.arange(width, device=lens.device) - (width - lens[first, None])  # (U, P) packed column
    prompt_mask = (source >= 0).long()
    prompt_ids = batch.input_ids[first].gather(1, source.clamp(min=0)) * prompt_mask
    cache = DynamicCache()  # filled in place by the model
    cache_kwarg = {"cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values": cache}
    prompt_out = body(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=source.clamp(min=0),
                      use_cache=True, **cache_kwarg)
    hidden = prompt_out.last_hidden_state[inverse, -1:]  # (B, 1, H): predicts completion token 0
    completion_in = batch.completion_ids[:, :-1].clone()  # (B, C - 1); a copy: the sampler's may be inference tensors
    if completion_in.shape[1]:
        cache.batch_select_indices(inverse)  # differentiable gather: each row gets its prompt's keys / values
        steps = torch.arange(completion_in.shape[1], device=lens.device)
        mask = torch.cat([prompt_mask[inverse], torch.ones_like(completion_in)], dim=1)
        out = body(input_ids=completion_in, attention_mask=mask, position_ids=lens[:, None] + steps,
                   use_cache=True, **cache_kwarg)
        hidden = torch.cat([hidden, out.last_hidden_state], dim=1)  # (B, C, H)
    return model.get_output_embeddings()(hidden[batch.completion_mask.bool()])


def completion_logits(model, batch: RLBatch) -> Tensor:
    """Logits (N, V) that predict ``batch``'s completion tokens: the LM head runs on completion
    positions only, and a prompt shared by several rows runs once where the model allows."""
    if shares_prompts(model, batch):
        return shared_prompt_logits(model, batch)
    return logits_at(model, batch.input_ids, batch.attention_mask, batch.positions)


def policy_logprobs(model, batch: RLBatch, temperature: float, precision: Precision,
                    entropy_grad: bool = False, wrapped=None) -> tuple[Tensor, Tensor]:
    """One forward of ``model`` on ``batch`` -> completion logprobs and entropy (B, C).

    ``wrapped``: the parallel root that holds ``model`` (training forwards go through it, so DDP and
    FSDP2 see them); None for a model that is not trained (the reference).
    """
    with precision.autocast():
        if wrapped is None:
            logits = completion_logits(model, batch)  # (N, V)
        else:
            logits = run_forward(wrapped, completion_logits, model, batch)
    return completion_logprobs(logits, batch, temperature, entropy_grad)


def matmul_weights(model) -> tuple[int, int]:
    """(body, head): weights of the linear layers a token goes through in the transformer body, and
    the LM head's. Norm weights and the embedding lookup do no matmul and are not counted."""
    head_weight = model.get_output_embeddings().weight
    body = sum(m.weight.numel() for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m.weight is not head_weight)
    return body, head_weight.numel()


def _distinct_prompts(part: RLBatch) -> tuple[int, int]:
    """(distinct prompts, longest of them) of rows that carry their group and prompt lengths."""
    lens = dict(zip(part.group_index.tolist(), part.prompt_lens.tolist()))
    return len(lens), max(lens.values())


def forward_flops(model, micro: RLBatch, share_prompts: bool = True) -> float:
    """Matmul FLOPs of one forward over the micro-batch ``micro`` as the trainer runs it: its distinct
    prompts once (left-padded) and then ``completion_ids[:, :-1]`` of every row
    (:func:`shared_prompt_logits`), or the packed rows with their padding; the LM head only on the
    completion positions."""
    body, head = matmul_weights(model)
    if share_prompts and shares_prompts(model, micro):
        distinct, width = _distinct_prompts(micro)
        tokens = distinct * width + micro.num_rows * (micro.completion_ids.shape[1] - 1)
    else:
        tokens = micro.input_ids.numel()
    return 2.0 * (body * tokens + head * int(micro.completion_mask.sum()))


def batch_forward_flops(model, batch: RLBatch, micro_batch_size: int, share_prompts: bool = True) -> float:
    """:func:`forward_flops` of ``batch`` run in micro-batches of ``micro_batch_size`` rows."""
    return sum(forward_flops(model, batch.select(rows), share_prompts)
               for rows in torch.arange(batch.num_rows).split(micro_batch_size))


def sampling_flops(model, batch: RLBatch) -> float:
    """Matmul FLOPs of sampling ``batch`` with the engine: one prefill of the distinct prompts,
    left-padded to the longest, with the LM head on their last position, then C - 1 decode forwards
    of all B rows (C: the completion width)."""
    body, head = matmul_weights(model)
    num_rows, width = batch.completion_ids.shape
    if batch.group_index is not None and batch.prompt_lens is not None:
        distinct, longest = _distinct_prompts(batch)
    else:
        distinct, longest = num_rows, int((batch.attention_mask.sum(1) - batch.completion_mask.sum(1)).max())
    return 2.0 * (body * distinct * longest + head * distinct) + 2.0 * (body + head) * num_rows * (width - 1)


def step_flops(model, batch: RLBatch, micro_batch_size: int, train_passes: int, forward_passes: int,
               share_prompts: bool = True) -> float:
    """Matmul FLOPs of one RL step as lmforge runs it when every row is trained (attention scores
    are left out): :func:`sampling_flops`, then ``train_passes`` forward + backward (3x a forward)
    and ``forward_passes`` forward-only passes (old logprobs, reference model, values) over the batch
    in micro-batches (:func:`forward_flops`); ``share_prompts=False`` for trainers that always run
    the packed rows (PPO). Checked against the FLOPs torch dispatches:
    tests/recipes/test_grpo.py::test_step_flops_equal_the_matmul_flops_torch_runs.
    """
    forward = batch_forward_flops(model, batch, micro_batch_size, share_prompts)
    return sampling_flops(model, batch) + forward * (3 * train_passes + forward_passes)


@torch.no_grad()
def batch_logprobs(model, batch: RLBatch, micro_batch_size: int, temperature: float,
                   precision: Precision, wrapped=None) -> Tensor:
    """(B, C) logprobs of ``model`` on the whole batch, in micro-batches, without gradients.
    ``model`` may be a LoRA policy's reference (:class:`lora.DisabledAdapters`): its base model."""
    if isinstance(model, lora.DisabledAdapters):
        with lora.adapters_disabled(model.model):
            return batch_logprobs(model.model, batch, micro_batch_size, temperature, precision, wrapped)
    parts = [policy_logprobs(model, batch.select(rows), temperature, precision, wrapped=wrapped)[0]
             for rows in torch.arange(batch.num_rows).split(micro_batch_size)]
    return torch.cat(parts)


def reference_model(model, kl_coef: float):
    """A frozen copy of the starting policy, made only when the KL term is on (it costs a model).
    A LoRA policy's reference is its base model: the policy run with its adapters off, no copy."""
    if kl_coef <= 0:
        return None
    if lora.has_adapters(model):
        return lora.DisabledAdapters(model)
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


# ----------------------------------------------------------------------------- the run


@dataclasses.dataclass
class RLState:
    """Everything a run's steps share (built by :func:`prepare`): the training state and the RL parts."""

    train: TrainState
    ref_model: torch.nn.Module | None
    prompts: PromptSet
    reward_set: RewardSet
    rollout_engine: Any = None  # a sampler with its own weights (vLLM, or a CastEngine copy), else the policy
    atropos: Any = None  # rollout.backend=atropos: the AtroposSource that replaces sampling (rl_atropos.py)
    async_rollouts: Any = None  # rl_async.AsyncRollouts when rollout.async_steps > 0

    @property
    def run(self) -> Run:
        return self.train.run

    @property
    def model(self) -> torch.nn.Module:
        return self.train.model

    @property
    def tokenizer(self):
        return self.train.tokenizer

    @property
    def updater(self):
        return self.train.updater

    @property
    def micro_batch_size(self) -> int:
        return self.run.micro_batch_size

    def next_prompts(self) -> list[int]:
        """This rank's prompts for the next step (the global order is the same on every rank)."""
        return rank_prompts(self.train.order.next(), self.run.cfg.algo.num_mini_batches, self.run.ctx)

    def sampler_model(self) -> torch.nn.Module:
        """The full policy to sample from (FSDP2: gathered; a collective)."""
        return full_model(self.train)


def rank_prompts(rows: list[int], num_mini_batches: int, ctx: ParallelContext) -> list[int]:
    """This rank's prompts of a step's global ``rows``: its share of each mini-batch, groups whole.

    Mini-batch m of the step is the m-th contiguous chunk of ``rows``; rank r takes the r-th part of
    each chunk. Then the rank's own m-th mini-batch is its share of the global m-th mini-batch, and
    the union over ranks of each update's rows is the update of a single process.
    """
    if not ctx.distributed:
        return rows
    per_mini = len(rows) // num_mini_batches
    share = per_mini // ctx.world_size
    return [rows[m * per_mini + ctx.rank * share + i] for m in range(num_mini_batches) for i in range(share)]


def step_seed(seed: int, step: int, rank: int = 0) -> int:
    """The sampler's seed at ``step`` on ``rank``: a function of both, so a resumed run samples the same."""
    return seed * 1_000_003 + step + 1_000_000_007 * rank


def check_rl_split(cfg, algo, world_size: int) -> int:
    """Rows of one optimizer update over all ranks; an error naming the numbers when the step's
    prompts cannot be shared out with each group whole on one rank."""
    num_prompts, group = cfg.rollout.num_prompts, cfg.rollout.group_size
    if num_prompts % (algo.num_mini_batches * world_size):
        raise ConfigError(
            f"rollout.num_prompts={num_prompts} must be divisible by algo.num_mini_batches="
            f"{algo.num_mini_batches} x world size={world_size}: each update takes whole groups from every rank")
    return num_prompts * group // algo.num_mini_batches


def prepare(cfg, name: str, algo, model=None, tokenizer=None, console=None,
            extra_modules: dict[str, torch.nn.Module] | None = None) -> RLState:
    """Load, set up hardware, the parallel context and the run directory, build the optimizer, resume.

    ``extra_modules`` (e.g. PPO's value head) are trained and clipped with the model; the saved
    trainer state of the checkpoint resumed from is ``state.train.saved`` ({} for a fresh run).
    """
    check_rl_config(cfg, algo)
    if model is None:
        model, tokenizer = load_model(cfg.model)
    cfg.data.max_prompt_len = prompt_budget(cfg, model)  # resolved: saved in config.yaml
    prompts = build_prompts(cfg.data, tokenizer, cfg.train.seed, cfg.data.max_prompt_len)
    seq_len = max(len(p) for p in prompts.prompt_ids) + cfg.rollout.max_new_tokens
    cfg.algo = algo  # the saved config holds the resolved algo (presets applied)
    rows = cfg.rollout.num_prompts * cfg.rollout.group_size
    if cfg.train.batch_size not in (0, rows):
        raise ConfigError(f"train.batch_size={cfg.train.batch_size}: an RL step's batch is rollout.num_prompts x "
                          f"rollout.group_size = {rows} completions; leave train.batch_size unset (0)")
    cfg.train.batch_size = rows
    from .parallel.context import torchrun_world

    update_rows = check_rl_split(cfg, algo, torchrun_world()[1])
    from .rl_async import check_async

    check_async(cfg, algo, torchrun_world()[1] > 1)  # before start_run takes the run directory
    run = start_run(cfg, name, model, seq_len=seq_len, console=console, update_rows=update_rows,
                    update_label="rollout rows per update (num_prompts x group_size / num_mini_batches)")
    if cfg.rollout.backend == "vllm" and run.ctx.distributed:
        raise ConfigError("rollout.backend=vllm runs in one process for now (docs/vllm.md has the plan for "
                          "torchrun); use rollout.backend=inprocess under torchrun")
    model = lora.apply_for_run(model, cfg, run.ctx).to(run.device)  # model.lora: adapters (docs/lora.md)
    ref_model = reference_model(model, algo.kl_coef)  # before resume: the reference is the start
    num_updates = cfg.train.max_steps * algo.num_iterations * algo.num_mini_batches
    order = BatchOrder(len(prompts.prompt_ids), cfg.rollout.num_prompts, cfg.train.seed)
    train = build_state(run, model, tokenizer, order, num_updates, extra_modules)
    reward_set = RewardSet(cfg.rewards.specs(), cfg.rewards.max_failure_fraction, cfg.rewards.timeout_s,
                           cfg.rewards.workers)
    state = RLState(train, ref_model, prompts, reward_set)
    if cfg.rollout.dtype != "same" and cfg.rollout.backend == "inprocess":
        state.rollout_engine = cast_engine(state.sampler_model(), cfg.rollout.dtype, algo, run)
    elif cfg.rollout.dtype != "same":
        run.print(f"[rollout] note: rollout.dtype={cfg.rollout.dtype} applies to rollout.backend=inprocess; "
                  f"with {cfg.rollout.backend} the sampler's precision is set there")
    if cfg.rollout.backend == "vllm":
        from .rollout.vllm_backend import VLLMEngine

        state.rollout_engine = VLLMEngine(model, tokenizer, cfg.rollout.vllm_gpu_memory_utilization,
                                          seed=cfg.train.seed, max_model_len=seq_len)
    if cfg.rollout.backend == "atropos":
        from .rl_atropos import AtroposSource

        state.atropos = AtroposSource(cfg, run)
    if prompts.eval_note:
        run.print(f"[data] {prompts.eval_note}")
    run.print(f"[data] {len(prompts.prompt_ids)} training prompts, {len(prompts.eval_problems)} held-out problems"
              + (f"; {prompts.num_dropped} longer than data.max_prompt_len={cfg.data.max_prompt_len} dropped"
                 if prompts.num_dropped else "")
              + (f"; {prompts.num_truncated} left-truncated to {cfg.data.max_prompt_len} tokens"
                 if prompts.num_truncated else ""))
    start_async_rollouts(state, algo)
    return state


def start_async_rollouts(state: RLState, algo) -> None:
    """``rollout.async_steps > 0``: the overlapped sampler (rl_async). A checkpoint of the other mode
    resumes with a note: an async one holds batches whose prompts the saved data order has passed."""
    cfg, saved = state.run.cfg, state.train.saved.get("async_rollouts", {}).get("pending")
    if getattr(cfg.rollout, "async_steps", 0):
        from .rl_async import AsyncRollouts

        state.async_rollouts = AsyncRollouts(state, algo)
        if state.train.step and not saved:
            state.run.print("[rollout] async: the checkpoint holds no launched batches; the next one is "
                            "sampled now, from the resumed weights (staleness 0)")
    elif saved:
        state.run.print(f"[rollout] note: resuming an async checkpoint synchronously skips the prompts of its "
                        f"{len(saved)} launched batch(es); set rollout.async_steps to train on them")


def cast_engine(model, dtype_name: str, algo, run) -> CastEngine:
    """The in-process sampler on a ``dtype_name`` copy of ``model`` (``rollout.dtype``), with a note
    when that dtype is slow on this device or when no importance weights correct for the rounding."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    device = next(model.parameters()).device
    if device.type == "cpu" and not (dtype is torch.bfloat16 and run.hw.bf16_supported):
        run.print(f"[rollout] note: rollout.dtype={dtype_name} on a CPU without native {dtype_name} units "
                  "is usually much slower than fp32; rollout.dtype=same is the fast choice here")
    if algo.is_level == "none":
        run.print(f"[rollout] note: sampling with {dtype_name} weights and training in "
                  f"{next(model.parameters()).dtype}: the sampler's logprobs differ by rounding; "
                  "algo.is_level=token corrects for it (the rollout_diff_* metrics show the size)")
    return CastEngine(model, dtype)


def rollout(state: RLState, step: int) -> tuple[RolloutBatch, RewardOutput, dict]:
    """Sample and score this rank's prompts for ``step`` (metrics reduced over ranks)."""
    cfg, ctx = state.run.cfg, state.run.ctx
    if state.atropos is not None:  # rollout.backend=atropos: pulled from the Atropos API (rl_atropos.py)
        return state.atropos.rollout(state, step)
    if state.async_rollouts is not None:  # launched earlier, in the background (rl_async)
        return state.async_rollouts.take(step)
    error, result = None, None
    try:
        result = sample_and_score(state.sampler_model(), state.tokenizer, state.prompts, state.next_prompts(),
                                  cfg.rollout, state.reward_set, step_seed(cfg.train.seed, step, ctx.rank),
                                  engine=state.rollout_engine)
    except (DataError, TrainingError) as exc:  # e.g. too many reward failures on this rank alone
        error = exc
    ctx.check_all_ok(error)
    batch, rewards, metrics = result
    if state.prompts.num_dropped or state.prompts.num_truncated:  # the run's over-long prompts (data.max_prompt_len)
        metrics.update(prompts_dropped=state.prompts.num_dropped, prompts_truncated=state.prompts.num_truncated)
    return batch, rewards, reduce_rollout_metrics(metrics, ctx)


def make_evaluate(state: RLState) -> Callable[[int], dict] | None:
    """Greedy held-out accuracy of the policy (a task's checker, or the configured rewards on held-out
    rows: :func:`lmforge.evaluation.held_out_evaluator`), plus a few printed samples."""
    prompts, run = state.prompts, state.run
    if not prompts.eval_problems:
        return None
    cfg = run.cfg
    evaluator = held_out_evaluator(state.tokenizer, prompts.eval_problems, prompts.chat, cfg.train.max_new_tokens,
                                   task=prompts.task, reward_specs=cfg.rewards.specs(), pass_k=cfg.data.pass_k,
                                   temperature=cfg.rollout.temperature, seed=cfg.train.seed,
                                   max_prompt_len=cfg.data.max_prompt_len,
                                   # the length limit the evaluation generates with, for `overlong`
                                   reward_kwargs={"max_new_tokens": cfg.train.max_new_tokens},
                                   reward_timeout_s=cfg.rewards.timeout_s, reward_workers=cfg.rewards.workers)

    def evaluate(step: int) -> dict:
        metrics, prompt_texts, texts = evaluator(state.sampler_model(), step)
        k = cfg.train.num_samples
        if run.ctx.is_main:
            save_samples(run.dir, step, prompt_texts[:k], texts[:k], run.print)
        return metrics

    evaluate.close = evaluator.close  # the evaluation's reward workers: stopped with the run

    return evaluate


TIME_KEYS = ("time_generation", "time_scoring", "time_training")


def update_state(batch: RLBatch, algo, state: RLState, loss_fn: LossFn, step: int, **options) -> dict:
    """:func:`update` with the run's optimizer, micro-batch size, parallel context and wrapped root
    (``options``: its keyword arguments)."""
    return update(batch, algo, state.updater, state.micro_batch_size, state.run.cfg.rollout.max_new_tokens, loss_fn,
                  step, state.run.ctx, state.train.wrapped, **options)


def train_rl(state: RLState, step_fn: Callable[[int], dict], extra_state: Callable[[], dict] = dict,
             save_extra: Callable[[Path], None] | None = None) -> dict:
    """Steps ``state.train.step + 1 .. max_steps`` of ``step_fn(step) -> metrics`` on the runtime loop
    (a baseline evaluation at step 0). Returns the last evaluation (+ ``accuracy_before``) and ``run_dir``."""
    def step(done: int) -> dict:
        metrics = step_fn(done)
        if state.atropos is not None:  # push the new weights to the inference server every rollout.push_every
            state.atropos.after_step(state, done)
        # async: the time the step waited for its batch; generation itself overlapped training
        metrics["data_time"] = metrics.get("time_rollout_wait", metrics["time_generation"] + metrics["time_scoring"])
        return metrics

    overlapped = state.async_rollouts
    if overlapped is not None:  # checkpoints hold the batches already launched (rl_async)
        extra_state = (lambda own: lambda: {**own(), **overlapped.state_dict()})(extra_state)
    evaluate = make_evaluate(state)
    trainer = Trainer(step=step, evaluate=evaluate, evaluate_at_start=True, extra_state=extra_state,
                      save_final_extra=save_extra, time_keys=TIME_KEYS)
    try:
        return train_loop(state.train, trainer)
    finally:  # on errors too: the background sampler first (it scores with the reward set), then the rewards
        if overlapped is not None:
            overlapped.close()
        state.reward_set.close()
        if evaluate is not None:
            evaluate.close()
