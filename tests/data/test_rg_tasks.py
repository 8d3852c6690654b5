"""reasoning-gym datasets as tasks (``data.task=rg:<name>``): spec parsing, determinism, disjoint
splits, the dataset's own scorer on known answers, prompts through the chat template, SFT rows."""

import pickle
import sys

import pytest

pytest.importorskip("reasoning_gym")

from lmforge.data.rg import RGTask, list_tasks, rg_task, task_parameters
from lmforge.data.sft import encode_prompt, sft_rows_from_task
from lmforge.data.tasks import SPLITS, get_task, split_of

SMALL_ARITH = "rg:basic_arithmetic:min_terms=2,max_terms=2,min_digits=1,max_digits=1,operators=[+,-]"


def questions(problems):
    return [p.entry["question"] for p in problems]


@pytest.mark.parametrize("spec", ["rg:leg_counting", SMALL_ARITH])
def test_same_seed_same_problems_other_seed_other_problems(spec):
    task = get_task(spec)
    first, again = task.make_problems(40, 3, "train"), get_task(spec).make_problems(40, 3, "train")
    assert [p.prompt for p in first] == [p.prompt for p in again]
    assert [p.entry for p in first] == [p.entry for p in again]
    assert [p.prompt for p in task.make_problems(40, 4, "train")] != [p.prompt for p in first]


@pytest.mark.parametrize("spec", ["rg:leg_counting", SMALL_ARITH])
def test_splits_are_disjoint_whatever_the_seeds(spec):
    # SMALL_ARITH has only a few hundred distinct questions, so seeds alone would collide
    task = get_task(spec)
    by_split = {split: set(questions(task.make_problems(60, seed, split))) for split, seed in zip(SPLITS, (0, 1, 2))}
    assert not by_split["train"] & by_split["val"]
    assert not by_split["train"] & by_split["test"]
    assert not by_split["val"] & by_split["test"]
    for split, qs in by_split.items():
        assert all(split_of(q) == split for q in qs)


def test_basic_arithmetic_answers_are_right_and_scored_by_score_answer():
    task = get_task(SMALL_ARITH)
    problems = task.make_problems(30, 0, "test")
    for p in problems:
        expression = p.entry["metadata"]["expression"]
        assert set(expression) <= set("0123456789+-() ")  # only + and -, as asked
        assert int(p.answer) == eval(expression)  # noqa: S307 - digits, + and - only
        assert task.score(f"<think>easy</think> <answer>{p.answer}</answer>", p) == 1.0
        assert task.score(f"<answer>{int(p.answer) + 1}</answer>", p) == 0.0
        assert task.score(p.answer, p) == 0.0  # tags format: no tags, no answer
        assert task.is_correct(p.completion, p)
    # the last tag counts
    p = problems[0]
    assert task.score(f"<answer>{int(p.answer) + 1}</answer> no, <answer>{p.answer}</answer>", p) == 1.0


def test_leg_counting_plain_format():
    task = get_task("rg:leg_counting:min_animals=2,max_animals=3,answer_format=plain")
    assert task.answer_format == "plain" and task.params == {"min_animals": 2, "max_animals": 3}
    for p in task.make_problems(10, 0, "train"):
        assert p.completion == p.answer == str(p.entry["metadata"]["total_legs"])
        assert p.prompt.startswith(p.entry["question"].rstrip()) and p.prompt.endswith(
            "Reply with only the final answer."
        )
        assert task.score(f"  {p.answer}\n", p) == 1.0
        assert task.score(f"{int(p.answer) + 2}", p) == 0.0


def test_last_number_format_scores_the_last_number_of_the_completion():
    task = get_task(
        "rg:basic_arithmetic:max_terms=2,max_digits=2,operators=[+],allow_parentheses=false,"
        "allow_negation=false,answer_format=last_number"
    )
    problems = task.make_problems(5, 0, "test")
    for p in problems:
        a, b = (int(x) for x in p.entry["question"].split("Calculate ")[1].split(".")[0].split(" + "))
        assert p.answer == str(a + b) and p.completion == p.answer
        assert p.prompt.endswith("Reply with only the final answer.")
        assert task.score(f"{a} + {b} = {a + b}", p) == 1.0  # the restated question does not count
        assert task.score(f"{a + b}, or maybe {a + b + 1}", p) == 0.0  # the last number does
        assert task.score("I cannot say.", p) == 0.0
    assert task.extract("total: 1,234 legs") == "1234" and task.extract("-2.5") == "-2.5"


