"""Issue 36 item 4 (b): the proofs can fail. The gateway is broken on purpose in the two ways agent
trainers have shipped -- an earlier assistant turn rendered from its text instead of from the ids
sampled for it, and one separator token dropped between an assistant turn and the tool result (verl
PR #6921) -- and the same exactness check the client proofs pass (``agent_exactness.check_exact``)
must fail, naming what broke. Each test also runs the unbroken gateway on the same episodes' seeds
first, so a failure is the break's doing, not the run's.
"""

from __future__ import annotations

import pytest
from agent_exactness import ROOT, check_exact

from lmforge.rl.sources.agent import load_agent
from lmforge.serve import sessions

pytest.importorskip("openai")

PROBLEMS = [{"prompt": "12*34=", "answer": "408"}]


@pytest.fixture(scope="module")
def example_agent():
    return load_agent(f"{ROOT}/examples/agent_calculator.py:run")


def _episodes(gateway, agent):
    episodes = gateway.run(agent, PROBLEMS, group_size=2, seed=5)
    assert max(len(e.calls) for e in episodes) >= 2, "no multi-turn episode: nothing to break"
    return episodes


def test_the_unbroken_gateway_passes_the_check(recording_gateway, example_agent):
    figures = check_exact(recording_gateway, _episodes(recording_gateway, example_agent))
    assert figures["samples_per_episode"] == 1.0


def test_an_assistant_turn_rendered_from_its_text_fails_the_check(recording_gateway, example_agent, monkeypatch):
    """The gateway forgets the recorded replies: every conversation rendered from its text (this template
    writes an assistant message's tool calls as nothing, so the history the model is shown loses them)."""
    original = sessions.Session.chat_prompt

    def from_text(self, *args, **kwargs):
        original(self, *args, **kwargs)  # the call's history is still noted; None: render from text

    monkeypatch.setattr(sessions.Session, "chat_prompt", from_text)
    episodes = _episodes(recording_gateway, example_agent)
    with pytest.raises(AssertionError) as failed:
        check_exact(recording_gateway, episodes)
    message = str(failed.value)
    assert "call 1: the prompt differs from the conversation with its replies' sampled ids" in message
    assert "samples, not 1 (its calls do not extend each other)" in message


def test_a_dropped_separator_after_an_assistant_turn_fails_the_check(recording_gateway, example_agent, monkeypatch):
    """The continued prompt loses the first token after the sampled reply (the newline the template writes
    after the end of turn, before the tool result). The calls still extend each other and the trainer
    still scores what was sampled: only the reference prompt catches it, as it must."""
    original = sessions.continue_prompt

    def dropping(tokenizer, messages, tools, prefix_ids, *args, **kwargs):
        ids = original(tokenizer, messages, tools, prefix_ids, *args, **kwargs)
        return ids[: len(prefix_ids)] + ids[len(prefix_ids) + 1 :]

    monkeypatch.setattr(sessions, "continue_prompt", dropping)
    episodes = _episodes(recording_gateway, example_agent)
    with pytest.raises(AssertionError) as failed:
        check_exact(recording_gateway, episodes)
    message = str(failed.value)
    assert "call 1: the prompt differs from the conversation with its replies' sampled ids" in message
    assert "samples, not 1" not in message  # the merge alone would not have seen it


def test_a_trainer_scoring_another_distribution_fails_the_check(recording_gateway, example_agent, monkeypatch):
    """The logprob half of the check is not vacuous: the same episodes scored by a trainer at temperature
    1.05 instead of the run's 1.0 (a mismatch of the kind a sampler's unscored logit change makes)."""
    episodes = _episodes(recording_gateway, example_agent)
    monkeypatch.setattr(recording_gateway, "TEMPERATURE", 1.05)
    with pytest.raises(AssertionError, match=r"trainer logprobs differ from the recorded ones by up to"):
        check_exact(recording_gateway, episodes)
