"""Antidistillation sampling (ADS; Savani et al. 2025): proxy gradient, logit adjustment, sampler.

The teacher samples token x from

    softmax( z_teacher / T + lam * (z_proxy(theta + eps*g) - z_proxy(theta - eps*g)) / (2*eps) )

where g is the proxy student's average gradient of its completion-only NLL on held-out teacher
traces (``proxy_gradient``). The central difference is the directional derivative of the proxy's
log-probabilities along g, i.e. (up to a learning rate) how much one SGD step of the proxy on token
x would *raise* its held-out loss. docs/antidistillation.md has the derivation and conventions.

Pieces, in pipeline order:
  proxy_gradient -> save_gradient / load_gradient -> perturbed_copies -> ads_generate (ads_logits)

Shapes: B = rows, T = sequence positions, V = vocabulary, P = padded prompt length, C = completion.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from ..core.errors import DataError
from ..core.ops import selective_log_softmax
from ..rollout.engine import (
    RolloutBatch,
    SamplingParams,
    decode_step,
    expand_cache,
    left_pad,
    lockstep_decode,
    make_cache,
    prefill,
    sample_token,
)

# The objective proxy_gradient averages; also written into the saved file's metadata.
OBJECTIVE = "mean over sequences of each sequence's mean completion-token NLL"

_LEADING_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP / DataParallel, torch.compile
_WRAPPER_INFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")  # FSDP1, activation ckpt
_INT_META = ("num_sequences", "num_tokens", "world_size")
_FLOAT_META = ("grad_norm",)


# ----------------------------------------------------------------------------- parameter names


def clean_param_name(name: str) -> str:
    """Parameter name as the bare model spells it: drops wrapper path components.

    Removes leading ``module.`` (DDP, DataParallel) and ``_orig_mod.`` (torch.compile), repeatedly,
    and ``_fsdp_wrapped_module.`` / ``_checkpoint_wrapped_module.`` anywhere.
    """
    for infix in _WRAPPER_INFIXES:
        name = name.replace(infix, "")
    while name.startswith(_LEADING_WRAPPER_PREFIXES):
        name = name.split(".", 1)[1]
    return name


def unwrap_model(model: nn.Module) -> nn.Module:
    """Peel DistributedDataParallel / DataParallel (``.module``) and torch.compile (``._orig_mod``)."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def _clean_named_parameters(model: nn.Module, trainable_only: bool) -> dict[str, nn.Parameter]:
    """{clean name: parameter}; tied parameters appear once (as ``named_parameters`` yields them)."""
    out: dict[str, nn.Parameter] = {}
    for raw_name, param in model.named_parameters():
        if trainable_only and not param.requires_grad:
            continue
        name = clean_param_name(raw_name)
        if name in out:
            raise ValueError(
                f"parameter names {raw_name!r} and another both clean to {name!r}; "
                "the model itself uses a wrapper prefix as a submodule name"
            )
        out[name] = param
    return out


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32 and narrower floats; fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


# ----------------------------------------------------------------------------- proxy gradient


