"""The agent gateway's speed (issue 36 item 7): an agent program over HTTP against the built-in environment.

Two parts, one run, each contestant after an untimed warm-up and in alternating order, so that the load
of other processes on the machine hits them alike:

(a) **Episodes per second.** The same rollouts two ways, from the same start model, problems, sampling
    and number of episodes: ``rollout.backend=agent`` with examples/agent_calculator.py (a plain
    ``openai`` tool loop per episode, in threads, against the policy served in process through
    ``/sessions/<id>/v1``, the calls recorded and merged into samples: ``rl.sources.agent``) and
    ``env.name=calculator`` (the episodes source: ``EpisodeRunner`` over continuous batching). The two
    configs are examples/grpo_agent_calculator.yaml and examples/grpo_calculator.yaml; a repetition is one
    step's batch (``rollout.num_prompts`` x ``rollout.group_size`` episodes) from the source's
    ``next_batch``: sampling, the tool, scoring, and for the agent the HTTP calls, the recording and the
    merge (no training: what differs is the rollout). The environment runs with ``--draft-tokens``
    (default 0: the engine the agent's server has; examples/grpo_calculator.yaml uses 8). Printed: the
    medians, episodes/s, and the ratio agent / environment (target >= 0.8). Before timing, ``--check``
    held-out problems are played greedily both ways and their ids compared end to end (the environment's
    prompt + episode ids against the agent's one merged sample: the same tokens, or where they part).
(b) **Time to a held-out success rate against TRL.** bench_env_vs_trl.py's race (read its doc: TRL 1.16's
    ``GRPOTrainer(environment_factory=Calc)`` against lmforge's episode runner on the same ``Calc``
    class, same start, template, problems and algorithm settings) with the agent path as a third
    contestant: examples/agent_calculator.py's loop (``calc_agent`` below) under ``rollout.backend=agent``
    with the env side's resolved config otherwise (its run directory's config.yaml), rewards
    ``[exact]`` (the task's check, as ``Calc._score``). TRL drives; at each of its steps one lmforge step
    and one agent step run, each timed alone. Every ``--eval-every`` steps the three policies play the
    same held-out problems greedily through one evaluator (``episode_evaluator``, the same code for all
    three, untimed). Printed: episodes/s of training steps and, for each ``--target``, each side's
    training time to it and the ratios trl / agent and trl / lmforge (target: the agent at most half of
    TRL's time, as the built-in path).

    PYTHONPATH=<trl 1.16> python benchmarks/bench_agent.py          # (a) 3 reps of 8 x 8, (b) 8 steps
    python benchmarks/bench_agent.py --quick                        # ~2 min: small batches, 2 race steps
    python benchmarks/bench_agent.py --skip-race                    # (a) alone (no TRL needed)
    python benchmarks/bench_agent.py --skip-rates                   # (b) alone

Both parts start from ``--start`` (runs/sft_calculator3/final: the three SFT commands in
examples/sft_calculator.yaml's header). Figures: docs/benchmarks.md ("Agent path vs the built-in
environment").
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import statistics
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # bench_env_vs_trl, and rollout.agent_entry=bench_agent:calc_agent
if __name__ == "__main__":  # the agent entry imports this module by name: let it find this one
    sys.modules.setdefault("bench_agent", sys.modules["__main__"])

import bench_env_vs_trl as vs_trl  # noqa: E402

AGENT_FILE = os.path.join(ROOT, "examples", "agent_calculator.py")
PLAYED: set = set()  # the problems the race's agent played since the last clear() (as vs_trl.PLAYED)
_AGENT: dict = {}
_LOCK = threading.Lock()


def example_agent():
    """examples/agent_calculator.py, loaded once (the episodes' threads ask at the same time)."""
    with _LOCK:
        if "module" not in _AGENT:
            spec = importlib.util.spec_from_file_location("agent_calculator_example", AGENT_FILE)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _AGENT["module"] = module
    return _AGENT["module"]


def calc_agent(base_url: str, problem: dict, max_turns: int = 3) -> str:
    """The race's agent: examples/agent_calculator.py's ``run``, noting which problem it played."""
    PLAYED.add(problem["prompt"])
    return example_agent().run(base_url, problem, max_turns=max_turns)


# ----------------------------------------------------------------------------- (a) episodes per second


def example_state(example: str, model, tok, args, out_dir: str, extra: list[str]):
    """``rl.prepare`` of an example config with this bench's model, batch and thread settings."""
    from lmforge import rl
    from lmforge.core.config import load_config
    from lmforge.recipes.grpo import GRPOConfig

    cfg = load_config(
        GRPOConfig,
        os.path.join(ROOT, "examples", example),
        [
            f"model.name={args.start}",
            f"rollout.num_prompts={args.prompts}",
            f"rollout.group_size={args.group}",
            f"train.output_dir={out_dir}",
            "train.save_every=0",
            "train.eval_every=0",
            "logging.progress=false",
            f"train.threads={args.threads}",
            "train.device=cpu",
            *extra,
        ],
    )
    algo = cfg.algo.resolved()
    return rl.prepare(cfg, "bench_agent", algo, model=model, tokenizer=tok)


def same_episodes(states: dict, tok, problems: list) -> str:
    """Greedy episodes of ``problems`` both ways on the start model: how many have the same token ids
    end to end (the env's prompt + episode ids; the agent's one merged sample), and the first that differs."""
    from lmforge.rl.sources.agent import agent_evaluator
    from lmforge.rl.sources.agent_samples import merge_calls
    from lmforge.rl.sources.episodes import episode_evaluator

    env_cfg, agent_cfg = states["env"], states["agent"]  # their resolved sections (rl.RLState)
    by_env = episode_evaluator(
        env_cfg.env,
        tok,
        problems,
        states["env"].prompts.task,
        [],
        env_cfg.rollout.max_new_tokens,
        states["env"].model.config.max_position_embeddings,
        10.0,
        1,
    )
    by_agent = agent_evaluator(
        agent_cfg.rollout,
        tok,
        problems,
        states["agent"].prompts.task,
        states["agent"].reward_set,
        agent_cfg.run.train.max_new_tokens,
    )
    try:
        env_episodes, agent_episodes = by_env(states["env"].model)[1], by_agent(states["agent"].model)[1]
    finally:
        by_env.close()
        by_agent.close()
    same, first = 0, ""
    for e, a in zip(env_episodes, agent_episodes):
        samples = merge_calls(a.calls)
        ours, theirs = e.prompt_ids + e.ids, samples[0].ids if len(samples) == 1 else []
        same += ours == theirs
        if ours != theirs and not first:
            at = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))
            first = (
                f"; first difference, {e.state.problem.prompt!r} at token {at} ({len(samples)} agent samples): "
                f"env {tok.decode(ours[at : at + 20])!r} agent {tok.decode(theirs[at : at + 20])!r}"
            )
    return f"{same} of {len(problems)} greedy episodes have the same ids on both paths{first}"


