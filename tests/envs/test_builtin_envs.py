"""The built-in environments (calculator, guess_number), their tasks and their SFT demonstrations:
hand-written episodes -- a correct tool call, a wrong answer, invalid calls, the limits."""

import random

import pytest

from lmforge.core.errors import ConfigError
from lmforge.data.problem import Problem
from lmforge.data.sft import tokenize_sft
from lmforge.data.tasks import GuessNumber as GuessNumberTask
from lmforge.data.tasks import Multiplication, get_task, split_of
from lmforge.envs.base import EpisodeState
from lmforge.envs.calculator import Calculator, calculator, estimate
from lmforge.envs.demos import demonstration_rows, play
from lmforge.envs.guess_number import GuessNumber
from lmforge.envs.registry import make_environment
from lmforge.envs.toolcalls import render_messages
from lmforge.model.tokenizer import ASCII_ALPHABET, char_tokenizer, load_tokenizer

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*456"}}\n</tool_call>'


def assistant(text):
    return {"role": "assistant", "content": text}


def started(env, problem):
    state = EpisodeState(problem=problem)
    state.messages = env.reset(problem, state)
    return state


# ----------------------------------------------------------------------------- the tasks


def test_multiplication_problems_and_exact_score():
    task = get_task("multiplication:digits=3")
    assert task.spec == "multiplication:digits=3" and isinstance(task, Multiplication)
    assert Multiplication(3)._problem_at((123 - 100) * 900 + (456 - 100)) == Problem("123*456=", "56088", "56088")
    problem = Problem("123*456=", "56088", "56088")
    assert task.score(" 56088\n", problem) == 1.0
    assert [task.score(t, problem) for t in ("5608", "56088.", "56088 and more", "")] == [0.0] * 4
    for p in task.make_problems(100, 0, "test"):
        a, b = p.prompt[:-1].split("*")
        assert len(a) == len(b) == 3 and int(p.answer) == int(a) * int(b) and split_of(p.prompt) == "test"


def test_guess_number_splits_are_disjoint_secrets_behind_one_prompt():
    task = get_task("guess_number:high=100")
    secrets = {
        split: {int(p.answer) for seed in (0, 1) for p in task.make_problems(300, seed, split)}
        for split in ("train", "val", "test")
    }
    assert secrets["train"] | secrets["val"] | secrets["test"] == set(range(1, 101))  # 300 cycles every split
    assert not secrets["train"] & secrets["test"] and not secrets["val"] & secrets["test"]
    assert all(split_of(f"secret {s}") == "test" for s in secrets["test"])
    assert {p.prompt for p in task.make_problems(50, 0, "train")} == {"guess 1-100"}
    assert task.make_problems(20, 3, "train") == task.make_problems(20, 3, "train")
    with pytest.raises(ValueError, match="high must be between 10"):
        GuessNumberTask(high=5)


def test_guess_number_random_openings_split_by_opening_with_every_secret_inside():
    task = get_task("guess_number:high=100,min_width=10")
    assert task.spec == "guess_number:high=100,min_width=10"
    games = {split: task.make_problems(400, 0, split) for split in ("train", "test")}
    openings = {split: set() for split in games}
    for split, problems in games.items():
        for p in problems:
            low, high = map(int, p.prompt.removeprefix("guess ").split("-"))
            assert 1 <= low <= int(p.answer) <= high <= 100 and high - low + 1 >= 10 and p.completion == p.answer
            assert split_of(p.prompt) == split
            openings[split].add(p.prompt)
    assert not openings["train"] & openings["test"] and len(openings["test"]) > 200  # held-out openings
    # every (opening, secret) game is indexed once: the first and last of the space by hand
    assert task._ranged_problem_at(0) == Problem("guess 1-10", "1", "1")
    size = sum(b - a + 1 for a in range(1, 101) for b in range(a + 9, 101))
    assert task._ranged_problem_at(size - 1) == Problem("guess 91-100", "100", "100")
    assert task.make_problems(20, 3, "test") == task.make_problems(20, 3, "test")
    for bad in ("min_width=1", "min_width=101"):
        with pytest.raises(ValueError, match="min_width must be 0"):
            get_task(f"guess_number:high=100,{bad}")


