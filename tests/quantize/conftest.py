"""Fixtures: tiny Llama models with a real byte-level BPE tokenizer, built in-process (no downloads)."""

import pytest
from quant_helpers import TEXT, make_model_dir


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory):
    from lmforge.model.tokenizer import train_bpe_tokenizer

    path = tmp_path_factory.mktemp("bpe") / "text.txt"
    path.write_text(TEXT)
    return train_bpe_tokenizer([path], vocab_size=300, min_frequency=2)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, bpe_tokenizer):
    """hidden 64, 2 layers, GQA 4/2 heads, vocab 320 (> the tokenizer's, as padded vocabularies are)."""
    return make_model_dir(tmp_path_factory.mktemp("tiny") / "model", bpe_tokenizer, 64, 128, vocab=320)


@pytest.fixture(scope="session")
def wide_dir(tmp_path_factory, bpe_tokenizer):
    """hidden 256, so that every matrix row is one TQ1_0 / TQ2_0 block of 256."""
    return make_model_dir(
        tmp_path_factory.mktemp("wide") / "model", bpe_tokenizer, 256, 256, layers=1, heads=4, kv_heads=4, vocab=512
    )
