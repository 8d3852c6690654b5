"""Weight updates for ``lmforge serve``: the server's loaders and the trainer's ``push_weights``.

Two ways to hand a server new weights:

* ``POST /v1/weights {"checkpoint_dir": DIR, "version": K}``: the server reads the safetensors of DIR
  (an lmforge checkpoint ``step-N/`` holding ``model/``, or a plain HF model directory). Cheapest
  when trainer and server share a filesystem; nothing but a path crosses the wire.
* ``POST /v1/weights/tensors?version=K`` with a safetensors-serialised state dict as the body (no
  pickle: the server never unpickles what a client sends). Works across machines.

Either way the server applies the weights between two decode steps once no running row was sampled
with the old ones (``scheduler.py``) and answers ``{"weight_version": K}``. Versions must increase;
without ``version`` the server adds one.
"""

from __future__ import annotations

from pathlib import Path

import torch


class WeightsError(ValueError):
    """The weights do not fit the served model (names, shapes) or cannot be read; the server answers 400."""


def _safetensors_dir(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise WeightsError(f"checkpoint_dir {str(path)!r} is not a directory on the server")
    for candidate in (path / "model", path):
        if sorted(candidate.glob("*.safetensors")):
            return candidate
    raise WeightsError(f"checkpoint_dir {str(path)!r} holds no *.safetensors (looked in it and in its model/)")


def read_checkpoint_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict stored in the safetensors files of a checkpoint or HF model directory."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(_safetensors_dir(path).glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def read_tensor_bytes(payload: bytes) -> dict[str, torch.Tensor]:
    """A state dict from safetensors bytes (the body of ``POST /v1/weights/tensors``)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    if not payload:
        raise WeightsError("the request body is empty; send a safetensors-serialised state dict")
    try:
        return load(payload)
    except (SafetensorError, ValueError) as exc:
        raise WeightsError(f"the request body is not a safetensors state dict: {exc}") from exc


def check_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Raise ``WeightsError`` unless ``state`` has exactly the model's tensors (tied ones may be absent)."""
    own = model.state_dict()
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(own) - set(state) - tied)
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise WeightsError(
            f"the weights do not match the served model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    wrong = [(k, tuple(state[k].shape), tuple(own[k].shape)) for k in state if state[k].shape != own[k].shape]
    if wrong:
        name, got, want = wrong[0]
        raise WeightsError(f"weight {name} has shape {got}, the served model's is {want} ({len(wrong)} tensors differ)")


def copy_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a checked state dict into ``model`` in place (cast to each parameter's dtype and device)."""
    with torch.no_grad():
        own = model.state_dict()
        for name, tensor in state.items():
            own[name].copy_(tensor)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


# ----------------------------------------------------------------------------- trainer side


def plain_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights under the plain HF names, detached: a model with LoRA adapters merged
    (``W + scale * B A``), which is what a server holding the plain model expects."""
    from ..model import lora

    unwrapped = getattr(model, "module", model)
    unwrapped = getattr(unwrapped, "_orig_mod", unwrapped)
    state = unwrapped.state_dict()
    if lora.has_adapters(unwrapped):
        merged = dict(lora.merged_named_parameters(unwrapped))
        state = {
            lora.plain_name(name): merged.get(lora.plain_name(name), tensor)
            for name, tensor in state.items()
            if ".lora_" not in name
        }
    return {name: t.detach() for name, t in state.items()}


def state_dict_bytes(model: torch.nn.Module) -> bytes:
    """``model``'s :func:`plain_state` as safetensors bytes (tied tensors are cloned: safetensors refuses
    shared memory)."""
    from safetensors.torch import save

    return save({name: t.to("cpu").clone().contiguous() for name, t in plain_state(model).items()})


def push_weights(
    server_url: str,
    model: torch.nn.Module | None = None,
    *,
    checkpoint_dir: str | Path | None = None,
    version: int | None = None,
    timeout: float = 600.0,
) -> int:
    """Hand new weights to an ``lmforge serve`` at ``server_url``; returns the server's new version.

    Give either ``model`` (its state dict is sent over HTTP) or ``checkpoint_dir`` (a directory the
    server can read: only the path is sent). ``version`` is normally the trainer's optimizer step, so
    that staleness = trainer step - the version that sampled a batch. Blocks until the server has
    finished the rows sampled with the old weights and switched.
    """
    import httpx

    url, request = weights_request(server_url, model, checkpoint_dir=checkpoint_dir, version=version)
    response = httpx.post(url, timeout=timeout, **request)
    if response.status_code != 200:
        raise RuntimeError(
            f"{server_url.rstrip('/')} refused the weight update ({response.status_code}): {response.text}"
        )
    return int(response.json()["weight_version"])


def weights_request(
    server_url: str,
    model: torch.nn.Module | None = None,
    *,
    checkpoint_dir: str | Path | None = None,
    version: int | None = None,
) -> tuple[str, dict]:
    """The POST that hands new weights to ``lmforge serve``: (url, httpx keyword arguments). Shared by
    :func:`push_weights` and the Atropos trainer's retried push (``lmforge.rl.sources.atropos``)."""
    if (model is None) == (checkpoint_dir is None):
        raise ValueError("push_weights needs exactly one of model= or checkpoint_dir=")
    base = server_url.rstrip("/")
    if checkpoint_dir is not None:
        return f"{base}/v1/weights", {"json": {"checkpoint_dir": str(checkpoint_dir), "version": version}}
    return f"{base}/v1/weights/tensors", {
        "content": state_dict_bytes(model),
        "params": {} if version is None else {"version": version},
        "headers": {"content-type": "application/octet-stream"},
    }
