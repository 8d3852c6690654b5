"""The command line: help texts, clear errors, and tiny pretrain / plot runs end to end."""
import json
import re
import subprocess
import sys

import pytest

from lmforge.cli import build_parser, main


def help_text(capsys, *args) -> str:
    """``lmforge ARGS --help`` in this process: argparse prints the help and exits with 0."""
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_help_lists_commands_and_options(capsys):
    top = help_text(capsys)
    for command in ("quickstart", "pretrain", "sft", "grpo", "ppo", "antidistill", "hardware", "plot"):
        assert re.search(rf"^    {command}\b", top, re.MULTILINE), command  # listed as a subcommand
    for command, option in (("quickstart", "sft_steps"), ("pretrain", "tokenizer.vocab_size"), ("sft", "optim.lr"),
                            ("grpo", "algo.preset"), ("ppo", "algo.value_coef"), (("antidistill", "sample"), "sample.lams")):
        text = help_text(capsys, *([command] if isinstance(command, str) else command))
        assert f"  {option} " in text and "[default:" in text, (command, option)
    assert main([]) == 0 and "usage: lmforge" in capsys.readouterr().out  # no command: the help, exit 0


def test_console_script_entry_point_runs():
    # one subprocess: `python -m lmforge.cli` as the installed `lmforge` script runs it
    proc = subprocess.run([sys.executable, "-m", "lmforge.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "lmforge" in proc.stdout, proc.stderr


# the commands whose help needs no torch yet: the recipes' config classes, lmforge.serve and the quantize
# formats are defined in modules that import torch (issue 38)
LIGHT_HELP = [["--version"], ["--help"], ["hardware", "--help"], ["export", "--help"], ["plot", "--help"],
              ["dequantize", "--help"], ["serve", "--help"]]


def test_version_and_help_import_no_torch():
    # `lmforge --version` / `--help` in a fresh process: importing torch and transformers takes seconds
    script = ("import contextlib, io, sys\nfrom lmforge.cli import main\n"
              f"for argv in {LIGHT_HELP!r}:\n"
              "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
              "        main(argv)\n"
              "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", (proc.stdout, proc.stderr)


def test_listed_help_is_the_built_commands_help():
    # the listing of `lmforge --help` is built before the commands are: it says what they say
    assert build_parser().format_help() == build_parser(complete=True).format_help()


def test_unknown_key_exits_with_suggestion(capsys):
    code = main(["sft", "data.task=addition", "train.max_step=3"])
    assert code == 2
    err = capsys.readouterr().err
    assert "unknown config key 'train.max_step'" in err and "train.max_steps" in err


def test_missing_data_file_is_clear(capsys, tmp_path):
    code = main(["sft", f"data.path={tmp_path / 'nope.jsonl'}", f"train.output_dir={tmp_path / 'run'}"])
    assert code == 2
    assert "nope.jsonl" in capsys.readouterr().err


@pytest.mark.real_plots
def test_pretrain_with_own_bpe_then_plot(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    words = "the quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat".split()
    for i in range(12):
        text = " ".join(words[(i + j) % len(words)] for j in range(300))
        (corpus / ("sub" if i % 2 else "") / f"doc{i}.txt").write_text(text)
    out = tmp_path / "run"
    code = main(["pretrain", f"data.files=[{corpus}]", "tokenizer.train=true", "tokenizer.vocab_size=300",
                 "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "data.seq_len=32",
                 "train.max_steps=30", "train.micro_batch_size=8", "train.eval_every=15", "train.save_every=15",
                 "optim.lr=3e-3", "train.num_samples=1", "train.max_new_tokens=8",
                 "logging.progress=false", f"train.output_dir={out}"])
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(train) == 30 and len(evals) == 2
    assert train[-1]["loss"] < train[0]["loss"] - 1.0, "repetitive text must be learned quickly"
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] + 1e-6
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    assert (out / "final" / "model.safetensors").is_file() and (out / "best").is_dir()
    assert (out / "samples.jsonl").is_file() and (out / "summary.json").is_file()
    assert (out / "curves.png").stat().st_size > 1000
    (out / "curves.png").unlink()
    assert main(["plot", str(out)]) == 0 and (out / "curves.png").is_file()
    # A second run into the finished directory is refused before it writes anything: its tokenizer (another
    # vocab_size) used to be saved over the run's own before the refusal.
    saved = (out / "tokenizer" / "tokenizer.json").read_bytes()
    assert main(["pretrain", f"data.files=[{corpus}]", "tokenizer.train=true", "tokenizer.vocab_size=280",
                 "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "data.seq_len=32",
                 "train.max_steps=30", "train.micro_batch_size=8", "logging.progress=false",
                 f"train.output_dir={out}"]) == 2
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == saved


def test_hardware_command(capsys):
    assert main(["hardware"]) == 0
    text = capsys.readouterr().out
    assert "tier=" in text and "micro_batch_size" in text and "GFLOP/s" in text
