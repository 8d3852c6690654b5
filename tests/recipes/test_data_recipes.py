"""Recipes on the data sources of docs/data.md: GRPO from a Parquet prompt file logs held-out
accuracy with the configured reward (issue 11, item 3); SFT from a save_to_disk directory with mapped
columns; pretraining from a dataset, streamed."""

import json

import pytest

datasets = pytest.importorskip("datasets")

from lmforge.core.config import load_config  # noqa: E402
from lmforge.recipes.grpo import GRPOConfig, run_grpo  # noqa: E402
from lmforge.recipes.pretrain import PretrainConfig, run_pretrain  # noqa: E402
from lmforge.recipes.sft import SFTConfig, run_sft  # noqa: E402
from lmforge.rollout import BUILTIN_REWARDS  # noqa: E402
from lmforge.runtime.metrics import read_metrics  # noqa: E402

TINY = [
    "model.tokenizer=char",
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.max_position_embeddings=48",
    "train.threads=1",
    "logging.progress=false",
]
RL = TINY + [
    "rollout.num_prompts=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=4",
    "train.max_steps=2",
    "train.eval_every=1",
    "train.max_new_tokens=4",
    "train.save_every=0",
]


def _questions(tmp_path, n=20, answers=True):
    table = {"question": [f"{i}+{i % 7}=" for i in range(n)]}
    if answers:
        table["solution"] = [str(i + i % 7) for i in range(n)]
    datasets.Dataset.from_dict(table).to_parquet(str(tmp_path / "questions.parquet"))
    return tmp_path / "questions.parquet"


def test_grpo_from_a_parquet_prompt_file_logs_held_out_accuracy_with_the_configured_reward(
    tmp_path, capsys, monkeypatch
):
    data = _questions(tmp_path)
    # a third reward that is rarely 0, so that eval_reward tells the weighted sum from the first reward
    monkeypatch.setitem(BUILTIN_REWARDS, "chars", lambda completion, problem: float(len(completion)))
    out = tmp_path / "run"
    args = RL + [
        f"data.path={data}",
        "data.columns={prompt: question, answer: solution}",
        "data.eval_fraction=0.1",
        "data.pass_k=2",
        "rewards.functions=[parity, exact, {name: chars, weight: 0.25}]",
        "train.num_samples=2",
        f"train.output_dir={out}",
    ]
    run_grpo(load_config(GRPOConfig, None, args))
    assert "[data] 2 rows held out for evaluation (data.eval_fraction=0.1, seed 0)" in capsys.readouterr().out
    evals = [r for r in read_metrics(out) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    answers = {f"{i}+{i % 7}=": str(i + i % 7) for i in range(20)}  # the rows _questions wrote
    parity = BUILTIN_REWARDS["parity"]  # registered by tests/recipes/conftest.py

    def scores(completion, prompt):  # (parity, weighted sum): the configured rewards with their weights
        first = parity(completion, None)
        return first, first + float(completion.strip() == answers[prompt]) + 0.25 * len(completion)

    for record in evals:
        # recomputed from the greedy completions of both held-out rows saved at this step:
        # accuracy = the first reward (parity) at full marks; eval_reward = mean of the weighted sum
        mine = [s for s in samples if s["step"] == record["step"]]
        assert len(mine) == 2
        per_row = [scores(s["completion"], s["prompt"]) for s in mine]
        assert record["accuracy"] == pytest.approx(sum(p >= 1 for p, _ in per_row) / 2, abs=1e-9)
        assert record["eval_reward"] == pytest.approx(sum(total for _, total in per_row) / 2, abs=1e-6)
    held = sorted({s["prompt"] for s in samples})
    assert len(held) == 2 and all(p in answers for p in held)
    # pass@2 of the final evaluation (step 2), recomputed on the saved final model: 2 completions per
    # held-out prompt sampled at rollout.temperature with seed train.seed + step, as the run drew them
    from lmforge.model.load import load_model
    from lmforge.rollout.evaluation import complete_ids

    cfg = load_config(GRPOConfig, None, args + [f"model.name={out / 'final'}", "model.tokenizer="])
    model, tok = load_model(cfg.model)
    order = [s["prompt"] for s in samples if s["step"] == 2]  # the held-out rows, in the run's order
    ids = [tok.encode(p) for p in order for _ in range(2)]
    sampled = complete_ids(model, tok, ids, 4, temperature=cfg.rollout.temperature, seed=cfg.train.seed + 2)
    hits = [any(parity(c, None) >= 1 for c in sampled[2 * i : 2 * i + 2]) for i in range(2)]
    assert evals[-1]["pass_at_k"] == pytest.approx(sum(hits) / 2, abs=1e-9)


def test_a_prompt_file_without_answers_trains_and_says_why_there_is_no_held_out_eval(tmp_path, capsys):
    data = _questions(tmp_path, answers=False)
    out = tmp_path / "run"
    run_grpo(
        load_config(
            GRPOConfig,
            None,
            RL
            + [
                f"data.path={data}",
                "data.columns={prompt: question}",
                "rewards.functions=[parity]",
                f"train.output_dir={out}",
            ],
        )
    )
    printed = capsys.readouterr().out
    assert "no held-out evaluation: the rows of" in printed and "have no 'answer' column" in printed
    assert "[data] 20 training prompts, 0 held-out problems" in printed
    assert not any("accuracy" in r for r in read_metrics(out))


def test_sft_from_a_saved_dataset_dict_with_mapped_columns_and_a_named_eval_split(tmp_path, capsys):
    rows = {"q": [f"{i}+1=" for i in range(24)], "a": [str(i + 1) for i in range(24)]}
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict(rows), "test": datasets.Dataset.from_dict({"q": ["7+7="], "a": ["14"]})}
    ).save_to_disk(str(tmp_path / "ds"))
    run_sft(
        load_config(
            SFTConfig,
            None,
            TINY
            + [
                f"data.path={tmp_path / 'ds'}",
                "data.columns={prompt: q, completion: a}",
                "data.eval_split=test",
                "data.max_len=16",
                "train.batch_size=8",
                "train.max_steps=2",
                "train.eval_every=0",
                f"train.output_dir={tmp_path / 'run'}",
            ],
        )
    )
    assert "[data] 24 training rows, 1 validation rows" in capsys.readouterr().out


