"""Shared by the recipe tests: a run's metric records by step, the check that resuming from a
checkpoint logs the later steps bit for bit as the uninterrupted run did, and the tiny SFT run of the
reliability and failure tests."""

from __future__ import annotations

import json
from pathlib import Path

from lmforge.core.config import load_config
from lmforge.recipes.sft import SFTConfig, run_sft
from lmforge.runtime.metrics import read_metrics


def records(run_dir: Path, kind: str = "train") -> dict[int, dict]:
    """``run_dir/metrics.jsonl``'s records of ``kind``, by step."""
    return {r["step"]: r for r in read_metrics(run_dir) if r["kind"] == kind}


def assert_resume_is_bit_exact(
    run, config_cls, args: list[str], out: Path, resumed: Path, from_step: int, keys: tuple[str, ...]
) -> None:
    """Runs ``run(config)`` with ``args`` into ``resumed``, resuming from ``out``'s checkpoint of
    ``from_step``; every later step of ``out`` must be logged again with the same ``keys``, bit for bit."""
    run(
        load_config(
            config_cls,
            None,
            args + [f"train.output_dir={resumed}", f"train.resume={out / 'checkpoints' / f'step-{from_step:06d}'}"],
        )
    )
    want, got = records(out), records(resumed)
    later = sorted(step for step in want if step > from_step)
    assert later and sorted(got) == later, (sorted(got), later)
    for step in later:
        for key in keys:
            assert got[step][key] == want[step][key], f"step {step} {key}: {got[step][key]!r} != {want[step][key]!r}"


# ----------------------------------------------------------------------------- the tiny SFT run

TINY = [
    "model.tokenizer=char",
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.max_position_embeddings=32",
]
SFT = TINY + [
    "data.task=addition",
    "data.num_train=64",
    "data.num_val=8",
    "data.num_eval=4",
    "data.max_len=16",
    "train.batch_size=8",
    "train.micro_batch_size=8",
    "train.max_new_tokens=4",
    "train.threads=1",
    "train.eval_every=0",
    "logging.progress=false",
]


def sft(out, *extra):
    return run_sft(load_config(SFTConfig, None, SFT + [f"train.output_dir={out}", *extra]))


def train_records(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]
