"""Preference data: row formats, completion-only masks, skips and truncation counts, bad rows,
pairs made from the addition task."""

from __future__ import annotations

import json
import random

import pytest

from lmforge.core.errors import DataError
from lmforge.data.preference import (
    check_pair_row,
    collate_pairs,
    load_preference_rows,
    no_carry_completion,
    off_by_one_completions,
    pairs_from_task,
    tokenize_pairs,
)
from lmforge.data.tasks import get_task
from lmforge.model.tokenizer import char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer("0123456789+-*= \nabcdefghijklmnopqrstuvwxyz?!.")


def trained_text(tok, example) -> str:
    return tok.decode([i for i, m in zip(example.input_ids, example.loss_mask) if m])


def test_plain_text_pair_masks_the_completion_and_eos(tok):
    data = tokenize_pairs([{"prompt": "37+48=", "chosen": "58", "rejected": "57"}], tok, 32)
    pair = data.pairs[0]
    eos = tok.eos_token_id
    assert pair.chosen.input_ids == tok.encode("37+48=58", add_special_tokens=False) + [eos]
    assert pair.chosen.loss_mask == [0] * 6 + [1, 1, 1]
    assert pair.rejected.input_ids[-3:] == tok.encode("57", add_special_tokens=False) + [eos]
    batch = collate_pairs(data.pairs * 2, tok.pad_token_id)
    assert batch["input_ids"].shape == (4, 9)  # chosen, chosen, rejected, rejected
    assert (batch["labels"][:2, 6:8] == batch["input_ids"][:2, 6:8]).all() and (batch["labels"][:, :6] == -100).all()
    assert batch["input_ids"][2].tolist() == pair.rejected.input_ids


def test_conversational_history_is_not_trained(tok):
    # the prompt's history holds an assistant turn: in SFT it would be trained, in a pair it is the prompt
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "ok?"},
    ]
    row = {"prompt": history, "chosen": [{"role": "assistant", "content": "sure"}], "rejected": "no"}
    pair = tokenize_pairs([row], tok, 256).pairs[0]
    assert "yes" not in trained_text(tok, pair.chosen)
    assert trained_text(tok, pair.chosen).startswith("sure")
    assert trained_text(tok, pair.rejected).startswith("no")
    # implicit prompt (whole conversations) gives the same tokens
    implicit = {"chosen": history + row["chosen"], "rejected": history + [{"role": "assistant", "content": "no"}]}
    assert tokenize_pairs([implicit], tok, 256).pairs[0] == pair


def test_text_pairs_through_the_chat_template(tok):
    pair = tokenize_pairs([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}], tok, 256, use_chat_template="on").pairs[
        0
    ]
    assert trained_text(tok, pair.chosen).startswith("2") and trained_text(tok, pair.rejected).startswith("3")
    assert "user" in tok.decode(pair.chosen.input_ids)  # the template's rendering, not the raw text


def test_skips_and_truncation_are_counted(tok):
    rows = [
        {"prompt": "1+1=", "chosen": "2", "rejected": "2"},  # identical
        {"prompt": "1+1=", "chosen": " ", "rejected": "3"},  # empty completion
        {"prompt": "1+1=", "chosen": "2", "rejected": "3"},  # kept: 4 + 1 + eos = 6 tokens
        {"prompt": "12345+1=", "chosen": "2", "rejected": "3"},  # prompt 8 > max_len 6: nothing left
        {"prompt": "1+1=", "chosen": "2222", "rejected": "2223"},
    ]  # cut to 6: both "22": identical tokens
    data = tokenize_pairs(rows, tok, 6)
    assert (len(data), data.num_identical, data.num_empty, data.num_dropped, data.num_truncated) == (1, 2, 1, 1, 0)
    data = tokenize_pairs(rows[2:3] + [{"prompt": "1+1=", "chosen": "22", "rejected": "3"}], tok, 6)
    assert (len(data), data.num_truncated) == (2, 1)  # "1+1=22" cut before eos: still a completion token
    data = tokenize_pairs(rows[2:3] + [{"prompt": "1+1=", "chosen": "22", "rejected": "3"}], tok, 6, truncation="drop")
    assert (len(data), data.num_dropped) == (1, 1)
    assert "2 with chosen = rejected skipped" in tokenize_pairs(rows, tok, 6).report(6, "right")
    with pytest.raises(DataError, match="none of the 2 preference rows is left.*1 with chosen = rejected"):
        tokenize_pairs(rows[:2], tok, 6)


