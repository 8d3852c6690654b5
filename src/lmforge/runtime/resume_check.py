"""Resuming with changed settings: the resumed run's settings are compared with the run's saved
``config.yaml`` before anything is written, so a run never continues under other values by accident.

A setting that changes the computation (the optimizer, schedule, algorithm, batch and group sizes,
the model, tokenizer, data, seed, ...) and differs from the saved one is a ConfigError listing each
key (old -> new); ``train.resume_accept`` names the keys (or whole sections) to change deliberately.
The settings marked ``opt(free_on_resume=...)`` on their field only decide what is logged, evaluated or
saved, when, and how fast the same computation runs; they may change freely. Every other key is
compared, so a key added later is compared until someone marks it.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Callable

import yaml

from ..core.config import describe, parse_yaml, read_yaml, resume_free_keys, to_dict
from ..core.errors import ConfigError
from .checkpoint import STEP_DIR, list_checkpoints

UNREPORTED = frozenset({"train.resume", "train.resume_accept", "train.output_dir"})  # differ by design


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
        say(
            f"[resume] no saved config at {saved_path}: the settings cannot be compared with the run's; "
            "make sure they are the ones it ran with"
        )
        return
    old = _flatten(read_yaml(saved_path), set(new))
    free = resume_free_keys(cfg)
    changed = {key: (old[key], new[key]) for key in sorted(old) if old[key] != new[key]}
    refused = {k: v for k, v in changed.items() if k not in free and not _accepted(k, accept)}
    if refused:
        lines = "\n".join(f"  {key}: {_show(a)} -> {_show(b)}" for key, (a, b) in refused.items())
        raise ConfigError(
            f"train.resume={train.resume}: these settings differ from the run's saved config ({saved_path}) and change "
            f"the computation, so the resumed run would not continue the same run:\n{lines}\nSet them back, or accept "
            f"the change deliberately with train.resume_accept=[{','.join(refused)}] (a key or a whole section; "
            "docs/training.md, 'Resuming with changed settings'). Nothing was written."
        )
    for key, (a, b) in changed.items():
        if key in UNREPORTED:
            continue
        why = "accepted by train.resume_accept" if key not in free else "does not change the computation"
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
            raise ConfigError(
                f"train.resume_accept names {entry!r}, which is no setting or section of this recipe.{hint}"
            )
    return accept


def _show(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text[:-4].strip() if text.endswith("\n...") else text.removesuffix("...").strip()
