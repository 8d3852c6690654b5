"""No wait without a bound (issue 37 item 6), the fast checks: a collective that timed out names the rank
that never came and its last phase; an Atropos call and a weight push end at their deadline, retries and
all, naming the call and the setting. The end-to-end rows (real runs, torchrun, resume) are the fault
table, tests/reliability/test_faults.py (slow layer)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch.distributed as dist

from lmforge.parallel import context
from lmforge.parallel.context import ParallelContext, stall_note
from lmforge.rl.sources.atropos_client import AtroposError, _request

GLOO_TIMEOUT = RuntimeError(
    "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for recv operation to complete"
)


@pytest.fixture
def two_ranks(monkeypatch):
    """This process as rank 0 of 2, with an in-memory store standing in for torchrun's."""
    store = dist.HashStore()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(context, "_store", lambda: store)
    monkeypatch.setitem(context._WHERE, "timeout_s", 8.0)
    monkeypatch.setattr(context, "_PEERS", [("host", 100), ("host", 4242)])
    return store


def test_a_timed_out_collective_names_the_rank_that_never_came_and_where_it_was(two_ranks):
    rank0, rank1 = ParallelContext(0, 2), ParallelContext(1, 2)
    rank1.mark("the collectives of training step 4")
    rank0.mark("the checkpoint barrier at step 4")
    start = time.monotonic()
    note = stall_note(GLOO_TIMEOUT, grace_s=0.3)
    assert note == (
        "rank 1 (PID 4242) did not reach the checkpoint barrier at step 4 within 8 s "
        "(parallel.timeout_s); its last mark: the collectives of training step 4"
    )
    assert 0.3 <= time.monotonic() - start < 2.0
    assert GLOO_TIMEOUT.lmforge_report is True  # rank 0 timed out, rank 1 did not: rank 0 reports


def test_no_stall_is_named_when_every_rank_timed_out_or_the_error_is_not_a_timeout(two_ranks):
    ParallelContext(0, 2).mark("the collectives of training step 2")
    assert stall_note(RuntimeError("Connection closed by peer [127.0.0.1]:1234"), grace_s=0.2) == ""
    two_ranks.set("lmforge/timed-out/1", "the collectives of training step 2")  # rank 1 waited too
    assert stall_note(RuntimeError("Timed out waiting 8000ms for send"), grace_s=0.2) == ""


def test_one_process_marks_nothing_and_names_no_stall(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    ParallelContext().mark("the collectives of training step 1")  # no process group: no store to write
    assert context._WHERE["phase"] == "the collectives of training step 1"
    assert stall_note(RuntimeError("timed out")) == ""


@pytest.fixture
def silent_server():
    """An HTTP server that reads the request and never answers (a stalled API or inference server)."""
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            release.wait()

        do_POST = do_GET

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    release.set()
    httpd.shutdown()
    httpd.server_close()


def test_a_call_ends_at_its_deadline_retries_included(silent_server):
    # 30 s per attempt and 5 retries would wait over 3 minutes; the deadline ends it after 1.5 s
    start = time.monotonic()
    with pytest.raises(AtroposError, match=r"GET \S+/batch failed after 1 attempt \(last: ReadTimeout"):
        _request(
            "GET", f"{silent_server}/batch", retries=5, backoff_s=1.0, timeout=30.0, deadline=time.monotonic() + 1.5
        )
    assert 1.4 < time.monotonic() - start < 3.0


def test_a_stalled_weight_push_ends_at_push_timeout_s_naming_the_server(silent_server, tmp_path):
    import torch

    from lmforge.rl.config import RolloutConfig
    from lmforge.rl.sources.atropos import AtroposSource

    source = AtroposSource.__new__(AtroposSource)  # only the push: no run around it
    source.rollout = RolloutConfig(
        backend="atropos",
        api_url=silent_server,
        server_url=silent_server,
        api_retries=3,
        api_backoff_s=0.1,
        push_timeout_s=1.5,
    )
    start = time.monotonic()
    with pytest.raises(
        AtroposError,
        match=r"pushing weights version 3 to rollout.server_url=\S+ "
        r"\(rollout.push_timeout_s=1.5\) failed after 1 attempt "
        r"\(last: ReadTimeout.*the last checkpoint is intact",
    ):
        source._push(torch.nn.Linear(2, 2), 3)
    assert 1.4 < time.monotonic() - start < 3.0


def test_push_timeout_s_must_be_positive():
    from lmforge.core.errors import ConfigError
    from lmforge.rl.config import RolloutConfig

    with pytest.raises(ConfigError, match="push_timeout_s > 0"):
        RolloutConfig(backend="atropos", api_url="http://x", push_timeout_s=0).validate()


def test_verifiers_episodes_that_hang_end_the_step_at_verifiers_timeout_s():
    import asyncio
    import contextlib

    from lmforge.core.errors import TrainingError
    from lmforge.rl.config import RolloutConfig
    from lmforge.rl.sources.verifiers import VerifiersSource

    class Env:  # verifiers' surface the source uses: serving(), slots(), run_slot()
        @contextlib.asynccontextmanager
        async def serving(self):
            yield

        def slots(self, task, n):
            return [(task, i) for i in range(n)]

        async def run_slot(self, slot, ctx):
            if slot == ("hangs", 1):
                await asyncio.sleep(3600)
            return slot

    source = VerifiersSource.__new__(VerifiersSource)  # only the step's wait: no server, no environment
    source.env, source.ctx = Env(), None
    source.rollout = RolloutConfig(backend="verifiers", verifiers_env="x", group_size=2, verifiers_timeout_s=0.5)
    assert asyncio.run(source._run(["fine"], 1)) == [("fine", 0), ("fine", 1)]
    start = time.monotonic()
    with pytest.raises(
        TrainingError,
        match=r"1 of the 4 episodes of step 3 did not finish within "
        r"rollout.verifiers_timeout_s=0.5 s .*resume",
    ):
        asyncio.run(source._run(["fine", "hangs"], 3))
    assert time.monotonic() - start < 2.0
