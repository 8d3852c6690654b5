"""Shared pieces of the quantized formats: the error type, loading a source model, a format record."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..core.errors import LmforgeError


class QuantizeError(LmforgeError, ValueError):
    """A model, file or option given to quantize / dequantize is unusable (the message says why)."""


@dataclass(frozen=True)
class Format:
    """One output format of ``lmforge quantize``.

    ``write(model, tokenizer, out_dir) -> list[Path]`` writes the files; ``bits`` is the nominal
    number of bits per weight of the quantized matrices (scales included).
    """

    name: str
    family: str
    bits: float
    description: str
    write: Callable


def require(module: str, extra: str, purpose: str) -> None:
    """Raise an install hint when an optional dependency is missing."""
    if importlib.util.find_spec(module) is None:
        raise QuantizeError(
            f"{purpose} needs the Python package '{module}'. Install it with: pip install 'lmforge[{extra}]'"
        )


def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise QuantizeError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise QuantizeError(f"{path}: not valid JSON ({exc})") from exc


def load_source(spec: str):
    """``(model, tokenizer or None)`` in fp32 from an HF directory, a run's ``final/``, a .gguf or an alias.

    A model that is already quantized (its config.json has a ``quantization_config``) is refused:
    quantizing twice compounds the errors; dequantize it first. A checkpoint of a QAT run (its
    config.json has ``lmforge_qat``) holds master weights: they are fake-quantized ("baked") here, so
    the export computes what the training forward computed.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..model.load import _from_hub, require_model_files, resolve_pretrained

    source = Path(resolve_pretrained(spec))
    if not source.is_dir():
        raise QuantizeError(
            f"model {spec!r} is not a local directory; quantize a local HF directory, "
            f"a run's final/ directory, a .gguf file or smollm2-135m-instruct"
        )
    config = read_config(source)
    if "quantization_config" in config:
        method = config["quantization_config"].get("quant_method", "?")
        raise QuantizeError(
            f"{source} is already quantized (quantization_config.quant_method = {method!r}); "
            f"run `lmforge dequantize {source} --out DIR` and quantize DIR instead"
        )
    require_model_files(source, tokenizer=False)  # the formats that need a tokenizer say so themselves
    model = _from_hub(AutoModelForCausalLM, str(source), dtype=torch.float32).eval()
    scheme = getattr(model.config, "lmforge_qat", None)
    if scheme:
        from .qat import apply_qat, bake_qat

        apply_qat(model, scheme)
        bake_qat(model)
        print(f"[lmforge] {source}: trained with {scheme} QAT; exporting its fake-quantized weights")
    has_tokenizer = any((source / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = _from_hub(AutoTokenizer, str(source)) if has_tokenizer else None
    return model, tokenizer


def save_plain(state: dict, config, tokenizer, out_dir: Path) -> Path:
    """Save fp32 weights ``state`` as a plain HF directory built from ``config`` (minus any quantization)."""
    from transformers import AutoModelForCausalLM

    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise QuantizeError(
            f"dequantized weights do not fit the architecture: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    model.tie_weights()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def tokenizer_of(model_dir: Path):
    """The HF tokenizer saved in ``model_dir``, or None if there is none."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir) if (model_dir / "tokenizer_config.json").is_file() else None