def _unpack_batch(batch: Any, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch is a mapping with input_ids / attention_mask / loss_mask or a 3-tuple of them."""
    if isinstance(batch, Mapping):
        missing = [k for k in ("input_ids", "attention_mask", "loss_mask") if k not in batch]
        if missing:
            raise ValueError(
                f"batch {index} lacks {missing}; proxy_gradient needs input_ids, "
                "attention_mask and loss_mask (1 on completion tokens), each (B, T)"
            )
        return batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    if isinstance(batch, (tuple, list)) and len(batch) == 3:
        return tuple(batch)
    raise ValueError(
        f"batch {index} is a {type(batch).__name__}; pass a mapping or a tuple (input_ids, attention_mask, loss_mask)"
    )


def sequence_mean_nll(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    batch_index: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence mean NLL over completion tokens, with autograd. Returns (nll (B,), num_tokens (B,)).

    input_ids, attention_mask, loss_mask: (B, T). ``loss_mask[b, t] = 1`` when token ``input_ids[b, t]``
    is a completion token whose NLL (predicted from position t-1) counts; column 0 is never a target.
    Log-softmax runs in fp32 (fp64 for fp64 models). Position ids count real tokens, so either
    padding side works.
    """
    if not input_ids.shape == attention_mask.shape == loss_mask.shape:
        raise ValueError(
            f"batch {batch_index}: input_ids {tuple(input_ids.shape)}, attention_mask "
            f"{tuple(attention_mask.shape)} and loss_mask {tuple(loss_mask.shape)} must match"
        )
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    logits = out.logits if hasattr(out, "logits") else out  # (B, T, V)
    logits = logits[:, :-1].to(_compute_dtype(logits.dtype))
    logprobs = selective_log_softmax(logits, input_ids[:, 1:])  # (B, T-1)
    mask = (loss_mask[:, 1:] * attention_mask[:, 1:]).to(logprobs.dtype)  # (B, T-1)
    num_tokens = mask.sum(1)  # (B,)
    if bool((num_tokens == 0).any()):
        rows = (num_tokens == 0).nonzero().flatten().tolist()
        raise ValueError(
            f"batch {batch_index}: rows {rows} have no completion tokens in loss_mask "
            "(after column 0); drop such traces before computing the proxy gradient"
        )
    return -(logprobs * mask).sum(1) / num_tokens, num_tokens


def _all_reduce_sums(sums: dict[str, torch.Tensor], counts: torch.Tensor) -> int:
    """SUM-reduce the gradient sums and counts in place across ranks; returns the world size."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    for tensor in sums.values():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return dist.get_world_size()


def proxy_gradient(
    model: nn.Module, batches: Iterable[Any], *, model_id: str = "", progress: Callable[[int, int], None] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Average gradient of the proxy's completion-only NLL on held-out teacher traces.

    The objective (``OBJECTIVE``) is ``L = (1/N) sum_i mean_{t in completion_i} -log p(x_t | x_<t)``
    over the N sequences of all batches on all ranks, as in the reference code (batch size 1).
    Each batch contributes the *sum* of its per-sequence means, so batch sizes do not change the
    result. Under an initialised ``torch.distributed`` group the fp32 sums and counts are SUM-reduced
    and divided by the global N on every rank; every rank must call this (ranks may hold different
    numbers of batches). DDP is bypassed for the forward so it does no gradient sync of its own.

    batches: iterable of mappings (or tuples) ``input_ids, attention_mask, loss_mask``, each (B, T).
    Runs in eval mode (no dropout) and clears ``.grad``. ``progress(num_batches, num_sequences_local)``
    is called after each batch. Returns ``(grads, meta)``: grads maps the bare model's parameter names
    (wrapper prefixes removed) to fp32 (fp64 for fp64 models) tensors; meta holds num_sequences,
    num_tokens, world_size, grad_norm, model_id, objective.
    """
    forward_model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    params = _clean_named_parameters(model, trainable_only=True)
    if not params:
        raise ValueError("the proxy has no trainable parameters; call model.requires_grad_(True)")
    device = next(iter(params.values())).device  # inputs go where the first parameter (embeddings) is
    sums = {n: torch.zeros(p.shape, dtype=_compute_dtype(p.dtype), device=p.device) for n, p in params.items()}
    counts = torch.zeros(2, dtype=torch.long, device=device)  # (num_sequences, num_tokens)
    was_training = model.training
    model.eval()
    try:
        for index, batch in enumerate(batches):
            input_ids, attention_mask, loss_mask = (t.to(device) for t in _unpack_batch(batch, index))
            nll, num_tokens = sequence_mean_nll(forward_model, input_ids, attention_mask, loss_mask, index)
            for p in params.values():
                p.grad = None
            nll.sum().backward()
            for name, p in params.items():
                if p.grad is not None:
                    sums[name] += p.grad.to(sums[name].dtype)
            counts[0] += nll.shape[0]
            counts[1] += num_tokens.sum().long()
            if progress is not None:
                progress(index + 1, int(counts[0]))
    finally:
        for p in params.values():
            p.grad = None
        model.train(was_training)
    world_size = _all_reduce_sums(sums, counts)
    num_sequences_global, num_tokens_global = (int(c) for c in counts)
    if num_sequences_global == 0:
        raise ValueError("no sequences were seen on any rank; the held-out trace set is empty")
    grads = {name: s / num_sequences_global for name, s in sums.items()}
    grad_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    meta = {
        "num_sequences": num_sequences_global,
        "num_tokens": num_tokens_global,
        "world_size": world_size,
        "grad_norm": grad_norm,
        "model_id": model_id,
        "objective": OBJECTIVE,
    }
    return grads, meta


# ----------------------------------------------------------------------------- save / load


def save_gradient(grads: Mapping[str, torch.Tensor], meta: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Write grads as safetensors with ``meta`` as string metadata (atomic rename).

    Call on one rank only (every rank holds the same reduced gradient). Names are cleaned of wrapper
    prefixes again here, so a gradient from another tool loads against the bare model.
    """
    from safetensors.torch import save_file

    tensors = {}
    for name, tensor in grads.items():
        clean = clean_param_name(name)
        if clean in tensors:
            raise ValueError(f"gradient names collide after removing wrapper prefixes: {clean!r}")
        tensors[clean] = tensor.detach().cpu().contiguous()
    if not tensors:
        raise ValueError("refusing to save an empty gradient")
    metadata = {str(k): ("" if v is None else repr(v) if isinstance(v, float) else str(v)) for k, v in meta.items()}
    tmp_path = f"{os.fspath(path)}.tmp"
    save_file(tensors, tmp_path, metadata=metadata)
    os.replace(tmp_path, path)


def load_gradient(
    path: str | os.PathLike, device: str | torch.device = "cpu"
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a file written by ``save_gradient``. Returns (grads, meta); counts come back as int,
    grad_norm as float, everything else as str."""
    from safetensors import safe_open

    grads = {}
    try:
        with safe_open(os.fspath(path), framework="pt", device=str(device)) as f:
            metadata = dict(f.metadata() or {})
            for name in f.keys():
                grads[name] = f.get_tensor(name)
    except Exception as exc:  # safetensors raises SafetensorsError (and OSError) on a bad file
        raise DataError(
            f"{path}: cannot read the proxy gradient ({type(exc).__name__}: {exc}); the file is "
            "truncated or corrupt: run `lmforge antidistill grad` again"
        ) from exc
    meta: dict[str, Any] = dict(metadata)
    for key in _INT_META:
        if key in meta:
            meta[key] = int(meta[key])
    for key in _FLOAT_META:
        if key in meta:
            meta[key] = float(meta[key])
    return grads, meta


# ----------------------------------------------------------------------------- perturbed proxies


def perturbed_copies(proxy: nn.Module, grads: Mapping[str, torch.Tensor], eps: float) -> tuple[nn.Module, nn.Module]:
    """Two frozen eval-mode copies of ``proxy`` with parameters theta + eps*g and theta - eps*g.

    The update is computed in fp32 (fp64 for fp64 models) and then cast to the parameter dtype.
    Every gradient name must match a parameter (after removing wrapper prefixes); parameters without
    a gradient (frozen ones) are left as they are. ``proxy`` itself is not modified; delete it after
    this call if memory is tight.
    """
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (the paper uses ~1e-2), got {eps}")
    base = unwrap_model(proxy)
    params = _clean_named_parameters(base, trainable_only=False)
    clean_grads = {clean_param_name(k): v for k, v in grads.items()}
    unknown = sorted(set(clean_grads) - set(params))
    if unknown:
        raise ValueError(
            f"{len(unknown)} gradient names match no proxy parameter, e.g. {unknown[:5]}; "
            "was the gradient computed for a different proxy model?"
        )
    for name, g in clean_grads.items():
        if tuple(g.shape) != tuple(params[name].shape):
            raise ValueError(
                f"gradient {name!r} has shape {tuple(g.shape)} but the parameter has "
                f"{tuple(params[name].shape)}; was the gradient computed for a different proxy?"
            )
    copies = []
    for sign in (1.0, -1.0):
        model = copy.deepcopy(base).eval().requires_grad_(False)
        with torch.no_grad():
            for name, p in _clean_named_parameters(model, trainable_only=False).items():
                if name in clean_grads:
                    work = _compute_dtype(p.dtype)
                    g = clean_grads[name].to(device=p.device, dtype=work)
                    p.copy_((p.to(work) + (sign * eps) * g).to(p.dtype))
        copies.append(model)
    return copies[0], copies[1]


# ----------------------------------------------------------------------------- the ADS logits


def ads_logits(
    teacher_logits: torch.Tensor,
    plus_logits: torch.Tensor,
    minus_logits: torch.Tensor,
    temperature: float,
    lam: float,
    eps: float,
) -> torch.Tensor:
    """Adjusted logits ``z_teacher / T + lam * (z_plus - z_minus) / (2 * eps)`` (paper convention).

    All inputs (..., V) of the same shape; returns fp32 (fp64 if any input is fp64). The term is
    added *after* temperature scaling, so lam means the same at every T; the reference code adds it
    before and on a gradient divided by its world size (see ``lam_from_reference``). ``z_plus`` / ``z_minus`` may
    be proxy logits or proxy
    log-softmax outputs: they differ by a per-row constant, which softmax ignores. lam = 0 returns
    ``z_teacher / T`` exactly (for finite proxy logits).
    """
    if not temperature > 0:
        raise ValueError(f"ADS needs temperature > 0, got {temperature}; greedy decoding has no distribution to adjust")
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (the paper uses ~1e-2), got {eps}")
    if not teacher_logits.shape == plus_logits.shape == minus_logits.shape:
        raise ValueError(
            f"teacher {tuple(teacher_logits.shape)}, proxy+ {tuple(plus_logits.shape)} and proxy- "
            f"{tuple(minus_logits.shape)} logits differ in shape; if only the (padded) vocabulary "
            "sizes differ, pass vocab_size=len(tokenizer) to ads_generate"
        )
    dtype = _compute_dtype(torch.promote_types(teacher_logits.dtype, plus_logits.dtype))
    scaled = teacher_logits.to(dtype) / temperature
    return scaled + lam * (plus_logits.to(dtype) - minus_logits.to(dtype)) / (2 * eps)


def lam_from_reference(lam_reference: float, temperature: float, reference_world_size: int) -> float:
    """Paper-convention lam from the reference code's lam, for a gradient saved by ``W`` processes.

    Two factors. (1) The reference adds ``lam_ref/(2 eps_ref) * diff`` to the logits *before* dividing
    by T, i.e. it samples softmax(z/T + (lam_ref/T) * diff/(2 eps_ref)). (2) Its ``save_grad.py`` ran
    under DDP (accelerate): every backward averaged the gradient over the ``W`` ranks, and the later
    cross-rank sum was returned in a new tensor and discarded, so the saved gradient is
    ``g_ref = g / W`` (g: the mean gradient over all traces). Perturbing by ``eps_ref * g_ref`` is
    perturbing by ``(eps_ref / W) * g``, and ``diff/(2 eps_ref)`` is ``1/W`` of the directional
    derivative along g. Together: ``lam = lam_ref / (W * T)``, with ``eps = eps_ref / W``
    (``eps_from_reference``); both are exact, not first-order. The reference runs used W = 8.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    _check_world_size(reference_world_size)
    return lam_reference / (reference_world_size * temperature)


def eps_from_reference(eps_reference: float, reference_world_size: int) -> float:
    """The eps on the true mean gradient that moves the proxies as far as the reference's ``eps_ref``
    did on its DDP-averaged gradient (``g / W``, see ``lam_from_reference``): ``eps = eps_ref / W``."""
    if not eps_reference > 0:
        raise ValueError(f"eps_reference must be > 0, got {eps_reference}")
    _check_world_size(reference_world_size)
    return eps_reference / reference_world_size


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"reference_world_size must be the number of processes save_grad.py ran on "
            f"(an int >= 1; the paper's runs used 8), got {world_size!r}"
        )


# ----------------------------------------------------------------------------- control direction


def random_direction(grads: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A random direction with the same names, shapes, dtypes and global L2 norm as ``grads``.

    Gaussian entries from a CPU generator seeded with ``seed`` (same seed, same direction on any
    device), drawn in the sorted order of the names, then scaled so that the norm over all tensors
    equals ``grads``' norm. The control for ADS: proxies perturbed along it tilt the teacher as much
    (per unit of eps) but in a direction unrelated to the proxy's held-out loss.
    """
    if not grads:
        raise ValueError("random_direction needs a non-empty gradient")
    generator = torch.Generator().manual_seed(seed)
    target = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    if not target > 0:
        raise ValueError("the gradient is zero; a norm-matched random direction would be zero too")
    draws = {name: torch.randn(grads[name].shape, generator=generator, dtype=torch.float64) for name in sorted(grads)}
    scale = target / math.sqrt(sum(float(d.pow(2).sum()) for d in draws.values()))
    return {name: (draws[name] * scale).to(device=g.device, dtype=g.dtype) for name, g in grads.items()}


# ----------------------------------------------------------------------------- tokenizers

_SPECIAL_ID_ATTRS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def check_same_tokenizer(tok_a: Any, tok_b: Any, names: tuple[str, str] = ("teacher", "proxy")) -> None:
    """Raise ValueError unless the two tokenizers map the same tokens to the same ids.

    ADS adds proxy logits to teacher logits id by id, so id i must be the same token in both.
    Compares ``len(tok)``, the bos/eos/pad/unk ids and ``get_vocab()``; the message names what differs.
    """
    a, b = names
    problems = []
    if len(tok_a) != len(tok_b):
        problems.append(f"vocabulary size {a}={len(tok_a)} vs {b}={len(tok_b)}")
    for attr in _SPECIAL_ID_ATTRS:
        id_a, id_b = getattr(tok_a, attr, None), getattr(tok_b, attr, None)
        if id_a != id_b:
            problems.append(f"{attr} {a}={id_a} vs {b}={id_b}")
    vocab_a, vocab_b = tok_a.get_vocab(), tok_b.get_vocab()
    differing = sorted(t for t in set(vocab_a) | set(vocab_b) if vocab_a.get(t) != vocab_b.get(t))
    if differing:
        examples = ", ".join(f"{t!r}: {a}={vocab_a.get(t)} vs {b}={vocab_b.get(t)}" for t in differing[:5])
        problems.append(f"{len(differing)} tokens have different ids, e.g. {examples}")
    if problems:
        raise ValueError(
            f"{a} and {b} tokenizers differ, but ADS needs token ids to mean the same thing "
            f"in both (use a proxy from the teacher's family): " + "; ".join(problems)
        )


# ----------------------------------------------------------------------------- lockstep sampler


@dataclass
class AdsRolloutBatch(RolloutBatch):
    """``RolloutBatch`` whose ``logprobs`` are under the ADS distribution that was sampled from (after
    top-k / top-p), plus the tempered teacher's log-probabilities of the same tokens."""

    teacher_logprobs: torch.Tensor  # (B, C) float32, log_softmax(z_teacher / T)[token], no truncation; 0 off-mask
    kl: torch.Tensor  # (B, C) float32, KL(ADS || tempered teacher) of each step's full distributions; 0 off-mask


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _check_ads_params(params: SamplingParams, eps: float) -> None:
    if not params.temperature > 0:
        raise ValueError(f"ADS needs temperature > 0, got {params.temperature}; use rollout.generate for greedy")
    if params.stop_strings:
        raise ValueError(
            "ads_generate supports stop_token_ids only; drop stop_strings (or cut the completions afterwards)"
        )
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (the paper uses ~1e-2), got {eps}")


@torch.inference_mode()
def ads_generate(
    teacher: nn.Module,
    proxy_plus: nn.Module,
    proxy_minus: nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    lam: float,
    eps: float,
    *,
    num_samples: int = 1,
    pad_token_id: int = 0,
    vocab_size: int | None = None,
) -> AdsRolloutBatch:
    """Antidistillation sampling: the teacher and the two perturbed proxies decode in lockstep.

    Each model prefills every prompt once (cache shared by the prompt's ``num_samples`` rows) and keeps
    its own KV cache; each step's sampled tokens are fed to all three. Token t is drawn with the rollout
    engine's ``sample_token`` from ``ads_logits(...)`` with ``params``' top-k / top-p applied to the
    adjusted logits, using ``params.seed``. With lam = 0 the tokens equal ``rollout.generate(teacher,
    ...)`` token for token. All three models run in eval mode (no dropout; ``generate`` does the same)
    and get their previous modes back afterwards. ``vocab_size`` keeps only the first ``vocab_size`` logits of
    every model
    (for models whose embedding matrices are padded to different sizes).
    """
    _check_ads_params(params, eps)
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    models = (teacher, proxy_plus, proxy_minus)
    modes = [model.training for model in models]
    try:
        for model in models:
            model.eval()  # no dropout: lam = 0 must be rollout.generate, which samples in eval mode
        return _ads_generate(models, prompts, params, lam, eps, num_samples, pad_token_id, vocab_size)
    finally:
        for model, mode in zip(models, modes):
            model.train(mode)


def _ads_generate(
    models,
    prompts,
    params: SamplingParams,
    lam: float,
    eps: float,
    num_samples: int,
    pad_token_id: int,
    vocab_size: int | None,
) -> AdsRolloutBatch:
    teacher = models[0]
    device = _model_device(teacher)
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id)  # (N, P)
    generator = None if params.seed is None else torch.Generator(device=device).manual_seed(params.seed)
    caches, logits = [], []
    for model in models:
        model_device = _model_device(model)
        cache = make_cache(model, capacity=prompt_ids.shape[1] + params.max_new_tokens)
        last, cache = prefill(model, prompt_ids.to(model_device), prompt_mask.to(model_device), cache)  # (N, V)
        caches.append(expand_cache(cache, num_samples))
        logits.append(last.repeat_interleave(num_samples, dim=0).to(device))  # (B, V)
    prompt_ids = prompt_ids.repeat_interleave(num_samples, dim=0)
    prompt_mask = prompt_mask.repeat_interleave(num_samples, dim=0)
    ids, mask, logprobs, teacher_logprobs, kl, finished = _ads_decode_loop(
        models, caches, logits, prompt_mask.to(device), params, lam, eps, pad_token_id, generator, vocab_size
    )
    return AdsRolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=ids.cpu(),
        completion_mask=mask.cpu(),
        logprobs=logprobs.cpu(),
        group_index=torch.arange(len(prompts)).repeat_interleave(num_samples),
        prompt_lens=prompt_mask.sum(1),
        completion_lens=mask.sum(1).cpu(),
        truncated=~finished.cpu(),
        teacher_logprobs=teacher_logprobs.cpu(),
        kl=kl.cpu(),
    )


