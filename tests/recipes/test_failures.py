"""Failures that are not lmforge's (issue 22): a save the machine refuses, a signal, a model directory
without weights. Each ends with one clear message and its documented exit code (docs/reliability.md),
nothing half-written, the previous checkpoint intact and the run lock released."""

from __future__ import annotations

import errno
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_records import SFT, TINY, sft, train_records
from safetensors import SafetensorError

from lmforge.cli import main
from lmforge.core import errors
from lmforge.core.errors import Interrupted
from lmforge.parallel.context import install_signal_handlers, restore_signal_handlers
from lmforge.runtime import checkpoint as ckpt
from lmforge.runtime.run import LOCK_NAME


def leftovers(run: Path) -> list[str]:
    """Temporary, replaced or half-deleted directories anywhere in a run directory."""
    return [str(p) for p in run.rglob("*") if any(tag in p.name for tag in (".tmp-", ".old-", ".deleting-"))]


# ----------------------------------------------------------------------------- a save the machine refuses


def _disk_full_torch_save(*args, **kwargs):
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")  # torch's words


SAVE_FAILURES = [  # (what raises, where, exception, probe says, exit code, message fragment)
    (
        "save_model",
        "step-000004",
        OSError(errno.ENOSPC, "No space left on device"),
        None,
        2,
        r"disk full while writing \S*step-000004",
    ),
    (
        "save_model",
        "step-000004",
        SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
        None,
        2,
        r"disk full while writing \S*step-000004",
    ),
    ("save_model", "step-000004", OSError(errno.EDQUOT, "Disk quota exceeded"), None, 2, "disk quota exceeded while"),
    (
        "save_model",
        "step-000004",
        PermissionError(errno.EACCES, "Permission denied"),
        None,
        2,
        r"could not write \S*step-000004: permission denied \(EACCES\)",
    ),
    (
        "save_model",
        "final",
        OSError(errno.EROFS, "Read-only file system"),
        None,
        2,
        r"could not write \S*final: the file system is read-only \(EROFS\)",
    ),
    ("torch.save", "step-000004", None, errno.ENOSPC, 2, r"disk full while writing \S*step-000004 \(RuntimeError"),
    (
        "save_model",
        "step-000004",
        RuntimeError("a bug in a writer"),
        None,
        1,
        r"internal error: RuntimeError: a bug in a writer\n  while writing \S*step-000004",
    ),
]


@pytest.mark.parametrize(
    "target,where,exc,probe,code,message",
    SAVE_FAILURES,
    ids=[f"{c[0]}-{c[1]}-{type(c[2]).__name__ if c[2] else 'probe'}" for c in SAVE_FAILURES],
)
def test_a_failed_save_is_reported_with_its_cause_and_leaves_nothing_half_written(
    tmp_path, monkeypatch, capsys, target, where, exc, probe, code, message
):
    """Any exception while a checkpoint or final/ is written: the machine's (disk full, quota,
    permissions, read-only: exit 2) or not (exit 1, a bug, with the path in the note). Either way the
    temporary directory is gone, the earlier checkpoint intact and the lock released. Before: only an
    OSError was caught, a SafetensorError or torch's RuntimeError was 'a bug in lmforge' and left
    ``.step-000004.tmp-PID`` behind."""
    import torch

    real_save_model, real_torch_save = ckpt.save_model, torch.save

    def failing(*args, **kwargs):
        path = str(args[2] if target == "save_model" else args[1])
        if where in path:
            if exc is None:
                _disk_full_torch_save()
            raise exc
        return (real_save_model if target == "save_model" else real_torch_save)(*args, **kwargs)

    if target == "save_model":
        monkeypatch.setattr(ckpt, "save_model", failing)
    else:
        monkeypatch.setattr(ckpt.torch, "save", failing)
    monkeypatch.setattr(errors, "_probe", lambda path: probe)  # what the file system would say
    out = tmp_path / "run"
    args = ["sft", *SFT, f"train.output_dir={out}", "train.max_steps=4", "train.save_every=2", "train.keep_last=5"]
    assert main(args) == code
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert "last checkpoint is intact" in err or code == 1
    assert leftovers(out) == []
    assert ckpt.checkpoint_problem(out / "checkpoints" / "step-000002") is None
    assert not (out / LOCK_NAME).exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 600 KiB tmpfs (room for about two checkpoints of the tiny model); skipped where mount is not
    allowed (the patched writers above cover the same paths)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()})")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_real_full_disk_stops_the_run_with_exit_2_and_the_checkpoints_resume(small_disk, tmp_path, capsys):
    """The disk fills up during the run (whichever writer meets it first: safetensors, torch.save,
    the metrics log): exit 2 naming the cause, no temporary directory, every checkpoint left complete,
    and the run resumes from the newest one once there is room."""
    out = small_disk / "run"
    args = ["sft", *SFT, f"train.output_dir={out}", "train.max_steps=12", "train.save_every=1", "train.keep_last=12"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "disk full while writing" in err or "no space left on the device (ENOSPC)" in err, err
    assert "internal error" not in err
    assert leftovers(out) == []
    found = ckpt.list_checkpoints(out)
    assert found and all(ckpt.checkpoint_problem(p) is None for p in found)
    assert not (out / LOCK_NAME).exists()
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    step = int(found[-1].name.split("-")[1])
    sft(moved, f"train.max_steps={step + 1}", "train.resume=auto")
    assert max(r["step"] for r in train_records(moved)) == step + 1


# ----------------------------------------------------------------------------- signals


def _run_until_first_checkpoint(out: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lmforge",
            "sft",
            *SFT,
            "train.max_steps=100000",
            "train.save_every=1",
            "train.keep_last=2",
            f"train.output_dir={out}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 180
    while not ckpt.list_checkpoints(out) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert ckpt.list_checkpoints(out), proc.stderr.read() if proc.poll() is not None else "no checkpoint in 180 s"
    return proc


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)])
def test_a_signal_stops_a_single_process_run_cleanly_and_it_resumes(tmp_path, sig, code):
    """``python -m lmforge sft`` signalled after its first checkpoint: exit 128 + the signal, one line
    saying so, no traceback, the lock released, nothing half-written, and train.resume=auto goes on.
    Before: SIGTERM killed the process (-15), silently, and left the run lock behind."""
    out = tmp_path / "run"
    proc = _run_until_first_checkpoint(out)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    assert f"stopped by {sig.name}" in err and "completed checkpoints are intact" in err
    assert "Traceback" not in err, err[-3000:]
    assert not (out / LOCK_NAME).exists()
    assert leftovers(out) == []
    found = ckpt.list_checkpoints(out)
    assert all(ckpt.checkpoint_problem(p) is None for p in found)
    step = int(found[-1].name.split("-")[1])
    sft(out, f"train.max_steps={step + 1}", "train.save_every=1", "train.keep_last=2", "train.resume=auto")
    assert max(r["step"] for r in train_records(out)) == step + 1


