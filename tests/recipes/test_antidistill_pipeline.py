"""``lmforge antidistill``: the six stages run end to end from one config on tiny random models (CPU,
in-process, through the CLI), a teacher/proxy tokenizer mismatch fails clearly, and a stage whose
input is missing names the command to run first."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from lmforge.antidistill.ads import load_gradient
from lmforge.antidistill.pipeline import StageInputMissing, interpolate, read_jsonl
from lmforge.cli import main
from lmforge.core.config import load_config
from lmforge.core.errors import ConfigError
from lmforge.data.tasks import get_task
from lmforge.model.load import load_model
from lmforge.model.tokenizer import char_tokenizer
from lmforge.parallel.context import free_port as _free_port
from lmforge.pipelines.antidistill import AntidistillConfig, run_grad, run_traces

TINY = [
    "name=tiny:llama",
    "tokenizer=char",
    "hidden_size=32",
    "num_layers=2",
    "num_heads=2",
    "max_position_embeddings=32",
]
ARGS = [f"{role}.{kv}" for role in ("teacher", "proxy", "student") for kv in TINY] + [
    "proxy.init_seed=1",
    "student.init_seed=2",
    "student.num_layers=1",
    "data.num_heldout=8",
    "data.num_prompts=8",
    "data.samples_per_prompt=2",
    "data.num_test=8",
    "data.max_new_tokens=4",
    "data.max_len=16",
    "traces.batch_size=4",
    "grad.batch_size=3",
    "sample.temperatures=[1.0,2.0]",
    "sample.lams=[0.0,0.5]",
    "sample.batch_size=4",
    "distill.max_steps=2",
    "distill.batch_size=4",
    "distill.micro_batch_size=4",
    "distill.optim.lr=1e-2",
    "distill.val_fraction=0.2",
    "run.threads=1",
    "run.progress=false",
]
SETTINGS = ["T1-lam0", "T1-lam0.5", "T2-lam0", "T2-lam0.5"]


def cli(stage: str, workdir, *extra: str) -> int:
    return main(["antidistill", stage, *ARGS, f"run.workdir={workdir}", *extra])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """One pipeline run, stage by stage; each stage must succeed."""
    root = tmp_path_factory.mktemp("ads")
    for stage in ("traces", "grad", "sample", "distill", "eval", "report"):
        assert cli(stage, root) == 0, stage
    return root


def test_traces_stage_writes_scored_heldout_traces(workdir):
    rows = read_jsonl(workdir / "traces" / "heldout.jsonl")
    summary = json.loads((workdir / "traces" / "summary.json").read_text())
    assert len(rows) == 8 and all({"prompt", "completion", "correct"} <= set(r) for r in rows)
    # scored against each row's own problem: the addition answer, written least-significant digit first
    cfg = load_config(AntidistillConfig, None, ARGS)
    problems = {
        p.prompt: p
        for p in get_task(cfg.data.task).make_problems(cfg.data.num_heldout, cfg.data.seed, cfg.data.heldout_split)
    }
    for row in rows:
        assert row["correct"] == (row["completion"].strip() == problems[row["prompt"]].completion), row
    assert summary["temperature"] == 0.0 and summary["config"]["data"]["num_heldout"] == 8


def test_grad_stage_writes_gradient_with_clean_names_and_metadata(workdir):
    grads, meta = load_gradient(workdir / "grad" / "proxy_grad.safetensors")
    cfg = load_config(AntidistillConfig, None, ARGS)
    proxy, _ = load_model(cfg.proxy)
    assert set(grads) == {n for n, _ in proxy.named_parameters()}
    assert meta["num_sequences"] == 8 and meta["world_size"] == 1 and meta["grad_norm"] > 0


def test_sample_stage_writes_every_setting(workdir):
    for name in SETTINGS:
        rows = read_jsonl(workdir / "samples" / name / "traces.jsonl")
        summary = json.loads((workdir / "samples" / name / "summary.json").read_text())
        assert len(rows) == 16  # 8 prompts x 2 samples
        assert summary["num_traces"] == 16 and summary["num_completion_tokens"] > 0
        if summary["lam"] == 0:
            assert summary["direction"] == "none"  # plain sampling
        else:  # the exact KL(ADS || tempered teacher): > 0 only if the proxy term reached the logits
            assert summary["kl_per_token"] > 0.0 and summary["direction"] == "proxy"


@pytest.mark.real_plots
def test_distill_eval_report_outputs(workdir):
    for name in SETTINGS:
        assert (workdir / "students" / name / "final" / "config.json").is_file()
    results = json.loads((workdir / "eval" / "results.json").read_text())
    assert [s["name"] for s in results["students"]] == SETTINGS and results["num_test"] == 8
    report = json.loads((workdir / "report" / "report.json").read_text())
    # the report carries eval's accuracies and sample's KL for each setting, not values of its own
    by_name = {s["name"]: s for s in report["settings"]}
    for student in results["students"]:
        assert by_name[student["name"]]["student_accuracy"] == student["student_accuracy"]
    for name in SETTINGS:
        sampled = json.loads((workdir / "samples" / name / "summary.json").read_text())
        assert by_name[name]["kl_per_token"] == sampled["kl_per_token"]
        assert by_name[name]["teacher_accuracy"] == sampled["teacher_accuracy"]
    table = (workdir / "report" / "report.md").read_text()
    assert all(f"| {name} |" in table for name in SETTINGS)
    assert (workdir / "report" / "student_vs_teacher.png").stat().st_size > 1000


@pytest.mark.e2e
def test_rerunning_distill_replaces_students(workdir):
    # the SFT recipe refuses a used run dir; the stage replaces it: new students, new files
    finals = [workdir / "students" / name / "final" / "model.safetensors" for name in SETTINGS]
    before = [path.stat().st_mtime_ns for path in finals]
    (workdir / "students" / SETTINGS[0] / "marker").write_text("from the first run")
    assert cli("distill", workdir) == 0
    assert all(path.stat().st_mtime_ns != old for path, old in zip(finals, before))
    assert not (workdir / "students" / SETTINGS[0] / "marker").exists()


def test_tokenizer_mismatch_between_teacher_and_proxy_fails_clearly(tmp_path, capsys):
    other = tmp_path / "other_tok"
    char_tokenizer("9876543210+=").save_pretrained(other)  # same characters, different ids
    cfg = load_config(AntidistillConfig, None, ARGS + [f"run.workdir={tmp_path}", f"proxy.tokenizer={other}"])
    run_traces(cfg)
    with pytest.raises(ConfigError, match="teacher and proxy tokenizers differ.*different ids"):
        run_grad(cfg)
    assert cli("grad", tmp_path, f"proxy.tokenizer={other}") == 2
    assert "tokenizers differ" in capsys.readouterr().err


@pytest.mark.parametrize(
    "stage,first",
    [("grad", "traces"), ("sample", "grad"), ("distill", "sample"), ("eval", "distill"), ("report", "eval")],
)
def test_missing_input_names_the_command_to_run_first(tmp_path, capsys, stage, first):
    assert cli(stage, tmp_path) == 2
    assert f"run `lmforge antidistill {first}`" in capsys.readouterr().err


def test_missing_input_raises_project_error(tmp_path):
    cfg = load_config(AntidistillConfig, None, ARGS + [f"run.workdir={tmp_path}"])
    with pytest.raises(StageInputMissing, match="heldout.jsonl not found: run `lmforge antidistill traces`"):
        run_grad(cfg)


def _copy_inputs(workdir, dest):
    """traces/ and grad/ of the module's run, so a stage can be re-run with other options."""
    for part in ("traces", "grad"):
        shutil.copytree(workdir / part, dest / part)
    return dest


