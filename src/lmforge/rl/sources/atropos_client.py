"""The trainer's side of the Atropos contract: register with the API server, pull scored batches, turn
them into lmforge's rollout structure.

Atropos (PyPI ``atroposlib``; its API server is ``run-api``) decouples sampling from training:
environments sample from an OpenAI-compatible server (``lmforge serve``), score the completions and
POST groups to ``/scored_data``; the trainer POSTs ``/register`` once, then GETs ``/batch`` (answered
``{"batch": null}`` until enough groups are queued) and, every few steps, pushes new weights to the
inference server (``weights.push_weights``). See docs/atropos.md for the sequence of calls.

One batch is a list of groups (one prompt each, the group's samples adjacent). Per group, per row:

* ``tokens``: prompt + completion token ids;
* ``masks``: -100 where the token is not trained on (the prompt), the token id where it is;
* ``scores``: one reward per row; ``inference_logprobs``: aligned with ``tokens``, 1.0 (a placeholder)
  on prompt positions and the sampler's logprob on completion positions;
* ``generation_params``: free-form; lmforge reads ``weight_version`` here (environments copy it from
  the ``weight_version`` field of lmforge serve's responses) to measure staleness.

``batch_to_rollout`` maps row r of a group to ``prompt = tokens[:first]`` and ``completion =
tokens[first:last + 1]``, where first / last are the first and last positions with a mask other than
-100, and trains on exactly the positions whose mask is not -100 (``RolloutBatch.trained_mask``).
A multi-turn row -- the model's turns with tool or environment output between them, masked -100 --
is one completion whose trained tokens are several spans; the masked tokens inside it are inputs
to the forward, never trained. Per-token ``advantages`` sent by an environment are refused (lmforge
computes advantages from ``scores`` with its configured estimator).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ...core.errors import LmforgeError
from ...rollout.engine import RolloutBatch, left_pad

IGNORE = -100  # Atropos's mask value for positions that are not trained on


class AtroposError(LmforgeError):
    """The Atropos API is unreachable, refused a call, or sent a batch lmforge cannot train on."""


_API_DOWN = "is the Atropos API server (`run-api`) running there? The run can be resumed once it is"


def _request(
    method: str,
    url: str,
    retries: int,
    backoff_s: float,
    timeout: float = 30.0,
    *,
    action: str = "",
    remedy: str = _API_DOWN,
    deadline: float | None = None,
    **kwargs,
) -> Any:
    """One JSON call with ``retries`` retries on connection errors, timeouts and 5xx, waiting backoff_s *
    2^k; a 4xx is an error at once (the same call would be refused again). ``timeout`` bounds each
    attempt (connecting, each read and write), ``deadline`` (``time.monotonic()``) all of them: no
    retry starts after it, none outlives it by more than half a second. ``action`` names the call in the errors
    (default ``METHOD URL``), ``remedy`` is
    what the final error tells the user to do."""
    import httpx

    action = action or f"{method} {url}"
    last, made = "", 0
    for attempt in range(retries + 1):
        left = timeout if deadline is None else deadline - time.monotonic()
        if left <= 0 and attempt:
            break
        made += 1
        try:  # the first attempt always runs (with at least half a second)
            response = httpx.request(method, url, timeout=max(0.5, min(timeout, left)), **kwargs)
            if response.status_code < 500:
                if response.status_code >= 400:
                    raise AtroposError(f"{action} was refused ({response.status_code}): {response.text[:500]}")
                return response.json()
            last = f"status {response.status_code}: {response.text[:200]}"
        except httpx.TransportError as exc:  # refused, reset, dropped, timed out
            last = f"{type(exc).__name__}: {str(exc) or 'no detail'}"
        if attempt < retries:
            time.sleep(
                backoff_s * 2**attempt
                if deadline is None
                else max(0.0, min(backoff_s * 2**attempt, deadline - time.monotonic()))
            )
    raise AtroposError(f"{action} failed after {made} attempt{'s' * (made != 1)} (last: {last}); {remedy}")


def register(
    api_url: str,
    *,
    batch_size: int,
    max_token_len: int,
    num_steps: int,
    starting_step: int = 0,
    checkpoint_dir: str = "",
    save_checkpoint_interval: int = 0,
    wandb_group: str = "",
    wandb_project: str = "",
    retries: int = 5,
    backoff_s: float = 1.0,
) -> int:
    """POST /register: announce the trainer (sequences per batch, longest sequence, run length).

    Call once, on rank 0, before the first ``pull_batch``. ``starting_step`` is the resumed step.
    Returns the trainer's uuid.
    """
    body = {
        "wandb_group": wandb_group,
        "wandb_project": wandb_project,
        "batch_size": batch_size,
        "max_token_len": max_token_len,
        "checkpoint_dir": checkpoint_dir,
        "save_checkpoint_interval": save_checkpoint_interval or num_steps,
        "starting_step": starting_step,
        "num_steps": num_steps,
    }
    reply = _request("POST", f"{api_url.rstrip('/')}/register", retries, backoff_s, json=body)
    if "uuid" not in reply:
        raise AtroposError(f"POST {api_url}/register answered without a uuid: {reply}")
    return int(reply["uuid"])


# ----------------------------------------------------------------------------- batch -> rollout


def _row(group: dict, g: int, r: int) -> tuple[list[int], list[int], list[int], list[float] | None]:
    """(prompt ids, completion ids, trained mask over the completion, its logprobs or None) of row r
    of group g."""
    tokens, masks = group["tokens"][r], group["masks"][r]
    if len(tokens) != len(masks):
        raise AtroposError(f"batch group {g} row {r}: {len(tokens)} tokens but {len(masks)} mask entries")
    trained = [i for i, m in enumerate(masks) if m != IGNORE]
    if not trained:
        raise AtroposError(f"batch group {g} row {r}: every mask entry is {IGNORE}; nothing to train on")
    first, last = trained[0], trained[-1]
    if first == 0:
        raise AtroposError(f"batch group {g} row {r}: no prompt token before the completion (mask[0] != {IGNORE})")
    trained_mask = [int(m != IGNORE) for m in masks[first : last + 1]]
    logprobs = None
    if group.get("inference_logprobs") is not None:
        row_logprobs = group["inference_logprobs"][r]
        if len(row_logprobs) != len(tokens):
            raise AtroposError(
                f"batch group {g} row {r}: {len(row_logprobs)} inference_logprobs for "
                f"{len(tokens)} tokens (they must be aligned with tokens)"
            )
        # the sampler's logprob on each trained token; 0 on environment tokens (placeholders there)
        logprobs = [float(x) if t else 0.0 for x, t in zip(row_logprobs[first : last + 1], trained_mask)]
        if max(logprobs) > 1e-4:
            raise AtroposError(
                f"batch group {g} row {r}: an inference logprob on a completion token is "
                f"{max(logprobs):.4g} > 0 (a placeholder where the sampler's logprob belongs?)"
            )
    return list(tokens[:first]), list(tokens[first : last + 1]), trained_mask, logprobs


def batch_to_rollout(groups: list[dict], pad_token_id: int) -> tuple[RolloutBatch, torch.Tensor]:
    """Atropos groups -> (RolloutBatch with B rows, rewards (B,) float32); see the module doc.

    ``logprobs`` is None unless every group carries ``inference_logprobs``. ``truncated`` is all False:
    Atropos does not say whether a completion hit its length limit.
    """
    prompts, completions, trained, logprobs, rewards, group_index = [], [], [], [], [], []
    for g, group in enumerate(groups):
        num_rows = len(group.get("tokens") or [])
        if num_rows == 0 or len(group.get("masks") or []) != num_rows or len(group.get("scores") or []) != num_rows:
            raise AtroposError(
                f"batch group {g}: tokens, masks and scores must be non-empty lists of one length "
                f"(got {num_rows}, {len(group.get('masks') or [])}, {len(group.get('scores') or [])})"
            )
        if group.get("advantages") is not None:
            raise AtroposError(
                f"batch group {g} carries per-token advantages; lmforge computes advantages from "
                f"scores with its configured estimator (algo.*), so send scores only"
            )
        for r in range(num_rows):
            prompt, completion, row_trained, row_logprobs = _row(group, g, r)
            prompts.append(prompt)
            completions.append(completion)
            trained.append(row_trained)
            logprobs.append(row_logprobs)
            rewards.append(float(group["scores"][r]))
            group_index.append(g)
    if not prompts:
        raise AtroposError("the batch holds no groups")
    if any(lp is None for lp in logprobs) and not all(lp is None for lp in logprobs):
        raise AtroposError("some groups carry inference_logprobs and others do not; send them for all or none")
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id)  # (B, P)
    lengths = torch.tensor([len(c) for c in completions])
    width = int(lengths.max())
    completion_ids = torch.full((len(completions), width), pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((len(completions), width), dtype=torch.long)
    trained_mask = torch.zeros((len(completions), width), dtype=torch.long)
    completion_logprobs = torch.zeros((len(completions), width), dtype=torch.float32)
    for b, completion in enumerate(completions):
        completion_ids[b, : len(completion)] = torch.tensor(completion)
        completion_mask[b, : len(completion)] = 1
        trained_mask[b, : len(completion)] = torch.tensor(trained[b])
        if logprobs[b] is not None:
            completion_logprobs[b, : len(completion)] = torch.tensor(logprobs[b])
    rollout = RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        logprobs=None if logprobs[0] is None else completion_logprobs,
        group_index=torch.tensor(group_index),
        prompt_lens=prompt_mask.sum(1),
        completion_lens=lengths,
        truncated=torch.zeros(len(prompts), dtype=torch.bool),
        trained_mask=trained_mask,
    )
    return rollout, torch.tensor(rewards, dtype=torch.float32)


def weight_version(group: dict) -> int | None:
    version = (group.get("generation_params") or {}).get("weight_version")
    return None if version is None else int(version)


# ----------------------------------------------------------------------------- pull


def _fetch_groups(
    api_url: str,
    trainer_step: int,
    max_staleness: int | None,
    poll_s: float,
    timeout_s: float,
    retries: int,
    backoff_s: float,
) -> tuple[list[dict], dict]:
    """Poll GET /batch until a batch with at least one fresh group arrives; drop stale groups."""
    start = time.monotonic()
    dropped = 0
    while True:
        reply = _request("GET", f"{api_url.rstrip('/')}/batch", retries, backoff_s, deadline=start + timeout_s)
        if reply.get("status") == "error":
            raise AtroposError(f"GET {api_url}/batch: {reply.get('message', reply)} (call register() first)")
        groups = reply.get("batch")
        if groups is not None:
            if not isinstance(groups, list):
                raise AtroposError(f"GET {api_url}/batch: 'batch' is a {type(groups).__name__}, not a list of groups")
            pairs = [(g, weight_version(g)) for g in groups]
            pairs = [
                (g, v) for g, v in pairs if max_staleness is None or v is None or trainer_step - v <= max_staleness
            ]
            dropped += len(groups) - len(pairs)
            fresh = [g for g, _ in pairs]
            if fresh:
                known = [trainer_step - v for _, v in pairs if v is not None]
                info = {"atropos_wait_s": time.monotonic() - start, "atropos_dropped_stale_groups": dropped}
                if known:
                    info.update(staleness_mean=sum(known) / len(known), staleness_max=max(known))
                return fresh, info
        if time.monotonic() - start > timeout_s:
            raise AtroposError(
                f"no batch from {api_url}/batch within {timeout_s:.0f} s ({dropped} stale groups "
                f"dropped); are the environments running and pointed at the inference server?"
            )
        time.sleep(poll_s)


def pull_batch(
    api_url: str,
    *,
    pad_token_id: int,
    trainer_step: int = 0,
    max_staleness: int | None = None,
    poll_s: float = 1.0,
    timeout_s: float = 600.0,
    retries: int = 5,
    backoff_s: float = 1.0,
) -> tuple[RolloutBatch, torch.Tensor, dict]:
    """The next scored batch from the Atropos API: ``(rollout, rewards (B,), metrics)``.

    Groups sampled with weights older than ``max_staleness`` steps (trainer_step minus the group's
    ``generation_params.weight_version``) are dropped and counted; groups without a version are kept.
    Connection errors and 5xx are retried ``retries`` times with exponential backoff, then raise
    ``AtroposError``, as does a malformed batch. Under torch.distributed, rank 0 talks to the API and
    broadcasts the groups; every rank must call this (with the same arguments).
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    payload: list[Any] = [None]
    if not distributed or dist.get_rank() == 0:
        try:
            payload[0] = _fetch_groups(api_url, trainer_step, max_staleness, poll_s, timeout_s, retries, backoff_s)
        except AtroposError as exc:
            payload[0] = exc  # the other ranks raise it too instead of waiting in the broadcast
    if distributed:
        dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], AtroposError):
        raise payload[0]
    groups, info = payload[0]
    rollout, rewards = batch_to_rollout(groups, pad_token_id)
    metrics = {
        "reward": rewards.mean(),
        "reward_std": rewards.std(correction=0),
        "completion_len_mean": rollout.completion_lens.float().mean(),
        "completion_len_max": rollout.completion_lens.max(),
        "atropos_groups": torch.tensor(len(groups)),
        **{k: torch.tensor(float(v)) for k, v in info.items()},
    }
    return rollout, rewards, metrics
