"""``lmforge serve MODEL``: argument parsing and start-up (the CLI calls ``add_parser``)."""

from __future__ import annotations

import argparse
import os

DTYPES = ("bfloat16", "float16", "float32")  # names of torch dtypes (torch is imported to run, not to parse)


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions) with batching and weight updates",
        description="Serve MODEL over an OpenAI-compatible HTTP API (docs/serving.md).",
    )
    parser.add_argument(
        "model",
        help="model spec, as model.name: tiny:llama | HF dir | hub id | file.gguf | "
        "smollm2-135m-instruct | an lmforge checkpoint dir (holding model/)",
    )
    parser.add_argument("--tokenizer", default="", help="tokenizer spec (default: the model's own)")
    parser.add_argument(
        "--name",
        default=None,
        help="model id reported by /v1/models (default: MODEL); a "
        "request's `model` may be this name or MODEL (or absent), any other is a 404",
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] | mps")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weights' dtype while serving")
    parser.add_argument("--max-batch-rows", type=int, default=64, help="most sequences decoded in one step")
    parser.add_argument(
        "--gather-ms",
        type=float,
        default=5.0,
        help="an idle server waits this long after a request for others to batch with it",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: as torch chooses)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("LMFORGE_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
        "(default: $LMFORGE_API_KEY; unset: no check)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (warning: no line per request)",
    )
    parser.set_defaults(func=run)


def _model_spec(spec: str) -> str:
    """An lmforge checkpoint directory (``step-N/``, ``final/``) holds its HF model in ``model/``."""
    from pathlib import Path

    path = Path(spec)
    return str(path / "model") if path.is_dir() and (path / "model" / "config.json").is_file() else spec


def run(args: argparse.Namespace) -> None:
    import torch

    from ..core.config import ModelConfig
    from ..model.load import load_model
    from ..runtime.hardware import detect
    from .app import ServedModel, _require_fastapi, run_server

    _require_fastapi()  # fail before loading a model
    if args.threads:
        torch.set_num_threads(args.threads)
    device = detect(args.device).device
    model, tokenizer = load_model(
        ModelConfig(name=_model_spec(args.model), tokenizer=args.tokenizer), dtype=getattr(torch, args.dtype)
    )
    served = ServedModel(
        model.to(device),
        tokenizer,
        args.name or args.model,
        max_batch_rows=args.max_batch_rows,
        gather_s=args.gather_ms / 1000,
        aliases=(args.model,),
    )
    print(
        f"lmforge serve: {args.name or args.model} on {device} ({args.dtype}), context {served.max_model_len} "
        f"tokens, up to {args.max_batch_rows} rows per step, http://{args.host}:{args.port}/v1",
        flush=True,
    )
    run_server(served, host=args.host, port=args.port, log_level=args.log_level, api_key=args.api_key)
