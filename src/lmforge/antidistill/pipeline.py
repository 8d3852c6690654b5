"""Helpers of the ``lmforge antidistill`` pipeline (pipelines/antidistill.py): the work directory's
layout, trace rows, batching for the proxy gradient, and the report (table, interpolation, plot).

Work directory (``run.workdir``); each stage reads what the stage before it wrote:

    traces/heldout.jsonl  traces/summary.json         lmforge antidistill traces
    grad/proxy_grad.safetensors  grad/summary.json    lmforge antidistill grad
    samples/<setting>/traces.jsonl  .../summary.json  lmforge antidistill sample   (one per (T, lam[, direction]))
    students/<setting>/final/                         lmforge antidistill distill  (an SFT run dir each)
    eval/results.json                                 lmforge antidistill eval
    report/report.md  report/student_vs_teacher.png   lmforge antidistill report
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..core.errors import DataError, LmforgeError
from ..core.fileio import read_text, text_lines
from ..data.sft import SFTExample
from ..rollout.engine import RolloutBatch


class StageInputMissing(LmforgeError, FileNotFoundError):
    """A stage's input file does not exist: an earlier stage has not been run with this config."""


# ----------------------------------------------------------------------------- layout


def heldout_path(workdir: Path) -> Path:
    return Path(workdir) / "traces" / "heldout.jsonl"


def grad_path(workdir: Path) -> Path:
    return Path(workdir) / "grad" / "proxy_grad.safetensors"


def setting_name(temperature: float, lam: float, direction: str = "proxy") -> str:
    """Directory name of one sweep setting, e.g. ``T1-lam0.5`` (lam in the paper's convention), or
    ``T1-lam0.5-random`` for the random-direction control. lam = 0 is plain sampling whatever the
    direction, so its name carries none."""
    name = f"T{temperature:g}-lam{lam:g}"
    return name if lam == 0 or direction == "proxy" else f"{name}-{direction}"


def sample_dir(workdir: Path, temperature: float, lam: float, direction: str = "proxy") -> Path:
    return Path(workdir) / "samples" / setting_name(temperature, lam, direction)


def student_dir(workdir: Path, temperature: float, lam: float, direction: str = "proxy") -> Path:
    return Path(workdir) / "students" / setting_name(temperature, lam, direction)


def results_path(workdir: Path) -> Path:
    return Path(workdir) / "eval" / "results.json"


def require(path: Path, command: str) -> Path:
    """``path`` if it exists, else StageInputMissing naming the command that writes it."""
    if not Path(path).exists():
        raise StageInputMissing(
            f"{path} not found: run `lmforge antidistill {command}` with the same config (same run.workdir) first"
        )
    return Path(path)


# ----------------------------------------------------------------------------- files


def write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    tmp.replace(path)