def episode_rates(args) -> dict:
    """Part (a): rollouts of the agent path and the environment path, alternating (module doc)."""
    from lmforge.core.config import ModelConfig
    from lmforge.model.load import load_model

    model, tok = load_model(ModelConfig(name=args.start, tokenizer=""))
    out = tempfile.mkdtemp(prefix="bench_agent_")
    states = {
        "agent": example_state(
            "grpo_agent_calculator.yaml",
            copy.deepcopy(model),
            tok,
            args,
            os.path.join(out, "agent"),
            [f"rollout.agent_entry={AGENT_FILE}:run"],
        ),
        "env": example_state(
            "grpo_calculator.yaml",
            copy.deepcopy(model),
            tok,
            args,
            os.path.join(out, "env"),
            [f"env.draft_tokens={args.draft_tokens}"],
        ),
    }
    rows: dict = {side: [] for side in states}
    try:
        if args.check:
            print(
                f"[check] {same_episodes(states, tok, states['env'].prompts.eval_problems[: args.check])}", flush=True
            )
        for side, state in states.items():  # the warm-up (untimed): the server's start, first compiles
            state.source.sync_weights(state.sampler_model, 0)
            state.source.next_batch(1)
        for rep in range(args.reps):
            for side in ("agent", "env") if rep % 2 == 0 else ("env", "agent"):
                start = time.perf_counter()
                metrics = states[side].source.next_batch(rep + 2).metrics
                seconds = time.perf_counter() - start
                rows[side].append((seconds, float(metrics["reward"]), float(metrics["completion_len_mean"])))
                print(
                    f"[rate] rep {rep} {side:5s} {seconds:6.2f} s  reward {rows[side][-1][1]:.2f}  policy tokens "
                    f"{rows[side][-1][2]:.0f} an episode",
                    flush=True,
                )
    finally:
        for state in states.values():
            state.source.close()
    episodes = args.prompts * args.group
    result = {}
    for side, values in rows.items():
        median = statistics.median(v[0] for v in values)
        result[side] = episodes / median
        print(
            f"[result] {side:5s}: {episodes} episodes in a median {median:.2f} s = {result[side]:.2f} episodes/s "
            f"(mean reward {statistics.mean(v[1] for v in values):.2f}, policy tokens "
            f"{statistics.mean(v[2] for v in values):.0f} an episode)",
            flush=True,
        )
    print(f"[result] episodes/s agent / env = {result['agent'] / result['env']:.2f} (target >= 0.8)", flush=True)
    return result


# ----------------------------------------------------------------------------- (b) the race against TRL