def test_random_direction_control_writes_its_own_settings(workdir, tmp_path):
    root = _copy_inputs(workdir, tmp_path)
    assert cli("sample", root, "sample.direction=random", "sample.direction_seed=5") == 0
    for name in ["T1-lam0", "T1-lam0.5-random", "T2-lam0", "T2-lam0.5-random"]:
        summary = json.loads((root / "samples" / name / "summary.json").read_text())
        assert summary["direction"] == ("none" if summary["lam"] == 0 else "random")
        assert (summary["kl_per_token"] > 0) == (summary["lam"] != 0)
    # lam = 0 does not depend on the direction: same seeds, same traces as the proxy run
    assert read_jsonl(root / "samples" / "T1-lam0" / "traces.jsonl") == read_jsonl(
        workdir / "samples" / "T1-lam0" / "traces.jsonl"
    )
    proxy_kl = json.loads((workdir / "samples" / "T1-lam0.5" / "summary.json").read_text())["kl_per_token"]
    random_kl = json.loads((root / "samples" / "T1-lam0.5-random" / "summary.json").read_text())["kl_per_token"]
    assert random_kl != proxy_kl  # another direction, another tilt


def test_sample_seed_changes_the_samples_not_the_prompts(workdir, tmp_path):
    root = _copy_inputs(workdir, tmp_path)
    assert cli("sample", root, "sample.seed=7", "sample.lams=[0.0]", "sample.temperatures=[2.0]") == 0
    base = read_jsonl(workdir / "samples" / "T2-lam0" / "traces.jsonl")  # sample.seed=-1: data.seed 0
    other = read_jsonl(root / "samples" / "T2-lam0" / "traces.jsonl")
    assert [r["prompt"] for r in other] == [r["prompt"] for r in base]
    assert [r["completion"] for r in other] != [r["completion"] for r in base]


