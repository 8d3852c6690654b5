"""CUDA only (marker ``gpu``; skipped without a GPU): SFT in bf16 and fp16 autocast, the fp16 grad
scaler's state in the checkpoint, and a resume that reproduces the uninterrupted run. The scaler's
logic itself is checked on CPU in tests/runtime/test_train.py."""

import json

import pytest
import torch

from lmforge.core.config import load_config
from lmforge.recipes.sft import SFTConfig, run_sft

ARGS = [
    "data.task=addition",
    "data.num_train=64",
    "data.num_val=16",
    "data.num_eval=0",
    "data.max_len=16",
    "model.tokenizer=char",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "train.device=cuda",
    "train.max_steps=6",
    "train.micro_batch_size=16",
    "train.save_every=3",
    "train.eval_every=0",
    "optim.lr=1e-2",
    "logging.progress=false",
]


def losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_sft_learns_and_resumes(tmp_path, dtype):
    out = tmp_path / "run"
    run_sft(load_config(SFTConfig, None, ARGS + [f"train.dtype={dtype}", f"train.output_dir={out}"]))
    reference = losses(out)
    assert reference[6] < reference[1]
    state = torch.load(out / "checkpoints" / "step-000003" / "trainer_state.pt", weights_only=False)
    assert bool(state["precision"]) == (dtype == "fp16")  # the grad scaler's state, fp16 only
    resumed = tmp_path / "resumed"
    run_sft(
        load_config(
            SFTConfig,
            None,
            ARGS
            + [
                f"train.dtype={dtype}",
                f"train.output_dir={resumed}",
                f"train.resume={out / 'checkpoints' / 'step-000003'}",
            ],
        )
    )
    got = losses(resumed)
    for step in (4, 5, 6):  # same kernels, same order: equal up to CUDA's non-determinism
        assert got[step] == pytest.approx(reference[step], rel=1e-3), step
