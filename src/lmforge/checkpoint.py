"""Atomic checkpoints and exact resume.

Layout of a run directory::

    checkpoints/step-000100/   model/ (plain HF dir: safetensors + tokenizer), trainer_state.pt
    best/                      model/ of the lowest validation loss so far
    final/                     model/ at the end of the run

Every checkpoint is written into a temporary sibling directory and renamed into place, so a crash
mid-save leaves the previous checkpoints intact and never a half-written one under a final name.
``trainer_state.pt`` holds the optimizer, scheduler, RNG states, data position and step, which is
what makes a resumed run reproduce the uninterrupted one exactly on CPU.
"""
from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import torch

from .errors import ConfigError
from .models import save_model

STEP_DIR = re.compile(r"^step-(\d+)$")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_dir(final: Path, write) -> Path:
    """Run ``write(tmp_dir)`` then atomically move ``tmp_dir`` to ``final`` (replacing it)."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    _fsync_tree(tmp)
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    return final


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def save_model_dir(final: Path, model, tokenizer) -> Path:
    """Atomically write a plain HF model directory (best / final)."""
    return _write_dir(final, lambda tmp: save_model(model, tokenizer, tmp))


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, trainer_state: dict, keep_last: int) -> Path:
    """Write ``checkpoints/step-XXXXXX`` atomically and prune all but the newest ``keep_last``."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        save_model(model, tokenizer, tmp / "model")
        torch.save({**trainer_state, "step": step, "rng": rng_state()}, tmp / "trainer_state.pt")

    path = _write_dir(root / f"step-{step:06d}", write)
    for stale in root.glob(".step-*.tmp-*"):  # left by a process that died mid-save
        shutil.rmtree(stale, ignore_errors=True)
    if keep_last > 0:
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary directories are ignored)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if (p / "trainer_state.pt").is_file()]


def resolve_resume(resume: str, run_dir: Path) -> Path | None:
    """``''`` -> None; ``'auto'`` -> newest checkpoint of ``run_dir`` (or None); else that path."""
    if not resume:
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / "trainer_state.pt").is_file():
        raise ConfigError(f"train.resume={resume!r}: no checkpoint there (expected {path}/trainer_state.pt)")
    return path


def resume_training(resume: str, run_dir: Path, model, updater, order, printer) -> dict:
    """Resume as ``train.resume`` says (see :func:`resolve_resume`), or do nothing.

    Loads the checkpoint's weights into ``model`` and restores ``updater`` (optimizer, schedule,
    precision), ``order`` (data position) and the RNG states; prints where it resumed from. Returns
    the saved trainer state (its ``step`` and whatever the recipe stored), or {} for a fresh run.
    """
    path = resolve_resume(resume, run_dir)
    if path is None:
        return {}
    load_model_weights(model, path)
    saved = load_trainer_state(path)
    updater.load_state_dict(saved)
    order.load_state_dict(saved["data"])
    set_rng_state(saved["rng"])
    printer(f"[resume] from {path} at step {saved['step']}")
    return saved


def load_trainer_state(path: Path) -> dict:
    return torch.load(Path(path) / "trainer_state.pt", map_location="cpu", weights_only=False)


def load_model_weights(model, path: Path) -> None:
    """Load the weights of checkpoint ``path`` into ``model`` in place."""
    from safetensors.torch import load_file

    files = sorted((Path(path) / "model").glob("*.safetensors"))
    if not files:
        raise ConfigError(f"checkpoint {path} has no model weights")
    state = {}
    for file in files:
        state.update(load_file(str(file)))
    # Checked before loading: load_state_dict copies the matching tensors before it complains, and
    # reports a shape mismatch as a bare RuntimeError.
    own = model.state_dict()
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing, unexpected = sorted(set(own) - set(state) - tied), sorted(set(state) - set(own))
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in sorted(set(own) & set(state))
              if state[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        raise ConfigError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}, "
                          f"shapes (checkpoint vs model) {shapes}; resume with the model config it was saved with")
    model.load_state_dict(state, strict=False)
    if tied:
        model.tie_weights()
