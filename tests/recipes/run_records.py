"""Shared by the recipe tests: a run's metric records by step, and the check that resuming from a
checkpoint logs the later steps bit for bit as the uninterrupted run did."""
from __future__ import annotations

from pathlib import Path

from lmforge.config import load_config
from lmforge.metrics import read_metrics


def records(run_dir: Path, kind: str = "train") -> dict[int, dict]:
    """``run_dir/metrics.jsonl``'s records of ``kind``, by step."""
    return {r["step"]: r for r in read_metrics(run_dir) if r["kind"] == kind}


def assert_resume_is_bit_exact(run, config_cls, args: list[str], out: Path, resumed: Path, from_step: int,
                               keys: tuple[str, ...]) -> None:
    """Runs ``run(config)`` with ``args`` into ``resumed``, resuming from ``out``'s checkpoint of
    ``from_step``; every later step of ``out`` must be logged again with the same ``keys``, bit for bit."""
    run(load_config(config_cls, None, args + [f"train.output_dir={resumed}",
                                              f"train.resume={out / 'checkpoints' / f'step-{from_step:06d}'}"]))
    want, got = records(out), records(resumed)
    later = sorted(step for step in want if step > from_step)
    assert later and sorted(got) == later, (sorted(got), later)
    for step in later:
        for key in keys:
            assert got[step][key] == want[step][key], f"step {step} {key}: {got[step][key]!r} != {want[step][key]!r}"
