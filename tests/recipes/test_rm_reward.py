"""A reward model as an RL reward, ``rewards.functions=[rm:DIR]``: one batched call per batch under the
reward timeout, the scores those of the model on prompt + completion + eos (as a preference side is
tokenized), a directory that is not a reward model a ConfigError; and GRPO runs with it."""

from __future__ import annotations

import json
import time

import pytest
import torch

from lmforge.core.config import ModelConfig, load_config
from lmforge.core.errors import ConfigError
from lmforge.data.sft import raw_example
from lmforge.data.tasks import get_task
from lmforge.model.load import load_model, save_model
from lmforge.recipes.grpo import GRPOConfig, run_grpo
from lmforge.rollout import RewardSet
from lmforge.rollout import rewards as rewards_module
from lmforge.rollout.reward_model import from_causal_lm

TINY = ModelConfig(
    name="tiny:llama", tokenizer="char", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32
)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A saved reward model whose head is random (the zero start would score everything 0)."""
    model, tokenizer = load_model(TINY)
    reward_model = from_causal_lm(model, tokenizer)
    with torch.no_grad():
        reward_model.score.weight.copy_(
            torch.randn(reward_model.score.weight.shape, generator=torch.Generator().manual_seed(0))
        )
    out = tmp_path_factory.mktemp("rm") / "final"
    save_model(reward_model, tokenizer, out)
    return out, reward_model.eval(), tokenizer


def test_rm_reward_scores_prompt_plus_completion(rm_dir):
    path, reward_model, tokenizer = rm_dir
    problems = get_task("addition").make_problems(6, 0, "test")
    completions = ["12", "7", "", "999", problems[4].completion, "1+1"]
    with RewardSet([(f"rm:{path}", 1.0, {"batch_size": 4})], timeout_s=30.0) as reward_set:
        out = reward_set(completions, problems)
    sides = [raw_example(tokenizer, p.prompt, c, True) for p, c in zip(problems, completions)]
    with torch.no_grad():  # one at a time, unpadded
        expected = torch.stack([reward_model(input_ids=torch.tensor([s.input_ids])).logits[0, 0] for s in sides])
    torch.testing.assert_close(out.total, expected, rtol=0, atol=1e-5)
    assert float(out.total.std()) > 1e-3 and int(out.num_failed.sum()) == 0


def test_batched_reward_is_called_once_per_batch_under_the_timeout(monkeypatch):
    calls = []

    def batched(completions, problems, scale=1.0):
        calls.append(list(completions))
        return [scale * len(c) for c in completions]

    batched.batched = True
    monkeypatch.setitem(rewards_module.BUILTIN_REWARDS, "lengths", batched)
    rows = ["a", "bbb", "cc"]
    for timeout in (0.0, 5.0):  # inline and in a worker thread
        with RewardSet([("lengths", 2.0, {"scale": 0.5})], timeout_s=timeout) as reward_set:
            out = reward_set(rows, [{"answer": ""}] * 3)
        assert out.total.tolist() == [1.0, 3.0, 2.0] and calls.pop() == rows and not calls

    def slow(completions, problems):
        time.sleep(1.0)
        return [0.0] * len(completions)

    slow.batched = True
    monkeypatch.setitem(rewards_module.BUILTIN_REWARDS, "slow", slow)
    with RewardSet([("slow", 1.0)], timeout_s=0.1, max_failure_fraction=1.0) as reward_set:
        out = reward_set(rows, [{"answer": ""}] * 3)
    assert out.num_failed.tolist() == [3] and out.num_timed_out.tolist() == [3]

    def short(completions, problems):
        return [1.0]

    short.batched = True
    monkeypatch.setitem(rewards_module.BUILTIN_REWARDS, "short", short)
    with RewardSet([("short", 1.0)], timeout_s=0.0, max_failure_fraction=1.0) as reward_set:
        out = reward_set(rows, [{"answer": ""}] * 3)
    assert out.num_failed.tolist() == [3] and out.num_timed_out.tolist() == [0]


def test_a_directory_that_is_not_a_reward_model(tmp_path, rm_dir):
    model, tokenizer = load_model(TINY)
    save_model(model, tokenizer, tmp_path / "lm")
    with pytest.raises(ConfigError, match="is not one: its config.json names architectures .'LlamaForCausalLM'."):
        RewardSet([(f"rm:{tmp_path / 'lm'}", 1.0)])
    with pytest.raises(ConfigError, match="no such directory"):
        RewardSet([(f"rm:{tmp_path / 'missing'}", 1.0)])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        RewardSet([(f"rm:{tmp_path / 'empty'}", 1.0)])
    with pytest.raises(ConfigError, match="name the reward model's directory"):
        RewardSet([("rm:", 1.0)])
    with pytest.raises(ConfigError, match="batch_size must be a positive integer"):
        RewardSet([(f"rm:{rm_dir[0]}", 1.0, {"batch_size": 0})])
    with pytest.raises(ConfigError, match="is batched"):
        RewardSet([(f"rm:{rm_dir[0]}", 1.0, {}, {"executor": "process"})])


def test_grpo_with_the_reward_model_as_its_only_reward(tmp_path, rm_dir):
    args = [
        "model.tokenizer=char",
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.num_heads=2",
        "model.max_position_embeddings=32",
        "data.task=addition",
        "data.num_train=16",
        "data.num_eval=4",
        "rollout.num_prompts=2",
        "rollout.group_size=4",
        "rollout.max_new_tokens=4",
        f"rewards.functions=[rm:{rm_dir[0]}]",
        "train.max_steps=2",
        "train.micro_batch_size=8",
        "train.eval_every=0",
        "train.save_every=0",
        "train.max_new_tokens=4",
        "train.threads=1",
        "logging.progress=false",
        f"train.output_dir={tmp_path}",
    ]
    run_grpo(load_config(GRPOConfig, None, args))
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["kind"] == "train"]
    assert len(steps) == 2
    for record in steps:  # the reward model scored every completion, none failed, and they differ
        assert record["reward_failures"] == 0 and record["reward_std"] > 0
        assert record[f"reward_rm:{rm_dir[0]}"] == record["reward"] != 0


def test_grpo_with_a_missing_reward_model_stops_before_taking_the_run_directory(tmp_path):
    args = [
        "model.tokenizer=char",
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.num_heads=2",
        "data.task=addition",
        f"rewards.functions=[rm:{tmp_path / 'missing'}]",
        "train.threads=1",
        f"train.output_dir={tmp_path / 'run'}",
    ]
    with pytest.raises(ConfigError, match="no such directory"):
        run_grpo(load_config(GRPOConfig, None, args))
    assert not (tmp_path / "run").exists()


def test_a_reward_model_config_over_weights_without_the_head_is_refused(tmp_path):
    """A causal LM's weights under a reward model's config.json: transformers would load it with a random
    scoring head (a warning, then noise for rewards and exit 0); lmforge names the missing tensors."""
    model, tokenizer = load_model(TINY)
    save_model(model, tokenizer, tmp_path / "lm")
    config = json.loads((tmp_path / "lm" / "config.json").read_text())
    config.update(
        architectures=["LlamaForSequenceClassification"],
        num_labels=1,
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
    )
    (tmp_path / "lm" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"weights lack 1 tensor\(s\).*\(score\.weight\).*lmforge rm"):
        RewardSet([(f"rm:{tmp_path / 'lm'}", 1.0)])
