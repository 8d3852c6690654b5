"""A chat template that rewrites earlier turns -- drops the ``<think>`` block of every assistant turn
but the last, as reasoning models' templates do -- cannot give an environment's tokens as a clean
delta (issue 37 item 7; envs/episode.py, the prefix check of ``_answer``). The episode ends there as
documented (docs/environments.md, "When the template does not allow a clean delta"): ``end`` is
"template", counted in ``num_template_mismatches``, its ids so far kept verbatim and trained, nothing
re-tokenized. The same conversation under a template that keeps the blocks goes on to the end."""

import types

import pytest
from episode_envs import Again
from test_episodes import MODES, run_scripted

from lmforge.envs.episode import EpisodeLimits, EpisodeRunner
from lmforge.model.tokenizer import load_tokenizer
from lmforge.rl.sources.episode_batch import episode_metrics, episode_rollout
from lmforge.rollout import SamplingParams

KEEPS = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
# the same, but an assistant turn followed by another message loses everything up to its '</think>'
DROPS_OLD_THINKING = KEEPS.replace(
    "message['content']",
    "(message['content'].split('</think>')[-1] if message['role'] == 'assistant' and not loop.last "
    "else message['content'])",
)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("template", ["drops_old_thinking", "keeps"])
def test_a_template_that_rewrites_earlier_turns_ends_the_episode_counted_with_its_ids_verbatim(mode, template):
    tok = load_tokenizer("char:ascii")
    tok.chat_template = DROPS_OLD_THINKING if template == "drops_old_thinking" else KEEPS
    eos = tok.eos_token_id
    replies = ["<think>1+1 is 2</think>2", "<think>still 2</think>2"]
    turns = [tok.encode(text, add_special_tokens=False) + [eos] for text in replies]
    assert all(len(t) == len(text) + 1 for t, text in zip(turns, replies))  # one id per character
    runner = EpisodeRunner(Again(turns=2), tok, EpisodeLimits(max_turns=2, max_episode_tokens=200), workers=1)
    problem = types.SimpleNamespace(prompt="1+1=", answer="2")
    episodes, times, _ = run_scripted(
        runner, mode, turns, [problem], 2, SamplingParams(max_new_tokens=40, stop_token_ids=[eos], seed=0)
    )
    metrics = episode_metrics(episodes, times)
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    for episode in episodes:
        assert episode.prompt_ids == prompt
        if template == "keeps":  # the prefix check passes: the environment's "again" is the delta, turn 2 follows
            assert episode.end == "done" and episode.state.turn == 2
            delta = (
                tok.encode("\n<|user|>\nagain", add_special_tokens=False)
                + [eos]
                + tok.encode("\n<|assistant|>\n", add_special_tokens=False)
            )
            assert episode.ids == turns[0] + delta + turns[1]
            assert episode.trained == [1] * len(turns[0]) + [0] * len(delta) + [1] * len(turns[1])
            continue
        # the rendering after turn 1 no longer holds "<think>1+1 is 2</think>": no delta can be cut from it
        assert episode.end == "template" and episode.state.turn == 1
        assert episode.ids == turns[0] and episode.trained == [1] * len(turns[0])  # as sampled, still trained
        assert episode.logprobs == pytest.approx([-0.5 - i / 10 for i in range(len(turns[0]))])
    assert metrics["num_template_mismatches"] == (2 if template == "drops_old_thinking" else 0)
    rollout = episode_rollout(episodes, 2, tok.pad_token_id)
    assert rollout.completion_ids[0, : len(episodes[0].ids)].tolist() == episodes[0].ids
    assert rollout.trained_mask[0, : len(episodes[0].ids)].tolist() == episodes[0].trained
