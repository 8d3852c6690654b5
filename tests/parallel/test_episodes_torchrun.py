"""Episodes under torchrun (gloo, 2 ranks): each rank plays its share of a step's problems with every
group whole on one rank, and together the ranks play exactly the problems one process plays (``e2e``)."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.parallel.context import free_port

ROOT = Path(__file__).resolve().parents[2]
ARGS = [
    "model.name=tiny:llama",
    "model.tokenizer=char",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.max_position_embeddings=128",
    "data.task=addition",
    "data.num_train=64",
    "data.num_eval=0",
    "rollout.num_prompts=4",
    "rollout.group_size=2",
    "rollout.max_new_tokens=4",
    "rewards.functions=[exact]",
    "train.max_steps=2",
    "logging.progress=false",
    "env.max_episode_tokens=40",
]


def played(log: Path) -> list[collections.Counter]:
    """One counter of prompts per process that wrote ``log.<pid>``."""
    return [collections.Counter(p.read_text().splitlines()) for p in sorted(log.parent.glob(log.name + ".*"))]


def run(args: list[str], nproc: int, out: Path, log: Path) -> None:
    log.parent.mkdir()
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
        if nproc > 1
        else [sys.executable]
    )
    path = f"{ROOT / 'tests' / 'recipes'}:{os.environ.get('PYTHONPATH', '')}"  # episode_envs
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [
            *launcher,
            "-m",
            "lmforge",
            "grpo",
            *args,
            f"train.output_dir={out}",
            "env.name=episode_envs:Recorder",
            f"env.args={{path: {log}}}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.e2e  # two runs, one under torchrun: ~65 s on the 2-core machine
def test_two_ranks_play_the_problems_of_one_process_groups_whole(tmp_path):
    run(ARGS, 1, tmp_path / "one", tmp_path / "one-log" / "played")
    run(ARGS, 2, tmp_path / "two", tmp_path / "two-log" / "played")
    (single,) = played(tmp_path / "one-log" / "played")
    ranks = played(tmp_path / "two-log" / "played")
    assert len(ranks) == 2 and all(ranks)
    assert ranks[0] + ranks[1] == single  # the same problems, each as often
    assert all(count % 2 == 0 for rank in ranks for count in rank.values())  # a group's 2 episodes on one rank
    assert not set(ranks[0]) & set(ranks[1])
