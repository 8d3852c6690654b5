"""The episode source, chosen when ``env.name`` is set: ``rollout.group_size`` episodes of the
environment for each of this rank's next problems, run token-in / token-out on the ``inprocess``
engines (the policy, or its ``rollout.dtype`` copy) by :class:`~lmforge.envs.episode.EpisodeRunner`,
scored by the environment's reward parts plus ``rewards.functions`` on each episode's last assistant
message. Rows are whole episodes: the first prompt, then the policy's turns (trained) and the
environment's messages (not trained) -- docs/environments.md.

The step's seed, the prompt order, the rank's share (groups whole) and the weight syncs are the
in-process source's (``sampled.SampledSource``), so an overlapped run, a run under torchrun and a
resumed run behave as they do for single-turn rows; a one-turn environment gives exactly the rows,
rewards and losses of the plain source (tests/recipes/test_episodes.py).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from ...core.errors import ConfigError, TrainingError
from ...envs.episode import Episode, EpisodeRunner
from ...envs.registry import make_environment
from ...model.load import context_length
from ...rollout import RewardOutput, RewardSet, RolloutBatch, SamplingParams, generate
from ...rollout.continuous import ContinuousDecoder, has_full_attention_caches
from ...rollout.drafts import NgramDrafter
from ...rollout.rewards import default_workers
from ..config import RolloutConfig
from ..prompts import PromptSet
from .base import SourceSetup
from .episode_batch import combine_rewards, episode_metrics, episode_rollout
from .inprocess import make_engine
from .sampled import SampledSource, reward_metrics

log = logging.getLogger(__name__)
_FELL_BACK: set[str] = set()  # model types already told about (one warning each per process)


# Ends where the environment failed (raised, hung, answered something malformed): a batch of only these
# trains on rewards no environment gave, so it stops the run as a batch with nothing to train on does.
BROKEN = ("env_error", "timeout", "malformed")


def score_episodes(
    episodes: list[Episode], reward_set: RewardSet | None, task, max_new_tokens: int, width: int
) -> RewardOutput:
    """The environment's parts plus the reward functions on each episode's last assistant message (its
    length: the policy's tokens of the whole episode); ``width``: the rows' completion width."""
    functions = None
    if reward_set is not None:
        shared = {} if task is None else {"task": task}
        functions = reward_set(
            [e.final_text for e in episodes],
            [e.state.problem for e in episodes],
            completion_lens=[e.num_trained for e in episodes],
            max_new_tokens=max_new_tokens,
            **shared,
        )
    return combine_rewards(episodes, functions, width)


def rollout_metrics(rollout: RolloutBatch, rewards: RewardOutput, episodes: list[Episode], times: dict) -> dict:
    """The single-turn source's metrics (reward, lengths of the policy's tokens, timings) and the episodes'."""
    policy_tokens = rollout.trained.sum(1).float()
    return {
        **reward_metrics(rewards),
        "completion_len_mean": policy_tokens.mean(),
        "completion_len_max": policy_tokens.max(),
        "episode_len_mean": rollout.completion_lens.float().mean(),
        "truncated_frac": rollout.truncated.float().mean(),
        **episode_metrics(episodes, times),
        "time_generation": times["time_generation"],
        **(
            {
                "draft_acceptance": times["accepted_tokens"] / max(1, times["draft_tokens"]),
                "draft_tokens_per_episode": times["draft_tokens"] / len(episodes),
            }
            if "draft_tokens" in times
            else {}
        ),
    }


