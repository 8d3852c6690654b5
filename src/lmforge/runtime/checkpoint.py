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

import contextlib
import errno
import os
import random
import re
import shutil
from pathlib import Path
from typing import Callable

import torch

from ..core.errors import ConfigError, LmforgeError, SaveError, TrainingError, describe_errno, environment_errno
from ..model.load import save_merged, save_model, save_model_config
from ..parallel.context import deferred_signals
from ..parallel.wrap import full_state_dict, is_sharded

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


def _tmp_dir(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


def _commit(tmp: Path, final: Path) -> Path:
    """fsync ``tmp`` and rename it to ``final`` (replacing it): all or nothing under ``final``. A signal
    is held from the first rename until the replaced directory is gone."""
    _fsync_tree(tmp)
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    with deferred_signals():
        if final.exists():
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
    return final


def _write_dir(final: Path, write) -> Path:
    """Run ``write(tmp_dir)`` then atomically move ``tmp_dir`` to ``final`` (replacing it)."""
    tmp = _tmp_dir(final)
    with _cleaned_on_failure(tmp, final):
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write(tmp)
        return _commit(tmp, final)


@contextlib.contextmanager
def _cleaned_on_failure(tmp: Path, final: Path):
    """Whatever stops a write into ``tmp`` (an error of any type, a signal) removes ``tmp``; what was
    under ``final`` before is untouched. The machine's failures (disk full, quota, permissions, a
    read-only file system: :func:`lmforge.core.errors.environment_errno`) become a SaveError naming
    ``final`` and the cause; any other error is re-raised with a note naming ``final``."""
    try:
        yield
    except BaseException as exc:
        ours = isinstance(exc, LmforgeError) or not isinstance(exc, Exception)  # a QuantizeError, an interrupt
        code = None if ours else environment_errno(exc, tmp)  # probed while the failed write holds its space
        shutil.rmtree(tmp, ignore_errors=True)
        if ours:
            raise
        if code is None:
            exc.add_note(
                f"while writing {final}: its temporary directory {tmp} was removed; what was there before is intact"
            )
            raise
        raise SaveError(save_failure_message(final, code, exc)) from exc


def save_failure_message(final: Path, code: int, exc: BaseException) -> str:
    """'disk full while writing PATH (cause); ...; what to do': the message of a SaveError."""
    head = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded"}.get(code)
    what = f"{head} while writing {final}" if head else f"could not write {final}: {describe_errno(code)}"
    fix = (
        f"Free space on the file system of {final.parent}"
        if head
        else f"Make {final.parent} writable (or choose another directory)"
    )
    return (
        f"{what} ({type(exc).__name__}: {str(exc).strip()[:200]}); nothing was written under that name, its "
        f"temporary directory was removed and the last checkpoint is intact. {fix}, then run the command "
        "again (a training run continues with train.resume=auto)"
    )


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def _on_main(ctx, work) -> None:
    """``work()`` on rank 0; every rank then learns whether it failed (no rank waits forever)."""
    error = None
    if ctx.is_main:
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - re-raised on rank 0 by check_all_ok, after the others know
            error = exc
    ctx.check_all_ok(error)


def parameters_finite(state) -> bool:
    """Whether every parameter of the trained modules is finite, on every rank (one flag all-reduced)."""
    norms = [
        torch.linalg.vector_norm(p.detach().to_local() if hasattr(p, "to_local") else p.detach())
        for p in state.wrapped.parameters()
    ]
    bad = torch.tensor([0 if not norms or bool(torch.isfinite(torch.stack(norms)).all()) else 1])
    return int(state.run.ctx.all_reduce(bad)) == 0


def _refuse_nonfinite(state, what: Path) -> None:
    if not parameters_finite(state):
        raise TrainingError(
            f"the parameters are not finite after step {state.step}: {what} was not written. "
            "Lower optim.lr or set train.on_nonfinite; the last checkpoint is intact."
        )


def save_model_dir(final: Path, state, extra: Callable[[Path], object] | None = None) -> Path:
    """Atomically write a plain HF model directory (best / final) of ``state.model``.

    Under FSDP2 the parameters are first gathered (a collective: every rank calls this); rank 0 writes.
    Non-finite parameters are never written (TrainingError). ``extra(tmp)`` (rank 0) adds more files
    to the directory before it is renamed into place, e.g. the quantized copies.
    """
    _refuse_nonfinite(state, final)
    weights = full_state_dict(state.wrapped) if is_sharded(state.wrapped) else None

    def write(tmp: Path) -> None:
        save_model(state.model, state.tokenizer, tmp, state_dict=weights)
        if extra is not None:
            extra(tmp)

    _on_main(state.run.ctx, lambda: _write_dir(final, write))
    return final


def save_merged_dir(final: Path, state) -> Path:
    """Atomically write the merged LoRA policy (``W + scale * B A``) as a plain HF directory (rank 0)."""

    _on_main(state.run.ctx, lambda: _write_dir(final, lambda tmp: save_merged(state.model, state.tokenizer, tmp)))
    return final


def save_checkpoint(state, extra: dict, keep_last: int) -> Path:
    """Write ``checkpoints/step-XXXXXX`` atomically and prune all but the newest ``keep_last``.

    One process or DDP: rank 0 writes the HF model and ``trainer_state.pt`` (optimizer, schedule,
    precision, data position, step, every rank's RNG state). FSDP2: the sharded model and optimizer
    go to ``dcp/`` with ``torch.distributed.checkpoint`` (each rank writes its shards), the model's
    config and tokenizer to ``model/``, the rest to ``trainer_state.pt``; ``lmforge export`` turns it
    into an HF directory. Either way the directory appears under its final name only when complete.
    """
    run, ctx = state.run, state.run.ctx
    root = Path(run.dir) / "checkpoints"
    final = root / f"step-{state.step:06d}"
    ctx.mark(f"the checkpoint save at step {state.step}")
    _refuse_nonfinite(state, final)
    rngs = ctx.gather_objects(rng_state())
    trainer_state = {
        "data": state.order.state_dict(),
        **extra,
        "step": state.step,
        "rng": rngs[0],
        "rng_ranks": rngs,
        "world_size": ctx.world_size,
        "strategy": ctx.strategy,
    }
    tmp = ctx.broadcast_object(_tmp_dir(final))
    sharded = is_sharded(state.wrapped)

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    _on_main(ctx, prepare)
    if sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(state.wrapped, state.updater.optimizer)
        error = None
        try:
            with _cleaned_on_failure(tmp, final):
                dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp / "dcp"))
        except TrainingError as exc:  # every rank learns that a rank's shard could not be written
            error = exc
        ctx.check_all_ok(error)
        trainer_state.update(
            {
                "scheduler": state.updater.scheduler.state_dict(),
                "precision": state.updater.precision.state_dict(),
                "nonfinite": {
                    "num_skipped": state.updater.num_skipped,
                    "skipped_in_a_row": state.updater.skipped_in_a_row,
                },
            }
        )
    else:
        trainer_state.update(state.updater.state_dict())

    def write() -> None:
        with _cleaned_on_failure(tmp, final):
            write_files()
        clean_checkpoints(root)
        if keep_last > 0:
            for old in list_checkpoints(run.dir)[:-keep_last]:
                remove_checkpoint(old)

    def write_files() -> None:
        if sharded:
            save_model_config(state.model, state.tokenizer, tmp / "model")
        else:
            save_model(state.model, state.tokenizer, tmp / "model")
        torch.save(trainer_state, tmp / "trainer_state.pt")
        _commit(tmp, final)

    ctx.mark(f"the checkpoint barrier at step {state.step}")
    ctx.barrier()  # every rank's shards are written
    _on_main(ctx, write)
    return final


