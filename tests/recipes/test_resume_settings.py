"""Resuming with changed settings (issue 22): a setting that changes the computation and differs from
the run's saved config.yaml is an error (exit 2) listing each change (old -> new) and naming
train.resume_accept; nothing is written. Settings that do not change the math may change; accepted
changes are printed. Before, the run continued under the new values without a word."""

import re
import shutil

import pytest

from lmforge.cli import EXIT_USER_ERROR, main
from lmforge.core.config import load_config, resume_free_keys
from lmforge.recipes.grpo import GRPOConfig
from lmforge.recipes.sft import SFTConfig
from lmforge.runtime.resume_check import flat_settings

TINY = [
    "model.tokenizer=char",
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.max_position_embeddings=32",
    "train.threads=1",
    "train.eval_every=0",
    "train.save_every=2",
    "train.num_samples=0",
    "train.max_new_tokens=2",
    "logging.progress=false",
    "optim.lr=1e-2",
]
SFT = [
    "sft",
    "data.task=addition",
    "data.num_train=32",
    "data.num_val=4",
    "data.num_eval=2",
    "data.max_len=16",
    "train.batch_size=8",
    "train.micro_batch_size=8",
] + TINY
GRPO = [
    "grpo",
    "data.task=addition",
    "data.num_train=16",
    "data.num_eval=0",
    "rollout.num_prompts=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=3",
    "rewards.functions=[format]",
] + TINY


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One finished 2-step run per recipe, with a checkpoint at step 2; each test resumes a copy."""
    root = tmp_path_factory.mktemp("base")
    for name, args in (("sft", SFT), ("grpo", GRPO)):
        assert main(args + ["train.max_steps=2", f"train.output_dir={root / name}"]) == 0
    return root


# (recipe, changed settings) -> exit code, fragments of the output
CASES = {
    "sft: learning rate": (
        "sft",
        ["optim.lr=1e-4"],
        EXIT_USER_ERROR,
        [
            r"optim.lr: 0.01 -> 0.0001",
            r"accept the change deliberately with "
            r"train.resume_accept=\[optim.lr\]",
            r"Nothing was written",
        ],
    ),
    "sft: batch size and seed, both listed": (
        "sft",
        ["train.batch_size=16", "train.seed=3"],
        EXIT_USER_ERROR,
        [
            r"  train.batch_size: 8 -> 16\n  train.seed: 0 -> 3\n",
            r"train.resume_accept=\[train.batch_size,train.seed\]",
        ],
    ),
    "sft: schedule and model width": (
        "sft",
        ["optim.schedule=constant", "model.hidden_size=64"],
        EXIT_USER_ERROR,
        [r"model.hidden_size: 32 -> 64", r"optim.schedule: cosine -> constant"],
    ),
    "grpo: group size": (
        "grpo",
        ["rollout.group_size=4"],
        EXIT_USER_ERROR,
        [r"rollout.group_size: 2 -> 4", r"train.batch_size: 4 -> 8"],
    ),
    "grpo: algorithm": (
        "grpo",
        ["algo.kl_coef=0.1", "rollout.temperature=0.7"],
        EXIT_USER_ERROR,
        [r"algo.kl_coef: 0.0 -> 0.1", r"rollout.temperature: 1.0 -> 0.7"],
    ),
    "a misspelt key in resume_accept": (
        "sft",
        ["optim.lr=1e-4", "train.resume_accept=[optim.lrr]"],
        EXIT_USER_ERROR,
        [r"train.resume_accept names 'optim.lrr'.*Did you mean: optim.lr"],
    ),
    "free: cadence, logging, threads, length": (
        "sft",
        [
            "train.max_steps=3",
            "train.eval_every=1",
            "train.log_every=1",
            "train.save_every=3",
            "train.micro_batch_size=4",
            "logging.progress=true",
        ],
        0,
        [
            r"\[resume\] train.max_steps: 2 -> 3 \(the cosine LR schedule follows the new length",
            r"\[resume\] train.micro_batch_size: 8 -> 4 \(does not change the computation\)",
        ],
    ),
    "accepted by key": (
        "sft",
        ["train.max_steps=3", "optim.lr=1e-4", "train.resume_accept=[optim.lr]"],
        0,
        [r"\[resume\] optim.lr: 0.01 -> 0.0001 \(accepted by train.resume_accept\)"],
    ),
    "accepted by section": (
        "grpo",
        [
            "train.max_steps=3",
            "rollout.group_size=4",
            "train.batch_size=0",
            "train.resume_accept=[rollout, train.batch_size]",
        ],
        0,
        [r"\[resume\] rollout.group_size: 2 -> 4 \(accepted by train.resume_accept\)"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_with_changed_settings(case, runs, tmp_path, capsys):
    recipe, changes, code, fragments = CASES[case]
    run_dir = tmp_path / recipe
    shutil.copytree(runs / recipe, run_dir)
    saved = (run_dir / "config.yaml").read_text()
    base = SFT if recipe == "sft" else GRPO
    args = base + ["train.max_steps=2", f"train.output_dir={run_dir}", "train.resume=auto"] + changes
    capsys.readouterr()
    assert main(args) == code
    out = capsys.readouterr()
    text = out.err if code else out.out
    for fragment in fragments:
        assert re.search(fragment, text), (fragment, text[-3000:])
    if code:
        assert (run_dir / "config.yaml").read_text() == saved  # nothing written
    else:
        assert "[resume] from" in out.out


def test_resume_from_a_checkpoint_path_compares_with_that_run(runs, tmp_path, capsys):
    """train.resume=<checkpoint> into a new directory: compared with the checkpoint's own run."""
    checkpoint = runs / "sft" / "checkpoints" / "step-000002"
    args = SFT + ["train.max_steps=3", f"train.output_dir={tmp_path / 'new'}", f"train.resume={checkpoint}"]
    assert main(args + ["optim.lr=5e-3"]) == EXIT_USER_ERROR
    assert f"saved config ({runs / 'sft' / 'config.yaml'})" in capsys.readouterr().err
    assert main(args) == 0


