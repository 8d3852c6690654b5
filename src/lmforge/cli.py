"""lmforge COMMAND: each command is a thin call into a recipe.

    lmforge quickstart                         the embedded default: tiny model, SFT then GRPO, no network
    lmforge pretrain CONFIG [key=value ...]    train on packed text
    lmforge sft CONFIG [key=value ...]         supervised fine-tuning
    lmforge grpo CONFIG [key=value ...]        RL: GRPO / Dr. GRPO / DAPO / GSPO / RLOO
    lmforge ppo CONFIG [key=value ...]         RL: PPO with a value head and GAE
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
import errno
import os
import sys
import tempfile
import textwrap
import time
import traceback
from pathlib import Path
from typing import Callable

from .config import describe, load_config
from .errors import LmforgeError

EXIT_USER_ERROR = 2  # bad config, data, model or paths: LmforgeError, FileNotFoundError, a missing extra
EXIT_INTERNAL_ERROR = 1  # anything else: a bug, reported with a traceback log
EXIT_INTERRUPTED = 130
# OSErrors that are about the machine, not lmforge: reported as user errors (exit 2), without a log
ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR,
                      errno.EISDIR, errno.EEXIST}


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
    the parent's class)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def _options_epilog(config_cls) -> str:
    rows = describe(config_cls)
    width = max(len(k) for k, _, _ in rows)
    lines = ["options (set in the YAML file or as key=value after it):"]
    for key, default, text in rows:
        lines.append(f"  {key:<{width}}  {text} [default: {default}]")
    return "\n".join(lines)


def _config_command(sub, name: str, help_text: str, config_cls, runner: Callable) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text, epilog=_options_epilog(config_cls))
    parser.add_argument("config", nargs="?", help="YAML config file (optional: every key has a default)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4 train.max_steps=100")

    def run(args) -> None:
        config, overrides = args.config, list(args.overrides)
        if config and "=" in config and not config.endswith((".yaml", ".yml")):
            config, overrides = None, [config] + overrides
        cfg = load_config(config_cls, config, overrides)
        train = getattr(cfg, "train", None)
        args.run_dir = getattr(train, "output_dir", None) or getattr(cfg, "output_dir", None)  # for an error log
        runner(cfg)

    parser.set_defaults(func=run)


def _recipes() -> list[tuple[str, str, type, Callable]]:
    from .recipes.grpo import GRPOConfig, run_grpo
    from .recipes.ppo import PPOConfig, run_ppo
    from .recipes.pretrain import PretrainConfig, run_pretrain
    from .recipes.quickstart import QuickstartConfig, run_quickstart
    from .recipes.sft import SFTConfig, run_sft

    return [
        ("quickstart", "train a tiny model on synthetic addition (SFT, then GRPO), offline, in minutes",
         QuickstartConfig, run_quickstart),
        ("pretrain", "train a model on packed raw text (optionally its own BPE tokenizer)",
         PretrainConfig, run_pretrain),
        ("sft", "supervised fine-tuning with a completion-only loss", SFTConfig, run_sft),
        ("grpo", "RL from verifiable rewards: GRPO and its variants (Dr. GRPO, DAPO, GSPO, RLOO)",
         GRPOConfig, run_grpo),
        ("ppo", "RL from verifiable rewards: PPO with a value head and GAE", PPOConfig, run_ppo),
    ]


def _antidistill(sub) -> None:
    """``lmforge antidistill <stage> CONFIG``: one subcommand per pipeline stage, sharing one config."""
    from .recipes.antidistill import STAGES, AntidistillConfig

    parser = sub.add_parser("antidistill", help="antidistillation sampling pipeline: traces, grad, sample, "
                            "distill, eval, report (or all)", description="antidistillation sampling pipeline")
    stages = parser.add_subparsers(dest="stage", metavar="STAGE", required=True)
    for name, (help_text, runner) in STAGES.items():
        _config_command(stages, name, help_text, AntidistillConfig, runner)


def _hardware(args) -> None:
    from . import hardware

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
    from .checkpoint import export_checkpoint, latest_or_given

    source = latest_or_given(Path(args.run_dir))  # the run's newest checkpoint, or the one named
    out = export_checkpoint(source, args.out)
    print(f"wrote {out} (a Hugging Face model directory) from checkpoint {source}")


def _plot(args) -> None:
    from .metrics import plot_run

    print(plot_run(args.run_dir, args.out))


def _quant_commands(sub) -> None:
    """``lmforge quantize`` and ``lmforge dequantize`` (see lmforge.quantize)."""
    from .quantize import FORMATS, dequantize, quantize

    def run_quantize(args) -> None:
        result = quantize(args.model, args.format, args.out)
        print(f"wrote {args.format} to {args.out}: {result.num_bytes / 2**20:.2f} MiB in "
              f"{result.seconds:.1f} s ({', '.join(f.name for f in result.files)})")

    formats = "\n".join(f"  {f.name:<14} {f.description}" for f in FORMATS.values())
    q = sub.add_parser("quantize", help="write a quantized checkpoint (compressed-tensors, GGUF, ternary)",
                       epilog="formats:\n" + formats)
    q.add_argument("model", help="HF directory, a run's final/ directory, a .gguf file or smollm2-135m-instruct")
    q.add_argument("--format", required=True, metavar="F", help="one of the formats listed below")
    q.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    q.set_defaults(func=run_quantize)
    d = sub.add_parser("dequantize", help="turn a quantized checkpoint back into a plain HF directory")
    d.add_argument("source", help="a directory written by `lmforge quantize`, or a .gguf file")
    d.add_argument("--out", required=True, help="output HF directory (must not exist or be empty)")
    d.set_defaults(func=lambda args: print(f"wrote {dequantize(args.source, args.out)}"))


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = Parser(prog="lmforge", description=textwrap.dedent(__doc__ or ""))
    parser.add_argument("--version", action="version", version=f"lmforge {__version__}",
                        help="print lmforge's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text, config_cls, runner in _recipes():
        _config_command(sub, name, help_text, config_cls, runner)
    _antidistill(sub)
    from .serve.command import add_parser as add_serve_parser

    add_serve_parser(sub)
    hw = sub.add_parser("hardware", help="print detected hardware and the automatic choices")
    hw.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] | mps")
    hw.set_defaults(func=_hardware)
    export = sub.add_parser("export", help="write a checkpoint (the newest of RUN_DIR, or CHECKPOINT) as an HF "
                            "model directory; gathers FSDP2 shards", description="consolidate a checkpoint into a "
                            "Hugging Face model directory (safetensors + config + tokenizer)")
    export.add_argument("run_dir", help="run directory (its newest checkpoint) or a checkpoints/step-N directory")
    export.add_argument("--out", required=True, help="output directory (replaced atomically)")
    export.set_defaults(func=_export)
    plot = sub.add_parser("plot", help="write a PNG of loss / lr / accuracy curves of a run")
    plot.add_argument("run_dir", help="run directory holding metrics.jsonl")
    plot.add_argument("--out", default=None, help="output PNG (default RUN_DIR/curves.png)")
    plot.set_defaults(func=_plot)
    _quant_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    from .parallel.context import end_process_group, rank_prefix, should_report

    try:
        args.func(args)
    except (LmforgeError, FileNotFoundError, ImportError) as exc:
        if should_report(exc):  # under torchrun: once, not once per rank
            print(f"lmforge {args.command}: error: {rank_prefix()}{exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        if should_report(KeyboardInterrupt()):
            print(f"lmforge {args.command}: interrupted; completed checkpoints are intact", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as exc:
        if exc.errno not in ENVIRONMENT_ERRNOS:
            return _internal_error(args, argv, exc)
        if should_report(exc):  # disk full, permissions, read-only: the machine, not lmforge
            print(f"lmforge {args.command}: error: {rank_prefix()}{exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Exception as exc:  # a bug in lmforge (or a library): keep the traceback, print one line
        return _internal_error(args, argv, exc)
    finally:
        end_process_group()
    return 0


def _internal_error(args, argv: list[str] | None, exc: Exception) -> int:
    from .parallel.context import rank_prefix, should_report

    command = "lmforge " + " ".join(sys.argv[1:] if argv is None else argv)
    log = write_error_log(getattr(args, "run_dir", None), command, exc)
    if should_report(exc):
        summary = (str(exc).strip().splitlines() or [""])[0]
        print(f"lmforge {args.command}: internal error: {rank_prefix()}{type(exc).__name__}: {summary}\n"
              f"  full traceback: {log}\n  this is a bug in lmforge: please report it to the maintainers, "
              "with that file attached", file=sys.stderr)
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
