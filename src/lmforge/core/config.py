"""Typed configs: dataclass sections, YAML files, dotted CLI overrides.

A recipe's config is a dataclass whose fields are sections (dataclasses themselves). Every field is
declared with :func:`opt`, which records a one-line help text used by ``lmforge <cmd> --help``.

    cfg = load_config(SFTConfig, "run.yaml", ["optim.lr=3e-4", "train.max_steps=100"])

Unknown keys are errors that name the key and suggest the closest valid ones; values of the wrong
type are errors that name the key and the expected type. YAML is read as YAML 1.2 reads scalars, not
1.1: only ``true`` / ``false`` are booleans (``on``, ``off``, ``yes``, ``no`` stay words, so
``gradient_checkpointing: on`` means "on") and ``1e-4`` is a number; a key given twice in one mapping
is an error naming both lines (PyYAML would keep the last one silently).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import re
import traceback
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from .errors import ConfigError
from .fileio import read_text


def opt(
    default: Any,
    help: str,  # noqa: A002 - "help" reads best at call sites
    keys: tuple[str, ...] = (),
    free_on_resume: bool | str = False,
) -> Any:
    """A config field with a default and a one-line help text. ``keys``: for a mapping field, the only
    keys it may hold (e.g. the names ``data.columns`` can map); any other is an unknown-key error.
    ``free_on_resume``: the key only decides what is logged, evaluated or saved, when, or how fast the
    same computation runs, so a resumed run may change it (lmforge.runtime.resume_check); ``"unless_path"``:
    free unless its section reads a file (``path`` set), whose held-out rows it then sizes."""
    metadata = {
        "help": help,
        **({"keys": tuple(keys)} if keys else {}),
        **({"free_on_resume": free_on_resume} if free_on_resume else {}),
    }
    if isinstance(default, (list, dict)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section(cls: type, help: str = "") -> Any:  # noqa: A002
    """A field holding a nested config section."""
    return dataclasses.field(default_factory=cls, metadata={"help": help})


# ----------------------------------------------------------------------------- type checking


def refuse_ignored(cfg: Any, section_name: str, keys: tuple[str, ...], when: str) -> None:
    """ConfigError naming every key of ``keys`` that was set away from its default although ``when``
    makes the recipe ignore it (e.g. a column mapping next to a built-in task): a setting that does
    nothing should not look as if it did."""
    changed = []
    for field in dataclasses.fields(cfg):
        if field.name in keys:
            default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
            if getattr(cfg, field.name) != default:
                changed.append(f"{section_name}.{field.name}")
    if changed:
        raise ConfigError(
            f"{', '.join(changed)} {'is' if len(changed) == 1 else 'are'} not used {when}; remove "
            f"{'it' if len(changed) == 1 else 'them'}"
        )


def where_raised(exc: BaseException) -> str:
    """``file:line`` of a syntax error, else of the innermost frame of ``exc``'s traceback."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "(unknown place)"


