"""Careless config inputs (issue 22): each is an error with exit code 2 and a message naming the
key / file and the fix, or is read as the user meant it; never a setting silently dropped or changed."""

import re

import pytest

from lmforge.cli import EXIT_USER_ERROR, main
from lmforge.core.config import load_config
from lmforge.core.errors import ConfigError
from lmforge.pipelines.antidistill import AntidistillConfig
from lmforge.recipes.grpo import GRPOConfig
from lmforge.recipes.pretrain import PretrainConfig
from lmforge.recipes.sft import SFTConfig

# (what the user wrote: YAML file text or None, command-line overrides) -> message fragment; exit 2
REFUSED = {
    "duplicate key at the top": (
        "optim:\n  lr: 1e-3\ntrain:\n  max_steps: 2\noptim:\n  weight_decay: 0.0\n",
        [],
        r"dup.yaml: key 'optim' is given twice \(lines 1 and 5\)",
    ),
    "duplicate key in a section": (
        "data:\n  task: addition\n  num_train: 10\n  num_train: 20\n",
        [],
        r"dup.yaml: key 'data.num_train' is given twice \(lines 3 and 4\)",
    ),
    "duplicate key in an override": (
        None,
        ["data.task=addition", "data.columns={prompt: a, prompt: b}"],
        r"override 'data.columns=.*': key 'prompt' is given twice",
    ),
    "empty file": ("", [], r"dup.yaml is empty \(or only comments\): it sets no key"),
    "comments only": ("# optim:\n#   lr: 1e-3\n", [], r"is empty \(or only comments\)"),
    "a list at the top": ("- optim\n- train\n", [], r"must hold a mapping .* not a list"),
    "a list for a section": (
        "optim: [1e-3, 2]\n",
        ["data.task=addition"],
        r"config section 'optim' must be a mapping of its keys, e.g. 'optim: \{lr: \.\.\.\}'",
    ),
    "a word for a section": (None, ["data.task=addition", "optim=adamw"], r"config section 'optim' must be a mapping"),
    "an empty value": (
        "optim:\n  lr:\n",
        ["data.task=addition"],
        r"config key 'optim.lr': expected float, got an empty value \(null\)",
    ),
    "a list for the column map": (
        None,
        ["data.path=x.jsonl", "data.columns=[prompt, question]"],
        r"'data.columns': expected mapping .* got a list",
    ),
    "a misspelt column name": (
        None,
        ["data.path=x.jsonl", "data.columns={promt: question}"],
        r"unknown config key 'data.columns.promt'. Did you mean: data.columns.prompt\? "
        r"Valid keys here: completion, messages, prompt",
    ),
    "a misspelt column name, dotted": (
        None,
        ["data.path=x.jsonl", "data.columns.complettion=a"],
        r"Did you mean: data.columns.completion\?",
    ),
    "no space after a colon in a mapping": (
        None,
        ["data.path=x.jsonl", "data.columns={prompt:question}"],
        r"YAML needs a space after the colon, 'prompt: question'",
    ),
    "no space after a colon in a file": (
        "data:\n  task: addition\noptim:\n  lr:1e-4\n",
        [],
        r"got 'lr:1e-4' \(YAML needs a space after the colon: 'lr: 1e-4'\)",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_careless_config_is_exit_2_with_a_message_naming_it(case, tmp_path, capsys, monkeypatch):
    text, overrides, fragment = REFUSED[case]
    monkeypatch.chdir(tmp_path)
    args = ["sft"]
    if text is not None:
        (tmp_path / "dup.yaml").write_text(text)
        args.append(str(tmp_path / "dup.yaml"))
    assert main(args + overrides + [f"train.output_dir={tmp_path / 'run'}"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert re.search(fragment, err), err
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize(
    "config_cls, overrides, fragment",
    [
        (SFTConfig, ["data.path=x.jsonl", "data.columns={prompt: q, completions: a}"], "data.columns.completion?"),
        (GRPOConfig, ["data.path=x.jsonl", "data.columns={prompt: q, anwser: a}"], "data.columns.answer?"),
        (PretrainConfig, ["data.path=x.jsonl", "data.columns={txt: body}"], "data.columns.text?"),
        (AntidistillConfig, ["data.path=x.jsonl", "data.columns={promt: q}"], "data.columns.prompt?"),
    ],
)
def test_every_recipe_refuses_a_column_name_it_does_not_read(config_cls, overrides, fragment):
    """Before, the misspelt name was carried into the rows and the real column silently went unused."""
    with pytest.raises(ConfigError, match="unknown config key") as err:
        load_config(config_cls, None, overrides)
    assert f"Did you mean: {fragment}" in str(err.value)


# YAML 1.1 (PyYAML's default) read on/off/yes/no as booleans and 1e-4 as a string; what was meant:
READ_AS_MEANT = [
    ("train:\n  gradient_checkpointing: on\n", lambda c: c.train.gradient_checkpointing, "on"),
    ("train:\n  gradient_checkpointing: off\n", lambda c: c.train.gradient_checkpointing, "off"),
    ("data:\n  use_chat_template: off\n", lambda c: c.data.use_chat_template, "off"),
    ("logging:\n  progress: off\n", lambda c: c.logging.progress, False),
    ("logging:\n  progress: yes\n", lambda c: c.logging.progress, True),
    ("logging:\n  tensorboard: True\n", lambda c: c.logging.tensorboard, True),
    ("optim:\n  lr: 1e-4\n", lambda c: c.optim.lr, 1e-4),
    ("train:\n  max_steps: 1e3\n", lambda c: c.train.max_steps, 1000),
    ("train:\n# every key commented out\n", lambda c: c.train.max_steps, 200),  # an empty section: the defaults
]


@pytest.mark.parametrize("text, get, expected", READ_AS_MEANT)
def test_yaml_scalars_are_read_as_meant(text, get, expected, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    cfg = load_config(SFTConfig, path, ["data.task=addition"])
    assert get(cfg) == expected and type(get(cfg)) is type(expected)


def test_on_off_on_the_command_line_and_numbers_inside_free_form_settings():
    cfg = load_config(SFTConfig, None, ["data.task=addition", "train.gradient_checkpointing=on"])
    assert cfg.train.gradient_checkpointing == "on"  # docs/training.md's own example was an error before
    cfg = load_config(GRPOConfig, None, ["data.task=addition", "rewards.functions=[{name: format, scale: 1e-4}]"])
    assert cfg.rewards.functions[0]["scale"] == 1e-4  # a reward's kwargs: a float, not the string '1e-4'


def test_a_json_file_holding_one_object_says_so_instead_of_blaming_line_1(tmp_path, capsys):
    """A pretty-printed {"rows": [...]} .json file: before, only 'line 1: invalid JSON'."""
    path = tmp_path / "rows.json"
    path.write_text('{\n  "rows": [{"prompt": "1+1=", "completion": "2"}]\n}\n')
    assert main(["sft", f"data.path={path}", f"train.output_dir={tmp_path / 'run'}"]) == EXIT_USER_ERROR
    assert "The file is one JSON object (keys 'rows'), not rows" in capsys.readouterr().err


# (command line) -> message fragment, exit 2; before: "no SFT rows to tokenize", an internal error
# (exit 1, "a bug in lmforge"), and JSON syntax pretrained on as text
DATA_SETTINGS = {
    "sft: a percentage for a fraction": (
        ["sft", "data.path=x.jsonl", "data.val_fraction=5"],
        r"data.val_fraction must be in \[0, 1\) .*got 5.0",
    ),
    "pretrain: a percentage for a fraction": (
        ["pretrain", "data.files=[x.txt]", "data.val_fraction=5"],
        r"data.val_fraction must be in \[0, 1\)",
    ),
    "antidistill: a percentage for a fraction": (
        ["antidistill", "distill", "distill.val_fraction=2"],
        r"distill.val_fraction must be in \[0, 1\)",
    ),
    "pretrain: a dataset file among the text files": (
        ["pretrain", "data.files=[{tmp}/rows.jsonl]"],
        r"rows.jsonl: data.files takes plain text files, and this is a "
        r"dataset file; read its text column with data.path=",
    ),
}


@pytest.mark.parametrize("case", list(DATA_SETTINGS))
def test_careless_data_settings_are_exit_2_with_the_fix(case, tmp_path, capsys, monkeypatch):
    args, fragment = DATA_SETTINGS[case]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.jsonl").write_text('{"text": "1+1=2"}\n' * 50)
    args = [a.format(tmp=tmp_path) for a in args]
    if args[0] == "antidistill":
        args += [f"run.workdir={tmp_path / 'work'}", "distill.max_steps=1"]
    else:
        args += [
            "model.tokenizer=char:ascii",
            "train.max_steps=1",
            "logging.progress=false",
            f"train.output_dir={tmp_path / 'run'}",
        ]
    assert main(args) == EXIT_USER_ERROR
    assert re.search(fragment, capsys.readouterr().err)


@pytest.mark.parametrize(
    "line, key",
    [
        ('{"prompt": "1+1=", "completion": "2", "prompt": "3+3="}', "prompt"),
        (
            '{"messages": [{"role": "user", "content": "a", "content": "b"}, {"role": "assistant", "content": "c"}]}',
            "content",
        ),
    ],
)
def test_a_key_given_twice_in_a_jsonl_row_names_the_line(line, key, tmp_path):
    """The data-file side of the duplicate-key class: json kept the last value silently."""
    from lmforge.core.errors import DataError
    from lmforge.data.sft import load_sft_rows

    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "1+1=", "completion": "2"}\n' + line + "\n")
    with pytest.raises(DataError, match=rf"rows.jsonl:2: key '{key}' is given twice in one object"):
        load_sft_rows(path)
