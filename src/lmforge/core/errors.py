"""Project error types. Each carries a message a user can act on.

The command line maps them to exit codes (src/lmforge/cli.py, docs/reliability.md): an
``LmforgeError`` is the user's or the machine's to fix (exit 2); ``Interrupted`` is a signal (exit
128 + the signal's number: 130 for SIGINT, 143 for SIGTERM); anything else is a bug (exit 1, with
a traceback log).
"""

from __future__ import annotations

import errno
import os
import re
import signal
from pathlib import Path

# OSErrors that are about the machine, not lmforge, each with what it means for a user
ENVIRONMENT_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "the file system is read-only",
    errno.EIO: "an input/output error of the storage",
    errno.EFBIG: "the file is too large for the file system",
    errno.ENOTDIR: "a path component is a file",
    errno.EISDIR: "a directory is in the way",
    errno.EEXIST: "a file is in the way",
    errno.ENAMETOOLONG: "the file name is too long",
    errno.EMFILE: "too many open files",
}


class LmforgeError(Exception):
    """Base class for errors caused by user input (config, data, model specs) or the machine."""


class ConfigError(LmforgeError, ValueError):
    """A config key, value or file is invalid."""


class DataError(LmforgeError, ValueError):
    """A data file or row is malformed, missing or empty."""


class ModelLoadError(LmforgeError):
    """A model spec could not be resolved or loaded."""


class TrainingError(LmforgeError, RuntimeError):
    """Training cannot continue (for example a non-finite loss)."""


class SaveError(TrainingError):
    """Writing a checkpoint, model directory, quantized copy or export failed because of the machine
    (disk full, quota, permissions, a read-only file system); nothing was written under its name."""


class Interrupted(BaseException):
    """SIGINT / SIGTERM, raised in the main thread between operations (a BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` mistakes it for a failure to report or retry)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"received {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def environment_errno(exc: BaseException, probe: Path | None = None) -> int | None:
    """The errno of the machine problem behind ``exc`` (one of :data:`ENVIRONMENT_ERRNOS`), or None.

    Writers report a full disk in different ways: an OSError (Python), ``... (os error 28)``
    (safetensors), ``unexpected pos 576 vs 534`` (torch.save's zip writer, with no errno at all). So:
    an OSError in the chain of causes, else an OS error number or message in the text, else the
    state of ``probe``'s file system (no space left, read-only, not writable), checked while the
    failed write still holds its space.
    """
    seen, chain = set(), exc
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        if isinstance(chain, OSError) and chain.errno in ENVIRONMENT_ERRNOS:
            return chain.errno
        text = str(chain)
        if (match := re.search(r"os error (\d+)", text)) and int(match.group(1)) in ENVIRONMENT_ERRNOS:
            return int(match.group(1))
        for code in ENVIRONMENT_ERRNOS:
            if os.strerror(code) in text:
                return code
        chain = chain.__cause__ or chain.__context__
    return _probe(probe) if probe is not None else None


def _probe(path: Path) -> int | None:
    """ENOSPC / EROFS / EACCES when ``path``'s file system is full, read-only or not writable."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    if stat.f_flag & os.ST_RDONLY:
        return errno.EROFS
    if stat.f_bavail * stat.f_frsize < 1 << 20 or (stat.f_files and stat.f_favail == 0):
        return errno.ENOSPC  # under 1 MiB (or no inode) left: what made the writer fail
    if not os.access(path if path.is_dir() else path.parent, os.W_OK):
        return errno.EACCES
    return None


def describe_errno(code: int) -> str:
    return f"{ENVIRONMENT_ERRNOS[code]} ({errno.errorcode[code]})"
