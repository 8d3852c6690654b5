"""The fault table (issue 37 item 6, slow layer): one row per fault injected into a real ``lmforge`` run (a
process, or two gloo ranks under torchrun) on a tiny model. Each row asserts the exit code (non-zero, or 0
when the fault is absorbed as documented and counted), that the output names the phase that stalled or
failed (and the peer), the seconds from the fault to the process's exit (within the row's timeout plus
``SLACK_S``), and that ``train.resume=auto`` from the last checkpoint trains every remaining step, one
metrics line each -- bit for bit the uninterrupted run's where the row has a reference (SFT, one process
and torchrun). The table is printed at the end (docs/reliability.md, "The fault table", holds a copy).

The faults come from outside lmforge: ``fault_launcher.py`` patches them into the command line it runs
(a kill, a stall, a NaN, a full disk, SIGTERM), ``fault_plugins.py`` holds a reward, an environment and
an agent that hang or die once armed, and ``FakeAtropos`` below is an Atropos API and inference server
that resets connections, stops answering, or dies in the middle of a weight push.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from lmforge.parallel.context import free_port

HERE = Path(__file__).resolve().parent
LAUNCHER = str(HERE / "fault_launcher.py")
SLACK_S = 15.0  # exit within a row's timeout plus this (teardown, a loaded 2-core machine)
TINY = [
    "model.name=tiny:llama",
    "model.tokenizer=char",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
]
RUN = ["train.save_every=2", "train.eval_every=0", "train.log_every=1", "train.threads=1", "logging.progress=false"]
# 16 rows, 8 per update: an epoch is 2 steps, so step-2 is the checkpoint at the first epoch boundary
SFT = (
    TINY
    + RUN
    + [
        "model.max_position_embeddings=32",
        "data.task=addition",
        "data.num_train=16",
        "data.num_eval=4",
        "data.max_len=32",
        "train.batch_size=8",
        "train.micro_batch_size=4",
        "train.max_new_tokens=4",
    ]
)
GRPO = (
    TINY
    + RUN
    + [
        "model.max_position_embeddings=64",
        "data.task=addition",
        "data.num_train=64",
        "data.num_eval=0",
        "rollout.num_prompts=2",
        "rollout.group_size=4",
        "rollout.max_new_tokens=4",
        "train.micro_batch_size=4",
        "optim.lr=1e-2",
    ]
)
REWARD = ["rewards.functions=[fault_plugins:score]"]
ENV = GRPO + [
    "rewards.functions=[]",
    "env.name=fault_plugins:Echo",
    "env.max_episode_tokens=8",
    "data.use_chat_template=on",
    "env.tool_timeout_s=2",
]
AGENT = [a for a in GRPO if not a.startswith(("model.max_position", "rollout.group_size", "rollout.max_new"))] + [
    "model.max_position_embeddings=2048",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "rollout.backend=agent",
    "rollout.agent_entry=fault_plugins:agent",
    "rollout.agent_timeout_s=3",
    "data.task=multiplication:digits=2",
]
ATROPOS = GRPO + [
    "rollout.backend=atropos",
    "rollout.api_poll_s=0.01",
    "rollout.api_retries=2",
    "rollout.api_backoff_s=0.05",
    "rollout.api_timeout_s=60",
]


@dataclasses.dataclass
class Fault:
    name: str  # the table's first column
    kind: str  # LMFORGE_FAULT (fault_launcher.py / fault_plugins.py / FakeAtropos)
    step: int  # the step the fault strikes in
    args: list[str]
    code: int  # expected exit code (torchrun: its own 1 when a rank fails)
    phase: str  # a regular expression the output must match: the phase (and the peer)
    timeout_s: float = 0.0  # the bound the row exercises (seconds); the exit comes within it + SLACK_S
    recipe: str = "sft"
    ranks: int = 1
    steps: int = 4  # train.max_steps of the faulty run
    resume_from: int = 2  # the checkpoint the resume starts from
    total: int = 4  # train.max_steps of the resume
    service: str = ""  # FakeAtropos mode for the faulty run
    exact: bool = False  # the resumed steps equal the uninterrupted reference run's, bit for bit


FAULTS = [
    Fault("kill -9 at an epoch boundary", "kill9", 3, SFT, -9, r"", exact=True),
    Fault(
        "SIGTERM mid-step", "sigterm", 3, SFT, 143, r"stopped by SIGTERM; completed checkpoints are intact", exact=True
    ),
    Fault("NaN loss", "nan", 3, SFT + ["train.on_nonfinite=stop"], 2, r"(?i)non-finite.*step 3", exact=True),
    Fault("full disk during a save", "enospc", 4, SFT, 2, r"disk full while writing .*step-000004", exact=True),
    Fault("SIGTERM during a save", "sigterm_save", 4, SFT, 143, r"stopped by SIGTERM", exact=True),
    Fault(
        "corrupted checkpoint file on resume",
        "corrupt",
        4,
        SFT,
        0,  # seconds: the whole resumed run
        r"\[resume\] skipping step-000004: .*\n(.|\n)*\[resume\] from .*step-000002 at step 2",
        timeout_s=60,
        exact=True,
    ),
    # each call has its own rewards.timeout_s: 8 calls on 2 reward threads hang 4 x 2 s
    Fault(
        "a reward function that never returns",
        "reward_hang",
        3,
        GRPO + REWARD + ["rewards.timeout_s=2", "rewards.max_failure_fraction=0", "rewards.workers=2"],
        2,
        r"reward 'fault_plugins:score' failed on 8/8 samples .*timed out after 2 s \(rewards\.timeout_s",
        timeout_s=8,
        recipe="grpo",
    ),
    Fault(
        "a reward worker process killed",
        "reward_worker_dies",
        3,
        GRPO
        + [
            "rewards.functions=[{name: 'fault_plugins:score', executor: process}]",
            "rewards.timeout_s=5",
            "rewards.max_failure_fraction=0",
        ],
        2,
        r"failed on 8/8 samples .*reward worker died",
        timeout_s=5,
        recipe="grpo",
    ),
    # each call has its own env.tool_timeout_s: 8 episodes on 2 environment threads wait 4 x 2 s
    Fault(
        "an environment that hangs",
        "env_hang",
        3,
        ENV + ["env.workers=2"],
        2,
        r"no episode of this batch is usable: .*\(they ended as: timeout\).*env\.tool_timeout_s",
        timeout_s=8,
        recipe="grpo",
    ),
    Fault(
        "an agent that hangs",
        "agent_hang",
        3,
        AGENT,
        2,
        r"no agent episode of this step is usable .*\{'timeout': 4\}\); the first error: no result within "
        r"rollout\.agent_timeout_s=3 s",
        timeout_s=3,
        recipe="grpo",
    ),
    Fault(
        "Atropos API drops the connection",
        "api_reset",
        3,
        ATROPOS,
        2,
        r"GET http://\S+/batch failed after 3 attempts \(last: \w+",
        recipe="grpo",
        service="api_reset",
    ),
    Fault(
        "Atropos API stops answering",
        "api_hang",
        3,
        ATROPOS + ["rollout.api_timeout_s=5"],
        2,
        r"GET http://\S+/batch failed after \d attempts? \(last: ReadTimeout(.|\n)*rollout\.api_timeout_s=5",
        timeout_s=5,
        recipe="grpo",
        service="api_hang",
    ),
    Fault(
        "inference server killed mid-weight-push",
        "push_killed",
        3,
        ATROPOS,
        2,
        r"pushing weights version 3 to rollout\.server_url=\S+ \(rollout\.push_timeout_s=600\) failed after 3 "
        r"attempts",
        recipe="grpo",
        service="push_killed",
    ),
    Fault(
        "inference server stalls mid-weight-push",
        "push_hang",
        3,
        ATROPOS + ["rollout.push_timeout_s=4"],
        2,
        r"pushing weights version 3 .*rollout\.push_timeout_s=4\) failed after 1 attempt \(last: ReadTimeout",
        timeout_s=4,
        recipe="grpo",
        service="push_hang",
    ),
    Fault(
        "a stalled rank (sleeps in a step)",
        "stall",
        3,
        SFT + ["parallel.timeout_s=8"],
        1,
        r"\[rank 0\] stopping: rank 1 \(PID \d+\) did not reach the collectives of training step 3 within 8 s "
        r"\(parallel\.timeout_s\); its last mark: the collectives of training step 3",
        timeout_s=8,
        ranks=2,
        exact=True,
    ),
    Fault(
        "a rank stuck before the checkpoint barrier",
        "stall_barrier",
        4,
        SFT + ["parallel.timeout_s=8"],
        1,
        r"\[rank 0\] stopping: rank 1 \(PID \d+\) did not reach the checkpoint barrier at step 4 within 8 s "
        r"\(parallel\.timeout_s\); its last mark: the checkpoint save at step 4",
        timeout_s=8,
        ranks=2,
        exact=True,
    ),
    Fault(
        "a rank that dies (kill -9)",
        "rank_dies",
        3,
        SFT + ["parallel.timeout_s=8"],
        1,
        r"\[rank 0\] stop(ping: rank 1 \(PID \d+\) killed by SIGKILL|ped by SIGTERM; rank 1)",
        ranks=2,
        exact=True,
    ),
]
TABLE: list[tuple] = []  # the rows' figures, printed at the end


# ------------------------------------------------------------------ running lmforge


def launch(
    args: list[str],
    out: Path,
    *,
    ranks: int = 1,
    kind: str = "none:0",
    folder: Path | None = None,
    timeout: float = 300,
) -> tuple[int, str, float]:
    """(exit code, stdout + stderr, the time it exited) of ``lmforge <args>`` with the fault ``kind``."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "LMFORGE_FAULT": kind,
        "LMFORGE_FAULT_RANK": str(ranks - 1),
        "LMFORGE_FAULT_DIR": str(folder or out.parent),
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
    }
    head = (
        [sys.executable, LAUNCHER]
        if ranks == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={ranks}",
            f"--master_port={free_port()}",
            LAUNCHER,
        ]
    )
    proc = subprocess.run(
        head + args + [f"train.output_dir={out}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=out.parent,
        check=False,
    )
    return proc.returncode, proc.stdout + proc.stderr, time.time()


def train_losses(run_dir: Path) -> dict[int, list[float]]:
    """{step: [loss, ...]} of every train line in metrics.jsonl (a step logged twice shows as two)."""
    found: dict[int, list[float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["kind"] == "train":
            found.setdefault(row["step"], []).append(row["loss"])
    return found


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The uninterrupted runs the exact rows compare with, made when first needed."""
    made: dict[int, dict] = {}

    def get(ranks: int) -> dict:
        if ranks not in made:
            out = tmp_path_factory.mktemp(f"reference{ranks}") / "run"
            timeout = ["parallel.timeout_s=8"] if ranks > 1 else []
            code, text, _ = launch(["sft", *SFT, *timeout, "train.max_steps=4"], out, ranks=ranks)
            assert code == 0, text[-3000:]
            made[ranks] = {"losses": train_losses(out), "dir": out}
        return made[ranks]

    return get


@pytest.fixture(scope="module", autouse=True)
def print_table(request):
    yield
    if not TABLE:
        return
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    lines = [
        "",
        "| Fault | Exit code | Phase named (output) | Seconds from fault to exit | Resumed steps |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {f} | {c} | {p} | {s} | {r} |" for f, c, p, s, r in TABLE]
    for line in lines:
        reporter.write_line(line) if reporter else print(line)


# ------------------------------------------------------------------ a fake Atropos API and inference server


class FakeAtropos:
    """``/register``, ``/batch`` (a fresh batch of synthetic groups on every call), ``GET /v1/weights`` and
    ``POST /v1/weights/tensors``. ``mode`` picks the fault, from the ``step``-th batch or the push of
    version ``step``: ``api_reset`` (every connection reset), ``api_hang`` (no answer), ``push_killed``
    (half the body read, then the server is gone: connection refused), ``push_hang`` (no answer)."""

    def __init__(self, mode: str, step: int, tokenizer, group_size: int = 4, num_prompts: int = 2):
        self.mode, self.step, self.onset, self.version, self.batches = mode, step, None, 0, 0
        self.release = threading.Event()
        digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
        fake = self

        def groups(seed: int) -> list[dict]:
            out = []
            for g in range(num_prompts):
                prompt = [digits[(seed * 7 + g * 3 + i) % 10] for i in range(5)]
                rows = [[digits[(seed + g + r + i) % 10] for i in range(1 + r % 4)] for r in range(group_size)]
                out.append(
                    {
                        "tokens": [prompt + c for c in rows],
                        "masks": [[-100] * 5 + c for c in rows],
                        "scores": [float(r % 2) for r in range(group_size)],
                        "inference_logprobs": [[1.0] * 5 + [-2.3] * len(c) for c in rows],
                    }
                )
            return out

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, body):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def fault(self, mode: str, now: bool) -> bool:
                if fake.mode != mode or not now:
                    return False
                fake.onset = fake.onset or time.time()
                return True

            def do_GET(self):
                if self.path == "/batch":
                    fake.batches += 1
                    if self.fault("api_reset", fake.batches >= fake.step):  # RST: a dropped connection
                        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        self.close_connection = True
                        return
                    if self.fault("api_hang", fake.batches >= fake.step):
                        fake.release.wait()
                        return
                    return self.reply({"batch": groups(fake.batches)})
                self.reply({"weight_version": fake.version})

            def do_POST(self):
                size = int(self.headers.get("content-length", 0))
                if self.path == "/register":
                    self.rfile.read(size)
                    return self.reply({"uuid": 7})
                version = int(self.path.split("version=")[1])
                if self.fault("push_killed", version >= fake.step):
                    self.rfile.read(size // 2)
                    threading.Thread(target=fake.kill, daemon=True).start()
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
                self.rfile.read(size)
                if self.fault("push_hang", version >= fake.step):
                    fake.release.wait()
                    return
                fake.version = version
                self.reply({"weight_version": version})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def kill(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def close(self) -> None:
        self.release.set()
        if self.thread.is_alive():
            self.kill()


@pytest.fixture(scope="module")
def tokenizer():
    from lmforge.core.config import ModelConfig
    from lmforge.model.load import load_model

    return load_model(
        ModelConfig(
            name="tiny:llama", tokenizer="char", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=64
        )
    )[1]


# ------------------------------------------------------------------ the table


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS, ids=[f.kind for f in FAULTS])
def test_fault(fault: Fault, tmp_path, references, tokenizer):
    out, args = tmp_path / "run", [fault.recipe, *fault.args]
    services = []

    def service(mode: str) -> list[str]:
        if fault.service == "" and "rollout.backend=atropos" not in fault.args:
            return []
        services.append(FakeAtropos(mode, fault.step, tokenizer))
        url = services[-1].url
        return [f"rollout.api_url={url}", f"rollout.server_url={url}"]

    try:
        if fault.kind == "corrupt":  # the fault is in the files: the resume itself is the faulty run
            shutil.copytree(references(1)["dir"], out)
            model = out / "checkpoints" / "step-000004" / "model" / "model.safetensors"
            model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
            start = time.time()
            code, text, ended = launch(args + ["train.resume=auto", f"train.max_steps={fault.total}"], out)
        else:
            code, text, ended = launch(
                args + service(fault.service) + [f"train.max_steps={fault.steps}"],
                out,
                ranks=fault.ranks,
                kind=f"{fault.kind}:{fault.step}",
                folder=tmp_path,
            )
            onsets = (
                [float(x) for x in (tmp_path / "onset").read_text().split()] if (tmp_path / "onset").exists() else []
            )
            if fault.service:
                onsets.append(services[-1].onset)
            assert onsets and all(onsets), f"the fault never struck:\n{text[-3000:]}"
            start = min(onsets)
        for s in services:
            s.close()
        assert code == fault.code, f"exit code {code}, expected {fault.code}:\n{text[-4000:]}"
        found = re.search(fault.phase, text)
        assert found, f"the output does not name the phase ({fault.phase}):\n{text[-4000:]}"
        assert "internal error" not in text and "a bug in lmforge" not in text, text[-4000:]
        seconds, fault_code = ended - start, code
        assert seconds <= fault.timeout_s + SLACK_S, f"{seconds:.1f} s from the fault to the exit"

        if fault.kind != "corrupt":  # resume from the last checkpoint, without the fault
            code, text, _ = launch(
                args + service("") + ["train.resume=auto", f"train.max_steps={fault.total}"],
                out,
                ranks=fault.ranks,
                folder=tmp_path / "resume",
            )
            for s in services:
                s.close()
            assert code == 0, text[-4000:]
        assert re.search(rf"\[resume\] from \S+step-{fault.resume_from:06d} at step {fault.resume_from}", text), text[
            -3000:
        ]
        losses = train_losses(out)
        assert sorted(losses) == list(range(1, fault.total + 1)), losses  # every step logged, once
        assert all(len(v) == 1 for v in losses.values()), losses
        resumed = list(range(fault.resume_from + 1, fault.total + 1))
        if fault.exact:
            reference = references(fault.ranks)["losses"]
            assert all(losses[s] == reference[s] for s in resumed), (losses, reference)
        phase = found.group(0).splitlines()[0].replace(str(out), "RUN") if found.group(0) else ""
        TABLE.append(
            (
                fault.name,
                fault_code,
                f"`{phase[:110]}`" if phase else "(killed: nothing printed)",
                f"{seconds:.1f}",
                f"{resumed[0]}-{resumed[-1]}{' (exact)' if fault.exact else ''}",
            )
        )
    finally:
        for s in services:
            s.close()
