"""The activation-checkpointing switch and check (``model.load``), read by ``rl.forward.shares_prompts``."""

from __future__ import annotations

import warnings

import torch

from lmforge.core.config import ModelConfig
from lmforge.model.load import activation_checkpointing, enable_activation_checkpointing, load_model


def test_activation_checkpointing_is_read_without_the_deprecated_alias():
    """transformers 5's ``is_gradient_checkpointing`` and ``gradient_checkpointing_enable`` warn (a
    FutureWarning a GRPO run printed at each step); the switch and the check use the current names, and a
    module with neither is not checkpointed."""
    model, _ = load_model(
        ModelConfig(
            name="tiny:llama", tokenizer="char", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32
        )
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert activation_checkpointing(model) is False
        enable_activation_checkpointing(model)
        assert activation_checkpointing(model) is True
        assert activation_checkpointing(torch.nn.Linear(2, 2)) is False
