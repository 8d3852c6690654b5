"""Shared by the RL recipe tests: a reward with variance for an untrained model."""

import pytest

from lmforge.rollout import BUILTIN_REWARDS


def parity(completion: str, problem) -> float:
    """Parity of the completion's character codes: about half of random completions score 1."""
    return float(sum(map(ord, completion)) % 2)


@pytest.fixture(scope="module", autouse=True)
def parity_reward():
    """Registers ``parity`` as a built-in reward for the tests of a module, then removes it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(BUILTIN_REWARDS, "parity", parity)
        yield


class Spy:
    """Wraps a function in every lmforge module that imported it by name: each call's arguments
    (bound to the signature, defaults applied) are recorded, then the real function runs."""

    def __init__(self, monkeypatch, func):
        import inspect
        import sys

        self.func, self.calls = func, []
        self.signature = inspect.signature(func)
        patched = 0
        for name, module in list(sys.modules.items()):
            if (name == "lmforge" or name.startswith("lmforge.")) and getattr(module, func.__name__, None) is func:
                monkeypatch.setattr(module, func.__name__, self)
                patched += 1
        assert patched, f"no lmforge module holds {func.__name__}"

    def __call__(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        self.calls.append(dict(bound.arguments))
        return self.func(*args, **kwargs)


@pytest.fixture
def spy(monkeypatch):
    """``spy(func) -> Spy``: record the calls of ``func`` for the rest of the test."""
    return lambda func: Spy(monkeypatch, func)
