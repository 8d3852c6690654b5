"""Overlapped rollouts for the built-in sampler (``rollout.async_steps=N``, N >= 1).

Synchronous RL alternates: sample batch k with the current weights, then train on it. Here the
rollout of step k + N is generated in a background thread while the trainer updates on batch k, so
on hardware where sampling and training do not share compute (a GPU each, or a separate inference
server) a step costs about max(generation, training) instead of their sum.

Weights versions. Version v is the policy after v RL steps (v = 0: the start, or the step a run
resumed from). Step k trains version k - 1 into version k. Batch k + N is launched at the start of
step k, from version k - 1, so with N = 1 the batch trained at step k >= 2 was sampled by version
k - 2, one version behind the weights being trained: ``staleness`` = (k - 1) - sampler version = N
(less for the first N steps, whose batches come from version 0).

The sampler never sees a half-updated policy: each in-flight batch has its own copy of the weights
(a :class:`CastEngine`, in ``rollout.dtype`` or the policy's dtype), refreshed from the policy on
the main thread when its batch is launched and not touched again until that batch has been taken.
N copies are held in all.

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

from .errors import ConfigError
from .rollout import CastEngine


class _Frozen:
    """An engine whose weights were set at launch: ``sync_weights`` (called by ``sample_and_score``
    in the sampler thread) must not read the policy, which the trainer is updating."""

    def __init__(self, engine: CastEngine):
        self.engine = engine

    def sync_weights(self, model) -> None:
        pass

    def generate(self, *args, **kwargs):
        return self.engine.generate(*args, **kwargs)


def check_async(cfg, algo, distributed: bool) -> None:
    """ConfigError naming the key when ``rollout.async_steps`` cannot run with the rest of the config
    (called before the run directory is taken, and again by :class:`AsyncRollouts`)."""
    n = getattr(cfg.rollout, "async_steps", 0)
    if not n:
        return
    if algo.is_level == "none":
        raise ConfigError(f"rollout.async_steps={n} trains on batches sampled by weights {n} step(s) old; set "
                          "algo.is_level=token (or sequence) so that truncated importance weights "
                          "pi_trainer / pi_sampler correct for it")
    if cfg.rollout.backend != "inprocess":
        raise ConfigError(f"rollout.async_steps applies to rollout.backend=inprocess, not {cfg.rollout.backend}")
    if distributed:
        raise ConfigError("rollout.async_steps runs in one process for now; unset it under torchrun")


def async_threads(total: int, wanted: int) -> int:
    """Intra-op threads while the sampler and the trainer run side by side: ``wanted``, else half of
    the run's ``total`` (at least 1; on one core both threads share it)."""
    return wanted or max(total // 2, 1)


class AsyncRollouts:
    """Rollouts launched ``ahead`` steps early in one background thread (module doc)."""

    def __init__(self, state, algo):
        from . import rl  # the caller's module; imported here, rl imports this one lazily

        self._rl = rl
        cfg = state.run.cfg
        check_async(cfg, algo, state.run.ctx.distributed)
        self.state, self.ahead, self.max_steps = state, cfg.rollout.async_steps, cfg.train.max_steps
        policy = state.sampler_model()
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.rollout.dtype, next(policy.parameters()).dtype)
        first = state.rollout_engine if isinstance(state.rollout_engine, CastEngine) else CastEngine(policy, dtype)
        self.engines = [first] + [CastEngine(policy, dtype) for _ in range(self.ahead - 1)]
        self.threads = None  # the run's thread count, restored by close()
        note = ""
        if state.run.device.type == "cpu":
            self.threads = torch.get_num_threads()
            shared = async_threads(self.threads, cfg.rollout.async_threads)
            torch.set_num_threads(shared)
            note = f"; {shared} intra-op thread(s) each for sampling and training (the run has {self.threads})"
        state.run.print(f"[rollout] async: sampling {self.ahead} step(s) ahead in a background thread{note}")
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="lmforge-rollout")
        self.pending: dict[int, tuple[Future, int]] = {}  # step -> (rollout future, sampler weights version)
        saved = state.train.saved.get("async_rollouts", {}).get("pending", {})
        for step, item in saved.items():
            future: Future = Future()
            future.set_result((item["rollout"], item["rewards"], item["metrics"]))
            self.pending[int(step)] = (future, int(item["version"]))
        if saved:
            state.run.print(f"[rollout] async: resumed with the saved rollouts of steps {sorted(self.pending)}")

    def _launch(self, step: int) -> None:
        """Take step ``step``'s prompts (in order), copy the current weights into its engine, start it."""
        state, rl = self.state, self._rl
        cfg = state.run.cfg
        rows = state.next_prompts()
        engine = self.engines[step % self.ahead]
        engine.sync_weights(state.sampler_model())  # main thread; this engine's last batch was taken
        seed = rl.step_seed(cfg.train.seed, step, state.run.ctx.rank)
        future = self.executor.submit(rl.sample_and_score, engine.model, state.tokenizer, state.prompts, rows,
                                      cfg.rollout, state.reward_set, seed, engine=_Frozen(engine))
        self.pending[step] = (future, state.train.step)

    def take(self, step: int):
        """Step ``step``'s rollout, rewards and metrics; then launch the batches up to ``step + ahead``
        from the current weights (before this step's update)."""
        if step not in self.pending:  # the first step of a run (or of a resume without saved batches)
            self._launch(step)
        start = time.perf_counter()
        future, version = self.pending.pop(step)
        rollout, rewards, metrics = future.result()
        waited = time.perf_counter() - start
        for ahead in range(step + 1, min(step + self.ahead, self.max_steps) + 1):
            if ahead not in self.pending:
                self._launch(ahead)
        trained = self.state.train.step  # the weights version this step updates
        metrics = {**metrics, "rollout_version": version, "staleness": trained - version, "time_rollout_wait": waited}
        return rollout, rewards, metrics

    def state_dict(self) -> dict:
        """The launched batches (waited for), for the checkpoint's trainer state. A batch whose sampling
        or scoring failed is left out, so that the checkpoint of the step that trained is still written;
        its error is raised when its step takes it, and a run resumed from this checkpoint samples that
        step anew from the next prompts (the failed batch's prompts are skipped)."""
        pending = {}
        for step, (future, version) in sorted(self.pending.items()):
            try:
                rollout, rewards, metrics = future.result()
            except Exception as exc:  # noqa: BLE001 -- re-raised by take(step), after this save
                self.state.run.print(f"[rollout] async: the batch of step {step} failed ({type(exc).__name__}: "
                                     f"{exc}); the checkpoint is written without it")
                continue
            pending[step] = {"rollout": rollout, "rewards": rewards, "metrics": metrics, "version": version}
        return {"async_rollouts": {"ahead": self.ahead, "pending": pending}}

    def close(self) -> None:
        """Stop the sampler thread (after its current batch) and give the trainer its threads back."""
        for future, _ in self.pending.values():
            future.cancel()
        self.executor.shutdown(wait=True)
        if self.threads is not None:
            torch.set_num_threads(self.threads)
