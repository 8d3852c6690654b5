"""Resuming with changed settings: the resumed run's settings are compared with the run's saved
``config.yaml`` before anything is written, so a run never continues under other values by accident.

A setting that changes the computation (the optimizer, schedule, algorithm, batch and group sizes,
the model, tokenizer, data, seed, ...) and differs from the saved one is a ConfigError listing each
key (old -> new); ``train.resume_accept`` names the keys (or whole sections) to change deliberately.
The settings in :data:`FREE` only decide what is logged, evaluated or saved, when, and how fast the
same computation runs; they may change freely. Every key not listed there is compared, so a key
added later is compared until someone decides otherwise.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Callable

import yaml

from ..checkpoint import STEP_DIR, list_checkpoints
from ..config import describe, parse_yaml, read_yaml, to_dict
from ..errors import ConfigError

# Settings that do not change the math of a step (each section's keys read one by one).
FREE = frozenset({
    # train: where and when things are written, evaluated and printed, and how the same batch is split
    # over micro-batches, threads and the device; gradient checkpointing recomputes the same values;
    # on_nonfinite / max_nonfinite_skips act only on a non-finite step, which they never let through.
    "train.output_dir", "train.max_steps", "train.micro_batch_size", "train.device", "train.threads",
    "train.gradient_checkpointing", "train.eval_every", "train.save_every", "train.keep_last", "train.resume",
    "train.resume_accept", "train.log_every", "train.on_nonfinite", "train.max_nonfinite_skips",
    "train.num_samples", "train.max_new_tokens", "train.save_quantized",
    # parallel: how the same sums are spread over processes (docs/distributed.md)
    "parallel.strategy", "parallel.grad_sync", "parallel.timeout_s",
    # logging: sinks only
    "logging.progress", "logging.tensorboard", "logging.wandb", "logging.wandb_project",
    "model.lora.save_merged",  # an extra copy of the final weights
    # data: evaluation only (SFT validation problems of a task, held-out accuracy); caches
    "data.num_val", "data.pass_k", "data.val_blocks", "data.cache",
    # rollout: memory of the vLLM engine, threads, and where the Atropos servers are / how patiently
    # they are polled (what they return is governed by the compared keys push_every, max_staleness)
    "rollout.vllm_gpu_memory_utilization", "rollout.async_threads", "rollout.api_url", "rollout.server_url",
    "rollout.api_timeout_s", "rollout.push_timeout_s", "rollout.api_poll_s", "rollout.api_retries",
    "rollout.api_backoff_s", "rollout.verifiers_timeout_s",
    "rewards.workers", "rewards.max_failure_fraction",  # parallelism; when to stop on failing rewards
})
UNREPORTED = frozenset({"train.resume", "train.resume_accept", "train.output_dir"})  # differ by design
# data.num_eval is free where it only sizes an evaluation (SFT, tasks); an RL prompts file holds out
# up to num_eval rows from training, so there it changes the training prompts.
FREE_UNLESS_RL_PATH = frozenset({"data.num_eval"})


def flat_settings(cfg: Any) -> dict[str, Any]:
    """Every leaf setting of a config dataclass as {dotted key: value}, values as YAML reads them
    back (so a fresh config compares equal to the saved copy of itself)."""
    leaves = {key for key, _, _ in describe(type(cfg))}
    return _flatten(parse_yaml(yaml.safe_dump(to_dict(cfg), sort_keys=False), "the resolved config"), leaves)


def _flatten(values: dict, leaves: set[str]) -> dict[str, Any]:
    out = {}
    for key in leaves:
        node: Any = values
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            out[key] = node
    return out


def saved_config_of(resume: str, run_dir: Path) -> Path | None:
    """The ``config.yaml`` of the run a resume continues, or None when nothing will be resumed:
    ``auto`` -> ``run_dir``'s (if it holds checkpoints); a checkpoint path -> that run's."""
    if not resume:
        return None
    if resume == "auto":
        return run_dir / "config.yaml" if list_checkpoints(run_dir) else None
    checkpoint = Path(resume)
    if STEP_DIR.match(checkpoint.name) and checkpoint.parent.name == "checkpoints":
        return checkpoint.parent.parent / "config.yaml"
    return checkpoint / "config.yaml"  # a checkpoint copied elsewhere: its config only if it sits beside it


def is_free(key: str, rl_path: bool) -> bool:
    return key in FREE or (key in FREE_UNLESS_RL_PATH and not rl_path)


def check_resume_settings(cfg: Any, run_dir: Path, say: Callable[[str], None]) -> None:
    """Compare ``cfg`` (resolved) with the saved config of the run it resumes (module doc).

    Raises ConfigError listing the changed settings that change the computation and are not in
    ``train.resume_accept``; prints the accepted and the free changes. Does nothing for a fresh run.
    """
    train = cfg.train
    saved_path = saved_config_of(train.resume, Path(run_dir))
    if saved_path is None:
        return
    new = flat_settings(cfg)
    accept = _checked_accept(list(getattr(train, "resume_accept", [])), new)
    if not saved_path.is_file():
        say(f"[resume] no saved config at {saved_path}: the settings cannot be compared with the run's; "
            "make sure they are the ones it ran with")
        return
    old = _flatten(read_yaml(saved_path), set(new))
    rl_path = bool(getattr(getattr(cfg, "data", None), "path", "")) and hasattr(cfg, "rollout")
    changed = {key: (old[key], new[key]) for key in sorted(old) if old[key] != new[key]}
    refused = {k: v for k, v in changed.items() if not is_free(k, rl_path) and not _accepted(k, accept)}
    if refused:
        lines = "\n".join(f"  {key}: {_show(a)} -> {_show(b)}" for key, (a, b) in refused.items())
        raise ConfigError(
            f"train.resume={train.resume}: these settings differ from the run's saved config ({saved_path}) and change "
            f"the computation, so the resumed run would not continue the same run:\n{lines}\nSet them back, or accept "
            f"the change deliberately with train.resume_accept=[{','.join(refused)}] (a key or a whole section; "
            "docs/training.md, 'Resuming with changed settings'). Nothing was written.")
    for key, (a, b) in changed.items():
        if key in UNREPORTED:
            continue
        why = "accepted by train.resume_accept" if not is_free(key, rl_path) else "does not change the computation"
        if key == "train.max_steps" and cfg.optim.schedule != "constant":
            why = f"the {cfg.optim.schedule} LR schedule follows the new length from here on"
        say(f"[resume] {key}: {_show(a)} -> {_show(b)} ({why})")


def _accepted(key: str, accept: list[str]) -> bool:
    return any(key == entry or key.startswith(entry + ".") for entry in accept)


def _checked_accept(accept: list[str], settings: dict[str, Any]) -> list[str]:
    """``train.resume_accept``, each entry a known key or section (an unknown one: did you mean)."""
    sections = {key.rsplit(".", i)[0] for key in settings for i in range(1, key.count(".") + 1)}
    valid = sorted(set(settings) | sections)
    for entry in accept:
        if entry not in valid:
            close = difflib.get_close_matches(entry, valid, n=3, cutoff=0.6)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            raise ConfigError(f"train.resume_accept names {entry!r}, which is no setting or section of this recipe.{hint}")
    return accept


def _show(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text[:-4].strip() if text.endswith("\n...") else text.removesuffix("...").strip()
