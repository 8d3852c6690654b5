"""What the sampling sources share: take this rank's next prompts, sample ``rollout.group_size``
completions of each with an engine, score them with the run's reward functions.

An engine is anything with ``sync_weights(model)`` and ``generate(prompt_ids, params, num_samples,
pad_token_id) -> RolloutBatch``: the policy itself (``inprocess``), a bf16 / fp16 copy of it
(``inprocess`` with ``rollout.dtype``), vLLM (``vllm``). The source files build the engine; this
one does the rest.
"""

from __future__ import annotations

import time
from typing import Callable

from ...core.errors import DataError, TrainingError
from ...rollout import RewardOutput, RewardSet, RolloutBatch
from ...rollout.evaluation import completion_texts
from ..batch import ScoredRollout, reduce_rollout_metrics
from ..config import RolloutConfig
from ..prompts import PromptSet, rank_prompts, step_seed
from .base import Policy, SourceSetup


def reward_metrics(rewards: RewardOutput) -> dict:
    """A batch's reward metrics: mean and std of the totals, each function's mean, failures and timeouts."""
    return {
        "reward": rewards.total.mean(),
        "reward_std": rewards.total.std(correction=0),
        **{f"reward_{name}": rewards.per_function[:, f].mean() for f, name in enumerate(rewards.names)},
        "reward_failures": rewards.num_failed.sum(),
        "reward_timeouts": rewards.num_timed_out.sum(),
    }


def sample_and_score(
    engine, tokenizer, prompts: PromptSet, rows: list[int], cfg: RolloutConfig, reward_set: RewardSet, seed: int
) -> tuple[RolloutBatch, RewardOutput, dict]:
    """Sample ``cfg.group_size`` completions for each prompt in ``rows`` with ``engine``; score them.

    Returns the rollout (B = len(rows) * G rows, a prompt's samples adjacent), the rewards and
    detached metrics: reward mean/std overall and per function, lengths, timings.
    """
    start = time.perf_counter()
    params = cfg.sampling([tokenizer.eos_token_id], seed)
    prompt_ids = [prompts.prompt_ids[i] for i in rows]
    rollout = engine.generate(prompt_ids, params, num_samples=cfg.group_size, pad_token_id=tokenizer.pad_token_id)
    generated = time.perf_counter()
    texts = completion_texts(tokenizer, rollout)
    problems = [prompts.problems[i] for i in rows for _ in range(cfg.group_size)]
    shared = {} if prompts.task is None else {"task": prompts.task}
    rewards = reward_set(
        texts, problems, completion_lens=rollout.completion_lens.tolist(), max_new_tokens=cfg.max_new_tokens, **shared
    )
    lengths = rollout.completion_lens.float()
    metrics = {
        **reward_metrics(rewards),
        "completion_len_mean": lengths.mean(),
        "completion_len_max": lengths.max(),
        "truncated_frac": rollout.truncated.float().mean(),
        "time_generation": generated - start,
        "time_scoring": time.perf_counter() - generated,
    }
    return rollout, rewards, metrics


class SampledSource:
    """A :class:`~lmforge.rl.sources.base.RolloutSource` that samples the run's prompts with ``engine``:
    ``sample`` (default :func:`sample_and_score`, same arguments) makes and scores a rank's rows."""

    def __init__(self, setup: SourceSetup, engine, sample: Callable | None = None):
        self.setup, self.engine = setup, engine
        self.sample = sample_and_score if sample is None else sample  # (looked up now: tests patch it)
        self.policy: Policy | None = None  # new weights not yet handed to the engine

    def sync_weights(self, policy: Policy, version: int) -> None:
        self.policy = policy  # read when the next batch is sampled (after the last step, none is)

    def next_batch(self, step: int) -> ScoredRollout:
        s = self.setup
        if self.policy is not None:  # every rank at the same step: policy() gathers under FSDP2
            self.engine.sync_weights(self.policy())
            self.policy = None
        rows = rank_prompts(s.order.next(), s.num_mini_batches, s.ctx)  # the same global order on every rank
        error, result = None, None
        try:
            result = self.sample(
                self.engine, s.tokenizer, s.prompts, rows, s.rollout, s.reward_set, step_seed(s.seed, step, s.ctx.rank)
            )
        except (DataError, TrainingError) as exc:  # e.g. too many reward failures on this rank alone
            error = exc
        s.ctx.check_all_ok(error)
        rollout, rewards, metrics = result
        if s.prompts.num_dropped or s.prompts.num_truncated:  # the run's over-long prompts (data.max_prompt_len)
            metrics.update(prompts_dropped=s.prompts.num_dropped, prompts_truncated=s.prompts.num_truncated)
        return ScoredRollout(rollout, rewards, reduce_rollout_metrics(metrics, s.ctx))

    def state_dict(self) -> dict:
        return {}  # the prompt order is the runtime's (checkpointed with the trainer state); seeds follow the step

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass
