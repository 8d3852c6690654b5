"""The RL run: build everything a run's steps share (:func:`prepare`), then drive the recipe's step
on the runtime loop (:func:`train_rl`), with the rollout source synced after every step.

A step (the recipe's: ``recipes/grpo.py:grpo_step``, ``recipes/ppo.py:ppo_step``) reads top to bottom
through this package: ``state.source.next_batch(step)`` (``sources/``: this rank's rows, scored) ->
advantages (``lmforge.losses.advantages``) -> ``batch.pack_rollout`` (the trainer's layout, trained mask)
-> ``forward`` (logprobs of the trained tokens) -> ``for update in updates.Updates(...)``: ``for micro in
update``: the recipe's forward, loss and ``update.backward``; ``update.step()`` (passes, mini- and
micro-batches, global counts) -> ``source.sync_weights``. This file knows no source by name: they
are built by ``sources.make_source`` from the rollout section.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch

from ..core.errors import ConfigError
from ..data.prompts import prompt_texts
from ..data.sft import special_text_note
from ..envs.episode import save_episodes
from ..model import lora
from ..model.load import context_length, load_model
from ..model.tokenizer import check_unknown_tokens
from ..parallel.context import torchrun_world
from ..rollout import RewardSet
from ..rollout.evaluation import held_out_evaluator, save_samples
from ..runtime.loop import Trainer, TrainState, build_state, full_model, train_loop
from ..runtime.optim import BatchOrder
from ..runtime.run import Run, start_run
from .config import EnvConfig, RewardsConfig, RLDataConfig, RolloutConfig, check_rl_config
from .forward import reference_model
from .prompts import PromptSet, build_prompts, prompt_budget
from .sources import RolloutSource, SourceSetup, check_source, make_source, resume_source
from .sources.agent import agent_evaluator, problem_dict
from .sources.episodes import episode_evaluator


@dataclasses.dataclass
class RLState:
    """Everything a run's steps share (built by :func:`prepare`): the training state and the RL parts."""

    train: TrainState
    ref_model: torch.nn.Module | None
    prompts: PromptSet
    reward_set: RewardSet | None  # None: an env run scored by its environment alone
    source: RolloutSource  # where each step's rows come from (lmforge.rl.sources)
    # the RL sections, resolved once in prepare (the runtime's own are on state.run)
    data: RLDataConfig
    rollout: RolloutConfig
    rewards: RewardsConfig
    env: EnvConfig | None  # None: a recipe without multi-turn environments (distill)

    @property
    def run(self) -> Run:
        return self.train.run

    @property
    def model(self) -> torch.nn.Module:
        return self.train.model

    @property
    def tokenizer(self):
        return self.train.tokenizer

    @property
    def updater(self):
        return self.train.updater

    @property
    def micro_batch_size(self) -> int:
        return self.run.micro_batch_size

    def sampler_model(self) -> torch.nn.Module:
        """The full policy to sample from (FSDP2: gathered; a collective)."""
        return full_model(self.train)


def check_rl_split(num_prompts: int, group_size: int, num_mini_batches: int, world_size: int) -> int:
    """Rows of one optimizer update over all ranks; an error naming the numbers when the step's
    prompts cannot be shared out with each group whole on one rank."""
    if num_prompts % (num_mini_batches * world_size):
        raise ConfigError(
            f"rollout.num_prompts={num_prompts} must be divisible by algo.num_mini_batches="
            f"{num_mini_batches} x world size={world_size}: each update takes whole groups from every rank"
        )
    return num_prompts * group_size // num_mini_batches


