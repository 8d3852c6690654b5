"""Overlapped rollouts (rollout.async_steps): staleness and IS metrics are logged, the batch of step k
was sampled by the weights of version k - 2 (one behind the trained ones), a seeded run repeats bit
for bit, resume reproduces the uninterrupted run, and the config errors."""

import pytest
import torch
from run_records import assert_resume_is_bit_exact, records

from lmforge import rl
from lmforge.core.config import ModelConfig, load_config
from lmforge.core.errors import ConfigError
from lmforge.model.load import load_model
from lmforge.recipes.grpo import GRPOConfig, run_grpo
from lmforge.rl.sources.overlap import async_threads
from lmforge.runtime.optim import Precision

ARGS = [
    "model.tokenizer=char",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.max_position_embeddings=32",
    "data.task=addition",
    "data.num_train=64",
    "data.num_eval=4",
    "rollout.num_prompts=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "rewards.functions=[parity]",
    "train.max_steps=4",
    "train.micro_batch_size=8",
    "train.save_every=1",
    "train.keep_last=10",
    "train.eval_every=4",
    "train.max_new_tokens=4",
    "train.threads=1",
    "optim.lr=3e-2",
    "logging.progress=false",
    "algo.is_level=token",
    "algo.is_cap=1.5",
    "rollout.async_steps=1",
]


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_async") / "run"
    run_grpo(load_config(GRPOConfig, None, ARGS + [f"train.output_dir={out}"]))
    return out


