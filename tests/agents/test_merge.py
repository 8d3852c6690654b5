"""The agent merge rule (``rl/sources/agent_samples.py``) and the per-episode advantages (``grpo.advantages_of``)
on hand-made ``Call``s: which calls merge into one sample, what is trained, where each logprob lands, the rows
of a step (empty episodes, padding) and the advantages they carry."""

from __future__ import annotations

import random

import pytest
import torch

from lmforge.recipes.grpo import GRPOAlgoConfig, advantages_of
from lmforge.rl.sources.agent_samples import AgentSample, agent_rollout, merge_calls
from lmforge.serve.sessions import Call

PAD, EMPTY = 0, 2


def call(
    index: int, prompt: list[int], tokens: list[int], logprobs: list[float] | None = None, finish: str = "stop"
) -> Call:
    logprobs = [-0.1 * (t + 1) for t in range(len(tokens))] if logprobs is None else logprobs
    return Call(index, "chat", list(prompt), list(tokens), list(logprobs), finish, 0)


def test_a_call_extending_the_previous_merges_with_the_ids_between_untrained():
    first = call(0, [5, 6, 7], [10, 11, 2], [-0.5, -0.25, -0.125])
    # the template's turn end and a tool result (not sampled) between the two replies
    second = call(1, [5, 6, 7, 10, 11, 2, 40, 41], [12, 2], [-1.5, -0.75])
    [sample] = merge_calls([first, second])
    assert sample.ids == [5, 6, 7, 10, 11, 2, 40, 41, 12, 2]
    assert sample.prompt_len == 3
    assert sample.trained == [1, 1, 1, 0, 0, 1, 1]
    assert sample.logprobs == [-0.5, -0.25, -0.125, 0.0, 0.0, -1.5, -0.75]
    assert sample.truncated is False


def test_a_call_whose_prompt_is_exactly_the_sample_so_far_adds_no_input_ids():
    first = call(0, [5, 6], [7, 8])
    second = call(1, [5, 6, 7, 8], [9], finish="length")
    [sample] = merge_calls([first, second])
    assert sample.ids == [5, 6, 7, 8, 9]
    assert sample.trained == [1, 1, 1]
    assert sample.truncated is True  # its last call hit the token budget


@pytest.mark.parametrize(
    "prompt",
    [
        [5, 6, 7, 10, 99, 2, 40],  # one sampled id differs (the reply re-tokenized differently from its text)
        [5, 6, 7, 10, 11],  # shorter than the first sample: a summarised history
        [8, 6, 7, 10, 11, 2, 40],  # the first prompt edited
    ],
)
def test_a_call_that_does_not_extend_starts_a_second_sample_of_the_episode(prompt):
    first = call(0, [5, 6, 7], [10, 11, 2])
    second = call(1, prompt, [12, 2], [-1.0, -2.0])
    samples = merge_calls([first, second])
    assert [s.ids for s in samples] == [[5, 6, 7, 10, 11, 2], prompt + [12, 2]]
    assert [s.prompt_len for s in samples] == [3, len(prompt)]
    assert samples[1].trained == [1, 1] and samples[1].logprobs == [-1.0, -2.0]


def test_interleaved_sub_agents_each_keep_their_own_sample():
    a0 = call(0, [5, 6], [10, 2], [-0.1, -0.2])
    b0 = call(1, [7, 8, 9], [20, 2], [-0.3, -0.4])
    a1 = call(2, [5, 6, 10, 2, 30], [11, 2], [-0.5, -0.6])
    b1 = call(3, [7, 8, 9, 20, 2, 31, 32], [21, 2], [-0.7, -0.8])
    a2 = call(4, [5, 6, 10, 2, 30, 11, 2, 33], [12], [-0.9])
    samples = merge_calls([a0, b0, a1, b1, a2])
    assert len(samples) == 2
    a, b = samples
    assert a.ids == [5, 6, 10, 2, 30, 11, 2, 33, 12]
    assert a.trained == [1, 1, 0, 1, 1, 0, 1]
    assert a.logprobs == [-0.1, -0.2, 0.0, -0.5, -0.6, 0.0, -0.9]
    assert b.ids == [7, 8, 9, 20, 2, 31, 32, 21, 2]
    assert b.trained == [1, 1, 0, 0, 1, 1]
    assert b.logprobs == [-0.3, -0.4, 0.0, 0.0, -0.7, -0.8]