def test_countdown_expression_and_partial_credit():
    task = get_task("rg:countdown:min_numbers=3,max_numbers=3")
    summed = []
    for p in task.make_problems(3, 0, "train"):
        target = p.entry["metadata"]["target"]
        assert eval(p.answer) == target  # noqa: S307 - the dataset's own arithmetic expression
        assert task.score(f"<answer>{p.answer}</answer>", p) == 1.0
        # an expression that is always wrong (target + 1): countdown's partial credit, below full marks
        # and above a completion with no answer at all
        wrong = f"<answer>{p.answer} + 1</answer>"
        assert 0.0 < task.score("no answer here", p) < task.score(wrong, p) < 1.0
        assert not task.is_correct(wrong, p)
        # the sum of the given numbers: full marks exactly when it happens to reach the target
        total = " + ".join(map(str, p.entry["metadata"]["numbers"]))
        summed.append((eval(total) == target, task.score(f"<answer>{total}</answer>", p)))  # noqa: S307
    # seed 0 gives one problem whose sum misses the target (partial credit) and two where it reaches it
    misses = [score for reached, score in summed if not reached]
    assert len(misses) == 1 and 0.0 < misses[0] < 1.0, summed
    assert [score for reached, score in summed if reached] == [1.0, 1.0], summed


def test_spec_round_trip_and_pickle():
    task = get_task(SMALL_ARITH)
    assert isinstance(task, RGTask)
    assert get_task(task.spec).spec == task.spec
    clone = pickle.loads(pickle.dumps(task))  # process-pool rewards pickle the task
    p = task.make_problems(1, 0, "train")[0]
    assert clone.spec == task.spec and clone.score(p.completion, p) == 1.0


@pytest.mark.parametrize(
    "spec,message",
    [
        ("rg:leg_countin", "Did you mean: leg_counting"),
        ("rg:leg_counting:legs=4", r"bad parameter 'legs=4'.*min_animals=3"),
        ("rg:leg_counting:min_animals=0", "min_animals must be positive"),
        ("rg:leg_counting:seed=1", "bad parameter 'seed=1'"),
        ("rg:leg_counting:answer_format=json", "answer_format must be one of tags, plain"),
        ("rg:", "name a reasoning-gym dataset"),
    ],
)
def test_bad_specs_are_clear(spec, message):
    with pytest.raises(ValueError, match=message):
        get_task(spec)


def test_bad_spec_is_a_config_error_naming_data_task():
    from lmforge.core.errors import ConfigError
    from lmforge.rl.config import RLDataConfig
    from lmforge.supervised.sft_data import SFTDataConfig

    with pytest.raises(ConfigError, match="data.task: rg: unknown reasoning-gym dataset"):
        RLDataConfig(task="rg:no_such_dataset").validate()
    with pytest.raises(ConfigError, match="data.task: rg: unknown reasoning-gym dataset"):
        SFTDataConfig(task="rg:no_such_dataset").validate()


def test_missing_package_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)
    with pytest.raises(ValueError, match=r"pip install 'lmforge\[rg\]'"):
        rg_task("rg:leg_counting")


def test_listing():
    names = list_tasks()
    assert len(names) > 50 and {"leg_counting", "countdown", "basic_arithmetic"} <= set(names)
    assert task_parameters("leg_counting") == {
        "min_animals": 3,
        "max_animals": 10,
        "min_instances": 1,
        "max_instances": 15,
    }


def test_prompts_go_through_the_chat_template_and_sft_rows():
    from lmforge.model.tokenizer import char_tokenizer
    from lmforge.rl import build_prompts
    from lmforge.rl.config import RLDataConfig

    tokenizer = char_tokenizer(get_task("rg:leg_counting").alphabet)
    data = RLDataConfig(task="rg:leg_counting", num_train=5, num_eval=3, use_chat_template="on")
    prompts = build_prompts(data, tokenizer, seed=0)
    assert prompts.chat and len(prompts.eval_problems) == 3
    for ids, problem in zip(prompts.prompt_ids, prompts.problems):
        assert ids == encode_prompt(tokenizer, problem.prompt, True)
        assert ids != encode_prompt(tokenizer, problem.prompt, False)  # the template's role tokens are there
    rows = sft_rows_from_task(get_task("rg:leg_counting"), 4, 0, "train")
    assert all(r["completion"] == f"<answer>{r['answer']}</answer>" for r in rows)
