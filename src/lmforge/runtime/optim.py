"""The shared pieces of every optimisation loop: optimizer, LR schedule, precision, forward on loss
positions only, accumulation-normalised steps, global-norm clipping and a resumable batch order."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from ..core.config import OptimConfig
from ..core.errors import TrainingError

# Model families whose logits are exactly ``lm_head(last_hidden_state)`` (no soft-capping or
# scaling): for these the LM head can run on the loss positions only. Not granite: it divides the
# head's output by ``config.logits_scaling``.
PLAIN_HEAD_MODELS = {"llama", "qwen2", "qwen3", "mistral", "phi3", "olmo2", "smollm3"}


# ----------------------------------------------------------------------------- optimizer


def param_groups(model: torch.nn.Module, weight_decay: float, no_decay: list[str]) -> list[dict]:
    """Two AdamW groups: decayed weights, and parameters whose name contains a ``no_decay`` substring."""
    decay, skip = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (skip if any(s in name.lower() for s in no_decay) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": skip, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay; the fused kernel where this torch build has it."""
    groups = param_groups(model, cfg.weight_decay, cfg.no_decay)
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


def lr_factor(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based).

    Linear warmup over ``warmup_steps`` (step 0 gets 1/warmup), then cosine / linear decay to
    ``min_lr_ratio`` at the last step, or constant.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    decay_steps = max(max_steps - 1 - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    if cfg.schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer, cfg: OptimConfig, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, max_steps))


# ----------------------------------------------------------------------------- precision