def test_a_call_that_sampled_nothing_adds_nothing():
    assert merge_calls([call(0, [5, 6], [])]) == []
    [sample] = merge_calls([call(0, [5], [6]), call(1, [5, 6, 7], []), call(2, [5, 6, 7, 8], [9])])
    assert sample.ids == [5, 6, 7, 8, 9] and sample.trained == [1, 0, 0, 1]


def _random_episode(rng: random.Random) -> list[Call]:
    """Calls of up to three interleaved conversations, some edited (not extending) on the way; every sampled
    id is unique (100 and up), so each call's ids can be found in the rows."""
    threads: list[list[int]] = []
    calls, fresh = [], iter(range(100, 10_000))
    for index in range(rng.randint(1, 8)):
        if not threads or rng.random() < 0.3:
            threads.append([rng.randint(3, 90) for _ in range(rng.randint(1, 4))])
        t = rng.randrange(len(threads))
        if rng.random() < 0.2:  # an edit: a fresh history that shares nothing sampled
            threads[t] = [91 + rng.randint(0, 8)] + threads[t][1:2]
        tokens = [next(fresh) for _ in range(rng.randint(1, 4))]
        calls.append(call(index, threads[t], tokens, [-rng.random() for _ in tokens]))
        threads[t] = threads[t] + tokens + [rng.randint(3, 90) for _ in range(rng.randint(0, 3))]
    return calls


@pytest.mark.parametrize("seed", range(20))
def test_every_sampled_id_is_trained_exactly_once_with_its_logprob(seed):
    """No episode's tokens lost or duplicated: the trained ids of an episode's rows, in order per row, are
    its calls' sampled ids, each call's ids contiguous and with its own logprobs."""
    rng = random.Random(seed)
    episodes = [_random_episode(rng) for _ in range(3)]
    samples = [merge_calls(calls) for calls in episodes]
    batch = agent_rollout(samples, PAD, EMPTY)
    trained_calls = []
    for row in range(batch.completion_ids.shape[0]):
        mask = batch.trained_mask[row].bool()
        trained_calls.append(
            (
                int(batch.episode_index[row]),
                batch.completion_ids[row][mask].tolist(),
                batch.logprobs[row][mask].tolist(),
            )
        )
    for e, calls in enumerate(episodes):
        rows = [(ids, lps) for episode, ids, lps in trained_calls if episode == e]
        ids = sorted(sum((r[0] for r in rows), []))
        assert ids == sorted(t for c in calls for t in c.token_ids)
        # each call's ids appear, contiguous and in order, in one of its episode's rows, with its logprobs
        for c in calls:
            r_ids, r_lps = next(r for r in rows if c.token_ids[0] in r[0])
            i = r_ids.index(c.token_ids[0])
            assert r_ids[i : i + len(c.token_ids)] == c.token_ids
            assert r_lps[i : i + len(c.token_ids)] == pytest.approx(c.logprobs, abs=1e-7)
    assert bool((batch.logprobs[batch.trained_mask == 0] == 0).all())


