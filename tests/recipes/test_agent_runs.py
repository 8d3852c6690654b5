"""GRPO runs with ``rollout.backend=agent`` (issue 36 item 5): the example calculator agent end to end (checkpoint,
metrics, held-out evaluation), overlapped rollouts, exact resume with an agent that is deterministic given the
run's seeded sampling, and two gloo ranks under torchrun (episodes sharded by rank, groups whole, a server each)."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from run_records import assert_resume_is_bit_exact, records

from lmforge.core.config import load_config
from lmforge.parallel.context import free_port
from lmforge.recipes.grpo import GRPOConfig, run_grpo

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.name=tiny:llama",
    "model.tokenizer=char",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.max_position_embeddings=2048",
]
ARGS = TINY + [
    "data.task=multiplication:digits=2",
    "data.num_train=64",
    "data.num_eval=4",
    "rollout.backend=agent",
    "rollout.num_prompts=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "train.max_new_tokens=8",
    "train.threads=1",
    "optim.lr=3e-2",
    "logging.progress=false",
]
AGENT_KEYS = {
    "num_agent_errors",
    "num_agent_timeouts",
    "num_agent_bad_rewards",
    "num_agent_no_calls",
    "calls_per_episode",
    "samples_per_episode",
    "reward",
    "loss",
    "grad_norm",
}

# Two turns of one conversation, the first reply sent back as the openai SDK gives it; the reward is the share of
# odd digits in the replies: deterministic given the run's seeded sampling, and it varies within a group.
TWO_TURNS = """
import os

import openai


def run(base_url, problem, episode, temperature_on_rank_0=None):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": problem["prompt"]}]
    asked = {"temperature": temperature_on_rank_0} if temperature_on_rank_0 and os.environ["RANK"] == "0" else {}
    first = client.chat.completions.create(model="policy", messages=messages, **asked).choices[0].message
    sent = first.model_dump(exclude_none=True)
    if asked:  # rank 0 also edits the reply it sends back: a second sample per episode, so rank 1's rows are padded
        sent["content"] = "[edited]"
    messages += [sent, {"role": "user", "content": "="}]
    second = client.chat.completions.create(model="policy", messages=messages).choices[0].message
    log = os.environ.get("AGENT_LOG")
    if log:
        with open(f"{log}.{os.getpid()}", "a") as out:
            out.write(f"{problem['prompt']}\\t{base_url.split('/sessions/')[0]}\\n")
    text = (first.content or "") + (second.content or "")
    odd = sum(c in "13579" for c in text) / max(len(text), 1)
    return {"odd": odd, "asked": 0.0} if asked else odd