def import_object(spec: str, label: str, kind: str) -> tuple[Any, str]:
    """The object a ``"package.module:attr"`` setting names (a user's reward function, environment
    class, ...) and the file it comes from; ``getattr``'s None when the module has no ``attr`` (the
    caller checks what it must be). ConfigError, led by ``label`` (e.g. ``"reward 'm:f'"``), when the
    spec is not of that form or its module cannot be imported; ``kind`` names ``attr`` in the
    message (``'package.module:function'``)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{label}: expected 'package.module:{kind}' with both parts non-empty")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{label}: cannot import module {module_name!r} ({exc}); is it installed or on PYTHONPATH?"
        ) from exc
    except Exception as exc:  # the module itself is broken: a syntax error, or code that raises on import
        raise ConfigError(
            f"{label}: importing module {module_name!r} failed at {where_raised(exc)}: {type(exc).__name__}: {exc}"
        ) from exc
    return getattr(module, attr, None), f"{module_name!r} ({getattr(module, '__file__', None) or module_name})"


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        (inner,) = get_args(tp) or (Any,)
        return f"list of {_type_name(inner)}"
    if origin is dict:
        key_tp, value_tp = get_args(tp) or (Any, Any)
        return f"mapping of {_type_name(key_tp)} to {_type_name(value_tp)}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a section (a mapping of its keys)"
    return getattr(tp, "__name__", str(tp))


def _shown(value: Any, key: str = "") -> str:
    """``value`` for an error message; an empty YAML value (``key:`` with nothing after it) and a
    missing space after a colon (YAML reads ``lr:1e-4`` as one word) say so."""
    if value is None:
        if ":" in key.rsplit(".", 1)[-1]:
            name, _, rest = key.rsplit(".", 1)[-1].partition(":")
            return (
                f"an empty value: YAML needs a space after the colon, '{name}: {rest}' (without it, "
                f"'{name}:{rest}' is one key with no value)"
            )
        return "an empty value (null)"
    if isinstance(value, (list, dict)):
        return f"a {'list' if isinstance(value, list) else 'mapping'} {value!r:.80}"
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z_][\w.]*:\S.*", value):
        name, _, rest = value.partition(":")
        return f"{value!r} (YAML needs a space after the colon: '{name}: {rest}')"
    return repr(value)


class _NonFinite(ConfigError):
    """A float setting given nan or inf (no setting means anything by them)."""


_MISMATCH = object()  # _scalar's "not this type"


def _scalar(value: Any, tp: type, key: str) -> Any:
    """``value`` as a bool, int, float or str (``tp``), from what YAML or the command line gives, or
    ``_MISMATCH``; a float given nan or inf raises ``_NonFinite``."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
            return value.lower() in ("true", "yes", "on", "1")
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                number = None
            if number is not None and number.is_integer():
                return int(number)
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise _NonFinite(f"config key '{key}': expected a finite number, got {value!r}")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    return _MISMATCH


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` converted to ``tp`` or raise ConfigError naming ``key``."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except _NonFinite:
                raise  # a float given nan/inf: say so, rather than "expected float or ..."
            except ConfigError:
                continue
        raise ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {_shown(value, key)}")
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {_shown(value, key)}")
    if origin is list:
        (inner,) = get_args(tp) or (Any,)
        if isinstance(value, str):  # "a,b,c" from the command line
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {_shown(value, key)}")
        return [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:  # e.g. data.columns: {prompt: question}
        key_tp, value_tp = get_args(tp) or (Any, Any)
        if not isinstance(value, dict):
            raise ConfigError(
                f"config key '{key}': expected {_type_name(tp)} (e.g. {{a: b}}), got {_shown(value, key)}"
            )
        return {_coerce(k, key_tp, key): _coerce(v, value_tp, f"{key}.{k}") for k, v in value.items()}
    if tp in (bool, int, float, str):
        converted = _scalar(value, tp, key)
        if converted is not _MISMATCH:
            return converted
    elif dataclasses.is_dataclass(tp):
        if value is None:  # "train:" with every key below it commented out
            value = {}
        if isinstance(value, dict):
            return _build(tp, value, key + ".")
        first = dataclasses.fields(tp)[0].name
        raise ConfigError(
            f"config section '{key}' must be a mapping of its keys, e.g. '{key}: {{{first}: ...}}' "
            f"or {key}.{first}=... on the command line; got {_shown(value, key)}"
        )
    raise ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {_shown(value, key)}")


def _unknown_key(key: str, prefix: str, valid: list[str], note: str = "") -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    hint = f" Did you mean: {', '.join(prefix + c for c in close)}?" if close else ""
    return ConfigError(f"unknown config key '{prefix}{key}'.{hint} Valid keys here: {', '.join(sorted(valid))}.{note}")


def _build(cls: type, values: dict, prefix: str = "") -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"config section '{prefix.rstrip('.')}' must be a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise _unknown_key(str(key), prefix, list(fields))
        kwargs[key] = _coerce(value, hints[key], prefix + key)
        allowed = fields[key].metadata.get("keys")
        for inner in kwargs[key] if allowed and isinstance(kwargs[key], dict) else ():
            if inner not in allowed:
                raise _unknown_key(
                    str(inner),
                    f"{prefix}{key}.",
                    list(allowed),
                    f" ({prefix}{key} maps these names to the data's own names; the data's other "
                    "columns pass through as they are)",
                )
    for name in fields:  # sections left out of the file are built too, so that they get validated
        if name not in kwargs and dataclasses.is_dataclass(hints[name]):
            kwargs[name] = _build(hints[name], {}, prefix + name + ".")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate()
    return obj


# ----------------------------------------------------------------------------- loading

_BOOL, _FLOAT = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:float"


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 scalars: booleans are only true / false (1.1 also turns on,
    off, yes, no, y, n into booleans, so ``gradient_checkpointing: on`` arrived as True), and ``1e-4``
    is a float (1.1 needs a dot: ``1.0e-4``)."""


_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_ConfigLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_ConfigLoader.add_implicit_resolver(  # after int: only numbers with an exponent and no dot are new here
    _FLOAT, re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"), list("-+0123456789.")
)


def _duplicate_key(node: Any, path: tuple = ()) -> tuple[str, int, int] | None:
    """(dotted key, first line, second line) of the first key given twice in one mapping of ``node``."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                line = key_node.start_mark.line + 1
                if key_node.value in seen:
                    return ".".join((*path, key_node.value)), seen[key_node.value], line
                seen[key_node.value] = line
            found = _duplicate_key(value_node, (*path, str(getattr(key_node, "value", "?"))))
            if found:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found = _duplicate_key(item, (*path[:-1], f"{path[-1]}[{i}]") if path else (f"[{i}]",))
            if found:
                return found
    return None


def parse_yaml(text: str, where: str) -> Any:
    """``text`` as YAML (1.2 scalars, see :class:`_ConfigLoader`); a key given twice in a mapping is a
    ConfigError naming it, ``where`` (the file or override) and both lines."""
    loader = _ConfigLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        duplicate = _duplicate_key(node)
        if duplicate:
            key, first, second = duplicate
            raise ConfigError(
                f"{where}: key '{key}' is given twice (lines {first} and {second}); YAML would keep "
                "only the last value without a word. Keep one of them"
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()


def parse_override(text: str) -> tuple[list[str], Any]:
    """'optim.lr=3e-4' -> (['optim', 'lr'], '3e-4' parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like section.key=value (e.g. optim.lr=3e-4)")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = parse_yaml(raw, f"override '{text}'") if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return path, value


def apply_overrides(values: dict, overrides: list[str]) -> dict:
    """Set each dotted override into the nested dict ``values`` (in place) and return it."""
    for text in overrides:
        path, value = parse_override(text)
        node = values
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{text}': '{part}' is a value, not a section")
            node = child
        node[path[-1]] = value
    return values


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = parse_yaml(read_text(path, "config file (YAML)", ConfigError), f"config file {path}")
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if data is None:  # naming a file that sets nothing is more likely a mistake than a wish for defaults
        raise ConfigError(
            f"config file {path} is empty (or only comments): it sets no key. Add the settings, "
            "or leave the file out to run with every default"
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping (key: value lines) at the top level, not a {type(data).__name__}"
        )
    return data


def load_config(cls: type, path: str | Path | None = None, overrides: list[str] | None = None) -> Any:
    """Build ``cls`` from an optional YAML file and dotted overrides (overrides win)."""
    values = read_yaml(path) if path else {}
    apply_overrides(values, list(overrides or []))
    return _build(cls, values)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every leaf option of ``cls``; used by ``--help``."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, prefix + f.name + "."))
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = "(required)"
        rows.append((prefix + f.name, repr(default), f.metadata.get("help", "")))
    return rows


def resume_free_keys(cfg: Any) -> set[str]:
    """The dotted keys of ``cfg`` (a config instance) that a resumed run may change (``opt(free_on_resume=...)``)."""
    free = set()
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            free |= {f"{f.name}.{key}" for key in resume_free_keys(value)}
        elif f.metadata.get("free_on_resume") is True or (
            f.metadata.get("free_on_resume") == "unless_path" and not getattr(cfg, "path", "")
        ):
            free.add(f.name)
    return free


# ----------------------------------------------------------------------------- shared sections


@dataclasses.dataclass
class LoraConfig:
    """LoRA adapters through PEFT (docs/lora.md); off while ``r`` is 0."""

    r: int = opt(0, "LoRA rank (0 = off: full fine-tuning); e.g. model.lora.r=8 trains rank-8 adapters only")
    alpha: float = opt(0.0, "LoRA scale numerator: the update is (alpha / r) B A (0 = 2 x r)")
    dropout: float = opt(0.0, "dropout on the adapters' input (training only)")
    target_modules: list[str] = opt(
        ["all-linear"], "module names to adapt (e.g. q_proj,v_proj); all-linear = every linear layer but the LM head"
    )
    save_merged: bool = opt(
        False, "also write the merged model (W + BA scale) as a plain HF directory: final/merged", free_on_resume=True
    )

    def validate(self) -> None:
        if self.r < 0:
            raise ConfigError(f"model.lora.r must be >= 0 (0 = off), got {self.r}")
        if self.alpha < 0:
            raise ConfigError(f"model.lora.alpha must be >= 0 (0 = 2 x r), got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        if self.r and not self.target_modules:
            raise ConfigError("model.lora.target_modules is empty: name the modules to adapt, or all-linear")


@dataclasses.dataclass
class ModelConfig:
    name: str = opt(
        "tiny:llama", "model spec: tiny:llama | tiny:qwen2 | HF dir | hub id | file.gguf | smollm2-135m-instruct"
    )
    tokenizer: str = opt(
        "",
        "tokenizer spec (HF dir, hub id, 'char', 'char:ascii' = printable ASCII, or a "
        "trained BPE dir); empty = the model's own",
    )
    hidden_size: int = opt(128, "tiny models: hidden size")
    num_layers: int = opt(4, "tiny models: number of transformer layers")
    num_heads: int = opt(4, "tiny models: attention heads")
    num_kv_heads: int = opt(0, "tiny models: key/value heads (0 = same as num_heads)")
    intermediate_size: int = opt(0, "tiny models: MLP width (0 = 4 x hidden_size)")
    max_position_embeddings: int = opt(512, "tiny models: longest sequence")
    init_seed: int = opt(0, "tiny models: seed of the random initialisation")
    lora: LoraConfig = section(LoraConfig, "LoRA adapters (off unless model.lora.r > 0)")

    def validate(self) -> None:
        if self.hidden_size % max(self.num_heads, 1):
            raise ConfigError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads ({self.num_heads})"
            )


@dataclasses.dataclass
class OptimConfig:
    lr: float = opt(1e-3, "peak learning rate")
    min_lr_ratio: float = opt(0.1, "final LR as a fraction of the peak (cosine / linear)")
    schedule: Literal["cosine", "linear", "constant"] = opt("cosine", "LR schedule after warmup")
    warmup_steps: int = opt(0, "linear warmup steps")
    weight_decay: float = opt(0.1, "decoupled (AdamW) weight decay")
    no_decay: list[str] = opt(["bias", "norm", "embed"], "parameter-name substrings excluded from weight decay")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.95, "AdamW beta2")
    eps: float = opt(1e-8, "AdamW epsilon")
    max_grad_norm: float = opt(1.0, "clip gradients to this global L2 norm (0 = no clipping)")

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclasses.dataclass
class TrainConfig:
    output_dir: str = opt("runs/run", "run directory (config, metrics, checkpoints)", free_on_resume=True)
    max_steps: int = opt(200, "optimizer steps", free_on_resume=True)
    batch_size: int = opt(
        0,
        "rows per optimizer step over all ranks (SFT / pretrain; 0 = 32; dpo / rm: "
        "pairs); RL: rollout.num_prompts x rollout.group_size, set by the recipe",
    )
    micro_batch_size: int = opt(
        0,
        "rows (dpo / rm: pairs) per forward pass on one rank (0 = chosen by hardware "
        "tier); only splits the batch: accumulation = batch_size / (micro_batch_size x ranks)",
        free_on_resume=True,
    )
    seed: int = opt(0, "seed for data order, sampling and dropout")
    device: str = opt("auto", "auto | cpu | cuda | cuda:N | mps", free_on_resume=True)
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = opt(
        "auto", "compute dtype (auto: fp32 on CPU, bf16 on recent GPUs)"
    )
    threads: int = opt(
        0,
        "CPU threads for torch (0 = the cores the load average leaves; lmforge hardware shows the choice)",
        free_on_resume=True,
    )
    gradient_checkpointing: Literal["auto", "on", "off"] = opt(
        "auto", "recompute activations in backward to save memory", free_on_resume=True
    )
    eval_every: int = opt(
        50, "evaluate (val loss, samples, accuracy) every N steps (0 = only at the end)", free_on_resume=True
    )
    save_every: int = opt(100, "checkpoint every N steps (0 = only best and final)", free_on_resume=True)
    keep_last: int = opt(2, "periodic checkpoints kept on disk", free_on_resume=True)
    resume: str = opt(
        "", "'' = fresh run, 'auto' = latest checkpoint in output_dir, or a checkpoint path", free_on_resume=True
    )
    resume_accept: list[str] = opt(
        [],
        "on resume: settings (keys or whole sections, e.g. [optim.lr] or [optim]) "
        "allowed to differ from the run's saved config.yaml; any other difference that "
        "changes the computation is an error (docs/training.md)",
        free_on_resume=True,
    )
    log_every: int = opt(10, "print a metrics line every N steps", free_on_resume=True)
    on_nonfinite: Literal["stop", "skip"] = opt(
        "stop",
        "a nan / inf loss or gradient norm: stop before the update, or skip that update (counted as skipped_updates)",
        free_on_resume=True,
    )
    max_nonfinite_skips: int = opt(
        3, "on_nonfinite=skip: stop after this many skipped updates in a row", free_on_resume=True
    )
    num_samples: int = opt(3, "generations printed and saved at each evaluation", free_on_resume=True)
    max_new_tokens: int = opt(32, "tokens generated per sample at evaluation", free_on_resume=True)
    qat: Literal["none", "ternary", "int4"] = opt(
        "none",
        "quantization-aware training: the decoder's linear layers "
        "compute with fake-quantized weights (ternary = BitNet b1.58 "
        "absmean, int4 = absmax per group of 32), straight-through "
        "gradients, full-precision master weights (docs/quantization.md)",
    )
    save_quantized: list[str] = opt(
        [],
        "formats of quantized copies written into best/ and final/ as "
        "quantized-<format>/ (e.g. [int8, gguf-q4_0]; lmforge quantize --help lists them)",
        free_on_resume=True,
    )

    def validate(self) -> None:
        if self.max_steps < 1:
            raise ConfigError(f"train.max_steps must be >= 1, got {self.max_steps}")
        if Path(self.output_dir).exists() and not Path(self.output_dir).is_dir():
            raise ConfigError(f"train.output_dir {self.output_dir!r} is a file; it must be a directory (or not exist)")
        for name in ("batch_size", "micro_batch_size"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0 (0 = automatic), got {getattr(self, name)}")


@dataclasses.dataclass
class ParallelConfig:
    strategy: Literal["ddp", "fsdp2"] = opt(
        "ddp",
        "data parallelism under torchrun: ddp (replicated model) or "
        "fsdp2 (sharded parameters, gradients and optimizer state)",
        free_on_resume=True,
    )
    grad_sync: Literal["native", "ring"] = opt(
        "native",
        "DDP gradient sum: native all-reduce, or lmforge's ring "
        "all-reduce (point-to-point, docs/algorithms/all-reduce.md)",
        free_on_resume=True,
    )
    timeout_s: float = opt(
        600.0, "a collective that waits longer than this fails (a dead rank never hangs the rest)", free_on_resume=True
    )


@dataclasses.dataclass
class LoggingConfig:
    progress: bool = opt(True, "show a progress bar", free_on_resume=True)
    tensorboard: bool = opt(False, "write TensorBoard events to output_dir/tb (needs tensorboard)", free_on_resume=True)
    wandb: bool = opt(False, "log to Weights & Biases (needs wandb)", free_on_resume=True)
    wandb_project: str = opt("lmforge", "wandb project name", free_on_resume=True)
