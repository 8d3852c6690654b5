"""Quantizing lmforge's own outputs (issue 22): a GGUF it wrote quantizes again, and a group size
that does not fit is answered with the ones that do, never with itself."""

import pytest
from quant_helpers import make_model_dir, needs_ct, needs_gguf

from lmforge.cli import main
from lmforge.quantize import QuantizeError, quantize


@needs_gguf
def test_lmforge_gguf_quantizes_again_and_loads_with_its_own_vocabulary(bpe_tokenizer, tmp_path, monkeypatch):
    """A model whose embedding has exactly the tokenizer's 300 rows (as lmforge's runs do): its GGUF
    read back by transformers gained an ``<|endoftext|>`` at id 300 (GPT-2's default unknown token),
    so quantizing it to GGUF again failed on '301 tokens, the model embeds 300' and loading it for
    training on '301 > 300'."""
    from lmforge.core.config import ModelConfig
    from lmforge.model.load import load_model

    monkeypatch.setenv("LMFORGE_CACHE", str(tmp_path / "cache"))
    source = make_model_dir(tmp_path / "m", bpe_tokenizer, 64, 128, layers=1)
    (gguf_file,) = quantize(str(source), "gguf-f16", tmp_path / "g").files
    again = quantize(str(gguf_file), "gguf-q8_0", tmp_path / "g2")
    assert again.files[0].stat().st_size > 0
    model, tokenizer = load_model(ModelConfig(name=str(gguf_file)))
    assert len(tokenizer) == model.get_input_embeddings().num_embeddings == len(bpe_tokenizer) == 300
    assert tokenizer.eos_token == bpe_tokenizer.eos_token and tokenizer.pad_token == bpe_tokenizer.pad_token
    assert max(tokenizer.encode("the cat <|endoftext|> sat", add_special_tokens=False)) < 300
    assert main(["dequantize", str(gguf_file), "--out", str(tmp_path / "hf")]) == 0


@needs_ct
def test_a_group_size_that_does_not_divide_suggests_the_ones_that_do(tiny_dir, tmp_path):
    """hidden 64: int4-g128 does not divide; the hint used to say 'e.g. int4-g32' whatever failed."""
    with pytest.raises(QuantizeError, match="use int4-g32 or int4-g64, whose group size divides them"):
        quantize(str(tiny_dir), "int4-g128", tmp_path / "x")


@needs_ct
def test_no_int4_group_size_fits_says_what_to_use_instead(bpe_tokenizer, tmp_path):
    """hidden 48: int4-g32 failed and its hint suggested int4-g32."""
    odd = make_model_dir(tmp_path / "odd", bpe_tokenizer, 48, 80, layers=1, heads=4, kv_heads=4)
    with pytest.raises(
        QuantizeError,
        match=r"no int4 group size lmforge offers divides the widths \[48, 80\]: "
        "use int8 or fp8",
    ) as info:
        quantize(str(odd), "int4-g32", tmp_path / "x")
    assert "int4-g32" not in str(info.value).split(";", 1)[1]
