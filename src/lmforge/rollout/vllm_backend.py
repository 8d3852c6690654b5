"""Optional vLLM rollout backend: the in-process engine's interface on a colocated vLLM ``LLM``.

CUDA only, one GPU, and unverified against a real vLLM in this repository (docs/vllm.md says what
is and is not checked). ``VLLMEngine.generate`` returns the same :class:`RolloutBatch` as
``engine.generate``; ``sync_weights(model)`` copies the trainer's current parameters into vLLM's
model (call it before every rollout: the trainer has stepped since the last one).

How it is wired (facts read from the vLLM 0.33 source; the minimum is vLLM 0.10.2)
---------------------------------------------------------------------------------------
* Colocated and in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set before the ``LLM`` is
  built, so vLLM's engine core and its single GPU worker live in the trainer's process. Then
  ``LLM.collective_rpc(fn, args=...)`` calls ``fn(worker, *args)`` directly: the weight list
  crosses no process boundary and is never serialised, and ``load_weights`` copies each tensor
  GPU-to-GPU into vLLM's own (bf16) parameters.
* A trainer ``nn.Module`` is handed to vLLM as its config and tokenizer in a temporary directory,
  loaded with ``load_format="dummy"`` (random weights, nothing read from disk) and synced at once.
* One vLLM request per row (``n=1``; a prompt's G copies are adjacent, so rows of a group stay
  adjacent and vLLM returns them in input order), each with its own seed drawn from
  ``params.seed``. ``ignore_eos=True`` so that, as in the in-process engine, only
  ``params.stop_token_ids`` (and ``stop_strings``) end a row; the stop token is kept.

Which distribution the logprobs are of
--------------------------------------
The engine is built with ``logprobs_mode="processed_logprobs"`` and each request asks for
``logprobs=0`` (the sampled token only). vLLM's sampler then reports ``log_softmax`` of the
logits after temperature and top-k / top-p masking -- the renormalised distribution it drew from,
the in-process engine's convention (engine.py module doc). With temperature 0 vLLM samples
greedily and reports ``log_softmax(logits)``, untempered, again as the in-process engine does.
(vLLM's default, ``raw_logprobs``, is of the untempered model distribution and would bias every
importance weight; vLLM < 0.10.2 has no ``logprobs_mode`` and is refused.) vLLM computes them in
float32 from its own bf16 forward pass, so they differ from the trainer's recomputation by
numerical noise: exactly what ``algo.is_level`` corrects for.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import random
import tempfile
from typing import Any, Sequence

import torch

from ..core.errors import ConfigError
from ..model import lora
from .engine import RolloutBatch, SamplingParams, left_pad

INSTALL_HINT = (
    "the vLLM rollout backend needs vLLM >= 0.10.2 on a CUDA machine: pip install vllm "
    "(it brings its own CUDA build of torch); or use rollout.backend=inprocess"
)
# Name fragments that wrappers add to parameter names and vLLM's checkpoint names lack.
_WRAPPER_FRAGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def import_vllm():
    """The ``vllm`` module, after checking for CUDA and for ``logprobs_mode`` (vLLM >= 0.10.2).

    Also sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (process-wide) so that an ``LLM`` built
    afterwards runs in this process, which the weight sync relies on.
    """
    if not torch.cuda.is_available():
        raise ConfigError(
            "rollout.backend=vllm needs a CUDA GPU and this machine has none; use rollout.backend=inprocess"
        )
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"vLLM is not installed: {INSTALL_HINT}") from exc
    if "logprobs_mode" not in {f.name for f in dataclasses.fields(vllm.EngineArgs)}:
        raise ImportError(
            f"vLLM {getattr(vllm, '__version__', '?')} is too old: it has no logprobs_mode, so "
            "its logprobs are of the untempered distribution, not the one it samples from; "
            f"{INSTALL_HINT}"
        )
    return vllm


def row_seeds(seed: int | None, num_rows: int) -> list[int | None]:
    """One seed per request, all a function of ``seed`` (None: vLLM's own randomness)."""
    if seed is None:
        return [None] * num_rows
    rng = random.Random(seed)
    return [rng.randrange(2**31) for _ in range(num_rows)]


def vllm_sampling_params(vllm, params: SamplingParams, num_rows: int) -> list:
    """``params`` as one ``vllm.SamplingParams`` per row (see the module doc for each choice)."""
    if params.stop_strings:
        text = {"stop": list(params.stop_strings)}  # matched by vLLM on its own detokenised text
    else:
        text = {"detokenize": False}  # nothing reads the text; spare the CPU
    # top_k "off" is -1 in older vLLM and 0 in newer: take the installed version's default.
    top_k = params.top_k if params.top_k > 0 else vllm.SamplingParams().top_k
    return [
        vllm.SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=top_k,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,
            logprobs=0,
            seed=seed,
            **text,
        )
        for seed in row_seeds(params.seed, num_rows)
    ]


