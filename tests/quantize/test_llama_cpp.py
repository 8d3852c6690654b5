"""llama.cpp itself reads the exported GGUF files: same tokens, close logits (skipped without the binding).

The binding is ``llama-cpp-python`` (only an sdist on PyPI: it compiles llama.cpp, minutes of CPU).
On a CPU that reports AMX, build it with ``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON
-DGGML_F16C=ON"``: a native build used AMX tile instructions that this VM does not allow (SIGILL).
"""

import importlib.util

import numpy as np
import pytest
import torch
from quant_helpers import PROMPT, load_plain, needs_gguf
from transformers import AutoTokenizer

from lmforge.quantize import dequantize, quantize

pytestmark = [
    needs_gguf,
    pytest.mark.skipif(
        importlib.util.find_spec("llama_cpp") is None, reason="needs llama-cpp-python (pip install llama-cpp-python)"
    ),
]


def _llama_logits(path, ids):
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=1)
    llm.eval(ids)
    return llm, torch.tensor(np.array(llm.scores[: len(ids)]), dtype=torch.float32)


# measured with llama-cpp-python 0.3.36 (CPU, AVX2): 0.0014, 0.0128, 0.0171, 0.0239
@pytest.mark.parametrize(
    "fmt,tol", [("gguf-f16", 0.005), ("gguf-q8_0", 0.03), ("gguf-q4_0", 0.04), ("gguf-tq2_0", 0.05)]
)
def test_llama_cpp_tokenizes_and_computes_like_the_dequantized_model(wide_dir, tmp_path, fmt, tol):
    tok = AutoTokenizer.from_pretrained(wide_dir)
    path = quantize(str(wide_dir), fmt, tmp_path / "g").files[0]
    text = PROMPT + " <|user|>"
    ids = tok.encode(text, add_special_tokens=False)
    llm, logits = _llama_logits(path, ids)
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids
    dequantize(path, tmp_path / "hf")  # the same quantized weights, computed by transformers in fp32
    with torch.no_grad():
        ref = load_plain(tmp_path / "hf")(torch.tensor([ids])).logits[0]
    err = ((logits - ref).abs().max() / ref.abs().max()).item()
    assert err < tol, err  # llama.cpp quantizes activations to 8 bits for Q8_0 / Q4_0 / TQ matmuls


def test_llama_cpp_runs_a_qwen2_export_with_biases(bpe_tokenizer, tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=128,
        )
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "qwen")
    bpe_tokenizer.save_pretrained(tmp_path / "qwen")
    tok = AutoTokenizer.from_pretrained(tmp_path / "qwen")  # transformers' Qwen2 tokenizer: qwen2 split regex
    path = quantize(str(tmp_path / "qwen"), "gguf-f16", tmp_path / "g").files[0]
    text = PROMPT + " 12345 <|user|>"
    ids = tok.encode(text, add_special_tokens=False)
    llm, logits = _llama_logits(path, ids)
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    assert ((logits - ref).abs().max() / ref.abs().max()).item() < 0.005
