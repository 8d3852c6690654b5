"""Checkpoints: pruning to ``keep_last``, clearing a dead process's temporary directory, and resume
errors a user can act on (no checkpoint at the path, a checkpoint of another model)."""
import pytest
import torch

from lmforge.checkpoint import list_checkpoints, load_model_weights, resolve_resume, save_checkpoint
from lmforge.config import ModelConfig, load_config
from lmforge.errors import ConfigError
from lmforge.models import load_model
from lmforge.recipes.sft import SFTConfig, run_sft


def tiny(hidden=32, layers=1):
    return load_model(ModelConfig(name="tiny:llama", tokenizer="char", hidden_size=hidden, num_layers=layers,
                                  num_heads=2, max_position_embeddings=32))


def test_keep_last_prunes_the_oldest_and_clears_stale_temporaries(tmp_path):
    model, tok = tiny()
    (tmp_path / "checkpoints" / ".step-000009.tmp-4242").mkdir(parents=True)  # a save that died
    for step in (2, 4, 6, 8):
        save_checkpoint(tmp_path, step, model, tok, {"marker": step}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000006", "step-000008"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000006", "step-000008"]
    saved = torch.load(tmp_path / "checkpoints" / "step-000008" / "trainer_state.pt", weights_only=False)
    assert (saved["marker"], saved["step"]) == (8, 8)
    save_checkpoint(tmp_path, 10, model, tok, {}, keep_last=0)  # 0 keeps everything
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000006", "step-000008", "step-000010"]


def test_resume_from_a_path_without_a_checkpoint_names_it(tmp_path):
    with pytest.raises(ConfigError, match=r"train.resume='.*nowhere'.*no checkpoint there.*trainer_state.pt"):
        resolve_resume(str(tmp_path / "nowhere"), tmp_path / "run")
    assert resolve_resume("auto", tmp_path / "empty-run") is None  # auto on a fresh run: start from scratch
    ARGS = ["data.task=addition", "data.num_train=32", "data.num_val=8", "data.num_eval=0", "model.tokenizer=char",
            "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "train.max_steps=1",
            "logging.progress=false", f"train.output_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match="no checkpoint there"):
        run_sft(load_config(SFTConfig, None, ARGS + [f"train.resume={tmp_path / 'nowhere'}"]))


@pytest.mark.parametrize("other", [dict(layers=2), dict(hidden=16)], ids=["more-layers", "other-width"])
def test_resume_into_a_different_model_names_the_checkpoint(tmp_path, other):
    model, tok = tiny()
    path = save_checkpoint(tmp_path, 2, model, tok, {}, keep_last=0)
    different, _ = tiny(**other)
    before = [p.detach().clone() for p in different.parameters()]
    with pytest.raises(ConfigError, match=f"checkpoint {path} does not match the model"):
        load_model_weights(different, path)
    assert all(torch.equal(a, p) for a, p in zip(before, different.parameters()))
