"""Synthetic tasks: problem format, determinism, disjoint splits, exact scoring, spec parsing."""

import pytest

from lmforge.data.tasks import Addition, ArithChat, Problem, get_task, split_of
from lmforge.model.tokenizer import DEFAULT_ALPHABET

# ----------------------------------------------------------------------------- addition


def test_addition_problem_format_and_reversed_answer():
    problems = get_task("addition").make_problems(200, seed=0, split="train")
    for p in problems:
        left, right = p.prompt[:-1].split("+")
        assert p.prompt.endswith("=") and len(left) == 2 and len(right) == 2
        total = int(left) + int(right)
        assert p.answer == str(total)
        assert p.completion == str(total)[::-1]


def test_addition_hand_example():
    p = Addition(digits=2)._problem_at((37 - 10) * 90 + (48 - 10))
    assert p == Problem(prompt="37+48=", completion="58", answer="85")


@pytest.mark.parametrize("digits", [1, 3])
def test_addition_digits_param(digits):
    task = get_task(f"addition:digits={digits}")
    assert task.digits == digits
    for p in task.make_problems(50, seed=1, split="val"):
        a, b = p.prompt[:-1].split("+")
        assert len(a) == len(b) == digits


def test_make_problems_is_deterministic_and_seed_dependent():
    task = get_task("addition")
    assert task.make_problems(100, 3, "train") == task.make_problems(100, 3, "train")
    assert task.make_problems(100, 3, "train") != task.make_problems(100, 4, "train")


@pytest.mark.parametrize("spec", ["addition", "addition:digits=1", "arith_chat", "addition:digits=5", "seeds"])
def test_splits_are_disjoint_across_seeds(spec):
    task = get_task(spec)
    prompts = {
        split: {p.prompt for seed in (0, 1, 2) for p in task.make_problems(300, seed, split)}
        for split in ("train", "val", "test")
    }
    assert not prompts["train"] & prompts["val"]
    assert not prompts["train"] & prompts["test"]
    assert not prompts["val"] & prompts["test"]
    for split, group in prompts.items():
        assert all(split_of(prompt) == split for prompt in group)


def test_split_shares_are_about_80_10_10():
    space = [Addition(2)._problem_at(i).prompt for i in range(90 * 90)]
    counts = {s: sum(split_of(p) == s for p in space) for s in ("train", "val", "test")}
    assert 0.78 < counts["train"] / len(space) < 0.82
    assert 0.08 < counts["val"] / len(space) < 0.12


def test_problems_are_distinct_until_the_split_is_exhausted():
    task = get_task("addition:digits=1")  # 100 problems, about 10 in test
    pool = [p for p in map(task._problem_at, range(100)) if split_of(p.prompt) == "test"]
    problems = task.make_problems(3 * len(pool), seed=0, split="test")
    assert len({p.prompt for p in problems[: len(pool)]}) == len(pool)
    assert problems[len(pool) :] == problems[: len(pool)] * 2  # then cycles in the same order
    large = get_task("addition:digits=5").make_problems(500, seed=0, split="train")
    assert len({p.prompt for p in large}) == 500


@pytest.mark.parametrize(
    "text, expected",
    [
        ("58", 1.0),
        ("58<eos>", 1.0),
        ("58\n12+3", 1.0),
        (" 58", 1.0),
        ("58 is it", 1.0),
        ("580", 0.0),
        ("5", 0.0),
        ("85", 0.0),
        ("", 0.0),
        ("x58", 0.0),
        ("-58", 0.0),
    ],
)
def test_addition_score(text, expected):
    task = get_task("addition")
    problem = Problem(prompt="37+48=", completion="58", answer="85")
    assert task.score(text, problem) == expected
    assert task.is_correct(text, problem) is (expected == 1.0)


def test_addition_score_keeps_leading_zero_of_reversed_sum():
    task = get_task("addition")
    problem = Problem(prompt="27+63=", completion="09", answer="90")
    assert task.score("09", problem) == 1.0
    assert task.score("9", problem) == 0.0


# ----------------------------------------------------------------------------- arith_chat


def test_arith_chat_answers_are_right():
    task = get_task("arith_chat:max_operand=12")
    problems = task.make_problems(400, seed=0, split="train")
    ops_seen = set()
    for p in problems:
        expr = p.prompt.removeprefix("What is ").removesuffix("? Answer with just the number.")
        a, op, b = expr.split(" ")
        ops_seen.add(op)
        assert 0 <= int(a) <= 12 and 0 <= int(b) <= 12
        expected = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert expected >= 0
        assert p.answer == p.completion == str(expected)
    assert ops_seen == {"+", "-"}


def test_arith_chat_problem_space_is_complete_and_unique():
    task = ArithChat(max_operand=4, ops="+-")
    space = [task._problem_at(i).prompt for i in range(sum(task._space_sizes()))]
    assert len(set(space)) == len(space) == 25 + 15  # 5*5 sums, 5*6/2 differences with a >= b


