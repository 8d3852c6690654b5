"""What every recipe does first: pick hardware settings, make the run directory, write the
resolved config, seed everything."""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import torch

from .. import hardware
from ..checkpoint import list_checkpoints
from ..config import save_config
from ..errors import ConfigError
from ..metrics import make_console
from ..models import count_parameters


@dataclasses.dataclass
class Run:
    name: str
    cfg: object
    dir: Path
    hw: hardware.Hardware
    choices: hardware.Choices
    console: object
    _peak: float = 0.0

    @property
    def device(self) -> torch.device:
        return self.choices.device

    def print(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)

    def peak_gflops(self) -> float:
        """Measured matmul peak of this machine in the run's dtype (cached)."""
        if not self._peak:
            self._peak = hardware.matmul_peak_gflops(self.choices.dtype, device=str(self.device))
        return self._peak

    @staticmethod
    def matmul_params(model) -> tuple[int, int]:
        """(body, head): parameters multiplied per token in the transformer body and in the LM head.

        The input-embedding lookup does no matmul; a tied embedding counts once, as the head.
        """
        head = model.get_output_embeddings().weight.numel()
        body = count_parameters(model) - head
        if not getattr(model.config, "tie_word_embeddings", False):
            body -= model.get_input_embeddings().weight.numel()
        return body, head

    @staticmethod
    def flops_per_token(model) -> float:
        """Training FLOPs per token, 6 x the parameters that do matmuls (forward 2N, backward 4N).

        The input-embedding lookup does no matmul; with tied embeddings the same matrix is the LM
        head, which does. Attention-score FLOPs (~ 12 x layers x hidden x seq) are left out.
        """
        params = count_parameters(model)
        if not getattr(model.config, "tie_word_embeddings", False):
            params -= model.get_input_embeddings().weight.numel()
        return 6.0 * params


def start_run(cfg, name: str, model=None, seq_len: int = 256, console=None) -> Run:
    """Choose hardware settings (printing each with its reason), prepare ``train.output_dir``."""
    console = console or make_console()
    tcfg = cfg.train
    run_dir = Path(tcfg.output_dir)
    if not tcfg.resume and list_checkpoints(run_dir):
        raise ConfigError(
            f"{run_dir} already holds checkpoints of an earlier run. Resume it with train.resume=auto "
            f"or choose another train.output_dir (nothing was overwritten)."
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    hw = hardware.detect(tcfg.device)
    mcfg = getattr(model, "config", None)
    choices = hardware.choose(
        hw, dtype=tcfg.dtype, threads=tcfg.threads, micro_batch_size=tcfg.micro_batch_size,
        gradient_checkpointing=tcfg.gradient_checkpointing,
        num_params=count_parameters(model) if model is not None else 0, seq_len=seq_len,
        hidden=getattr(mcfg, "hidden_size", 128), layers=getattr(mcfg, "num_hidden_layers", 4),
    )
    hardware.apply(choices)
    console.print(f"[hardware] {hardware.describe(hw)}", markup=False)
    choices.report(lambda text: console.print(text, markup=False))
    seed_everything(tcfg.seed)
    save_config(cfg, run_dir / "config.yaml")
    return Run(name, cfg, run_dir, hw, choices, console)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