def to_rollout_batch(
    outputs: Sequence[Any],
    prompts: Sequence[Sequence[int]],
    num_samples: int,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
) -> RolloutBatch:
    """vLLM ``RequestOutput`` list -> :class:`RolloutBatch` with the in-process engine's layout.

    ``outputs`` in request order: either one request per row (B outputs of one completion each)
    or one per prompt with ``num_samples`` completions each; both flatten to the B rows in group
    order. Completions are right-padded to the longest (C); the mask covers every returned token,
    the stop token included; a row is truncated unless it ended on a stop token or vLLM reports
    ``finish_reason == "stop"`` (a stop string). Logprobs are read from each position's
    ``{token_id: Logprob}`` entry for the sampled token; 0 off the mask.
    """
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id)  # (N, P)
    completions = [c for request in outputs for c in request.outputs]
    num_rows = len(prompts) * num_samples
    if len(completions) != num_rows:
        raise ValueError(
            f"expected {num_rows} completions ({len(prompts)} prompts x {num_samples}), "
            f"vLLM returned {len(completions)}"
        )
    width = max((len(c.token_ids) for c in completions), default=0)
    completion_ids = torch.full((num_rows, width), pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((num_rows, width), dtype=torch.long)
    logprobs = torch.zeros((num_rows, width), dtype=torch.float32)
    truncated = torch.zeros(num_rows, dtype=torch.bool)
    stops = set(stop_token_ids)
    for row, c in enumerate(completions):
        tokens = list(c.token_ids)
        if c.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended row {row} with finish_reason={c.finish_reason!r} (aborted?)")
        if tokens and c.logprobs is None:
            raise RuntimeError("vLLM returned no logprobs; requests must set logprobs=0")
        completion_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        completion_mask[row, : len(tokens)] = 1
        for t, token in enumerate(tokens):
            entry = c.logprobs[t]
            if token not in entry:
                raise RuntimeError(f"vLLM's logprobs for row {row}, position {t} lack the sampled token {token}")
            logprobs[row, t] = entry[token].logprob
        truncated[row] = not (c.finish_reason == "stop" or (tokens and tokens[-1] in stops))
    return RolloutBatch(
        prompt_ids=prompt_ids.repeat_interleave(num_samples, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(num_samples, dim=0),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        logprobs=logprobs,
        group_index=torch.arange(len(prompts)).repeat_interleave(num_samples),
        prompt_lens=prompt_mask.sum(1).repeat_interleave(num_samples),
        completion_lens=completion_mask.sum(1),
        truncated=truncated,
    )


def _vllm_name(name: str) -> str:
    """A trainer parameter name as a checkpoint name: wrapper fragments (torch.compile,
    activation checkpointing, FSDP) and a leading DDP ``module.`` removed."""
    for fragment in _WRAPPER_FRAGMENTS:
        name = name.replace(fragment, "")
    return name.removeprefix("module.")


def vllm_named_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(checkpoint name, tensor)`` for every distinct parameter of ``model``, detached, no copy.

    Names are Hugging Face checkpoint names, which vLLM's ``load_weights`` maps to its fused
    layers (qkv_proj, gate_up_proj) itself. A tied parameter (``lm_head.weight`` is
    ``model.embed_tokens.weight``) is sent once, under its non-``lm_head`` name: vLLM's tied
    model loads the embedding and skips or rejects a lone ``lm_head.weight``.
    """
    names_of: dict[int, list[str]] = {}
    params: dict[int, torch.Tensor] = {}
    # A LoRA policy sends its merged weights W + scale * B A (computed out of place, docs/lora.md).
    adapted = lora.has_adapters(model)
    source = lora.merged_named_parameters(model) if adapted else model.named_parameters(remove_duplicate=False)
    for name, param in source:
        key = param.data_ptr() if adapted else id(param)  # (merged tensors are new objects; ties share memory)
        names_of.setdefault(key, []).append(_vllm_name(name))
        params[key] = param
    weights = []
    for key, names in names_of.items():
        preferred = [n for n in names if "lm_head" not in n.split(".")] or names
        weights.append((preferred[0], params[key].detach()))
    return weights


def load_weights_on_worker(worker, weights: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Runs inside vLLM's worker via ``collective_rpc``: load ``weights`` into its model.

    Returns the names of vLLM parameters that no weight reached (they would keep stale or, after
    a dummy load or a level-2 sleep, garbage values); empty when the load is complete.
    """
    get_model = getattr(worker, "get_model", None)
    model = get_model() if callable(get_model) else worker.model_runner.model
    expected = {name for name, _ in model.named_parameters()}
    loaded = model.load_weights(weights)
    if loaded is None:  # some model classes do not report what they loaded
        return []
    return sorted(expected - set(loaded))


def _write_model_files(model: torch.nn.Module, tokenizer, directory: str) -> None:
    """What vLLM reads to build ``model`` without weights: config.json (with the architecture
    name vLLM dispatches on) and the tokenizer."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


class VLLMEngine:
    """A colocated vLLM ``LLM`` behind the in-process engine's interface (module doc).

    ``model``: the trainer's Hugging Face causal LM (an ``nn.Module``, unwrapped: its class name
    selects vLLM's architecture; built with dummy weights, then synced) or a model path / hub id
    (vLLM loads its weights). ``gpu_memory_utilization``: the fraction of the GPU's total memory
    vLLM reserves for its weights, activations and KV cache; the trainer keeps the rest, and the
    fraction must be free when the engine is built. ``enable_sleep_mode`` allows :meth:`sleep`.
    ``llm_kwargs`` go to ``vllm.LLM`` unchanged (e.g. ``enforce_eager=True``).
    """

    def __init__(
        self,
        model: torch.nn.Module | str,
        tokenizer,
        gpu_memory_utilization: float = 0.3,
        dtype: str = "bfloat16",
        seed: int = 0,
        max_model_len: int | None = None,
        enable_sleep_mode: bool = False,
        **llm_kwargs,
    ):
        vllm = import_vllm()
        self._vllm, self.tokenizer, self.max_model_len = vllm, tokenizer, max_model_len
        self.enable_sleep_mode = enable_sleep_mode
        self._awake, self._weights_valid = True, True
        self._model_dir = None  # keeps the temporary directory alive as long as the engine
        kwargs: dict[str, Any] = dict(
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_sleep_mode=enable_sleep_mode,
            logprobs_mode="processed_logprobs",
        )
        if isinstance(model, torch.nn.Module):
            self._model_dir = tempfile.TemporaryDirectory(prefix="lmforge-vllm-")
            _write_model_files(model, tokenizer, self._model_dir.name)
            path, kwargs["load_format"] = self._model_dir.name, "dummy"
        else:
            path = str(model)
        self.llm = vllm.LLM(model=path, **{**kwargs, **llm_kwargs})
        if getattr(self.llm.llm_engine, "model_executor", None) is None:
            raise RuntimeError(
                "vLLM runs its engine core in a separate process here, so sync_weights cannot reach its "
                "model; build the engine before anything else uses vLLM in this process, with "
                "VLLM_ENABLE_V1_MULTIPROCESSING unset or 0"
            )
        if isinstance(model, torch.nn.Module):
            self.sync_weights(model)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        num_samples: int = 1,
        pad_token_id: int | None = None,
    ) -> RolloutBatch:
        """Sample ``num_samples`` completions per prompt; the same batch as ``engine.generate``.

        ``pad_token_id`` defaults to the tokenizer's pad token (else 0). Stop strings are matched
        by vLLM on its own detokenisation, so no ``decode_fn`` is needed.
        """
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if not self._awake or not self._weights_valid:
            raise RuntimeError(
                "the vLLM engine is asleep or its weights were discarded; call "
                "sync_weights(model) (or wake_up() after a level-1 sleep) before generate"
            )
        if self.max_model_len is not None and prompts:
            longest = max(len(p) for p in prompts) + params.max_new_tokens
            if longest > self.max_model_len:
                raise ValueError(
                    f"a prompt plus max_new_tokens is {longest} tokens, over the engine's "
                    f"max_model_len={self.max_model_len}"
                )
        if pad_token_id is None:
            pad_token_id = getattr(self.tokenizer, "pad_token_id", None)
            pad_token_id = 0 if pad_token_id is None else pad_token_id
        left_pad(prompts, pad_token_id)  # the same input checks (and messages) as the in-process engine
        requests = [{"prompt_token_ids": list(p)} for p in prompts for _ in range(num_samples)]
        sampling = vllm_sampling_params(self._vllm, params, len(requests))
        outputs = self.llm.generate(requests, sampling_params=sampling, use_tqdm=False)
        return to_rollout_batch(outputs, prompts, num_samples, params.stop_token_ids, pad_token_id)

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Copy ``model``'s current parameters into vLLM's model and drop its prefix cache.

        Cost: one on-device copy of every parameter (no host round trip, no extra copy of the
        model). After a sleep, vLLM's weight memory is woken first and its KV cache only after
        the load, so the two are never allocated next to a third copy.
        """
        rpc = getattr(self.llm, "collective_rpc", None)
        if rpc is None:
            raise RuntimeError(
                f"this vLLM ({getattr(self._vllm, '__version__', '?')}) has no "
                f"LLM.collective_rpc to load weights with; {INSTALL_HINT}"
            )
        weights = vllm_named_weights(model)
        if not self._awake:
            self.llm.wake_up(tags=["weights"])
        missing = sorted({name for per_worker in rpc(load_weights_on_worker, args=(weights,)) for name in per_worker})
        if not self._awake:
            self.llm.wake_up(tags=["kv_cache"])
            self._awake = True
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        if missing:
            self._weights_valid = False
            raise RuntimeError(
                f"vLLM parameters not reached by the trainer's weights: {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''}; the trainer and vLLM models differ"
            )
        self._weights_valid = True

    def sleep(self, level: int = 2) -> None:
        """Free vLLM's GPU memory while the trainer steps. Level 1 offloads the weights to CPU
        memory and drops the KV cache; level 2 drops both (the next ``sync_weights`` restores
        the weights, so level 2 costs no host copy and is the one to use between RL steps)."""
        if not self.enable_sleep_mode:
            raise RuntimeError("sleep() needs VLLMEngine(..., enable_sleep_mode=True)")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self.llm.sleep(level=level)
        self._awake = False
        self._weights_valid = self._weights_valid and level == 1

    def wake_up(self) -> None:
        """Reallocate everything ``sleep`` freed (after level 2, ``sync_weights`` is still needed)."""
        self.llm.wake_up()
        self._awake = True
