"""Bad input gets an error that names the problem; the CLI commands; the char tokenizer in GGUF."""

import json

import pytest
from quant_helpers import load_plain, logits_of, make_model_dir, needs_ct, needs_gguf
from transformers import AutoTokenizer

from lmforge.cli import main
from lmforge.quantize import QuantizeError, dequantize, quantize


def test_unknown_format_lists_the_valid_ones(tiny_dir, tmp_path):
    with pytest.raises(QuantizeError, match="unknown format 'int3'; valid formats: int8, int4-g32, .*gguf-q4_0"):
        quantize(str(tiny_dir), "int3", tmp_path / "x")
    from lmforge.quantize import canonical_format

    assert [canonical_format(n) for n in ("q4_0", "Q8_0", "tq2_0", "int8", "gguf-f16")] == [
        "gguf-q4_0",
        "gguf-q8_0",
        "gguf-tq2_0",
        "int8",
        "gguf-f16",
    ]
    with pytest.raises(QuantizeError, match="unknown format 'q4_k'"):
        canonical_format("q4_k")  # not implemented in the gguf package's Python quantizers


@needs_ct
def test_group_size_that_does_not_divide(tiny_dir, tmp_path):
    # hidden 64: int4-g128 does not divide the attention / gate / up input width
    with pytest.raises(QuantizeError, match="group size 128 does not divide .*in_features 64"):
        quantize(str(tiny_dir), "int4-g128", tmp_path / "x")
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.tmp").exists()  # nothing half-written


@needs_ct
def test_int4_g128_on_a_model_it_divides(bpe_tokenizer, tmp_path):
    d = make_model_dir(tmp_path / "m", bpe_tokenizer, 128, 256, layers=1, vocab=320)
    tok = AutoTokenizer.from_pretrained(d)
    quantize(str(d), "int4-g128", tmp_path / "q")
    err = (logits_of(load_plain(tmp_path / "q"), tok) - logits_of(load_plain(d), tok)).abs().max()
    assert 1e-4 < err.item() / logits_of(load_plain(d), tok).abs().max().item() < 0.4


@needs_ct
def test_already_quantized_and_not_empty_output(tiny_dir, tmp_path):
    quantize(str(tiny_dir), "int8", tmp_path / "q")
    with pytest.raises(QuantizeError, match="already quantized .*compressed-tensors.*lmforge dequantize"):
        quantize(str(tmp_path / "q"), "fp8", tmp_path / "q2")
    with pytest.raises(QuantizeError, match="exists and is not empty"):
        quantize(str(tiny_dir), "int8", tmp_path / "q")


def test_truncated_ternary_file_names_the_file(tiny_dir, tmp_path):
    quantize(str(tiny_dir), "ternary", tmp_path / "t")
    path = tmp_path / "t" / "ternary.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(QuantizeError, match=f"{path}: cannot read"):
        dequantize(tmp_path / "t", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@needs_ct
def test_truncated_compressed_tensors_file_names_the_file(tiny_dir, tmp_path):
    quantize(str(tiny_dir), "int8", tmp_path / "q")
    path = tmp_path / "q" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(QuantizeError, match=f"{path}: cannot read"):
        dequantize(tmp_path / "q", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_corrupt_trits_name_the_file_and_tensor(tiny_dir, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    quantize(str(tiny_dir), "ternary", tmp_path / "t")
    path = tmp_path / "t" / "ternary.safetensors"
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    tensors["model.layers.1.mlp.up_proj.weight_packed"][0] = 255  # code 3 is not a trit
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(QuantizeError, match="ternary.safetensors: model.layers.1.mlp.up_proj.weight_packed: .*code 3"):
        dequantize(tmp_path / "t", tmp_path / "hf")


@needs_gguf
def test_truncated_gguf_names_the_file(tiny_dir, tmp_path):
    path = quantize(str(tiny_dir), "gguf-q8_0", tmp_path / "g").files[0]
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(QuantizeError, match=f"{path}: not a readable GGUF"):
        dequantize(path, tmp_path / "hf")


@needs_gguf
def test_gguf_of_an_architecture_it_cannot_describe(bpe_tokenizer, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=320, n_embd=32, n_layer=1, n_head=2)).save_pretrained(tmp_path / "gpt2")
    bpe_tokenizer.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(QuantizeError, match="GGUF export supports the model types llama, qwen2; this model is 'gpt2'"):
        quantize(str(tmp_path / "gpt2"), "gguf-q8_0", tmp_path / "g")


def test_dequantize_of_a_plain_model_is_an_error(tiny_dir, tmp_path):
    with pytest.raises(QuantizeError, match="not a quantized checkpoint"):
        dequantize(tiny_dir, tmp_path / "hf")


@needs_gguf
def test_char_tokenizer_cannot_go_to_gguf(tmp_path):
    from lmforge.core.config import ModelConfig
    from lmforge.model.load import load_model, save_model

    model, tok = load_model(ModelConfig(name="tiny:llama", tokenizer="char", hidden_size=32, num_layers=1, num_heads=4))
    save_model(model, tok, tmp_path / "m")
    with pytest.raises(QuantizeError, match="no BPE merges .*use a safetensors format"):
        quantize(str(tmp_path / "m"), "gguf-q8_0", tmp_path / "g")
    assert not (tmp_path / "g").exists()


@needs_ct
def test_cli_quantize_and_dequantize(tiny_dir, tmp_path, capsys):
    assert main(["quantize", str(tiny_dir), "--format", "int8", "--out", str(tmp_path / "q")]) == 0
    assert "wrote int8" in capsys.readouterr().out
    assert main(["dequantize", str(tmp_path / "q"), "--out", str(tmp_path / "hf")]) == 0
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    assert main(["quantize", str(tiny_dir), "--format", "int3", "--out", str(tmp_path / "z")]) == 2
    assert "valid formats: int8" in capsys.readouterr().err