def remove_checkpoint(path: Path) -> None:
    """Rename first, then delete: a kill mid-delete (SIGKILL, a crash) leaves a ``.deleting`` directory
    (removed by the next :func:`clean_checkpoints`), never a half-deleted one under a checkpoint's name.
    SIGINT / SIGTERM wait until the deletion is over, so a run they stop leaves none."""
    doomed = path.with_name(f".{path.name}.deleting-{os.getpid()}")
    with deferred_signals():
        path.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def _pid_of(name: str) -> int | None:
    match = re.search(r"\.(?:tmp|deleting|old)-(\d+)$", name)
    return int(match.group(1)) if match else None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (this process included)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_checkpoints(root: Path) -> None:
    """Remove what interrupted saves and deletions left in ``checkpoints/``: temporary and
    half-deleted directories of processes that are gone, and step directories without a trainer
    state (only a deletion interrupted before checkpoints were renamed first leaves those).
    The run directory's lock guarantees that no other live run writes here."""
    if not root.is_dir():
        return
    for path in root.iterdir():
        pid = _pid_of(path.name)
        if pid is not None and path.name.startswith(".") and not pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
        elif STEP_DIR.match(path.name) and not (path / "trainer_state.pt").is_file():
            shutil.rmtree(path, ignore_errors=True)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary directories are ignored)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if (p / "trainer_state.pt").is_file()]


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` cannot be resumed (incomplete, unreadable or non-finite), or None if it can."""
    try:
        saved = load_trainer_state(path)
    except Exception as exc:  # noqa: BLE001 - truncated / corrupt file: reported, never resumed
        return f"trainer_state.pt unreadable ({type(exc).__name__})"
    if not isinstance(saved, dict) or "step" not in saved or "data" not in saved:
        return "trainer_state.pt incomplete"
    if (path / "dcp").is_dir():
        return None if (path / "dcp" / ".metadata").is_file() else "dcp/ has no .metadata (incomplete)"
    files = sorted((path / "model").glob("*.safetensors"))
    if not files:
        return "no model weights"
    from safetensors import safe_open

    try:
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    if not bool(torch.isfinite(handle.get_tensor(key)).all()):
                        return f"non-finite weights ({key})"
    except Exception as exc:  # noqa: BLE001 - whatever safetensors raises: reported, never resumed
        return f"model weights unreadable ({type(exc).__name__})"
    return None


def resolve_resume(resume: str, run_dir: Path, printer=print) -> Path | None:
    """``''`` -> None; ``'auto'`` -> the newest checkpoint of ``run_dir`` that is complete and finite
    (naming the ones skipped; an error if there are checkpoints but none is usable); else that path."""
    if not resume:
        return None
    if resume == "auto":
        root = Path(run_dir) / "checkpoints"
        candidates = (
            sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))), reverse=True)
            if root.is_dir()
            else []
        )
        skipped = []
        for _, path in candidates:
            problem = checkpoint_problem(path)
            if problem is None:
                for name, why in skipped:
                    printer(f"[resume] skipping {name}: {why}")
                return path
            skipped.append((path.name, problem))
        if skipped:
            raise ConfigError(
                f"train.resume=auto: no usable checkpoint in {root} ("
                + "; ".join(f"{name}: {why}" for name, why in skipped)
                + "); nothing was overwritten. Resume one explicitly, or start a new train.output_dir"
            )
        return None
    path = Path(resume)
    if not (path / "trainer_state.pt").is_file():
        raise ConfigError(f"train.resume={resume!r}: no checkpoint there (expected {path}/trainer_state.pt)")
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ConfigError(f"train.resume={resume!r}: cannot resume this checkpoint: {problem}")
    return path


def resume_training(resume: str, run_dir: Path, state, printer) -> dict:
    """Resume as ``train.resume`` says (see :func:`resolve_resume`), or do nothing.

    Restores the weights, the optimizer / schedule / precision (``state.updater``), the data position
    (``state.order``) and each rank's RNG state. A checkpoint written at another world size reshards
    (FSDP2, through ``torch.distributed.checkpoint``) or loads as is (DDP, one process: the state is
    replicated); the RNG streams then restart from the seed, the rank and the step (docs/distributed.md).
    Returns the saved trainer state (its ``step`` and what the recipe stored), or {} for a fresh run.
    """
    ctx = state.run.ctx
    path, error = None, None
    if ctx.is_main:  # rank 0 validates; every rank resumes the checkpoint it chose
        try:
            path = resolve_resume(resume, run_dir, printer)
        except ConfigError as exc:
            error = exc
    ctx.check_all_ok(error)
    path = ctx.broadcast_object(path)
    if path is None:
        return {}
    saved = load_trainer_state(path)
    if (path / "dcp").is_dir():
        _load_sharded(path, state)
        state.updater.scheduler.load_state_dict(saved["scheduler"])
        state.updater.precision.load_state_dict(saved["precision"])
        state.updater.load_counters(saved)
    elif is_sharded(state.wrapped):
        raise ConfigError(
            f"checkpoint {path} was written without FSDP2 (no dcp/ directory): resume it with "
            f"parallel.strategy=ddp, or start a new run from its weights (model.name={path}/model)"
        )
    else:
        load_model_weights(state.model, path)
        state.updater.load_state_dict(saved)
    state.order.load_state_dict(saved["data"])
    rngs = saved.get("rng_ranks", [saved["rng"]])
    if len(rngs) == ctx.world_size:
        set_rng_state(rngs[ctx.rank])
    else:
        reseed = state.run.train.seed + 1_000_003 * ctx.rank + 7919 * saved["step"]
        random.seed(reseed)
        torch.manual_seed(reseed)
        printer(
            f"[resume] the checkpoint was written by {len(rngs)} ranks, this run has {ctx.world_size}: "
            "weights, optimizer and data position are restored, the RNG streams restart from "
            "(seed, rank, step)"
        )
    printer(f"[resume] from {path} at step {saved['step']}")
    return saved


def _load_sharded(path: Path, state) -> None:
    """Load a ``dcp/`` checkpoint into the (possibly differently sharded) model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(state.wrapped, state.updater.optimizer)
    loaded = {"model": model_state, "optim": optim_state}
    dcp.load(loaded, checkpoint_id=str(path / "dcp"))
    set_state_dict(
        state.wrapped, state.updater.optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )


def load_trainer_state(path: Path) -> dict:
    """The trainer state of checkpoint ``path``; a missing, truncated or corrupt file is a ConfigError."""
    file = Path(path) / "trainer_state.pt"
    try:
        state = torch.load(file, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise ConfigError(f"{file}: checkpoint has no trainer state (not a complete checkpoint)") from None
    except Exception as exc:  # torch.load raises RuntimeError, EOFError, UnpicklingError, ... on bad files
        raise ConfigError(
            f"{file}: cannot read the trainer state ({type(exc).__name__}: {exc}); the file is "
            "truncated or corrupt: resume from another checkpoint"
        ) from exc
    if not isinstance(state, dict):
        raise ConfigError(f"{file}: expected a dict of trainer state, found a {type(state).__name__}")
    return state


def load_model_weights(model, path: Path) -> None:
    """Load the weights of checkpoint ``path`` into ``model`` in place (a LoRA model: its adapters)."""
    from safetensors.torch import load_file

    from ..model.lora import has_adapters, is_adapter_dir, load_adapter_weights

    if has_adapters(model) or is_adapter_dir(Path(path) / "model"):
        if not (has_adapters(model) and is_adapter_dir(Path(path) / "model")):
            raise ConfigError(
                f"checkpoint {path} was written {'without' if has_adapters(model) else 'with'} LoRA "
                "adapters: resume it with the model.lora settings it was saved with"
            )
        load_adapter_weights(model, Path(path) / "model")
        return
    files = sorted((Path(path) / "model").glob("*.safetensors"))
    if not files:
        raise ConfigError(f"checkpoint {path} has no model weights")
    state = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except Exception as exc:  # safetensors raises SafetensorsError (and OSError) on a bad file
            raise ConfigError(
                f"{file}: cannot read the checkpoint weights ({type(exc).__name__}: {exc}); the "
                "file is truncated or corrupt: resume from another checkpoint"
            ) from exc
    # Checked before loading: load_state_dict copies the matching tensors before it complains, and
    # reports a shape mismatch as a bare RuntimeError.
    own = model.state_dict()
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing, unexpected = sorted(set(own) - set(state) - tied), sorted(set(state) - set(own))
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(state))
        if state[k].shape != own[k].shape
    ]
    if missing or unexpected or shapes:
        raise ConfigError(
            f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}, "
            f"shapes (checkpoint vs model) {shapes}; resume with the model config it was saved with"
        )
    model.load_state_dict(state, strict=False)
    if tied:
        model.tie_weights()


def latest_or_given(run_or_checkpoint: Path) -> Path:
    """A checkpoint directory: the path itself, or the newest checkpoint of a run directory."""
    path = Path(run_or_checkpoint)
    if (path / "trainer_state.pt").is_file():
        return path
    found = list_checkpoints(path)
    if not found:
        raise ConfigError(
            f"{path} is neither a checkpoint (no trainer_state.pt) nor a run directory with checkpoints/step-*"
        )
    return found[-1]


def export_checkpoint(run_or_checkpoint: Path, out: Path) -> Path:
    """Write a consolidated HF directory (safetensors + config + tokenizer) of a checkpoint.

    Sharded (FSDP2) checkpoints are gathered from ``dcp/`` in this one process, whatever the world
    size that wrote them; others already hold an HF directory (``model/``), which is copied. A
    checkpoint that cannot be resumed (no weights, non-finite weights) is not exported either.
    """
    from ..model.lora import is_adapter_dir

    path = latest_or_given(run_or_checkpoint)
    problem = None if is_adapter_dir(path / "model") else checkpoint_problem(path)
    if problem is not None:  # a weightless or non-finite export would look like a model
        raise ConfigError(
            f"cannot export checkpoint {path}: {problem}; export another checkpoint of the run "
            "(lmforge export RUN_DIR/checkpoints/step-N)"
        )
    out = Path(out)
    _check_replaceable(out)

    def write(tmp: Path) -> None:
        if is_adapter_dir(path / "model"):
            _export_merged_lora(path, tmp)
            return
        if not (path / "dcp").is_dir():
            shutil.copytree(path / "model", tmp, dirs_exist_ok=True)
            return
        import json
        import tempfile

        from safetensors.torch import save_file
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as scratch:
            dcp_to_torch_save(str(path / "dcp"), f"{scratch}/full.pt")
            state = torch.load(f"{scratch}/full.pt", map_location="cpu", weights_only=False)["model"]
        weights = {k.removeprefix("policy."): v.contiguous() for k, v in state.items() if k.startswith("policy.")}
        config = json.loads((path / "model" / "config.json").read_text())
        if config.get("tie_word_embeddings"):
            weights.pop("lm_head.weight", None)
        shutil.copytree(path / "model", tmp, dirs_exist_ok=True)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        extras = {k: v for k, v in state.items() if not k.startswith("policy.")}
        if extras:  # e.g. PPO's value head
            torch.save(extras, tmp / "extra_modules.pt")

    return _write_dir(out, write)


def _check_replaceable(out: Path) -> None:
    """An export replaces its target whole: only a new or empty directory, or a model directory (an
    earlier export), may be replaced; never a file or a directory of other things."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a directory to create (or an earlier export to replace)")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise ConfigError(
            f"--out {out} is a directory that holds other things (no config.json): an export replaces "
            "its target whole, so it is left alone; give a new or empty directory, or an earlier export"
        )


def _export_merged_lora(path: Path, out: Path) -> None:
    """A LoRA checkpoint as a merged HF directory: the base model named by the run's ``config.yaml``
    (``model`` section), its adapters loaded from the checkpoint, ``W + scale * B A`` written."""
    import yaml

    from ..core.config import ModelConfig, _build
    from ..model.load import load_model
    from ..model.lora import apply_lora, load_adapter_weights

    run_config = path.parent.parent / "config.yaml"
    if not run_config.is_file():
        raise ConfigError(
            f"{path} holds LoRA adapters; merging them needs the base model named in the run's "
            f"config ({run_config}), which is missing"
        )
    values = yaml.safe_load(run_config.read_text()) or {}
    model_cfg = _build(ModelConfig, values.get("model") or {}, "model.")
    model, tokenizer = load_model(model_cfg)
    model = apply_lora(model, model_cfg.lora)
    load_adapter_weights(model, path / "model")
    save_merged(model, tokenizer, out)
