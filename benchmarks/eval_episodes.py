"""Held-out episodes of a saved model on a built-in environment, greedy and sampled.

The GRPO recipe's own evaluation plays one greedy episode per held-out problem (``data.num_eval`` of
them; guess_number with one opening has only 11 held-out secrets). This script plays more of them
greedily (``--greedy N``) and adds sampled episodes (``--sampled N`` games over the same held-out
problems, cycled, at ``--temperature``) and reports, for each mode, the success rate, the mean turns
of the solved episodes and the mean turns of all episodes (an unsolved game counts its turns until
the limit). docs/environments.md quotes it::

    python benchmarks/eval_episodes.py runs/grpo_guess_number/final --env guess_number \\
        --task guess_number:high=100,min_width=10 --env-args '{max_guesses: 10, show_range: true}' \\
        --max-turns 10 --max-new-tokens 8 --greedy 1000 --sampled 800 --seed 2

Success is a total reward >= 1 (the environment's parts), as in the recipe's ``accuracy``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import yaml

from lmforge.core.config import ModelConfig
from lmforge.data.tasks import get_task
from lmforge.envs.episode import EpisodeLimits, EpisodeRunner
from lmforge.envs.registry import make_environment
from lmforge.model.load import context_length, load_model
from lmforge.rollout import SamplingParams, generate


def play(runner, model, tokenizer, problems, temperature: float, max_new_tokens: int, seed: int, batch: int = 64):
    params = SamplingParams(
        temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=[tokenizer.eos_token_id], seed=seed
    )

    def generate_fn(ids, turn_params, num_samples):
        return generate(model, ids, turn_params, num_samples=num_samples, pad_token_id=tokenizer.pad_token_id)

    episodes = []
    with torch.no_grad():
        for start in range(0, len(problems), batch):
            episodes += runner.run(generate_fn, problems[start : start + batch], 1, params)[0]
    return episodes


def summary(episodes) -> dict:
    solved = [e for e in episodes if sum(e.rewards.values()) >= 1.0]
    n = len(episodes)
    return {
        "episodes": n,
        "success": round(len(solved) / n, 4),
        "turns_to_solve": round(sum(e.state.turn for e in solved) / max(len(solved), 1), 3),
        "turns_per_episode": round(sum(e.state.turn for e in episodes) / n, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a saved model directory (a run's final/ or checkpoints/step-N/model)")
    parser.add_argument("--env", required=True, help="environment name, e.g. guess_number or calculator")
    parser.add_argument("--task", required=True, help="data.task of the run, e.g. guess_number:high=100")
    parser.add_argument("--env-args", default="{}", help="env.args of the run, as YAML, e.g. '{show_range: true}'")
    parser.add_argument("--greedy", type=int, default=0, help="greedy episodes (held-out problems, in order)")
    parser.add_argument("--sampled", type=int, default=0, help="sampled episodes (held-out problems, cycled)")
    parser.add_argument("--temperature", type=float, default=1.0, help="temperature of the sampled episodes")
    parser.add_argument("--max-turns", type=int, default=8, help="env.max_turns of the run")
    parser.add_argument("--max-episode-tokens", type=int, default=400, help="env.max_episode_tokens")
    parser.add_argument("--max-new-tokens", type=int, default=100, help="longest turn (train.max_new_tokens)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(ModelConfig(name=args.model))
    model.eval()
    task = get_task(args.task)
    env = make_environment(args.env, yaml.safe_load(args.env_args) or {})
    runner = EpisodeRunner(
        env,
        tokenizer,
        EpisodeLimits(max_turns=args.max_turns, max_episode_tokens=args.max_episode_tokens),
        1,
        context_length(model),
    )
    out = {}
    try:
        for mode, n, temperature in (("greedy", args.greedy, 0.0), ("sampled", args.sampled, args.temperature)):
            if n:
                start = time.perf_counter()
                episodes = play(
                    runner,
                    model,
                    tokenizer,
                    task.make_problems(n, 0, "test"),
                    temperature,
                    args.max_new_tokens,
                    args.seed,
                )
                out[mode] = {**summary(episodes), "seconds": round(time.perf_counter() - start, 1)}
    finally:
        runner.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
