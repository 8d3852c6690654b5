"""Safetensors in the compressed-tensors format: int8 per channel, int4 group-wise, fp8 e4m3.

transformers (with the ``compressed-tensors`` package) and vLLM read these directories as they are:
the scheme is in ``config.json`` under ``quantization_config`` (``quant_method: compressed-tensors``).
Which Linear layers: every ``nn.Linear`` except ``lm_head`` (the embeddings are not Linear and stay
in the source dtype). The math, per weight matrix W (out, in), all symmetric (zero point 0):
    int8  per output channel   s_o = max_i |W_oi| / 127.5 ; q = clamp(round(W / s), -128, 127)
    int4  per group of G cols  s_og = max_{i in g} |W_oi| / 7.5 ; q = clamp(round(W / s), -8, 7)
    fp8   per output channel   s_o = max_i |W_oi| / 448 ; q = e4m3(W / s)
(``compressed_tensors.quantization.utils.calculate_qparams`` divides the absmax by half the integer
range, 255/2 and 15/2, so the extreme value rounds to 128 or 8 and is clamped.) int8 and int4 are
stored packed in int32 words ("pack-quantized"), fp8 as float8_e4m3fn ("float-quantized").
"""

from __future__ import annotations

from pathlib import Path

import torch

from .catalog import DESCRIPTIONS
from .common import Format, QuantizeError, require

SCHEMES = {  # format name -> compressed_tensors.QuantizationArgs fields
    "int8": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
    "int4-g32": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
    "int4-g64": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=64),
    "int4-g128": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128),
    "fp8": dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
}
_HINT = "quant"


def check_group_size(model, group_size: int) -> None:
    """Every quantized Linear's input width must be a multiple of the group size (no padding)."""
    bad = [
        f"{name} (in_features {module.in_features})"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head") and module.in_features % group_size
    ]
    if bad:
        raise QuantizeError(
            f"group size {group_size} does not divide the input width of {len(bad)} layer(s): "
            f"{', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}; {_group_hint(model)}"
        )


def _group_hint(model) -> str:
    """The int4 formats whose group size divides every quantized input width, or what to use instead."""
    widths = {
        module.in_features
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")
    }
    fitting = [
        name
        for name, scheme in SCHEMES.items()
        if scheme.get("group_size") and all(width % scheme["group_size"] == 0 for width in widths)
    ]
    if fitting:
        return f"use {' or '.join(fitting)}, whose group size divides them"
    return (
        f"no int4 group size lmforge offers divides the widths {sorted(widths)}: use int8 or fp8 "
        "(per channel), or a GGUF format"
    )


def _min_max(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (channel) or per-group extremes of a weight, shaped like the scale the format stores."""
    w = weight.detach().float()
    if args.strategy == "group":
        w = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
        return w.amin(dim=-1), w.amax(dim=-1)
    return w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)


def write_compressed(model, tokenizer, out_dir: Path, scheme: str) -> list[Path]:
    """Quantize ``model`` in place with ``scheme`` and save it in the compressed-tensors format."""
    require("compressed_tensors", _HINT, "the compressed-tensors formats")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(**SCHEMES[scheme])
    if args.strategy == "group":
        check_group_size(model, args.group_size)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]
    )
    # A baked int4-QAT model already sits on QAT's grid (max|W_g| / 7 per group of 32): keep that
    # scale, so the codes come back exactly (compressed-tensors' own max / 7.5 would round them again).
    qat_grid = scheme == "int4-g32" and getattr(model, "lmforge_baked_qat", None) == "int4"
    apply_quantization_config(model, config)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        scale, zero_point = calculate_qparams(*_min_max(module.weight, args), args)
        if qat_grid:
            low, high = _min_max(module.weight, args)
            scale = torch.maximum(low.abs(), high.abs()).clamp_min(1e-8) / 7
        module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point.to(module.weight_zero_point.dtype))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    compressor.update_config(str(out_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return sorted(out_dir.glob("*.safetensors"))


def load_compressed(model_dir: Path):
    """A compressed-tensors directory loaded by plain transformers, weights dequantized to fp32 at load."""
    require("compressed_tensors", _HINT, "loading a compressed-tensors checkpoint")
    import warnings

    from safetensors import SafetensorError, safe_open
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    for path in sorted(Path(model_dir).glob("*.safetensors")):  # a truncated file fails here, named
        try:
            with safe_open(str(path), "pt") as f:
                f.keys()
        except (SafetensorError, OSError) as exc:
            raise QuantizeError(f"{path}: cannot read (corrupt or truncated file?): {exc}") from exc
    with warnings.catch_warnings():  # "loading attributes will be overwritten": that is the point here
        warnings.filterwarnings("ignore", message="You passed `quantization_config`")
        try:
            return AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
            )
        except (SafetensorError, OSError) as exc:
            raise QuantizeError(f"{model_dir}: cannot load the compressed-tensors checkpoint: {exc}") from exc


def formats() -> list[Format]:
    # bits per weight with the fp32 scales: a group's scale adds 32 / G; a row's scale adds 32 / in_features
    bits = {"int8": 8.0, "fp8": 8.0, "int4-g32": 5.0, "int4-g64": 4.5, "int4-g128": 4.25}

    def make(name):
        return lambda model, tok, out: write_compressed(model, tok, out, name)

    return [Format(name, "compressed-tensors", bits[name], DESCRIPTIONS[name], make(name)) for name in SCHEMES]
