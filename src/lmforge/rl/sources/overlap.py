"""Overlapped rollouts (``rollout.async_steps=N``, N >= 1): a wrapper over any rollout source.

Synchronous RL alternates: sample batch k with the current weights, then train on it. Here the
rollout of step k + N is generated in a background thread while the trainer updates on batch k, so
on hardware where sampling and training do not share compute (a GPU each, or a separate inference
server) a step costs about max(generation, training) instead of their sum.

Weights versions. Version v is the policy after v RL steps (v = 0: the start, or the step a run
resumed from). Step k trains version k - 1 into version k. Batch k + N is launched at the start of
step k, from version k - 1, so with N = 1 the batch trained at step k >= 2 was sampled by version
k - 2, one version behind the weights being trained: ``staleness`` = (k - 1) - sampler version = N
(less for the first N steps, whose batches come from version 0).

The source never sees a half-updated policy: each in-flight batch has its own copy of the weights
(a :class:`CastEngine` in the policy's dtype), refreshed from the policy on the main thread when
its batch is launched and not touched again until that batch has been taken. N copies are held in
all. In the background thread the wrapped source is synced to that copy (``sync_weights``) and
asked for the batch (``next_batch``): the in-process source samples from the copy itself, its
bf16 variant (``rollout.dtype``) casts it into its own copy, vLLM loads it, Atropos pushes it. Batches are produced
one at a time, in step
order, so a source's own state (the prompt order) advances as in a synchronous run.

Correction. The trainer recomputes ``old_logprobs`` with the weights it trains (version k - 1;
the on-policy shortcut of a single update does so in its own forward), and ``algo.is_level``
weights each token (or sequence) by ``min(pi_old / pi_sampler, algo.is_cap)`` against the
sampler's logprobs: truncated importance sampling for the version gap (docs/algorithms/
importance-sampling.md). So async needs ``algo.is_level`` token or sequence. The step logs
``rollout_version``, ``staleness``, ``time_rollout_wait`` and, from the loss, ``is_weight_mean`` /
``is_weight_max`` / ``is_weight_clip_frac`` and the ``rollout_diff_*`` alignment metrics.

Resume. A checkpoint written after step s holds the batches already launched for steps
s + 1 .. s + N (the data order has moved past their prompts): the save waits for them and stores
the rollouts, rewards, metrics and sampler versions in the trainer state. A resumed run trains on
exactly those, so it reproduces the uninterrupted run bit for bit (tests/recipes/test_grpo_async.py).

Threads (CPU). Generation and training share the cores. torch's intra-op thread count is one per
process (``torch.set_num_threads`` from the sampler thread changes the trainer's too, checked on
this build), so it cannot be split per thread; instead, while async runs, the process count is set
to ``rollout.async_threads`` (0 = half the run's threads, at least 1), so that the sampler and the
trainer, each running ops with that many threads, together use about the run's cores. On two cores
that is one thread each. The run's count is restored at the end.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ...core.errors import ConfigError
from ...core.ops import adopt_thread_count
from ...rollout import CastEngine
from ..batch import ScoredRollout
from .base import Policy, RolloutSource, SourceSetup


def check_async(rollout, is_level: str, distributed: bool) -> None:
    """ConfigError naming the key when ``rollout.async_steps`` cannot run with the rest of the config
    (called before the run directory is taken)."""
    n = rollout.async_steps
    if not n:
        return
    if is_level == "none":
        raise ConfigError(
            f"rollout.async_steps={n} trains on batches sampled by weights {n} step(s) old; set "
            "algo.is_level=token (or sequence) so that truncated importance weights "
            "pi_trainer / pi_sampler correct for it"
        )
    if distributed:
        raise ConfigError("rollout.async_steps runs in one process for now; unset it under torchrun")


def async_threads(total: int, wanted: int) -> int:
    """Intra-op threads while the sampler and the trainer run side by side: ``wanted``, else half of
    the run's ``total`` (at least 1; on one core both threads share it)."""
    return wanted or max(total // 2, 1)


class Overlapped:
    """``inner``'s batches taken ``ahead`` steps early in one background thread (module doc)."""

    def __init__(self, inner: RolloutSource, setup: SourceSetup):
        rollout = setup.rollout
        self.inner, self.setup = inner, setup
        self.ahead, self.max_steps = rollout.async_steps, setup.max_steps
        dtype = next(setup.policy.parameters()).dtype
        self.engines = [CastEngine(setup.policy, dtype) for _ in range(self.ahead)]
        self.threads = None  # the run's thread count, restored by close()
        note = ""
        if next(setup.policy.parameters()).device.type == "cpu":
            self.threads = torch.get_num_threads()
            shared = async_threads(self.threads, rollout.async_threads)
            torch.set_num_threads(shared)
            note = f"; {shared} intra-op thread(s) each for sampling and training (the run has {self.threads})"
        setup.print(f"[rollout] async: sampling {self.ahead} step(s) ahead in a background thread{note}")
        self.executor = ThreadPoolExecutor(
            1, thread_name_prefix="lmforge-rollout", initializer=adopt_thread_count
        )  # its OpenMP team as set (core/ops.py)
        self.pending: dict[int, tuple[Future, int]] = {}  # step -> (batch future, sampler weights version)
        self.policy: Policy | None = None
        self.version = 0  # of the weights last synced

    def sync_weights(self, policy: Policy, version: int) -> None:
        self.policy, self.version = policy, version  # read at the next launch, on the main thread

    def _launch(self, step: int) -> None:
        """Copy the current weights into step ``step``'s engine (this engine's last batch was taken),
        then produce its batch in the background: sync ``inner`` to that copy, take the batch."""
        engine = self.engines[step % self.ahead]
        engine.sync_weights(self.policy())
        version = self.version

        def produce() -> ScoredRollout:
            self.inner.sync_weights(lambda: engine.model, version)
            return self.inner.next_batch(step)

        self.pending[step] = (self.executor.submit(produce), version)

    def next_batch(self, step: int) -> ScoredRollout:
        """Step ``step``'s batch; then launch the batches up to ``step + ahead`` from the current
        weights (before this step's update)."""
        if step not in self.pending:  # the first step of a run (or of a resume without saved batches)
            self._launch(step)
        start = time.perf_counter()
        future, version = self.pending.pop(step)
        scored = future.result()
        waited = time.perf_counter() - start
        for ahead in range(step + 1, min(step + self.ahead, self.max_steps) + 1):
            if ahead not in self.pending:
                self._launch(ahead)
        metrics = {
            **scored.metrics,
            "rollout_version": version,
            "staleness": self.version - version,
            "time_rollout_wait": waited,
        }
        return ScoredRollout(scored.rollout, scored.rewards, metrics)

    def state_dict(self) -> dict:
        """The launched batches (waited for), for the checkpoint's trainer state. A batch whose sampling
        or scoring failed is left out, so that the checkpoint of the step that trained is still written;
        its error is raised when its step takes it, and a run resumed from this checkpoint samples that
        step anew from the next prompts (the failed batch's prompts are skipped)."""
        pending = {}
        for step, (future, version) in sorted(self.pending.items()):
            try:
                scored = future.result()
            except Exception as exc:  # noqa: BLE001 -- re-raised by next_batch(step), after this save
                self.setup.print(
                    f"[rollout] async: the batch of step {step} failed ({type(exc).__name__}: "
                    f"{exc}); the checkpoint is written without it"
                )
                continue
            pending[step] = {
                "rollout": scored.rollout,
                "rewards": scored.rewards,
                "metrics": scored.metrics,
                "version": version,
            }
        return {**self.inner.state_dict(), "async_rollouts": {"ahead": self.ahead, "pending": pending}}

    def load_state_dict(self, state: dict) -> None:
        """The batches a checkpoint holds are trained as they were (exact resume); a synchronous
        checkpoint holds none, and the next batch is sampled from the resumed weights."""
        self.inner.load_state_dict(state)
        saved = state.get("async_rollouts", {}).get("pending", {})
        for step, item in saved.items():
            future: Future = Future()
            future.set_result(ScoredRollout(item["rollout"], item["rewards"], item["metrics"]))
            self.pending[int(step)] = (future, int(item["version"]))
        if saved:
            self.setup.print(f"[rollout] async: resumed with the saved rollouts of steps {sorted(self.pending)}")
        elif state.get("step"):
            self.setup.print(
                "[rollout] async: the checkpoint holds no launched batches; the next one is "
                "sampled now, from the resumed weights (staleness 0)"
            )

    def close(self) -> None:
        """Stop the background thread (after its current batch), close ``inner``, give the trainer its
        threads back."""
        for future, _ in self.pending.values():
            future.cancel()
        self.executor.shutdown(wait=True)
        self.inner.close()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
