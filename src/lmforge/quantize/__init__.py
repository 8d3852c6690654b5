"""Quantized checkpoints: ``quantize(model, format, out_dir)`` and ``dequantize(dir, out_dir)``.

Formats are a registry (:data:`FORMATS`), one module per family:
  ct_formats        int8, int4-g32/64/128, fp8   safetensors in the compressed-tensors format
  gguf_format       gguf-f16, -bf16, -q8_0, -q4_0, -tq1_0, -tq2_0   for llama.cpp / Ollama
  ternary_format    ternary, ternary-5trit        lmforge's packed BitNet b1.58 absmean checkpoint
Quantization-aware training lives in :mod:`.qat` (``apply_qat``, ``apply_ternary_qat``, ``bake_qat``).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from . import ct_formats, gguf_format, ternary_format
from .common import Format, QuantizeError, load_source, read_config, save_plain, tokenizer_of
from .qat import apply_qat, apply_ternary_qat, bake_qat

FORMATS: dict[str, Format] = {f.name: f for mod in (ct_formats, gguf_format, ternary_format) for f in mod.formats()}

__all__ = [
    "FORMATS",
    "Format",
    "QuantizeError",
    "QuantizeResult",
    "apply_qat",
    "apply_ternary_qat",
    "bake_qat",
    "canonical_format",
    "dequantize",
    "quantize",
    "quantize_model",
    "save_quantized_copies",
]


@dataclass(frozen=True)
class QuantizeResult:
    files: list[Path]
    num_bytes: int
    seconds: float


def _fresh_dir(out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise QuantizeError(f"output directory {out_dir} is a file; choose a new directory")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise QuantizeError(f"output directory {out_dir} exists and is not empty; choose a new one")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _finish(tmp: Path, out_dir: Path) -> None:
    if out_dir.exists():
        out_dir.rmdir()
    tmp.rename(out_dir)  # atomic: a failed export leaves no half-written directory


def canonical_format(name: str) -> str:
    """The registry name of ``name``: itself, or ``gguf-<name>`` for llama.cpp's type names (q4_0, Q8_0, tq2_0)."""
    if name in FORMATS:
        return name
    if f"gguf-{name.lower()}" in FORMATS:
        return f"gguf-{name.lower()}"
    raise QuantizeError(
        f"unknown format {name!r}; valid formats: {', '.join(FORMATS)} "
        "(the GGUF ones also as q8_0, q4_0, f16, bf16, tq1_0, tq2_0)"
    )


def get_format(name: str) -> Format:
    return FORMATS[canonical_format(name)]


def quantize_model(model, tokenizer, fmt: str, out_dir: str | Path) -> QuantizeResult:
    """Write ``model`` (fp32, modified in place by some formats) in format ``fmt`` to ``out_dir``."""
    spec = get_format(fmt)
    out_dir = Path(out_dir)
    tmp = _fresh_dir(out_dir)
    start = time.perf_counter()
    try:
        files = spec.write(model, tokenizer, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - start
    _finish(tmp, out_dir)
    files = [out_dir / f.name for f in files]
    return QuantizeResult(files, sum(f.stat().st_size for f in files), seconds)


def quantize(model_spec: str, fmt: str, out_dir: str | Path) -> QuantizeResult:
    """``lmforge quantize``: load ``model_spec`` (HF dir, run's final/, .gguf, alias) and write ``fmt``."""
    get_format(fmt)  # an unknown format fails before the model loads
    model, tokenizer = load_source(model_spec)
    return quantize_model(model, tokenizer, fmt, out_dir)


def save_quantized_copies(model, tokenizer, checkpoint_dir: str | Path, formats: list[str]) -> list[QuantizeResult]:
    """Write ``checkpoint_dir/quantized-<format>/`` for each format, from the in-memory model.

    For ``train.save_quantized`` next to the best and final checkpoints. The live model is not
    touched: each format quantizes an fp32 copy; a model under QAT is baked in the copy first, so the
    copies compute what the training forward computes. Unknown formats fail before anything is written.
    """
    import copy

    import torch

    formats = [canonical_format(fmt) for fmt in formats]
    unwrapped = getattr(model, "module", model)
    unwrapped = getattr(unwrapped, "_orig_mod", unwrapped)
    results = []
    for fmt in formats:
        clone = copy.deepcopy(unwrapped).to("cpu", torch.float32).eval()
        if getattr(clone.config, "lmforge_qat", None):
            bake_qat(clone)
        results.append(quantize_model(clone, tokenizer, fmt, Path(checkpoint_dir) / f"quantized-{fmt}"))
    return results


def _read_compressed(source: Path):
    model = ct_formats.load_compressed(source)
    return model.state_dict(), model.config, tokenizer_of(source)


def _read_gguf(source: Path):
    return gguf_format.read_gguf(gguf_format.find_gguf(source))


def _read_ternary(source: Path):
    from transformers import AutoConfig

    state, config = ternary_format.read_ternary(source)
    return state, AutoConfig.for_model(**config), tokenizer_of(source)


# quantization_config.quant_method (or "gguf") -> reader: (fp32 state dict, config, tokenizer or None)
READERS = {"compressed-tensors": _read_compressed, "gguf": _read_gguf, ternary_format.FORMAT_NAME: _read_ternary}


def _detect(source: Path) -> str:
    if source.suffix == ".gguf" or (source.is_dir() and list(source.glob("*.gguf"))):
        return "gguf"
    method = read_config(source).get("quantization_config", {}).get("quant_method")
    if method in READERS:
        return method
    raise QuantizeError(
        f"{source} is not a quantized checkpoint lmforge knows (quantization_config.quant_method = "
        f"{method!r}; expected one of {', '.join(m for m in READERS if m != 'gguf')} or a .gguf file)"
    )


def dequantize(source: str | Path, out_dir: str | Path) -> Path:
    """``lmforge dequantize``: any format above -> a plain fp32 HF directory at ``out_dir``."""
    source, out_dir = Path(source), Path(out_dir)
    if not source.exists():
        raise QuantizeError(f"{source}: no such file or directory")
    reader = READERS[_detect(source)]
    tmp = _fresh_dir(out_dir)
    try:
        save_plain(*reader(source), tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _finish(tmp, out_dir)
    return out_dir
