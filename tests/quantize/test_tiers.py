"""`lmforge hardware`'s tier table: the rows, and the arithmetic on a known memory size."""

import re

from lmforge.quantize.tiers import TRAINING_BYTES_PER_PARAM, largest_model, tier_report

GIB16 = 16 * 2**30


def row(lines, label):
    (line,) = [line for line in lines if line.split()[:1] == [label]]
    return line.split()[1:]


def test_tier_report_rows_and_math_for_16_gib():
    lines = tier_report(GIB16, "RAM")
    assert lines[0].startswith("memory for models: 16.0 GiB (RAM)")
    header = lines[2].split()
    assert header[:5] == ["model", "fp32", "bf16", "int8", "int4-g32"]
    col = {name: i for i, name in enumerate(header[1:])}
    # 8B parameters: fp32 32e9 bytes = 29.8 GiB does not fit; bf16 16e9 bytes = 14.90 GiB fits;
    # Q4_0 4.5 bits = 4.5e9 bytes = 4.19 GiB; ternary 2 bits = 2e9 bytes = 1.86 GiB
    eight = row(lines, "8B")
    assert eight[col["fp32"]] == "-" and eight[col["bf16"]] == "14.90"
    assert eight[col["gguf-q4_0"]] == "4.19" and eight[col["ternary"]] == "1.86"
    assert row(lines, "135M")[col["int4-g32"]] == f"{135e6 * 5 / 8 / 2**30:.2f}" == "0.08"
    # the table stops at the first size whose smallest format (ternary, 2 bits) no longer fits:
    # 70B x 0.25 B = 16.3 GiB > 16 GiB, so 70B is the last row and nothing fits in it
    sizes = [line.split()[0] for line in lines[3:] if line.startswith("  ") and line.split()[0][-1] in "MB"]
    assert sizes == ["135M", "360M", "1.7B", "8B", "14B", "32B", "70B"]
    assert set(row(lines, "70B")) == {"-"}
    # training: 16 GiB / 16 B = 2^30 = 1.07B parameters; QAT 2^34 / 20 = 859M; LoRA 2^34 / 2.16 = 7.95B
    training = {m: line for line in lines for m in TRAINING_BYTES_PER_PARAM if line.strip().startswith(m)}
    assert training["fp32 AdamW"].split()[-1] == "1.07B"
    assert training["bf16 + fp32 master AdamW"].split()[-1] == "1.07B"
    assert training["QAT (fp32 master AdamW)"].split()[-1] == "859M"
    assert training["LoRA on a bf16 base"].split()[-1] == "7.95B"
    assert largest_model(GIB16, 16) == 2**30


def test_lmforge_hardware_prints_the_tiers_for_the_detected_memory(monkeypatch, capsys):
    import torch

    from lmforge import cli
    from lmforge.runtime import hardware

    fake = hardware.Hardware("cuda:0", "Test GPU", 8, 64.0, 16.0, True)
    monkeypatch.setattr(hardware, "detect", lambda device="auto": fake)
    monkeypatch.setattr(hardware, "matmul_peak_gflops", lambda *a, **k: 1.0)
    monkeypatch.setattr(
        hardware, "choose", lambda hw, **k: hardware.Choices(torch.device("cpu"), torch.float32, 1, 1, False, {})
    )
    assert cli.main(["hardware"]) == 0
    out = capsys.readouterr().out
    assert "memory for models: 16.0 GiB (Test GPU memory)" in out  # the accelerator's memory, not the 64 GiB RAM
    assert re.search(r"fp32 AdamW\s+16 B/param\s+1.07B", out)
    assert re.search(r"QAT \(fp32 master AdamW\)\s+20 B/param\s+859M", out)