def test_top_k_one_makes_every_sample_of_a_prompt_the_same(workdir, tmp_path):
    root = _copy_inputs(workdir, tmp_path)
    assert cli("sample", root, "sample.top_k=1", "sample.temperatures=[2.0]", "run.dtype=bf16") == 0
    for name in ["T2-lam0", "T2-lam0.5"]:
        rows = read_jsonl(root / "samples" / name / "traces.jsonl")
        summary = json.loads((root / "samples" / name / "summary.json").read_text())
        assert summary["top_k"] == 1 and summary["dtype"] == "bf16"
        pairs = list(zip(rows[0::2], rows[1::2]))  # 2 samples per prompt, in prompt order
        assert all(a["prompt"] == b["prompt"] and a["completion"] == b["completion"] for a, b in pairs)
    plain = read_jsonl(workdir / "samples" / "T2-lam0" / "traces.jsonl")  # same seeds, no top-k, fp32
    assert [r["completion"] for r in plain[0::2]] != [r["completion"] for r in plain[1::2]]


def test_bad_sweep_is_a_config_error():
    with pytest.raises(ConfigError, match="sample.temperatures must all be > 0"):
        load_config(AntidistillConfig, None, ["sample.temperatures=[0.0]"])
    with pytest.raises(ConfigError, match="three different splits"):
        load_config(AntidistillConfig, None, ["data.test_split=train"])
    with pytest.raises(ConfigError, match=r"sample.top_p must be in \(0, 1\]"):
        load_config(AntidistillConfig, None, ["sample.top_p=1.5"])
    with pytest.raises(ConfigError, match="sample.direction"):
        load_config(AntidistillConfig, None, ["sample.direction=sideways"])


@pytest.mark.e2e
def test_grad_under_torchrun_equals_one_process(workdir, tmp_path):
    """`torchrun --nproc_per_node=2 -m lmforge antidistill grad`: the traces are sharded over two gloo
    ranks, the sums all-reduced, rank 0 writes; the file equals the one-process gradient."""
    shutil.copytree(workdir / "traces", tmp_path / "traces")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={_free_port()}",
        "-m",
        "lmforge",
        "antidistill",
        "grad",
        *ARGS,
        f"run.workdir={tmp_path}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("[antidistill grad] 8 traces") == 1  # rank 0 alone reports
    two, meta = load_gradient(tmp_path / "grad" / "proxy_grad.safetensors")
    one, one_meta = load_gradient(workdir / "grad" / "proxy_grad.safetensors")
    assert meta["world_size"] == 2 and one_meta["world_size"] == 1
    assert (meta["num_sequences"], meta["num_tokens"]) == (one_meta["num_sequences"], one_meta["num_tokens"])
    assert set(two) == set(one)
    for name in one:  # fp32, summed in another order: rounding only
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-7)


def test_interpolate_reads_the_temperature_curve():
    points = [(0.9, 0.6), (0.5, 0.2), (0.7, 0.5)]
    assert interpolate(points, 0.6) == pytest.approx(0.35, abs=1e-12)
    assert interpolate(points, 0.9) == 0.6
    assert interpolate(points, 0.95) is None and interpolate(points, 0.4) is None
    assert interpolate([(0.5, 0.1), (0.5, 0.3)], 0.5) == pytest.approx(0.2, abs=1e-12)


def test_a_reasoning_gym_task_is_a_prompt_source(tmp_path):
    """data.task=rg:<name> (issue 13 item 4): the traces stage samples the reasoning-gym problems of the
    held-out split and scores each trace with the dataset's own score_answer."""
    pytest.importorskip("reasoning_gym")
    long_ctx = [a for a in ARGS if not a.startswith("data.max_len") and "max_position" not in a]
    long_ctx += [f"{role}.max_position_embeddings=256" for role in ("teacher", "proxy", "student")]
    assert (
        main(
            [
                "antidistill",
                "traces",
                *long_ctx,
                "data.max_len=256",
                "data.task=rg:leg_counting:answer_format=plain",
                f"run.workdir={tmp_path}",
            ]
        )
        == 0
    )
    rows = read_jsonl(tmp_path / "traces" / "heldout.jsonl")
    task = get_task("rg:leg_counting:answer_format=plain")
    problems = task.make_problems(8, 0, "val")
    assert [r["prompt"] for r in rows] == [p.prompt for p in problems]
    for row, problem in zip(rows, problems):
        assert row["answer"] == problem.answer
        assert row["correct"] == task.is_correct(row["completion"], problem)
        assert task.is_correct(problem.answer, problem) and not task.is_correct(problem.answer + "1", problem)