def agent_state(env_cfg, model, tok, out_dir: str):
    """The race's agent contestant: the env side's resolved config, its environment swapped for
    ``calc_agent`` (rollout.backend=agent) and the task's exact check as the reward."""
    import yaml

    from lmforge import rl
    from lmforge.core.config import load_config, to_dict
    from lmforge.recipes.grpo import GRPOConfig

    values = to_dict(env_cfg)
    del values["env"]
    values["rollout"].update(backend="agent", agent_entry="bench_agent:calc_agent")
    values["rewards"]["functions"] = ["exact"]
    values["train"]["output_dir"] = out_dir
    path = out_dir + "_config.yaml"
    with open(path, "w") as f:
        yaml.safe_dump(values, f, sort_keys=False)
    cfg = load_config(GRPOConfig, path)
    return rl.prepare(cfg, "bench_agent", cfg.algo.resolved(), model=model, tokenizer=tok)


def race(args) -> dict:
    """Part (b): TRL, lmforge's environment path and the agent path, alternating (module doc)."""
    from transformers import TrainerCallback

    from lmforge import rl
    from lmforge.data.tasks import get_task
    from lmforge.recipes.grpo import make_step
    from lmforge.rl.sources.episodes import episode_evaluator

    task = get_task(args.task)
    args.train_problems = task.make_problems(4096, 0, "train")
    eval_problems = task.make_problems(args.eval_games, 0, "test")
    model, tok = vs_trl.start_model(args)
    out = tempfile.mkdtemp(prefix="bench_agent_race_")
    env_state, algo, env_cfg = vs_trl.lmforge_state(copy.deepcopy(model), tok, args, os.path.join(out, "lmforge"))
    ag_state = agent_state(env_cfg, copy.deepcopy(model), tok, os.path.join(out, "agent"))
    evaluate = episode_evaluator(
        env_cfg.env, tok, eval_problems, task, [], args.episode_tokens, model.config.max_position_embeddings, 10.0, 1
    )
    steps = {
        "lmforge": rl.synced_steps(env_state, make_step(env_state, algo)),
        "agent": rl.synced_steps(ag_state, make_step(ag_state, algo)),
    }
    log: dict = {"trl": [], "lmforge": [], "agent": []}  # (step, training seconds so far, accuracy)
    clock = {"trl": 0.0, "lmforge": 0.0, "agent": 0.0, "mark": 0.0, "step": 0, "different": []}

    def evaluate_all(trl_model, step: int) -> None:
        for side, policy in (("trl", trl_model), ("lmforge", env_state.model), ("agent", ag_state.model)):
            log[side].append((step, clock[side], evaluate(policy)[0]["accuracy"]))
        print(
            f"[eval {step:3d}] held-out success: " + "  ".join(f"{s} {rows[-1][2]:.3f}" for s, rows in log.items()),
            flush=True,
        )

    def clear() -> None:
        for played in (*vs_trl.PLAYED.values(), PLAYED):
            played.clear()

    class Alternate(TrainerCallback):
        def on_train_begin(self, _args, _state, _control, model=None, **_):
            evaluate_all(model, 0)
            clear()
            clock["mark"] = time.perf_counter()

        def on_step_end(self, _args, _state, _control, model=None, **_):
            clock["trl"] += time.perf_counter() - clock["mark"]
            clock["step"] = step = clock["step"] + 1
            order = ("lmforge", "agent") if step % 2 else ("agent", "lmforge")
            notes = []
            for side in order:
                start = time.perf_counter()
                metrics = steps[side](step)
                clock[side] += time.perf_counter() - start
                notes.append(
                    f"{side} reward {float(metrics['reward']):.2f}, gen {float(metrics['time_generation']):.1f}s "
                    f"train {float(metrics['time_training']):.1f}s"
                )
            expected = set(keys[(step - 1) * args.prompts : step * args.prompts])
            if not vs_trl.PLAYED["trl"] == vs_trl.PLAYED["lmforge"] == PLAYED == expected:
                clock["different"].append(step)
            print(
                f"step {step:3d}: " + "  ".join(f"{s} {clock[s]:7.1f}s" for s in log) + f"  ({', '.join(notes)})",
                flush=True,
            )
            if step % args.eval_every == 0 or step == args.steps:
                evaluate_all(model, step)
            clear()
            clock["mark"] = time.perf_counter()

    problems = vs_trl.lmforge_problems(env_state, args.steps)
    keys = [p.prompt for p in problems]  # what Calc.reset and calc_agent record
    trainer = vs_trl.trl_trainer(copy.deepcopy(model), tok, args, os.path.join(out, "trl"), Alternate(), problems)
    vs_trl.check_same_prompt(trainer, env_state, args, problems[0])
    try:
        trainer.train()
    finally:
        evaluate.close()
        env_state.source.close()
        ag_state.source.close()
    print(f"[bench] trl's last step: {vs_trl.trl_tool_use(trainer)}", flush=True)
    print(
        f"[bench] the same problems on all three sides at every step: {not clock['different']}"
        + (f" (not at steps {clock['different']})" if clock["different"] else ""),
        flush=True,
    )
    return race_report(log, args)


