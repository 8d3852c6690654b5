"""What fits in memory: bytes per parameter for inference per format and for training per mode.

Formula: memory ~= num_params * bytes_per_param (+ activations and the KV cache, not counted here;
they depend on batch and sequence length). ``lmforge hardware`` prints :func:`tier_report` for the
detected memory (the accelerator's on a GPU, RAM on a CPU); ``memory_plan`` is a pure function.

Inference: a format's nominal bits per weight / 8 (its scales included: int4-g32 = 4 + 32/32 = 5
bits, Q4_0 = 18 bytes per 32 weights = 4.5 bits).

Training, per parameter (AdamW keeps two fp32 moments, m and v: 8 bytes):
  fp32 AdamW              4 weight + 4 grad + 8 moments                          = 16
  bf16 + fp32 master      2 bf16 weight + 2 bf16 grad + 4 master + 8 moments     = 16
                          (the ZeRO paper's count; the saving is in activations, not states)
  LoRA (bf16 base)        2 frozen bf16 weight + adapters of ~1% of the parameters trained with
                          fp32 AdamW (16 bytes each): 2 + 0.01 * 16                = 2.16
  QAT (fp32 master)       fp32 AdamW + 4 for the fake-quantized copy each Linear keeps for backward = 20
"""

from __future__ import annotations

TRAINING_BYTES_PER_PARAM = {
    "fp32 AdamW": 16.0,
    "bf16 + fp32 master AdamW": 16.0,
    "LoRA on a bf16 base": 2.16,
    "QAT (fp32 master AdamW)": 20.0,
}


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


# Reference model sizes (parameters) for the inference table: SmolLM2's and common open-weight sizes.
MODEL_SIZES = {
    "135M": 135e6,
    "360M": 360e6,
    "1.7B": 1.7e9,
    "8B": 8e9,
    "14B": 14e9,
    "32B": 32e9,
    "70B": 70e9,
    "405B": 405e9,
}
# The formats shown by ``lmforge hardware`` (every registered one is in ``memory_plan``).
SHOWN_FORMATS = ("fp32", "bf16", "int8", "int4-g32", "gguf-q8_0", "gguf-q4_0", "gguf-tq2_0", "ternary")


def human_params(n: float) -> str:
    """135e6 -> '135M', 1.07e9 -> '1.07B'."""
    if n >= 1e9:
        return f"{n / 1e9:.3g}B"
    return f"{n / 1e6:.3g}M"


def largest_model(available_bytes: float, bytes_per_param: float) -> float:
    """Parameters that fit: available / bytes per parameter (nothing left for activations)."""
    return available_bytes / bytes_per_param


def tier_report(available_bytes: float, where: str) -> list[str]:
    """The lines ``lmforge hardware`` prints: GiB of weights per format for the reference model sizes
    whose smallest format fits (and the next size up), then bytes per parameter and the largest model
    per training mode. A cell that does not fit ``available_bytes`` reads ``-``."""
    per_param = inference_bytes_per_param()
    shown = [f for f in SHOWN_FORMATS if f in per_param]
    smallest = min(per_param[f] for f in shown)
    sizes, lines = [], []
    for label, n in MODEL_SIZES.items():
        sizes.append((label, n))
        if n * smallest > available_bytes:
            break
    gib = available_bytes / 2**30
    lines.append(
        f"memory for models: {gib:.1f} GiB ({where}); bytes = parameters x bytes per parameter, "
        "before activations and the KV cache"
    )
    lines.append("inference: GiB of weights per format ('-' = does not fit)")
    width = max(len(f) for f in shown) + 1
    lines.append("  " + f"{'model':<7}" + "".join(f"{f:>{width}}" for f in shown))
    for label, n in sizes:
        cells = "".join(
            f"{(f'{n * per_param[f] / 2**30:.2f}' if n * per_param[f] <= available_bytes else '-'):>{width}}"
            for f in shown
        )
        lines.append(f"  {label:<7}{cells}")
    lines.append(
        "  largest: "
        + ", ".join(
            f"{f} {human_params(largest_model(available_bytes, per_param[f]))}"
            for f in ("bf16", "int8", "gguf-q4_0", "ternary")
            if f in per_param
        )
    )
    lines.append("training (AdamW): bytes per parameter and the largest model that fits")
    for mode, bpp in TRAINING_BYTES_PER_PARAM.items():
        lines.append(f"  {mode:<26}{bpp:>6g} B/param  {human_params(largest_model(available_bytes, bpp)):>8}")
    return lines
