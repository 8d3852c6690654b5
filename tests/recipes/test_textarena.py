"""TextArena's games, unmodified, through lmforge's episode runner and GRPO (env.name=textarena,
lmforge.envs.textarena). Skips without the optional extra: ``pip install 'lmforge[textarena]'``."""

import json
import random
import re
import types

import pytest
import torch

ta = pytest.importorskip("textarena")

from run_records import records  # noqa: E402

from lmforge.core.config import load_config  # noqa: E402 (after the skip)
from lmforge.core.errors import ConfigError  # noqa: E402
from lmforge.envs.episode import EpisodeLimits, EpisodeRunner  # noqa: E402
from lmforge.envs.registry import make_environment  # noqa: E402
from lmforge.model.tokenizer import load_tokenizer  # noqa: E402
from lmforge.recipes.grpo import GRPOConfig, run_grpo  # noqa: E402
from lmforge.rollout import RolloutBatch, SamplingParams  # noqa: E402

FEEDBACK = re.compile(r"<\|assistant\|>\n\[(\d+)\]<eos>\n<\|user\|>\nThe target number is (higher|lower)\.")


def bisecting_player(tok):
    """A generate function that plays GuessTheNumber (1-20) by bisection, reading each row's history
    (TextArena's feedback to its earlier guesses): the reply is ``[guess]`` and the stop token."""
    calls = []

    def generate_fn(prompts, params, num_samples):
        replies = []
        for prompt in prompts:
            low, high = 1, 20
            for guess, hint in FEEDBACK.findall(tok.decode(prompt)):
                low, high = (int(guess) + 1, high) if hint == "higher" else (low, int(guess) - 1)
            replies += [
                tok(f"[{(low + high) // 2}]", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ] * num_samples
        calls.append(replies)
        rows, width = len(replies), max(map(len, replies))
        ids = torch.full((rows, width), tok.pad_token_id)
        mask = torch.zeros(rows, width, dtype=torch.long)
        for row, reply in enumerate(replies):
            ids[row, : len(reply)], mask[row, : len(reply)] = torch.tensor(reply), 1
        return RolloutBatch(
            torch.ones(rows, 1, dtype=torch.long),
            torch.ones(rows, 1, dtype=torch.long),
            ids,
            mask,
            -0.25 * mask.float(),
            torch.arange(rows),
            torch.ones(rows, dtype=torch.long),
            mask.sum(1),
            torch.zeros(rows, dtype=torch.bool),
        )

    return generate_fn, calls


def bisection_guesses(secret: int) -> list[int]:
    low, high, guesses = 1, 20, []
    while not guesses or guesses[-1] != secret:
        guesses.append((low + high) // 2)
        low, high = (guesses[-1] + 1, high) if guesses[-1] < secret else (low, guesses[-1] - 1)
    return guesses


def play(seeds, workers):
    tok = load_tokenizer("char:ascii")
    runner = EpisodeRunner(
        make_environment("textarena", {"game": "GuessTheNumber-v0"}),
        tok,
        EpisodeLimits(max_turns=10, max_episode_tokens=400),
        workers=workers,
    )
    generate_fn, calls = bisecting_player(tok)
    problems = [types.SimpleNamespace(prompt=f"seed {s}", answer=str(s)) for s in seeds]
    episodes, _ = runner.run(generate_fn, problems, 2, SamplingParams(max_new_tokens=8, stop_token_ids=[2], seed=0))
    runner.close()
    return tok, episodes, calls


def test_games_play_as_textarena_deals_and_scores_them():
    seeds = [3, 11, 29, 40]
    process_random = random.getstate()
    tok, episodes, calls = play(seeds, workers=4)
    assert random.getstate() == process_random  # the games' draws left the process's `random` alone
    for episode, seed in zip(episodes, [s for s in seeds for _ in range(2)]):
        secret = random.Random(seed).randint(1, 20)  # TextArena's deal: State seeds `random`, then randint(1, 20)
        guesses = bisection_guesses(secret)
        messages = episode.state.messages
        assert messages[0]["role"] == "user" and messages[0]["content"].startswith(
            "You are Player 0. You are playing Guess The Number."
        )
        assert [m["content"] for m in messages[1::2]] == [f"[{g}]" for g in guesses]
        assert [m["content"] for m in messages[2::2]] == [
            f"The target number is {'higher' if g < secret else 'lower'}." for g in guesses[:-1]
        ]
        assert episode.end == "done" and episode.rewards == {"game": 1.0}  # a win: full marks
        assert episode.state.info["outcome"] == "Congratulations! You guessed the correct number."
        # the masks: the policy's replies trained, verbatim; TextArena's observations not
        sampled = [i for i, t in zip(episode.ids, episode.trained) if t]
        assert sampled == [i for g in guesses for i in tok(f"[{g}]<eos>", add_special_tokens=False)["input_ids"]]
        environment = tok.decode([i for i, t in zip(episode.ids, episode.trained) if not t])
        assert environment == "".join(f"\n<|user|>\n{m['content']}<eos>\n<|assistant|>\n" for m in messages[2::2])
        assert all(lp == 0.0 for lp, t in zip(episode.logprobs, episode.trained) if not t)
    assert len(calls) == max(len(bisection_guesses(random.Random(s).randint(1, 20))) for s in seeds)


def first_boards(seeds, workers) -> dict[int, str]:
    """Minesweeper games of ``seeds`` (in that order), each opened with the move [3 3]: seed -> the board
    shown after it (the mines are laid from `random` at the first move, inside step)."""
    tok = load_tokenizer("char:ascii")
    runner = EpisodeRunner(
        make_environment("textarena", {"game": "Minesweeper-v0"}),
        tok,
        EpisodeLimits(max_turns=2, max_episode_tokens=2000),
        workers=workers,
    )

    def generate_fn(prompts, params, num_samples):
        reply = tok("[3 3]", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows = len(prompts) * num_samples
        ids, ones = torch.tensor([reply] * rows), torch.ones(rows, len(reply), dtype=torch.long)
        return RolloutBatch(
            torch.ones(rows, 1, dtype=torch.long),
            torch.ones(rows, 1, dtype=torch.long),
            ids,
            ones,
            torch.zeros(rows, len(reply)),
            torch.arange(rows),
            torch.ones(rows, dtype=torch.long),
            ones.sum(1),
            torch.zeros(rows, dtype=torch.bool),
        )

    problems = [types.SimpleNamespace(prompt=f"seed {s}", answer=str(s)) for s in seeds]
    episodes, _ = runner.run(generate_fn, problems, 1, SamplingParams(max_new_tokens=8, stop_token_ids=[2]))
    runner.close()
    return {seed: e.state.messages[2]["content"] for seed, e in zip(seeds, episodes)}


def test_a_game_depends_only_on_its_seed_whatever_the_batch_and_threads():
    forward = first_boards(list(range(8)), workers=4)
    assert forward == first_boards(list(range(7, -1, -1)), workers=1)
    assert len(set(forward.values())) == 8  # the seeds deal different boards


@pytest.mark.parametrize(
    "args, match",
    [
        ({"game": "NoSuchGame-v0"}, "not a TextArena game id"),
        ({"game": "TicTacToe-v0"}, "single-player"),
        ({}, "needs argument"),
    ],
)
def test_games_that_cannot_be_played_are_config_errors(args, match):
    with pytest.raises(ConfigError, match=match):
        make_environment("textarena", args)


def test_grpo_trains_on_textarena_games(tmp_path):
    """Two GRPO steps of a tiny char-level model on GuessTheNumber-v0 (plus the parity reward, so that
    an untrained model's groups have reward variance and the step has a gradient)."""
    out = tmp_path / "run"
    run_grpo(
        load_config(
            GRPOConfig,
            None,
            [
                "model.tokenizer=char:ascii",
                "model.hidden_size=32",
                "model.num_layers=2",
                "model.num_heads=2",
                "model.max_position_embeddings=1024",
                "data.task=seeds",
                "data.num_train=16",
                "data.num_eval=2",
                "data.use_chat_template=on",
                "env.name=textarena",
                "env.args={game: GuessTheNumber-v0}",
                "env.max_turns=3",
                "env.max_episode_tokens=320",
                "rollout.num_prompts=2",
                "rollout.group_size=4",
                "rollout.max_new_tokens=4",
                "rewards.functions=[parity]",
                "train.max_steps=2",
                "train.micro_batch_size=4",
                "train.eval_every=0",
                "train.threads=1",
                "optim.lr=1e-2",
                "logging.progress=false",
                "algo.preset=grpo",
                f"train.output_dir={out}",
            ],
        )
    )
    steps = records(out)
    assert sorted(steps) == [1, 2]
    for r in steps.values():
        assert r["turns_per_episode"] >= 1 and "reward_env_game" in r and r["grad_norm"] > 0
        assert r["episode_len_mean"] > r["completion_len_mean"]  # rows hold TextArena's messages, untrained
    episodes = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert episodes and all(
        e["messages"][0]["content"].startswith("You are Player 0. You are playing Guess The Number.") for e in episodes
    )