def prepare(
    cfg,
    name: str,
    algo,
    model=None,
    tokenizer=None,
    console=None,
    extra_modules: dict[str, torch.nn.Module] | None = None,
) -> RLState:
    """Load, set up hardware, the parallel context and the run directory, build the optimizer, resume,
    build the rollout source.

    ``cfg`` is the recipe's whole config: this is where its sections are resolved (into a copy: ``cfg`` is
    not changed) and handed out (the source gets the rollout section, the steps the sections on the state).
    ``extra_modules`` (e.g. PPO's value head) are trained and clipped with the model; the saved trainer
    state of the checkpoint resumed from is ``state.train.saved`` ({} for a fresh run).
    """
    check_rl_config(cfg, algo)
    if model is None:
        model, tokenizer = load_model(cfg.model)
    data = dataclasses.replace(
        cfg.data, max_prompt_len=prompt_budget(cfg.data.max_prompt_len, cfg.rollout.max_new_tokens, model)
    )
    cfg = dataclasses.replace(cfg, data=data, algo=algo)  # the saved config holds the resolved values (presets applied)
    prompts = build_prompts(cfg.data, tokenizer, cfg.train.seed, cfg.data.max_prompt_len)
    env = getattr(cfg, "env", None)  # env.name set: rows are episodes (sources/episodes.py)
    env = env if env is not None and env.name else None
    seq_len = max(len(p) for p in prompts.prompt_ids) + completion_budget(cfg, env, model)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=step_rows(cfg)))
    world_size = torchrun_world()[1]
    update_rows = check_rl_split(cfg.rollout.num_prompts, cfg.rollout.group_size, algo.num_mini_batches, world_size)
    check_source(cfg.rollout, algo.is_level, world_size > 1)  # before start_run takes the run directory
    run = start_run(
        cfg,
        name,
        model,
        seq_len=seq_len,
        console=console,
        update_rows=update_rows,
        update_label="rollout rows per update (num_prompts x group_size / num_mini_batches)",
        rollout_backend=cfg.rollout.backend,
    )
    source_name = cfg.data.path or f"data.task={cfg.data.task}"
    check_unknown_tokens(tokenizer, prompt_texts(prompts.problems), cfg.model, source_name, run.print)
    model = lora.apply_for_run(model, cfg.model.lora, run.train, run.ctx).to(run.device)  # adapters: docs/lora.md
    ref_model = reference_model(model, algo.kl_coef)  # before resume: the reference is the start
    num_updates = cfg.train.max_steps * algo.num_iterations * algo.num_mini_batches
    order = BatchOrder(len(prompts.prompt_ids), cfg.rollout.num_prompts, cfg.train.seed)
    train = build_state(run, model, tokenizer, order, num_updates, extra_modules)
    specs = cfg.rewards.specs(allow_empty=True)  # (empty only in an env run: check_rl_config)
    rewards = cfg.rewards
    reward_set = RewardSet(specs, rewards.max_failure_fraction, rewards.timeout_s, rewards.workers) if specs else None
    setup = SourceSetup(
        rollout=cfg.rollout,
        prompts=prompts,
        order=order,
        tokenizer=tokenizer,
        reward_set=reward_set,
        ctx=run.ctx,
        policy=full_model(train),
        seed=cfg.train.seed,
        num_mini_batches=algo.num_mini_batches,
        is_level=algo.is_level,
        max_prompt_len=cfg.data.max_prompt_len,
        max_steps=cfg.train.max_steps,
        run_dir=run.dir,
        bf16_native=run.hw.bf16_supported,
        print=run.print,
        env=env,
    )
    source = make_source(setup)
    resume_source(source, train.saved, run.print)
    print_prompts(prompts, cfg.data.max_prompt_len, run.print)
    return RLState(train, ref_model, prompts, reward_set, source, cfg.data, cfg.rollout, cfg.rewards, env)


def completion_budget(cfg, env, model) -> int:
    """Tokens after a row's first prompt: ``env.max_episode_tokens`` for episodes, else
    ``rollout.max_new_tokens``; an error naming both numbers when episodes leave no room for a prompt."""
    if env is None:
        return cfg.rollout.max_new_tokens
    completion_len, context = env.max_episode_tokens, context_length(model)
    if completion_len != cfg.rollout.max_new_tokens and completion_len >= (context or completion_len + 1):
        tiny = cfg.model.name.startswith("tiny:")
        raise ConfigError(
            f"env.max_episode_tokens={completion_len} leaves no room for a prompt in the model's "
            f"context of {context} tokens"
            + (" (model.max_position_embeddings)" if tiny else "")
            + "; lower env.max_episode_tokens"
            + (" or raise model.max_position_embeddings" if tiny else "")
        )
    return completion_len


def step_rows(cfg) -> int:
    """Rows of an RL step, ``rollout.num_prompts x rollout.group_size``: what ``train.batch_size`` resolves
    to (an error when it is set to anything else)."""
    rows = cfg.rollout.num_prompts * cfg.rollout.group_size
    if cfg.train.batch_size not in (0, rows):
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size}: an RL step's batch is rollout.num_prompts x "
            f"rollout.group_size = {rows} completions; leave train.batch_size unset (0)"
        )
    return rows


def print_prompts(prompts: PromptSet, max_prompt_len: int, say: Callable[[str], None]) -> None:
    """The run's prompt counts: training, held out, dropped or cut to ``data.max_prompt_len``."""
    if prompts.eval_note:
        say(f"[data] {prompts.eval_note}")
    dropped = f"; {prompts.num_dropped} longer than data.max_prompt_len={max_prompt_len} dropped"
    cut = f"; {prompts.num_truncated} left-truncated to {max_prompt_len} tokens"
    say(
        f"[data] {len(prompts.prompt_ids)} training prompts, {len(prompts.eval_problems)} held-out problems"
        + (dropped if prompts.num_dropped else "")
        + (cut if prompts.num_truncated else "")
    )
    if prompts.num_special_text:
        say(special_text_note(prompts.num_special_text, "prompts"))