def test_a_signal_during_the_renames_of_a_save_waits_until_they_are_done(tmp_path):
    """_commit's renames (old aside, new in place, old deleted) happen together: a SIGTERM among them
    is raised once they are done, never between them (which would leave neither directory in place)."""
    previous = install_signal_handlers()
    try:
        final = tmp_path / "best"
        final.mkdir()
        (final / "old").write_text("old")
        tmp = tmp_path / ".best.tmp"
        tmp.mkdir()
        (tmp / "new").write_text("new")
        real_rename, seen = Path.rename, []

        def rename(self, target):
            if not seen:  # the first rename: the signal arrives here
                seen.append(1)
                signal.raise_signal(signal.SIGTERM)
            return real_rename(self, target)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Path, "rename", rename)
            with pytest.raises(Interrupted) as info:
                ckpt._commit(tmp, final)
        assert info.value.exit_code == 143
        assert sorted(p.name for p in tmp_path.iterdir()) == ["best"] and (final / "new").is_file()
    finally:
        restore_signal_handlers(previous)


def test_a_signal_during_the_deletion_of_an_old_checkpoint_waits_until_it_is_gone(tmp_path):
    """keep_last's deletion (rename aside, then delete) finishes before a SIGINT among it is raised: a run
    it stops leaves no ``.deleting`` directory. Before, the signal broke into the delete (seen in CI: the
    SIGINT case of test_a_signal_stops_a_single_process_run_cleanly_and_it_resumes)."""
    previous = install_signal_handlers()
    try:
        old = tmp_path / "checkpoints" / "step-000001"
        (old / "model").mkdir(parents=True)
        (old / "model" / "weights.bin").write_bytes(b"0" * 1024)
        real_rmtree = shutil.rmtree

        def rmtree(path, ignore_errors=False):
            signal.raise_signal(signal.SIGINT)  # the handler runs before the deletion starts
            real_rmtree(path, ignore_errors=ignore_errors)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ckpt.shutil, "rmtree", rmtree)
            with pytest.raises(Interrupted) as info:
                ckpt.remove_checkpoint(old)
        assert info.value.exit_code == 130
        assert list((tmp_path / "checkpoints").iterdir()) == []
    finally:
        restore_signal_handlers(previous)


