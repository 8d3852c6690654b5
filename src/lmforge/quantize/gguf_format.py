"""GGUF export (llama.cpp / Ollama / transformers' GGUF loader) and GGUF -> HF dequantization.

Written with the ``gguf`` package, whose Python quantizers do the math (per block of 32 weights for
Q8_0 / Q4_0: d = absmax / 127 or absmax / -8; per block of 256 for TQ1_0 / TQ2_0: d = absmax,
q = round(W / d) in {-1, 0, 1}). What lmforge adds is the llama layout:
  * tensor names through ``gguf.get_tensor_name_map`` (``model.layers.0.self_attn.q_proj`` ->
    ``blk.0.attn_q``); for llama the q and k projections are permuted to llama.cpp's rotary layout (the same
    permutation as llama.cpp's ``convert_hf_to_gguf.py``; transformers' loader undoes it);
  * which tensor gets which type: 1-D tensors (norms) stay F32; for TQ1_0 / TQ2_0 the token embedding
    and output matrix are F16 (ternary models keep those in higher precision); a matrix whose rows
    are not a multiple of the type's block size falls back to F16, and the writer prints which ones;
  * the tokenizer: byte-level BPE (``tokenizer.ggml.model = gpt2``) with its merges, token types and
    special ids, and the chat template. lmforge's char tokenizer (no merges) cannot be written: the
    ``gguf`` writer refuses an empty merges list and llama.cpp requires one.
Architectures: llama and qwen2 (no q/k permutation: llama.cpp runs qwen2 with the NeoX rotary
layout, as transformers does; q/k/v biases are written as ``blk.N.attn_q.bias`` ...). Others raise
an error naming the model type.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .catalog import DESCRIPTIONS
from .common import Format, QuantizeError, require

# transformers model_type -> (gguf.MODEL_ARCH member, permute q/k to llama.cpp's interleaved rotary layout)
ARCHS = {"llama": ("LLAMA", True), "qwen2": ("QWEN2", False)}
_TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "TQ1_0", "TQ2_0")
_FILE_TYPES = {
    "F16": "MOSTLY_F16",
    "BF16": "MOSTLY_BF16",
    "Q8_0": "MOSTLY_Q8_0",
    "Q4_0": "MOSTLY_Q4_0",
    "TQ1_0": "MOSTLY_TQ1_0",
    "TQ2_0": "MOSTLY_TQ2_0",
}
_PRE_TOKENIZERS = {"bytelevel": "gpt-2", "digits+bytelevel": "smollm"}  # llama.cpp's names (llama-vocab.cpp)


def _permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotary layout (halves) -> llama.cpp's (interleaved pairs), per head; (out, in) -> (out, in)."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`_permute_qk`."""
    return (
        weight.reshape(n_head, weight.shape[0] // n_head // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _check_arch(config) -> None:
    if config.model_type not in ARCHS:
        raise QuantizeError(
            f"GGUF export supports the model types {', '.join(ARCHS)}; this model is "
            f"{config.model_type!r}, whose layout lmforge cannot describe in GGUF"
        )
    if getattr(config, "use_sliding_window", False):
        raise QuantizeError("GGUF export: sliding-window attention is not described by this exporter")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise QuantizeError(f"GGUF export: rope scaling {rope.get('rope_type')!r} is not described by this exporter")
    if config.model_type == "llama" and (config.attention_bias or config.mlp_bias):
        raise QuantizeError("GGUF export: llama models with attention or MLP biases are not supported")


def _tensor_type(gguf, name: str, array: np.ndarray, qtype_name: str):
    """The GGML type of one tensor (see module docstring) and whether it fell back to F16."""
    T = gguf.GGMLQuantizationType
    if array.ndim == 1:
        return T.F32, False
    wanted = T[qtype_name]
    if qtype_name.startswith("TQ") and name in ("token_embd.weight", "output.weight"):
        return T.F16, False
    block, _ = gguf.GGML_QUANT_SIZES[wanted]
    if array.shape[-1] % block:
        return T.F16, True
    return wanted, False


def _pre_tokenizer_name(pre: dict, kinds: list[str]) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a byte-level pre-tokenizer (tokenizer.json's dict)."""
    if kinds == ["ByteLevel"]:
        return _PRE_TOKENIZERS["bytelevel"]
    if kinds == ["Digits", "ByteLevel"]:
        return _PRE_TOKENIZERS["digits+bytelevel"]
    if kinds == ["Split", "ByteLevel"]:
        # the split regexes transformers' GGUF loader knows by llama.cpp name (qwen2, llama3, ...)
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

        regex = pre["pretokenizers"][0].get("pattern", {}).get("Regex")
        for name, split in GGUF_PRE_TOKENIZER_SPLITS.items():
            if split == regex:
                return name
    raise QuantizeError(
        f"GGUF export: the pre-tokenizer {kinds or 'none'} has no llama.cpp name that lmforge "
        f"knows; llama.cpp could not reproduce this tokenization"
    )


def _bytelevel_tokens(tokenizer) -> tuple[list[str], list[str], str]:
    """``(tokens by id, merges, pre-tokenizer name)`` from a fast tokenizer, in byte-level spelling."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model = state["model"]
    if model.get("type") != "BPE":
        raise QuantizeError(f"GGUF export: tokenizer model {model.get('type')!r} is not supported (BPE only)")
    pre = state.get("pre_tokenizer") or {}
    kinds = [p["type"] for p in pre.get("pretokenizers", [pre])] if pre else []
    vocab = dict(model["vocab"])
    for added in state.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    if not model.get("merges"):
        # gguf cannot store an empty merges list and llama.cpp requires the key (lmforge's char tokenizer)
        raise QuantizeError(
            "GGUF export: the tokenizer has no BPE merges (a character tokenizer?); GGUF's "
            "byte-level BPE needs them. Train a BPE tokenizer (model.tokenizer / pretrain) or "
            "use a safetensors format (int8, int4-g32, fp8, ternary)"
        )
    pre_name = _pre_tokenizer_name(pre, kinds)
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    if [i for _, i in by_id] != list(range(len(by_id))):
        raise QuantizeError("GGUF export: the tokenizer's ids are not contiguous from 0")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return [t for t, _ in by_id], merges, pre_name


def _add_tokenizer(gguf, writer, tokenizer, vocab_size: int) -> None:
    tokens, merges, pre_name = _bytelevel_tokens(tokenizer)
    if len(tokens) > vocab_size:
        raise QuantizeError(f"GGUF export: tokenizer has {len(tokens)} tokens, the model embeds {vocab_size}")
    types = [gguf.TokenType.NORMAL] * len(tokens)
    for added_id, added in tokenizer.added_tokens_decoder.items():  # special -> CONTROL, else USER_DEFINED
        types[added_id] = gguf.TokenType.CONTROL if added.special else gguf.TokenType.USER_DEFINED
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]  # as llama.cpp's converter pads
    types += [gguf.TokenType.UNUSED] * (vocab_size - len(types))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_name)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for name, add in (
        ("bos", writer.add_bos_token_id),
        ("eos", writer.add_eos_token_id),
        ("unk", writer.add_unk_token_id),
        ("pad", writer.add_pad_token_id),
    ):
        token_id = getattr(tokenizer, f"{name}_token_id", None)
        if token_id is not None:
            add(token_id)
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)
    if getattr(tokenizer, "chat_template", None):
        writer.add_chat_template(tokenizer.chat_template)


def write_gguf(model, tokenizer, out_dir: Path, qtype_name: str) -> list[Path]:
    """Write ``out_dir/model-<TYPE>.gguf`` for a llama-architecture ``model``."""
    require("gguf", "gguf", "GGUF export")
    import gguf

    config = model.config
    _check_arch(config)
    if tokenizer is None:
        raise QuantizeError("GGUF export needs the model's tokenizer (no tokenizer files in the model directory)")
    path = out_dir / f"model-{qtype_name}.gguf"
    arch, permute = ARCHS[config.model_type]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[arch]])
    writer.add_name(Path(str(getattr(config, "_name_or_path", "") or "model")).name or "model")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType[_FILE_TYPES[qtype_name]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(gguf, writer, tokenizer, config.vocab_size)

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch], config.num_hidden_layers)
    fallbacks = []
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise QuantizeError(f"GGUF export: no GGUF name for tensor {hf_name!r}")
        array = tensor.detach().float().numpy()
        if permute and name.endswith("attn_q.weight"):
            array = _permute_qk(array, config.num_attention_heads)
        elif permute and name.endswith("attn_k.weight"):
            array = _permute_qk(array, config.num_key_value_heads)
        ttype, fell_back = _tensor_type(gguf, name, array, qtype_name)
        if fell_back:
            fallbacks.append(name)
        writer.add_tensor(name, gguf.quants.quantize(array, ttype), raw_dtype=ttype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if fallbacks:
        print(
            f"[lmforge] {qtype_name}: {len(fallbacks)} matrices have rows not divisible by the block size "
            f"and are stored as F16: {', '.join(fallbacks[:6])}{' ...' if len(fallbacks) > 6 else ''}"
        )
    return [path]


def find_gguf(source: Path) -> Path:
    """``source`` itself if it is a .gguf file, else the single .gguf file in the directory."""
    if source.is_file():
        return source
    found = sorted(source.glob("*.gguf"))
    if len(found) != 1:
        raise QuantizeError(f"{source}: expected exactly one .gguf file, found {len(found)}")
    return found[0]


def read_gguf(path: Path):
    """``(state_dict in HF names, config, tokenizer)`` from a llama / qwen2 GGUF, weights in fp32."""
    require("gguf", "gguf", "reading GGUF")
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..model.load import gguf_tokenizer

    try:
        reader = gguf.GGUFReader(str(path))
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer = gguf_tokenizer(path)
    except (ValueError, OSError, KeyError, IndexError) as exc:
        raise QuantizeError(f"{path}: not a readable GGUF file (corrupt or truncated?): {exc}") from exc
    if config.model_type not in ARCHS:
        raise QuantizeError(
            f"{path}: architecture {config.model_type!r}; lmforge dequantizes {', '.join(ARCHS)} GGUF files"
        )
    arch, permute = ARCHS[config.model_type]
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch], config.num_hidden_layers)
    with torch.device("meta"):  # the HF names this architecture has, without allocating it
        hf_names = list(AutoModelForCausalLM.from_config(config).state_dict())
    to_hf = {name_map.get_name(n, try_suffixes=(".weight", ".bias")): n for n in hf_names}
    state = {}
    for tensor in reader.tensors:
        if tensor.name not in to_hf:
            raise QuantizeError(f"{path}: unexpected tensor {tensor.name!r} for a {config.model_type} model")
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(
            [int(d) for d in reversed(tensor.shape)]
        )
        if permute and tensor.name.endswith("attn_q.weight"):
            array = _unpermute_qk(array, config.num_attention_heads)
        elif permute and tensor.name.endswith("attn_k.weight"):
            array = _unpermute_qk(array, config.num_key_value_heads)
        state[to_hf[tensor.name]] = torch.tensor(
            np.asarray(array, dtype=np.float32)
        )  # a copy: reader memory is read-only
    return state, config, tokenizer


def formats() -> list[Format]:
    bits = {"F16": 16.0, "BF16": 16.0, "Q8_0": 8.5, "Q4_0": 4.5, "TQ1_0": 1.6875, "TQ2_0": 2.0625}

    def make(qtype):
        return lambda model, tok, out: write_gguf(model, tok, out, qtype)

    return [Format(f"gguf-{t.lower()}", "gguf", bits[t], DESCRIPTIONS[f"gguf-{t.lower()}"], make(t)) for t in _TYPES]