class Precision:
    """Autocast context and (fp16 only) a gradient scaler. fp32 is a no-op."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.enabled = dtype != torch.float32
        self.scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None

    def autocast(self):
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)


def optimizer_step(
    model, optimizer, scheduler, precision: Precision, max_grad_norm: float, skip_nonfinite: bool = False
) -> torch.Tensor:
    """Unscale, clip by global norm, step, zero grads. Returns the pre-clip global grad norm.

    ``skip_nonfinite``: when the norm is nan / inf (and no fp16 grad scaler handles it), drop the
    gradients without touching the weights, the optimizer state or the schedule (a host sync).
    """
    if precision.scaler:
        precision.scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    if max_grad_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    elif any(hasattr(p.grad, "full_tensor") for p in params):  # FSDP2 shards: a norm over all ranks
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    else:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    if skip_nonfinite and not precision.scaler and not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return norm.detach()
    if precision.scaler:
        precision.scaler.step(optimizer)
        precision.scaler.update()
    else:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm.detach()


@dataclasses.dataclass
class Updater:
    """Optimizer, LR schedule and precision of the trained module; ``step`` is one update.

    A non-finite loss or gradient norm never reaches the weights: ``on_nonfinite="stop"`` raises a
    TrainingError before the update, ``"skip"`` drops that update, counts it (``num_skipped``) and
    stops after ``max_skips`` in a row.
    """

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    max_grad_norm: float
    on_nonfinite: str = "stop"
    max_skips: int = 3
    num_skipped: int = 0
    skipped_in_a_row: int = 0

    @classmethod
    def build(
        cls, module, optim_cfg, num_updates: int, precision: Precision, on_nonfinite: str = "stop", max_skips: int = 3
    ) -> "Updater":
        """``module``: what the optimizer trains (the wrapped root, so DDP / FSDP2 parameters)."""
        optimizer = build_optimizer(module, optim_cfg)
        return cls(
            module,
            optimizer,
            build_scheduler(optimizer, optim_cfg, num_updates),
            precision,
            optim_cfg.max_grad_norm,
            on_nonfinite,
            max_skips,
        )

    def check_loss(self, loss: torch.Tensor, step: int) -> None:
        """Before the update: a non-finite loss stops the run under ``stop`` (under ``skip`` its
        gradient norm is non-finite too, and :meth:`step` skips the update)."""
        if self.on_nonfinite == "stop":
            check_finite(loss, step)

    def step(self, step: int = 0) -> torch.Tensor:
        norm = optimizer_step(
            self.module, self.optimizer, self.scheduler, self.precision, self.max_grad_norm, skip_nonfinite=True
        )
        if self.precision.scaler or torch.isfinite(norm):  # (fp16: the grad scaler skips overflows itself)
            self.skipped_in_a_row = 0
            return norm
        if self.on_nonfinite == "stop":
            raise TrainingError(
                f"non-finite gradient norm ({norm.item()}) at step {step}: the update was not "
                "applied. Lower optim.lr, or set train.on_nonfinite=skip to skip such updates; "
                "the last checkpoint is intact."
            )
        self.num_skipped += 1
        self.skipped_in_a_row += 1
        if self.skipped_in_a_row > self.max_skips:
            raise TrainingError(
                f"{self.skipped_in_a_row} updates in a row had a non-finite gradient norm (last at "
                f"step {step}; train.max_nonfinite_skips={self.max_skips}); stopping. Lower "
                "optim.lr; the last checkpoint is intact."
            )
        return norm

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "precision": self.precision.state_dict(),
            "nonfinite": {"num_skipped": self.num_skipped, "skipped_in_a_row": self.skipped_in_a_row},
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state["precision"])
        self.load_counters(state)

    def load_counters(self, state: dict) -> None:
        counters = state.get("nonfinite", {})
        self.num_skipped = counters.get("num_skipped", 0)
        self.skipped_in_a_row = counters.get("skipped_in_a_row", 0)


# ----------------------------------------------------------------------------- forward


def decoder_of(model):
    """The transformer body (without LM head) of an HF causal LM, or None if unknown."""
    getter = getattr(model, "get_decoder", None)
    body = getter() if getter else None
    return body if body is not None and body is not model else getattr(model, "model", None)


def logits_at(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Logits at the selected positions only: (B, T) bool ``positions`` -> (N, V).

    For plain-head models the LM head (the largest matmul of a small model: V x H per token) runs
    only where a loss is taken, e.g. completion tokens in SFT and RL. Other models fall back to the
    full forward.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    body = decoder_of(model)
    if model_type in PLAIN_HEAD_MODELS and body is not None:
        hidden = body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return model.get_output_embeddings()(hidden[positions])
    return model(input_ids=input_ids, attention_mask=attention_mask).logits[positions]


def shifted_targets(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """labels (B, T) aligned with inputs, -100 = no loss -> (positions (B, T) bool, targets (N,)).

    Position t predicts token t+1, so ``positions[:, t]`` is True where ``labels[:, t+1]`` counts.
    """
    next_labels = labels[:, 1:]
    positions = torch.zeros_like(labels, dtype=torch.bool)
    positions[:, :-1] = next_labels != -100
    return positions, next_labels[next_labels != -100]


def count_loss_tokens(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != -100).sum())


def check_finite(loss: torch.Tensor, step: int) -> None:
    if not torch.isfinite(loss):
        raise TrainingError(
            f"non-finite loss ({loss.item()}) at step {step}. Lower optim.lr, enable clipping "
            f"(optim.max_grad_norm), or use train.dtype=fp32; the last checkpoint is intact."
        )


# ----------------------------------------------------------------------------- batch order


class BatchOrder:
    """Shuffled row indices, reshuffled every epoch from (seed, epoch); resumable from a position."""

    def __init__(self, num_rows: int, batch_rows: int, seed: int):
        if num_rows < 1:
            raise TrainingError("no training rows")
        self.num_rows, self.batch_rows, self.seed = num_rows, min(batch_rows, num_rows), seed
        self.epoch, self.pos = 0, 0
        self._perm = self._permutation()

    def _permutation(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(self.num_rows, generator=gen)

    def next(self) -> list[int]:
        if self.pos + self.batch_rows > self.num_rows:
            self.epoch, self.pos = self.epoch + 1, 0
            self._perm = self._permutation()
        rows = self._perm[self.pos : self.pos + self.batch_rows].tolist()
        self.pos += self.batch_rows
        return rows

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._perm = self._permutation()
