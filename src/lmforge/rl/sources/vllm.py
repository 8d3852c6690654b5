"""``rollout.backend=vllm``: sampling on vLLM in the training process (one CUDA GPU; docs/vllm.md),
weights loaded into it after every step."""

from __future__ import annotations

from ...core.errors import ConfigError
from .base import SourceSetup
from .sampled import SampledSource


def build(setup: SourceSetup) -> SampledSource:
    if setup.ctx.distributed:
        raise ConfigError(
            "rollout.backend=vllm runs in one process for now (docs/vllm.md has the plan for "
            "torchrun); use rollout.backend=inprocess under torchrun"
        )
    from ...rollout.vllm_backend import VLLMEngine  # vLLM is an optional extra, imported when used

    max_model_len = max(len(ids) for ids in setup.prompts.prompt_ids) + setup.rollout.max_new_tokens
    return SampledSource(
        setup,
        VLLMEngine(
            setup.policy,
            setup.tokenizer,
            setup.rollout.vllm_gpu_memory_utilization,
            seed=setup.seed,
            max_model_len=max_model_len,
        ),
    )
