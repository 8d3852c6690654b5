"""The calculator pipeline end to end on a tiny model: an SFT warm-up on the environment's demonstrations
(data.env), then GRPO on its episodes -- rows with one trained span per assistant turn, the tool's
messages untrained, the episode metrics logged, whole episodes in samples.jsonl."""

import json

import pytest
import torch
from run_records import records

from lmforge.core.config import ModelConfig, load_config
from lmforge.core.errors import ConfigError
from lmforge.data.tasks import get_task
from lmforge.envs.episode import EpisodeLimits, EpisodeRunner
from lmforge.envs.registry import make_environment
from lmforge.model.load import load_model
from lmforge.recipes.grpo import GRPOConfig, run_grpo
from lmforge.recipes.sft import SFTConfig, run_sft
from lmforge.rl.sources.episode_batch import episode_rollout
from lmforge.rollout import SamplingParams, generate

TINY = [
    "model.name=tiny:llama",
    "model.tokenizer=char:ascii",
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.max_position_embeddings=512",
    "train.threads=1",
    "logging.progress=false",
]


def warm_up(tmp_path):
    """60 SFT steps on calculator demonstrations: enough to learn the format (not the digits)."""
    run_sft(
        load_config(
            SFTConfig,
            None,
            TINY
            + [
                "data.task=multiplication:digits=3",
                "data.env=calculator",
                "data.num_train=64",
                "data.num_val=4",
                "data.max_len=256",
                "optim.lr=5e-3",
                "optim.warmup_steps=5",
                "train.max_steps=60",
                "train.batch_size=16",
                "train.micro_batch_size=16",
                "train.eval_every=0",
                "train.save_every=60",
                "train.max_new_tokens=8",
                f"train.output_dir={tmp_path / 'sft'}",
            ],
        )
    )
    return tmp_path / "sft" / "final"


def spans(mask: list[int]) -> list[tuple[int, int]]:
    """The (start, end) of each run of 1s."""
    out, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_calculator_sft_then_grpo_trains_the_policy_turns_only(tmp_path):
    model_dir = warm_up(tmp_path)
    model, tok = load_model(ModelConfig(name=str(model_dir)))
    torch.manual_seed(0)
    problems = get_task("multiplication:digits=3").make_problems(4, 0, "train")
    runner = EpisodeRunner(
        make_environment("calculator"), tok, EpisodeLimits(max_turns=3, max_episode_tokens=400), workers=2
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=100, stop_token_ids=[tok.eos_token_id], seed=0)
    episodes, _ = runner.run(
        lambda ids, p, n: generate(model, ids, p, num_samples=n, pad_token_id=tok.pad_token_id), problems, 2, params
    )
    runner.close()
    rollout = episode_rollout(episodes, 2, tok.pad_token_id)
    multi = 0
    for row, episode in enumerate(episodes):
        roles = [m["role"] for m in episode.state.messages]
        n = int(rollout.completion_lens[row])
        ids, trained = rollout.completion_ids[row, :n].tolist(), rollout.trained_mask[row, :n].tolist()
        assert len(spans(trained)) == roles.count("assistant")  # one trained span per policy turn
        replies = [m["content"] for m in episode.state.messages if m["role"] == "assistant"]
        for (start, end), reply in zip(spans(trained), replies):
            assert tok.decode(ids[start:end]).removesuffix(tok.eos_token) == reply  # the sampled ids, verbatim
        if roles.count("assistant") >= 2:  # the tool answered the call and the policy replied to it
            untrained = tok.decode([i for i, t in zip(ids, trained) if not t])
            tool = episode.state.messages[roles.index("tool")]["content"]
            assert untrained == f"\n<|tool|>\n{tool}<eos>\n<|assistant|>\n"  # in the row, never trained
            multi += 1
    assert multi == len(episodes), [e.state.messages[1:] for e in episodes]  # greedy: the learnt format

    result = run_grpo(
        load_config(
            GRPOConfig,
            None,
            [
                f"model.name={model_dir}",
                "train.threads=1",
                "logging.progress=false",
                "data.task=multiplication:digits=3",
                "data.num_train=64",
                "data.num_eval=4",
                "env.name=calculator",
                "env.max_turns=3",
                "env.max_episode_tokens=400",
                "rollout.num_prompts=2",
                "rollout.group_size=4",
                "rollout.max_new_tokens=100",
                "rollout.temperature=0.3",
                "rewards.functions=[]",
                "train.max_steps=2",
                "train.micro_batch_size=8",
                "train.eval_every=2",
                "train.save_every=2",
                "train.max_new_tokens=100",
                "train.num_samples=2",
                f"train.output_dir={tmp_path / 'grpo'}",
            ],
        )
    )
    steps = records(result["run_dir"])
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        assert record["turns_per_episode"] >= 1
        for key in (
            "num_invalid_tool_calls",
            "tool_errors",
            "num_truncated_turns",
            "env_time_share",
            "reward_env_correct",
        ):
            assert key in record, key
    samples = [json.loads(line) for line in open(f"{result['run_dir']}/samples.jsonl")]
    assert samples and all("tool" in [m["role"] for m in s["messages"]] for s in samples)  # greedy evaluation
    assert {"accuracy", "eval_turns", "eval_turns_to_solve", "eval_tool_calls"} <= set(result)