def run_episodes(
    runner: EpisodeRunner,
    continuous: bool,
    model: torch.nn.Module,
    generate_fn: Callable,
    problems: list,
    group_size: int,
    params: SamplingParams,
    pad_token_id: int,
    drafter: NgramDrafter | None = None,
) -> tuple[list[Episode], dict]:
    """``runner.run_continuous`` on ``model`` (in eval mode meanwhile) or round-based ``runner.run`` on
    ``generate_fn`` (``env.continuous``). A model whose KV cache has sliding-window or other special
    layers, which the continuous decoder cannot merge between rows, runs in rounds, with one warning.
    ``drafter``: the continuous decoder checks its drafts (``env.draft_tokens``); the times then also
    hold ``draft_tokens`` and ``accepted_tokens``."""
    if continuous and not has_full_attention_caches(model):
        kind = getattr(model.config, "model_type", type(model).__name__)
        if kind not in _FELL_BACK:
            _FELL_BACK.add(kind)
            log.warning(
                "env.continuous: %s has sliding-window (or other non-full-attention) cache layers, which "
                "continuous batching cannot merge between episodes; its episodes run in rounds "
                "(as env.continuous=false)",
                kind,
            )
        continuous = False
    if not continuous:
        return runner.run(generate_fn, problems, group_size, params)
    was_training = model.training
    model.eval()  # no dropout while sampling
    try:
        decoder = ContinuousDecoder(model, pad_token_id, drafter=drafter)
        episodes, times = runner.run_continuous(decoder, problems, group_size, params)
        if drafter is not None:
            times.update(draft_tokens=decoder.num_draft_tokens, accepted_tokens=decoder.num_accepted_tokens)
        return episodes, times
    finally:
        model.train(was_training)


def overlong_prompt_error(episodes: list[Episode], context: int | None) -> str:
    """The error of a batch whose every first prompt (the environment's reset, rendered) alone filled the
    model's context: no episode could sample a token."""
    lengths = sorted(e.overlong_prompt for e in episodes)
    span = f"{lengths[0]}" if lengths[0] == lengths[-1] else f"{lengths[0]}-{lengths[-1]}"
    return (
        f"the environment's first prompt is {span} tokens with this tokenizer, and the model's context is "
        f"{context}: no episode has room for a reply (each ended before its first turn). Use a model with a "
        "longer context (model.max_position_embeddings for a tiny: model), a tokenizer whose chat template "
        "writes tools briefly (model.tokenizer=char:ascii lists each tool as 'name(params)'; other "
        "tokenizers without a tool format get lmforge's JSON tools block of some 600 characters), or a "
        "shorter system prompt / tool list in the environment"
    )


def episode_sampler(runner: EpisodeRunner, continuous: bool, draft_tokens: int = 0) -> Callable:
    """``SampledSource``'s ``sample``: run and score episodes of this rank's problems ``rows``; with
    ``draft_tokens``, one n-gram drafter learns from every step's episodes (``env.draft_tokens``)."""
    drafter = NgramDrafter(draft_tokens) if draft_tokens and continuous else None

    def sample(
        engine,
        tokenizer,
        prompts: PromptSet,
        rows: list[int],
        cfg: RolloutConfig,
        reward_set: RewardSet | None,
        seed: int,
    ) -> tuple[RolloutBatch, RewardOutput, dict]:
        params = cfg.sampling([tokenizer.eos_token_id], seed)
        problems = [prompts.problems[i] for i in rows]

        def sample_turns(ids, turn_params, num_samples):
            return engine.generate(ids, turn_params, num_samples=num_samples, pad_token_id=tokenizer.pad_token_id)

        episodes, times = run_episodes(
            runner,
            continuous,
            engine.model,
            sample_turns,
            problems,
            cfg.group_size,
            params,
            tokenizer.pad_token_id,
            drafter,
        )
        if not any(e.num_trained and e.end not in BROKEN for e in episodes):
            if all(e.overlong_prompt for e in episodes):
                raise ConfigError(overlong_prompt_error(episodes, context_length(engine.model)))
            ends = sorted({e.end for e in episodes})
            raise TrainingError(
                f"no episode of this batch is usable: each has no policy token to train on or its "
                f"environment failed (they ended as: {', '.join(ends)}); the environment fails on "
                "every problem (see the warnings above, and env.tool_timeout_s / "
                "env.max_episode_tokens)"
            )
        rollout = episode_rollout(episodes, cfg.group_size, tokenizer.pad_token_id)
        start = time.perf_counter()
        rewards = score_episodes(
            episodes, reward_set, prompts.task, cfg.max_new_tokens, rollout.completion_ids.shape[1]
        )
        metrics = rollout_metrics(rollout, rewards, episodes, times)
        metrics["time_scoring"] = time.perf_counter() - start
        return rollout, rewards, metrics

    return sample


