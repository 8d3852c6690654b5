"""PPO recipe on a tiny in-process model: a run of a few steps with the value head checkpointed,
bit-exact resume, the critic learning a fixed batch, terminal rewards, config errors."""

import pytest
import torch
from run_records import records

from lmforge import rl
from lmforge.core.config import ModelConfig, OptimConfig, load_config
from lmforge.core.errors import ConfigError
from lmforge.model.load import load_model
from lmforge.recipes.ppo import (
    PPOConfig,
    ValueHead,
    add_targets,
    micro_loss,
    policy_and_values,
    run_ppo,
    terminal_rewards,
)
from lmforge.rl import config as rl_config
from lmforge.rollout import RewardSet
from lmforge.runtime.optim import Precision, Updater

ARGS = [
    "model.tokenizer=char",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.max_position_embeddings=32",
    "data.task=addition",
    "data.num_train=64",
    "data.num_eval=8",
    "rollout.num_prompts=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "rewards.functions=[parity]",
    "train.max_steps=4",
    "train.micro_batch_size=4",
    "train.save_every=2",
    "train.keep_last=10",
    "train.eval_every=0",
    "train.max_new_tokens=4",
    "train.threads=1",
    "optim.lr=1e-2",
    "logging.progress=false",
    "algo.kl_coef=0.05",
    "algo.num_iterations=2",
    "algo.num_mini_batches=2",
    # T != 1: training logprobs of softmax(logits) instead of softmax(logits / T) would show below
    "rollout.temperature=0.7",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo") / "run"
    run_ppo(load_config(PPOConfig, None, ARGS + [f"train.output_dir={out}"]))
    return out


def test_ppo_runs_and_saves_the_value_head(reference):
    train = records(reference)
    assert sorted(train) == [1, 2, 3, 4]
    for record in train.values():
        assert {
            "value_loss",
            "value_mean",
            "value_clip_frac",
            "kl",
            "pg_loss",
            "entropy",
            "reward",
            "ratio_mean",
            "clip_frac_low",
            "clip_frac_high",
            "rollout_diff_abs_max",
            "grad_norm",
        } <= set(record)
    assert any(r["value_loss"] > 0 for r in train.values())
    # the trainer's rollout-time logprobs reproduce the sampler's at T = 0.7: numerical noise only
    assert all(r["rollout_diff_abs_max"] < 1e-4 for r in train.values()), [
        r["rollout_diff_abs_max"] for r in train.values()
    ]
    head = torch.load(reference / "final" / "value_head.pt")
    assert head["linear.weight"].abs().sum() > 0, "the value head never trained"
    saved = torch.load(reference / "checkpoints" / "step-000002" / "trainer_state.pt", weights_only=False)
    assert set(saved["value_head"]) == {"linear.weight", "linear.bias"}


def test_ppo_resume_is_bit_exact(reference, tmp_path):
    resumed = tmp_path / "resumed"
    run_ppo(
        load_config(
            PPOConfig,
            None,
            ARGS + [f"train.output_dir={resumed}", f"train.resume={reference / 'checkpoints' / 'step-000002'}"],
        )
    )
    want, got = records(reference), records(resumed)
    for step in (3, 4):
        for key in ("loss", "value_loss", "kl"):
            assert got[step][key] == want[step][key], f"step {step} {key}"


def test_value_loss_decreases_on_a_fixed_batch():
    torch.manual_seed(0)
    model, tokenizer = load_model(
        ModelConfig(
            name="tiny:llama", tokenizer="char", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32
        )
    )
    cfg = load_config(
        PPOConfig,
        None,
        [
            "data.task=addition",
            "rollout.num_prompts=2",
            "rollout.group_size=4",
            "rollout.max_new_tokens=4",
            "algo.value_clip=null",
            "algo.value_coef=1",
        ],
    )
    algo = cfg.algo.resolved()
    value_head = ValueHead(model.config.hidden_size)
    module = torch.nn.ModuleDict({"policy": model, "value_head": value_head})
    precision = Precision(torch.device("cpu"), torch.float32)
    updater = Updater.build(module, OptimConfig(lr=1e-2, schedule="constant"), 100, precision)
    prompts = rl.build_prompts(cfg.data, tokenizer, seed=0)
    rollout, _, _ = rl.sample_and_score(
        rl.PolicyEngine(model), tokenizer, prompts, [0, 1], cfg.rollout, RewardSet([("exact", 1.0)]), 0
    )
    batch = rl.pack_rollout(rollout, tokenizer.pad_token_id, need_rollout_logprobs=False)
    batch, _ = add_targets(
        model, value_head, None, algo, batch, torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]), 1.0, 8, precision
    )

    spec, plan = rl_config.policy_spec(algo), rl.UpdatePlan(algo.num_iterations, algo.num_mini_batches, 8, 4)

    def update_phase(step):  # ppo_step's update loop on the fixed batch
        updates = rl.Updates(batch, plan, updater, step)
        for update in updates:
            for micro in update:
                logprobs, entropy, values = policy_and_values(model, value_head, micro, 1.0, precision)
                update.backward(*micro_loss(logprobs, entropy, values, micro, spec, algo, update.counts))
            update.step()
        return updates.metrics()

    value_losses = [update_phase(step)["value_loss"] for step in range(15)]
    assert value_losses[0] > 0.05
    assert max(value_losses[-3:]) < 0.5 * value_losses[0], value_losses


def test_terminal_rewards_sit_on_the_last_completion_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    got = terminal_rewards(torch.tensor([2.0, -1.0, 0.5]), mask)
    want = torch.tensor([[0, 0, 2.0, 0], [-1.0, 0, 0, 0], [0, 0, 0, 0.5]])
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "override, message",
    [
        ("algo.loss_type=gspo", "per-token advantages"),
        ("algo.lam=1.5", "algo.lam"),
        ("algo.value_clip=0", "value_clip"),
        ("algo.kl_estimator=k9", "algo.kl_estimator"),
    ],
)
def test_bad_ppo_config_is_a_clear_error(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(PPOConfig, None, ["data.task=addition", override])