@pytest.mark.parametrize(
    "text, expected",
    [
        ("7", 1.0),
        ("7.", 1.0),
        ("The answer is 7", 1.0),
        (" 7<|im_end|>", 1.0),
        ("07", 1.0),
        ("3 + 4 = 7", 0.0),
        ("seven", 0.0),
        ("", 0.0),
        ("-7", 0.0),
        ("17", 0.0),
    ],
)
def test_arith_chat_score_first_integer(text, expected):
    problem = Problem(prompt="What is 3 + 4? Answer with just the number.", completion="7", answer="7")
    assert get_task("arith_chat").score(text, problem) == expected


def test_arith_chat_negative_integer_is_parsed():
    problem = Problem(prompt="", completion="-2", answer="-2")
    assert get_task("arith_chat").score("It is -2.", problem) == 1.0


# ----------------------------------------------------------------------------- alphabets and specs


@pytest.mark.parametrize("spec", ["addition", "addition:digits=4", "arith_chat:ops=+", "seeds:count=1000"])
def test_alphabet_covers_all_text(spec):
    task = get_task(spec)
    for p in task.make_problems(300, seed=0, split="train"):
        assert set(p.prompt + p.completion) <= set(task.alphabet)


def test_default_alphabet_covers_char_tasks():
    assert set(get_task("addition").alphabet) <= set(DEFAULT_ALPHABET)


def test_get_task_params():
    task = get_task(" arith_chat: max_operand=20 , ops=+ ")
    assert (task.max_operand, task.ops) == (20, "+")
    assert get_task(task.spec) == task


def test_unknown_task_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown task 'substraction'.*addition, addition_trace, arith_chat"):
        get_task("substraction")


def test_unknown_param_lists_valid_ones():
    with pytest.raises(ValueError, match=r"bad parameter 'digit=3'.*valid: digits="):
        get_task("addition:digit=3")
    with pytest.raises(ValueError, match=r"bad parameter 'digits'"):
        get_task("addition:digits")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("addition:digits=three", "digits must be an integer"),
        ("addition:digits=0", "between 1 and 9"),
        ("arith_chat:ops=*", "ops must be"),
        ("arith_chat:max_operand=0", "max_operand must be >= 1"),
        ("seeds:count=5", "count must be between 10"),
    ],
)
def test_bad_param_values(spec, message):
    with pytest.raises(ValueError, match=message):
        get_task(spec)


def test_unknown_split_and_negative_n():
    task = get_task("addition")
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        task.make_problems(3, 0, "dev")
    with pytest.raises(ValueError, match=">= 0"):
        task.make_problems(-1, 0, "train")


# ----------------------------------------------------------------------------- addition_trace


def test_addition_trace_hand_values():
    task = get_task("addition_trace:digits=3")
    # 372 + 459: 2+9+0 = 11 (carry 1), 7+5+1 = 13 (carry 1), 3+4+1 = 08 -> 831
    assert task.worked_trace(372, 459) == "2+9+0=11 7+5+1=13 3+4+1=08"
    # 999 + 999: every column carries, the answer gains a digit
    assert task.worked_trace(999, 999) == "9+9+0=18 9+9+1=19 9+9+1=19"
    first = task._problem_at(0)
    assert (first.prompt, first.completion, first.answer) == ("100+100=", "0+0+0=00 0+0+0=00 1+1+0=02\n200", "200")


def test_addition_trace_answers_only_shares_prompts_and_splits():
    traced = get_task("addition_trace:digits=3,trace=1").make_problems(20, 4, "val")
    plain = get_task("addition_trace:digits=3,trace=0").make_problems(20, 4, "val")
    assert [p.prompt for p in traced] == [p.prompt for p in plain]
    assert all(p.completion == p.answer == str(eval(p.prompt[:-1])) for p in plain)  # noqa: S307 - digits, + and - only
    assert all(t.completion.endswith("\n" + t.answer) for t in traced)


def test_addition_trace_scores_the_last_line_only():
    task = get_task("addition_trace:digits=2")
    problem = task._problem_at(0)  # 10+10=, answer 20
    assert task.score("1+1+0=02 0+0+0=00\n20", problem) == 1.0
    assert task.score("9+9+9=99 9+9+9=99\n20<eos>", problem) == 1.0  # the trace is not checked
    assert task.score("0+0+0=00 1+1+0=02\n200", problem) == 0.0  # longer digit run
    assert task.score("0+0+0=00 1+1+0=20", problem) == 0.0  # no answer line: the whole text is read
    assert task.score("20", problem) == 1.0
    with pytest.raises(ValueError, match="trace must be 0"):
        get_task("addition_trace:trace=2")