def make_runner(setup: SourceSetup) -> EpisodeRunner:
    """The runner of ``setup.env``'s environment on ``setup.tokenizer``, within the policy's context."""
    env = setup.env
    return EpisodeRunner(
        make_environment(env.name, env.args),
        setup.tokenizer,
        env.limits(),
        env.workers or default_workers(),
        context_length(setup.policy),
    )


class EpisodeSource(SampledSource):
    """The in-process source with episodes for rows (module doc); closes its environment threads."""

    def __init__(self, setup: SourceSetup):
        self.runner = make_runner(setup)
        super().__init__(
            setup, make_engine(setup), sample=episode_sampler(self.runner, setup.env.continuous, setup.env.draft_tokens)
        )

    def close(self) -> None:
        self.runner.close()


def build(setup: SourceSetup) -> EpisodeSource:
    return EpisodeSource(setup)


def episode_evaluator(
    env_cfg,
    tokenizer,
    problems: list,
    task,
    reward_specs: list[tuple],
    max_new_tokens: int,
    context: int | None,
    reward_timeout_s: float,
    reward_workers: int,
    batch_size: int = 64,
):
    """``evaluate(model) -> (metrics, episodes, rewards)``: one greedy episode per held-out problem.

    A success is an episode whose reward (the environment's parts plus the weighted reward functions)
    reaches 1, full marks: ``accuracy`` is the success rate; also ``eval_reward`` (mean reward),
    ``eval_turns`` (mean turns), ``eval_turns_to_solve`` (mean turns of the successes; 0 when none) and
    ``eval_tool_calls`` (mean tool calls per episode). Turns are
    ``max_new_tokens`` long at most; the rewards run with failures scored, never stopping the run.
    The function has a ``close()`` for the environment threads and reward workers.
    """
    runner = EpisodeRunner(
        make_environment(env_cfg.name, env_cfg.args),
        tokenizer,
        env_cfg.limits(),
        env_cfg.workers or default_workers(),
        context,
    )
    reward_set = (
        RewardSet(reward_specs, max_failure_fraction=1.0, timeout_s=reward_timeout_s, workers=reward_workers)
        if reward_specs
        else None
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=[tokenizer.eos_token_id])

    def evaluate(model) -> tuple[dict, list[Episode], list[float]]:
        def generate_fn(ids, turn_params, num_samples):
            return generate(model, ids, turn_params, num_samples=num_samples, pad_token_id=tokenizer.pad_token_id)

        episodes: list[Episode] = []
        for start in range(0, len(problems), batch_size):
            episodes += run_episodes(
                runner,
                env_cfg.continuous,
                model,
                generate_fn,
                problems[start : start + batch_size],
                1,
                params,
                tokenizer.pad_token_id,
            )[0]
        width = max(1, max(len(e.ids) for e in episodes))
        totals = score_episodes(episodes, reward_set, task, max_new_tokens, width).total
        metrics = episode_metrics(episodes, {"time_generation": 0.0, "time_env": 0.0})
        solved_turns = [e.state.turn for e, total in zip(episodes, totals.tolist()) if total >= 1.0]
        return (
            {
                "accuracy": (totals >= 1.0).float().mean().item(),
                "eval_reward": totals.mean().item(),
                "eval_turns": metrics["turns_per_episode"],
                "eval_turns_to_solve": sum(solved_turns) / len(solved_turns) if solved_turns else 0.0,
                "eval_tool_calls": metrics["tool_calls_per_episode"],
            },
            episodes,
            totals.tolist(),
        )

    def close() -> None:
        runner.close()
        if reward_set is not None:
            reward_set.close()

    evaluate.close = close
    return evaluate