def test_rollout_rows_episodes_placeholder_and_padding():
    a = merge_calls([call(0, [5, 6, 7], [10, 2], [-0.5, -0.25]), call(1, [5, 6, 7, 10, 2, 40], [11], [-2.0])])
    b = merge_calls([call(0, [8], [12, 13], [-1.0, -1.0]), call(1, [9, 9], [14], [-3.0], finish="length")])
    batch = agent_rollout([a, [], b], PAD, EMPTY, num_rows=6)
    assert batch.episode_index.tolist() == [0, 1, 2, 2, -1, -1]
    # prompts left-padded, completions right-padded
    assert batch.prompt_ids.tolist() == [
        [5, 6, 7],
        [PAD, PAD, EMPTY],
        [PAD, PAD, 8],
        [PAD, 9, 9],
        [PAD, PAD, EMPTY],
        [PAD, PAD, EMPTY],
    ]
    assert batch.prompt_mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 1], [0, 1, 1], [0, 0, 1], [0, 0, 1]]
    assert batch.prompt_lens.tolist() == [3, 1, 1, 2, 1, 1]
    assert batch.completion_ids.tolist() == [
        [10, 2, 40, 11],
        [EMPTY, PAD, PAD, PAD],
        [12, 13, PAD, PAD],
        [14, PAD, PAD, PAD],
        [EMPTY, PAD, PAD, PAD],
        [EMPTY, PAD, PAD, PAD],
    ]
    assert batch.completion_mask.tolist() == [
        [1, 1, 1, 1],
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 0, 0],
        [1, 0, 0, 0],
        [1, 0, 0, 0],
    ]
    assert batch.completion_lens.tolist() == [4, 1, 2, 1, 1, 1]
    # the empty episode's row and the padding rows train nothing
    assert batch.trained_mask.tolist() == [
        [1, 1, 0, 1],
        [0, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 0, 0],
        [0, 0, 0, 0],
        [0, 0, 0, 0],
    ]
    assert batch.logprobs.tolist() == [
        [-0.5, -0.25, 0.0, -2.0],
        [0.0] * 4,
        [-1.0, -1.0, 0.0, 0.0],
        [-3.0, 0.0, 0.0, 0.0],
        [0.0] * 4,
        [0.0] * 4,
    ]
    assert batch.truncated.tolist() == [False, False, False, True, False, False]
    # group_index numbers distinct first prompts (the trainer runs a shared prompt once)
    assert batch.group_index.tolist() == [0, 1, 2, 3, 1, 1]


def test_rollout_without_num_rows_has_no_padding_and_equal_num_rows_adds_none():
    samples = [[AgentSample([5, 6, 7], 2, [1], [-1.0])], [AgentSample([5, 6, 8], 2, [1], [-2.0])]]
    assert agent_rollout(samples, PAD, EMPTY).episode_index.tolist() == [0, 1]
    assert agent_rollout(samples, PAD, EMPTY, num_rows=2).episode_index.tolist() == [0, 1]
    assert agent_rollout(samples, PAD, EMPTY).group_index.tolist() == [0, 0]  # one shared prompt


def algo(advantage: str) -> GRPOAlgoConfig:
    return GRPOAlgoConfig(advantage=advantage, std_eps=0.0)


def test_advantages_are_the_episodes_group_estimate_shared_by_their_rows():
    # 4 episodes in 2 groups of 2: episode 0 has 2 rows, episode 1 one, episode 2 three, episode 3 one, + padding.
    # Each row carries its episode's reward (agent.py: rewards[episode_index]), padding 0.
    episode_index = torch.tensor([0, 0, 1, 2, 2, 2, 3, -1, -1])
    per_episode = torch.tensor([1.0, 0.0, 3.0, 0.0])
    rewards = torch.where(episode_index >= 0, per_episode[episode_index.clamp(min=0)], 0.0)
    # group_mean (r - mean of the group): group 0 = (1, 0) -> (0.5, -0.5); group 1 = (3, 0) -> (1.5, -1.5)
    advantages, metrics = advantages_of(rewards, algo("group_mean"), 2, episode_index)
    assert advantages.tolist() == [0.5, 0.5, -0.5, 1.5, 1.5, 1.5, -1.5, 0.0, 0.0]
    assert int(metrics["num_zero_variance_groups"]) == 0
    # rloo (r - mean of the others): group 0 -> (1, -1), group 1 -> (3, -3)
    advantages, _ = advantages_of(rewards, algo("rloo"), 2, episode_index)
    assert advantages.tolist() == [1.0, 1.0, -1.0, 3.0, 3.0, 3.0, -3.0, 0.0, 0.0]


def test_advantages_count_groups_of_episodes_not_rows():
    # group 0's two episodes scored the same (zero variance: all 0); group 1's did not
    episode_index = torch.tensor([0, 0, 0, 1, 2, 3, 3])
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 2.0, 2.0])
    advantages, metrics = advantages_of(rewards, algo("group_mean"), 2, episode_index)
    assert advantages.tolist() == [0.0, 0.0, 0.0, 0.0, -1.0, 1.0, 1.0]
    assert int(metrics["num_zero_variance_groups"]) == 1
    assert float(metrics["frac_zero_variance_groups"]) == 0.5


def test_advantages_without_episode_index_are_per_row():
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])
    advantages, _ = advantages_of(rewards, algo("group_mean"), 2)
    assert advantages.tolist() == [0.5, -0.5, 0.0, 0.0]