def test_guess_number_plays_a_random_opening_inside_its_range():
    env = make_environment("guess_number", {"max_guesses": 8, "show_range": True, "speed_bonus": 0.1})
    state = started(env, Problem("guess 23-87", "40", "40"))
    assert state.messages == [{"role": "user", "content": "guess 23-87"}]
    replies = [env.step(state, assistant(g)).messages[0]["content"] for g in ("55", "22", "30")]
    assert replies == ["lower 23-54", "invalid 23-54", "higher 31-54"]  # 22 is outside the opening range
    assert state.counts == {"invalid_guesses": 1}
    assert env.step(state, assistant("40")).reward == {"solved": 1.0, "speed": 0.4}
    halving = GuessNumber(max_guesses=8, show_range=True, demo_mix={"halving": 1.0})
    messages, reward = play(halving, Problem("guess 23-87", "40", "40"), random.Random(0))
    assert [m["content"] for m in messages] == [
        "guess 23-87",
        "55",
        "lower 23-54",
        "38",
        "higher 39-54",
        "46",
        "lower 39-45",
        "42",
        "lower 39-41",
        "40",
    ]
    assert reward == {"solved": 1.0, "speed": pytest.approx(0.3)}  # five guesses of eight: 0.1 x 3 unused


# ----------------------------------------------------------------------------- calculator


def test_calculator_tool_evaluates_integer_arithmetic_only():
    assert calculator("123*456") == "56088" and calculator(" (2+3)*-4 ") == "-20"
    for bad, match in [
        ("2**10", "unsupported"),
        ("1/2", "unsupported"),
        ("abs(3)", "unsupported"),
        ("1.5*2", "unsupported"),
        ("12*", "cannot parse"),
        ("9" * 40 + "*" + "9" * 40, "more than 60"),
        ("1+" * 150 + "1", "at most 200"),
    ]:
        with pytest.raises(ValueError, match=match):
            calculator(bad)


def test_calculator_episode_with_a_correct_tool_call_then_the_answer():
    env = make_environment("calculator")
    state = started(env, Problem("123*456=", "56088", "56088"))
    assert state.messages == [{"role": "user", "content": "123*456="}]
    assert [t["function"]["name"] for t in env.tools] == ["calculator"]
    result = env.step(state, assistant(CALL))
    assert not result.done and result.reward == {}
    assert [(m["role"], m["content"], m["name"]) for m in result.messages] == [("tool", "56088", "calculator")]
    assert state.counts == {"tool_calls": 1}
    final = env.step(state, assistant("56088"))
    assert final.done and final.messages == [] and final.reward == {"correct": 1.0}


@pytest.mark.parametrize("answer", ["56087", "56088.", "the answer is 56088", ""])
def test_calculator_wrong_final_answer_scores_zero(answer):
    env = Calculator()
    result = env.step(started(env, Problem("123*456=", "56088", "56088")), assistant(answer))
    assert result.done and result.reward == {"correct": 0.0}


@pytest.mark.parametrize(
    "reply, count, error",
    [
        (
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*"}}\n</tool_call>',
            "tool_errors",
            "cannot parse",
        ),
        (
            '<tool_call>\n{"name": "calc", "arguments": {"expression": "1*2"}}\n</tool_call>',
            "invalid_tool_calls",
            "no tool named 'calc'",
        ),
        (
            '<tool_call>\n{"name": "calculator", "arguments": {"expr": "1*2"}}\n</tool_call>',
            "invalid_tool_calls",
            "unexpected keyword argument 'expr'",
        ),
        (
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1*2"\n</tool_call>',
            "invalid_tool_calls",
            "invalid JSON",
        ),
        (
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1*2"}}',
            "invalid_tool_calls",
            "never closed",
        ),
    ],
)
def test_calculator_invalid_calls_are_answered_with_a_readable_error_and_counted(reply, count, error):
    env = Calculator()
    state = started(env, Problem("123*456=", "56088", "56088"))
    result = env.step(state, assistant(reply))
    assert not result.done and len(result.messages) == 1
    assert result.messages[0]["role"] == "tool" and result.messages[0]["content"].startswith("error: ")
    assert error in result.messages[0]["content"]
    assert state.counts.get(count) == 1


# ----------------------------------------------------------------------------- guess_number


def test_guess_number_feedback_until_solved():
    env = make_environment("guess_number", {"max_guesses": 8, "speed_bonus": 0.1})
    state = started(env, Problem("guess 1-100", "37", "37"))
    assert state.messages == [{"role": "user", "content": "guess 1-100"}] and env.tools == []
    replies = [env.step(state, assistant(g)) for g in ("50", "25", " 31\n")]
    assert [r.messages for r in replies] == [[{"role": "user", "content": w}] for w in ("lower", "higher", "higher")]
    assert all(r.reward == {} and not r.done for r in replies)
    assert (state.info["low_bound"], state.info["high_bound"]) == (32, 49)
    last = env.step(state, assistant("37"))
    assert last.done and last.messages == [] and last.reward == {"solved": 1.0, "speed": pytest.approx(0.4)}


