"""``rollout.backend=verifiers``: the RL step's rows are episodes of a `verifiers
<https://github.com/PrimeIntellect-ai/verifiers>`_ v1 environment, run by verifiers' own rollout code
against the policy, served from the training process (docs/verifiers.md).

Design. verifiers runs an episode as a harness program (``null``: its chat loop, a ``uv`` script in a
subprocess runtime) whose model calls go through verifiers' interception server to a *client*. Its
training client (``TrainClientConfig``, what prime-rl uses) renders each turn's prompt to token ids
itself with a ``renderers`` renderer, POSTs them to ``/inference/v1/generate`` and records the
sampled ids and logprobs on the trace's message graph; each root-to-leaf path is one ``Branch`` with
``token_ids``, ``sampled_mask`` (the policy's tokens) and ``logprobs``: exactly a training row, as
prime-rl's orchestrator consumes it. This source therefore:

1. at build, copies the policy (the scheduler puts its model in eval mode without gradients, so the
   trainer's own module cannot be shared) into an in-process ``lmforge serve``
   (:class:`lmforge.serve.app.ServedModel` under uvicorn in a thread, 127.0.0.1, a free port), and
   saves the run's tokenizer (and model config) under ``<run_dir>/verifiers_tokenizer`` so that the
   renderer tokenizes exactly as lmforge does;
2. loads the environment (``rollout.verifiers_env``: a taskset id, i.e. an importable module, with
   ``rollout.verifiers_args`` as its taskset config) with ``verifiers.v1.load_environment``, and
   its tasks once;
3. per step k, takes ``rollout.num_prompts`` tasks (a seeded permutation, walked in order, so a resumed
   run continues where it stopped with nothing saved) and runs ``rollout.group_size`` episodes of each
   with ``Env.run_slot`` (the environment's own tools, stop conditions and rewards), sampling at
   ``rollout.temperature`` / ``top_p`` / ``top_k`` with ``rollout.max_new_tokens`` per turn;
4. turns each episode's last branch into an Atropos-shaped row (``atropos_client.batch_to_rollout``):
   prompt = the tokens before the first sampled token, completion = the rest up to the last sampled
   token, ``trained_mask`` = the sampled tokens (tool output and template scaffold between turns are
   inputs, never trained), the server's logprobs on them, the reward = ``Trace.reward``;
5. checks every row against lmforge's rendering of the same conversation
   (``envs.toolcalls.render_messages``, what ``lmforge serve`` renders for chat): the first prompt
   token for token (``vf_prompt_mismatch``) and the whole conversation (``vf_episode_mismatch``). A
   mismatch is counted and the first of a step is logged with its position; the row is trained as
   verifiers rendered it (those are the tokens the policy saw and sampled from);
6. after each update, copies the weights into the served model (``scheduler.update_weights`` with
   ``copy_state``, merged when LoRA), so every step samples from the weights being trained.

Where verifiers has no renderer for the model (any local directory: its renderer map is keyed by hub
names), ``rollout.verifiers_renderer`` defaults to ``{"name": "default"}``: ``DefaultRenderer``, the
tokenizer's own ``apply_chat_template``. It passes ``tools`` to the template and parses no tool calls
unless given a ``tool_parser`` (its parsers need ``<tool_call>`` to be one token). With a template that
does not render tools (SmolLM2's, lmforge's default) the prompt lacks the tool descriptions that
lmforge serve adds, every row counts in ``vf_prompt_mismatch``, and a reply's ``<tool_call>`` text stays
text: the episode ends after one turn. A model verifiers does know (e.g. Qwen3) is configured with
its renderer's name, e.g. ``{"name": "qwen3"}``.

One process only (the server and the environment run on rank 0's machine); ``rollout.async_steps``
works as for any source. Needs ``pip install verifiers`` (which pins openai 2.x: a separate venv from
the serve compatibility clients) and ``uv`` on PATH for the chat harness.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from pathlib import Path

import torch

from ...core.errors import ConfigError, TrainingError
from ...envs.toolcalls import render_messages
from ...model.safe_encode import encode_rendered, render_marked
from ...rollout import RewardOutput
from ..batch import ScoredRollout
from .atropos_client import IGNORE, batch_to_rollout
from .base import Policy, SourceSetup
from .served import SERVED_NAME, PolicyServer, served_copy

log = logging.getLogger(__name__)
INSTALL_HINT = (
    "rollout.backend=verifiers needs verifiers (pip install verifiers; it pins openai 2.x, so use a "
    "venv of its own) and lmforge's serve extra (pip install 'lmforge[serve]')"
)
RENDERER = "lmforge.rl.sources.vf_renderer.LmforgeRenderer"  # vf_renderer.py (imported by renderers, by name)


def _require_verifiers():
    try:
        import uvicorn  # noqa: F401
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ConfigError(INSTALL_HINT) from exc
    return vf


def absolute_pythonpath() -> None:
    """Make ``$PYTHONPATH``'s relative entries absolute (``PYTHONPATH=examples`` still finds the
    environment's module from the directory verifiers runs its tool server in)."""
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(e) for e in entries if e)


