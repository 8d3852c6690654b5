"""What fits in memory: bytes per parameter for inference per format and for training per mode.

Formula: memory ~= num_params * bytes_per_param (+ activations and the KV cache, not counted here;
they depend on batch and sequence length). For ``lmforge hardware`` to print next to the detected
memory (the lead wires it in); ``memory_plan`` is a pure function.

Training, per parameter (AdamW keeps two fp32 moments, m and v: 8 bytes):
  fp32 AdamW              4 weight + 4 grad + 8 moments                          = 16
  bf16 + fp32 master      2 bf16 weight + 2 bf16 grad + 4 master + 8 moments     = 16
                          (the ZeRO paper's count; the saving is in activations, not states)
  LoRA (bf16 base)        2 frozen bf16 weight; the adapters' states are ~1% of that  ~ 2
  QAT (fp32 master)       fp32 AdamW + 4 for the fake-quantized copy each Linear keeps for backward = 20
"""
from __future__ import annotations

TRAINING_BYTES_PER_PARAM = {"fp32 AdamW": 16.0, "bf16 + fp32 master AdamW": 16.0, "LoRA on a bf16 base": 2.0,
                            "QAT (fp32 master AdamW)": 20.0}


def inference_bytes_per_param() -> dict[str, float]:
    """fp32, bf16 and every registered format (its nominal bits per weight / 8)."""
    from . import FORMATS

    return {"fp32": 4.0, "bf16": 2.0, **{name: f.bits / 8 for name, f in FORMATS.items()}}


def memory_plan(num_params: int, available_bytes: int) -> list[tuple[str, str, float, bool]]:
    """Rows ``(use, format or mode, GiB needed, fits)`` for a model of ``num_params`` parameters."""
    rows = []
    for use, table in (("inference", inference_bytes_per_param()), ("training", TRAINING_BYTES_PER_PARAM)):
        for name, per_param in table.items():
            need = num_params * per_param
            rows.append((use, name, need / 2**30, need <= available_bytes))
    return rows
