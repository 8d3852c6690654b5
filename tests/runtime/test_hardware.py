"""Hardware choices: every choice has a reason, explicit settings win, bf16 on CPU only where native."""

from __future__ import annotations

import torch

from lmforge.runtime.hardware import Hardware, choose


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
    assert (
        gpu(True, 80).tier == "large-gpu" and gpu(False, 16).tier == "small-gpu" and gpu(True, 24).tier == "large-gpu"
    )
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


def test_threads_follow_the_cores_the_load_leaves_and_busy_is_passive():
    from lmforge.runtime.hardware import choose_threads

    quiet, busy, crowded = choose_threads(2, 0.7), choose_threads(2, 1.0), choose_threads(2, 6.0)
    assert (quiet.threads, quiet.passive) == (2, False) and "load average 0.7 on 2 cores: quiet" in quiet.reason
    assert (busy.threads, busy.passive) == (1, True) and (crowded.threads, crowded.passive) == (1, True)
    assert "busy" in crowded.reason and "OpenMP's default wait policy" in crowded.reason  # torch started without it
    assert "sleep while they wait" in choose_threads(2, 6.0, wait="OMP_WAIT_POLICY=PASSIVE").reason
    assert "OMP_WAIT_POLICY=ACTIVE from the environment" in choose_threads(2, 6.0, wait="OMP_WAIT_POLICY=ACTIVE").reason
    assert choose_threads(16, 4.5).threads == 12 and not choose_threads(16, 4.5).passive  # floor: 4 cores taken
    assert (choose_threads(16, 10.0).threads, choose_threads(16, 10.0).passive) == (6, True)
    # torchrun: each of the ranks on the machine takes its share of the free cores, at least one
    assert (
        choose_threads(4, 0.2, local_ranks=2).threads == 2
        and "shared by the 2 ranks" in choose_threads(4, 0.2, 2).reason
    )
    assert choose_threads(4, 3.0, local_ranks=2).threads == 1
    # train.threads wins; the wait policy still follows the load
    set_busy = choose_threads(2, 6.0, threads=2)
    assert (set_busy.threads, set_busy.passive) == (2, True) and set_busy.reason.startswith("set in config")
    assert choose(cpu(bf16=False), threads=3).threads == 3


def test_choose_takes_the_load_from_the_hardware():
    loaded = Hardware("cpu", "none", 2, 24.0, 0.0, False, load=3.0)
    assert choose(loaded).threads == 1 and "busy" in choose(loaded).reasons["threads"]
    assert choose(cpu(bf16=False)).threads == 2


def test_prepare_process_sets_passive_only_when_busy_and_unset(monkeypatch):
    from lmforge.runtime import hardware

    monkeypatch.setattr(hardware, "_num_cores", lambda: 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for load, user, expected in (
        (6.0, {}, "PASSIVE"),
        (0.2, {}, None),
        (6.0, {"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),
        (6.0, {"GOMP_SPINCOUNT": "1000"}, None),
    ):
        monkeypatch.setattr(hardware, "start_load", lambda load=load: load)
        environ = dict(user)
        choice = hardware.prepare_process(environ)
        assert environ.get("OMP_WAIT_POLICY") == expected, (load, user)
        assert choice.threads == (1 if load > 1 else 2)
