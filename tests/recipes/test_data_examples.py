"""The data examples of docs/data.md run as shipped (one step each), and every source that
examples/data/make_sources.py writes reads back as the same 40 prompt rows."""

import runpy
import sys
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")

from lmforge.core.config import load_config  # noqa: E402
from lmforge.data.prompts import load_prompt_rows  # noqa: E402
from lmforge.recipes.grpo import GRPOConfig, run_grpo  # noqa: E402
from lmforge.recipes.pretrain import PretrainConfig, run_pretrain  # noqa: E402
from lmforge.recipes.sft import SFTConfig, run_sft  # noqa: E402
from lmforge.runtime.metrics import read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "data"
RECIPES = {
    "grpo_csv.yaml": (GRPOConfig, run_grpo),
    "sft_csv.yaml": (SFTConfig, run_sft),
    "pretrain_stream.yaml": (PretrainConfig, run_pretrain),
}
MAP = {"prompt": "question"}


def test_every_data_example_config_is_tested():
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(RECIPES)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_data_examples_run_as_shipped(name, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the examples name their files relative to the repository root
    cls, run = RECIPES[name]
    out = tmp_path / "run"
    run(
        load_config(
            cls,
            EXAMPLES / name,
            ["train.max_steps=1", "train.threads=1", "logging.progress=false", f"train.output_dir={out}"],
        )
    )
    records = read_metrics(out)
    assert any(r["kind"] == "train" for r in records)
    if cls is GRPOConfig:
        evals = [r for r in records if r["kind"] == "eval"]
        assert evals and all({"accuracy", "eval_reward", "pass_at_k"} <= r.keys() for r in evals)


def test_make_sources_writes_every_source_with_the_same_rows(tmp_path, monkeypatch):
    expected = load_prompt_rows(str(EXAMPLES / "arith_prompts.csv"), columns=MAP)
    assert len(expected) == 40
    monkeypatch.setattr(sys, "argv", ["make_sources.py", str(tmp_path / "out"), "--hub-cache", str(tmp_path / "hub")])
    runpy.run_path(str(EXAMPLES / "make_sources.py"), run_name="__main__")
    out = tmp_path / "out"
    for name in ("arith_prompts.parquet", "arith_prompts.arrow", "arith_prompts.jsonl"):
        assert load_prompt_rows(str(out / name), columns=MAP) == expected, name
    for source in (str(out / "arith_saved"), str(out / "arith_dir"), "local/arith"):
        if source == "local/arith":
            monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hub"))
        rows = load_prompt_rows(source, "train", columns=MAP) + load_prompt_rows(source, "test", columns=MAP)
        assert rows == expected, source