@pytest.mark.parametrize("reply", ["0", "101", "-5", "5.0", "fifty", "50 or 51", "", "٣"])
def test_guess_number_invalid_guess_is_answered_counted_and_costs_its_turn(reply):
    env = GuessNumber()
    state = started(env, Problem("guess 1-100", "37", "37"))
    result = env.step(state, assistant(reply))
    assert result.messages == [{"role": "user", "content": "invalid"}] and not result.done
    assert result.reward == {} and state.counts == {"invalid_guesses": 1}
    assert (state.info["low_bound"], state.info["high_bound"]) == (1, 100)


def test_guess_number_turn_limit_ends_the_game_unsolved():
    env = GuessNumber(max_guesses=3, speed_bonus=0.5)
    state = started(env, Problem("guess 1-100", "37", "37"))
    results = [env.step(state, assistant(g)) for g in ("1", "2", "3")]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].messages == [] and results[-1].reward == {"solved": 0.0, "speed": 0.0}
    state = started(env, Problem("guess 1-100", "37", "37"))
    assert env.step(state, assistant("37")).reward == {"solved": 1.0, "speed": 1.0}  # two guesses left unused


def test_guess_number_show_range_answers_with_the_numbers_still_possible():
    env = make_environment("guess_number", {"max_guesses": 8, "show_range": True})
    state = started(env, Problem("guess 1-100", "37", "37"))
    replies = [env.step(state, assistant(g)).messages[0]["content"] for g in ("50", "25", "x", "40", "30")]
    assert replies == ["lower 1-49", "higher 26-49", "invalid 26-49", "lower 26-39", "higher 31-39"]
    assert env.step(state, assistant("37")).reward == {"solved": 1.0, "speed": 0.2}  # six guesses, two unused


def test_guess_number_bad_problem_or_arguments_say_what_is_needed():
    with pytest.raises(ConfigError, match="guess L-H"):
        started(GuessNumber(), Problem("guess 50-40", "45", "45"))
    with pytest.raises(ConfigError, match="guess L-H"):
        started(GuessNumber(), Problem("guess 10-40", "41", "41"))
    with pytest.raises(ConfigError, match="guess L-H"):
        started(GuessNumber(), Problem("123*456=", "56088", "56088"))
    with pytest.raises(ConfigError, match="max_guesses must be >= 1"):
        make_environment("guess_number", {"max_guesses": 0})
    with pytest.raises(ConfigError, match="takes no argument"):
        make_environment("calculator", {"max_guesses": 3})


# ----------------------------------------------------------------------------- demonstrations


@pytest.mark.parametrize("spec", ["char:ascii", "default format"])
def test_calculator_demonstration_is_the_episode_the_runner_renders(spec):
    # char:ascii's template renders tools itself (one short line); a plain char tokenizer gets the JSON block
    tokenizer = load_tokenizer("char:ascii") if spec == "char:ascii" else char_tokenizer(ASCII_ALPHABET)
    env = Calculator()
    problems = get_task("multiplication").make_problems(4, 0, "train")
    rows = demonstration_rows(env, problems, seed=0, tokenizer=tokenizer)
    data = tokenize_sft(rows, tokenizer, max_len=1024)
    for row, problem, example in zip(rows, problems, data.examples):
        episode = [m for m in row["messages"] if m["role"] != "system"]
        assert [m["role"] for m in episode] == ["user", "assistant", "tool", "assistant"]
        assert episode[1]["content"] == CALL.replace("123*456", problem.prompt[:-1])
        assert episode[2]["content"] == episode[3]["content"] == problem.answer
        text = tokenizer.decode(example.input_ids)
        assert text == render_messages(tokenizer, episode, env.tools, add_generation_prompt=False)
        assert tokenizer.unk_token_id not in example.input_ids
        trained = tokenizer.decode([i for i, m in zip(example.input_ids, example.loss_mask) if m])
        assert trained == f"{episode[1]['content']}<eos>{problem.answer}<eos>"  # the assistant's turns only
    assert ("tools" in rows[0]) == (spec == "char:ascii")
    assert len(data.examples[0].input_ids) < (170 if spec == "char:ascii" else 800)
    _, reward = play(env, problems[0], random.Random(0))
    assert reward == {"correct": 1.0}