def _ads_decode_loop(
    models,
    caches,
    logits,
    prompt_mask,
    params: SamplingParams,
    lam: float,
    eps: float,
    pad_token_id: int,
    generator,
    vocab_size: int | None,
    check_every: int = 4,
):
    """Lockstep sampling of [teacher, plus, minus]. logits: their (B, V) logits; prompt_mask (B, P).

    Returns (ids, mask, logprobs, teacher_logprobs, kl) each (B, C) and finished (B,). ``kl`` is the
    exact KL(softmax(adjusted) || softmax(z_teacher / T)) of each step, over the whole vocabulary
    (before top-k / top-p), so it does not depend on the token drawn. The rollout
    engine's loop (``rollout.engine.lockstep_decode``: same RNG use, same stop rule) with the ADS
    logits in place of the teacher's, so that lam = 0 reproduces the engine exactly.
    """
    device = prompt_mask.device
    adjusted_params = dataclasses.replace(params, temperature=1.0)  # ads_logits already divided by T

    def pick(step: int):
        z_teacher, z_plus, z_minus = (z[:, :vocab_size] for z in logits)
        adjusted = ads_logits(z_teacher, z_plus, z_minus, params.temperature, lam, eps)  # (B, V)
        tokens, token_logprobs = sample_token(adjusted, adjusted_params, generator)  # (B,), (B,)
        teacher_all = torch.log_softmax(z_teacher.to(adjusted.dtype) / params.temperature, dim=-1)  # (B, V)
        ads_all = torch.log_softmax(adjusted, dim=-1)  # (B, V)
        kl = (ads_all.exp() * (ads_all - teacher_all)).sum(-1)  # (B,)
        return tokens, token_logprobs, (teacher_all.gather(-1, tokens[:, None]).squeeze(-1), kl)

    def advance(tokens, attention_mask, positions):
        for i, model in enumerate(models):
            model_device = _model_device(model)
            step_logits, caches[i] = decode_step(
                model, tokens.to(model_device), caches[i], attention_mask.to(model_device), positions.to(model_device)
            )
            logits[i] = step_logits.to(device)

    ids, mask, logprobs, (teacher_logprobs, kl), finished = lockstep_decode(
        pick, advance, prompt_mask, params, pad_token_id, check_every=check_every, num_extras=2
    )
    return ids, mask, logprobs, teacher_logprobs, kl, finished
