"""The three programs of an Atropos run, as separate processes on this machine: atroposlib's ``run-api``,
the example environment ``examples/atropos_addition_env.py`` (a ``BaseEnv``) sampling from ``lmforge
serve``, and ``lmforge grpo rollout.backend=atropos`` training on what the API hands out and pushing its
weights back to the server.

The smoke test uses a random tiny model (a few steps; it checks the wiring, not learning). The slow
test starts from an SFT'd quickstart-size model and checks that its held-out accuracy rises.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmforge.core.config import ModelConfig
from lmforge.model.load import load_model, save_model
from lmforge.parallel.context import free_port

httpx = pytest.importorskip("httpx")
REPO = Path(__file__).resolve().parents[2]
ENV_SCRIPT = REPO / "examples" / "atropos_addition_env.py"


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["WANDB_MODE"] = "disabled"
    return env


class Processes:
    """Started subprocesses, each logging to its own file; all stopped (by their own pid) at the end."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.started = log_dir, []

    def start(self, name: str, args: list[str]) -> tuple[subprocess.Popen, Path]:
        log = self.log_dir / f"{name}.log"
        process = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
        self.started.append(process)
        return process, log

    def stop(self) -> None:
        for process in reversed(self.started):
            if process.poll() is None:
                process.terminate()
        for process in self.started:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def run_three_programs(
    tmp_path: Path, model_dir: Path, trainer_args: list[str], env_args: list[str], timeout: float
) -> tuple[Path, str, int]:
    """run-api, lmforge serve MODEL_DIR, lmforge grpo (the trainer registers first), the environment.
    Returns the trainer's run directory, its log and the server's final weight version."""
    run_api = shutil.which("run-api")
    if run_api is None:
        pytest.skip("atroposlib's run-api is not on PATH (pip install atroposlib)")
    api_port, serve_port = free_port(), free_port()
    api_url, serve_url = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{serve_port}"
    procs = Processes(tmp_path)
    out = tmp_path / "run"
    try:
        # All four start at once (imports dominate start-up): the trainer retries /register until run-api
        # answers, the environment waits until the trainer has registered, then samples from the server.
        _, api_log = procs.start("api", [run_api, "--host", "127.0.0.1", "--port", str(api_port)])
        _, server_log = procs.start(
            "serve",
            [
                sys.executable,
                "-m",
                "lmforge",
                "serve",
                str(model_dir),
                "--port",
                str(serve_port),
                "--name",
                "lmforge",
                "--threads",
                "1",
                "--log-level",
                "warning",
            ],
        )
        trainer, trainer_log = procs.start(
            "trainer",
            [
                sys.executable,
                "-m",
                "lmforge",
                "grpo",
                f"model.name={model_dir}",
                "rollout.backend=atropos",
                f"rollout.api_url={api_url}",
                f"rollout.server_url={serve_url}",
                f"train.output_dir={out}",
                "logging.progress=false",
                "train.threads=1",
                "rollout.api_poll_s=0.2",
                "rollout.api_timeout_s=300",
                "rollout.api_retries=8",
                "rollout.api_backoff_s=0.25",
                *trainer_args,
            ],
        )
        _, env_log = procs.start(
            "env",
            [
                sys.executable,
                str(ENV_SCRIPT),
                "serve",
                f"--env.tokenizer_name={model_dir}",
                f"--env.rollout_server_url={api_url}",
                f"--openai.base_url={serve_url}/v1",
                "--openai.api_key=none",
                "--openai.model_name=lmforge",
                "--openai.health_check=False",
                "--env.use_wandb=False",
                *env_args,
            ],
        )
        try:
            rc = trainer.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        logs = {p.name: p.read_text()[-4000:] for p in (trainer_log, env_log, server_log, api_log)}
        assert rc == 0, f"the trainer ended with {rc}:\n" + "\n".join(f"--- {k}\n{v}" for k, v in logs.items())
        version = httpx.get(f"{serve_url}/v1/weights", timeout=10).json()["weight_version"]
        return out, logs[trainer_log.name], version
    finally:
        procs.stop()


