"""``rollout.backend=agent``: the RL step's rows are episodes of an agent program that talks to an
OpenAI-compatible endpoint, run unmodified against the policy, served from the training process
(docs/agents.md).

Per step, for each of this rank's problems (``rollout.num_prompts``, shared out as every source's, groups
whole), ``rollout.group_size`` episodes run at once (``rollout.agent_concurrency``), each in a thread of
its own: the agent function (``rollout.agent_entry``, plain or ``async``) is called as
``function(base_url, problem, **rollout.agent_args)``, where ``base_url`` is the episode's session on the
in-process ``lmforge serve`` (``http://127.0.0.1:PORT/sessions/<id>/v1``) and ``problem`` the task's
problem as a dict (``prompt``, ``answer``, ... or the prompts file's row). A function that also takes
``model``, ``api_key`` or ``episode`` receives the served model's name, a placeholder key and the
episode's number. The server records every call (``serve.sessions``: exact ids and logprobs, the run's
sampling); the calls become samples by the merge rule (``agent_samples``).

The reward is what the function returns: a number, a dict of named parts (summed; each part's mean is
logged as ``reward_<name>``), or a string, its final answer, scored by ``rewards.functions`` (with the
task) as a single-turn completion would be. An episode that raises, overruns ``rollout.agent_timeout_s``
(its session is then ended, so its further calls fail) or returns anything else (None, NaN, a list) gets
reward 0, is counted (``agent_errors``, ``agent_timeouts``, ``agent_bad_rewards``) and logged with its
id, and its recorded calls still train, as a built-in environment's failed episodes do. A step in which
no episode both called the model and returned a usable reward stops the run with the first errors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.util
import inspect
import logging
import math
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch

from ...core.errors import ConfigError, TrainingError
from ...envs.episode import episode_seed
from ...rollout import RewardOutput
from ...serve.sessions import COUNTS, RunSampling, SessionRecorder
from ..batch import ScoredRollout
from .agent_samples import agent_rollout, merge_calls
from .base import SourceSetup
from .sampled import SampledSource, reward_metrics
from .served import SERVED_NAME, PolicyServer, served_copy

log = logging.getLogger(__name__)
INSTALL_HINT = "rollout.backend=agent serves the policy over HTTP: pip install 'lmforge[serve]'"
OPTIONAL = ("model", "api_key", "episode")  # arguments passed to an agent function that declares them


def load_agent(entry: str, args: dict | None = None) -> Callable:
    """The function ``entry`` names: ``package.module:function`` or ``path/to/file.py:function``, checked to
    take ``(base_url, problem, **args)``."""
    target, _, name = entry.rpartition(":")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise ConfigError(f"rollout.agent_entry={entry!r}: no such file {path}")
            spec = importlib.util.spec_from_file_location(f"lmforge_agent_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or ""
        if not target.endswith(".py") and (not missing or target == missing or target.startswith(missing + ".")):
            raise ConfigError(
                f"rollout.agent_entry={entry!r}: cannot import {target} ({exc}); put its directory on "
                "PYTHONPATH, or give the file's path: path/to/file.py:function"
            ) from exc
        raise ConfigError(
            f"rollout.agent_entry={entry!r}: importing {target} failed: {failure_text(exc)} -- a "
            "module the agent imports is missing from this environment (install it here, where "
            "lmforge runs the agent)"
        ) from exc
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"rollout.agent_entry={entry!r}: importing {target} raised {failure_text(exc)}") from exc
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigError(f"rollout.agent_entry={entry!r}: {target} has no function {name!r}")
    check_call(function, entry, args or {})
    return function


def check_call(function: Callable, entry: str, args: dict) -> None:
    """That ``function(base_url, problem, **args)`` binds (with the optional arguments it declares):
    a signature that does not fit is the user's error, said once at the start."""
    taken = sorted(set(args) & {"base_url", "problem", *OPTIONAL})
    if taken:
        raise ConfigError(
            f"rollout.agent_args sets {', '.join(taken)}, which lmforge passes to the agent itself "
            "(the episode's base URL, its problem, and model / api_key / episode where the function "
            "declares them); use other names"
        )
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    where = ""
    code = getattr(function, "__code__", None)
    if code is not None:
        where = f" ({code.co_filename}:{code.co_firstlineno})"
    try:
        signature.bind(
            "http://127.0.0.1:1/sessions/x/v1", {}, **args, **{k: None for k in OPTIONAL if k in signature.parameters}
        )
    except TypeError as exc:
        raise ConfigError(
            f"rollout.agent_entry={entry!r}: {getattr(function, '__name__', entry)}{signature}"
            f"{where} cannot be called as function(base_url, problem, **rollout.agent_args) with "
            f"agent_args={args!r}: {exc}. The agent takes the episode's base URL and its problem "
            "(a dict) first; docs/agents.md"
        ) from None


