"""Losses and advantage estimators as pure functions: tensors in, ``(loss, metrics)`` out.

``policy`` holds the SFT, policy, value and KL losses (the names below are re-exported from it),
``advantages`` the estimators, ``preference`` DPO / IPO / SimPO, ``reward`` the Bradley-Terry loss and
``distill`` the distillation losses."""

from .advantages import ADVANTAGES, compute_advantages
from .policy import Counts, PolicyLossSpec, aggregate, kl_per_token, policy_loss, sft_loss, value_loss

__all__ = [
    "ADVANTAGES",
    "Counts",
    "PolicyLossSpec",
    "aggregate",
    "compute_advantages",
    "kl_per_token",
    "policy_loss",
    "sft_loss",
    "value_loss",
]
