"""The sandboxed Python tool: each guard is tried by code that breaks it, with the kernel namespaces
(where this machine allows them) and with the audit-hook fallback (``namespaces=False``)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from lmforge.core.errors import ConfigError
from lmforge.envs.sandbox import SandboxLimits, SandboxResult, describe, python, python_tool, run_python
from lmforge.envs.toolcalls import function_schema

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the sandbox needs fork (Linux, macOS)")

FAST = SandboxLimits(wall_s=3, cpu_s=1, memory_mb=256, file_size_mb=1, max_output_bytes=1000)
MODES = {"namespaces": FAST, "audit-hook": SandboxLimits(**{**FAST.__dict__, "namespaces": False})}


@pytest.fixture(params=list(MODES))
def limits(request):
    return MODES[request.param]


def test_normal_code_returns_its_stdout_and_stderr(limits):
    result = run_python("import sys\nprint(sum(range(10)))\nprint('note', file=sys.stderr)", limits)
    assert result.output == "45\nnote\n"
    assert (result.exit_code, result.signal, result.timed_out, result.truncated_bytes) == (0, None, False, 0)


def test_an_exception_is_shown_like_python_c(limits):
    result = run_python("x = 1\nraise ValueError('bad value')", limits)
    assert result.exit_code == 1
    assert result.output.startswith('Traceback (most recent call last):\n  File "<code>", line 2, in <module>\n')
    assert result.output.endswith("ValueError: bad value\n")


def test_fresh_directory_is_cwd_and_home_env_cleared_and_removed_after(limits, monkeypatch):
    monkeypatch.setenv("LMFORGE_SECRET_FOR_TEST", "s3cret")
    code = (
        "import os, json\nopen('note.txt', 'w').write('kept inside')\n"
        "print(json.dumps({'cwd': os.getcwd(), 'env': dict(os.environ), 'files': os.listdir('.')}))"
    )
    result = run_python(code, limits)
    seen = json.loads(result.output)
    work = Path(seen["cwd"])
    assert work.name.startswith("lmforge-sandbox-")
    assert seen["env"]["HOME"] == seen["env"]["TMPDIR"] == str(work)
    assert "LMFORGE_SECRET_FOR_TEST" not in seen["env"]
    assert seen["files"] == ["note.txt"]
    assert not work.exists()


def test_writing_outside_the_directory_is_refused(limits, tmp_path):
    target = tmp_path / "escaped.txt"
    result = run_python(f"open({str(target)!r}, 'w').write('x')", limits)
    assert result.exit_code == 1
    assert ("Read-only file system" in result.output) or (
        "writing outside the working directory is refused" in result.output
    )
    assert not target.exists()


def test_network_is_refused(limits):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # reachable from outside the sandbox
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
        result = run_python(code, limits)
    finally:
        server.close()
    assert "connected" not in result.output
    assert result.exit_code == 1
    assert ("Network is unreachable" in result.output) or ("network access is refused" in result.output)


def test_infinite_loop_is_killed_by_the_cpu_limit(limits):
    """A generous wall clock, since the machine is shared: the CPU limit must be what stops it."""
    result = run_python("while True:\n    pass", SandboxLimits(**{**limits.__dict__, "wall_s": 20}))
    assert result.cpu_limit and not result.timed_out
    assert result.signal in ("SIGKILL", "SIGXCPU")
    assert 0.8 <= result.cpu_s < 2.0


def test_sleeping_code_is_killed_by_the_wall_clock():
    limits = SandboxLimits(wall_s=1, cpu_s=5)
    result = run_python("import time\nprint('started')\ntime.sleep(60)", limits)
    assert result.timed_out and not result.cpu_limit
    assert result.exit_code is None
    assert result.output == "started\n"
    assert 1.0 <= result.wall_s < 1.0 + 2.5


def test_memory_bomb_is_stopped(limits):
    result = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(10 << 20))", limits)
    assert result.output.rstrip().endswith("MemoryError")
    assert result.exit_code == 1


def test_megabytes_of_output_are_capped(limits):
    result = run_python("import sys\nsys.stdout.write('y' * 5_000_000)", limits)
    assert result.output == "y" * 1000
    assert result.truncated_bytes == 5_000_000 - 1000
    assert result.exit_code == 0


def test_file_size_is_limited(limits):
    result = run_python("open('big.bin', 'wb').write(b'0' * (2 << 20))", limits)
    assert "File too large" in result.output


def test_namespace_mode_cannot_undo_its_mounts_or_see_host_processes():
    result = run_python(
        "import os, ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.mount(None, b'/', None, 32 | 4096, None), ctypes.get_errno())\n"  # rw remount
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        "print([l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1])",
        FAST,
    )
    if not result.isolation.get("files", "").startswith("read-only"):
        pytest.skip(f"namespaces are not available here: {result.isolation}")
    assert result.output.splitlines() == ["-1 1", "[1]", "0000000000000000"]  # EPERM, only itself, no caps


# Runs in a child process that made itself an unprivileged user (uid 1000 in a user namespace of its own,
# no capabilities), then uses the sandbox: the path a non-root user takes, with its own user namespace.
AS_NON_ROOT = r"""
import json, os, sys
from lmforge.envs import sandbox as sb
try:
    sb._unshare(sb.CLONE_NEWUSER)
    for name, text in (("setgroups", "deny"), ("uid_map", "1000 0 1"), ("gid_map", "1000 0 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    sb._drop_capabilities()
except OSError as exc:
    print(json.dumps({"skip": str(exc)}))
    sys.exit(0)
limits = sb.SandboxLimits(wall_s=5)
checks = {
    "write": f"open({sys.argv[1]!r}, 'w').write('x')",
    "network": "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
    "inside": "import os, ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
              "print(libc.mount(None, b'/', None, 32 | 4096, None), ctypes.get_errno())\n"
              "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), os.geteuid())\n"
              "open('kept.txt', 'w').write('1')\nprint(os.listdir('.'))",
}
results = {name: sb.run_python(code, limits) for name, code in checks.items()}
print(json.dumps({"euid": os.geteuid(), "isolation": results["inside"].isolation,
                  **{name: r.output for name, r in results.items()}}))
"""


def test_a_non_root_user_gets_namespaces_through_a_user_namespace(tmp_path):
    import subprocess
    import sys

    target = tmp_path / "escaped.txt"
    done = subprocess.run([sys.executable, "-c", AS_NON_ROOT, str(target)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    if "skip" in seen:
        pytest.skip(f"cannot make a user namespace here to act as a non-root user: {seen['skip']}")
    assert seen["euid"] == 1000
    assert seen["isolation"].pop("private").startswith("empty read-only tmpfs over ")
    assert seen["isolation"] == {
        "network": "new network namespace (no interfaces up)",
        "processes": "new PID namespace, fresh /proc, no capabilities",
        "files": "read-only, nodev mounts except the temporary directory",
    }
    assert "Read-only file system" in seen["write"] and not target.exists()
    assert "Network is unreachable" in seen["network"]
    assert seen["inside"].splitlines() == ["-1 1", "[1] 1000", "['kept.txt']"]  # EPERM: the mounts stay


def test_fallback_refuses_new_processes():
    result = run_python("import subprocess\nsubprocess.run(['true'])", MODES["audit-hook"])
    assert "PermissionError: sandbox: subprocess.Popen is refused" in result.output
    assert result.isolation["processes"].startswith("audit hook")


def test_fallback_refuses_changing_attributes_outside(tmp_path):
    target = tmp_path / "outside.txt"
    target.write_text("x")
    code = f"import os\nos.setxattr({str(target)!r}, 'user.lmforge', b'1')\nprint('set')"
    result = run_python(code, MODES["audit-hook"])
    assert "sandbox: os.setxattr outside the working directory is refused" in result.output
    assert "set" not in result.output.splitlines()


def test_fallback_refuses_signals_to_other_processes():
    """Without a PID namespace a signal reaches any process of the same user (kill(-1) as root: all of
    them); signal 0 only checks that it would, so this test cannot hurt anything if the guard breaks."""
    code = (
        "import os\n"
        f"for pid in ({os.getpid()}, -1):\n"
        "    try:\n        os.kill(pid, 0)\n        print('reached', pid)\n"
        "    except PermissionError as exc:\n        print(exc)\n"
        "os.kill(os.getpid(), 0)\nprint('self ok')"
    )
    result = run_python(code, MODES["audit-hook"])
    refused = "sandbox: signalling another process is refused"
    assert [line.split(" (")[0] for line in result.output.splitlines()] == [refused, refused, "self ok"]


def test_code_cannot_stop_its_supervisor(limits):
    """kill(0) signals the caller's process group; the supervisor must not be in it (with namespaces) or
    the call must be refused (fallback), so that the result still says how the code ended."""
    result = run_python(
        "import os, signal\ntry:\n    os.kill(0, signal.SIGKILL)\n"
        "except PermissionError as exc:\n    print(exc)\nprint('still here')",
        limits,
    )
    assert result.output.endswith("still here\n")
    assert (result.exit_code, result.signal) == (0, None) and result.cpu_s is not None


def test_a_result_without_status_says_so():
    result = SandboxResult(
        output="",
        truncated_bytes=0,
        exit_code=None,
        signal=None,
        timed_out=False,
        cpu_limit=False,
        cpu_s=None,
        wall_s=0.1,
    )
    assert describe(result, FAST) == "[ended without an exit status: the sandbox's supervisor was stopped]"


def test_the_python_tool_function():
    schema = function_schema(python)["function"]
    assert schema["name"] == "python"
    assert schema["parameters"]["required"] == ["code"]
    assert python("print(6 * 7)") == "42"
    tool = python_tool(SandboxLimits(wall_s=1, max_output_bytes=10))
    assert tool("print('a' * 25)") == "aaaaaaaaaa\n[output truncated: 16 more bytes]"
    assert tool("import time\ntime.sleep(30)") == "[killed: wall-clock limit of 1 s]"
    assert tool("import sys\nsys.exit(3)") == "[exit code 3]"
    assert python("input()").endswith("EOFError: EOF when reading a line\n[exit code 1]")


@pytest.mark.parametrize(
    "key, value", [("wall_s", 0), ("cpu_s", -1), ("cpu_s", 1.5), ("memory_mb", "512"), ("max_output_bytes", True)]
)
def test_bad_limits_are_config_errors(key, value):
    with pytest.raises(ConfigError, match=f"sandbox limit {key} must be a positive"):
        SandboxLimits(**{key: value})
