"""Data-parallel wrapping: one root module that every training forward goes through, wrapped in DDP or
sharded with FSDP2, and the few operations that differ between them (gradient-sync switch, full
state dict, global gradient norm).

Why a root module. lmforge's forwards are functions of the model (``runtime.optim.logits_at`` runs the LM
head on the loss positions only; ``rl.shared_prompt_logits`` runs a shared prompt once per group;
PPO adds a value head). Called on the bare model they would bypass the wrappers: DDP would not
prepare its gradient reduction, and FSDP2 would not all-gather the root's parameters (the
embeddings, the final norm, the tied LM head). :class:`Root` owns the trained modules and its
``forward(fn, *args)`` just calls ``fn(*args)``: whatever the function does runs inside the
wrapper's forward, so DDP and FSDP2 see every call (:func:`run_forward`).

Gradient averaging. lmforge divides each loss by the global count it normalises by (tokens or
sequences of the whole step, all ranks), so the gradients must be *summed* across ranks, not
averaged: DDP gets a summing communication hook (``parallel.ring``), FSDP2 a gradient divide factor of 1.
"""

from __future__ import annotations

import contextlib

import torch

from ..core.errors import ConfigError
from .context import ParallelContext


class Root(torch.nn.Module):
    """The trained modules under one root (``policy`` first, so the parameter order, and with it the
    optimizer state layout, is the model's own order)."""

    def __init__(self, **modules: torch.nn.Module):
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)

    def forward(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)


def run_forward(wrapped: torch.nn.Module, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` inside the forward of ``wrapped`` (a :class:`Root`, possibly wrapped)."""
    return wrapped(fn, *args, **kwargs)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of an HF causal LM (the units FSDP2 shards one by one)."""
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if layers is None:
        raise ConfigError(
            f"parallel.strategy=fsdp2 needs the decoder layers at model.model.layers; "
            f"{type(model).__name__} has none (use parallel.strategy=ddp)"
        )
    return list(layers)


def wrap(
    root: Root, ctx: ParallelContext, device: torch.device, dtype: torch.dtype, grad_sync: str = "native"
) -> torch.nn.Module:
    """``root`` on ``device``, wrapped for ``ctx.strategy`` (returned as is on one process).

    FSDP2: ``fully_shard`` on each decoder layer of ``root.policy`` and on the root (which then holds
    the embeddings, final norm, tied head and any extra module such as PPO's value head); on CUDA a
    mixed-precision policy computes in ``dtype`` and reduces gradients in fp32.
    """
    root = root.to(device)
    if not ctx.distributed:
        return root
    if ctx.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        # Buffers (rotary frequencies) are equal on every rank: synced once at construction, not per forward.
        wrapped = DDP(
            root,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=ctx.group,
            forward_sync_buffers=False,
        )
        from .ring import ring_hook, sum_hook

        wrapped.register_comm_hook(ctx.group, ring_hook if grad_sync == "ring" else sum_hook)
        return wrapped
    if grad_sync != "native":
        raise ConfigError("parallel.grad_sync=ring is a DDP communication hook; FSDP2 reduce-scatters natively")
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": ctx.mesh}
    if device.type == "cuda" and dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(root.policy):
        fully_shard(layer, **kwargs)
    fully_shard(root, **kwargs)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a sum: the losses carry the global normaliser
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return root


def unwrap(wrapped: torch.nn.Module) -> Root:
    return getattr(wrapped, "module", wrapped)


def is_sharded(wrapped: torch.nn.Module | None) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(wrapped, FSDPModule)


@contextlib.contextmanager
def gradient_sync(wrapped: torch.nn.Module, enabled: bool):
    """Reduce gradients across ranks in this backward only if ``enabled`` (the last micro-batch of
    an optimizer step); the earlier micro-batches accumulate locally. ``wrapped=None``: one process."""
    if not enabled and hasattr(wrapped, "no_sync"):  # DDP
        with wrapped.no_sync():
            yield
        return
    if is_sharded(wrapped):
        wrapped.set_requires_gradient_sync(enabled)
    yield


def full_state_dict(wrapped: torch.nn.Module, module_name: str = "policy") -> dict:
    """The unsharded state dict of ``root.<module_name>`` (names without the prefix), on every rank.

    A collective under FSDP2: every rank must call it.
    """
    root = unwrap(wrapped)
    if not is_sharded(wrapped):
        return getattr(root, module_name).state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True))
    prefix = module_name + "."
    return {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective), or the tensor itself."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value
