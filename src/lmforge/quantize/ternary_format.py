"""lmforge's packed ternary checkpoint: BitNet b1.58 absmean weights, 2 bits or 1.6 bits per weight.

A directory with ``config.json`` (its ``quantization_config`` names ``quant_method: lmforge-ternary``),
the tokenizer files, and ``ternary.safetensors`` (not ``model.safetensors``: transformers would
ignore the unknown quant_method and fill the missing matrices with random weights; without a
``model.safetensors`` it refuses the directory instead) holding:
  * for every ``nn.Linear`` in the decoder layers: ``<name>.weight_packed`` (uint8, see
    :mod:`.ternary` for the packing) and ``<name>.weight_scale`` (fp32, shape (1,));
  * every other tensor (embeddings, norms, an untied lm_head) unchanged;
  * a header in the safetensors metadata: ``format``, ``version``, ``packing`` and, per packed
    tensor, its true shape (``shape.<name>``).
Only lmforge reads this directory (``lmforge dequantize``); for llama.cpp use ``gguf-tq2_0`` or
``gguf-tq1_0``, which hold the same ternary values.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .catalog import DESCRIPTIONS
from .common import Format, QuantizeError, read_config
from .qat import decoder_layers
from .ternary import PACKINGS, absmean_ternary, stored_scale

FORMAT_NAME, VERSION, WEIGHTS = "lmforge-ternary", "1", "ternary.safetensors"


def _linear_weight_names(model) -> list[str]:
    layers = decoder_layers(model)
    return [
        f"model.layers.{i}.{name}.weight"
        for i, layer in enumerate(layers)
        for name, module in layer.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]


def write_ternary(model, tokenizer, out_dir: Path, packing: str) -> list[Path]:
    """Absmean-ternarize the decoder Linear weights of ``model`` and write the packed directory."""
    from safetensors.torch import save_file

    pack = PACKINGS[packing][0]
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    metadata = {"format": FORMAT_NAME, "version": VERSION, "packing": packing}
    for name in _linear_weight_names(model):
        weight = state.pop(name)
        q, _ = absmean_ternary(weight)
        scale = stored_scale(weight, q)
        stem = name[: -len(".weight")]
        state[f"{stem}.weight_packed"] = pack(q)
        state[f"{stem}.weight_scale"] = scale.reshape(1)
        metadata[f"shape.{stem}"] = json.dumps(list(weight.shape))
    path = out_dir / WEIGHTS
    save_file(state, str(path), metadata=metadata)
    config = model.config.to_dict()
    config["quantization_config"] = {
        "quant_method": FORMAT_NAME,
        "packing": packing,
        "version": VERSION,
        "note": "lmforge's own format: run `lmforge dequantize DIR --out HF_DIR`",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return [path]


def read_ternary(model_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """``(fp32 state dict, config dict without quantization_config)`` of a packed ternary directory."""
    from safetensors import SafetensorError, safe_open

    config = read_config(model_dir)
    path = model_dir / WEIGHTS
    if not path.is_file():
        raise QuantizeError(f"{model_dir}: no {WEIGHTS}")
    try:
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise QuantizeError(f"{path}: cannot read (corrupt or truncated file?): {exc}") from exc
    if metadata.get("format") != FORMAT_NAME or metadata.get("packing") not in PACKINGS:
        raise QuantizeError(
            f"{path}: not an {FORMAT_NAME} file (header format={metadata.get('format')!r}, "
            f"packing={metadata.get('packing')!r})"
        )
    _, unpack, per_byte = PACKINGS[metadata["packing"]]
    state = {}
    for key, tensor in tensors.items():
        if key.endswith(".weight_scale"):
            continue
        if not key.endswith(".weight_packed"):
            state[key] = tensor.float()
            continue
        stem = key[: -len(".weight_packed")]
        if f"shape.{stem}" not in metadata or f"{stem}.weight_scale" not in tensors:
            raise QuantizeError(f"{path}: packed tensor {key} has no shape in the header or no scale")
        shape = json.loads(metadata[f"shape.{stem}"])
        numel = shape[0] * shape[1]
        if tensor.numel() != -(-numel // per_byte):
            raise QuantizeError(
                f"{path}: {key} holds {tensor.numel()} bytes, shape {shape} needs "
                f"{-(-numel // per_byte)} (truncated or corrupt)"
            )
        try:
            q = unpack(tensor, numel)
        except ValueError as exc:
            raise QuantizeError(f"{path}: {key}: {exc}") from exc
        state[f"{stem}.weight"] = q.float().reshape(shape) * tensors[f"{stem}.weight_scale"].float()
    config.pop("quantization_config", None)
    return state, config


def formats() -> list[Format]:
    def make(packing):
        return lambda model, tok, out: write_ternary(model, tok, out, packing)

    return [
        Format("ternary", FORMAT_NAME, 2.0, DESCRIPTIONS["ternary"], make("2bit")),
        Format("ternary-5trit", FORMAT_NAME, 1.6, DESCRIPTIONS["ternary-5trit"], make("5trit")),
    ]
