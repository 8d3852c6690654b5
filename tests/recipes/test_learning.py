"""RL learns: GRPO raises a reward it can reach within seconds (default run), and on the quickstart
task a short GRPO run from a short SFT raises held-out accuracy (``slow``). Each margin comes from
runs with several seeds, whose numbers the test's docstring records."""

import dataclasses
import json

import pytest

from lmforge.core.config import load_config
from lmforge.data.tasks import get_task
from lmforge.model.load import load_model
from lmforge.model.tokenizer import char_tokenizer
from lmforge.pipelines.quickstart import QuickstartConfig, grpo_config, sft_config
from lmforge.recipes.grpo import GRPOConfig, run_grpo
from lmforge.recipes.sft import run_sft
from lmforge.rollout import BUILTIN_REWARDS


def sevens(completion: str, problem) -> float:
    """The fraction of a 4-token completion that is the character 7: ~1/20 for a random model."""
    return completion.count("7") / 4


def rewards_by_step(run_dir) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["reward"] for r in map(json.loads, lines) if r["kind"] == "train"]


def grpo_on_sevens(out, lr: float, seed: int = 0) -> list[float]:
    run_grpo(
        load_config(
            GRPOConfig,
            None,
            [
                "model.tokenizer=char",
                "model.hidden_size=32",
                "model.num_layers=2",
                "model.num_heads=2",
                "model.max_position_embeddings=32",
                f"model.init_seed={seed}",
                "data.task=addition",
                "data.num_train=64",
                "data.num_eval=0",
                "rollout.num_prompts=4",
                "rollout.group_size=8",
                "rollout.max_new_tokens=4",
                "rewards.functions=[sevens]",
                "train.max_steps=15",
                "train.micro_batch_size=32",
                "train.save_every=0",
                "train.threads=1",
                f"train.seed={seed}",
                f"optim.lr={lr}",
                "optim.schedule=constant",
                "logging.progress=false",
                f"train.output_dir={out}",
            ],
        )
    )
    return rewards_by_step(out)


def test_grpo_raises_a_reachable_reward(tmp_path, monkeypatch):
    """15 GRPO steps (4 prompts x 8 samples, lr 1e-2) on a random tiny Llama, rewarded for writing 7s.

    Measured with seeds 0-4 (model init and sampling), reward at step 1 -> mean of steps 13-15:
    0.031 -> 0.781, 0.062 -> 0.826, 0.016 -> 0.854, 0.055 -> 0.784, 0.031 -> 0.807; the control at
    lr 1e-8 (the same samples at step 1, weights that do not move) ends at 0.028, 0.029, 0.034,
    0.034, 0.036 (its first and last three steps all <= 0.062). The test asks for a rise of 0.5 and a control below 0.2,
    far from both. ~1.5 s per run on an idle core.
    """
    monkeypatch.setitem(BUILTIN_REWARDS, "sevens", sevens)
    learned = grpo_on_sevens(tmp_path / "lr", lr=1e-2)
    frozen = grpo_on_sevens(tmp_path / "frozen", lr=1e-8)  # the control: same start, weights that barely move
    assert len(learned) == len(frozen) == 15
    assert learned[0] == frozen[0] < 0.2  # the same random start
    late = sum(learned[-3:]) / 3
    assert late - learned[0] > 0.5, learned
    assert max(frozen) < 0.2, frozen  # without updates the reward does not rise by itself


def addition_accuracy_gain(root, seed: int) -> tuple[float, float]:
    """The quickstart's SFT (tiny Llama 128 x 4, 600 steps) then 100 GRPO steps with the quickstart's
    GRPO settings (lr 5e-5); held-out accuracy on 200 problems."""
    cfg = QuickstartConfig(output_dir=str(root), seed=seed, grpo_steps=100, progress=False)
    sft = sft_config(cfg, root)
    sft = dataclasses.replace(sft, train=dataclasses.replace(sft.train, threads=1, eval_every=0, save_every=0))
    model, tokenizer = load_model(sft.model, char_tokenizer(get_task(cfg.task).alphabet))
    run_sft(sft, model, tokenizer)
    grpo = grpo_config(cfg, root)
    grpo = dataclasses.replace(grpo, train=dataclasses.replace(grpo.train, threads=1, eval_every=0, save_every=0))
    result = run_grpo(grpo, model, tokenizer)
    return result["accuracy_before"], result["accuracy"]


@pytest.mark.slow
def test_grpo_after_sft_raises_heldout_addition_accuracy(tmp_path):
    """Measured with seeds 0-3 on the AVX2-only 2-core machine (held-out accuracy on 200 problems,
    after SFT -> after GRPO): 81.5 -> 96.0%, 95.5 -> 98.5%, 67.0 -> 90.0%, 81.5 -> 92.5%: the errors
    fell to 0.22, 0.33, 0.30 and 0.41 of the start's. At lr 1e-4 the same runs ended at 0.32, 0.67,
    0.38 and 0.86; from a 400-step SFT model, lr 2e-4 for 60 steps collapsed (-37, -37, -5.5 points):
    the test would catch a policy gradient with the wrong sign. The test asks that the errors fall
    to at most 0.6 of the start's, from a start of at least 50%; the SFT stage's accuracy at a fixed
    step depends on the machine's kernels (the 400-step model of seed 0 was 69% on an AVX-512 machine
    and 25.5% on the AVX2 one), so where it starts above 95% and 0.6 of its errors would be within a
    few problems, the check is that it ends at 97% or more. ~1.5 min on an idle core."""
    before, after = addition_accuracy_gain(tmp_path, seed=0)
    assert before >= 0.5, f"SFT reached only {before:.1%}: below the 50% this check is sized for"
    assert 1 - after <= max(0.6 * (1 - before), 0.03), (before, after)
