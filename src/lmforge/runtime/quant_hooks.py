"""The training loop's two quantization settings (``lmforge.quantize`` does the work):

* ``train.qat: ternary | int4`` -- :func:`apply_train_qat` swaps the decoder's ``nn.Linear`` layers
  for fake-quantized ones (straight-through gradients, full-precision master weights) before the
  optimizer is built; the checkpoints hold the master weights and ``config.json`` records
  ``lmforge_qat``, so ``lmforge quantize`` of ``final/`` computes what the training forward computed.
* ``train.save_quantized: [int8, q4_0, ...]`` -- :func:`write_quantized_copies` writes
  ``<checkpoint>/quantized-<format>/`` into best/ and final/ before they are renamed into place, so
  each appears with its copies (rank 0). A format that fails is reported and skipped: the checkpoint
  is never lost.

:func:`check_quant_settings` runs when the run starts, so a bad format name fails before training.
"""

from __future__ import annotations

from pathlib import Path

from ..core.errors import ConfigError

QAT_OFF = "none"


def check_quant_settings(tcfg, rollout_backend: str | None = None) -> None:
    """Unknown ``train.save_quantized`` formats and QAT with the vLLM rollout backend are ConfigErrors
    (``tcfg``: the train section; ``rollout_backend``: an RL run's ``rollout.backend``)."""
    from ..quantize import QuantizeError, canonical_format

    for i, fmt in enumerate(tcfg.save_quantized):
        try:
            canonical_format(fmt)
        except QuantizeError as exc:
            raise ConfigError(f"config key 'train.save_quantized[{i}]': {exc}") from None
    backend = rollout_backend
    if tcfg.qat != QAT_OFF and backend in ("vllm", "atropos"):
        sampler = "vLLM" if backend == "vllm" else "the inference server the environments call"
        raise ConfigError(
            f"train.qat needs rollout.backend=inprocess: with rollout.backend={backend}, {sampler} "
            "would sample from the full-precision master weights, not from the fake-quantized "
            "model that is trained"
        )


def apply_train_qat(run, model) -> list[str]:
    """Apply ``train.qat`` to ``model`` in place (before the optimizer is built); returns the swapped layers.

    A model that already carries the same QAT layers is left as it is. A model saved by a QAT run
    (``config.lmforge_qat``) trained with ``train.qat=none`` loses the marker, so that a later
    ``lmforge quantize`` does not ternarize weights that were trained without fake quantization.
    """
    from ..quantize.qat import QATLinear, apply_qat

    scheme = run.train.qat
    present = {m.scheme for m in model.modules() if isinstance(m, QATLinear)}
    config = getattr(model, "config", None)
    if scheme == QAT_OFF:
        if present:  # applied by the caller (e.g. apply_qat before run_sft): keep it
            run.print(f"[qat] the model already computes with {'/'.join(sorted(present))} fake-quantized weights")
        elif getattr(config, "lmforge_qat", None):
            run.print(
                f"[qat] the model comes from a {config.lmforge_qat} QAT run but train.qat=none: training "
                "its full-precision master weights without fake quantization"
            )
            del config.lmforge_qat
        return []
    if present:
        if present == {scheme}:
            return []
        raise ConfigError(f"train.qat={scheme}, but the model already has {'/'.join(sorted(present))} QAT layers")
    try:
        replaced = apply_qat(model, scheme)
    except ValueError as exc:
        raise ConfigError(f"train.qat={scheme}: {exc}") from None
    dtype = next(model.parameters()).dtype
    run.print(
        f"[qat] {scheme}: {len(replaced)} linear layers of the decoder compute with fake-quantized weights "
        f"(straight-through gradients); master weights stay {str(dtype).removeprefix('torch.')}; "
        "embeddings, norms and lm_head are not quantized"
    )
    return replaced


def write_quantized_copies(
    model, tokenizer, checkpoint_dir: Path, formats: list[str], printer=print, shown_as: Path | None = None
) -> list[Path]:
    """``checkpoint_dir/quantized-<format>/`` for each format, from ``model`` (left untouched).

    Call on rank 0 once the model files of ``checkpoint_dir`` are written (``shown_as``: the name
    the messages give it, when it is still a temporary directory). Each format is independent: one
    that fails (e.g. GGUF of a char tokenizer) is reported with its reason and the others are still
    written.
    """
    shown = Path(shown_as) if shown_as is not None else Path(checkpoint_dir)
    from ..quantize import canonical_format, save_quantized_copies

    written = []
    for fmt in formats:
        name = canonical_format(fmt)
        try:
            (result,) = save_quantized_copies(model, tokenizer, checkpoint_dir, [name])
        except Exception as exc:  # noqa: BLE001 - a failed copy must never cost the checkpoint or the run
            printer(
                f"[quantize] could not write the {name} copy of {shown}: {type(exc).__name__}: {exc} "
                f"(the checkpoint itself is complete)"
            )
            continue
        printer(
            f"[quantize] wrote {shown / f'quantized-{name}'} ({result.num_bytes / 2**20:.2f} MiB, "
            f"{result.seconds:.1f} s)"
        )
        written.append(Path(checkpoint_dir) / f"quantized-{name}")
    return written
