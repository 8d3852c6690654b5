"""A reasoning-gym task through the RL and SFT recipes on a tiny model: GRPO with the task's
scorer plus format and overlong rewards, held-out accuracy, the reward workers closed at the end
and on errors; SFT on prompt -> answer rows."""

import json

import pytest

pytest.importorskip("reasoning_gym")

from run_records import records

from lmforge.core.config import load_config
from lmforge.core.errors import TrainingError
from lmforge.recipes.grpo import GRPOConfig, run_grpo
from lmforge.rollout import RewardSet

TASK = "rg:basic_arithmetic:min_terms=2,max_terms=2,max_digits=1,answer_format=plain"
TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.max_position_embeddings=96"]
ARGS = TINY + [
    f"data.task={TASK}",
    "data.num_train=16",
    "data.num_eval=4",
    "rollout.num_prompts=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=6",
    "train.max_steps=2",
    "train.micro_batch_size=4",
    "train.eval_every=2",
    "train.max_new_tokens=6",
    "train.threads=1",
    "train.save_every=0",
    "optim.lr=1e-2",
    "logging.progress=false",
    "rewards.functions=[exact, {name: format, weight: 0.5, pattern: '^-?[0-9]+$', match: full},"
    " {name: overlong, weight: 1.0, cache: 2}]",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A byte-level BPE for the task's English prompts (the char tokenizer knows only digits and
    +-*=, so it would turn most of them into <unk>: a start-up error)."""
    from lmforge.data.tasks import get_task
    from lmforge.model.tokenizer import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("bpe")
    text = root / "prompts.txt"
    text.write_text("\n".join(p.prompt + " " + p.answer for p in get_task(TASK).make_problems(64, 0, "train")))
    train_bpe_tokenizer([text], 300, root / "tok")
    return [f"model.tokenizer={root / 'tok'}"]


@pytest.fixture
def closes(monkeypatch):
    calls = []
    original = RewardSet.close

    def close(self):
        calls.append(self)
        original(self)

    monkeypatch.setattr(RewardSet, "close", close)
    return calls


def test_grpo_on_a_reasoning_gym_task(tmp_path, closes, tok):
    out = tmp_path / "run"
    result = run_grpo(load_config(GRPOConfig, None, tok + ARGS + [f"train.output_dir={out}"]))
    train, evals = records(out, "train"), records(out, "eval")
    assert sorted(train) == [1, 2] and sorted(evals) == [0, 2]
    for record in train.values():
        assert {"reward_exact", "reward_format", "reward_overlong", "reward_failures", "reward_timeouts"} <= set(record)
        assert record["reward_failures"] == 0 and record["reward_timeouts"] == 0
        assert -1.0 <= record["reward_overlong"] <= 0.0 and 0.0 <= record["reward_exact"] <= 1.0
        # total = exact + 0.5 format + overlong, averaged over the batch
        want = record["reward_exact"] + 0.5 * record["reward_format"] + record["reward_overlong"]
        assert record["reward"] == pytest.approx(want, abs=1e-5)
    assert 0.0 <= result["accuracy"] <= 1.0 and "accuracy_before" in result
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"].startswith("Calculate ") for s in samples)
    assert all(s["prompt"].endswith("Reply with only the final answer.") for s in samples)
    assert len(closes) == 1  # the reward workers stop with the run


def test_reward_workers_are_closed_when_the_run_fails(tmp_path, monkeypatch, closes, tok):
    (tmp_path / "broken_rewards.py").write_text(
        "def broken(completion, problem):\n    raise RuntimeError('verifier down')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ARGS[:-1] + ["rewards.functions=[exact, 'broken_rewards:broken']"]
    with pytest.raises(TrainingError, match="broken_rewards:broken.*RuntimeError: verifier down"):
        run_grpo(load_config(GRPOConfig, None, tok + args + [f"train.output_dir={tmp_path / 'fails'}"]))
    assert len(closes) == 1, "the reward workers were not closed after the error"


def test_sft_on_a_reasoning_gym_task(tmp_path, monkeypatch, tok):
    """The SFT rows are the rg problems' prompt -> plain answer pairs, the answers are the value of
    the arithmetic in the question (computed here, not by reasoning-gym), and the logged accuracy is
    the task's scorer on the saved greedy completions of the held-out problems."""
    import re

    import lmforge.supervised.sft_data as sft_recipe
    from lmforge.data.tasks import get_task
    from lmforge.recipes.sft import SFTConfig, run_sft

    made = {}
    real_rows = sft_recipe.sft_rows_from_task

    def rows_of(task, n, seed, split):
        made[split] = real_rows(task, n, seed, split)
        return made[split]

    monkeypatch.setattr(sft_recipe, "sft_rows_from_task", rows_of)
    out = tmp_path / "sft"
    cfg = load_config(
        SFTConfig,
        None,
        tok
        + TINY
        + [
            f"data.task={TASK}",
            "data.num_train=32",
            "data.num_val=4",
            "data.num_eval=4",
            "train.max_steps=2",
            "train.batch_size=8",
            "train.micro_batch_size=8",
            "train.threads=1",
            "train.eval_every=2",
            "train.max_new_tokens=4",
            "train.num_samples=4",
            "train.save_every=0",
            "logging.progress=false",
            f"train.output_dir={out}",
        ],
    )
    result = run_sft(cfg)
    assert [len(made["train"]), len(made["val"])] == [32, 4]
    question = re.compile(r"Calculate (.+)\.\n\nReply with only the final answer\.")
    for row in made["train"] + made["val"]:
        expression = question.fullmatch(row["prompt"]).group(1)
        assert re.fullmatch(r"[-+*/() 0-9]+", expression), expression
        # plain answer format: the completion is the bare answer, the value of the expression
        assert row["completion"] == row["answer"] and float(row["answer"]) == eval(expression), row  # noqa: S307 - matched above

    task = get_task(TASK)
    problems = task.make_problems(4, cfg.train.seed, "test")
    assert not {p.prompt for p in problems} & {r["prompt"] for r in made["train"]}
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    evals = records(out, "eval")
    assert sorted(evals) == [2]
    final = [s for s in samples if s["step"] == 2]
    assert [s["prompt"] for s in final] == [p.prompt for p in problems]
    expected = sum(task.score(s["completion"], p) >= 0.999 for s, p in zip(final, problems)) / 4
    assert evals[2]["accuracy"] == result["accuracy"] == pytest.approx(expected, abs=1e-9)
    # the scorer tells a right answer from a wrong one on these problems (so the check above can fail)
    assert all(task.score(p.completion, p) == 1.0 and task.score(p.completion + "1", p) < 1.0 for p in problems)