@pytest.mark.parametrize(
    "row, match",
    [
        ({"prompt": "a", "chosen": "b"}, r"row 1: row has no 'rejected' \(its keys: chosen, prompt\).*data.columns"),
        ({"question": "a", "good": "b", "bad": "c"}, r"no 'chosen' or 'rejected'"),
        ({"prompt": "a", "chosen": ["b"], "rejected": "c"}, r"with a string 'prompt', 'chosen' must be a string"),
        ({"prompt": [{"role": "user"}], "chosen": "b", "rejected": "c"}, r"prompt\[0\] must be an object with string"),
        (
            {
                "prompt": [{"role": "user", "content": "a"}],
                "chosen": [{"role": "user", "content": "b"}],
                "rejected": "c",
            },
            "'chosen' must start with an assistant message",
        ),
        (
            {"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]},
            "start with the same messages",
        ),
        ([1, 2], "expected an object, got list"),
    ],
)
def test_bad_rows_name_the_problem(row, match):
    with pytest.raises(DataError, match=match):
        check_pair_row(row, "row 1")


def test_file_rows_with_a_column_map(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        "\n".join(json.dumps({"q": f"{i}+1=", "good": str(i + 1), "bad": str(i)}) for i in range(3))
        + "\n"
        + json.dumps({"q": "x"})
        + "\n"
    )
    with pytest.raises(DataError, match=r"pairs.jsonl:4: no column 'good'"):
        load_preference_rows(str(path), columns={"prompt": "q", "chosen": "good", "rejected": "bad"})
    path.write_text("\n".join(path.read_text().splitlines()[:3]) + "\n")
    rows = load_preference_rows(str(path), columns={"prompt": "q", "chosen": "good", "rejected": "bad"})
    assert rows[2] == {"prompt": "2+1=", "chosen": "3", "rejected": "2"}


def test_wrong_answers_by_hand():
    # 37+48 = 85, written reversed "58"; without carries: 7+8 -> 5, 3+4 -> 7, reversed order "57"
    assert no_carry_completion("37+48=", "58") == "57"
    assert no_carry_completion("37+48=", "85") == "75"  # the same mistake in normal digit order
    assert no_carry_completion("99+1=", "001") == "09"  # columns 9+1 -> 0, 9+0 -> 9; the carry-out is lost
    assert no_carry_completion("hello", "5") is None
    assert sorted(off_by_one_completions("09")) == ["00", "08", "19", "99"]


def test_task_pairs_chosen_correct_rejected_wrong():
    task = get_task("addition")
    rows = pairs_from_task(task, 200, 0, "train")
    problems = task.make_problems(200, 0, "train")
    assert [r["prompt"] for r in rows] == [p.prompt for p in problems]
    assert all(
        task.is_correct(r["chosen"], p) and not task.is_correct(r["rejected"], p) for r, p in zip(rows, problems)
    )
    no_carry = sum(r["rejected"] == no_carry_completion(r["prompt"], r["chosen"]) for r in rows)
    assert 40 < no_carry < 160  # both kinds of mistake are made
    random.seed(1)  # seeded by its arguments, not by the global RNG
    assert rows == pairs_from_task(task, 200, 0, "train") != pairs_from_task(task, 200, 1, "train")


def test_task_pairs_take_a_models_wrong_answers_as_rejected():
    task = get_task("addition")
    problems = task.make_problems(3, 0, "val")
    answers = ["123", problems[1].completion, "  "]  # wrong, right, blank
    rows = pairs_from_task(task, 3, 0, "val", answers)
    assert rows[0]["rejected"] == "123" and rows[0]["chosen"] == problems[0].completion
    for row, problem in zip(rows[1:], problems[1:]):  # right or blank: a rule-made wrong answer
        rule_made = off_by_one_completions(problem.completion) + [
            no_carry_completion(problem.prompt, problem.completion)
        ]
        assert row["rejected"] in rule_made
    assert all(not task.is_correct(r["rejected"], p) for r, p in zip(rows, problems))
    with pytest.raises(ValueError, match="2 completions for 3 problems"):
        pairs_from_task(task, 3, 0, "val", answers[:2])
