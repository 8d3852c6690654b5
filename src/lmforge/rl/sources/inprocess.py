"""``rollout.backend=inprocess``: the built-in sampler (KV cache, lockstep decoding) in the training
process, on the policy itself, or with ``rollout.dtype=bf16|fp16`` on a cast copy of it synced after
every step (:class:`~lmforge.rollout.CastEngine`)."""

from __future__ import annotations

import torch

from ...rollout import CastEngine, generate
from .base import SourceSetup
from .sampled import SampledSource

CAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class PolicyEngine:
    """Samples from the model it was last given: the live policy, no copy (under FSDP2, the run's
    gathered copy). Sampling is inference: the model is in eval mode meanwhile (no dropout)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model

    def generate(self, prompt_ids, params, num_samples: int, pad_token_id: int):
        was_training = self.model.training
        self.model.eval()
        try:
            return generate(self.model, prompt_ids, params, num_samples=num_samples, pad_token_id=pad_token_id)
        finally:
            self.model.train(was_training)


def cast_engine(model: torch.nn.Module, dtype_name: str, is_level: str, bf16_native: bool, say) -> CastEngine:
    """The sampler on a ``dtype_name`` copy of ``model`` (``rollout.dtype``), with a note when that
    dtype is slow on this device or when no importance weights correct for the rounding."""
    dtype = CAST_DTYPES[dtype_name]
    device = next(model.parameters()).device
    if device.type == "cpu" and not (dtype is torch.bfloat16 and bf16_native):
        say(
            f"[rollout] note: rollout.dtype={dtype_name} on a CPU without native {dtype_name} units "
            "is usually much slower than fp32; rollout.dtype=same is the fast choice here"
        )
    if is_level == "none":
        say(
            f"[rollout] note: sampling with {dtype_name} weights and training in "
            f"{next(model.parameters()).dtype}: the sampler's logprobs differ by rounding; "
            "algo.is_level=token corrects for it (the rollout_diff_* metrics show the size)"
        )
    return CastEngine(model, dtype)


def make_engine(setup: SourceSetup) -> PolicyEngine | CastEngine:
    """The policy itself, or its ``rollout.dtype`` copy (also the episode source's engine)."""
    if setup.rollout.dtype == "same":
        return PolicyEngine(setup.policy)
    return cast_engine(setup.policy, setup.rollout.dtype, setup.is_level, setup.bf16_native, setup.print)


def build(setup: SourceSetup) -> SampledSource:
    return SampledSource(setup, make_engine(setup))
