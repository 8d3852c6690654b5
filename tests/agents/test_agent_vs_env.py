"""Issue 36 item 4 (c): the calculator task as an agent program (examples/agent_calculator.py, and its LangChain
twin) trains like ``env.name=calculator``. One GRPO batch of each from the same model, problems, sampling and
seed: every episode has the same token ids (prompt, replies, tool results), the same trained positions, the same
logprobs and the same reward on both paths -- the gateway's episodes are the environment's, token for token, so
the two runs take the same steps (docs/benchmarks.md, "Agent path vs the built-in environment", measured it
over a whole run). The model (conftest.py) calls the calculator on every turn: each episode is three calls
and two tool results, ended by the turn limit on both paths.
"""

from __future__ import annotations

import copy

import pytest
import torch
from agent_exactness import ROOT

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

COMMON = [
    "data.task=multiplication:digits=2",
    "data.num_train=16",
    "data.num_eval=2",
    "rollout.num_prompts=2",
    "rollout.group_size=2",
    "rollout.temperature=1.0",
    "rollout.max_new_tokens=100",
    "train.max_steps=1",
    "train.eval_every=0",
    "train.save_every=0",
    "logging.progress=false",
    "train.threads=1",
    "train.seed=3",
]


def _batch(model, tokenizer, overrides: list[str], out_dir) -> tuple[list[tuple], list[float]]:
    """One step's batch: per row (prompt ids, completion ids, trained mask, logprobs), and the rewards."""
    from lmforge import rl
    from lmforge.core.config import load_config
    from lmforge.recipes.grpo import GRPOConfig

    cfg = load_config(GRPOConfig, None, [*COMMON, f"train.output_dir={out_dir}", *overrides])
    state = rl.prepare(cfg, "test_agent_vs_env", cfg.algo.resolved(), model=copy.deepcopy(model), tokenizer=tokenizer)
    try:
        scored = state.source.next_batch(1)
    finally:
        state.source.close()
    r = scored.rollout
    rows = []
    for b in range(r.prompt_ids.shape[0]):
        n = int(r.completion_lens[b])
        rows.append(
            (
                r.prompt_ids[b][r.prompt_mask[b].bool()].tolist(),
                r.completion_ids[b, :n].tolist(),
                r.trained_mask[b, :n].tolist(),
                r.logprobs[b, :n],
            )
        )
    return rows, scored.rewards.total.tolist()


@pytest.mark.parametrize("agent", ["agent_calculator.py", "agent_calculator_langchain.py"])
def test_example_agent_plays_the_calculator_environments_episodes_token_for_token(calculator_model, tmp_path, agent):
    if agent.endswith("langchain.py"):
        pytest.importorskip("langchain_openai")
    model, tokenizer = calculator_model
    env_rows, env_rewards = _batch(
        model,
        tokenizer,
        [
            "env.name=calculator",
            "env.max_turns=3",
            "env.max_episode_tokens=1000",
            "env.max_invalid_calls=0",
            "rewards.functions=[]",
        ],
        tmp_path / "env",
    )
    agent_rows, agent_rewards = _batch(
        model,
        tokenizer,
        ["rollout.backend=agent", f"rollout.agent_entry={ROOT / 'examples' / agent}:run", "rewards.functions=[exact]"],
        tmp_path / "agent",
    )
    assert len(env_rows) == len(agent_rows) == 4  # one row (sample) per episode on both paths
    for (env_prompt, env_ids, env_trained, env_lp), (prompt, ids, trained, lp) in zip(env_rows, agent_rows):
        assert prompt == env_prompt
        assert ids == env_ids  # replies, template and tool results: the same tokens
        assert trained == env_trained and sum(trained) > 0
        assert torch.allclose(lp, env_lp, atol=1e-5)
        text = tokenizer.decode(env_prompt + env_ids)
        assert text.count("<tool_call>") == 3 and text.count("<|tool|>") == 2, text  # the whole loop was played
    assert agent_rewards == env_rewards
