"""LoRA adapters through PEFT: add them, switch them off for the reference policy, merge them for
the sampler, save and load them. docs/lora.md explains what is trained and how the pieces fit.

The trained model stays a plain Hugging Face causal LM object: PEFT injects its ``lora.Linear``
layers in place (``q_proj`` becomes a layer holding ``base_layer``, ``lora_A``, ``lora_B``), so
every lmforge forward (``runtime.optim.logits_at``, the shared-prompt forward, the value head, the
sampler) runs the adapted model without knowing about PEFT. Only the adapter weights require
gradients, so the optimizer (which takes the parameters that require gradients) sees only them.

peft is an optional dependency (``pip install 'lmforge[lora]'``), imported only when LoRA is on.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from ..core.config import LoraConfig
from ..core.errors import ConfigError

ADAPTER = "default"  # PEFT's name of the one adapter lmforge trains
INSTALL_HINT = "pip install 'lmforge[lora]' (or: pip install peft)"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _peft():
    try:
        import peft
    except ImportError as exc:
        raise ConfigError(f"model.lora.r > 0 needs the Python package 'peft'. Install it with: {INSTALL_HINT}") from exc
    return peft


def _tuner_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """PEFT's adapter layers in ``model`` (empty without peft or without adapters)."""
    if not any(".lora_" in name for name, _ in model.named_parameters()):
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def has_adapters(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries LoRA adapters (an lmforge LoRA policy)."""
    return any(".lora_" in name for name, _ in model.named_parameters())


def check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """ConfigError for a ``model.lora.target_modules`` name that matches no linear layer of ``model``
    (PEFT adapts the names that match and silently skips the rest) or that names an embedding (not
    supported: docs/lora.md); the message lists the names that can be adapted."""
    linear, other = set(), {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear):
            linear.add(leaf)
        elif name:
            other.setdefault(leaf, type(module).__name__)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is head}
    choices = ", ".join(sorted(linear - head_names)) + " (or all-linear)"
    for target in targets:
        if target in head_names or other.get(target) == "Embedding":
            raise ConfigError(
                f"model.lora.target_modules: {target!r} is an embedding or the LM head, which LoRA "
                f"does not adapt here (docs/lora.md); this model's linear layers: {choices}"
            )
        if target not in linear:
            raise ConfigError(
                f"model.lora.target_modules: {target!r} matches no linear layer of this "
                f"{type(model).__name__}; its linear layers: {choices}"
            )


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, seed: int = 0) -> torch.nn.Module:
    """Inject LoRA adapters into ``model`` in place and freeze everything else; returns ``model``.

    ``lora_A`` is initialised from ``seed`` (PEFT's Kaiming-uniform), ``lora_B`` to zero, so the
    adapted model starts equal to the base model. A model that already has adapters is returned as is.
    """
    if has_adapters(model):
        return model
    peft = _peft()
    targets = cfg.target_modules
    if targets != ["all-linear"]:
        check_targets(model, list(targets))
    target = "all-linear" if targets == ["all-linear"] else list(targets)
    config = peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha or 2 * cfg.r,
        lora_dropout=cfg.dropout,
        target_modules=target,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            wrapper = peft.get_peft_model(model, config)
    except ValueError as exc:  # e.g. "Target modules {...} not found in the base model"
        raise ConfigError(f"model.lora.target_modules={list(targets)}: {exc}") from exc
    model = wrapper.get_base_model()  # the HF model, its linear layers now LoRA layers
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
    return model


def check_settings(lora_cfg: LoraConfig | None, train_cfg, ctx=None) -> None:
    """ConfigError for the settings ``model.lora`` cannot run with (QAT / quantized copies in the
    ``train`` section; FSDP2). Called by ``start_run`` before the run directory is touched, and again
    by :func:`apply_for_run`."""
    if lora_cfg is None or not lora_cfg.r:
        return
    if getattr(train_cfg, "qat", "none") != "none" or getattr(train_cfg, "save_quantized", None):
        raise ConfigError(
            "model.lora with train.qat or train.save_quantized is not supported: train the adapters, "
            "write the merged model (model.lora.save_merged=true) and run `lmforge quantize` on "
            "final/merged"
        )
    if ctx is not None and ctx.distributed and ctx.strategy == "fsdp2":
        raise ConfigError(
            "model.lora with parallel.strategy=fsdp2 is not supported: LoRA trains a few MB of "
            "adapters, so use parallel.strategy=ddp (each rank holds the frozen base model)"
        )


def apply_for_run(model: torch.nn.Module, lora_cfg: LoraConfig | None, train_cfg, ctx=None) -> torch.nn.Module:
    """``model`` with the adapters ``lora_cfg`` (the run's ``model.lora``) asks for (unchanged while
    r = 0), seeded by ``train_cfg.seed``."""
    check_settings(lora_cfg, train_cfg, ctx)
    if lora_cfg is None or not lora_cfg.r:
        return model
    return apply_lora(model, lora_cfg, train_cfg.seed)


def count_trainable(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, all) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Run ``model`` as its base model: every adapter layer passes its input through ``base_layer``
    only. The adapters' ``requires_grad`` flags are restored afterwards (PEFT's switch clears them)."""
    layers = _tuner_layers(model)
    flags = {id(p): p.requires_grad for p in model.parameters()}
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p in model.parameters():
            p.requires_grad_(flags[id(p)])


class DisabledAdapters:
    """The reference policy of a LoRA run: the policy itself, run with its adapters switched off
    (:func:`adapters_disabled`). No second copy of the weights exists."""

    def __init__(self, model: torch.nn.Module):
        self.model = model


# ----------------------------------------------------------------------------- merged weights


def plain_name(name: str) -> str:
    """``model.layers.0.self_attn.q_proj.base_layer.weight`` -> ``model.layers.0.self_attn.q_proj.weight``."""
    return name.replace(".base_layer.", ".")


def merged_named_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(plain HF name, tensor)`` for every parameter of the model the adapters define, lazily: each
    adapted weight is ``W + scale * B A``, computed out of place when its turn comes (one extra matrix
    alive at a time; the trained model is not touched); other parameters are yielded as they are (no
    copy). Tied parameters appear under each of their names. Without adapters: the parameters with
    their own names."""
    adapted = {
        f"{name}.base_layer.weight": module
        for name, module in model.named_modules()
        if hasattr(module, "get_delta_weight") and ADAPTER in getattr(module, "lora_A", {})
    }
    for name, param in model.named_parameters(remove_duplicate=False):
        if ".lora_" in name:
            continue
        module = adapted.get(name)
        if module is None:
            yield plain_name(name), param.detach()
        else:
            with torch.no_grad():
                yield plain_name(name), param.detach() + module.get_delta_weight(ADAPTER).to(param.dtype)


def strip_adapters(model: torch.nn.Module) -> torch.nn.Module:
    """Replace each adapter layer of ``model`` by its ``base_layer`` in place (for a *copy* of the
    policy, e.g. the sampler's): the result is a plain HF model whose adapted weights are still the
    base weights until merged ones are loaded into it. Returns ``model``."""
    for name, module in list(model.named_modules()):
        base = getattr(module, "base_layer", None)
        if base is None or not hasattr(module, "lora_A"):
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, base)
    for attr in ("peft_config", "_hf_peft_config_loaded"):
        if attr in model.__dict__:
            delattr(model, attr)
    return model


# ----------------------------------------------------------------------------- save / load


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights under the names ``peft.PeftModel.from_pretrained`` reads:
    ``base_model.model.<module>.lora_A.weight`` (the adapter name removed)."""
    return {
        f"base_model.model.{name.replace(f'.{ADAPTER}.', '.')}": param.detach().cpu().contiguous()
        for name, param in model.named_parameters()
        if ".lora_" in name
    }


def save_adapter(model: torch.nn.Module, out_dir: str | Path) -> Path:
    """Write a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``),
    loadable on the base model with ``peft.PeftModel.from_pretrained(base, out_dir)``."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.peft_config[ADAPTER].save_pretrained(str(out_dir))
    save_file(adapter_state_dict(model), str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out_dir


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def load_adapter_weights(model: torch.nn.Module, adapter_dir: str | Path) -> None:
    """Load ``adapter_dir``'s adapter weights into ``model``'s adapters in place (exact resume).
    A checkpoint whose adapters do not match (other rank, other modules) is a ConfigError naming them."""
    from safetensors.torch import load_file

    file = Path(adapter_dir) / ADAPTER_WEIGHTS
    try:
        saved = load_file(str(file))
    except Exception as exc:  # safetensors raises SafetensorsError / OSError on a bad file
        raise ConfigError(f"{file}: cannot read the adapter weights ({type(exc).__name__}: {exc})") from exc
    own = {
        f"base_model.model.{name.replace(f'.{ADAPTER}.', '.')}": param
        for name, param in model.named_parameters()
        if ".lora_" in name
    }
    missing, unexpected = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
    shapes = [
        f"{k} {tuple(saved[k].shape)} vs {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(saved))
        if saved[k].shape != own[k].shape
    ]
    if missing or unexpected or shapes:
        raise ConfigError(
            f"{file} does not match this run's adapters (model.lora): missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}, shapes (saved vs model) {shapes[:3]}; resume with the "
            "model.lora settings it was saved with"
        )
    with torch.no_grad():
        for key, param in own.items():
            param.copy_(saved[key])