def save_tokenizer(tokenizer, model: torch.nn.Module, run_dir: Path) -> Path:
    """The tokenizer (and the model's config, which renderers probes) where ``renderers`` can load it."""
    path = Path(run_dir) / "verifiers_tokenizer"
    tokenizer.save_pretrained(str(path))
    model.config.save_pretrained(str(path))
    return path


def branch_row(episode) -> tuple[dict | None, object | None]:
    """(row, branch) of an episode's last trainable branch: Atropos-shaped ``tokens`` / ``masks`` /
    ``logprobs`` / ``score``; (None, None) when it holds no sampled token."""
    for trace in reversed(episode.traces):
        for branch in reversed(trace.branches):
            ids, sampled = branch.token_ids, branch.sampled_mask
            if branch.trainable and any(sampled) and not sampled[0]:
                logprobs = [lp if s else 1.0 for lp, s in zip(branch.logprobs, sampled)]
                return (
                    {
                        "tokens": ids,
                        "masks": [t if s else IGNORE for t, s in zip(ids, sampled)],
                        "logprobs": logprobs,
                        "score": float(trace.reward),
                        "turns": sum(1 for c in trace.calls if c.error is None),
                        "tool_calls": len(trace.tool_messages),
                    },
                    branch,
                )
    return None, None


def render_check(tokenizer, branch, row: dict) -> tuple[int | None, int | None]:
    """Where lmforge's rendering of ``branch`` first differs from the row's tokens: (position in the
    first prompt or None, position in the conversation before the last reply or None)."""
    from verifiers.v1.clients.train import tool_to_wire
    from verifiers.v1.dialects.chat import message_to_wire

    messages = [message_to_wire(m) for m in branch.messages]
    tools = [tool_to_wire(t) for t in branch.tools] or None
    first = next(i for i, n in enumerate(branch.nodes) if any(n.mask))
    prompt_len = row["masks"].index(next(m for m in row["masks"] if m != IGNORE))

    def differs(ids: list[int], reference: list[int]) -> int | None:
        pos = next((i for i, (a, b) in enumerate(zip(ids, reference)) if a != b), None)
        return pos if pos is not None or len(ids) == len(reference) else min(len(ids), len(reference))

    def encode(msgs, gen):  # as LmforgeRenderer encodes: the messages' text as text
        return encode_rendered(
            tokenizer,
            render_marked(
                tokenizer, lambda m, t: render_messages(tokenizer, m, t, add_generation_prompt=gen), msgs, tools
            ),
        )

    # the whole conversation up to the last turn's prompt: the last reply, often cut at max_tokens,
    # renders closed by the template where the sampled tokens stop
    sampled = [m != IGNORE for m in row["masks"]]
    last = max(i for i in range(1, len(sampled)) if sampled[i] and not sampled[i - 1])
    whole = encode(messages, False)
    return (
        differs(encode(messages[:first], True), row["tokens"][:prompt_len]),
        differs(whole[:last], row["tokens"][:last]),
    )