def sft_start_with_room(root: Path) -> Path:
    """The quickstart's SFT stage (600 steps, seed 0) with a checkpoint and a held-out evaluation every
    50 steps; returns the model of the latest checkpoint whose greedy accuracy is at most 90% (at least
    50%), or the final model when none is. The accuracy climbs steeply late in the run and where it ends
    depends on the CPU's kernels: the final model was 81.5% on the AVX2 2-core machine and 97.5% on the
    AVX-512 one, where a rise cannot be told from noise on 200 problems."""
    from lmforge.data.tasks import get_task
    from lmforge.model.tokenizer import char_tokenizer
    from lmforge.pipelines.quickstart import QuickstartConfig, sft_config
    from lmforge.recipes.sft import run_sft

    cfg = QuickstartConfig(output_dir=str(root), grpo_steps=0, progress=False)
    sft = sft_config(cfg, root)
    sft = dataclasses.replace(
        sft, train=dataclasses.replace(sft.train, eval_every=50, save_every=50, keep_last=cfg.sft_steps // 50)
    )
    model, tokenizer = load_model(sft.model, char_tokenizer(get_task(cfg.task).alphabet))
    run_sft(sft, model, tokenizer)
    run_dir = Path(sft.train.output_dir)
    accuracy = {
        r["step"]: r["accuracy"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == "eval"
    }
    print("SFT held-out accuracy by step: " + ", ".join(f"{s}: {a:.3f}" for s, a in sorted(accuracy.items())))
    room = [step for step, acc in accuracy.items() if 0.5 <= acc <= 0.9]
    step = max(room) if room else max(accuracy)
    return run_dir / "checkpoints" / f"step-{step:06d}" / "model"


def train_records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["kind"] == "train"}


@pytest.mark.e2e  # 47 s wall (17 s CPU) on the busy 2-core machine: imports of four processes, and BaseEnv's
# fixed 5 s start-up pause; the default suite's fast version is tests/recipes/test_grpo_atropos.py
def test_run_api_environment_serve_and_trainer_smoke(tmp_path):
    pytest.importorskip("atroposlib")
    pytest.importorskip("fastapi")
    model, tokenizer = load_model(
        ModelConfig(
            name="tiny:llama", tokenizer="char", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=64
        )
    )
    model_dir = save_model(model, tokenizer, tmp_path / "model")
    start = time.monotonic()
    out, log, version = run_three_programs(
        tmp_path,
        model_dir,
        [
            "data.task=addition",
            "data.num_train=64",
            "data.num_eval=0",
            "rollout.num_prompts=2",
            "rollout.group_size=4",
            "rollout.max_new_tokens=4",
            "rewards.functions=[exact]",
            "algo.is_level=token",
            "train.max_steps=3",
            "train.micro_batch_size=8",
            "train.save_every=0",
            "train.log_every=1",
            "optim.lr=1e-3",
            "algo.skip_zero_advantage=false",
        ],  # every row trained: the alignment metrics below cover all of them
        ["--env.group_size=4", "--env.max_new_tokens=4", "--env.num_train=64", "--env.total_steps=50"],
        timeout=120,
    )
    records = train_records(out)
    assert sorted(records) == [1, 2, 3], log
    for step, record in records.items():
        # every group carried the version that sampled it; the trainer pushed after every step
        assert 0 <= record["staleness_max"] <= step, record
        assert record["atropos_dropped_stale_groups"] == 0
        # IS against lmforge serve's logprobs: same weights, same temperature, so near-equal logprobs
        # wherever the batch was sampled with the weights being trained
        if record["staleness_max"] == 0:
            assert record["rollout_diff_abs_max"] < 1e-3, record
    assert version == 3  # pushes after steps 1, 2, 3 (rollout.push_every=1)
    print(f"three-program smoke run: {time.monotonic() - start:.1f} s")


@pytest.mark.slow
@pytest.mark.e2e
def test_grpo_through_atropos_raises_accuracy_of_the_quickstart_model(tmp_path):
    """The quickstart's SFT stage (tiny Llama, 128 hidden, 4 layers, char tokens), then 60 GRPO steps fed
    by the environment through run-api: the held-out greedy accuracy rises. The GRPO stage starts from
    the latest SFT checkpoint at 50-90% (``sft_start_with_room``). ``LMFORGE_TEST_SFT_MODEL=DIR``
    skips the SFT stage and starts from DIR (e.g. a quickstart's ``sft/final``).

    Margin. The held-out accuracy is greedy on the same 200 problems each time; what varies between runs is the
    order in which the environment's groups arrive (it runs up to two steps ahead). From the 600-step
    quickstart SFT model of seed 0 (81.5%, 37 errors; AVX2 2-core machine), four runs at lr 5e-5 ended at 94.5,
    92.5, 96.5 and 94% (11, 15, 7 and 12 errors: at most 0.41 of the start's), three at lr 1e-4 at 90.5, 93.5
    and 92.5% (one dipped to 73.5% at step 30). From the seed-2 model (69.5% by the trainer's evaluation) four
    runs at lr 5e-5 ended at 0.31-0.43 of its errors, from the seed-1 model (93.5%) two at 0.15 and 0.31.
    Earlier, from a 69% model at lr 1e-4, seven runs ended at 0.48-0.81 of its errors and one at 1.16: that run
    failed the former check (a rise of 2 points), hence the lower lr. On the AVX-512 2-core machine the
    600-step model starts at 97.5% and one CI run went 97.5 -> 99.0 (step 30) -> 96.0%: at that height 200
    problems cannot show a rise, hence the earlier checkpoint (step 500 there, 76%); from it three runs ended
    at 95.0, 94.5 and 97.0% (10, 11 and 6 errors of 48: at most 0.23 of the start's; 1 min each, idle machine).
    The check asks that the errors fall to at most 0.75 of the start's, from a start of at least 50%; from a
    start above 96% (a model given by ``LMFORGE_TEST_SFT_MODEL``, or an SFT stage whose every checkpoint lands
    outside 50-90%), that it ends at 97% or more. The sampled reward (T = 1, 64 completions per step) is
    printed, not asserted: its 15-step means fell in one earlier run whose accuracy rose. About 1.5 min on a
    quiet 2-core machine, 7-8 min on a loaded one."""
    pytest.importorskip("atroposlib")
    pytest.importorskip("fastapi")
    if os.environ.get("LMFORGE_TEST_SFT_MODEL"):
        model_dir = Path(os.environ["LMFORGE_TEST_SFT_MODEL"])
    else:
        model_dir = sft_start_with_room(tmp_path / "quickstart")
    out, log, version = run_three_programs(
        tmp_path,
        model_dir,
        [
            "data.task=addition",
            "data.num_train=4000",
            "data.num_eval=200",
            "rollout.num_prompts=8",
            "rollout.group_size=8",
            "rollout.max_new_tokens=6",
            "rewards.functions=[exact]",
            "algo.is_level=token",
            "rollout.max_staleness=2",
            "optim.lr=5e-5",
            "optim.schedule=constant",
            "optim.weight_decay=0.0",
            "train.max_steps=60",
            "train.micro_batch_size=64",
            "train.eval_every=30",
            "train.save_every=0",
            "train.max_new_tokens=6",
            "train.log_every=10",
        ],
        ["--env.group_size=8", "--env.max_new_tokens=6", "--env.num_train=4000", "--env.total_steps=1000"],
        timeout=1500,
    )
    records = train_records(out)
    assert sorted(records) == list(range(1, 61)), log
    first = sum(records[k]["reward"] for k in range(1, 16)) / 15
    last = sum(records[k]["reward"] for k in range(46, 61)) / 15
    evals = {
        r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"
    }
    print(
        f"reward first 15 steps {first:.3f}, last 15 {last:.3f}; held-out accuracy "
        + ", ".join(f"step {s}: {e['accuracy']:.3f}" for s, e in sorted(evals.items()))
        + f"; dropped stale groups {records[60]['atropos_dropped_stale_total']}, server version {version}"
    )
    start, end = evals[0]["accuracy"], evals[60]["accuracy"]
    assert start >= 0.5, f"the SFT model starts at {start:.1%}, below the 50% this check is sized for"
    assert 1 - end <= max(0.75 * (1 - start), 0.03), evals
    assert version == 60
