"""Fixtures for the serving tests: a tiny model with the char tokenizer, and a real server on a free port
(``lmforge.serve.app.ThreadedServer``)."""

from __future__ import annotations

import pytest
import torch

from lmforge.core.config import ModelConfig
from lmforge.model.load import load_model

CONTEXT = 64  # max_position_embeddings of the test model: small, so the context-limit error is cheap to hit


def tiny_model(seed: int = 0, sharpness: float = 3.0):
    """(model, tokenizer): a 2-layer tiny Llama on the char tokenizer, output made far from uniform so that
    greedy decoding has no near-ties (batched and unbatched runs then pick the same tokens)."""
    cfg = ModelConfig(
        name="tiny:llama", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=CONTEXT, init_seed=seed
    )
    model, tokenizer = load_model(cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpness)
    return model.eval(), tokenizer


def ascii_model(context: int = 2048, seed: int = 0):
    """(model, tokenizer): a tiny random Llama on the ASCII character tokenizer (``char:ascii``), which xgrammar
    can describe; at temperature 1 it writes noise, so a valid structure in its replies is the grammar's doing."""
    cfg = ModelConfig(
        name="tiny:llama",
        tokenizer="char:ascii",
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        max_position_embeddings=context,
        init_seed=seed,
    )
    model, tokenizer = load_model(cfg)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def make_ascii():
    """The ``ascii_model`` factory (module-scoped fixtures build their models with it)."""
    return ascii_model


@pytest.fixture
def make_tiny():
    """The ``tiny_model`` factory, for tests that need several models or a fresh one."""
    return tiny_model


@pytest.fixture
def server():
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from lmforge.serve.app import ServedModel, ThreadedServer

    model, tokenizer = tiny_model()
    running = ThreadedServer(ServedModel(model, tokenizer, "tiny-test", max_batch_rows=32, gather_s=0.005))
    yield running
    assert running.stop(), "the server thread did not stop"


@pytest.fixture
def serve_model():
    """Start a server on a given (model, tokenizer); every server started is stopped after the test."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from lmforge.serve.app import ServedModel, ThreadedServer

    started = []

    def start(model, tokenizer, name: str = "tiny-test") -> ThreadedServer:
        started.append(ThreadedServer(ServedModel(model, tokenizer, name, max_batch_rows=8, gather_s=0.005)))
        return started[-1]

    yield start
    for running in started:
        assert running.stop(), "the server thread did not stop"
