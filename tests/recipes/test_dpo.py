"""``lmforge dpo`` on a tiny model: the first step's loss and rewards where policy = reference, the
reference frozen (a copy, or the LoRA policy with its adapters off), SimPO without a reference, exact
resume, bad settings as ConfigErrors through the CLI."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from lmforge.cli import main
from lmforge.core.config import load_config
from lmforge.core.errors import ConfigError
from lmforge.data.sft import collate_sft
from lmforge.model.load import load_model
from lmforge.recipes import dpo
from lmforge.runtime.checkpoint import list_checkpoints
from lmforge.supervised.pair_forward import pack_pairs, pair_logits, segment_length, side_logps
from lmforge.supervised.pairs import model_answers

REAL_MAKE_REFERENCE = dpo.make_reference

ARGS = [
    "data.task=addition",
    "data.num_train=64",
    "data.num_val=16",
    "data.num_eval=8",
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
    "train.max_new_tokens=4",
    "train.threads=1",
    "optim.lr=1e-2",
    "logging.progress=false",
]


def records(run_dir, kind="train"):
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == kind:
            by_step[record["step"]] = record
    return by_step


def run(tmp_path, *extra):
    cfg = load_config(dpo.DPOConfig, None, ARGS + [f"train.output_dir={tmp_path}", *extra])
    return cfg, dpo.run_dpo(cfg)


def test_dpo_starts_at_log_two_and_learns_the_training_pairs(tmp_path):
    _, final = run(tmp_path / "run", "train.max_steps=25", "optim.schedule=constant", "algo.beta=0.5")
    steps = records(tmp_path / "run")
    # step 1: policy = reference, so every implicit reward is 0 and every pair's loss is log 2
    assert steps[1]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert steps[1]["rewards_chosen"] == steps[1]["rewards_rejected"] == steps[1]["reward_accuracy"] == 0.0
    last = steps[25]
    assert last["loss"] < 0.6 and last["reward_margin"] > 0.1 and last["reward_accuracy"] > 0.7, last
    # held out, before training: policy = reference as well (a random tiny model does not generalise
    # from 64 pairs; examples/dpo_addition.yaml starts from an SFT'd one)
    assert final["val_reward_accuracy_before"] == 0.0 and final["val_loss_before"] == pytest.approx(math.log(2))
    assert {"accuracy", "accuracy_before", "val_loss"} <= set(final)
    assert (tmp_path / "run" / "final").is_dir()


def test_the_reference_is_the_starting_model_and_stays_frozen(tmp_path, monkeypatch):
    cfg = load_config(dpo.DPOConfig, None, ARGS + [f"train.output_dir={tmp_path}"])
    model, tokenizer = load_model(cfg.model)
    start, _ = load_model(cfg.model)
    made = []
    monkeypatch.setattr(dpo, "make_reference", lambda *a: made.append(REAL_MAKE_REFERENCE(*a)) or made[-1])
    dpo.run_dpo(cfg, model, tokenizer)
    after = made[0].state_dict()  # the run's reference, after 4 updates of the policy
    assert all(torch.equal(after[k], v) for k, v in start.state_dict().items())
    train_data, _ = dpo.build_pairs(cfg.data, cfg.train, cfg.model, tokenizer, lambda *_: None)
    pairs = train_data.pairs[:4]
    batch = pack_pairs(pairs)
    assert sum(len(ids) for ids in batch.input_ids) < batch.num_tokens  # a pair's prompt runs once for both sides
    reference = dpo.make_reference(start, "sigmoid")
    with torch.no_grad():
        start_logps, lens = side_logps(pair_logits(start, batch), batch)
    # the sequence sums equal a plain fp64 per-token sum from the model's full logits, each side collated alone
    sides = collate_sft([p.chosen for p in pairs] + [p.rejected for p in pairs], tokenizer.pad_token_id)
    predicts = sides["labels"][:, 1:] != -100
    assert lens.tolist() == predicts.sum(-1).tolist()
    torch.testing.assert_close(
        start_logps.double(),
        full_logps(start, sides["input_ids"], sides["attention_mask"], predicts),
        rtol=0,
        atol=1e-5,
    )
    assert dpo.make_reference(start, "simpo") is None and reference is not start
    # training raised log pi(chosen) - log pi(rejected) over the training pairs (each side collated and
    # run on its own here, so a swap of the sides inside the recipe's batches shows)
    margins = []
    for net in (start, model):
        sides = [
            collate_sft([getattr(p, side) for p in train_data.pairs], tokenizer.pad_token_id)
            for side in ("chosen", "rejected")
        ]
        chosen, rejected = (
            full_logps(net, b["input_ids"], b["attention_mask"], b["labels"][:, 1:] != -100) for b in sides
        )
        margins.append((chosen - rejected).mean().item())
    assert margins[1] > margins[0] + 0.05, margins


def full_logps(model, input_ids, attention_mask, predicts):
    """Sum over each row of log p(token t+1) where ``predicts[:, t]``: fp64, from the full logits."""
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.double()
    token_logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    return (token_logps * predicts[:, : token_logps.shape[1]]).sum(-1)


def test_the_hardware_choice_sees_the_longest_pair_as_it_runs(tmp_path, monkeypatch):
    """Activation checkpointing is chosen for the longest packed pair (its prompt once, both completions),
    not for two sides of data.max_len tokens; with data.rejected=policy the pairs come after the run starts."""
    seen = []
    real = dpo.start_run
    monkeypatch.setattr(
        dpo,
        "start_run",
        lambda cfg, name, model, seq_len, console: (
            seen.append(seq_len) or real(cfg, name, model, seq_len=seq_len, console=console)
        ),
    )
    cfg, _ = run(tmp_path / "rule", "train.max_steps=1", "data.max_len=24")
    train_data, val_data = dpo.build_pairs(cfg.data, cfg.train, cfg.model, load_model(cfg.model)[1], lambda *_: None)
    longest = max(segment_length(pair) for data in (train_data, val_data) for pair in data.pairs)
    longest_side = max(len(side.input_ids) for pair in train_data.pairs for side in pair)
    assert seen == [longest] and longest_side < longest < 2 * longest_side
    run(tmp_path / "policy", "train.max_steps=1", "data.max_len=24", "data.rejected=policy")
    assert seen[1] == 2 * 24


def test_sides_longer_than_a_sliding_window_are_a_config_error(tmp_path):
    cfg = load_config(dpo.DPOConfig, None, ARGS + [f"train.output_dir={tmp_path}"])
    model, tokenizer = load_model(cfg.model)
    train_data, _ = dpo.build_pairs(cfg.data, cfg.train, cfg.model, tokenizer, lambda *_: None)
    longest = max(len(side.input_ids) for pair in train_data.pairs for side in pair)
    model.config.sliding_window = longest
    dpo.check_fits_context(model, train_data)
    model.config.sliding_window = longest - 1
    with pytest.raises(ConfigError, match=f"data.max_len <= {longest - 1}"):
        dpo.check_fits_context(model, train_data)


def test_lora_reference_is_the_base_model(tmp_path):
    _, final = run(tmp_path / "lora", "model.lora.r=4", "train.max_steps=3", "optim.lr=5e-2")
    steps = records(tmp_path / "lora")
    # adapters start at B = 0: the policy equals its base, the reference (adapters off): loss log 2
    assert steps[1]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert steps[3]["loss"] < steps[1]["loss"] and steps[3]["reward_margin"] != 0.0
    assert (tmp_path / "lora" / "final" / "adapter_config.json").is_file()


def test_simpo_and_ipo_run(tmp_path):
    run(tmp_path / "simpo", "algo.loss=simpo", "algo.beta=2.0", "algo.gamma=0.5", "train.max_steps=2")
    first = records(tmp_path / "simpo")[1]
    # SimPO has no reference: step 1 is not log 2; its rewards are beta x the mean token logprob (< 0)
    assert first["rewards_chosen"] < 0 and first["rewards_rejected"] < 0 and first["loss"] != pytest.approx(math.log(2))
    run(tmp_path / "ipo", "algo.loss=ipo", "algo.beta=0.5", "train.max_steps=2")
    # IPO at policy = reference: h = 0, loss (0 - 1 / (2 beta))^2 = 1
    assert records(tmp_path / "ipo")[1]["loss"] == pytest.approx(1.0, abs=1e-6)


def test_policy_rejected_pairs_are_the_models_wrong_answers(tmp_path, capsys):
    cfg = load_config(dpo.DPOConfig, None, ARGS + [f"train.output_dir={tmp_path}", "data.rejected=policy"])
    model, tokenizer = load_model(cfg.model)
    train, _ = dpo.build_pairs(cfg.data, cfg.train, cfg.model, tokenizer, print, model)
    answers = model_answers(
        model, tokenizer, dpo.get_task("addition"), 64, 0, "train", cfg.data, cfg.train.max_new_tokens
    )
    rejected = [
        tokenizer.decode([i for i, m in zip(p.rejected.input_ids, p.rejected.loss_mask) if m], skip_special_tokens=True)
        for p in train.pairs
    ]
    assert "the starting model answers 64 of 64 training problems wrongly (and 0 blank)" in capsys.readouterr().out
    assert rejected == [a.strip() for a in answers if a.strip()]  # an untrained model: every answer wrong


def test_resume_reproduces_the_run(tmp_path):
    full = tmp_path / "full"
    run(full, "train.max_steps=6", "train.save_every=3", "train.keep_last=10")
    part = tmp_path / "part"
    shutil.copytree(full, part)
    for path in list_checkpoints(part)[1:] + [part / "final"]:  # keep the step-3 checkpoint only
        shutil.rmtree(path)
    run(part, "train.max_steps=6", "train.save_every=3", "train.keep_last=10", "train.resume=auto")
    assert {k: v["loss"] for k, v in records(part).items()} == {k: v["loss"] for k, v in records(full).items()}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algo.label_smoothing=0.1", "algo.loss=ipo"], "algo: label_smoothing is defined for the 'sigmoid'"),
        (["algo.beta=0"], "algo: beta must be > 0"),
        (["data.path=x.jsonl"], "set exactly one of data.path"),
        (["data.columns={chosen: a}"], "data.columns"),
        (["data.columns={answer: a}", "data.task=", "data.path=x.jsonl"], "answer"),
        (["data.rejected=policy", "data.task=", "data.path=x.jsonl"], "data.rejected chooses how pairs are made"),
    ],
)
def test_bad_settings_exit_2_naming_the_key(tmp_path, capsys, overrides, message):
    assert main(["dpo", *ARGS, f"train.output_dir={tmp_path}", *overrides]) == 2
    assert message in capsys.readouterr().err
