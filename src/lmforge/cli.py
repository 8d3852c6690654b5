"""lmforge COMMAND: each command is a thin call into a recipe (or a pipeline of recipes).

lmforge quickstart                         the embedded default: tiny model, SFT then GRPO, no network
lmforge pretrain CONFIG [key=value ...]    train on packed text
lmforge sft CONFIG [key=value ...]         supervised fine-tuning
lmforge grpo CONFIG [key=value ...]        RL: GRPO / Dr. GRPO / DAPO / GSPO / RLOO
lmforge ppo CONFIG [key=value ...]         RL: PPO with a value head and GAE
lmforge dpo CONFIG [key=value ...]         preference pairs: DPO / IPO / SimPO
lmforge rm CONFIG [key=value ...]          a reward model (Bradley-Terry) on preference pairs
lmforge distill CONFIG [key=value ...]     distillation: on-policy (reverse KL on the student's samples) or logit
lmforge antidistill STAGE CONFIG [...]     antidistillation pipeline (traces, grad, sample, distill, eval, report, all)
lmforge export RUN_DIR --out DIR           a checkpoint as an HF directory (gathers FSDP2 shards, merges LoRA)
lmforge serve MODEL [--port N ...]         OpenAI-compatible HTTP server with batching and weight updates
lmforge hardware                           what was detected and what would be chosen
lmforge plot RUN_DIR                       PNG of the run's curves
lmforge quantize MODEL --format F --out DIR   quantized checkpoint (compressed-tensors, GGUF, ternary)
lmforge dequantize DIR --out HF_DIR        a quantized checkpoint back to a plain HF directory
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import tempfile
import textwrap
import time
import traceback
from pathlib import Path
from typing import Callable

from .core import confighelp
from .core.config import describe, load_config
from .core.errors import Interrupted, LmforgeError, describe_errno, environment_errno

# The exit codes (docs/reliability.md): one mapping for every command, in one process and under torchrun.
EXIT_USER_ERROR = 2  # config, data, model, paths, a missing extra, the machine (disk full, permissions): LmforgeError
EXIT_INTERNAL_ERROR = 1  # anything else: a bug, reported with a traceback log
# SIGINT / SIGTERM: 128 + the signal's number (130, 143), the shell's convention: Interrupted.exit_code
OWN_SIGNAL_HANDLING = {"serve"}  # commands that handle SIGINT / SIGTERM themselves


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions and epilogs as written; every option's default after its help text (unless the
    text already says what the default is, or there is none)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS, False) and action.nargs == 0:
            return text
        if action.default is None:
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose subcommands use :class:`HelpFormatter` too (subparsers are built with
    the parent's class). ``epilog_of``: a function giving the epilog, called only when help is printed."""

    def __init__(self, *args, epilog_of: Callable[[], str] | None = None, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.epilog_of = epilog_of

    def format_help(self) -> str:
        if self.epilog_of is not None:
            self.epilog, self.epilog_of = self.epilog_of(), None
        return super().format_help()


def _option_rows(module: str, config: str) -> list[tuple[str, str, str]]:
    """``describe`` of the config class ``config`` of ``lmforge.<module>`` (``recipes.sft``, ...), read from the
    source (no torch import: lmforge.core.confighelp); imported and described where the reader cannot follow it."""
    try:
        return confighelp.option_rows(module, config)
    except (confighelp.Unreadable, OSError, SyntaxError):
        return describe(getattr(importlib.import_module(f".{module}", __package__), config))


def _options_epilog(module: str, config: str) -> str:
    rows = _option_rows(module, config)
    width = max(len(k) for k, _, _ in rows)
    lines = ["options (set in the YAML file or as key=value after it):"]
    for key, default, text in rows:
        lines.append(f"  {key:<{width}}  {text} [default: {default}]")
    return "\n".join(lines)


def _config_command(sub, name: str, help_text: str, module: str, config: str, runner: Callable) -> None:
    """``lmforge NAME [CONFIG] [key=value ...]``: the config class ``config`` of ``lmforge.<module>``
    loaded and given to ``runner(recipe module)(cfg)``; the module (and torch) is imported only to run."""
    parser = sub.add_parser(
        name, help=help_text, description=help_text, epilog_of=lambda: _options_epilog(module, config)
    )
    parser.add_argument("config", nargs="?", help="YAML config file (optional: every key has a default)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4 train.max_steps=100")

    def run(args) -> None:
        config_path, overrides = args.config, list(args.overrides)
        if config_path and "=" in config_path and not config_path.endswith((".yaml", ".yml")):
            config_path, overrides = None, [config_path] + overrides
        recipe = importlib.import_module(f".{module}", __package__)
        cfg = load_config(getattr(recipe, config), config_path, overrides)
        train = getattr(cfg, "train", None)
        args.run_dir = getattr(train, "output_dir", None) or getattr(cfg, "output_dir", None)  # for an error log
        runner(recipe)(cfg)

    parser.set_defaults(func=run)


# command: (help text, its module under lmforge (a recipe, or a pipeline of recipes), the config class and the run
# function there)
RECIPES = {
    "quickstart": (
        "train a tiny model on synthetic addition (SFT, then GRPO), offline, in minutes",
        "pipelines.quickstart",
        "QuickstartConfig",
        "run_quickstart",
    ),
    "pretrain": (
        "train a model on packed raw text (optionally its own BPE tokenizer)",
        "recipes.pretrain",
        "PretrainConfig",
        "run_pretrain",
    ),
    "sft": ("supervised fine-tuning with a completion-only loss", "recipes.sft", "SFTConfig", "run_sft"),
    "grpo": (
        "RL from verifiable rewards: GRPO and its variants (Dr. GRPO, DAPO, GSPO, RLOO)",
        "recipes.grpo",
        "GRPOConfig",
        "run_grpo",
    ),
    "ppo": ("RL from verifiable rewards: PPO with a value head and GAE", "recipes.ppo", "PPOConfig", "run_ppo"),
    "dpo": (
        "preference optimisation on prompt / chosen / rejected pairs: DPO, IPO, SimPO",
        "recipes.dpo",
        "DPOConfig",
        "run_dpo",
    ),
    "rm": (
        (
            "a reward model (Bradley-Terry) on prompt / chosen / rejected pairs, saved for "
            "AutoModelForSequenceClassification"
        ),
        "recipes.rm",
        "RMConfig",
        "run_rm",
    ),
    "distill": (
        (
            "distillation from a teacher: on-policy (per-token reverse KL on the student's samples) or "
            "logit (forward KL at a temperature on fixed data)"
        ),
        "recipes.distill",
        "DistillConfig",
        "run_distill",
    ),
}
# the listed help of the commands whose parser is built by a function of its own (tests/recipes/test_cli.py
# checks it against the built command's)
ANTIDISTILL_HELP = "antidistillation sampling pipeline: traces, grad, sample, distill, eval, report (or all)"
SERVE_HELP = "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions) with batching and weight updates"
QUANTIZE_HELP = "write a quantized checkpoint (compressed-tensors, GGUF, ternary)"


class Commands(argparse._SubParsersAction):
    """Subcommands whose parsers are built when one is chosen: building one reads sources (a config's options,
    a table of formats: lmforge.core.confighelp), which ``lmforge --help`` and ``--version`` need not wait for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.builders: dict[str, Callable] = {}

    def add_command(self, name: str, help_text: str, build: Callable) -> None:
        """List ``name`` with ``help_text``; ``build(self)`` adds its real parser once it is chosen."""
        self.add_parser(name, help=help_text)
        self.builders[name] = build

    def build(self, name: str) -> None:
        build = self.builders.pop(name, None)
        if build is not None:
            del self._name_parser_map[name]
            listed = [action.dest for action in self._choices_actions].index(name)
            self._choices_actions.pop(listed)
            build(self)
            self._choices_actions.insert(listed, self._choices_actions.pop())  # listed where it was

    def build_all(self) -> None:
        for name in list(self.builders):
            self.build(name)

    def __call__(self, parser, namespace, values, option_string=None):
        self.build(values[0])
        super().__call__(parser, namespace, values, option_string)


def _recipe(sub, name: str) -> None:
    help_text, module, config, runner = RECIPES[name]
    _config_command(sub, name, help_text, module, config, lambda recipe: getattr(recipe, runner))


def _antidistill(sub) -> None:
    """``lmforge antidistill <stage> CONFIG``: one subcommand per pipeline stage, sharing one config."""
    try:  # {stage: help text} of pipelines.antidistill.STAGES, read without importing it (nor torch)
        stage_help = confighelp.mapping_heads("pipelines.antidistill", "STAGES")
    except (confighelp.Unreadable, OSError, SyntaxError):
        from .pipelines.antidistill import STAGES

        stage_help = {name: help_text for name, (help_text, _) in STAGES.items()}
    parser = sub.add_parser("antidistill", help=ANTIDISTILL_HELP, description="antidistillation sampling pipeline")
    stages = parser.add_subparsers(dest="stage", metavar="STAGE", required=True)
    for name, help_text in stage_help.items():
        _config_command(
            stages,
            name,
            help_text,
            "pipelines.antidistill",
            "AntidistillConfig",
            lambda recipe, name=name: recipe.STAGES[name][1],
        )


def _hardware(args) -> None:
    from .runtime import hardware

    hw = hardware.detect(args.device)
    print(hardware.describe(hw))
    choices = hardware.choose(hw)
    choices.report()
    print(f"measured fp32 matmul peak: {hardware.matmul_peak_gflops(device=hw.device):.0f} GFLOP/s")
    from .quantize.tiers import tier_report

    on_accel = hw.accel_mem_gb > 0
    memory = (hw.accel_mem_gb if on_accel else hw.ram_gb) * 2**30
    print("\n".join(tier_report(memory, f"{hw.accelerator} memory" if on_accel else "RAM")))


def _export(args) -> None:
    from .runtime.checkpoint import export_checkpoint, latest_or_given

    source = latest_or_given(Path(args.run_dir))  # the run's newest checkpoint, or the one named
    out = export_checkpoint(source, args.out)
    print(f"wrote {out} (a Hugging Face model directory) from checkpoint {source}")


def _plot(args) -> None:
    from .runtime.metrics import plot_run

    print(plot_run(args.run_dir, args.out))


def _quantize(sub) -> None:
    """``lmforge quantize`` (see lmforge.quantize)."""

    def run_quantize(args) -> None:
        from .quantize import quantize

        result = quantize(args.model, args.format, args.out)
        print(
            f"wrote {args.format} to {args.out}: {result.num_bytes / 2**20:.2f} MiB in "
            f"{result.seconds:.1f} s ({', '.join(f.name for f in result.files)})"
        )

    try:  # quantize.catalog's table, read without importing the package (its writers import torch)
        descriptions = confighelp.constant("quantize.catalog", "DESCRIPTIONS")
    except (confighelp.Unreadable, OSError, SyntaxError):
        from .quantize.catalog import DESCRIPTIONS as descriptions
    formats = "\n".join(f"  {name:<14} {text}" for name, text in descriptions.items())
    q = sub.add_parser("quantize", help=QUANTIZE_HELP, epilog="formats:\n" + formats)
    q.add_argument("model", help="HF directory, a run's final/ directory, a .gguf file or smollm2-135m-instruct")
    q.add_argument("--format", required=True, metavar="F", help="one of the formats listed below")
    q.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    q.set_defaults(func=run_quantize)


def _dequantize(args) -> None:
    from .quantize import dequantize

    print(f"wrote {dequantize(args.source, args.out)}")


def _serve(sub) -> None:
    from .serve.command import add_parser

    add_parser(sub)


def build_parser(complete: bool = False) -> argparse.ArgumentParser:
    """The ``lmforge`` parser; a command's own parser is built when it is chosen (or now, if ``complete``)."""
    from . import __version__

    parser = Parser(prog="lmforge", description=textwrap.dedent(__doc__ or ""))
    parser.add_argument(
        "--version", action="version", version=f"lmforge {__version__}", help="print lmforge's version and exit"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", action=Commands)
    for name, (help_text, *_) in RECIPES.items():
        sub.add_command(name, help_text, lambda sub, name=name: _recipe(sub, name))
    sub.add_command("antidistill", ANTIDISTILL_HELP, _antidistill)
    sub.add_command("serve", SERVE_HELP, _serve)
    hw = sub.add_parser("hardware", help="print detected hardware and the automatic choices")
    hw.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] | mps")
    hw.set_defaults(func=_hardware)
    export = sub.add_parser(
        "export",
        help="write a checkpoint (the newest of RUN_DIR, or CHECKPOINT) as an HF model directory; gathers FSDP2 shards",
        description="consolidate a checkpoint into a Hugging Face model directory (safetensors + config + tokenizer)",
    )
    export.add_argument("run_dir", help="run directory (its newest checkpoint) or a checkpoints/step-N directory")
    export.add_argument(
        "--out", required=True, help="output directory: new, empty, or an earlier export (replaced atomically)"
    )
    export.set_defaults(func=_export)
    plot = sub.add_parser("plot", help="write a PNG of loss / lr / accuracy curves of a run")
    plot.add_argument("run_dir", help="run directory holding metrics.jsonl")
    plot.add_argument("--out", default=None, help="output PNG (default RUN_DIR/curves.png)")
    plot.set_defaults(func=_plot)
    sub.add_command("quantize", QUANTIZE_HELP, _quantize)
    d = sub.add_parser("dequantize", help="turn a quantized checkpoint back into a plain HF directory")
    d.add_argument("source", help="a directory written by `lmforge quantize`, or a .gguf file")
    d.add_argument("--out", required=True, help="output HF directory (must not exist or be empty)")
    d.set_defaults(func=_dequantize)
    if complete:
        sub.build_all()
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    from .runtime import hardware

    hardware.prepare_process()  # the load at start, and the OpenMP wait policy before torch loads OpenMP
    from .parallel.context import (
        disarm_signals,
        end_process_group,
        ignore_signals,
        install_signal_handlers,
        restore_signal_handlers,
        torchrun_world,
    )

    # SIGTERM stops a command like SIGINT, in one process and under torchrun; serve's server (uvicorn)
    # shuts down gracefully on both by itself and exits 0
    previous = install_signal_handlers() if args.command not in OWN_SIGNAL_HANDLING else {}
    try:
        args.func(args)
    except BaseException as exc:  # noqa: BLE001 - every way a command ends is mapped to its exit code here
        disarm_signals()  # a signal during the report is noted, never a second traceback
        return report(args, argv, exc)
    finally:
        try:
            end_process_group()
        except Exception:  # noqa: BLE001 - a peer already gone makes the teardown fail: nothing to report
            pass
        if torchrun_world()[1] > 1:  # a rank's run is over: torchrun's SIGTERM must not replace its exit code
            ignore_signals()
        else:
            restore_signal_handlers(previous)
    return 0


def report(args, argv: list[str] | None, exc: BaseException) -> int:
    """Print ``exc`` as its kind deserves (once under torchrun) and return the exit code."""
    from .parallel.context import is_peer_loss, peers_note, rank_prefix, should_report, stall_note

    name = f"lmforge {args.command}"
    if isinstance(exc, SystemExit):
        raise exc
    if isinstance(exc, (Interrupted, KeyboardInterrupt)):
        signum = exc.signum if isinstance(exc, Interrupted) else 2
        gone = peers_note()
        if should_report(exc):
            why = f"; {gone} (torchrun stops every rank when one fails)" if gone else ""
            print(
                f"{name}: {rank_prefix()}stopped by {signal.Signals(signum).name}{why}; completed checkpoints "
                f"are intact "
                "and nothing half-written is left (resume with train.resume=auto)",
                file=sys.stderr,
            )
        return Interrupted(signum).exit_code
    if not isinstance(exc, LmforgeError) and is_peer_loss(exc):
        who = (
            stall_note(exc)
            or peers_note(wait_s=2.0)
            or (  # a rank that never came, one that is gone
                "another rank stopped or lost contact (torchrun's summary names it and its exit code or signal)"
            )
        )
        if should_report(exc):  # after peers_note: a rank 0 that is gone is known to be gone
            print(
                f"{name}: {rank_prefix()}stopping: {who}. Completed checkpoints are intact (resume with "
                "train.resume=auto)",
                file=sys.stderr,
            )
        return EXIT_USER_ERROR
    if isinstance(exc, (LmforgeError, FileNotFoundError, ImportError)):
        if should_report(exc):  # under torchrun: once, not once per rank
            print(f"{name}: error: {rank_prefix()}{exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    if not isinstance(exc, Exception):
        raise exc
    code = environment_errno(exc)  # disk full, permissions, read-only: the machine, not lmforge
    if code is not None:
        if should_report(exc):
            print(f"{name}: error: {rank_prefix()}{describe_errno(code)}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    return _internal_error(args, argv, exc)


def _internal_error(args, argv: list[str] | None, exc: Exception) -> int:
    from .parallel.context import rank_prefix, should_report

    command = "lmforge " + " ".join(sys.argv[1:] if argv is None else argv)
    log = write_error_log(getattr(args, "run_dir", None), command, exc)
    if should_report(exc):
        summary = (str(exc).strip().splitlines() or [""])[0]
        notes = "".join(f"\n  {note}" for note in getattr(exc, "__notes__", ()))
        print(
            f"lmforge {args.command}: internal error: {rank_prefix()}{type(exc).__name__}: {summary}{notes}\n"
            f"  full traceback: {log}\n  this is a bug in lmforge: please report it to the maintainers, "
            "with that file attached",
            file=sys.stderr,
        )
    return EXIT_INTERNAL_ERROR


def write_error_log(run_dir: str | None, command: str, exc: BaseException) -> str:
    """Write ``command`` and ``exc``'s full traceback to ``run_dir/lmforge-error-<time>.log`` (a
    temporary file when ``run_dir`` is unknown, not a directory or not writable); return its path, or
    a note that no file could be written (then the traceback goes to stderr)."""
    from .parallel.context import torchrun_world

    rank, world, _ = torchrun_world()
    name = f"lmforge-error-{time.strftime('%Y%m%d-%H%M%S')}{f'-rank{rank}' if world > 1 else ''}"
    text = f"{command}\n\n{''.join(traceback.format_exception(exc))}"
    if run_dir and Path(run_dir).is_dir():
        try:
            path = Path(run_dir) / f"{name}.log"
            path.write_text(text)
            return str(path)
        except OSError:
            pass  # e.g. the disk is full or read-only: try a temporary file
    try:
        handle, temp = tempfile.mkstemp(prefix=name + "-", suffix=".log")
        with os.fdopen(handle, "w") as f:
            f.write(text)
        return temp
    except OSError as exc:
        print(text, file=sys.stderr)
        return f"(none: cannot write a log file: {exc}; the traceback is printed above)"


if __name__ == "__main__":
    sys.exit(main())
