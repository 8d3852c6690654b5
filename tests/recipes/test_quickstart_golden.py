"""The quickstart's curves, bit for bit: a change that does not alter the computation (a refactor, a
new layer of the runtime, a moved function) must reproduce them exactly.

The reference (``golden/quickstart_small.json``) was written by ``golden/make_quickstart_golden.py``
on the machine it names. Its SFT stage trains: the losses and gradient norms of all 20 steps are
compared. Its GRPO stage is too short for the reward to leave zero on this tiny model, so it checks
the sampler (rewards, completion lengths, the eval accuracy) and that no row is trained: every
advantage is 0, so ``algo.skip_zero_advantage`` runs no forward (the trainer-vs-sampler logprob
agreement is checked by tests/recipes/test_grpo.py).

Exactness needs the same kernels: on the machine that wrote the file (same torch, same CPU flags that
select the kernels) every float must be equal. Elsewhere the matmul kernels sum in another order
(AVX2 vs AVX-512 vs AMX), so the floats are compared to a relative 1e-4: fp32 rounding differences
grown over 20 Adam steps stay near 1e-6, while any real change of the computation (a loss term, a
normalisation, the data order, a learning-rate step) moves these curves by 1e-3 or more.
"""

import json
import math
import platform
from pathlib import Path

import torch

from lmforge.cli import main

GOLDEN = Path(__file__).parent / "golden" / "quickstart_small.json"
ARGS = ["sft_steps=20", "grpo_steps=3", "num_eval=10", "hidden_size=32", "num_layers=1", "progress=false"]
SFT_KEYS = ("loss", "grad_norm", "lr", "loss_tokens")
GRPO_KEYS = ("reward", "completion_len_mean", "truncated_frac", "frac_rows_trained", "loss")
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def machine() -> dict:
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {
        "torch": torch.__version__,
        "arch": platform.machine(),
        "flags": sorted(flag for flag in KERNEL_FLAGS if flag in flags),
    }


def curves(out: Path) -> dict:
    def rows(stage, keys):
        found = []
        for line in (out / stage / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            if row["kind"] == "train":
                found.append({"step": row["step"], **{key: row[key] for key in keys}})
            elif row["kind"] == "eval" and "accuracy" in row:
                found.append({"step": row["step"], "accuracy": row["accuracy"]})
        return found

    return {"sft": rows("sft", SFT_KEYS), "grpo": rows("grpo", GRPO_KEYS)}


def test_quickstart_curves_are_reproduced_bit_for_bit(tmp_path, capsys):
    golden = json.loads(GOLDEN.read_text())
    assert golden["args"] == ARGS
    out = tmp_path / "qs"
    assert main(["quickstart", f"output_dir={out}", *ARGS]) == 0
    got = curves(out)
    exact = golden["machine"] == machine()
    for stage in ("sft", "grpo"):
        assert len(got[stage]) == len(golden[stage]), stage
        for want_row, got_row in zip(golden[stage], got[stage]):
            assert want_row.keys() == got_row.keys(), (stage, want_row["step"])
            for key, want in want_row.items():
                have = got_row[key]
                where = f"{stage} step {want_row['step']} {key}: golden {want!r}, got {have!r}"
                if exact or isinstance(want, int):
                    assert have == want, where + f" (machine {machine()} wrote the golden: exact)"
                elif key.startswith("rollout_diff"):  # rounding noise itself (~1e-8): only its size
                    assert abs(have - want) < 1e-6, where
                else:
                    assert math.isclose(have, want, rel_tol=1e-4, abs_tol=1e-9), where
    # the SFT stage must actually train, or the check above would only cover a constant
    sft_losses = [row["loss"] for row in got["sft"] if "loss" in row]
    assert sum(sft_losses[-5:]) / 5 < sum(sft_losses[:5]) / 5 - 0.02
    # and the command's promises: both stages report and save
    printed = capsys.readouterr().out
    assert "before 0.0% -> after SFT" in printed and "-> after GRPO" in printed
    for stage in ("sft", "grpo"):
        assert (out / stage / "final" / "model.safetensors").is_file()
        assert (out / stage / "curves.png").is_file() and (out / stage / "metrics.jsonl").is_file()
