"""The sandboxed Python tool keeps its own rules by default (issue 37 item 5): its wall clock ends code
before the environment call that runs it times out, so the model reads the sandbox's message; and the
code cannot read the host's private files (every home directory, the runtime and secrets directories),
with namespaces (empty mounts) and with the audit-hook fallback."""

from __future__ import annotations

import os
import pwd
import tempfile
import uuid
from pathlib import Path

import pytest

from lmforge.envs import sandbox as sb
from lmforge.envs.base import EpisodeState
from lmforge.envs.episode import env_calls
from lmforge.envs.tool_env import ToolEnv
from lmforge.envs.toolcalls import CALL_CLOSE, CALL_OPEN
from lmforge.rl.config import EnvConfig

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the sandbox needs fork (Linux, macOS)")

MODES = {"namespaces": sb.SandboxLimits(), "audit-hook": sb.SandboxLimits(namespaces=False)}


@pytest.fixture(params=list(MODES))
def limits(request):
    return MODES[request.param]


def test_the_default_limits_end_code_inside_the_default_environment_timeout():
    # even a supervisor that never answers is killed (the backstop) before the environment call is abandoned
    assert sb.SandboxLimits().wall_s + sb._BACKSTOP_S < EnvConfig().tool_timeout_s


def test_a_sleeping_tool_call_reads_the_wall_clock_message_not_an_environment_timeout():
    """The default python tool in a ToolEnv, called the way the episode runner calls an environment
    (env_calls, the default env.tool_timeout_s): the step answers, and the model reads why its code stopped."""
    env = ToolEnv([sb.python])
    state = EpisodeState(problem={"prompt": "wait"})
    reply = {
        "role": "assistant",
        "content": f'{CALL_OPEN}\n{{"name": "python", "arguments": '
        f'{{"code": "import time\\ntime.sleep(600)"}}}}\n{CALL_CLOSE}',
    }
    calls = env_calls(1, EnvConfig().tool_timeout_s)
    try:
        calls.submit("step", lambda: env.step(state, reply))
        [(_, (status, value))] = calls.poll(wait=True)
    finally:
        calls.close()
    # today's 10 s clock, when it fails: ("timeout", "timed out after 10 s (env.tool_timeout_s; call abandoned)")
    assert status == "ok", value
    [message] = value.messages
    assert message["content"] == f"[killed: wall-clock limit of {sb.SandboxLimits().wall_s:g} s]"


@pytest.fixture
def secret():
    """A file in the home directory of the user running the tests, removed afterwards."""
    home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    path = home / f".lmforge-sandbox-secret-{uuid.uuid4().hex}"
    try:
        path.write_text("the host's secret")
    except OSError as exc:
        pytest.skip(f"cannot write a file in {home}: {exc}")
    yield path
    path.unlink()


def _read(path: Path) -> str:
    return (
        f"import os\n"
        f"try:\n    print(open({str(path)!r}).read())\n"
        f"except OSError as exc:\n    print('refused', type(exc).__name__)\n"
        f"try:\n    print(sorted(os.listdir({str(path.parent)!r})))\n"
        f"except OSError as exc:\n    print('refused', type(exc).__name__)\n"
        f"import decimal, json\nopen('mine.txt', 'w').write(json.dumps(str(decimal.Decimal(1) / 4)))\n"
        f"print(open('mine.txt').read())"
    )


def test_the_code_cannot_read_the_hosts_private_files(limits, secret):
    result = sb.run_python(_read(secret), limits)
    lines = result.output.splitlines()
    assert "the host's secret" not in result.output and secret.name not in result.output, result.output
    assert lines[-1] == '"0.25"', result.output  # the standard library and its own directory still work
    if limits.namespaces and result.isolation["private"].startswith("empty"):
        assert lines[0] == "refused FileNotFoundError"  # an empty mount: the file is not there
        assert not any(name.startswith(".lmforge-sandbox-secret") for name in eval(lines[1]))  # noqa: S307 - the listing the sandbox printed
        if Path("/home").is_dir() and os.listdir("/home"):
            assert sb.run_python("import os\nprint(os.listdir('/home'))", limits).output == "[]\n"
    else:
        assert lines[:2] == ["refused PermissionError"] * 2, result.output
        assert result.isolation["private"].startswith("audit hook")


def test_a_working_directory_inside_a_private_directory_still_works(limits, secret, monkeypatch):
    """TMPDIR under the user's home: the sandbox's own directory is bound back, the rest stays hidden."""
    monkeypatch.setattr(tempfile, "tempdir", str(secret.parent))
    result = sb.run_python(_read(secret), limits)
    assert "the host's secret" not in result.output and secret.name not in result.output, result.output
    assert result.output.splitlines()[-1] == '"0.25"', result.output
    assert not any(p.name.startswith("lmforge-sandbox-") for p in secret.parent.iterdir())  # removed after