def test_calculator_demo_tool_rate_mixes_tool_calls_with_leading_digit_estimates():
    assert estimate("123*456") == "40000" and estimate("987*654") == "540000" and estimate("300*200") == "60000"
    env = make_environment("calculator", {"demo_tool_rate": 0.25})
    problems = get_task("multiplication:digits=3").make_problems(400, 0, "train")
    rows = demonstration_rows(env, problems, seed=3, tokenizer=load_tokenizer("char:ascii"))
    called = 0
    for row, problem in zip(rows, problems):
        episode = [m for m in row["messages"] if m["role"] != "system"]
        if len(episode) == 4:  # the tool episode, exactly as with the default rate
            assert episode[1]["content"] == CALL.replace("123*456", problem.prompt[:-1])
            called += 1
        else:
            assert [m["role"] for m in episode] == ["user", "assistant"]
            assert episode[1]["content"] == f"about {estimate(problem.prompt[:-1])}"
    assert 70 <= called <= 130  # 100 expected; binomial sd 8.7
    for bad in (1.5, "0.3", None, True):
        with pytest.raises(ConfigError, match="demo_tool_rate must be a number in"):
            make_environment("calculator", {"demo_tool_rate": bad})
    with pytest.raises(ConfigError, match="products of two positive integers"):  # another task's problems
        demonstration_rows(env, get_task("addition").make_problems(40, 0, "train"), 3, load_tokenizer("char:ascii"))


def test_guess_number_demonstrations_play_valid_games_with_random_consistent_guesses():
    env = GuessNumber(max_guesses=100)
    tokenizer = load_tokenizer("char:ascii")
    rows = demonstration_rows(env, get_task("guess_number").make_problems(200, 0, "train"), 1, tokenizer)
    turns = []
    for row in rows:
        messages = row["messages"]
        assert messages[0] == {"role": "user", "content": "guess 1-100"}
        guesses = [int(m["content"]) for m in messages if m["role"] == "assistant"]
        feedback = [m["content"] for m in messages[2::2]]
        assert set(feedback) <= {"higher", "lower"} and len(feedback) == len(guesses) - 1
        turns.append(len(guesses))
    assert 5.5 < sum(turns) / len(turns) < 9.5  # about 2 ln 100 - 1.8 = 7.4 for uniform consistent guesses
    assert demonstration_rows(env, get_task("guess_number").make_problems(5, 0, "train"), 1, tokenizer) == rows[:5]


def test_guess_number_demo_mix_plays_halving_and_stride_games():
    env = make_environment(
        "guess_number", {"max_guesses": 100, "show_range": True, "demo_mix": {"halving": 0.3, "stride": 0.7}}
    )
    rows = demonstration_rows(
        env, get_task("guess_number").make_problems(400, 0, "train"), 2, load_tokenizer("char:ascii")
    )
    halving = stride = 0
    for row in rows:
        messages = row["messages"]
        guesses = [int(m["content"]) for m in messages if m["role"] == "assistant"]
        low, high = 1, 100
        first = {50: "halving", 10: "stride"}[guesses[0]]
        for guess, answer in zip(guesses, [m["content"] for m in messages[2::2]] + [None]):
            assert guess == ((low + high) // 2 if first == "halving" else min(low + 9, high))
            if answer is not None:  # the feedback names the range that is left
                low, high = (int(x) for x in answer.split()[1].split("-"))
        halving += first == "halving"
        stride += first == "stride"
        assert len(guesses) <= (7 if first == "halving" else 19)
    assert 90 <= halving <= 150 and halving + stride == 400  # 120 expected, binomial sd 9.2
    for bad, match in [
        ({"bisect": 1.0}, "unknown strategy"),
        ({"halving": -1.0}, "weights must be"),
        ({"halving": 0}, "weights must be"),
        ({"halving": float("inf")}, "weights must be"),
        ({"halving": "1"}, "weights must be"),
        ({}, "must be a mapping"),
        ("halving", "must be a mapping"),
        (["halving"], "must be a mapping"),
    ]:
        with pytest.raises(ConfigError, match=match):
            make_environment("guess_number", {"demo_mix": bad})


def test_an_environment_without_an_expert_cannot_write_demonstrations():
    class NoExpert:
        tools: list = []

    with pytest.raises(ConfigError, match="no scripted expert"):
        demonstration_rows(NoExpert(), [], 0, load_tokenizer("char:ascii"))
