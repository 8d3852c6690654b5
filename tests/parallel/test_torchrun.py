"""Real ``torchrun`` processes (gloo, 2 ranks, tiny models): a recipe end to end with checkpoints,
exact resume and export; under the ``e2e`` marker the failure behaviour (a rank that fails alone, a
config that differs between ranks, SIGTERM during training), pretraining (against one process),
GRPO / PPO under torchrun and a 2-node x 2-process rendezvous over loopback. (The antidistillation gradient under
torchrun:
tests/recipes/test_antidistill_pipeline.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmforge.parallel.context import free_port
from lmforge.runtime.checkpoint import list_checkpoints

TINY = [
    "model.name=tiny:llama",
    "model.tokenizer=char",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.max_position_embeddings=32",
]
SFT = TINY + [
    "data.task=addition",
    "data.num_train=256",
    "data.num_eval=8",
    "data.max_len=32",
    "train.batch_size=8",
    "train.micro_batch_size=2",
    "train.eval_every=3",
    "train.save_every=3",
    "train.keep_last=5",
    "train.max_new_tokens=4",
    "logging.progress=false",
]
GRPO = TINY + [
    "data.task=addition",
    "data.num_train=64",
    "data.num_eval=8",
    "rollout.num_prompts=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "train.max_steps=2",
    "train.save_every=2",
    "train.eval_every=2",
    "train.max_new_tokens=4",
    "logging.progress=false",
]


def torchrun(*args: str, nproc: int = 2, timeout: float = 300, extra: list[str] | None = None, **popen):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        *(extra or []),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **popen)


def train_records(run_dir: Path) -> dict:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if r["kind"] == "train"}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_sft_under_torchrun_resumes_exactly_and_exports(tmp_path, strategy):
    out, resumed = tmp_path / "run", tmp_path / "resumed"
    proc = torchrun(
        "-m", "lmforge", "sft", *SFT, "train.max_steps=6", f"parallel.strategy={strategy}", f"train.output_dir={out}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("[summary] time") == 1  # rank 0 alone writes to the console
    assert [p.name for p in list_checkpoints(out)] == ["step-000003", "step-000006"]
    assert (out / "final" / "model.safetensors").is_file()
    # resume from step 3 in a fresh directory: steps 4-6 equal the uninterrupted run's, bit for bit
    (resumed / "checkpoints").mkdir(parents=True)
    os.rename(out / "checkpoints" / "step-000003", resumed / "checkpoints" / "step-000003")
    proc = torchrun(
        "-m",
        "lmforge",
        "sft",
        *SFT,
        "train.max_steps=6",
        f"parallel.strategy={strategy}",
        f"train.output_dir={resumed}",
        "train.resume=auto",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference, again = train_records(out), train_records(resumed)
    assert sorted(again) == [4, 5, 6] and all(again[s] == reference[s] for s in again)
    # the exported newest checkpoint is the final model
    from safetensors.torch import load_file

    from lmforge.cli import main

    assert main(["export", str(resumed), "--out", str(tmp_path / "hf")]) == 0
    exported, final = (
        load_file(str(tmp_path / "hf" / "model.safetensors")),
        load_file(str(out / "final" / "model.safetensors")),
    )
    assert exported.keys() == final.keys() and all((exported[k] == final[k]).all() for k in final)


@pytest.mark.e2e
def test_a_rank_failing_alone_stops_every_rank_and_is_reported_once(tmp_path):
    reward = tmp_path / "rank_reward.py"
    reward.write_text(
        "import os\n\ndef score(completion, problem, **kw):\n"
        "    if os.environ['RANK'] == '1':\n        raise RuntimeError('verifier down on rank 1')\n"
        "    return 0.0\n"
    )
    start = time.monotonic()
    proc = torchrun(
        "-m",
        "lmforge",
        "grpo",
        *GRPO,
        "rewards.functions=[rank_reward:score]",
        "rewards.max_failure_fraction=0",
        f"train.output_dir={tmp_path / 'run'}",
        "parallel.timeout_s=60",
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert time.monotonic() - start < 120  # stopped together, not at the collective timeout
    assert proc.stderr.count("lmforge grpo: error:") == 1, proc.stderr[-3000:]
    assert "[rank 1]" in proc.stderr and "verifier down on rank 1" in proc.stderr


@pytest.mark.e2e
def test_different_configs_on_the_ranks_are_refused(tmp_path):
    script = tmp_path / "skewed.py"
    script.write_text(
        "import os, sys\nfrom lmforge.cli import main\n"
        "lr = '1e-3' if os.environ['RANK'] == '0' else '2e-3'\n"
        f"sys.exit(main(['sft', *{SFT!r}, 'train.max_steps=2', 'optim.lr=' + lr, "
        f"'train.output_dir={tmp_path / 'run'}']))\n"
    )
    proc = torchrun(str(script))
    assert proc.returncode != 0
    assert "the ranks resolved different configs" in proc.stderr and proc.stderr.count("error:") == 1


@pytest.mark.e2e
def test_sigterm_during_training_leaves_every_checkpoint_intact(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "-m",
        "lmforge",
        "sft",
        *SFT,
        "train.max_steps=100000",
        "train.save_every=1",
        "train.keep_last=3",
        f"train.output_dir={out}",
    ]
    proc = subprocess.Popen(
        cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 180
    while len(list_checkpoints(out)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    found = list_checkpoints(out)
    assert len(found) >= 3
    for path in found:  # complete: weights and trainer state both load
        import torch
        from safetensors.torch import load_file

        load_file(str(path / "model" / "model.safetensors"))
        torch.load(path / "trainer_state.pt", weights_only=False)
    step = int(found[-1].name.split("-")[1])
    resumed = torchrun(
        "-m", "lmforge", "sft", *SFT, f"train.max_steps={step + 2}", f"train.output_dir={out}", "train.resume=auto"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {step}" in resumed.stdout


@pytest.mark.e2e
@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_rl_recipes_under_torchrun(tmp_path, recipe):
    extra = ["rewards.functions=[exact]"] + (["algo.num_mini_batches=2"] if recipe == "ppo" else [])
    proc = torchrun(
        "-m", "lmforge", recipe, *GRPO, *extra, "parallel.strategy=fsdp2", f"train.output_dir={tmp_path / 'run'}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    assert "rollout rows per update" in proc.stdout


@pytest.mark.e2e
def test_two_nodes_of_two_processes_over_loopback(tmp_path):
    """The multi-node launch of docs/distributed.md, with both "nodes" on this machine."""
    port, out = free_port(), tmp_path / "run"
    common = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
    ]
    args = ["-m", "lmforge", "sft", *SFT, "train.max_steps=2", f"train.output_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [*common, f"--node_rank={rank}", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert "4 ranks" in outputs[0][0]
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.e2e
def test_pretrain_under_torchrun_matches_one_process(tmp_path):
    """Pretraining with a BPE tokenizer trained on the fly: 2 ranks x 2 rows x 2 micro-batches take the
    same steps as one process with 8 rows (fp32; the bound is the one of tests/parallel/test_equivalence)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = "the quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat".split()
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(" ".join(words[(i + j) % len(words)] for j in range(200)))
    args = [
        "pretrain",
        f"data.files=[{corpus}]",
        "tokenizer.train=true",
        "tokenizer.vocab_size=300",
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.num_heads=2",
        "data.seq_len=32",
        "train.max_steps=4",
        "train.batch_size=8",
        "train.micro_batch_size=2",
        "train.eval_every=4",
        "train.save_every=4",
        "optim.lr=3e-3",
        "train.num_samples=0",
        "logging.progress=false",
    ]
    proc = torchrun("-m", "lmforge", *args, f"train.output_dir={tmp_path / 'two'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = subprocess.run(
        [sys.executable, "-m", "lmforge", *args, f"train.output_dir={tmp_path / 'one'}"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two, single = train_records(tmp_path / "two"), train_records(tmp_path / "one")
    assert sorted(two) == sorted(single) == [1, 2, 3, 4]
    for step in single:
        assert abs(two[step][0] - single[step][0]) <= 3e-6 * abs(single[step][0]), (step, two[step], single[step])
    assert (tmp_path / "two" / "tokenizer" / "tokenizer.json").read_text() == (
        tmp_path / "one" / "tokenizer" / "tokenizer.json"
    ).read_text()
