"""``lmforge distill`` on tiny in-process models: both modes end to end, the teacher's logprobs are the
ones the loss reads (a teacher equal to the student gives a reverse KL of 0; the LoRA-off teacher is
the student's base), the shared-tokenizer check and the config errors."""

import pytest
import torch
from run_records import assert_resume_is_bit_exact, records

from lmforge import cli
from lmforge.core.config import load_config
from lmforge.core.errors import ConfigError
from lmforge.recipes import distill
from lmforge.recipes.distill import DistillConfig, run_distill

TINY = ["tokenizer=char", "hidden_size=32", "num_layers=2", "num_heads=2", "max_position_embeddings=32"]
STUDENT = [f"model.{x}" for x in TINY]
TEACHER = [f"teacher.{x}" for x in TINY] + ["teacher.name=tiny:llama", "teacher.init_seed=1", "teacher.dtype=fp32"]
COMMON = [
    "train.max_steps=2",
    "train.save_every=0",
    "train.eval_every=2",
    "train.max_new_tokens=4",
    "train.threads=1",
    "optim.lr=1e-2",
    "logging.progress=false",
]
ON_POLICY = (
    STUDENT
    + TEACHER
    + COMMON
    + [
        "data.task=addition",
        "data.num_train=64",
        "data.num_eval=8",
        "rollout.num_prompts=2",
        "rollout.group_size=4",
        "rollout.max_new_tokens=4",
        "train.micro_batch_size=4",
    ]
)
LOGIT = (
    STUDENT
    + TEACHER
    + COMMON
    + [
        "mode=logit",
        "fixed_data.task=addition",
        "fixed_data.num_train=64",
        "fixed_data.num_val=8",
        "fixed_data.num_eval=8",
        "fixed_data.max_len=32",
        "train.batch_size=8",
        "train.micro_batch_size=4",
        "algo.temperature=2",
    ]
)


def run(args, out):
    return run_distill(load_config(DistillConfig, None, args + [f"train.output_dir={out}"]))


@pytest.mark.parametrize("signal", ["sampled", "full"])
def test_on_policy_runs_and_logs_the_reverse_kl(tmp_path, signal):
    result = run(ON_POLICY + ["algo.reward_weight=0.5", f"algo.signal={signal}"], tmp_path / "run")
    train = records(tmp_path / "run")
    assert sorted(train) == [1, 2]
    for record in train.values():
        assert {"reverse_kl", "reward", "loss", "grad_norm", "time_teacher"} <= set(record)
        assert record["reverse_kl"] > 1e-3  # two random tiny models (near-uniform) still disagree
    assert {"accuracy", "accuracy_before", "run_dir"} <= set(result)


@pytest.mark.parametrize("signal", ["sampled", "full"])
def test_a_teacher_equal_to_the_student_gives_zero_reverse_kl(tmp_path, signal):
    """The loss reads the teacher's logprobs (of the sampled tokens, or all of them at each prefix): the
    student's own (same init, fp32) makes the signal 0, so the loss and the gradient are 0."""
    run(
        ON_POLICY + ["teacher.init_seed=0", "train.max_steps=1", "train.eval_every=0", f"algo.signal={signal}"],
        tmp_path / "run",
    )
    record = records(tmp_path / "run")[1]
    assert abs(record["reverse_kl"]) < 1e-5 and abs(record["loss"]) < 1e-5 and record["grad_norm"] < 1e-4


def test_lora_off_teacher_is_the_students_base(tmp_path):
    """teacher.name empty: the student's base with its adapters off. LoRA starts as the identity (B = 0),
    so the first step's reverse KL is 0 (and so is its gradient); a task reward moves the adapters, and
    then the student's distribution leaves its base's."""
    args = [a for a in ON_POLICY if not a.startswith("teacher.")] + [
        "model.lora.r=4",
        "train.max_steps=3",
        "train.eval_every=0",
        "optim.lr=5e-2",
        "algo.reward_weight=1",
        "rewards.functions=[parity]",
    ]
    run(args, tmp_path / "run")
    train = records(tmp_path / "run")
    assert abs(train[1]["reverse_kl"]) < 1e-5
    assert abs(train[3]["reverse_kl"]) > 1e-4