def problem_dict(problem: Any) -> dict:
    """What an agent receives for a task Problem (its fields) or a prompts file's row (the row)."""
    return dict(problem) if isinstance(problem, dict) else dataclasses.asdict(problem)


@dataclasses.dataclass
class AgentEpisode:
    """One run of the agent: its session's calls, what it returned, and how it ended."""

    number: int  # its place in the step's batch (the seeds follow it)
    problem: Any
    session: Any = None  # serve.sessions.Session
    calls: list = dataclasses.field(default_factory=list)
    end: str = "running"  # ok, error, timeout, bad_reward
    returned: Any = None
    error: str = ""
    started: float = 0.0


class AgentRunner:
    """Runs agent episodes against a gateway server (module doc); one per source."""

    def __init__(
        self, function: Callable, args: dict, url: str, recorder: SessionRecorder, concurrency: int, timeout_s: float
    ):
        self.function, self.args, self.url, self.recorder = function, dict(args), url, recorder
        self.concurrency, self.timeout_s = concurrency, timeout_s
        accepted = inspect.signature(function).parameters
        self.extra = [name for name in OPTIONAL if name in accepted]
        self.is_async = inspect.iscoroutinefunction(function)

    def _call(self, episode: AgentEpisode) -> None:
        """Run the agent on one episode (in its own thread); its outcome is set on ``episode``."""
        base_url = f"{self.url}/sessions/{episode.session.id}/v1"
        extra = {"model": SERVED_NAME, "api_key": "lmforge", "episode": episode.number}
        kwargs = {**self.args, **{k: extra[k] for k in self.extra}}
        try:
            result = self.function(base_url, problem_dict(episode.problem), **kwargs)
            if self.is_async:
                result = asyncio.run(result)
        except BaseException as exc:  # noqa: BLE001 - the agent's own failure: counted, logged, reward 0
            if episode.end == "running":
                episode.end, episode.error = "error", failure_text(exc)
            return
        if episode.end == "running":
            episode.returned, episode.end = result, "ok"

    def run(self, problems: list, group_size: int, sampling: Callable[[int], RunSampling]) -> list[AgentEpisode]:
        """``group_size`` episodes of each problem (a problem's adjacent), at most ``concurrency`` at once;
        ``sampling(number)`` is episode ``number``'s RunSampling."""
        episodes = [AgentEpisode(i, problems[i // group_size]) for i in range(len(problems) * group_size)]
        waiting, running = list(reversed(episodes)), []
        limit = self.concurrency or len(episodes)
        while waiting or running:
            while waiting and len(running) < limit:
                episode = waiting.pop()
                episode.session, episode.started = self.recorder.open(sampling(episode.number)), time.monotonic()
                thread = threading.Thread(
                    target=self._call, args=(episode,), daemon=True, name=f"lmforge-agent-{episode.number}"
                )
                thread.start()
                running.append((episode, thread))
            time.sleep(0.005)
            still = []
            for episode, thread in running:
                if thread.is_alive() and time.monotonic() - episode.started > self.timeout_s:
                    episode.end = "timeout"  # the thread is left to finish; its session refuses it from now
                    episode.error = f"no result within rollout.agent_timeout_s={self.timeout_s:g} s"
                elif thread.is_alive():
                    still.append((episode, thread))
                    continue
                episode.calls = self.recorder.close(episode.session)
            running = still
        self.recorder.forget([e.session for e in episodes])
        return episodes


def failure_text(exc: BaseException) -> str:
    """The exception, and where in the agent's own code it was raised (the last frame outside installed
    packages: the agent's line, not the HTTP client's)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "site-packages" not in f.filename]
    where = f" (at {frames[-1].filename}:{frames[-1].lineno}, in {frames[-1].name})" if frames else ""
    return "".join(traceback.format_exception_only(exc)).strip() + where


def finite_number(value: Any) -> float | None:
    """``value`` as a finite float if it is a number (Python's, NumPy's ``float32`` or ``bool_``, a one-element
    tensor), else None."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, RuntimeError):  # a tensor of several elements
        return None
    return number if math.isfinite(number) else None


def episode_reward(returned: Any) -> tuple[float | None, dict[str, float], str | None]:
    """(total or None, named parts, final text or None) of an agent's return value; (None, {}, None)
    for a value that is none of a finite number, a dict of finite numbers, a string."""
    if isinstance(returned, str):
        return None, {}, returned
    if not isinstance(returned, dict):
        return finite_number(returned), {}, None
    parts = {k: finite_number(v) for k, v in returned.items()}
    if not parts or any(v is None or not isinstance(k, str) for k, v in parts.items()):
        return None, {}, None
    return sum(parts.values()), parts, None


class AgentEngine:
    """The served policy and the agent runner; ``sync_weights`` copies the trained weights into the server."""

    def __init__(self, setup: SourceSetup):
        try:
            import uvicorn  # noqa: F401
        except ImportError as exc:
            raise ConfigError(INSTALL_HINT) from exc
        cfg = setup.rollout
        function = load_agent(cfg.agent_entry, cfg.agent_args)  # before the server: a bad entry starts nothing
        self.recorder = SessionRecorder()
        self.server = PolicyServer(
            served_copy(setup.policy),
            setup.tokenizer,
            cfg.num_prompts * cfg.group_size,
            "agent",
            sessions=self.recorder,
        )
        self.runner = AgentRunner(
            function, cfg.agent_args, self.server.url, self.recorder, cfg.agent_concurrency, cfg.agent_timeout_s
        )
        self.version = 0
        self.ctx = setup.ctx
        self.samples: list[list] = []  # the last step's samples (AgentSource pads them under torchrun)
        setup.print(
            f"[agent] {cfg.agent_entry}: policy served at {self.server.url}/sessions/<episode>/v1, "
            f"{cfg.agent_concurrency or 'all'} episodes at once, {cfg.agent_timeout_s:g} s each"
        )

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.version += 1
        self.server.load(model, self.version)


def score(episodes: list[AgentEpisode], reward_set, task, max_new_tokens: int) -> tuple[torch.Tensor, dict]:
    """(B_episodes,) rewards and the counts and part means of module doc's rule."""
    totals, parts, texts = [], [], {}
    for e in episodes:
        total, named, text = episode_reward(e.returned) if e.end == "ok" else (None, {}, None)
        if text is not None:
            texts[e.number] = text
        elif total is None and e.end == "ok":
            e.end, e.error = (
                "bad_reward",
                f"returned {e.returned!r:.200} (not a finite number, a dict of them, or text)",
            )
        totals.append(0.0 if total is None else total)
        parts.append(named)
    if texts:
        if reward_set is None:
            raise ConfigError(
                "the agent returned its final text, which rewards.functions scores, but no reward "
                "functions are configured; set rewards.functions or return a number"
            )
        numbers = sorted(texts)
        shared = {} if task is None else {"task": task}
        lens = [sum(len(c.token_ids) for c in episodes[n].calls) for n in numbers]
        out = reward_set(
            [texts[n] for n in numbers],
            [episodes[n].problem for n in numbers],
            completion_lens=lens,
            max_new_tokens=max_new_tokens,
            **shared,
        )
        for n, value in zip(numbers, out.total.tolist()):
            totals[n] = value
    names = sorted({k for p in parts for k in p})
    means = {f"reward_{k}": sum(p.get(k, 0.0) for p in parts) / len(parts) for k in names}
    return torch.tensor(totals, dtype=torch.float32), means


def agent_sampler(engine: AgentEngine) -> Callable:
    """``SampledSource``'s ``sample``: run and score the agent's episodes of this rank's problems ``rows``."""

    def sample(_engine, tokenizer, prompts, rows: list[int], cfg, reward_set, seed: int):
        start = time.perf_counter()
        run = RunSampling(
            cfg.temperature,
            cfg.top_p,
            cfg.top_k,
            cfg.max_new_tokens,
            seed=0,
            seed_of=lambda number, call: episode_seed(seed, number, call),
        )
        episodes = engine.runner.run(
            [prompts.problems[i] for i in rows], cfg.group_size, lambda number: dataclasses.replace(run, seed=number)
        )
        generated = time.perf_counter()
        rewards, part_means = score(episodes, reward_set, prompts.task, cfg.max_new_tokens)
        if engine.ctx.distributed:  # every rank logs every part (the metrics are all-reduced by position)
            names = sorted({name for rank in engine.ctx.gather_objects(sorted(part_means)) for name in rank})
            part_means = {name: part_means.get(name, 0.0) for name in names}
        samples = [merge_calls(e.calls) for e in episodes]
        counts = report(episodes, samples, engine.recorder.drain())
        own = reward_metrics(
            RewardOutput(
                total=rewards,
                per_function=rewards[:, None],
                names=["agent"],
                num_failed=torch.zeros(1, dtype=torch.long),
            )
        )
        clash = sorted(set(part_means) & {*own, *counts})
        if clash:
            raise ConfigError(
                f"the agent's reward parts {', '.join(k[len('reward_') :] for k in clash)} would be "
                f"logged as {', '.join(clash)}, a metric lmforge logs itself; rename them in the "
                "dict the agent returns"
            )
        usable = sum(bool(s) and e.end == "ok" for e, s in zip(episodes, samples))
        if not engine.ctx.sum_counts(usable)[0]:  # under torchrun: the step's usable episodes, all ranks'
            raise TrainingError(unusable_text(episodes, counts))
        engine.samples = samples
        rollout = agent_rollout(samples, tokenizer.pad_token_id, tokenizer.eos_token_id)
        row_rewards = rewards[rollout.episode_index]
        output = RewardOutput(
            total=row_rewards,
            per_function=row_rewards[:, None],
            names=["agent"],
            num_failed=torch.zeros(1, dtype=torch.long),
        )
        trained = rollout.trained.sum(1).float()
        metrics = {
            **own,
            **part_means,
            **counts,
            "completion_len_mean": trained.mean(),
            "completion_len_max": trained.max(),
            "truncated_frac": rollout.truncated.float().mean(),
            "time_generation": generated - start,
            "time_scoring": time.perf_counter() - generated,
        }
        return rollout, output, metrics

    return sample


def unusable_text(episodes: list[AgentEpisode], counts: dict) -> str:
    """Why no episode of a step can train: the first error, the episodes that never called the model, the
    calls the server refused."""
    first = next((e for e in episodes if e.error), None)
    causes = [f"the first error: {first.error}"] if first else []
    no_calls = sum(not e.calls and e.end == "ok" for e in episodes)
    if no_calls:
        causes.append(
            f"{no_calls} episode(s) returned without a call recorded in their session (does the agent "
            "build its client from the base_url it is given, for every episode?)"
        )
    if counts.get("num_refused_calls"):
        causes.append(
            f"{counts['num_refused_calls']} call(s) were refused with a 400 (see the warnings above: "
            "malformed, n > 1, or past the context)"
        )
    return (
        f"no agent episode of this step is usable (each failed, or never called the model: "
        f"{dict(Counter(e.end for e in episodes))}); " + ("; ".join(causes) or "no error was raised")
    )


def report(episodes: list[AgentEpisode], samples: list[list], late: Counter) -> dict:
    """The step's agent counts (docs/agents.md lists them; ``late``: the server's calls of no open
    session); the failures logged with their episode ids."""
    ends = Counter(e.end for e in episodes)
    counts: Counter = Counter(late)
    for e in episodes:
        counts.update(e.session.counts)
        if e.end != "ok":
            log.warning(
                "agent episode %d (session %s) ended as %s: %s",
                e.number,
                e.session.id,
                e.end,
                e.error or "no error text",
            )
        if e.session.counts["refused_calls"]:
            log.warning(
                "agent episode %d (session %s): %d call(s) refused with a 400 (malformed, or n > 1)",
                e.number,
                e.session.id,
                e.session.counts["refused_calls"],
            )
    calls = sum(len(e.calls) for e in episodes)
    return {
        "num_agent_errors": ends["error"],
        "num_agent_timeouts": ends["timeout"],
        "num_agent_bad_rewards": ends["bad_reward"],
        "num_agent_no_calls": sum(not e.calls for e in episodes),
        "calls_per_episode": calls / len(episodes),
        "samples_per_episode": sum(len(s) for s in samples) / len(episodes),
        # every count, 0 when none: rl.batch.reduce_rollout_metrics reduces the ranks' metrics by position
        **{f"num_{k}": counts[k] for k in sorted({*COUNTS, *counts})},
    }


class AgentSource(SampledSource):
    """The in-process source's prompts, seeds, rank shares and weight syncs; rows from agent episodes."""

    def __init__(self, setup: SourceSetup):
        self.agent = AgentEngine(setup)
        super().__init__(setup, self.agent, sample=agent_sampler(self.agent))

    def next_batch(self, step: int) -> ScoredRollout:
        """This rank's rows; under torchrun padded with empty rows to the most of any rank (each rank then
        runs as many micro-batches: FSDP2 gathers weights in each)."""
        scored = super().next_batch(step)
        ctx, rows = self.setup.ctx, scored.rollout.prompt_ids.shape[0]
        if not ctx.distributed:
            return scored
        most = int(ctx.all_reduce(torch.tensor([rows]), op=torch.distributed.ReduceOp.MAX)[0])
        if most == rows:
            return scored
        tokenizer = self.setup.tokenizer
        rollout = agent_rollout(self.agent.samples, tokenizer.pad_token_id, tokenizer.eos_token_id, num_rows=most)
        total = torch.cat([scored.rewards.total, torch.zeros(most - rows)])
        rewards = dataclasses.replace(scored.rewards, total=total, per_function=total[:, None])
        return ScoredRollout(rollout, rewards, scored.metrics)

    def close(self) -> None:
        self.agent.server.stop()


def build(setup: SourceSetup) -> AgentSource:
    return AgentSource(setup)


def agent_evaluator(rollout, tokenizer, problems: list, task, reward_set, max_new_tokens: int) -> Callable:
    """``evaluate(model) -> (metrics, episodes, totals)``: one greedy episode of the agent per held-out
    problem, on a server of its own (a copy of ``model``, started at the first call, reloaded at each).

    A success is an episode whose reward reaches 1: ``accuracy`` is the success rate; also
    ``eval_reward`` (mean), ``eval_calls`` (model calls per episode) and ``eval_agent_failures``
    (episodes that raised, timed out or returned no usable reward). The function has a ``close()``."""
    function = load_agent(rollout.agent_entry, rollout.agent_args)
    held: dict = {}

    def evaluate(model: torch.nn.Module) -> tuple[dict, list[AgentEpisode], list[float]]:
        if not held:
            held["recorder"] = SessionRecorder()
            held["server"] = PolicyServer(
                served_copy(model), tokenizer, min(len(problems), 64), "agent-eval", sessions=held["recorder"]
            )
            held["runner"] = AgentRunner(
                function,
                rollout.agent_args,
                held["server"].url,
                held["recorder"],
                rollout.agent_concurrency or min(len(problems), 64),
                rollout.agent_timeout_s,
            )
        else:
            held["server"].load(model, held["server"].weight_version + 1)
        greedy = RunSampling(0.0, 1.0, 0, max_new_tokens)
        episodes = held["runner"].run(problems, 1, lambda number: greedy)
        held["recorder"].drain()
        totals, _ = score(episodes, reward_set, task, max_new_tokens)
        failures = sum(e.end != "ok" for e in episodes)
        failed = next((e for e in episodes if e.end != "ok"), None)
        if failed is not None:
            log.warning(
                "evaluation: %d of %d agent episodes failed; the first (episode %d) ended as %s: %s",
                failures,
                len(episodes),
                failed.number,
                failed.end,
                failed.error or "no error text",
            )
        return (
            {
                "accuracy": (totals >= 1.0).float().mean().item(),
                "eval_reward": totals.mean().item(),
                "eval_calls": sum(len(e.calls) for e in episodes) / len(episodes),
                "eval_agent_failures": failures,
            },
            episodes,
            totals.tolist(),
        )

    def close() -> None:
        if held:
            held["server"].stop()

    evaluate.close = close
    return evaluate
