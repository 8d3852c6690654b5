"""lmforge COMMAND: each command is a thin call into a recipe.

    lmforge quickstart                         the embedded default: tiny model, SFT then GRPO, no network
    lmforge pretrain CONFIG [key=value ...]    train on packed text
    lmforge sft CONFIG [key=value ...]         supervised fine-tuning
    lmforge grpo CONFIG [key=value ...]        RL: GRPO / Dr. GRPO / DAPO / GSPO / RLOO
    lmforge ppo CONFIG [key=value ...]         RL: PPO with a value head and GAE
    lmforge antidistill STAGE CONFIG [...]     antidistillation pipeline (traces, grad, sample, distill, eval, report, all)
    lmforge serve MODEL [--port N ...]         OpenAI-compatible HTTP server with batching and weight updates
    lmforge hardware                           what was detected and what would be chosen
    lmforge plot RUN_DIR                       PNG of the run's curves
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Callable

from .config import describe, load_config
from .errors import LmforgeError


def _options_epilog(config_cls) -> str:
    rows = describe(config_cls)
    width = max(len(k) for k, _, _ in rows)
    lines = ["options (set in the YAML file or as key=value after it):"]
    for key, default, text in rows:
        lines.append(f"  {key:<{width}}  {text} [default: {default}]")
    return "\n".join(lines)


def _config_command(sub, name: str, help_text: str, config_cls, runner: Callable) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text,
                            epilog=_options_epilog(config_cls),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="YAML config file (optional: every key has a default)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4 train.max_steps=100")

    def run(args) -> None:
        config, overrides = args.config, list(args.overrides)
        if config and "=" in config and not config.endswith((".yaml", ".yml")):
            config, overrides = None, [config] + overrides
        runner(load_config(config_cls, config, overrides))

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


def _plot(args) -> None:
    from .metrics import plot_run

    print(plot_run(args.run_dir, args.out))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmforge", description=textwrap.dedent(__doc__ or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text, config_cls, runner in _recipes():
        _config_command(sub, name, help_text, config_cls, runner)
    _antidistill(sub)
    from .serve.command import add_parser as add_serve_parser

    add_serve_parser(sub)
    hw = sub.add_parser("hardware", help="print detected hardware and the automatic choices")
    hw.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] | mps")
    hw.set_defaults(func=_hardware)
    plot = sub.add_parser("plot", help="write a PNG of loss / lr / accuracy curves of a run")
    plot.add_argument("run_dir", help="run directory holding metrics.jsonl")
    plot.add_argument("--out", default=None, help="output PNG (default RUN_DIR/curves.png)")
    plot.set_defaults(func=_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        args.func(args)
    except (LmforgeError, FileNotFoundError, ImportError) as exc:
        print(f"lmforge {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lmforge {args.command}: interrupted; completed checkpoints are intact", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
