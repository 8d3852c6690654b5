"""``rollout.backend=atropos``: the RL step's rollouts come from an Atropos API server instead of the
in-process sampler.

The training step stays the recipe's own (``grpo_step``): only where the rollout comes from changes.
:class:`AtroposSource` is a rollout source (``lmforge.rl.sources.base``) and returns what the
sampling sources return -- a :class:`ScoredRollout` with the sampler's logprobs, the rewards (the
environments' ``scores``) and the step's metrics -- so the advantages, the packing, the importance
weights against the inference logprobs and the update are exactly the in-process path's. A row's
mask may mark several spans (a multi-turn environment's turns, with tool output between them
masked): only the marked tokens are trained.

Per step ``k`` (1-based, as the runtime loop counts; the trainer holds weights of version k - 1):

1. once, at the first ``sync_weights`` (before the first pull): rank 0 ``POST /register``s; if the
   run resumed (k - 1 > 0) and ``rollout.server_url`` is set, the resumed weights are pushed as
   version k - 1 so the environments sample from them;
2. rank 0 pulls ``GET /batch`` until it holds ``rollout.num_prompts`` fresh groups of
   ``rollout.group_size`` rows (groups older than ``rollout.max_staleness`` are dropped and counted;
   groups beyond the step's need wait in memory for the next step and are re-checked then), converts
   them once to catch a malformed batch, and broadcasts them (``ParallelContext.broadcast_object``);
   an error on rank 0 stops every rank (``check_all_ok``);
3. every rank converts its share of the groups (the same split as :func:`lmforge.rl.prompts.rank_prompts`,
   so each optimizer update's rows over all ranks are the single-process update's);
4. after the update (``sync_weights(policy, k)``), every ``rollout.push_every`` steps, rank 0 pushes
   the new weights to ``rollout.server_url`` (``lmforge serve``'s ``/v1/weights/tensors``) as version k.

Staleness of a group = (k - 1) - its ``generation_params.weight_version``: 0 when it was sampled with
the weights being trained. Retries with backoff on connection errors / 5xx, then an ``AtroposError``
that leaves the last checkpoint as it was: ``train.resume`` continues the run (groups held in memory
for a later step are lost; the API has already handed them out).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ...rollout import RewardOutput
from ...serve.weights import weights_request
from ..batch import ScoredRollout
from ..prompts import rank_prompts
from .atropos_client import AtroposError, _fetch_groups, _request, batch_to_rollout, register, weight_version
from .base import Policy, SourceSetup


def check_groups(groups: list[dict], group_size: int, max_new_tokens: int) -> None:
    """``AtroposError`` naming the group, row and field when a group does not fit this run's step."""
    for g, group in enumerate(groups):
        if not isinstance(group, dict):
            raise AtroposError(f"batch group {g} is a {type(group).__name__}, not an object with tokens, masks, scores")
        for field in ("tokens", "masks", "scores"):
            if not isinstance(group.get(field), list):
                raise AtroposError(f"batch group {g}: field '{field}' is missing or not a list")
        if len(group["tokens"]) != group_size:
            raise AtroposError(
                f"batch group {g}: field 'tokens' holds {len(group['tokens'])} rows, but "
                f"rollout.group_size={group_size}; set the environment's group_size to match"
            )
        for r, masks in enumerate(group["masks"]):
            trained = sum(1 for m in masks if m != -100) if isinstance(masks, list) else 0
            if trained > max_new_tokens:
                raise AtroposError(
                    f"batch group {g} row {r}: field 'masks' marks {trained} completion tokens, more "
                    f"than rollout.max_new_tokens={max_new_tokens}; raise it or have the "
                    "environment sample fewer"
                )
        for r, score in enumerate(group["scores"]):
            if not isinstance(score, (int, float)) or score != score:
                raise AtroposError(f"batch group {g} row {r}: field 'scores' holds {score!r}, not a number")


