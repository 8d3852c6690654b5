"""Quantization-aware training: swap the decoder layers' ``nn.Linear`` for a fake-quantized linear.

Contract (what a training loop needs to know):
  * ``apply_qat(model, "ternary" | "int4")`` replaces, in place, every ``nn.Linear`` inside the
    decoder layers (``model.model.layers``; never the embeddings or ``lm_head``) by a
    :class:`QATLinear` and returns the list of replaced module names. Call it once, after loading
    the model and before building the optimizer (the parameters are the same objects, so an
    optimizer built before also works).
  * The forward uses ``fake_quant(weight)``; the backward is straight-through (the gradient of the
    fake-quantized weight is passed to the full-precision master weight unchanged). The master
    weights stay in their dtype; the optimizer state is unchanged.
  * The state dict keys are unchanged (``...q_proj.weight``), so checkpoints save and resume as
    usual; a checkpoint holds the *master* weights, and ``config.json`` records ``"lmforge_qat":
    "<scheme>"`` (``apply_qat`` sets ``model.config.lmforge_qat``). Plain transformers runs such a
    checkpoint unquantized; ``lmforge quantize`` sees the key and bakes before exporting. To resume
    QAT, call ``apply_qat`` again after loading.
  * ``bake_qat(model)`` turns the QAT linears back into ``nn.Linear`` holding the fake-quantized
    weights, so that a plain HF save (and any later export, e.g. ``lmforge quantize --format
    ternary`` or ``gguf-tq2_0``) computes exactly what the training forward computed. It sets the
    attribute ``model.lmforge_baked_qat = "<scheme>"`` (not saved): the ``int4-g32`` writer then
    uses int4 QAT's own grid (``max|W_g| / 7``), so that export is exact too.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .ternary import StraightThrough, ternary_fake_quant

INT4_GROUP = 32


def int4_fake_quant(weight: torch.Tensor, group_size: int = INT4_GROUP) -> torch.Tensor:
    """Symmetric int4 absmax per group of ``group_size`` input columns, straight-through gradient.

    scale_g = max|W_g| / 7, q = clamp(round(W / scale_g), -8, 7), W_hat = q * scale_g.
    """
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"int4 QAT: group size {group_size} does not divide in_features {in_features}")
    w = weight.detach().reshape(out_features, in_features // group_size, group_size)
    scale = w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 7
    w_hat = (torch.clamp(torch.round(w / scale), -8, 7) * scale).reshape_as(weight)
    return StraightThrough.apply(weight, w_hat)


QAT_SCHEMES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "ternary": ternary_fake_quant,
    "int4": int4_fake_quant,
}


class QATLinear(nn.Linear):
    """``nn.Linear`` whose forward multiplies by ``fake_quant(weight)`` (same parameters, same keys)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: str, **factory):
        super().__init__(in_features, out_features, bias=bias, **factory)
        self.scheme = scheme

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, QAT_SCHEMES[self.scheme](self.weight), self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", qat={self.scheme}"


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder block list of a transformers causal LM (``model.model.layers``)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"QAT needs a decoder-only model with model.model.layers; got {type(model).__name__}")
    return layers


def _swap(layers: nn.ModuleList, make: Callable[[nn.Linear], nn.Module], want: type) -> list[str]:
    replaced = []
    for i, layer in enumerate(layers):
        for name, module in list(layer.named_modules()):
            if type(module) is not want:
                continue
            parent_name, _, child = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            setattr(parent, child, make(module))
            replaced.append(f"model.layers.{i}.{name}")
    return replaced


def apply_qat(model: nn.Module, scheme: str) -> list[str]:
    """Swap the decoder layers' ``nn.Linear`` for :class:`QATLinear` (in place); see module docstring."""
    if scheme not in QAT_SCHEMES:
        raise ValueError(f"unknown QAT scheme {scheme!r}; valid: {', '.join(QAT_SCHEMES)}")

    def make(linear: nn.Linear) -> QATLinear:
        qat = QATLinear(linear.in_features, linear.out_features, linear.bias is not None, scheme, device="meta")
        qat.weight, qat.bias = linear.weight, linear.bias  # the same Parameter objects
        if scheme == "int4":
            int4_fake_quant(linear.weight.detach())  # fail now, not at the first step, on a bad shape
        return qat

    replaced = _swap(decoder_layers(model), make, nn.Linear)
    if not replaced:
        raise ValueError("apply_qat: no nn.Linear found in the decoder layers (already applied?)")
    if getattr(model, "config", None) is not None:
        model.config.lmforge_qat = scheme  # saved in config.json: the checkpoint holds master weights
    return replaced


def apply_ternary_qat(model: nn.Module) -> list[str]:
    """BitNet b1.58 ternary QAT: ``apply_qat(model, "ternary")``."""
    return apply_qat(model, "ternary")


@torch.no_grad()
def bake_qat(model: nn.Module) -> list[str]:
    """Replace each :class:`QATLinear` by an ``nn.Linear`` holding its fake-quantized weight (in place)."""

    def make(qat: QATLinear) -> nn.Linear:
        linear = nn.Linear(qat.in_features, qat.out_features, bias=qat.bias is not None, device="meta")
        linear.weight = nn.Parameter(QAT_SCHEMES[qat.scheme](qat.weight).detach().clone())
        linear.bias = qat.bias
        return linear

    schemes = {m.scheme for m in model.modules() if isinstance(m, QATLinear)}
    baked = _swap(decoder_layers(model), make, QATLinear)
    if hasattr(getattr(model, "config", None), "lmforge_qat"):
        del model.config.lmforge_qat  # the weights are quantized now; baking twice would rescale ternary
    if len(schemes) == 1:
        model.lmforge_baked_qat = schemes.pop()  # in memory only: int4-g32 export then keeps the QAT grid
    return baked