def make_evaluate(state: RLState) -> Callable[[int], dict] | None:
    """Greedy held-out accuracy of the policy (a task's checker, or the configured rewards on held-out
    rows: :func:`lmforge.rollout.evaluation.held_out_evaluator`), plus a few printed samples."""
    prompts, run = state.prompts, state.run
    if not prompts.eval_problems:
        return None
    if state.env is not None:
        return make_episode_evaluate(state)
    if state.rollout.backend == "agent":
        return make_agent_evaluate(state)
    tcfg, rewards = run.train, state.rewards
    evaluator = held_out_evaluator(
        state.tokenizer,
        prompts.eval_problems,
        prompts.chat,
        tcfg.max_new_tokens,
        task=prompts.task,
        reward_specs=rewards.specs(),
        pass_k=state.data.pass_k,
        temperature=state.rollout.temperature,
        seed=tcfg.seed,
        max_prompt_len=state.data.max_prompt_len,
        # the length limit the evaluation generates with, for `overlong`
        reward_kwargs={"max_new_tokens": tcfg.max_new_tokens},
        reward_timeout_s=rewards.timeout_s,
        reward_workers=rewards.workers,
    )

    def evaluate(step: int) -> dict:
        metrics, prompt_texts, texts = evaluator(state.sampler_model(), step)
        k = tcfg.num_samples
        if run.ctx.is_main:
            save_samples(run.dir, step, prompt_texts[:k], texts[:k], run.print)
        return metrics

    evaluate.close = evaluator.close  # the evaluation's reward workers: stopped with the run

    return evaluate


def make_episode_evaluate(state: RLState) -> Callable[[int], dict]:
    """Held-out success of the policy's greedy episodes (``sources.episodes.episode_evaluator``), a few
    whole episodes written to samples.jsonl."""
    run, rewards = state.run, state.rewards
    evaluator = episode_evaluator(
        state.env,
        state.tokenizer,
        state.prompts.eval_problems,
        state.prompts.task,
        rewards.specs(allow_empty=True),
        state.rollout.max_new_tokens,
        context_length(state.model),
        rewards.timeout_s,
        rewards.workers,
    )

    def evaluate(step: int) -> dict:
        metrics, episodes, totals = evaluator(state.sampler_model())
        k = run.train.num_samples
        if run.ctx.is_main:
            save_episodes(run.dir, step, episodes[:k], totals[:k], run.print)
        return metrics

    evaluate.close = evaluator.close
    return evaluate


def make_agent_evaluate(state: RLState) -> Callable[[int], dict]:
    """Held-out success of the agent's greedy episodes on the policy (``sources.agent.agent_evaluator``);
    a few episodes' calls, decoded, written to samples.jsonl."""
    run = state.run
    evaluator = agent_evaluator(
        state.rollout,
        state.tokenizer,
        state.prompts.eval_problems,
        state.prompts.task,
        state.reward_set,
        run.train.max_new_tokens,
    )

    def evaluate(step: int) -> dict:
        metrics, episodes, totals = evaluator(state.sampler_model())
        k = run.train.num_samples
        if run.ctx.is_main:
            replies = [" | ".join(state.tokenizer.decode(c.token_ids) for c in e.calls) for e in episodes[:k]]
            save_samples(
                run.dir, step, [problem_dict(e.problem).get("prompt", "") for e in episodes[:k]], replies, run.print
            )
        return metrics

    evaluate.close = evaluator.close
    return evaluate


TIME_KEYS = ("time_generation", "time_scoring", "time_training")


def synced_steps(state: RLState, step_fn: Callable[[int], dict]) -> Callable[[int], dict]:
    """``step_fn`` with the rollout source's weight syncs around it: before the first step (the start's,
    or the resumed, weights) and after each one. What :func:`train_rl` runs; a benchmark that drives
    steps itself calls this too, so that a source with its own copy (bf16, vLLM) samples the new weights."""
    started = False

    def step(done: int) -> dict:
        nonlocal started
        if not started:
            state.source.sync_weights(state.sampler_model, done - 1)
            started = True
        metrics = step_fn(done)
        state.source.sync_weights(state.sampler_model, done)  # the weights after this step's update
        return metrics

    return step


def train_rl(
    state: RLState,
    step_fn: Callable[[int], dict],
    extra_state: Callable[[], dict] = dict,
    save_extra: Callable[[Path], None] | None = None,
) -> dict:
    """Steps ``state.train.step + 1 .. max_steps`` of ``step_fn(step) -> metrics`` on the runtime loop
    (a baseline evaluation at step 0), with the source's weight syncs (:func:`synced_steps`: inside the
    runtime loop, so that a source failing there still frees the run directory); checkpoints hold the
    source's state. Returns the last evaluation (+ ``accuracy_before``) and ``run_dir``."""
    source, synced = state.source, synced_steps(state, step_fn)

    def step(done: int) -> dict:
        metrics = synced(done)
        # async: the time the step waited for its batch; generation itself overlapped training
        metrics["data_time"] = metrics.get("time_rollout_wait", metrics["time_generation"] + metrics["time_scoring"])
        return metrics

    evaluate = make_evaluate(state)
    trainer = Trainer(
        step=step,
        evaluate=evaluate,
        evaluate_at_start=True,
        extra_state=lambda: {**extra_state(), **source.state_dict()},
        save_final_extra=save_extra,
        time_keys=TIME_KEYS,
    )
    try:
        return train_loop(state.train, trainer)
    finally:  # on errors too: the source first (a background sampler scores with the reward set), then the rewards
        source.close()
        if state.reward_set is not None:
            state.reward_set.close()
        if evaluate is not None:
            evaluate.close()
