"""An agent episode's recorded calls -> training samples -> a step's rows (docs/agents.md, "The merge rule").

The merge rule. An episode's calls are taken in the order they were made. A call whose prompt ids start
with the whole of an earlier sample of the episode -- its first prompt, every call merged into it, and
the last call's sampled ids -- extends that sample: the ids between (the template's end of turn, tool
results, new user messages) join it as input, not trained, and the call's sampled ids join it trained,
with their logprobs. Any other call (the agent edited or summarised its history, a sub-agent with its
own conversation, a prompt rebuilt from text that tokenizes differently) starts a new sample of the
same episode. Every sample of an episode carries the episode's reward and its group; an episode's
samples are counted in ``samples_per_episode``. Nothing is re-tokenized here: the ids are the server's.
"""

from __future__ import annotations

import dataclasses

import torch

from ...rollout import RolloutBatch
from ...rollout.engine import left_pad


@dataclasses.dataclass
class AgentSample:
    """One training row of an episode: ``ids[:prompt_len]`` is its first prompt, ``trained`` marks the
    sampled ids after it, ``logprobs`` their logprobs (0 elsewhere)."""

    ids: list[int]
    prompt_len: int
    trained: list[int]  # over ids[prompt_len:]
    logprobs: list[float]  # over ids[prompt_len:]
    truncated: bool = False  # its last call hit its token budget


def merge_calls(calls) -> list[AgentSample]:
    """The samples of one episode's ``calls`` (``serve.sessions.Call``, in the order made): the merge rule."""
    samples: list[AgentSample] = []
    for call in calls:
        if not call.token_ids:
            continue
        prompt = call.prompt_ids
        sample = next(
            (s for s in reversed(samples) if len(prompt) >= len(s.ids) and prompt[: len(s.ids)] == s.ids), None
        )
        if sample is None:
            samples.append(AgentSample(list(prompt), len(prompt), [], []))
            sample = samples[-1]
        between = len(prompt) - len(sample.ids)
        sample.ids += prompt[len(sample.ids) :] + call.token_ids
        sample.trained += [0] * between + [1] * len(call.token_ids)
        sample.logprobs += [0.0] * between + list(call.logprobs)
        sample.truncated = call.finish_reason == "length"
    return samples


def agent_rollout(
    episodes: list[list[AgentSample]], pad_token_id: int, empty_id: int, num_rows: int | None = None
) -> RolloutBatch:
    """The rows of a step's episodes (each a list of samples, an episode's rows adjacent), as a
    RolloutBatch whose ``episode_index`` maps each row to its episode. An episode with no sample (it
    never called the model) gets one row with nothing to train (``[empty_id]``, no completion token
    trained); ``num_rows`` pads with such rows, episode -1, up to that many (equal rows on every rank).
    ``group_index`` numbers distinct first prompts: the trainer runs a shared prompt once."""
    rows, episode_index = [], []
    for e, samples in enumerate(episodes):
        for sample in samples or [AgentSample([empty_id, empty_id], 1, [0], [0.0])]:
            rows.append(sample)
            episode_index.append(e)
    while num_rows is not None and len(rows) < num_rows:
        rows.append(AgentSample([empty_id, empty_id], 1, [0], [0.0]))
        episode_index.append(-1)
    prompts = [s.ids[: s.prompt_len] for s in rows]
    distinct: dict[tuple, int] = {}
    group_index = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id)
    lengths = torch.tensor([len(s.ids) - s.prompt_len for s in rows])
    width = int(lengths.max())
    completion_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((len(rows), width), dtype=torch.long)
    trained = torch.zeros((len(rows), width), dtype=torch.long)
    logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
    for b, sample in enumerate(rows):
        n = len(sample.ids) - sample.prompt_len
        completion_ids[b, :n] = torch.tensor(sample.ids[sample.prompt_len :])
        completion_mask[b, :n] = 1
        trained[b, :n] = torch.tensor(sample.trained)
        logprobs[b, :n] = torch.tensor(sample.logprobs)
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        logprobs=logprobs,
        group_index=torch.tensor(group_index),
        prompt_lens=prompt_mask.sum(1),
        completion_lens=lengths,
        truncated=torch.tensor([s.truncated for s in rows]),
        trained_mask=trained,
        episode_index=torch.tensor(episode_index),
    )
