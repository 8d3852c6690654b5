"""An episode batch as the trainer's rows (lmforge.rl.sources.episodes, their only caller): the episodes'
tokens as a ``RolloutBatch`` (the sampled ids trained, the environment's not), the environment's reward parts
beside the configured reward functions', and the batch's episode metrics."""

from __future__ import annotations

import torch

from ...envs.episode import FAILURES, LIMITS, Episode
from ...envs.tool_env import INVALID_CALLS, TOOL_CALLS, TOOL_ERRORS
from ...rollout import RewardOutput, RolloutBatch
from ...rollout.engine import left_pad


def episode_rollout(episodes: list[Episode], group_size: int, pad_token_id: int) -> RolloutBatch:
    """The episodes as rows: the first prompt as ``prompt_ids``, every later token as the completion,
    ``trained_mask`` 1 on the sampled ids only, the sampler's logprobs there and 0 elsewhere."""
    prompt_ids, prompt_mask = left_pad([e.prompt_ids for e in episodes], pad_token_id)
    width = max(1, max(len(e.ids) for e in episodes))
    shape = (len(episodes), width)
    ids = torch.full(shape, pad_token_id, dtype=torch.long)
    mask, trained = torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long)
    logprobs = torch.zeros(shape, dtype=torch.float32)
    for row, e in enumerate(episodes):
        n = len(e.ids)
        ids[row, :n] = torch.tensor(e.ids, dtype=torch.long)
        mask[row, :n] = 1
        trained[row, :n] = torch.tensor(e.trained, dtype=torch.long)
        logprobs[row, :n] = torch.tensor(e.logprobs, dtype=torch.float32)
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=ids,
        completion_mask=mask,
        logprobs=logprobs,
        group_index=torch.arange(len(episodes)) // group_size,
        prompt_lens=prompt_mask.sum(1),
        completion_lens=mask.sum(1),
        truncated=torch.tensor([e.end != "done" for e in episodes]),
        trained_mask=trained,
    )


def combine_rewards(episodes: list[Episode], functions: RewardOutput | None, width: int) -> RewardOutput:
    """The episode rewards: the environment's parts (summed over turns; a part an episode never got is
    0), each a column ``env_<name>`` of weight 1, plus the configured reward functions' columns.
    ``turn_rewards`` (B, ``width``) holds each step's parts on the last token of the turn it answered."""
    names = sorted({name for e in episodes for name in e.rewards})
    env_parts = torch.tensor([[e.rewards.get(n, 0.0) for n in names] for e in episodes], dtype=torch.float32).reshape(
        len(episodes), len(names)
    )
    turn_rewards = torch.zeros(len(episodes), width, dtype=torch.float32)
    for row, episode in enumerate(episodes):
        for index, reward in episode.turn_rewards:
            turn_rewards[row, index] += reward
    env_names = [f"env_{n}" for n in names]
    zeros = torch.zeros(len(names), dtype=torch.int64)
    if functions is None:
        return RewardOutput(
            total=env_parts.sum(1),
            per_function=env_parts,
            names=env_names,
            num_failed=zeros,
            num_timed_out=zeros.clone(),
            turn_rewards=turn_rewards,
        )
    return RewardOutput(
        total=functions.total + env_parts.sum(1),
        per_function=torch.cat([functions.per_function, env_parts], 1),
        names=[*functions.names, *env_names],
        num_failed=torch.cat([functions.num_failed, zeros]),
        num_timed_out=torch.cat([functions.num_timed_out, zeros]),
        turn_rewards=turn_rewards,
    )


def episode_metrics(episodes: list[Episode], times: dict) -> dict:
    """The batch's episode metrics (docs/environments.md, "Limits, and what is counted")."""
    n = len(episodes)
    counts = [e.state.counts for e in episodes]
    ends = [e.end for e in episodes]
    busy = times["time_generation"] + times["time_env"]
    metrics = {
        "turns_per_episode": sum(e.state.turn for e in episodes) / n,
        "tool_calls_per_episode": sum(c.get(TOOL_CALLS, 0) for c in counts) / n,
        "num_invalid_tool_calls": sum(c.get(INVALID_CALLS, 0) for c in counts),
        "tool_errors": sum(c.get(TOOL_ERRORS, 0) for c in counts),
        "num_empty_replies": sum(e.num_empty for e in episodes),
        "num_tool_results_cut": sum(e.num_cut_results for e in episodes),
        "episodes_done_frac": ends.count("done") / n,
        "time_env": times["time_env"],
        "env_time_share": times["time_env"] / busy if busy > 0 else 0.0,
    }
    metrics.update({f"num_truncated_{limit}": ends.count(limit) for limit in LIMITS})
    metrics.update({key: ends.count(end) for end, key in FAILURES.items()})
    return metrics
