"""``lmforge grpo rollout.backend=verifiers`` on a tiny model: verifiers' own rollout code runs episodes of
examples/vf_calculate.py (an unmodified verifiers v1 environment) against the policy served in process,
the rows are its token ids, and a GRPO step trains on them. Skips without verifiers (its own venv: it
pins openai 2.x) or without ``uv`` (its chat harness is a uv script)."""

import shutil
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e  # verifiers starts a harness and a tool server per episode (~45 s)
pytest.importorskip("verifiers.v1")
pytest.importorskip("uvicorn")
if shutil.which("uv") is None:
    pytest.skip("verifiers' chat harness needs uv on PATH", allow_module_level=True)

from run_records import records  # noqa: E402

from lmforge.core.config import load_config  # noqa: E402
from lmforge.recipes.grpo import GRPOConfig, run_grpo  # noqa: E402
from lmforge.rl.sources import verifiers as vf_source  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ARGS = [
    "model.name=tiny:llama",
    "model.tokenizer=char",
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.max_position_embeddings=1024",
    "data.task=addition",
    "data.num_train=8",
    "data.num_eval=0",
    "rollout.backend=verifiers",
    "rollout.verifiers_env=vf-calculate",
    "rollout.verifiers_args={num_tasks: 4}",
    "rollout.num_prompts=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=6",
    "train.max_steps=2",
    "train.micro_batch_size=4",
    "train.save_every=0",
    "train.threads=1",
    "optim.lr=1e-2",
    "logging.progress=false",
    "algo.preset=",
    "algo.is_level=token",
]


@pytest.fixture
def on_path(monkeypatch):
    """examples/ importable here and in the processes verifiers starts (its tool server runs
    ``python -m vf_calculate``)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setenv("PYTHONPATH", ":".join(filter(None, [str(EXAMPLES), *sys.path[1:2]])))


def test_grpo_steps_train_on_verifiers_episodes(tmp_path, on_path, monkeypatch):
    batches, loads = [], []
    real_rows, real_load = vf_source.VerifiersSource.rows, vf_source.PolicyServer.load

    def rows(self, episodes):
        groups, counts = real_rows(self, episodes)
        batches.append((episodes, groups, counts))
        return groups, counts

    def load(self, model, version):
        real_load(self, model, version)
        loads.append((version, {n: t.clone() for n, t in self.served.model.state_dict().items()}))

    monkeypatch.setattr(vf_source.VerifiersSource, "rows", rows)
    monkeypatch.setattr(vf_source.PolicyServer, "load", load)
    run_grpo(load_config(GRPOConfig, None, ARGS + [f"train.output_dir={tmp_path / 'run'}"]))

    assert len(batches) == 2
    for episodes, groups, counts in batches:
        assert len(episodes) == 4 and all(e.traces for e in episodes)
        for group in groups:
            for tokens, masks, logprobs in zip(group["tokens"], group["masks"], group["inference_logprobs"]):
                trained = [i for i, m in enumerate(masks) if m != vf_source.IGNORE]
                assert trained and trained[0] > 0  # a prompt, then the policy's tokens
                assert all(masks[i] == tokens[i] and logprobs[i] <= 0 for i in trained)
        # verifiers rendered with lmforge's renderer (vf_renderer.py), the way lmforge serve renders chat
        assert counts == {"vf_prompt_mismatch": 0, "vf_episode_mismatch": 0, "vf_failed_episodes": 0}
    # after each step the served copy took the updated weights, versioned by the step
    assert [v for v, _ in loads] == [1, 2]
    assert all(torch.isfinite(t).all() for _, state in loads for t in state.values())
    logged = records(tmp_path / "run")
    assert sorted(logged) == [1, 2]
    for step in (1, 2):
        assert 0.0 <= logged[step]["reward"] <= 1.0
        assert logged[step]["completion_len_mean"] > 0
        assert "vf_prompt_mismatch" in logged[step]
