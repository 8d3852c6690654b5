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
