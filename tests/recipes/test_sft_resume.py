"""Exact resume: a run killed at step k (also during a checkpoint save) and resumed reproduces the
uninterrupted run's loss at every later step, bit for bit, on CPU."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from lmforge.core.config import load_config
from lmforge.core.errors import ConfigError
from lmforge.recipes.sft import SFTConfig, run_sft
from lmforge.runtime.checkpoint import list_checkpoints

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
    "train.max_steps=8",
    "train.micro_batch_size=8",
    "train.batch_size=16",
    "train.save_every=2",
    "train.keep_last=10",
    "train.eval_every=4",
    "train.max_new_tokens=4",
    "train.threads=1",
    "optim.lr=1e-2",
    "optim.warmup_steps=2",
    "logging.progress=false",
]


def losses(run_dir):
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            by_step[record["step"]] = record["loss"]  # a resumed run rewrites later steps
    return by_step


def crash_run(out_dir, patch: str):
    """Run the SFT recipe in a subprocess that dies (os._exit) where ``patch`` says."""
    script = textwrap.dedent(f"""
        import os, sys
        import lmforge.runtime.optim as tr, lmforge.runtime.checkpoint as ck
        from lmforge.core.config import load_config
        from lmforge.recipes.sft import SFTConfig, run_sft
        {patch}
        run_sft(load_config(SFTConfig, None, {ARGS!r} + ["train.output_dir={out_dir}"]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 17, proc.stderr[-2000:]


def resume(out_dir):
    run_sft(load_config(SFTConfig, None, ARGS + [f"train.output_dir={out_dir}", "train.resume=auto"]))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    run_sft(load_config(SFTConfig, None, ARGS + [f"train.output_dir={out}"]))
    return losses(out)


@pytest.mark.e2e  # a fresh interpreter that dies mid-run, then a resume: ~4 s
def test_kill_between_steps_then_resume_is_bit_exact(tmp_path, reference):
    out = tmp_path / "run"
    # die right after the 5th optimizer step: checkpoints exist for steps 2 and 4
    crash_run(
        out,
        textwrap.dedent("""
        real = tr.optimizer_step
        calls = []
        def dying_step(*a, **k):
            calls.append(1)
            result = real(*a, **k)
            if len(calls) == 5:
                os._exit(17)
            return result
        tr.optimizer_step = dying_step  # Updater.step looks it up in lmforge.runtime.optim
    """).replace("\n", "\n        "),
    )
    assert [p.name for p in list_checkpoints(out)] == ["step-000002", "step-000004"]
    resume(out)
    got = losses(out)
    assert sorted(got) == list(range(1, 9))
    for step in range(5, 9):
        assert got[step] == reference[step], f"step {step}: {got[step]!r} != {reference[step]!r}"


@pytest.mark.e2e  # a fresh interpreter that dies mid-run, then a resume: ~4 s
def test_kill_during_save_keeps_last_good_checkpoint(tmp_path, reference):
    out = tmp_path / "run"
    # die half-way through writing the step-4 checkpoint (model written, trainer state not)
    crash_run(
        out,
        textwrap.dedent("""
        real = ck.save_model
        def dying_save(model, tok, path, **kwargs):
            real(model, tok, path, **kwargs)
            if "step-000004" in str(path):
                os._exit(17)
        ck.save_model = dying_save
    """).replace("\n", "\n        "),
    )
    assert [p.name for p in list_checkpoints(out)] == ["step-000002"]
    assert any(p.name.startswith(".step-000004.tmp") for p in (out / "checkpoints").iterdir())
    resume(out)
    got = losses(out)
    for step in range(3, 9):
        assert got[step] == reference[step], f"step {step}: {got[step]!r} != {reference[step]!r}"
    assert (out / "final" / "config.json").is_file() and (out / "best" / "config.json").is_file()


def test_fresh_run_refuses_to_overwrite_checkpoints(tmp_path, reference):
    out = tmp_path / "run"
    run_sft(load_config(SFTConfig, None, ARGS + [f"train.output_dir={out}", "train.max_steps=2"]))
    with pytest.raises(ConfigError, match="train.resume=auto"):
        run_sft(load_config(SFTConfig, None, ARGS + [f"train.output_dir={out}", "train.max_steps=2"]))


def test_nan_loss_stops_before_the_update_and_keeps_the_checkpoints(tmp_path, reference, monkeypatch):
    # the loss of step 5's second micro-batch turns NaN: the run stops with a TrainingError naming
    # the step, before that step's optimizer update, and the step-2/4 checkpoints resume bit for bit
    import lmforge.supervised.step as supervised
    from lmforge.core.errors import TrainingError

    real, calls = supervised.micro_loss, []

    def poisoned(*args, **kwargs):
        calls.extend([1] if torch.is_grad_enabled() else [])  # training calls (validation runs no_grad)
        loss, metrics = real(*args, **kwargs)
        return (loss * float("nan") if len(calls) == 10 else loss), metrics  # 2 micro-batches per step

    monkeypatch.setattr(supervised, "micro_loss", poisoned)
    out = tmp_path / "run"
    with pytest.raises(TrainingError, match="non-finite loss .* step 5"):
        run_sft(load_config(SFTConfig, None, ARGS + [f"train.output_dir={out}"]))
    assert [c.name for c in list_checkpoints(out)] == ["step-000002", "step-000004"]
    assert sorted(losses(out)) == [1, 2, 3, 4]  # step 5 was never logged
    monkeypatch.setattr(supervised, "micro_loss", real)
    resume(out)
    assert losses(out) == reference