@pytest.mark.parametrize(
    "args, match",
    [
        (["data.task=multiplication", "data.env=no_such_env"], "data.env: .*not a built-in environment"),
        (["data.path=rows.jsonl", "data.env=calculator"], "data.env needs data.task"),
    ],
)
def test_sft_demonstration_config_errors(args, match):
    with pytest.raises(ConfigError, match=match):
        load_config(SFTConfig, None, args)


def test_guess_number_random_openings_run_sft_demos_then_grpo(tmp_path):
    """The shipped guess_number recipe's settings at toy size: demonstrations of random openings (both demo
    strategies), then GRPO episodes and the greedy evaluation on held-out openings."""
    task = "data.task=guess_number:high=100,min_width=10"
    run_sft(
        load_config(
            SFTConfig,
            None,
            TINY
            + [
                task,
                "data.env=guess_number",
                "data.env_args={max_guesses: 10, show_range: true, demo_mix: {halving: 0.5, stride: 0.5}}",
                "data.num_train=32",
                "data.num_val=4",
                "data.max_len=320",
                "train.max_steps=2",
                "train.batch_size=8",
                "train.micro_batch_size=8",
                "train.eval_every=0",
                "train.save_every=2",
                f"train.output_dir={tmp_path / 'sft'}",
            ],
        )
    )
    result = run_grpo(
        load_config(
            GRPOConfig,
            None,
            [
                f"model.name={tmp_path / 'sft' / 'final'}",
                "train.threads=1",
                "logging.progress=false",
                task,
                "data.num_train=32",
                "data.num_eval=6",
                "env.name=guess_number",
                "env.args={max_guesses: 10, speed_bonus: 0.05, show_range: true}",
                "env.max_turns=10",
                "env.max_episode_tokens=300",
                "rollout.num_prompts=2",
                "rollout.group_size=2",
                "rollout.max_new_tokens=8",
                "rewards.functions=[]",
                "train.max_steps=1",
                "train.micro_batch_size=4",
                "train.eval_every=1",
                "train.save_every=0",
                "train.max_new_tokens=8",
                "train.num_samples=6",
                f"train.output_dir={tmp_path / 'grpo'}",
            ],
        )
    )
    held_out = {p.prompt for p in get_task("guess_number:high=100,min_width=10").make_problems(6, 0, "test")}
    samples = [json.loads(line) for line in open(f"{result['run_dir']}/samples.jsonl")]
    openings = {s["messages"][0]["content"] for s in samples}
    assert openings and openings <= held_out  # the evaluation plays held-out openings, each its own range
    for s in samples:
        low, high = map(int, s["messages"][0]["content"].removeprefix("guess ").split("-"))
        assert 10 <= high - low + 1 and all(
            m["role"] == ("user", "assistant")[k % 2] for k, m in enumerate(s["messages"])
        )
    assert 0.0 <= result["accuracy"] <= 1.0 and "eval_turns_to_solve" in result