"""


@pytest.fixture(scope="module")
def two_turns(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("agent") / "two_turns.py"
    path.write_text(TWO_TURNS)
    return path


def test_example_agent_trains_two_steps_and_writes_checkpoint_metrics_and_eval(tmp_path):
    out = tmp_path / "run"
    result = run_grpo(
        load_config(
            GRPOConfig,
            None,
            ARGS
            + [
                f"rollout.agent_entry={ROOT / 'examples' / 'agent_calculator.py'}:run",
                "train.max_steps=2",
                "train.save_every=2",
                "train.eval_every=2",
                f"train.output_dir={out}",
            ],
        )
    )
    train = records(out)
    assert sorted(train) == [1, 2]
    for step, record in train.items():
        assert AGENT_KEYS <= set(record), f"step {step} lacks {sorted(AGENT_KEYS - set(record))}"
        assert record["num_agent_errors"] == record["num_agent_timeouts"] == record["num_agent_no_calls"] == 0
        assert record["calls_per_episode"] >= 1
    evals = records(out, "eval")
    assert sorted(evals) == [0, 2]
    assert all(r["eval_agent_failures"] == 0 and r["eval_calls"] >= 1 for r in evals.values())
    assert (out / "checkpoints" / "step-000002").is_dir()
    assert (out / "final" / "model.safetensors").is_file()
    assert "accuracy" in result


@pytest.fixture(scope="module")
def four_steps(two_turns, tmp_path_factory):
    out = tmp_path_factory.mktemp("agent_run") / "run"
    run_grpo(
        load_config(
            GRPOConfig,
            None,
            ARGS
            + [
                f"rollout.agent_entry={two_turns}:run",
                "train.max_steps=4",
                "train.save_every=2",
                "train.keep_last=10",
                "train.eval_every=0",
                f"train.output_dir={out}",
            ],
        )
    )
    return out


def test_two_turn_agent_merges_into_one_sample_per_episode_and_learns(four_steps):
    train = records(four_steps)
    assert sorted(train) == [1, 2, 3, 4]
    for record in train.values():
        assert record["calls_per_episode"] == 2.0
        # the second call continues the first reply's sampled ids: one multi-turn sample, no text-rendered turn
        assert record["samples_per_episode"] == 1.0
        assert record["num_text_rendered_turns"] == 0
    assert any(r["grad_norm"] > 0 for r in train.values()), "no step had a learning signal"


def test_resume_reproduces_the_uninterrupted_agent_run_bit_for_bit(four_steps, two_turns, tmp_path):
    args = ARGS + [
        f"rollout.agent_entry={two_turns}:run",
        "train.max_steps=4",
        "train.save_every=2",
        "train.keep_last=10",
        "train.eval_every=0",
    ]
    assert_resume_is_bit_exact(
        run_grpo,
        GRPOConfig,
        args,
        four_steps,
        tmp_path / "resumed",
        2,
        ("loss", "reward", "reward_std", "grad_norm", "completion_len_mean", "calls_per_episode"),
    )


def test_overlapped_rollouts_run_the_agent_one_step_ahead_and_resume_exactly(two_turns, tmp_path):
    out = tmp_path / "run"
    args = ARGS + [
        f"rollout.agent_entry={two_turns}:run",
        "train.max_steps=3",
        "train.eval_every=0",
        "rollout.async_steps=1",
        "algo.is_level=token",
        "train.save_every=1",
        "train.keep_last=10",
    ]
    run_grpo(load_config(GRPOConfig, None, args + [f"train.output_dir={out}"]))
    train = records(out)
    assert sorted(train) == [1, 2, 3]
    assert [train[k]["staleness"] for k in (1, 2, 3)] == [0, 1, 1]
    assert [train[k]["rollout_version"] for k in (1, 2, 3)] == [0, 0, 1]
    assert all(r["calls_per_episode"] == 2.0 and r["samples_per_episode"] == 1.0 for r in train.values())
    # step 1 on-policy: the recorded logprobs are the trainer's (up to rounding); later ones a version behind
    assert train[1]["rollout_diff_abs_max"] < 1e-4
    # the checkpoint of step 2 holds the launched batch of step 3: resumed, step 3 is the same
    assert_resume_is_bit_exact(
        run_grpo,
        GRPOConfig,
        args,
        out,
        tmp_path / "resumed",
        2,
        ("loss", "reward", "grad_norm", "is_weight_mean", "rollout_version"),
    )


def _played(log: Path) -> list[list[tuple[str, str]]]:
    """Per process that wrote ``log.<pid>``: its (prompt, server URL) lines."""
    return [
        [tuple(line.split("\t")) for line in p.read_text().splitlines()]
        for p in sorted(log.parent.glob(log.name + ".*"))
    ]


@pytest.mark.slow  # one torchrun of two ranks, each with its own server: ~35 s on the 2-core machine
# (no held-out problems: every rank would run the whole evaluation on a server of its own, as every backend's does)
def test_two_ranks_shard_episodes_with_groups_whole_and_a_server_each(two_turns, tmp_path):
    """Each rank plays its share of the step's problems, groups whole, against a server of its own. A count only one
    rank has (its agent asks for a temperature: overrides) is summed, and reward parts
    only one rank's agent returns are logged, not a collective mismatch (before, gloo aborted the run); rank 0's
    episodes give two samples each (an edited reply), so rank 1 pads its rows to as many."""
    log = tmp_path / "played"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "-m",
        "lmforge",
        "grpo",
        *ARGS,
        f"rollout.agent_entry={two_turns}:run",
        "rollout.num_prompts=4",
        "rollout.agent_args={temperature_on_rank_0: 0.5}",
        "data.num_eval=0",
        "train.max_steps=2",
        "train.eval_every=0",
        f"train.output_dir={tmp_path / 'run'}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AGENT_LOG": str(log)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = _played(log)
    assert len(ranks) == 2 and all(ranks)
    counts = [collections.Counter(prompt for prompt, _ in rank) for rank in ranks]
    assert sum(sum(c.values()) for c in counts) == 2 * 4 * 2  # steps x prompts x group size
    assert all(n % 2 == 0 for c in counts for n in c.values())  # a group's episodes on one rank
    servers = [{url for _, url in rank} for rank in ranks]
    assert all(len(s) == 1 for s in servers) and servers[0] != servers[1]  # one server per rank
    train = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in train if r["kind"] == "train"] == [1, 2]
    # rank 0's 4 episodes ask once each per step; rank 1's never
    assert [r["num_override_temperature"] for r in train if r["kind"] == "train"] == [4.0, 4.0]
    assert all(r["reward_asked"] == 0.0 and 0 <= r["reward_odd"] <= 0.5 for r in train if r["kind"] == "train")
    assert all(
        r["samples_per_episode"] == 1.5 and r["num_text_rendered_turns"] == 4 for r in train if r["kind"] == "train"
    )