class VerifiersSource:
    """Episodes of a verifiers environment against the served policy (module doc); one per run."""

    def __init__(self, setup: SourceSetup):
        vf = _require_verifiers()
        from verifiers.v1.utils.loaders import load_environment, resolve_env_config

        if setup.ctx.distributed:
            raise ConfigError(
                "rollout.backend=verifiers runs in one process (its server and environment "
                "live in the training process); launch without torchrun"
            )
        self.setup, self.rollout = setup, setup.rollout
        cfg = self.rollout
        absolute_pythonpath()  # verifiers starts the tool servers as `python -m <module>` in their own directories
        env_cfg = resolve_env_config(
            {
                "taskset": {"id": cfg.verifiers_env, **cfg.verifiers_args},
                "agent": {"harness": {"id": cfg.verifiers_harness}, "runtime": {"type": "subprocess"}},
            }
        )
        self.env = load_environment(env_cfg)
        self.tasks = list(self.env.taskset)
        if not self.tasks:
            raise ConfigError(f"rollout.verifiers_env={cfg.verifiers_env!r}: the taskset has no tasks")
        self.order = list(range(len(self.tasks)))
        random.Random(setup.seed).shuffle(self.order)
        tokenizer_dir = save_tokenizer(setup.tokenizer, setup.policy, setup.run_dir)
        self.server = PolicyServer(
            served_copy(setup.policy), setup.tokenizer, cfg.num_prompts * cfg.group_size, "verifiers"
        )
        renderer = cfg.verifiers_renderer or {"name": "custom", "import_path": RENDERER}
        client = vf.TrainClientConfig(
            base_url=f"{self.server.url}/v1",
            api_key_var="LMFORGE_VERIFIERS_API_KEY",
            renderer=renderer,
            renderer_model_name=str(tokenizer_dir),
        )
        sampling = vf.SamplingConfig(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_tokens=cfg.max_new_tokens,
            **({"top_k": cfg.top_k} if cfg.top_k else {}),
        )
        self.ctx = vf.ModelContext(model=SERVED_NAME, client=client, sampling=sampling)
        setup.print(
            f"[verifiers] {cfg.verifiers_env}: {len(self.tasks)} tasks, harness {cfg.verifiers_harness}, "
            f"policy served at {self.server.url}, renderer {renderer}"
        )

    def step_tasks(self, step: int) -> list:
        start = (step - 1) * self.rollout.num_prompts
        return [self.tasks[self.order[(start + i) % len(self.order)]] for i in range(self.rollout.num_prompts)]

    async def _run(self, tasks: list, step: int = 0) -> list:
        """The step's episodes, or a TrainingError when they have not all finished within
        ``rollout.verifiers_timeout_s`` (a harness, tool server or environment that hangs)."""
        async with self.env.serving():
            slots = [slot for task in tasks for slot in self.env.slots(task, self.rollout.group_size)]
            running = [asyncio.ensure_future(self.env.run_slot(slot, self.ctx)) for slot in slots]
            limit = self.rollout.verifiers_timeout_s
            _, pending = await asyncio.wait(running, timeout=limit)
            if pending:
                for task in pending:
                    task.cancel()
                await asyncio.wait(pending, timeout=10.0)  # cancelled; one that ignores it is left behind
                raise TrainingError(
                    f"rollout.backend=verifiers: {len(pending)} of the {len(running)} episodes of "
                    f"step {step} did not finish within rollout.verifiers_timeout_s={limit:g} s (the "
                    "environment, its harness or its tool server hangs; see their messages above); "
                    "the last checkpoint is intact: resume with train.resume=auto"
                )
            return [task.result() for task in running]

    def rows(self, episodes: list) -> tuple[list[dict], dict]:
        """The step's rows, grouped by task, and the render check's counts (module doc, 4-5)."""
        groups, prompt_bad, episode_bad, failed = [], 0, 0, 0
        for g in range(self.rollout.num_prompts):
            group = {"tokens": [], "masks": [], "scores": [], "inference_logprobs": [], "turns": [], "tool_calls": []}
            for episode in episodes[g * self.rollout.group_size : (g + 1) * self.rollout.group_size]:
                row, branch = branch_row(episode)
                if row is None:
                    error = episode.last_error or next((t.last_error for t in episode.traces if t.last_error), None)
                    raise TrainingError(
                        f"rollout.backend=verifiers: an episode of task {episode.task.key[:12]} "
                        f"holds no sampled token (it failed: {error.message if error else 'no error'}"
                        "); see the environment's and the policy server's messages above"
                    )
                failed += not episode.ok
                prompt_pos, episode_pos = render_check(self.setup.tokenizer, branch, row)
                if (prompt_pos is not None or episode_pos is not None) and not (prompt_bad or episode_bad):
                    log.warning(
                        "verifiers' rendering differs from lmforge's: first prompt at token %s, whole "
                        "conversation at token %s (of %d); trained as verifiers rendered it",
                        prompt_pos,
                        episode_pos,
                        len(row["tokens"]),
                    )
                prompt_bad += prompt_pos is not None
                episode_bad += episode_pos is not None
                for key, value in (
                    ("tokens", row["tokens"]),
                    ("masks", row["masks"]),
                    ("scores", row["score"]),
                    ("inference_logprobs", row["logprobs"]),
                    ("turns", row["turns"]),
                    ("tool_calls", row["tool_calls"]),
                ):
                    group[key].append(value)
            groups.append(group)
        return groups, {
            "vf_prompt_mismatch": prompt_bad,
            "vf_episode_mismatch": episode_bad,
            "vf_failed_episodes": failed,
        }

    def next_batch(self, step: int) -> ScoredRollout:
        start = time.monotonic()
        episodes = asyncio.run(self._run(self.step_tasks(step), step))
        generation = time.monotonic() - start
        groups, counts = self.rows(episodes)
        batch, rewards = batch_to_rollout(groups, self.setup.tokenizer.pad_token_id)
        output = RewardOutput(
            total=rewards,
            per_function=rewards[:, None],
            names=["verifiers"],
            num_failed=torch.zeros(1, dtype=torch.long),
        )
        trained = batch.trained.sum(1).float()

        def flat(key: str) -> torch.Tensor:
            return torch.tensor([float(v) for g in groups for v in g[key]])

        metrics = {
            "reward": rewards.mean(),
            "reward_std": rewards.std(correction=0),
            "completion_len_mean": trained.mean(),
            "completion_len_max": trained.max(),
            "episode_len_mean": batch.completion_lens.float().mean(),
            "turns_per_episode": flat("turns").mean(),
            "tool_calls_per_episode": flat("tool_calls").mean(),
            "time_generation": generation,
            "time_scoring": 0.0,
            **counts,
        }
        return ScoredRollout(batch, output, metrics)

    def sync_weights(self, policy: Policy, version: int) -> None:
        """The served copy takes the weights after ``version`` steps (nothing to copy at the start: the
        copy was made from them)."""
        if version > self.server.weight_version:
            self.server.load(policy(), version)

    def state_dict(self) -> dict:
        return {}  # the task order is the seed's; the step says where in it a resumed run is

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        self.server.stop()


def build(setup: SourceSetup) -> VerifiersSource:
    return VerifiersSource(setup)
