"""The RL recipes' wiring: what reaches the losses from the config, which problem each reward is
scored against, and PPO's reward -> KL -> GAE -> whitening targets, each checked so that it fails
when the wiring breaks (docs/testing.md lists the breakages each test was seen to catch)."""

import torch

from lmforge import rl
from lmforge.core.config import ModelConfig, load_config
from lmforge.data.tasks import get_task
from lmforge.losses import policy as losses
from lmforge.model.load import load_model
from lmforge.recipes.grpo import GRPOConfig, run_grpo
from lmforge.recipes.ppo import PPOAlgoConfig, PPOConfig, ValueHead, add_targets, run_ppo
from lmforge.rl import config as rl_config
from lmforge.rollout import BUILTIN_REWARDS, RewardSet
from lmforge.runtime.optim import Precision

TINY = [
    "model.tokenizer=char",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.max_position_embeddings=32",
]
RUN = TINY + [
    "data.task=addition",
    "data.num_train=16",
    "data.num_eval=0",
    "rollout.num_prompts=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "rewards.functions=[parity]",
    "train.max_steps=1",
    "train.micro_batch_size=4",
    "train.save_every=0",
    "train.threads=1",
    "optim.lr=1e-2",
    "logging.progress=false",
]
# every key of rl_config.policy_spec away from its default, so a key that is dropped shows
POLICY_KEYS = {
    "aggregation": "global_token_mean",
    "eps_low": 0.1,
    "eps_high": 0.3,
    "dual_clip": 3.0,
    "is_level": "token",
    "is_cap": 1.5,
    "kl_coef": 0.1,
    "kl_estimator": "k2",
    "entropy_coef": 0.01,
}


def tiny_model():
    return load_model(
        ModelConfig(
            name="tiny:llama", tokenizer="char", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32
        )
    )


def test_grpo_config_reaches_the_policy_loss(tmp_path, spy):
    calls = spy(losses.policy_loss).calls
    overrides = [f"algo.{key}={value}" for key, value in POLICY_KEYS.items()]
    run_grpo(
        load_config(GRPOConfig, None, RUN + overrides + ["rollout.temperature=0.7", f"train.output_dir={tmp_path}"])
    )
    assert len(calls) == 2  # 8 rows in micro-batches of 4, one update
    for call in calls:
        assert {key: getattr(call["spec"], key) for key in POLICY_KEYS} == POLICY_KEYS
        assert call["spec"].loss_type == "token_clip"
        # the tensors the keys act on are there: sampler logprobs (IS), reference (KL), entropy
        for name in ("rollout_logprobs", "ref_logprobs", "entropy"):
            assert call[name] is not None and call[name].shape == call["mask"].shape, name
        assert call["entropy"].requires_grad  # entropy_coef != 0: the bonus has a gradient
        assert call["counts"].num_loss_tokens_global == int(sum(c["mask"].sum() for c in calls))


def test_ppo_config_reaches_the_policy_and_value_losses(tmp_path, spy):
    policy_calls, value_calls = spy(losses.policy_loss).calls, spy(losses.value_loss).calls
    keys = {key: value for key, value in POLICY_KEYS.items() if key != "kl_coef"}
    overrides = [f"algo.{key}={value}" for key, value in keys.items()]
    run_ppo(
        load_config(
            PPOConfig,
            None,
            RUN + overrides + ["algo.kl_coef=0.2", "algo.value_clip=0.3", f"train.output_dir={tmp_path}"],
        )
    )
    assert len(policy_calls) == len(value_calls) == 2
    for call in policy_calls:
        assert {key: getattr(call["spec"], key) for key in keys} == keys
        assert call["spec"].kl_coef == 0.0  # PPO's KL is in the reward (algo.kl_coef), never also in the loss
        assert call["rollout_logprobs"] is not None and call["entropy"] is not None
    for call in value_calls:
        assert call["clip_eps"] == 0.3 and call["aggregation"] == "global_token_mean"
        assert call["old_values"] is not None


