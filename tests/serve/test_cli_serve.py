"""``lmforge serve tiny:llama`` as a user starts it: a subprocess that answers, and on SIGINT (Ctrl-C) or
SIGTERM (what docker and systemd send) lets the request in flight finish, then exits with status 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_cli_serve_answers_and_shuts_down_cleanly(tmp_path, stop):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "serve.log", "w+")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lmforge.cli",
            "serve",
            "tiny:llama",
            "--port",
            str(port),
            "--threads",
            "1",
            "--log-level",
            "warning",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, f"the server exited: {(tmp_path / 'serve.log').read_text()}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not answer within 120 s"
            time.sleep(0.2)
        assert httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"] == "tiny:llama"

        result = {}

        def long_request():
            result["response"] = httpx.post(
                url + "/v1/completions",
                timeout=120,
                json={"prompt": [1, 5], "max_tokens": 500, "temperature": 1.0, "n": 4, "ignore_eos": True},
            )

        client = threading.Thread(target=long_request)
        client.start()
        while httpx.get(url + "/health", timeout=10).json()["running_rows"] == 0:  # wait until it decodes
            assert client.is_alive(), "the request finished before it was seen running"
            time.sleep(0.005)
        process.send_signal(stop)
        client.join(120)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert result["response"].status_code == 200
    assert [len(c["token_ids"]) for c in result["response"].json()["choices"]] == [500] * 4  # finished in full
