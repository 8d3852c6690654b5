"""Hardware choices: every choice has a reason, explicit settings win, bf16 on CPU only where native."""
from __future__ import annotations

import torch

from lmforge.hardware import Hardware, choose


def cpu(bf16: bool, cores: int = 2, ram_gb: float = 24.0) -> Hardware:
    return Hardware("cpu", "none", cores, ram_gb, 0.0, bf16)


def test_cpu_defaults_to_fp32_and_points_at_native_bf16():
    plain, native = choose(cpu(bf16=False)), choose(cpu(bf16=True))
    assert plain.dtype == native.dtype == torch.float32
    assert "try train.dtype=bf16" in native.reasons["dtype"]
    assert "try train.dtype=bf16" not in plain.reasons["dtype"]
    assert set(plain.reasons) == {"dtype", "threads", "micro_batch_size", "gradient_checkpointing"}


def test_explicit_bf16_on_cpu_warns_only_without_native_units():
    assert "far slower" in choose(cpu(bf16=False), dtype="bf16").reasons["dtype"]
    native = choose(cpu(bf16=True), dtype="bf16")
    assert native.dtype == torch.bfloat16 and native.reasons["dtype"] == "set in config"
    assert "far slower" in choose(cpu(bf16=True), dtype="fp16").reasons["dtype"]


def test_explicit_settings_win_and_the_batch_shrinks_to_the_memory_budget():
    chosen = choose(cpu(bf16=False), threads=1, micro_batch_size=3, gradient_checkpointing="on")
    assert (chosen.threads, chosen.micro_batch_size, chosen.gradient_checkpointing) == (1, 3, True)
    big = dict(num_params=1_000_000_000, seq_len=2048, hidden=2048, layers=24)
    roomy, tight = choose(cpu(bf16=False, ram_gb=512), **big), choose(cpu(bf16=False, ram_gb=16), **big)
    assert roomy.micro_batch_size == 8 and tight.micro_batch_size < roomy.micro_batch_size