def test_free_keys_are_marked_on_their_fields_and_a_fresh_config_equals_its_saved_copy(tmp_path):
    """Which keys a resumed run may change is read from the fields (``opt(free_on_resume=...)``): the
    runtime's sinks and schedules are free, the math is compared, and data.num_eval is free in an RL run
    only while its prompts come from a task (a prompts file holds out num_eval of its rows). A config
    read back from the YAML it was saved as compares equal (no false change)."""
    from lmforge.core.config import save_config

    for cls, args in ((SFTConfig, ["data.task=addition"]), (GRPOConfig, ["data.task=addition"])):
        cfg = load_config(cls, None, args + ["optim.lr=3e-4", "optim.no_decay=[bias]"])
        free = resume_free_keys(cfg)
        assert free <= set(flat_settings(cfg))
        assert {"train.output_dir", "train.threads", "logging.wandb", "parallel.strategy", "data.num_eval"} <= free
        assert not {"optim.lr", "train.seed", "train.batch_size", "model.name", "data.task"} & free
        save_config(cfg, tmp_path / "c.yaml")
        assert flat_settings(load_config(cls, tmp_path / "c.yaml")) == flat_settings(cfg)
    grpo = load_config(GRPOConfig, None, ["data.path=prompts.jsonl"])
    assert {"rollout.api_url", "rewards.workers", "data.pass_k"} <= resume_free_keys(grpo)
    assert "data.num_eval" not in resume_free_keys(grpo) and "algo.kl_coef" not in resume_free_keys(grpo)
    sft = load_config(SFTConfig, None, ["data.path=rows.jsonl"])
    assert "data.num_eval" in resume_free_keys(sft)  # SFT's num_eval only sizes an evaluation
    from lmforge.recipes.pretrain import PretrainConfig

    assert {"data.cache", "data.val_blocks"} <= resume_free_keys(load_config(PretrainConfig, None, []))
