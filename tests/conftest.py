import os

import pytest
import torch

# Tests run on 2 CPU cores next to each other; keep torch from oversubscribing them.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Tokenized-data caches go to a per-session temporary directory, never ~/.cache."""
    if "LMFORGE_CACHE" not in os.environ or os.environ.get("LMFORGE_TEST_KEEP_CACHE") != "1":
        monkeypatch.setenv("LMFORGE_CACHE", str(tmp_path_factory.getbasetemp() / "lmforge-cache"))
