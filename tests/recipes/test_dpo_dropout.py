"""DPO's policy runs without the model's own dropout by default (issue 37 item 7), as TRL's
``disable_dropout=True`` does: the reference runs without it, so with it the log-ratios are noise from
step 1 on. Docs: docs/preference.md."""

import json
import math

import pytest
import torch

from lmforge.core.config import load_config
from lmforge.model.load import load_model
from lmforge.recipes import dpo

ARGS = [
    "data.task=addition",
    "data.num_train=16",
    "data.num_val=8",
    "data.num_eval=0",
    "data.max_len=16",
    "model.tokenizer=char",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.max_position_embeddings=32",
    "train.max_steps=1",
    "train.micro_batch_size=8",
    "train.batch_size=8",
    "train.eval_every=0",
    "train.save_every=0",
    "train.max_new_tokens=4",
    "train.threads=1",
    "logging.progress=false",
]


def first_step(tmp_path, *extra) -> dict:
    cfg = load_config(dpo.DPOConfig, None, ARGS + [f"train.output_dir={tmp_path}", *extra])
    model, tokenizer = load_model(cfg.model)
    attention = [m for m in model.modules() if isinstance(getattr(m, "attention_dropout", None), float)]
    assert attention  # the tiny Llama's attention modules apply this rate in training mode
    for module in attention:
        module.attention_dropout = 0.5
    dpo.run_dpo(cfg, model, tokenizer)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["kind"] == "train" and r["step"] == 1)


def test_a_model_with_dropout_starts_at_log_two_by_default(tmp_path):
    step = first_step(tmp_path / "default")
    # policy = reference, exactly: every implicit reward is 0 and every pair's loss is log 2
    assert step["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert step["rewards_chosen"] == step["rewards_rejected"] == 0.0
    kept = first_step(tmp_path / "kept", "algo.disable_dropout=false")  # what the default prevents
    assert abs(kept["loss"] - math.log(2)) > 1e-3 and kept["rewards_chosen"] != 0.0, kept


def test_disable_dropout_sets_the_models_rates_and_leaves_loras():
    model = torch.nn.Module()
    model.drop = torch.nn.Dropout(0.1)
    model.attn = torch.nn.Module()
    model.attn.attention_dropout = 0.2
    model.lora_dropout = torch.nn.ModuleDict({"default": torch.nn.Dropout(0.3)})
    model.off = torch.nn.Dropout(0.0)
    assert dpo.disable_dropout(model) == 2
    assert (model.drop.p, model.attn.attention_dropout, model.lora_dropout["default"].p) == (0.0, 0.0, 0.3)
