"""Helpers of the quantize tests: tiny Llama models with a real byte-level BPE tokenizer, built in-process."""

import importlib.util

import pytest
import torch

HAS_CT = importlib.util.find_spec("compressed_tensors") is not None
HAS_GGUF = importlib.util.find_spec("gguf") is not None
needs_ct = pytest.mark.skipif(not HAS_CT, reason="needs compressed-tensors (pip install 'lmforge[quant]')")
needs_gguf = pytest.mark.skipif(not HAS_GGUF, reason="needs gguf (pip install 'lmforge[gguf]')")

TEXT = (
    "the quick brown fox jumps over the lazy dog. 12+34=46 and 58+7=65.\n" * 40
    + "hello world, this is a small test of the tokenizer and the model.\n" * 20
)
PROMPT = "the quick brown fox 12+34=46, hello"


def make_model_dir(root, tokenizer, hidden, intermediate, layers=2, heads=4, kv_heads=2, seed=0, vocab=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab or len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # a scale where quantization error shows in the logits
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def logits_of(model, tokenizer, text=PROMPT):
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        return model(ids).logits[0]


def load_plain(path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
