"""The rollout seam from a source author's side: a source is one file and one registry entry.

Two sources nobody in lmforge/rl/ knows about are registered here (``SOURCES``) and trained with
``lmforge grpo``: the replay example of docs/architecture.md, loaded from the doc itself, and a
sampler whose rows carry tool-output tokens between the policy's turns (trained tokens in two spans,
the tool's not trained). The second resumes bit for bit, and so does the overlap wrapper over it.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import torch
from run_records import assert_resume_is_bit_exact, records

from lmforge.core.config import load_config
from lmforge.model.load import load_model
from lmforge.recipes.grpo import GRPOConfig, run_grpo
from lmforge.rl import sources
from lmforge.rl.batch import ScoredRollout
from lmforge.rl.prompts import rank_prompts, step_seed
from lmforge.rl.sources import inprocess
from lmforge.rollout import RewardOutput, RolloutBatch, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
ARGS = [
    "model.tokenizer=char",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.max_position_embeddings=48",
    "model.init_seed=0",
    "data.task=addition",
    "data.num_train=64",
    "data.num_eval=0",
    "rollout.num_prompts=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "train.max_steps=3",
    "train.micro_batch_size=8",
    "train.save_every=1",
    "train.keep_last=10",
    "train.threads=1",
    "optim.lr=3e-2",
    "logging.progress=false",
]
TOOL_IDS = [5, 6, 7]  # the "tool output" inserted after the policy's first two tokens


def load_doc_example():
    """The ``replay`` source of docs/architecture.md, as a module of lmforge.rl.sources."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    code = re.search(r"```python\n# src/lmforge/rl/sources/replay.py\n(.*?)```", doc, re.S).group(1)
    spec = importlib.util.spec_from_loader("lmforge.rl.sources.replay", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "lmforge.rl.sources"
    exec(compile(code, "docs/architecture.md", "exec"), module.__dict__)
    return module


def test_the_architecture_doc_example_source_trains(tmp_path, monkeypatch):
    replay = load_doc_example()
    _, tokenizer = load_model(load_config(GRPOConfig, None, ARGS).model)
    rows = [
        {
            "prompt": tokenizer.encode(f"{a}+{a}="),
            "completion": tokenizer.encode(str(2 * a + g % 2)),
            "reward": float(g % 2 == 0),
        }
        for a in range(10, 16)
        for g in range(4)
    ]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    monkeypatch.setenv("LMFORGE_REPLAY", str(tmp_path / "rows.json"))
    monkeypatch.setitem(sources.SOURCES, "replay", replay.build)
    model, tokenizer = load_model(load_config(GRPOConfig, None, ARGS).model)
    start = [p.detach().clone() for p in model.parameters()]
    run_grpo(
        load_config(GRPOConfig, None, ARGS + ["rollout.backend=replay", f"train.output_dir={tmp_path / 'run'}"]),
        model,
        tokenizer,
    )
    train = records(tmp_path / "run")
    assert sorted(train) == [1, 2, 3]
    assert [train[k]["reward"] for k in (1, 2, 3)] == [0.5, 0.5, 0.5]  # the file's rows, 8 a step
    assert max(float((p.detach() - s).abs().max()) for p, s in zip(model.parameters(), start)) > 1e-3


class ToolTurns:
    """A two-turn episode per row, token in / token out: the policy samples 2 tokens, a "tool" answers
    with ``TOOL_IDS``, the policy samples 2 more tokens after it. The row's completion is [turn 1,
    tool, turn 2]; its trained mask has two spans, the tool's tokens are inputs only. Reward: the
    first sampled token's id is even (so groups have variance)."""

    def __init__(self, setup):
        self.setup, self.engine = setup, inprocess.PolicyEngine(setup.policy)

    def next_batch(self, step: int) -> ScoredRollout:
        s, group = self.setup, self.setup.rollout.group_size
        rows = rank_prompts(s.order.next(), s.num_mini_batches, s.ctx)
        seed = step_seed(s.seed, step, s.ctx.rank)
        turn = lambda k: SamplingParams(temperature=1.0, max_new_tokens=2, seed=seed + k)  # noqa: E731 (no stop token)
        first = self.engine.generate([s.prompts.prompt_ids[i] for i in rows], turn(0), group, s.tokenizer.pad_token_id)
        after_tool = [
            s.prompts.prompt_ids[rows[b // group]] + first.completion_ids[b].tolist() + TOOL_IDS
            for b in range(len(first.completion_ids))
        ]
        second = self.engine.generate(after_tool, turn(1), 1, s.tokenizer.pad_token_id)
        tool = torch.tensor(TOOL_IDS).repeat(len(after_tool), 1)
        ids = torch.cat([first.completion_ids, tool, second.completion_ids], dim=1)
        trained = torch.cat(
            [
                torch.ones(2 * len(ids), dtype=torch.long).view(-1, 2),
                torch.zeros_like(tool),
                torch.ones_like(second.completion_ids),
            ],
            dim=1,
        )
        logprobs = torch.cat([first.logprobs, torch.zeros(tool.shape), second.logprobs], dim=1)
        rollout = RolloutBatch(
            first.prompt_ids,
            first.prompt_mask,
            ids,
            torch.ones_like(ids),
            logprobs,
            first.group_index,
            first.prompt_lens,
            torch.full((len(ids),), ids.shape[1]),
            torch.zeros(len(ids), dtype=torch.bool),
            trained_mask=trained,
        )
        rewards = (first.completion_ids[:, 0] % 2 == 0).float()
        scored = RewardOutput(rewards, rewards[:, None], ["even"], torch.zeros(1, dtype=torch.long))
        return ScoredRollout(rollout, scored, {"reward": rewards.mean(), "time_generation": 0.0, "time_scoring": 0.0})

    def sync_weights(self, policy, version):
        self.engine.sync_weights(policy())

    def state_dict(self):
        return {}  # the prompt order is the runtime's; the seeds follow the step

    def load_state_dict(self, state):
        pass

    def close(self):
        pass


def test_a_source_with_tool_turns_trains_and_resumes_exactly_plain_and_overlapped(tmp_path, monkeypatch):
    monkeypatch.setitem(sources.SOURCES, "tool_turns", ToolTurns)
    keys = ("loss", "reward", "grad_norm", "rollout_diff_abs_max", "is_weight_mean", "frac_rows_trained")
    for name, extra in (("plain", []), ("overlapped", ["rollout.async_steps=1"])):
        args = ARGS + ["rollout.backend=tool_turns", "algo.is_level=token"] + extra
        out = tmp_path / name
        run_grpo(load_config(GRPOConfig, None, args + [f"train.output_dir={out}"]))
        train = records(out)
        assert sorted(train) == [1, 2, 3]
        for record in train.values():
            assert all(record[key] == record[key] for key in keys)  # finite, logged
        # the sampler's logprobs of both turns are the trainer's on the same ids: the two-span mask, the
        # positions that predict the trained tokens and the tool tokens as context all line up
        assert train[1]["rollout_diff_abs_max"] < 1e-4
        if name == "plain":
            assert all(train[k]["rollout_diff_abs_max"] < 1e-4 for k in (1, 2, 3))
        else:
            assert [train[k]["staleness"] for k in (1, 2, 3)] == [0, 1, 1]
        assert_resume_is_bit_exact(run_grpo, GRPOConfig, args, out, tmp_path / f"{name}-resumed", 1, keys)
