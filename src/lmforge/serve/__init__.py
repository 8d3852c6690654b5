"""``lmforge serve``: an OpenAI-compatible inference server on the rollout engine, and the trainer's side
of a served rollout loop (``push_weights``; ``atropos.pull_batch``).

Importing this package needs neither FastAPI nor uvicorn; ``app.build_app`` / ``command`` import them
lazily with an install hint (``pip install 'lmforge[serve]'``). See docs/serving.md.
"""
from .scheduler import BatchScheduler, GenerationRequest, GenerationResult, Sample, ServeError
from .weights import WeightsError, push_weights

__all__ = ["BatchScheduler", "GenerationRequest", "GenerationResult", "Sample", "ServeError", "WeightsError",
           "push_weights"]
