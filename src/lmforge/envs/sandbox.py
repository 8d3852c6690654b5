"""A sandboxed Python tool: run model-written code in a separate, limited process.

``run_python(code, limits)`` starts this module in ``python -I -u`` in a new session with a
fresh temporary directory as its cwd, HOME and TMPDIR and a cleared environment, hands it the code on
stdin, reads its stdout and stderr (one stream, interleaved) up to ``max_output_bytes`` and counts the
rest, and removes the directory. ``python_tool`` wraps that as a typed tool function
``python(code: str) -> str`` for a ToolEnv.

Inside, the child is a supervisor that forks the process running the code and SIGKILLs it at the
wall-clock limit (the parent kills the whole process group two seconds later should the supervisor not
have answered). Linux only for what follows. Where the kernel allows it (as root; as another user
through a user namespace of its own, where unprivileged user namespaces are enabled), the supervisor
first moves into new network, mount and PID namespaces:
- network: a fresh namespace has only a loopback device, and it is down -- no connection goes anywhere;
- files: every mount is remounted read-only, nodev and nosuid, except a bind of the temporary directory;
  /dev is replaced by a tmpfs holding only null, zero, full, random and urandom;
- private files: an empty tmpfs covers each of :data:`PRIVATE_DIRS` and the user's home, with what the code
  needs inside them (the interpreter's prefixes, ``sys.path``, the temporary directory) bound back;
- processes: the code runs as PID 1 of its own PID namespace with a fresh /proc, so it sees no other
  process, and everything it starts dies with it; in a session of its own, so that kill(0) does not reach
  the supervisor (the code dies with the supervisor, PR_SET_PDEATHSIG, in both modes).
The code process then drops every capability (and the bounding set, with no_new_privs), so it cannot
undo the mounts, mount anything, or enter another namespace; and it runs under RLIMIT_CPU, RLIMIT_AS,
RLIMIT_FSIZE and RLIMIT_CORE = 0.

Where namespaces are not available (a kernel or container that forbids unshare, or ``namespaces=False``),
the code process installs an audit hook that refuses writes outside the directory, reading the private
directories, sockets other than AF_UNIX pairs, and starting processes -- a best effort: code can get
around an in-process hook (ctypes, interpreter internals). Each result says which protection was in
force and why (``isolation``).
docs/environments.md, "The sandboxed Python tool", lists what this does and does not guard against.
"""

from __future__ import annotations

import builtins
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..core.errors import ConfigError


