"""The policy served from the training process: ``lmforge serve`` on a copy of the policy, under uvicorn in
a daemon thread on 127.0.0.1, for the sources whose episodes are run by someone else's code over HTTP
(``verifiers``, ``agent``). After each update the copy takes the trained weights, so every step samples
from the weights being trained.

The copy is needed because the scheduler keeps its model in eval mode without gradients, which the
trainer's own module cannot be.
"""

from __future__ import annotations

import copy

import torch

from ...core.errors import TrainingError
from ...model import lora
from ...serve.weights import copy_state, plain_state

SERVED_NAME = "policy"
LOAD_TIMEOUT_S = 600.0  # longest wait for the served copy to take new weights


class PolicyServer:
    """``lmforge serve`` on a copy of the policy (module doc); ``sessions``: an agent gateway's recorder."""

    def __init__(self, model: torch.nn.Module, tokenizer, max_batch_rows: int, backend: str, sessions=None):
        from ...serve.app import ServedModel, ThreadedServer

        self.served = ServedModel(
            model, tokenizer, SERVED_NAME, max_batch_rows=max_batch_rows, gather_s=0.005, sessions=sessions
        )
        try:
            self.server = ThreadedServer(self.served, name=f"lmforge-{backend}-serve")
        except RuntimeError as exc:
            raise TrainingError(f"rollout.backend={backend}: the policy server did not start ({exc})") from exc
        self.url = self.server.url

    @property
    def weight_version(self) -> int:
        return self.served.scheduler.weight_version

    def load(self, model: torch.nn.Module, version: int) -> None:
        """The served copy takes ``model``'s weights (merged if LoRA) as ``version``."""
        state = plain_state(model)
        update = self.served.scheduler.update_weights(lambda served: copy_state(served, state), version)
        try:  # it waits for the rows in flight (at most one call's tokens each): bounded, never a hang
            update.result(timeout=LOAD_TIMEOUT_S)
        except TimeoutError as exc:
            raise TrainingError(
                f"the served policy did not take the weights of version {version} within "
                f"{LOAD_TIMEOUT_S:.0f} s (its generation thread is stuck or dead: "
                f"alive={self.served.scheduler.alive})"
            ) from exc

    def stop(self) -> None:
        self.server.stop()


def served_copy(policy: torch.nn.Module) -> torch.nn.Module:
    """A plain copy of the policy for the server (adapters stripped, merged weights loaded)."""
    unwrapped = getattr(policy, "module", policy)
    served = copy.deepcopy(unwrapped)
    if lora.has_adapters(served):
        lora.strip_adapters(served)
        copy_state(served, plain_state(unwrapped))
    return served