def test_a_data_file_of_prompts_and_answers_is_a_prompt_source(tmp_path):
    """data.path (issue 13 item 4): a CSV with its own column names through data.columns; the traces
    stage samples rows of the held-out split (a hash of the prompt) and scores them by exact match."""
    from lmforge.data.rows_task import RowsTask
    from lmforge.data.tasks import split_of

    pytest.importorskip("datasets")
    addition = get_task("addition")  # its own splits use the same hash: take rows of all three
    problems = [
        p for split, n in (("train", 240), ("val", 30), ("test", 30)) for p in addition.make_problems(n, 0, split)
    ]
    csv = tmp_path / "sums.csv"
    csv.write_text("question,solution\n" + "".join(f"{p.prompt},{p.completion}\n" for p in problems))
    assert (
        main(
            [
                "antidistill",
                "traces",
                *ARGS,
                f"data.path={csv}",
                "data.columns={prompt: question, answer: solution}",
                f"run.workdir={tmp_path / 'work'}",
            ]
        )
        == 0
    )
    rows = read_jsonl(tmp_path / "work" / "traces" / "heldout.jsonl")
    assert len(rows) == 8
    wanted = {p.prompt: p.completion for p in problems}
    for row in rows:
        assert split_of(row["prompt"]) == "val" and row["answer"] == wanted[row["prompt"]]
        assert row["correct"] == (row["completion"].strip() == row["answer"])
    task = RowsTask.load(str(csv), columns={"prompt": "question", "answer": "solution"})
    assert sum(task.sizes().values()) == 300
    assert task.make_problems(5, 1, "test") == task.make_problems(5, 1, "test") != task.make_problems(5, 2, "test")
    assert {p.prompt for p in task.make_problems(1000, 0, "train")}.isdisjoint(
        p.prompt for p in task.make_problems(1000, 0, "test")
    )


def test_rows_task_errors_name_the_file_and_row(tmp_path):
    from lmforge.core.errors import DataError
    from lmforge.data.rows_task import RowsTask

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: no 'answer' column"):
        RowsTask.load(str(bad))
    one = tmp_path / "one.jsonl"
    one.write_text('{"prompt": "1+1=", "answer": 2}\n')  # a number is read as its text
    task = RowsTask.load(str(one))
    (split,) = [s for s, k in task.sizes().items() if k == 1]
    other = next(s for s in ("train", "val", "test") if s != split)
    with pytest.raises(DataError, match=f"one.jsonl: no row falls in the '{other}' split"):
        task.make_problems(1, 0, other)
    assert task.is_correct(" 2\n", task.make_problems(1, 0, split)[0])


def test_a_rows_reward_that_raises_or_hangs_is_an_error_naming_it(tmp_path, monkeypatch):
    """data.path traces are scored through a RewardSet: a raising reward and one that hangs past the
    timeout both stop the stage with an error naming the reward and the prompt, never a silent 0."""
    import time as clock

    from lmforge.core.errors import DataError
    from lmforge.pipelines import antidistill
    from lmforge.rollout import BUILTIN_REWARDS

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(40)))

    def raising(completion, problem):
        raise ZeroDivisionError("boom")

    def hanging(completion, problem):
        clock.sleep(30)
        return 1.0

    monkeypatch.setitem(BUILTIN_REWARDS, "raising", raising)
    monkeypatch.setitem(BUILTIN_REWARDS, "hanging", hanging)
    monkeypatch.setattr(antidistill, "REWARD_TIMEOUT_S", 0.5)
    for name, needle in (("raising", "it raised"), ("hanging", "timed out after 0.5 s")):
        cfg = load_config(AntidistillConfig, None, [f"data.path={rows}", f"data.reward={name}"])
        task = antidistill._task(cfg)
        problem = task.make_problems(1, 0, "train")[0]
        start = clock.monotonic()
        with pytest.raises(DataError, match=f"the '{name}' reward failed on the prompt .*{needle}"):
            task.score("1", problem)
        assert clock.monotonic() - start < 10
    cfg = load_config(AntidistillConfig, None, [f"data.path={rows}", "data.reward=exact"])
    task = antidistill._task(cfg)
    problem = task.make_problems(1, 0, "train")[0]
    assert task.score(problem.answer, problem) == 1.0 and task.score("x", problem) == 0.0