def test_pretraining_streams_a_dataset_and_resumes_mid_stream(tmp_path, capsys):
    docs = [f"{i}+1={i + 1} " + "12+34=46 " * (1 + i % 3) for i in range(60)]  # text the char tokenizer knows
    datasets.Dataset.from_dict({"body": docs}).to_parquet(str(tmp_path / "corpus.parquet"))
    base = TINY + [
        f"data.path={tmp_path / 'corpus.parquet'}",
        "data.columns={text: body}",
        "data.streaming=true",
        "data.seq_len=16",
        "data.val_fraction=0.1",
        "data.val_blocks=4",
        "train.batch_size=4",
        "train.eval_every=0",
        "train.save_every=2",
        "train.num_samples=0",
        "optim.schedule=constant",
    ]
    out = tmp_path / "run"
    run_pretrain(load_config(PretrainConfig, None, base + ["train.max_steps=4", f"train.output_dir={out}"]))
    assert "4 validation blocks" in capsys.readouterr().out
    straight = [r["loss"] for r in read_metrics(out) if r["kind"] == "train"]
    # the same run stopped at step 2 and resumed gives the same losses for steps 3 and 4
    half = tmp_path / "half"
    run_pretrain(load_config(PretrainConfig, None, base + ["train.max_steps=2", f"train.output_dir={half}"]))
    run_pretrain(
        load_config(PretrainConfig, None, base + ["train.max_steps=4", f"train.output_dir={half}", "train.resume=auto"])
    )
    resumed = [r["loss"] for r in read_metrics(half) if r["kind"] == "train" and r["step"] > 2]
    assert resumed == pytest.approx(straight[2:], rel=1e-5)