def test_a_second_signal_while_stopping_ends_the_process_at_once(tmp_path):
    """The first SIGTERM starts a clean stop; a second one (the user insists, e.g. while a long native
    call holds the first) exits 143 at once with a line saying so, never a traceback."""
    script = (
        "import os, signal, time\nfrom lmforge.parallel.context import install_signal_handlers\n"
        "install_signal_handlers()\ntry:\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(5)\n"
        "finally:\n    os.kill(os.getpid(), signal.SIGTERM)  # during the cleanup\n    time.sleep(5)\n"
        "    print('not reached')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 143 and "not reached" not in proc.stdout
    assert "SIGTERM again: stopping now" in proc.stderr and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- models without their files


def _model_dir(tmp_path: Path) -> Path:
    out = tmp_path / "run"
    sft(out, "train.max_steps=1")
    return out / "final"


def test_model_directories_missing_files_are_named_not_blamed_on_lmforge(tmp_path, capsys):
    """A directory without weights, without a tokenizer, with an index whose shard is gone, or a file
    given where a directory is expected: exit 2, the directory and what it lacks, never 'a bug in
    lmforge' (quantize, before) nor 'install sentencepiece or tiktoken' (a load without a tokenizer)."""
    final = _model_dir(tmp_path)
    no_weights = tmp_path / "no_weights"
    shutil.copytree(final, no_weights)
    (no_weights / "model.safetensors").unlink()
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(final / "config.json", config_only)
    sharded = tmp_path / "sharded"
    shutil.copytree(final, sharded)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}'
    )
    weightless_run = tmp_path / "weightless_run"
    shutil.copytree(final.parent / "checkpoints", weightless_run / "checkpoints")
    (weightless_run / "checkpoints" / "step-000001" / "model" / "model.safetensors").unlink()
    cases = [  # (command, exit code, message fragments)
        (
            ["quantize", str(no_weights), "--format", "int8", "--out", str(tmp_path / "q1")],
            2,
            ["no_weights: not a complete model directory", "lacks its weights"],
        ),
        (
            ["sft", *SFT, f"model.name={no_weights}", f"train.output_dir={tmp_path / 'r1'}"],
            2,
            ["no_weights: not a complete model directory", "lacks its weights"],
        ),
        (
            [
                "sft",
                *[a for a in SFT if not a.startswith("model.tokenizer")],
                f"model.name={config_only}",
                f"train.output_dir={tmp_path / 'r2'}",
            ],
            2,
            ["lacks its weights", "and its tokenizer", "holds config.json"],
        ),
        (
            ["quantize", str(sharded), "--format", "int8", "--out", str(tmp_path / "q2")],
            2,
            ["lacks the weight file(s) model-00002-of-00002.safetensors named by model.safetensors.index.json"],
        ),
        (
            ["quantize", str(final / "model.safetensors"), "--format", "int8", "--out", str(tmp_path / "q3")],
            2,
            ["model.safetensors' is a file, not a model", "(here "],
        ),
        (["export", str(final / "config.json"), "--out", str(tmp_path / "e")], 2, ["neither a checkpoint"]),
        (
            ["export", str(final.parent), "--out", str(final.parent / "config.yaml")],
            2,  # replaced it, before
            ["config.yaml is a file; give a directory"],
        ),
        (
            ["export", str(final.parent), "--out", str(tmp_path)],
            2,  # deleted tmp_path, before
            ["holds other things (no config.json)"],
        ),
        (
            ["export", str(weightless_run), "--out", str(tmp_path / "e2")],
            2,  # exported a model without weights
            ["cannot export checkpoint", "step-000001: no model weights"],
        ),
        (
            [
                "quantize",
                str(final.parent / "checkpoints" / "step-000001"),
                "--format",
                "int8",
                "--out",
                str(tmp_path / "q4"),
            ],
            2,
            ["it is a checkpoint: its model is", "step-000001/model"],
        ),
        (
            ["quantize", str(final), "--format", "int8", "--out", str(final.parent / "config.yaml")],
            2,
            ["config.yaml is a file; choose a new directory"],
        ),
    ]
    for command, code, fragments in cases:
        assert main(command) == code, command
        err = capsys.readouterr().err
        for fragment in fragments:
            assert fragment in err, (command, err)
        assert "internal error" not in err and "sentencepiece" not in err, (command, err)
    assert not any((tmp_path / name).exists() for name in ("q1", "q2", "q4", "e", "e2"))
    assert (final.parent / "config.yaml").is_file() and no_weights.is_dir() and leftovers(final.parent) == []


def test_a_machine_without_what_the_config_asks_for_is_a_user_error(tmp_path, monkeypatch, capsys):
    """rollout.backend=vllm without a GPU was 'internal error ... a bug in lmforge' (a RuntimeError)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = [
        "grpo",
        *TINY,
        "data.task=addition",
        "rollout.backend=vllm",
        "rollout.num_prompts=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=4",
        "train.max_steps=1",
        "logging.progress=false",
        f"train.output_dir={tmp_path / 'run'}",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "rollout.backend=vllm needs a CUDA GPU" in err and "internal error" not in err