def test_async_run_logs_staleness_and_importance_weights(async_run):
    train = records(async_run)
    assert sorted(train) == [1, 2, 3, 4]
    assert [train[k]["rollout_version"] for k in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert [train[k]["staleness"] for k in (1, 2, 3, 4)] == [0, 1, 1, 1]
    for record in train.values():
        assert {"is_weight_mean", "is_weight_max", "is_weight_clip_frac", "time_rollout_wait"} <= set(record)
        assert 0 <= record["is_weight_clip_frac"] <= 1 and record["is_weight_max"] <= 1.5 + 1e-6
    # step 1 is on-policy: sampler and trainer hold the same weights, the weights are 1 up to rounding
    assert train[1]["rollout_diff_abs_max"] < 1e-4 and train[1]["is_weight_clip_frac"] == 0
    # later batches come from the previous weights: the trainer's logprobs differ from the sampler's
    assert all(train[k]["rollout_diff_abs_max"] > 1e-3 for k in (2, 3, 4))
    assert any(abs(train[k]["is_weight_mean"] - 1) > 1e-4 for k in (2, 3, 4))


def test_batch_of_step_k_was_sampled_by_version_k_minus_2(async_run):
    """The checkpoint after step 2 holds the launched batch of step 3; its sampler logprobs are those
    of the weights saved after step 1 (version 1), not of the weights after step 2 it is trained from."""
    saved = torch.load(async_run / "checkpoints" / "step-000002" / "trainer_state.pt", weights_only=False)
    item = saved["async_rollouts"]["pending"][3]
    assert item["version"] == 1
    batch = rl.pack_rollout(item["rollout"], 0, need_rollout_logprobs=True)
    precision = Precision(torch.device("cpu"), torch.float32)

    def logprobs_at(step):
        model, _ = load_model(ModelConfig(name=str(async_run / "checkpoints" / f"step-{step:06d}" / "model")))
        return rl.batch_logprobs(model.eval(), batch, batch.num_rows, 1.0, precision)

    mask = batch.trained_mask.bool()
    gap = {step: (logprobs_at(step) - batch.rollout_logprobs)[mask].abs().max().item() for step in (1, 2)}
    assert gap[1] < 1e-4, gap
    assert gap[2] > 1e-3, gap


def test_async_seeded_run_repeats_and_resume_is_bit_exact(async_run, tmp_path):
    again = tmp_path / "again"
    run_grpo(load_config(GRPOConfig, None, ARGS + [f"train.output_dir={again}"]))
    want, got = records(async_run), records(again)
    for step in (1, 2, 3, 4):
        for key in ("loss", "reward", "grad_norm", "is_weight_mean"):
            assert got[step][key] == want[step][key], f"repeat, step {step} {key}"
    assert_resume_is_bit_exact(
        run_grpo,
        GRPOConfig,
        ARGS,
        async_run,
        tmp_path / "resumed",
        2,
        ("rollout_version", "loss", "reward", "grad_norm", "is_weight_mean"),
    )


def test_two_steps_ahead_trains_on_batches_two_versions_old(tmp_path):
    out = tmp_path / "two"
    run_grpo(
        load_config(GRPOConfig, None, ARGS + ["rollout.async_steps=2", "train.save_every=0", f"train.output_dir={out}"])
    )
    train = records(out)
    assert [train[k]["rollout_version"] for k in (1, 2, 3, 4)] == [0, 0, 0, 1]
    assert [train[k]["staleness"] for k in (1, 2, 3, 4)] == [0, 1, 2, 2]


def test_async_config_errors(tmp_path):
    base = [a for a in ARGS if not a.startswith("algo.is_level")] + [f"train.output_dir={tmp_path / 'r'}"]
    with pytest.raises(ConfigError, match="algo.is_level"):
        run_grpo(load_config(GRPOConfig, None, base))
    with pytest.raises(ConfigError, match="rollout.async_steps"):
        load_config(GRPOConfig, None, ARGS + ["rollout.async_steps=-1"]).rollout.validate()


def test_async_threads():
    assert async_threads(2, 0) == 1  # two cores: one thread each for the sampler and the trainer
    assert async_threads(8, 0) == 4
    assert async_threads(8, 3) == 3
    assert async_threads(1, 0) == 1  # one core: both threads share it


def test_ppo_runs_with_async_rollouts(tmp_path):
    """PPO takes its rollouts through the same hook; its values and old logprobs are recomputed at
    the trained weights, so a stale batch only changes the importance weights."""
    from lmforge.recipes.ppo import PPOConfig, run_ppo

    out = tmp_path / "ppo"
    args = [a for a in ARGS if not a.startswith(("train.save_every", "train.eval_every"))]
    run_ppo(
        load_config(
            PPOConfig,
            None,
            args + ["train.max_steps=3", "train.save_every=0", "train.eval_every=3", f"train.output_dir={out}"],
        )
    )
    train = records(out)
    assert [train[k]["staleness"] for k in (1, 2, 3)] == [0, 1, 1]
    assert all(r["value_loss"] == r["value_loss"] and "is_weight_mean" in r for r in train.values())


def test_a_failed_batch_in_flight_does_not_cost_the_checkpoint_of_the_step_that_trained(tmp_path, monkeypatch):
    """The reward fails on every row of the third batch, which is sampled in the background while step 2
    trains. Step 2's checkpoint is still written (without that batch), then the run stops with the
    reward's error at step 3, and it resumes from step 2."""
    from lmforge.core.errors import TrainingError
    from lmforge.rollout import BUILTIN_REWARDS
    from lmforge.runtime.checkpoint import list_checkpoints

    calls = [0]

    def third_batch_fails(completion, problem):
        calls[0] += 1
        if 16 < calls[0] <= 24:  # 8 rows per batch: the third batch
            raise RuntimeError("verifier down")
        return float(len(completion) % 2)

    monkeypatch.setitem(BUILTIN_REWARDS, "third_batch_fails", third_batch_fails)
    out = tmp_path / "run"
    args = [a for a in ARGS if not a.startswith("rewards.")] + [
        "rewards.functions=[third_batch_fails]",
        "rewards.timeout_s=0",
        f"train.output_dir={out}",
    ]
    with pytest.raises(TrainingError, match="verifier down"):
        run_grpo(load_config(GRPOConfig, None, args))
    assert [p.name for p in list_checkpoints(out)] == ["step-000001", "step-000002"]
    assert sorted(records(out)) == [1, 2]
    calls[0] = 100  # the verifier is back
    run_grpo(load_config(GRPOConfig, None, args + ["train.resume=auto"]))
    assert sorted(records(out)) == [1, 2, 3, 4]
