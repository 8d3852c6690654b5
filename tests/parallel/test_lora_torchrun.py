"""LoRA under torchrun (gloo, 2 ranks, tiny model): DDP wraps the LoRA policy (only the adapters
are DDP parameters) and GRPO with a KL reference trains and saves an adapter; FSDP2 with LoRA is
refused with a ConfigError that says what to use instead."""

import pytest
import torch
from test_torchrun import GRPO, torchrun, train_records

peft = pytest.importorskip("peft")


@pytest.mark.e2e
def test_grpo_with_lora_under_ddp_and_fsdp2_refused(tmp_path):
    out = tmp_path / "run"
    (tmp_path / "parity.py").write_text(
        "def score(completion, problem, **kw):\n    return float(sum(map(ord, completion)) % 2)\n"
    )  # variance: a signal
    proc = torchrun(
        "-m",
        "lmforge",
        "grpo",
        *GRPO,
        "model.lora.r=4",
        "algo.preset=grpo",
        "optim.lr=5e-2",
        "rewards.functions=[parity:score]",
        f"train.output_dir={out}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[lora] training" in proc.stdout and "[parallel] 2 ranks, ddp" in proc.stdout
    records = train_records(out)
    assert sorted(records) == [1, 2] and all(torch.isfinite(torch.tensor(v)).all() for v in records.values())
    assert (out / "final" / "adapter_model.safetensors").is_file()
    from safetensors.torch import load_file

    adapters = load_file(str(out / "final" / "adapter_model.safetensors"))
    assert any(float(v.abs().max()) > 0 for k, v in adapters.items() if "lora_B" in k)  # they trained
    proc = torchrun(
        "-m",
        "lmforge",
        "grpo",
        *GRPO,
        "model.lora.r=4",
        "parallel.strategy=fsdp2",
        f"train.output_dir={tmp_path / 'fsdp2'}",
    )
    assert proc.returncode != 0 and "parallel.strategy=ddp" in proc.stderr, proc.stderr[-3000:]
