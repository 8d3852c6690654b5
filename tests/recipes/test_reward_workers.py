"""The held-out evaluation's reward set runs with the run's reward settings and is closed when the
run ends (its worker threads / processes stop), with and without overlapped rollouts."""

import json

import pytest

from lmforge.core.config import load_config
from lmforge.recipes.grpo import GRPOConfig, run_grpo
from lmforge.rollout import rewards as rewards_module

TINY = [
    "model.tokenizer=char",
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.max_position_embeddings=48",
]


@pytest.mark.parametrize("extra", [[], ["rollout.async_steps=1", "algo.is_level=token"]], ids=["sync", "async"])
def test_the_evaluation_reward_set_uses_the_settings_and_is_closed(tmp_path, monkeypatch, extra):
    made = []

    class Recording(rewards_module.RewardSet):  # the evaluation imports RewardSet from this module
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.closed = False
            made.append(self)

        def close(self):
            self.closed = True
            super().close()

    monkeypatch.setattr(rewards_module, "RewardSet", Recording)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "run"
    run_grpo(
        load_config(
            GRPOConfig,
            None,
            TINY
            + [
                f"data.path={path}",
                "data.eval_fraction=0.1",
                "rollout.num_prompts=2",
                "rollout.group_size=4",
                "rollout.max_new_tokens=3",
                "rewards.functions=[exact]",
                "rewards.workers=1",
                "rewards.timeout_s=7",
                "train.max_steps=2",
                "train.eval_every=2",
                "train.max_new_tokens=3",
                "train.threads=1",
                "logging.progress=false",
                f"train.output_dir={out}",
                *extra,
            ],
        )
    )
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2] and all("eval_reward" in r for r in evals)
    (evaluation_set,) = made
    assert (evaluation_set.timeout_s, evaluation_set.workers) == (7.0, 1)
    assert evaluation_set.closed
