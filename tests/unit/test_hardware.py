"""Hardware choices: every choice has a reason, explicit settings win, bf16 on CPU only where native."""
from __future__ import annotations

import torch

from lmforge.hardware import Hardware, choose


def cpu(bf16: bool, cores: int = 2, ram_gb: float = 24.0) -> Hardware:
    return Hardware("cpu", "none", cores, ram_gb, 0.0, bf16)


def test_cpu_defaults_to_fp32_and_points_at_native_bf16():
    plain, native = choose(cpu(bf16=False)), choose(cpu(bf16=True))
    assert plain.dtype == native.dtype == torch.float32
    assert "train.dtype=bf16 is faster" in native.reasons["dtype"]
    assert "train.dtype=bf16 is faster" not in plain.reasons["dtype"]
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


def gpu(bf16: bool, mem_gb: float, name: str = "NVIDIA H200") -> Hardware:
    return Hardware("cuda:0", name, 16, 128.0, mem_gb, bf16)


def test_gpu_dtype_follows_bf16_support():
    bf16, fp16 = choose(gpu(bf16=True, mem_gb=80)), choose(gpu(bf16=False, mem_gb=16, name="Tesla T4"))
    assert (bf16.dtype, fp16.dtype) == (torch.bfloat16, torch.float16)
    assert "bf16 autocast" in bf16.reasons["dtype"] and "grad scaler" in fp16.reasons["dtype"]
    assert bf16.device == torch.device("cuda:0") and bf16.threads == 16
    assert choose(gpu(bf16=True, mem_gb=80), dtype="fp32").dtype == torch.float32  # explicit wins
    assert "far slower" not in choose(gpu(bf16=False, mem_gb=16), dtype="fp16").reasons["dtype"]  # CPU-only warning


def test_gpu_tiers_and_batch_from_accelerator_memory():
    assert gpu(True, 80).tier == "large-gpu" and gpu(False, 16).tier == "small-gpu" and gpu(True, 24).tier == "large-gpu"
    small = dict(num_params=10_000_000, seq_len=256, hidden=256, layers=4)
    # by hand: 10M params x 16 B = 0.15 GB of states; 34 x 256 x 4 layers x 4 B = 139 kB per token,
    # x 256 tokens x 64 rows = 2.3 GB: fits 70% of 16 GB, so the GPU cap 64 (CPU's is 8)
    assert choose(gpu(True, 16), **small).micro_batch_size == 64
    assert choose(cpu(bf16=False, ram_gb=512), **small).micro_batch_size == 8
    big = dict(num_params=1_000_000_000, seq_len=2048, hidden=2048, layers=24)
    # 1B params: 14.9 GB of states alone > 70% of 16 GB = 11.2 GB, so the batch shrinks to 1 and
    # checkpointing turns on; on 141 GB, states (14.9 GB) + 34 x 2048 x 24 x 4 B x 2048 x 8 rows
    # = 14.9 + 102 GB > 98.7 GB, but 4 rows (14.9 + 51) fit
    tight, roomy = choose(gpu(True, 16), **big), choose(gpu(True, 141), **big)
    assert (tight.micro_batch_size, tight.gradient_checkpointing) == (1, True)
    assert (roomy.micro_batch_size, roomy.gradient_checkpointing) == (4, False)
    assert "70% of 141 GB (large-gpu)" in roomy.reasons["micro_batch_size"]
