import dataclasses
import re
from pathlib import Path

import pytest

from lmforge.core.config import describe, load_config, parse_override
from lmforge.core.errors import ConfigError
from lmforge.recipes.sft import SFTConfig


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 3e-4\ntrain:\n  max_steps: 10\ndata:\n  task: addition\n")
    cfg = load_config(SFTConfig, path, ["train.max_steps=100", "optim.no_decay=bias,norm"])
    assert cfg.optim.lr == 3e-4  # YAML 1.1 reads "3e-4" as a string: coerced to float
    assert cfg.train.max_steps == 100  # the override wins over the file
    assert cfg.optim.no_decay == ["bias", "norm"]
    assert cfg.data.task == "addition"
    assert cfg.optim.beta1 == 0.9  # untouched default


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError) as err:
        load_config(SFTConfig, None, ["data.task=addition", "optim.learning_rate=1e-3"])
    assert "optim.learning_rate" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(SFTConfig, None, ["data.task=addition", "train.max_step=5"])
    assert "Did you mean: train.max_steps" in str(err.value)
    with pytest.raises(ConfigError, match="unknown config key 'optimizer'"):
        load_config(SFTConfig, None, ["optimizer.lr=1"])


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.max_steps=ten", "expected int"),
        ("train.max_steps=1.5", "expected int"),
        ("optim.lr=fast", "expected float"),
        ("logging.progress=maybe", "expected bool"),
        ("optim.schedule=exponential", "one of 'cosine', 'linear', 'constant'"),
    ],
)
def test_wrong_type_names_key_and_type(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(SFTConfig, None, ["data.task=addition", override])
    assert override.split("=")[0] in str(err.value)
    assert expected in str(err.value)


def test_section_validation_and_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="exactly one of data.path"):
        load_config(SFTConfig, None, [])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(SFTConfig, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(SFTConfig, bad)
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("optim.lr")
    with pytest.raises(ConfigError, match="optim.lr must be > 0"):
        load_config(SFTConfig, None, ["data.task=addition", "optim.lr=0"])


def test_describe_lists_every_leaf_with_help():
    rows = describe(SFTConfig)
    keys = [k for k, _, _ in rows]
    assert "optim.lr" in keys and "train.resume" in keys and "data.completion_only" in keys
    assert all(text for _, _, text in rows), "every option needs a one-line help text"
    cfg = SFTConfig()  # direct construction does not validate

    def leaves(obj) -> int:  # nested sections (model.lora) count their own fields
        return sum(
            leaves(getattr(obj, f.name)) if dataclasses.is_dataclass(getattr(obj, f.name)) else 1
            for f in dataclasses.fields(obj)
        )

    assert len(rows) == sum(leaves(getattr(cfg, f.name)) for f in dataclasses.fields(cfg))
    assert "model.lora.r" in keys


EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))


def example_command(path: Path) -> str:
    """The command a shipped example says it runs with (``lmforge <command> examples/<file>``)."""
    match = re.search(rf"lmforge ((?:antidistill )?\w+) examples/{re.escape(path.name)}", path.read_text())
    assert match, f"{path.name} does not say how to run it (`lmforge <command> examples/{path.name}`)"
    return match.group(1)


def test_examples_exist():
    assert len(EXAMPLES) >= 6


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_loads_with_its_command(path):
    from lmforge.pipelines.antidistill import AntidistillConfig
    from lmforge.recipes.distill import DistillConfig
    from lmforge.recipes.dpo import DPOConfig
    from lmforge.recipes.grpo import GRPOConfig
    from lmforge.recipes.ppo import PPOConfig
    from lmforge.recipes.pretrain import PretrainConfig
    from lmforge.recipes.rm import RMConfig

    command = example_command(path)
    config_cls = {
        "sft": SFTConfig,
        "grpo": GRPOConfig,
        "ppo": PPOConfig,
        "pretrain": PretrainConfig,
        "dpo": DPOConfig,
        "distill": DistillConfig,
        "rm": RMConfig,
    }.get(command.split()[0], AntidistillConfig)
    cfg = load_config(config_cls, str(path), [])  # unknown keys, wrong types and bad values are errors
    algo = getattr(cfg, "algo", None)
    if hasattr(algo, "resolved"):  # RL: presets and the algorithm's own checks (dpo checks its algo on load)
        algo.resolved()
    assert dataclasses.asdict(cfg)  # a complete, resolved config


@pytest.mark.parametrize(
    "recipe, overrides, named",
    [
        ("grpo", ["data.task=addition", "data.columns={prompt: question}"], "data.columns"),
        ("grpo", ["data.task=addition", "data.split=test", "data.eval_fraction=0.2"], "data.split, data.eval_fraction"),
        ("sft", ["data.task=addition", "data.subset=main"], "data.subset"),
        ("sft", ["data.task=addition", "data.val_fraction=0.5"], "data.val_fraction"),
        ("antidistill", ["data.reward=math"], "data.reward"),
        (
            "antidistill",
            ["data.source_split=test", "data.columns={answer: solution}"],
            "data.source_split, data.columns",
        ),
    ],
)
def test_keys_a_task_would_ignore_are_refused(recipe, overrides, named):
    """Keys that only select or score the rows of data.path are an error next to a task, not a no-op."""
    from lmforge.pipelines.antidistill import AntidistillConfig
    from lmforge.recipes.grpo import GRPOConfig

    cls = {"grpo": GRPOConfig, "sft": SFTConfig, "antidistill": AntidistillConfig}[recipe]
    first = named.split(", ")[0]
    with pytest.raises(ConfigError, match=re.escape(first)):
        load_config(cls, None, overrides)
    # the same keys with data.path are accepted
    if recipe != "antidistill":
        overrides = [o for o in overrides if not o.startswith("data.task")] + ["data.path=rows.jsonl"]
    else:
        overrides = overrides + ["data.path=rows.jsonl"]
    load_config(cls, None, overrides)
