"""``lmforge serve``: an OpenAI-compatible inference server on the rollout engine, and the trainer's side
of a served rollout loop (``push_weights``; the Atropos client is ``lmforge.rl.sources.atropos_client``).

Importing this package needs neither FastAPI nor uvicorn; ``app.build_app`` / ``command`` import them
lazily with an install hint (``pip install 'lmforge[serve]'``). See docs/serving.md.
"""

import importlib

# name -> the module that defines it, imported on first use: ``lmforge serve --help`` builds its parser from
# ``serve.command`` without loading torch (which the scheduler imports)
_EXPORTS = {
    "BatchScheduler": "scheduler",
    "GenerationRequest": "scheduler",
    "GenerationResult": "scheduler",
    "Sample": "scheduler",
    "ServeError": "scheduler",
    "WeightsError": "weights",
    "push_weights": "weights",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
