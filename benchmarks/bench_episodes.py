"""Episodes per second: the round-based episode runner vs continuous batching across turns, side by side.

Both runners play the same batch of episodes of a built-in environment with the same model, limits
and sampling settings (``env.continuous=false`` vs ``true``). Rounds: every turn of every active
episode is one engine call, and the next turn waits for every environment step of the round.
Continuous: one running batch; an episode's next turn joins it as soon as its environment step
returns, with its KV cache kept (only the environment's delta tokens prefilled).

``--latency-s`` makes the environment step of a ``--slow-frac`` share of the episodes (chosen per
problem, fixed by ``--seed``) sleep that long, standing in for a tool call or a remote environment.
Each repetition runs both runners in alternating order, so load from other processes on the machine
hits them alike; the script prints medians, episodes/s, sampled tokens/s and the ratio.

    python benchmarks/bench_episodes.py --threads 1                      # guess_number, tiny random Llama
    python benchmarks/bench_episodes.py --threads 1 --latency-s 0.05 --slow-frac 0.25
    python benchmarks/bench_episodes.py --threads 1 --env calculator --task multiplication:digits=3 --env-args '{}' \
        --tokenizer char:ascii --max-new-tokens 48 --latency-s 0.02

Sampling is at temperature 1 with a fixed seed; the two runners draw from different generators
(rounds: one per round, continuous: one per turn of each episode), so their episodes differ and
the sampled tokens/s is the fairer speed when their lengths differ.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
import yaml

from lmforge.core.config import ModelConfig
from lmforge.data.tasks import get_task
from lmforge.envs.episode import EpisodeLimits, EpisodeRunner
from lmforge.envs.registry import make_environment
from lmforge.model.load import context_length, load_model
from lmforge.rollout import SamplingParams, generate
from lmforge.rollout.continuous import ContinuousDecoder


class Latency:
    """``env`` whose ``step`` sleeps ``latency_s`` first on the problems in ``slow`` (by prompt and answer)."""

    def __init__(self, env, latency_s: float, slow: set):
        self.env, self.latency_s, self.slow = env, latency_s, slow
        self.tools = getattr(env, "tools", [])

    def reset(self, problem, state):
        return self.env.reset(problem, state)

    def step(self, state, message):
        if (state.problem.prompt, str(state.problem.answer)) in self.slow:
            time.sleep(self.latency_s)
        return self.env.step(state, message)


def play(mode: str, runner, model, tokenizer, problems, group_size: int, params: SamplingParams) -> tuple:
    """One batch in ``mode``; returns (seconds, episodes)."""
    start = time.perf_counter()
    with torch.inference_mode():
        if mode == "rounds":

            def generate_fn(ids, turn_params, num_samples):
                return generate(model, ids, turn_params, num_samples=num_samples, pad_token_id=tokenizer.pad_token_id)

            episodes, _ = runner.run(generate_fn, problems, group_size, params)
        else:
            episodes, _ = runner.run_continuous(
                ContinuousDecoder(model, tokenizer.pad_token_id), problems, group_size, params
            )
    return time.perf_counter() - start, episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (a random tiny Llama) or a model name / dir")
    parser.add_argument(
        "--tokenizer",
        default="char",
        help="the tiny model's tokenizer (calculator: char:ascii, whose template lists the tools on one line)",
    )
    parser.add_argument("--env", default="guess_number", help="built-in environment")
    parser.add_argument("--task", default="guess_number:high=100", help="data.task giving the problems")
    parser.add_argument("--env-args", default="{show_range: true}", help="env.args, as YAML")
    parser.add_argument("--problems", type=int, default=8, help="problems per batch (rollout.num_prompts)")
    parser.add_argument("--group-size", type=int, default=4, help="episodes per problem (rollout.group_size)")
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--max-episode-tokens", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=16, help="longest turn")
    parser.add_argument("--latency-s", type=float, default=0.0, help="seconds a slow problem's environment step sleeps")
    parser.add_argument("--slow-frac", type=float, default=1.0, help="share of the problems whose steps sleep")
    parser.add_argument("--workers", type=int, default=8, help="environment threads (env.workers)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.model == "tiny":
        model, tokenizer = load_model(
            ModelConfig(
                name="tiny:llama",
                tokenizer=args.tokenizer,
                hidden_size=64,
                num_layers=2,
                num_heads=4,
                max_position_embeddings=512,
            )
        )
    else:
        model, tokenizer = load_model(ModelConfig(name=args.model))
    model.eval()
    problems = get_task(args.task).make_problems(args.problems, args.seed, "train")
    keys = [(p.prompt, str(p.answer)) for p in problems]
    slow = set(random.Random(args.seed).sample(keys, round(args.slow_frac * len(keys))))
    env = Latency(make_environment(args.env, yaml.safe_load(args.env_args) or {}), args.latency_s, slow)
    limits = EpisodeLimits(max_turns=args.max_turns, max_episode_tokens=args.max_episode_tokens)
    runner = EpisodeRunner(env, tokenizer, limits, args.workers, context_length(model))
    params = SamplingParams(
        temperature=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=[tokenizer.eos_token_id], seed=args.seed
    )
    results: dict[str, list] = {"rounds": [], "continuous": []}
    try:
        play("continuous", runner, model, tokenizer, problems[:2], 1, params)  # warm-up
        for rep in range(args.reps):
            for mode in ("rounds", "continuous") if rep % 2 == 0 else ("continuous", "rounds"):
                seconds, episodes = play(mode, runner, model, tokenizer, problems, args.group_size, params)
                results[mode].append(
                    (
                        seconds,
                        len(episodes),
                        sum(e.num_trained for e in episodes),
                        sum(e.state.turn for e in episodes) / len(episodes),
                    )
                )
    finally:
        runner.close()
    print(
        f"{args.problems} problems x {args.group_size} episodes, {args.env}, latency {args.latency_s:g} s on "
        f"{len(slow)}/{len(keys)} problems, max_turns {args.max_turns}, max_new_tokens {args.max_new_tokens}, "
        f"threads {args.threads}, {args.reps} reps (medians)"
    )
    summary = {}
    for mode, rows in results.items():
        seconds = statistics.median(r[0] for r in rows)
        tokens_per_s = statistics.median(r[2] / r[0] for r in rows)
        summary[mode] = {
            "seconds": round(seconds, 3),
            "episodes_per_s": round(rows[0][1] / seconds, 2),
            "sampled_tokens_per_s": round(tokens_per_s, 1),
            "turns_per_episode": round(statistics.mean(r[3] for r in rows), 2),
        }
        print(
            f"  {mode:<11} {seconds:7.2f} s  {rows[0][1] / seconds:7.2f} episodes/s  {tokens_per_s:8.1f} sampled "
            f"tokens/s  {summary[mode]['turns_per_episode']:.2f} turns/episode"
        )
    if not all(s["turns_per_episode"] for s in summary.values()):
        raise SystemExit(
            "no turn was played: the first prompts fill the model's context or the environment fails "
            "on reset (see the warnings above); the figures above measure nothing"
        )
    ratio = summary["rounds"]["seconds"] / summary["continuous"]["seconds"]
    print(f"  continuous / rounds: {ratio:.2f}x episodes/s")
    print(json.dumps({**summary, "speedup": round(ratio, 2)}))


if __name__ == "__main__":
    main()
