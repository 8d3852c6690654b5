"""The CLI describes itself, and the docs cannot drift from it: every option of every command has help
text (with its default), ``lmforge --version`` works, and every ``lmforge ...`` command line quoted
in a code block of README.md or docs/ parses (argparse, then the config keys for the commands that take
a config)."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

import lmforge
from lmforge.cli import build_parser, main
from lmforge.core.config import describe, load_config

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def subcommands(parser: argparse.ArgumentParser, prefix: str = "lmforge"):
    """(name, parser) of ``parser`` and of every subcommand below it."""
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from subcommands(child, f"{prefix} {name}")


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"lmforge {lmforge.__version__}"


def test_every_option_of_every_command_has_help_and_its_default():
    commands = dict(subcommands(build_parser(complete=True)))
    assert {"lmforge serve", "lmforge grpo", "lmforge antidistill sample", "lmforge quantize"} <= set(commands)
    for name, parser in commands.items():
        text = parser.format_help()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"{name}: {action.dest} has no help text"
            if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
                assert "default" in parser._get_formatter()._get_help_string(action), (name, action.dest)
        assert "(default: None)" not in text, name
    for config_cls in _config_classes().values():
        for key, _, help_text in describe(config_cls):
            assert help_text.strip(), f"{config_cls.__name__}: {key} has no help text"


def _config_classes() -> dict[str, type]:
    from lmforge.pipelines.antidistill import AntidistillConfig
    from lmforge.pipelines.quickstart import QuickstartConfig
    from lmforge.recipes.grpo import GRPOConfig
    from lmforge.recipes.ppo import PPOConfig
    from lmforge.recipes.pretrain import PretrainConfig
    from lmforge.recipes.sft import SFTConfig

    return {
        "quickstart": QuickstartConfig,
        "pretrain": PretrainConfig,
        "sft": SFTConfig,
        "grpo": GRPOConfig,
        "ppo": PPOConfig,
        "antidistill": AntidistillConfig,
    }


def quoted_command_lines() -> list[tuple[str, str]]:
    """(where, command) of every ``lmforge ...`` / ``torchrun ... -m lmforge ...`` line in a fenced code
    block of the docs, continuation lines joined, comments dropped."""
    found = []
    for path in DOCS:
        fenced, pending = False, ""
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced, pending = not fenced, ""
                continue
            if not fenced:
                continue
            line = pending + line.strip()
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            pending = ""
            command = re.sub(r"\s+#.*$", "", line)
            command = re.sub(r"^.*?-m lmforge ", "lmforge ", command) if command.startswith("torchrun") else command
            if re.match(r"lmforge [a-z]+(\s|$)", command) and not re.match(r"lmforge [a-z]+:", command):
                found.append((f"{path.relative_to(ROOT)}:{number}", command))
    return found


def test_the_docs_quote_commands():
    lines = [c for _, c in quoted_command_lines()]
    assert len(lines) > 30 and any(c.startswith("lmforge serve") for c in lines)


# what a placeholder in a quoted command stands for: a config file of that command, a shell variable's value
PLACEHOLDER_CONFIGS = {
    "sft": "examples/sft_addition.yaml",
    "grpo": "examples/grpo_addition.yaml",
    "ppo": "examples/ppo_addition.yaml",
    "pretrain": None,
    "quickstart": None,
    "antidistill": None,
}
SHELL_VALUES = {"d": "fp32", "s": "0", "MODEL": "tiny:llama"}


@pytest.mark.parametrize("where, command", quoted_command_lines(), ids=lambda value: value)
def test_every_quoted_command_line_parses(where, command):
    command = re.sub(r"\[key=value \.\.\.\]|\[\.\.\.\]", "", command)
    command = re.sub(r"\$(\w+)", lambda m: SHELL_VALUES.get(m.group(1), "x"), command)
    argv = shlex.split(command)[1:]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse's exit: 0 for --help / --version
        assert exc.code == 0, f"{where}: `{command}` does not parse"
        return
    name = args.command
    if name in _config_classes():
        config = getattr(args, "config", None)
        overrides = list(getattr(args, "overrides", []) or [])
        if config and "=" in config and not config.endswith((".yaml", ".yml")):
            config, overrides = None, [config] + overrides
        path = ROOT / config if config else None
        if path is not None and not path.is_file():  # a placeholder (CONFIG, run.yaml): an example of the command
            path = PLACEHOLDER_CONFIGS[name] and ROOT / PLACEHOLDER_CONFIGS[name]
        load_config(_config_classes()[name], path, overrides)  # an unknown or mistyped key raises ConfigError
