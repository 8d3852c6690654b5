"""``python fault_launcher.py <lmforge command and overrides>``: runs lmforge's command line with one fault
injected, for the fault table (tests/reliability/test_faults.py); also a torchrun script.

``LMFORGE_FAULT=<kind>:<step>`` picks the fault, ``LMFORGE_FAULT_RANK`` the rank that misbehaves (under
torchrun; default 0) and ``LMFORGE_FAULT_DIR`` a folder where the moment of the fault is noted (``onset``)
and where ``armed`` appears for the faults a plugin performs (fault_plugins.py: rewards, environments,
agents). Nothing here is part of lmforge: the faults are patched in from outside, as a real stall, kill
or full disk would hit an unmodified run.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path

KIND, _, STEP = os.environ.get("LMFORGE_FAULT", "none:0").partition(":")
STEP = int(STEP or 0)
FOLDER = Path(os.environ.get("LMFORGE_FAULT_DIR", "."))
FOREVER_S = 3600.0
PLUGIN_FAULTS = {"reward_hang", "reward_worker_dies", "env_hang", "agent_hang"}


def onset() -> None:
    with open(FOLDER / "onset", "a") as out:
        out.write(f"{time.time()}\n")


def my_rank() -> bool:
    return os.environ.get("RANK", "0") == os.environ.get("LMFORGE_FAULT_RANK", "0")


def at_step(state, step: int) -> None:
    """The faults that strike when step ``step`` begins."""
    if step != STEP or not my_rank():
        return
    if KIND in PLUGIN_FAULTS:
        (FOLDER / "armed").touch()
    elif KIND in ("kill9", "rank_dies"):
        onset()
        os.kill(os.getpid(), signal.SIGKILL)
    elif KIND == "stall":
        onset()
        time.sleep(FOREVER_S)
    elif KIND == "sigterm":  # from inside the model's forward: mid-step

        def hook(*_):
            handle.remove()
            onset()
            os.kill(os.getpid(), signal.SIGTERM)

        handle = state.model.register_forward_hook(hook)
    elif KIND == "nan":
        import torch

        with torch.no_grad():
            next(state.model.parameters()).fill_(float("nan"))
        onset()


def patch() -> None:
    import torch

    from lmforge.parallel.context import ParallelContext
    from lmforge.runtime import loop

    real_loop, real_save, real_mark = loop.train_loop, torch.save, ParallelContext.mark

    def train_loop(state, trainer):
        real_step = trainer.step

        def step(n: int):
            at_step(state, n)
            return real_step(n)

        trainer.step = step
        return real_loop(state, trainer)

    def save(obj, f, *args, **kwargs):
        if f"step-{STEP:06d}" in str(f) and KIND == "enospc":
            onset()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        if f"step-{STEP:06d}" in str(f) and KIND == "sigterm_save":
            onset()
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save(obj, f, *args, **kwargs)

    def mark(self, phase: str) -> None:
        if KIND == "stall_barrier" and phase == f"the checkpoint barrier at step {STEP}" and my_rank():
            onset()
            time.sleep(FOREVER_S)  # stuck before the barrier (e.g. writing its shards)
        real_mark(self, phase)

    loop.train_loop, torch.save, ParallelContext.mark = train_loop, save, mark


if __name__ == "__main__":
    patch()
    from lmforge.cli import main

    sys.exit(main(sys.argv[1:]))