def race_report(log: dict, args) -> dict:
    """Episodes/s of training steps per side, and the time to each ``--target`` with the ratios."""
    rates = {}
    for side, rows in log.items():
        step, seconds, _ = rows[-1]
        rates[side] = step * args.prompts * args.group / seconds
        print(
            f"[result] {side:8s}: {step * args.prompts * args.group} episodes in {seconds:.1f} s of training steps "
            f"= {rates[side]:.2f} episodes/s; held-out success {rows[0][2]:.3f} -> {rows[-1][2]:.3f} "
            f"(best {max(r[2] for r in rows):.3f})",
            flush=True,
        )
    print(
        f"[result] episodes/s of training steps: agent / trl = {rates['agent'] / rates['trl']:.2f}, "
        f"lmforge / trl = {rates['lmforge'] / rates['trl']:.2f}, agent / lmforge = "
        f"{rates['agent'] / rates['lmforge']:.2f}",
        flush=True,
    )
    for target in args.target:
        reached = {side: next((r for r in rows if r[2] >= target), None) for side, rows in log.items()}
        when = "  ".join(f"{s} {f'{r[1]:.1f} s (step {r[0]})' if r else 'not reached'}" for s, r in reached.items())
        ratios = "".join(
            f"; trl / {s} = {reached['trl'][1] / reached[s][1]:.2f}"
            for s in ("agent", "lmforge")
            if reached["trl"] and reached[s] and reached[s][1] > 0
        )
        print(f"[result] time to held-out success {target:.2f}: {when}{ratios}", flush=True)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--start",
        default="runs/sft_calculator3/final",
        help="the warm checkpoint every contestant starts from (examples/sft_calculator.yaml's third "
        "run; default runs/sft_calculator3/final)",
    )
    parser.add_argument("--prompts", type=int, default=8, help="problems per batch, both parts (default 8)")
    parser.add_argument("--group", type=int, default=8, help="episodes per problem, both parts (default 8)")
    parser.add_argument("--reps", type=int, default=3, help="(a): timed batches per side (default 3)")
    parser.add_argument(
        "--draft-tokens",
        type=int,
        default=0,
        help="(a): the environment path's env.draft_tokens (default 0, as the agent's server)",
    )
    parser.add_argument(
        "--check",
        type=int,
        default=16,
        help="(a): held-out problems played greedily both ways to compare their token ids (default 16)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--steps", type=int, default=8, help="(b): GRPO steps per side (default 8)")
    parser.add_argument("--eval-every", type=int, default=2, help="(b): steps between evaluations (default 2)")
    parser.add_argument("--eval-games", type=int, default=200, help="(b): held-out problems (default 200)")
    parser.add_argument(
        "--target", type=float, nargs="+", default=[0.5, 0.6, 0.7, 0.8], help="(b): held-out success rates to time"
    )
    parser.add_argument("--seed", type=int, default=0, help="(b): every side's training seed (default 0)")
    parser.add_argument("--skip-race", action="store_true", help="part (a) alone (no TRL needed)")
    parser.add_argument("--skip-rates", action="store_true", help="part (b) alone")
    parser.add_argument(
        "--quick", action="store_true", help="~2 min: 2 x 4 episodes, 2 reps; race of 2 steps on 16 held-out problems"
    )
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.group, args.reps, args.steps, args.eval_every, args.eval_games = 2, 4, 2, 2, 2, 16
        args.check = 4
    if not os.path.isdir(args.start):
        sys.exit(
            f"--start {args.start}: no such checkpoint directory; make it with the three commands in "
            f"examples/sft_calculator.yaml's header, or pass the path of yours"
        )
    torch.set_num_threads(args.threads)
    print(
        f"[bench] load average at start: {os.getloadavg()} ({os.cpu_count()} cores, shared with other jobs)", flush=True
    )
    if not args.skip_rates:
        episode_rates(args)
    if not args.skip_race:
        ours = {k: v for k, v in vars(args).items() if k != "draft_tokens"}  # the race keeps bench_env_vs_trl's 8
        race_args = argparse.Namespace(
            **{
                **vs_trl.SETTINGS["calculator"],
                **ours,
                "env_name": "calculator",
                "trl_micro_batch": None,
                "trl_continuous_batching": False,
            }
        )
        race_args.micro_batch = min(race_args.micro_batch, args.prompts * args.group)
        race(race_args)
    print(f"[bench] load average at end: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