def _json_value(text: str, where: str, what: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(
            f"{where}: invalid JSON in the {what} ({err.msg}); the file is truncated or was edited: run its stage again"
        ) from None
    if not isinstance(value, dict):
        raise DataError(f"{where}: expected a JSON object in the {what}, got {type(value).__name__}")
    return value


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a stage's JSONL file; a bad file is a DataError naming ``path:line``."""
    return [
        _json_value(line, f"{path}:{number}", "stage file")
        for number, line in text_lines(path, "stage file")
        if line.strip()
    ]


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> dict:
    """A stage's JSON object; a bad file is a DataError naming ``path``."""
    return _json_value(read_text(path, "stage file"), str(path), "stage file")


# ----------------------------------------------------------------------------- traces


def trace_rows(batch: RolloutBatch, problems: Sequence, tokenizer, task) -> list[dict]:
    """One ``prompt``/``completion`` row per sampled completion, scored by the task's verifier.

    ``problems[i]`` is the problem of prompt ``i`` of the batch. The completion is decoded without
    special tokens (the stop token is dropped; SFT appends eos again). ``truncated`` rows hit
    max_new_tokens without a stop token.
    """
    rows = []
    for b in range(batch.completion_ids.shape[0]):
        problem = problems[int(batch.group_index[b])]
        ids = batch.completion_ids[b][batch.completion_mask[b].bool()].tolist()
        text = tokenizer.decode(ids, skip_special_tokens=True)
        rows.append(
            {
                "prompt": problem.prompt,
                "completion": text,
                "answer": problem.answer,
                "correct": bool(task.is_correct(text, problem)),
                "truncated": bool(batch.truncated[b]),
            }
        )
    return rows


def accuracy(rows: Sequence[dict]) -> float:
    return sum(r["correct"] for r in rows) / max(len(rows), 1)


def kl_sums(batch) -> tuple[float, int]:
    """(sum over completion tokens of the per-step KL(sampling distribution || tempered teacher),
    number of completion tokens).

    Their ratio is the per-token KL between the ADS distribution and the plain temperature-T
    distribution at the sampled prefixes: exact at each step (``AdsRolloutBatch.kl``, summed over the
    whole vocabulary before top-k / top-p), averaged over the sampled tokens. A plain ``RolloutBatch``
    (temperature sampling) contributes 0.
    """
    mask = batch.completion_mask.bool()
    if not hasattr(batch, "kl"):
        return 0.0, int(mask.sum())
    return float(batch.kl[mask].sum()), int(mask.sum())


def gradient_batches(examples: Sequence[SFTExample], pad_id: int, batch_size: int) -> Iterator[dict]:
    """Right-padded batches ``input_ids``, ``attention_mask``, ``loss_mask`` (each (B, T) long)."""
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        width = max(len(ex.input_ids) for ex in chunk)
        batch = {
            k: torch.zeros((len(chunk), width), dtype=torch.long) for k in ("input_ids", "attention_mask", "loss_mask")
        }
        batch["input_ids"].fill_(pad_id)
        for b, ex in enumerate(chunk):
            n = len(ex.input_ids)
            batch["input_ids"][b, :n] = torch.tensor(ex.input_ids)
            batch["attention_mask"][b, :n] = 1
            batch["loss_mask"][b, :n] = torch.tensor(ex.loss_mask)
        yield batch


# ----------------------------------------------------------------------------- report


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float | None:
    """Piecewise-linear y(x) through ``points`` (x, y), or None outside their x range.

    Points with equal x are averaged first. Used to read off the temperature-sampling student's
    accuracy at an ADS setting's teacher accuracy.
    """
    by_x: dict[float, list[float]] = {}
    for px, py in points:
        by_x.setdefault(px, []).append(py)
    xs = sorted(by_x)
    ys = [sum(by_x[v]) / len(by_x[v]) for v in xs]
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[0]  # a single point, x equal to it


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def report_markdown(settings: Sequence[dict], teacher_greedy: float, student_baseline: float) -> str:
    """Markdown table. Each setting: name, temperature, lam, teacher_accuracy (on its traces),
    kl_per_token, student_accuracy, and temperature_student_at_same_teacher (None if out of range)."""
    lines = [
        f"Teacher (greedy) test accuracy: {_pct(teacher_greedy)}%. "
        f"Undistilled student test accuracy: {_pct(student_baseline)}%.",
        "",
        "| setting | sampling | T | lam | teacher acc. on traces (%) | KL/token (nats) | student test acc. (%) "
        "| temperature-sampling student at same teacher acc. (%) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in settings:
        kind = "temperature" if s["lam"] == 0 else "ADS" if s.get("direction", "proxy") == "proxy" else "random dir."
        lines.append(
            f"| {s['name']} | {kind} | {s['temperature']:g} | {s['lam']:g} | {_pct(s['teacher_accuracy'])} "
            f"| {s['kl_per_token']:.3f} | {_pct(s['student_accuracy'])} "
            f"| {_pct(s.get('temperature_student_at_same_teacher'))} |"
        )
    return "\n".join(lines) + "\n"


def plot_report(settings: Sequence[dict], teacher_greedy: float, student_baseline: float, out: Path) -> Path:
    """PNG: student test accuracy vs teacher accuracy on the traces, ADS vs temperature sampling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    temp = sorted((s for s in settings if s["lam"] == 0), key=lambda s: s["teacher_accuracy"])
    if temp:
        ax.plot(
            [100 * s["teacher_accuracy"] for s in temp],
            [100 * s["student_accuracy"] for s in temp],
            "o-",
            color="tab:blue",
            label="temperature sampling (lam = 0)",
        )
        for s in temp:
            ax.annotate(
                f"T={s['temperature']:g}",
                (100 * s["teacher_accuracy"], 100 * s["student_accuracy"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
    ads = [s for s in settings if s["lam"] != 0]
    if ads:
        ax.scatter(
            [100 * s["teacher_accuracy"] for s in ads],
            [100 * s["student_accuracy"] for s in ads],
            marker="s",
            color="tab:red" if ads[0].get("direction", "proxy") == "proxy" else "tab:green",
            label="antidistillation sampling"
            if ads[0].get("direction", "proxy") == "proxy"
            else "random direction (control)",
            zorder=3,
        )
        for s in ads:
            ax.annotate(
                f"T={s['temperature']:g} lam={s['lam']:g}",
                (100 * s["teacher_accuracy"], 100 * s["student_accuracy"]),
                fontsize=7,
                xytext=(3, -9),
                textcoords="offset points",
            )
    ax.plot([0, 100], [0, 100], color="lightgray", linewidth=0.8, label="student = teacher traces")
    ax.axhline(100 * student_baseline, color="gray", linestyle="--", label="undistilled student")
    ax.axvline(100 * teacher_greedy, color="gray", linestyle=":", label="teacher, greedy (test)")
    ax.set_xlabel("teacher accuracy on its sampled traces (%)")
    ax.set_ylabel("distilled student test accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