@dataclass(frozen=True)
class SandboxLimits:
    """Limits for one run of sandboxed code."""

    wall_s: float = 6.0  # wall-clock seconds before the whole process group is killed; with the
    # start (~0.3 s) and the backstop (2 s) below env.tool_timeout_s (10 s)
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU, SIGKILL when used up)
    memory_mb: int = 512  # address space (RLIMIT_AS); Python raises MemoryError past it
    file_size_mb: int = 16  # largest file the code may write (RLIMIT_FSIZE)
    max_output_bytes: int = 8192  # stdout + stderr kept; the rest is counted, not kept
    namespaces: bool = True  # False: skip the namespaces, use the audit-hook fallback

    def __post_init__(self):
        for name in ("wall_s", "cpu_s", "memory_mb", "file_size_mb", "max_output_bytes"):
            value = getattr(self, name)
            kinds = (int, float) if name == "wall_s" else (int,)  # rlimits are whole numbers
            if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
                kind = "number" if name == "wall_s" else "whole number"
                raise ConfigError(f"sandbox limit {name} must be a positive {kind}, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    output: str  # stdout and stderr interleaved, the first max_output_bytes bytes
    truncated_bytes: int  # bytes of output past the cap (read and dropped)
    exit_code: int | None  # the code's exit status; None when killed by a signal or the clock
    signal: str | None  # e.g. "SIGKILL" when a signal ended the code
    timed_out: bool  # the wall-clock limit killed it
    cpu_limit: bool  # it used its whole CPU-time limit
    cpu_s: float | None  # CPU seconds the code used (None if the supervisor did not report)
    wall_s: float
    isolation: dict = field(default_factory=dict)  # {"network": ..., "files": ..., "processes": ...}


# The child runs this module as __main__; -I (isolated) ignores PYTHONPATH, so name lmforge's location.
_BOOT = (
    f"import sys, runpy; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r}); "
    f"runpy.run_module({__name__!r}, run_name='__main__', alter_sys=True)"
)
_BACKSTOP_S = 2.0  # extra seconds the parent waits for the supervisor before killing its process group


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` in the sandbox; always returns (errors in the code are in ``output``)."""
    if not isinstance(code, str):
        raise ConfigError(f"run_python: code must be a string, got {type(code).__name__}")
    work = tempfile.mkdtemp(prefix="lmforge-sandbox-")
    status_read, status_write = os.pipe()
    start = time.monotonic()
    proc = None
    try:
        env = {"HOME": work, "TMPDIR": work, "PATH": os.defpath, "LC_ALL": "C.UTF-8"}
        config = {"code": code, "work": work, "status_fd": status_write, **asdict(limits)}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-u", "-c", _BOOT],
            cwd=work,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=(status_write,),
            start_new_session=True,
        )
        os.close(status_write)
        status_write = -1
        try:
            proc.stdin.write(json.dumps(config).encode("utf-8"))
            proc.stdin.close()
        except BrokenPipeError:  # the child died before reading (reported through its exit below)
            pass
        # The supervisor kills the code at wall_s; this deadline is the backstop should it fail to.
        deadline = start + limits.wall_s + _BACKSTOP_S
        kept, dropped, backstop = _read_capped(proc, deadline, limits.max_output_bytes)
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            backstop = True
        _kill_group(proc)
        proc.wait()
        status = _read_status(status_read)
    finally:
        if proc is not None and proc.returncode is None:  # interrupted: leave nothing running
            _kill_group(proc)
            proc.wait()
        if status_write >= 0:
            os.close(status_write)
        os.close(status_read)
        shutil.rmtree(work, onerror=_force_remove)
    final = status.get("final", {})
    cpu_s = final.get("cpu_s")
    timed_out = backstop or final.get("timed_out", False)
    return SandboxResult(
        output=kept.decode("utf-8", errors="replace"),
        truncated_bytes=dropped,
        exit_code=None if timed_out else final.get("exit_code"),
        signal=final.get("signal"),
        timed_out=timed_out,
        cpu_limit=_hit_cpu_limit(final, timed_out, limits.cpu_s),
        cpu_s=cpu_s,
        wall_s=time.monotonic() - start,
        isolation=status.get("isolation", {}),
    )


def _hit_cpu_limit(final: dict, timed_out: bool, cpu_limit_s: int) -> bool:
    """Killed by the kernel's RLIMIT_CPU signals after using (nearly: rusage and the limit are measured
    differently, and a loaded machine showed 0.94 s at a 1 s limit) all of it."""
    cpu_s = final.get("cpu_s")
    return (
        not timed_out
        and final.get("signal") in ("SIGKILL", "SIGXCPU")
        and cpu_s is not None
        and cpu_s >= 0.8 * cpu_limit_s
    )


def _read_capped(proc, deadline: float, cap: int) -> tuple[bytes, int, bool]:
    """Read proc.stdout until EOF or ``deadline``: (first ``cap`` bytes, bytes dropped, timed out)."""
    kept, dropped = bytearray(), 0
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(kept), dropped, True
            if not sel.select(timeout=min(left, 0.5)):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                return bytes(kept), dropped, False
            room = cap - len(kept)
            kept += chunk[:room]
            dropped += max(0, len(chunk) - room)


def _kill_group(proc) -> None:
    """SIGKILL the child's process group (the child and whatever it started that stayed in the group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass
    if not proc.stdout.closed:
        proc.stdout.close()


def _read_status(fd: int) -> dict:
    """The supervisor's status lines: {"isolation": ...} before the code runs, {"final": ...} after."""
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    status = {}
    for line in data.decode("utf-8", errors="replace").splitlines():
        if line.strip():
            status.update(json.loads(line))
    return status


def _force_remove(func, path, exc_info) -> None:
    """rmtree's error handler: code may leave a directory without write permission; allow and retry."""
    os.chmod(os.path.dirname(path), 0o700)
    func(path)


# ---------------------------------------------------------------------------------------------------
# The tool function
# ---------------------------------------------------------------------------------------------------


def python_tool(limits: SandboxLimits = SandboxLimits()):
    """A tool function ``python(code: str) -> str`` that runs code under ``limits``, for a ToolEnv."""

    def python(code: str) -> str:
        """Run Python code in a sandbox and return what it printed. Nothing persists between calls.

        Args:
            code: a complete Python program; print the values you want to see
        """
        return describe(run_python(code, limits), limits)

    return python


def describe(result: SandboxResult, limits: SandboxLimits) -> str:
    """The text a model reads for ``result``: the output, then a bracketed line for each limit hit."""
    notes = []
    if result.truncated_bytes:
        notes.append(f"[output truncated: {result.truncated_bytes} more bytes]")
    if result.timed_out:
        notes.append(f"[killed: wall-clock limit of {limits.wall_s:g} s]")
    elif result.cpu_limit:
        notes.append(f"[killed: CPU-time limit of {limits.cpu_s} s]")
    elif result.signal:
        notes.append(f"[killed by {result.signal}]")
    elif result.exit_code:
        notes.append(f"[exit code {result.exit_code}]")
    elif result.exit_code is None:  # no signal, no exit code: the supervisor never reported
        notes.append("[ended without an exit status: the sandbox's supervisor was stopped]")
    return "\n".join([result.output.rstrip("\n"), *notes]).strip("\n")


python = python_tool()


# ---------------------------------------------------------------------------------------------------
# The child: supervisor, isolation, the code process
# ---------------------------------------------------------------------------------------------------


def _child_main() -> None:
    config = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    null = os.open(os.devnull, os.O_RDONLY)  # the code reads an empty stdin (input() raises EOFError)
    os.dup2(null, 0)
    os.close(null)
    status = os.fdopen(config["status_fd"], "w")
    isolation = _isolate(config["work"]) if config["namespaces"] else _no_namespaces("namespaces=False")
    pid = os.fork()
    if pid == 0:  # the code process
        status.write(json.dumps({"isolation": _enter_code_process(isolation, config)}) + "\n")
        status.close()
        _run_code(config["code"])
    final = _supervise(pid, config["wall_s"])
    status.write(json.dumps({"final": final}) + "\n")
    status.close()
    os._exit(0)


def _supervise(pid: int, wall_s: float) -> dict:
    """Wait for the code process, SIGKILL it at ``wall_s`` (its own unreaped child: no pid-reuse race;
    as PID 1 of its namespace, everything it started dies with it); its exit, signal and CPU time."""
    deadline = time.monotonic() + wall_s
    timed_out = False
    while True:
        done, wait_status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if not timed_out and time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
            timed_out = True
        time.sleep(0.005)
    sig = os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else None
    return {
        "exit_code": os.WEXITSTATUS(wait_status) if os.WIFEXITED(wait_status) else None,
        "signal": signal.Signals(sig).name if sig else None,
        "timed_out": timed_out,
        "cpu_s": usage.ru_utime + usage.ru_stime,
    }


def _no_namespaces(reason: str) -> dict:
    return {
        "network": f"audit hook (best effort): {reason}",
        "files": f"audit hook (best effort): {reason}",
        "processes": f"audit hook refuses new processes (best effort): {reason}",
        "private": f"audit hook refuses reading private directories (best effort): {reason}",
    }


# Directories of private files (every user's home, runtime sockets and keys, mounted secrets) that the code
# must not read; the home of the user running lmforge is added wherever it is (docs/environments.md).
PRIVATE_DIRS = ("/root", "/home", "/run/user", "/run/secrets")


def _inside(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip(os.sep) + os.sep)


def _private_dirs(work: str) -> tuple[list[str], list[str]]:
    """(the private directories to hide, the paths inside them the code needs: the interpreter's
    prefixes, ``sys.path`` -- lmforge's own directory included -- and ``work``). A private directory
    that lies inside one of those (an interpreter installed as /home/me) cannot be hidden: left out."""
    import pwd

    try:
        home = pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:  # a uid without a passwd entry
        home = None
    private = {os.path.realpath(d) for d in (*PRIVATE_DIRS, home) if d and os.path.isdir(d)} - {"/"}
    needed = {
        os.path.realpath(p)
        for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path, work)
        if os.path.exists(p)
    }
    private = {d for d in private if not any(_inside(d, n) for n in needed)}
    hide = sorted(d for d in private if not any(d != e and _inside(d, e) for e in private))
    keep = sorted(
        n for n in needed if any(_inside(n, d) for d in hide) and not any(n != m and _inside(n, m) for m in needed)
    )
    return hide, keep


def _hide_private(work: str) -> str:
    """Mount an empty tmpfs over each private directory (read-only once ``_read_only_except`` has run),
    then bind back the paths inside them that the code needs, opened before they were hidden."""
    hide, keep = _private_dirs(work)
    handles = {path: os.open(path, os.O_PATH) for path in keep}
    try:
        for top in hide:
            _mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        for path, fd in handles.items():
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(path, exist_ok=True)
            else:  # a file (a zipped standard library): a file to bind it onto
                os.makedirs(os.path.dirname(path), exist_ok=True)
                open(path, "w").close()
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
    finally:
        for fd in handles.values():
            os.close(fd)
    text = f"empty read-only tmpfs over {', '.join(hide) or 'nothing (none found)'}"
    return text + (f"; bound back read-only: {', '.join(keep)}" if keep else "")


def _isolate(work: str) -> dict:
    """Move this process into new namespaces (applies to its children) and lock the file system down;
    what could not be done falls back to the audit hook, with the reason."""
    uid, gid = os.geteuid(), os.getegid()
    try:  # not root: a user namespace of our own gives the capabilities the others need
        _unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID | (CLONE_NEWUSER if uid else 0))
        if uid:  # map our ids to themselves, the one mapping an unprivileged process may write
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
    except (OSError, AttributeError) as exc:  # AttributeError: a libc without unshare (not Linux)
        reason = "unshare failed" + (" (unprivileged user namespaces may be disabled)" if uid else "")
        return _no_namespaces(f"{reason}: {exc}")
    isolation = {
        "network": "new network namespace (no interfaces up)",
        "processes": "new PID namespace, fresh /proc, no capabilities",
    }
    try:
        _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted below reaches the host's namespace
        isolation["private"] = _hide_private(work)
    except OSError as exc:
        isolation["private"] = f"audit hook (best effort): empty mounts failed ({exc})"
    try:
        _read_only_except(work)
        isolation["files"] = "read-only, nodev mounts except the temporary directory"
    except OSError as exc:
        isolation["files"] = f"audit hook (best effort): read-only mounts failed ({exc})"
    return isolation


def _enter_code_process(isolation: dict, config: dict) -> dict:
    """In the code process: fresh /proc, capabilities dropped, rlimits set, audit hook where needed."""
    import resource

    os.chdir(config["work"])  # the cwd inherited from Popen is the directory under the new bind mount
    if isolation["processes"].startswith("new PID"):
        os.setsid()  # out of the supervisor's process group, so kill(0) cannot reach the supervisor
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
        except OSError as exc:
            isolation["processes"] = f"new PID namespace, host /proc read-only ({exc}), no capabilities"
    if sys.platform == "linux":
        _check(_libc().prctl(1, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")  # dies with the supervisor
        if _has_capabilities():  # root, or the owner of a new user namespace
            _drop_capabilities()
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (config["cpu_s"],) * 2)  # SIGKILL at the hard limit
    resource.setrlimit(resource.RLIMIT_AS, (config["memory_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (config["file_size_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    hooked = {key for key, how in isolation.items() if how.startswith("audit hook")}
    if hooked:
        sys.addaudithook(_audit_hook(config["work"], hooked))
    return isolation


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PATH_EVENTS = {
    "os.remove",
    "os.rename",
    "os.mkdir",
    "os.rmdir",
    "os.chmod",
    "os.chown",
    "os.symlink",
    "os.link",
    "os.truncate",
    "os.utime",
    "os.setxattr",
    "os.removexattr",
    "shutil.rmtree",
    "shutil.copyfile",
    "shutil.move",
}  # os.mkfifo and os.mknod raise no audit event
_PROCESS_EVENTS = {
    "subprocess.Popen",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "pty.spawn",
    "ctypes.dlopen",
}


def _audit_hook(work: str, hooked: set[str]):
    """An audit hook refusing, per ``hooked`` area: writes outside ``work`` ("files"), sockets other than
    AF_UNIX ("network"), new processes, signals to other processes and loading C libraries through ctypes
    ("processes"). Signals matter most: without a PID namespace ``os.kill(-1, SIGKILL)`` reaches every
    process of the user (as root, every process on the machine)."""
    import socket

    root = os.path.realpath(work)
    me = os.getpid()  # fork is refused too, so this stays the code's only pid
    hide, keep = _private_dirs(work) if "private" in hooked else ([], [])

    def private(path) -> bool:
        if isinstance(path, int):
            return False
        real = os.path.realpath(os.fsdecode(path))
        return any(_inside(real, d) for d in hide) and not any(_inside(real, k) for k in keep)

    def outside(path) -> bool:
        if isinstance(path, int):  # an open file descriptor
            return False
        real = os.path.realpath(os.fsdecode(path))
        return real != root and not real.startswith(root + os.sep)

    def hook(event: str, args: tuple) -> None:
        if "files" in hooked:
            if (
                event == "open"
                and args[0] is not None
                and ((isinstance(args[1], str) and set(args[1]) & set("wax+")) or (args[2] or 0) & _WRITE_FLAGS)
                and outside(args[0])
            ):
                raise PermissionError(f"sandbox: writing outside the working directory is refused: {args[0]}")
            if event in _PATH_EVENTS and any(outside(a) for a in args[:2] if isinstance(a, (str, bytes))):
                raise PermissionError(f"sandbox: {event} outside the working directory is refused")
        if (
            "private" in hooked
            and event in ("open", "os.listdir", "os.scandir")
            and args[0] is not None
            and private(args[0])
        ):
            raise PermissionError(f"sandbox: reading a private directory is refused: {args[0]}")
        if "network" in hooked and event == "socket.__new__" and args[1] != socket.AF_UNIX:
            raise PermissionError("sandbox: network access is refused")
        if "processes" in hooked and event in _PROCESS_EVENTS:
            raise PermissionError(f"sandbox: {event} is refused")
        if "processes" in hooked and (event == "os.killpg" or (event == "os.kill" and args[0] != me)):
            raise PermissionError(f"sandbox: signalling another process is refused ({event}{args})")

    return hook


def _run_code(code: str) -> None:
    """Run ``code`` as ``__main__`` and exit like ``python -c`` would (traceback without this frame)."""
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    exit_code = 0
    try:
        exec(compile(code, "<code>", "exec"), namespace)
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException as exc:  # noqa: BLE001 - the code's own error: shown to the model, like python -c does
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        exit_code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


# ---------------------------------------------------------------------------------------------------
# Linux system calls through ctypes (Python 3.11 has no os.unshare, no mount)
# ---------------------------------------------------------------------------------------------------

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE, MS_STRICTATIME = (
    1,
    2,
    4,
    8,
    32,
    4096,
    16384,
    1 << 18,
    1 << 24,
)
# Per-mount flags a bind remount must repeat (the kernel refuses to clear some of them).
_KEPT_FLAGS = {"noexec": MS_NOEXEC, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
MNT_DETACH = 2
_DEVICES = ("null", "zero", "full", "random", "urandom")


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        import ctypes

        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _unshare(flags: int) -> None:
    _check(_libc().unshare(flags), "unshare")


def _mount(source: str | None, target: str, fstype: str | None, flags: int) -> None:
    def enc(s):
        return None if s is None else s.encode()

    _check(_libc().mount(enc(source), enc(target), enc(fstype), flags, None), f"mount {target}")


def _umount(target: str) -> None:
    _check(_libc().umount2(target.encode(), MNT_DETACH), f"umount {target}")


def _private_dev(work: str) -> None:
    """Replace /dev by a read-only tmpfs holding only the harmless devices: the host's nodes are bound
    into the work dir (hidden under a tmpfs there), then into the new /dev."""
    _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV)
    for name in _DEVICES:
        open(os.path.join(work, name), "w").close()
        _mount(f"/dev/{name}", os.path.join(work, name), None, MS_BIND)
    _mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC)
    for name in _DEVICES:
        open(f"/dev/{name}", "w").close()
        _mount(os.path.join(work, name), f"/dev/{name}", None, MS_BIND)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"/dev/{name}")
    _umount(work)
    _mount(None, "/dev", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC)


def _read_only_except(work: str) -> None:
    """In a new mount namespace: every mount read-only, nodev, nosuid, except ``work`` (a rw bind)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _private_dev(work)
    _mount(work, work, None, MS_BIND)
    keep = {os.path.realpath(work), "/dev", *(f"/dev/{name}" for name in _DEVICES)}
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        point = fields[4].encode().decode("unicode_escape")  # mountinfo escapes spaces as \040
        if point in keep:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
        options = fields[5].split(",")
        flags |= sum(bit for opt, bit in _KEPT_FLAGS.items() if opt in options)
        if not any(opt in options for opt in ("noatime", "relatime")):  # a user namespace may not change it
            flags |= MS_STRICTATIME
        try:
            _mount(None, point, None, flags)
        except FileNotFoundError:  # hidden under the new /dev (e.g. /dev/shm): out of reach anyway
            continue
    _mount(None, work, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)


def _has_capabilities() -> bool:
    with open("/proc/self/status") as f:
        return any(line.startswith("CapEff:") and int(line.split()[1], 16) for line in f)


def _drop_capabilities() -> None:
    """Drop every capability: the bounding set (so no exec gives them back), then no_new_privs, then the
    effective / permitted / inheritable sets (capset, version 3)."""
    import ctypes

    libc = _libc()
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _check(libc.prctl(24, cap, 0, 0, 0), "prctl(PR_CAPBSET_DROP)")
    _check(libc.prctl(38, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(libc.capset(header, data), "capset")


if __name__ == "__main__":
    _child_main()
