"""Checkpoints: pruning to ``keep_last``, clearing a dead process's temporary directory, and resume
errors a user can act on (no checkpoint at the path, a checkpoint of another model)."""

import pytest
import torch

from lmforge.core.config import ModelConfig, load_config
from lmforge.core.errors import ConfigError
from lmforge.model.load import load_model
from lmforge.recipes.sft import SFTConfig, run_sft
from lmforge.runtime.checkpoint import list_checkpoints, load_model_weights, resolve_resume


def tiny(hidden=32, layers=1):
    return load_model(
        ModelConfig(
            name="tiny:llama",
            tokenizer="char",
            hidden_size=hidden,
            num_layers=layers,
            num_heads=2,
            max_position_embeddings=32,
        )
    )


SFT = [
    "data.task=addition",
    "data.num_train=32",
    "data.num_val=8",
    "data.num_eval=0",
    "model.tokenizer=char",
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.max_position_embeddings=32",
    "train.batch_size=8",
    "train.micro_batch_size=8",
    "train.eval_every=0",
    "train.threads=1",
    "logging.progress=false",
]


def dead_pid() -> int:
    import subprocess
    import sys

    return int(
        subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    )


def test_keep_last_prunes_the_oldest_and_clears_stale_temporaries(tmp_path):
    stale = tmp_path / "checkpoints" / f".step-000009.tmp-{dead_pid()}"  # a save whose process died
    stale.mkdir(parents=True)
    run_sft(
        load_config(
            SFTConfig,
            None,
            SFT + ["train.max_steps=8", "train.save_every=2", "train.keep_last=2", f"train.output_dir={tmp_path}"],
        )
    )
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000006", "step-000008"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000006", "step-000008"]
    saved = torch.load(tmp_path / "checkpoints" / "step-000008" / "trainer_state.pt", weights_only=False)
    assert saved["step"] == 8
    run_sft(
        load_config(
            SFTConfig,
            None,
            SFT
            + [
                "train.max_steps=12",
                "train.save_every=2",
                "train.keep_last=0",
                "train.resume=auto",
                f"train.output_dir={tmp_path}",
            ],
        )
    )
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step-000006",
        "step-000008",
        "step-000010",
        "step-000012",
    ]  # 0 keeps everything


def test_resume_from_a_path_without_a_checkpoint_names_it(tmp_path):
    with pytest.raises(ConfigError, match=r"train.resume='.*nowhere'.*no checkpoint there.*trainer_state.pt"):
        resolve_resume(str(tmp_path / "nowhere"), tmp_path / "run")
    assert resolve_resume("auto", tmp_path / "empty-run") is None  # auto on a fresh run: start from scratch
    ARGS = [
        "data.task=addition",
        "data.num_train=32",
        "data.num_val=8",
        "data.num_eval=0",
        "model.tokenizer=char",
        "model.hidden_size=32",
        "model.num_layers=1",
        "model.num_heads=2",
        "train.max_steps=1",
        "logging.progress=false",
        f"train.output_dir={tmp_path / 'run'}",
    ]
    with pytest.raises(ConfigError, match="no checkpoint there"):
        run_sft(load_config(SFTConfig, None, ARGS + [f"train.resume={tmp_path / 'nowhere'}"]))


@pytest.mark.parametrize("other", [dict(layers=2), dict(hidden=16)], ids=["more-layers", "other-width"])
def test_resume_into_a_different_model_names_the_checkpoint(tmp_path, other):
    run_sft(
        load_config(SFTConfig, None, SFT + ["train.max_steps=2", "train.save_every=2", f"train.output_dir={tmp_path}"])
    )
    path = list_checkpoints(tmp_path)[-1]
    different, _ = tiny(**other)
    before = [p.detach().clone() for p in different.parameters()]
    with pytest.raises(ConfigError, match=f"checkpoint {path} does not match the model"):
        load_model_weights(different, path)
    assert all(torch.equal(a, p) for a, p in zip(before, different.parameters()))