class AtroposSource:
    """The rollouts of ``rollout.backend=atropos`` (module doc); one per run."""

    def __init__(self, setup: SourceSetup):
        self.setup = setup
        self.rollout = setup.rollout
        self.ctx = setup.ctx
        self.max_token_len = setup.max_prompt_len + setup.rollout.max_new_tokens
        self.num_steps = setup.max_steps
        self.started = False
        self.pending: list[dict] = []  # rank 0: fresh groups pulled beyond a step's need
        self.dropped_total = 0

    # ------------------------------------------------------------------ rank 0 talks to the services

    def _rank0(self, what: str, fn, *args) -> Any:
        """``fn(*args)`` on rank 0; its result on every rank; its error raised on every rank. ``what`` is
        the phase the other ranks wait in (named if rank 0 stalls past parallel.timeout_s)."""
        ctx = self.ctx
        ctx.mark(what)
        result, error = None, None
        if ctx.is_main:
            try:
                result = fn(*args)
            except Exception as exc:  # noqa: BLE001 -- raised below on rank 0, and stops the other ranks
                error = exc
        ctx.check_all_ok(error)
        return ctx.broadcast_object(result)

    def _server_version(self) -> int:
        reply = _request(
            "GET",
            f"{self.rollout.server_url.rstrip('/')}/v1/weights",
            self.rollout.api_retries,
            self.rollout.api_backoff_s,
        )
        return int(reply["weight_version"])

    def _push(self, model: torch.nn.Module, version: int) -> int:
        """POST the weights (serialised once, merged if LoRA) to ``lmforge serve``; retried like every
        other call here, and a refusal (4xx: wrong names or shapes, a version that does not increase)
        is an error at once."""
        url, request = weights_request(self.rollout.server_url, model, version=version)
        limit = self.rollout.push_timeout_s
        reply = _request(
            "POST",
            url,
            self.rollout.api_retries,
            self.rollout.api_backoff_s,
            timeout=limit,
            **request,
            deadline=time.monotonic() + limit,
            action=f"pushing weights version {version} to rollout.server_url={self.rollout.server_url} "
            f"(rollout.push_timeout_s={limit:g})",
            remedy="the last checkpoint is intact: resume the run once the inference server is back",
        )
        return int(reply["weight_version"])

    def _start(self, policy: Policy, trained_steps: int) -> None:
        def start() -> None:
            uuid = register(
                self.rollout.api_url,
                batch_size=self.rollout.num_prompts * self.rollout.group_size,
                max_token_len=self.max_token_len,
                num_steps=self.num_steps,
                starting_step=trained_steps,
                retries=self.rollout.api_retries,
                backoff_s=self.rollout.api_backoff_s,
            )
            self.setup.print(
                f"[atropos] registered with {self.rollout.api_url} (trainer uuid {uuid}) at step {trained_steps}"
            )
            if self.rollout.server_url:
                return self._server_version()
            return None

        server_version = self._rank0(f"the end of rank 0's registration with {self.rollout.api_url}", start)
        if self.rollout.server_url and trained_steps > 0:  # resumed: the environments must sample our weights
            if server_version >= trained_steps:
                raise AtroposError(
                    f"rollout.server_url={self.rollout.server_url} serves weight version {server_version}, but the run "
                    f"resumed at step {trained_steps} (versions must increase); restart lmforge serve on the "
                    f"resumed checkpoint ({self.setup.run_dir}/step-{trained_steps}) and resume again"
                )
            model = policy()  # every rank (FSDP2 gathers)
            self._rank0(
                f"the end of rank 0's weight push to {self.rollout.server_url}", self._push, model, trained_steps
            )
            self.setup.print(
                f"[atropos] pushed the resumed weights to {self.rollout.server_url} as version {trained_steps}"
            )
        self.started = True

    def _next_groups(self, trained_steps: int) -> tuple[list[dict], dict]:
        """Rank 0: ``num_prompts`` fresh groups for this step, and what it took to get them."""
        cfg, max_staleness = self.rollout, (None if self.rollout.max_staleness < 0 else self.rollout.max_staleness)
        start = time.monotonic()
        dropped = 0

        def fresh(group: dict) -> bool:
            version = weight_version(group)
            return max_staleness is None or version is None or trained_steps - version <= max_staleness

        kept = [g for g in self.pending if fresh(g)]
        dropped += len(self.pending) - len(kept)
        self.pending = kept
        while len(self.pending) < cfg.num_prompts:
            remaining = cfg.api_timeout_s - (time.monotonic() - start)
            if remaining <= 0:
                raise AtroposError(
                    f"no batch from {cfg.api_url}/batch within rollout.api_timeout_s="
                    f"{cfg.api_timeout_s:.0f} s ({dropped} stale groups dropped); are the environments "
                    "running and pointed at the inference server?"
                )
            try:
                groups, info = _fetch_groups(
                    cfg.api_url,
                    trained_steps,
                    max_staleness,
                    cfg.api_poll_s,
                    remaining,
                    cfg.api_retries,
                    cfg.api_backoff_s,
                )
            except AtroposError as exc:  # the API stopped answering: say which bound ended the wait
                if time.monotonic() - start < cfg.api_timeout_s:
                    raise
                raise AtroposError(f"{exc} (no batch within rollout.api_timeout_s={cfg.api_timeout_s:g} s)") from None
            check_groups(groups, cfg.group_size, cfg.max_new_tokens)
            dropped += int(info["atropos_dropped_stale_groups"])
            self.pending.extend(groups)
        groups, self.pending = self.pending[: cfg.num_prompts], self.pending[cfg.num_prompts :]
        batch_to_rollout(groups, 0)  # a malformed group stops the run here, on rank 0, naming group and row
        self.dropped_total += dropped
        versions = [trained_steps - v for v in map(weight_version, groups) if v is not None]
        info = {
            "time_generation": time.monotonic() - start,
            "atropos_dropped_stale_groups": dropped,
            "atropos_dropped_stale_total": self.dropped_total,
            "atropos_pending_groups": len(self.pending),
        }
        if versions:
            info.update(staleness_mean=sum(versions) / len(versions), staleness_max=max(versions))
        return groups, info

    # ------------------------------------------------------------------ the source, on every rank

    def sync_weights(self, policy: Policy, version: int) -> None:
        """First call: register (and push resumed weights). Then, after step ``version``'s update, every
        ``push_every`` steps, hand the weights (version ``version``) over."""
        if not self.started:
            self._start(policy, version)
            return
        if not self.rollout.server_url or version % self.rollout.push_every:
            return
        model = policy()  # every rank (FSDP2 gathers)
        self._rank0(
            f"the end of rank 0's weight push to {self.rollout.server_url} after step {version}",
            self._push,
            model,
            version,
        )

    def next_batch(self, step: int) -> ScoredRollout:
        """This rank's share of the next ``num_prompts`` groups."""
        trained_steps = step - 1  # the optimizer steps behind the weights this step starts from
        groups, info = self._rank0(
            f"the end of rank 0's pull from {self.rollout.api_url}/batch for step {step}",
            self._next_groups,
            trained_steps,
        )
        scores = torch.tensor([float(s) for g in groups for s in g["scores"]])
        rows = rank_prompts(list(range(len(groups))), self.setup.num_mini_batches, self.ctx)
        batch, rewards = batch_to_rollout([groups[i] for i in rows], self.setup.tokenizer.pad_token_id)
        output = RewardOutput(
            total=rewards, per_function=rewards[:, None], names=["atropos"], num_failed=torch.zeros(1, dtype=torch.long)
        )
        lengths = torch.tensor(
            [sum(1 for m in masks if m != -100) for g in groups for masks in g["masks"]], dtype=torch.float32
        )
        # Over the whole step's batch (every rank holds it), so no reduction over ranks is needed.
        metrics = {
            "reward": scores.mean(),
            "reward_std": scores.std(correction=0),
            "completion_len_mean": lengths.mean(),
            "completion_len_max": lengths.max(),
            "time_scoring": 0.0,
            **info,
        }
        return ScoredRollout(batch, output, metrics)

    def state_dict(self) -> dict:
        return {}  # groups held for a later step are not saved: the API has handed them out (module doc)

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass


def build(setup: SourceSetup) -> AtroposSource:
    return AtroposSource(setup)
