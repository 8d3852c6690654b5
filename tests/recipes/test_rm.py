"""``lmforge rm`` on a tiny model: log 2 at the start (the head starts at zero), learning the training
pairs, the saved directory loads with transformers' AutoModelForSequenceClassification and gives the
rewards lmforge computed (and the head at the last non-pad token, written out by hand), exact resume,
skipped pairs counted, bad settings exit 2."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from lmforge.cli import main
from lmforge.core.config import load_config
from lmforge.data.preference import collate_pairs
from lmforge.model.load import load_model
from lmforge.recipes import rm
from lmforge.rollout.reward_model import from_causal_lm, load_reward_model, sequence_rewards
from lmforge.runtime.checkpoint import list_checkpoints

ARGS = [
    "data.task=addition",
    "data.num_train=64",
    "data.num_val=16",
    "data.max_len=16",
    "model.tokenizer=char",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.max_position_embeddings=32",
    "train.max_steps=4",
    "train.micro_batch_size=4",
    "train.batch_size=8",
    "train.eval_every=0",
    "train.save_every=0",
    "train.threads=1",
    "optim.lr=1e-2",
    "optim.schedule=constant",
    "logging.progress=false",
]


def records(run_dir, kind="train"):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["kind"] == kind}


def run(tmp_path, *extra):
    cfg = load_config(rm.RMConfig, None, ARGS + [f"train.output_dir={tmp_path}", *extra])
    return cfg, rm.run_rm(cfg)


def test_rm_starts_at_log_two_and_learns_the_training_pairs(tmp_path):
    _, final = run(tmp_path / "run", "train.max_steps=40", "optim.lr=1e-3")
    steps = records(tmp_path / "run")
    # the head starts at zero: every reward is 0, every pair's loss log 2, no pair won (a tie)
    assert steps[1]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert steps[1]["rewards_chosen"] == steps[1]["rewards_rejected"] == steps[1]["accuracy"] == 0.0
    assert final["val_accuracy_before"] == 0.0 and final["val_loss_before"] == pytest.approx(math.log(2), abs=1e-6)
    # a random tiny body, 8 pairs a step: single steps are noisy, the last ten steps' means are not
    late = [steps[k] for k in range(31, 41)]
    mean = lambda key: sum(r[key] for r in late) / len(late)  # noqa: E731
    assert mean("loss") < 0.62 and mean("accuracy") > 0.65 and mean("reward_margin") > 0.2, late[-1]
    assert {"val_loss", "val_accuracy", "val_reward_margin"} <= set(final)


def test_saved_directory_loads_with_transformers_and_scores_the_same(tmp_path):
    from transformers import AutoModelForSequenceClassification

    cfg, _ = run(tmp_path / "run", "train.max_steps=6")
    final = tmp_path / "run" / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert len(config["id2label"]) == 1 and config["pad_token_id"] is not None
    hf = AutoModelForSequenceClassification.from_pretrained(str(final)).eval()
    assert hf.num_labels == 1 and float(hf.score.weight.detach().abs().sum()) > 0  # trained, not the zero start
    ours, tokenizer = load_reward_model(final)
    train, _ = rm.build_pairs(cfg.data, cfg.train, cfg.model, tokenizer, lambda *_: None)
    pairs = train.pairs[:8]
    batch = collate_pairs(pairs, tokenizer.pad_token_id)  # (16, T) right-padded: sides of different lengths
    assert int((batch["attention_mask"] == 0).sum()) > 0
    with torch.no_grad():
        lmforge_rewards = sequence_rewards(ours, batch["input_ids"], batch["attention_mask"])  # (16,)
        # transformers, one unpadded sequence at a time
        hf_rewards = torch.stack(
            [
                hf(input_ids=torch.tensor([side.input_ids])).logits[0, 0]
                for side in [p.chosen for p in pairs] + [p.rejected for p in pairs]
            ]
        )
        # written out: the head on the body's last hidden state at the last real token
        hidden = hf.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        last = batch["attention_mask"].sum(-1) - 1
        by_hand = hidden[torch.arange(len(last)), last] @ hf.score.weight[0]
    torch.testing.assert_close(lmforge_rewards, hf_rewards, rtol=0, atol=1e-5)
    torch.testing.assert_close(lmforge_rewards, by_hand, rtol=0, atol=1e-5)
    assert float(lmforge_rewards.std()) > 1e-3  # the rewards differ between sequences: the check can fail


def test_the_reward_model_starts_from_the_causal_lm_body(tmp_path):
    cfg = load_config(rm.RMConfig, None, ARGS)
    model, tokenizer = load_model(cfg.model)
    reward_model = from_causal_lm(model, tokenizer)
    for name, value in model.model.state_dict().items():
        assert torch.equal(reward_model.model.state_dict()[name], value), name
    assert not reward_model.score.weight.any() and reward_model.config.pad_token_id == tokenizer.pad_token_id


def test_resume_reproduces_the_run(tmp_path):
    full = tmp_path / "full"
    run(full, "train.max_steps=6", "train.save_every=3", "train.keep_last=10")
    part = tmp_path / "part"
    shutil.copytree(full, part)
    for path in list_checkpoints(part)[1:] + [part / "final"]:  # keep the step-3 checkpoint only
        shutil.rmtree(path)
    run(part, "train.max_steps=6", "train.save_every=3", "train.keep_last=10", "train.resume=auto")
    assert {k: v["loss"] for k, v in records(part).items()} == {k: v["loss"] for k, v in records(full).items()}


def test_identical_pairs_are_skipped_and_counted(tmp_path, capsys):
    rows = [
        {"prompt": f"{a}+{a}=", "chosen": str(2 * a)[::-1], "rejected": str(2 * a + 1)[::-1]} for a in range(10, 30)
    ]
    rows[3]["rejected"] = rows[3]["chosen"]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, final = run(tmp_path / "run", "data.task=", f"data.path={path}", "data.val_fraction=0.2", "train.max_steps=2")
    assert "1 with chosen = rejected skipped" in capsys.readouterr().out
    assert "val_accuracy" in final


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algo.margin=-1"], "algo.margin must be >= 0"),
        (["algo.loss=hinge"], "algo.loss"),
        (["model.lora.r=4"], "model.lora is not supported"),
        (["data.path=x.jsonl"], "set exactly one of data.path"),
        (["data.num_eval=5"], "data.num_eval is not used by lmforge rm"),
    ],
)
def test_bad_settings_exit_2_naming_the_key(tmp_path, capsys, overrides, message):
    assert main(["rm", *ARGS, f"train.output_dir={tmp_path}", *overrides]) == 2
    assert message in capsys.readouterr().err