def test_logit_mode_runs_and_lowers_the_forward_kl(tmp_path):
    result = run(LOGIT + ["train.max_steps=4", "train.eval_every=4"], tmp_path / "run")
    train = records(tmp_path / "run")
    assert sorted(train) == [1, 2, 3, 4]
    assert train[4]["forward_kl"] < train[1]["forward_kl"]
    # loss = T^2 x the KL per token at temperature T (T = 2)
    assert train[1]["loss"] == pytest.approx(4 * train[1]["forward_kl"], rel=1e-5)
    assert {"accuracy", "val_loss", "run_dir"} <= set(result)


@pytest.mark.parametrize(
    "args, keys",
    [
        (ON_POLICY + ["algo.signal=sampled", "algo.reward_weight=0.5"], ("loss", "reverse_kl", "reward", "grad_norm")),
        (ON_POLICY + ["algo.signal=full"], ("loss", "reverse_kl", "reward", "grad_norm")),
        (LOGIT, ("loss", "forward_kl", "grad_norm")),
    ],
    ids=["sampled", "full", "logit"],
)
def test_resume_is_bit_exact(tmp_path, args, keys):
    """The teacher holds no state: a run resumed from its step-2 checkpoint logs steps 3-4 bit for bit."""
    args = args + ["train.max_steps=4", "train.save_every=2", "train.eval_every=0", "train.keep_last=10"]
    run(args, tmp_path / "run")
    assert_resume_is_bit_exact(run_distill, DistillConfig, args, tmp_path / "run", tmp_path / "resumed", 2, keys)


def test_mismatched_tokenizers_are_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"must share one tokenizer.*vocabulary size"):
        run(ON_POLICY + ["teacher.tokenizer=char:ascii"], tmp_path / "run")
    assert not (tmp_path / "run").exists()  # before the run directory is taken


class Tok:
    """A tokenizer stand-in: ``ids`` maps characters to ids."""

    def __init__(self, ids, eos=0):
        self.ids, self.eos_token_id, self.pad_token_id = ids, eos, eos

    def __len__(self):
        return len(self.ids)

    def decode(self, ids, skip_special_tokens=True):
        inverse = {v: k for k, v in self.ids.items()}
        return "".join(inverse[i] for i in ids if i in inverse)

    def encode(self, text, add_special_tokens=False):
        return [self.ids[c] for c in text]


def test_same_size_but_other_ids_is_caught_by_the_probe():
    student, teacher = Tok({"a": 0, "b": 1, "c": 2}), Tok({"a": 0, "c": 1, "b": 2})
    distill.check_shared_tokenizer(student, Tok(dict(student.ids)), 3, 3, ("s", "t"))  # the same: no error
    with pytest.raises(ConfigError, match="probe string encodes differently"):
        distill.check_shared_tokenizer(student, teacher, 3, 3, ("s", "t"))
    with pytest.raises(ConfigError, match="output logits: student 3, teacher 4"):
        distill.check_shared_tokenizer(student, Tok(dict(student.ids)), 3, 4, ("s", "t"))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["teacher.name="], "student has none"),
        (["mode=logit"], "fixed_data.task"),
        (["fixed_data.task=addition"], "fixed_data.task is not used with mode=on_policy"),
        (["algo.kl_coef=0.1"], "remove algo.kl_coef"),
        (["algo.temperature=2"], "remove algo.temperature"),
        (["algo.reward_weight=1", "rollout.group_size=1"], "group_size must be >= 2"),
        (["algo.signal=full", "algo.num_iterations=2"], "signal=full differentiates the exact KL"),
    ],
)
def test_config_errors(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        run(ON_POLICY + extra, tmp_path / "run")


def test_logit_refuses_a_reward_weight(tmp_path):
    with pytest.raises(ConfigError, match="algo.reward_weight is not used with mode=logit"):
        run(LOGIT + ["algo.reward_weight=1"], tmp_path / "run")


def test_cli_lists_distill():
    parser = cli.build_parser()
    assert "distill" in parser.format_help()
    torch.manual_seed(0)  # (no state leaks into other tests through the parser)