def test_each_reward_is_scored_against_its_own_problem_and_completion(monkeypatch):
    # a reward that reads both its problem and its completion: any mis-pairing of rows, problems and
    # completions changes some row's total
    model, tokenizer = tiny_model()
    task = get_task("addition")
    prompts = rl.build_prompts(rl_config.RLDataConfig(task="addition", num_train=16, num_eval=0), tokenizer, seed=0)
    rows = [5, 2, 11]
    assert len({prompts.problems[i].answer for i in rows}) == 3

    def answer_and_length(completion, problem):
        return 100.0 * int(problem.answer) + len(completion)

    monkeypatch.setitem(BUILTIN_REWARDS, "answer_and_length", answer_and_length)

    cfg = rl_config.RolloutConfig(num_prompts=3, group_size=4, max_new_tokens=5, temperature=1.0)
    rollout, rewards, _ = rl.sample_and_score(
        rl.PolicyEngine(model), tokenizer, prompts, rows, cfg, RewardSet([("answer_and_length", 1.0)]), seed=3
    )
    by_prompt = {p.prompt: p for p in task.make_problems(16, 0, "train")}
    lengths = set()
    for b in range(rollout.prompt_ids.shape[0]):
        prompt = tokenizer.decode(rollout.prompt_ids[b][rollout.prompt_mask[b].bool()])
        completion = tokenizer.decode(
            rollout.completion_ids[b][rollout.completion_mask[b].bool()], skip_special_tokens=True
        )
        assert prompt == prompts.problems[rows[b // 4]].prompt  # a prompt's samples are adjacent, in order
        assert rewards.total[b].item() == 100.0 * int(by_prompt[prompt].answer) + len(completion), b
        lengths.add(len(completion))
    assert len(lengths) > 1  # the completions differ, so a completion/row swap would show


def ppo_batch(temperature: float):
    model, tokenizer = tiny_model()
    prompts = rl.build_prompts(rl_config.RLDataConfig(task="addition", num_train=8, num_eval=0), tokenizer, seed=0)
    cfg = rl_config.RolloutConfig(num_prompts=2, group_size=3, max_new_tokens=4, temperature=temperature)
    rollout, _, _ = rl.sample_and_score(
        rl.PolicyEngine(model), tokenizer, prompts, [0, 1], cfg, RewardSet([("exact", 1.0)]), seed=1
    )
    return model, rl.pack_rollout(rollout, tokenizer.pad_token_id, need_rollout_logprobs=False)


def full_forward_logprobs(model, batch, temperature):
    """(B, C) completion logprobs from a plain HF forward over the packed rows (no lmforge helpers)."""
    out = torch.zeros(batch.trained_mask.shape)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    for b in range(batch.num_rows):
        start = int(batch.attention_mask[b].sum()) - int(batch.trained_mask[b].sum())  # first completion token
        for t in range(int(batch.trained_mask[b].sum())):
            out[b, t] = logprobs[b, start + t - 1, batch.completion_ids[b, t]]
    return out


def test_ppo_targets_are_reward_minus_kl_then_gae_then_whitened():
    temperature, gamma, lam, kl_coef = 0.8, 0.9, 0.7, 0.25
    model, batch = ppo_batch(temperature)
    ref_model, _ = tiny_model()
    with torch.no_grad():  # a reference that differs from the policy, so the KL is not 0
        for p in ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    value_head = ValueHead(model.config.hidden_size)
    torch.nn.init.normal_(value_head.linear.weight, std=0.5)  # values != 0, so GAE's V terms count
    algo = PPOAlgoConfig(kl_coef=kl_coef, kl_estimator="k1", gamma=gamma, lam=lam).resolved()
    rewards = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, 0.0])
    batch, _ = add_targets(
        model,
        value_head,
        ref_model,
        algo,
        batch,
        rewards,
        temperature,
        4,
        Precision(torch.device("cpu"), torch.float32),
    )
    mask = batch.trained_mask
    old = full_forward_logprobs(model, batch, temperature)
    ref = full_forward_logprobs(ref_model, batch, temperature)
    torch.testing.assert_close(batch.old_logprobs * mask, old, rtol=0, atol=1e-5)
    values = batch.old_values
    assert values[mask.bool()].abs().min() > 0
    # by hand, row by row: r_t = -kl_coef * (old_t - ref_t), plus the reward on the last token;
    # delta_t = r_t + gamma V_{t+1} - V_t (V = 0 after the last token); A_t = delta_t + gamma lam A_{t+1}
    advantages = torch.zeros(mask.shape)
    for b in range(batch.num_rows):
        n = int(mask[b].sum())
        next_value = next_adv = 0.0
        for t in reversed(range(n)):
            r = -kl_coef * (old[b, t] - ref[b, t]).item() + (rewards[b].item() if t == n - 1 else 0.0)
            delta = r + gamma * next_value - values[b, t].item()
            advantages[b, t] = next_adv = delta + gamma * lam * next_adv
            next_value = values[b, t].item()
    torch.testing.assert_close(batch.returns, (advantages + values) * mask, rtol=0, atol=1e-5)
    flat = advantages[mask.bool()]
    whitened = (flat - flat.mean()) / (flat.std() + 1e-8)  # sample std over the completion tokens
    torch.testing.assert_close(batch.advantages[mask.bool()], whitened, rtol=0, atol=1e-5)
    assert (batch.advantages[~mask.bool()] == 0).all()
