"""Fixtures of the agent gateway's proofs (issue 36 item 4): a tiny model trained here, in a few seconds,
to answer any conversation with a calculator call in lmforge's format, and a gateway server on it that
logs every HTTP request made under ``/sessions/<id>/`` (route, status, body) beside what it records.

The model is a 2-layer tiny Llama (hidden 32) on the ASCII character tokenizer. It is trained on
three-turn calculator conversations built as the gateway builds prompts (``agent_exactness.
reference_prompt``: each earlier reply's ids, then the template's text), the loss on the replies only:
first on 128-token windows (the call's format, at a fraction of the cost: RoPE is relative), then on
whole conversations (~340 tokens; trained on windows alone, it wrote noise from the second turn on).
About 9 s of CPU time on one thread. The expressions in its calls are random, so the digits it samples
carry real uncertainty (logprobs down to about -3) while the call's frame is near certain. Its final norm
is then scaled by 2 (its logits doubled): at temperature 1, 45 of 46 replies of 16 example-agent episodes
parsed as calls here, at every turn (unscaled, only 4 of 16 episodes reached their third call).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import random
import time

import pytest
import torch
from agent_exactness import TOOLS, calculator, reference_prompt

from lmforge.core.config import ModelConfig
from lmforge.model.load import load_model

TURNS = 3  # replies per training conversation (the example agent's max_turns)
WINDOW, BATCH, LONG_BATCH, SHORT_STEPS, STEPS, LR = 128, 16, 8, 200, 260, 1e-2
SHARPEN = 2.0  # the final norm's scale after training


def _expression(rng: random.Random) -> str:
    return f"{rng.randint(1, 99)}{rng.choice('+-*')}{rng.randint(1, 99)}"


def call_text(expression: str) -> str:
    """A calculator call as lmforge's tool parser reads it (serve/tools.py)."""
    return (
        "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "\n</tool_call>"
    )


def question(rng: random.Random) -> str:
    q = _expression(rng)
    return rng.choice([f"{q}=", f"What is {q}?", f"Compute {q}."])


def _conversation(tokenizer, rng: random.Random) -> tuple[list[int], list[int]]:
    """(ids, trained) of one conversation of TURNS calls and their results, as the gateway's prompts are."""
    messages, replies = [{"role": "user", "content": question(rng)}], []
    ids, trained = [], []
    for _ in range(TURNS):
        prompt = reference_prompt(tokenizer, messages, TOOLS, replies)
        expression = _expression(rng)
        reply = tokenizer.encode(call_text(expression), add_special_tokens=False)
        trained += [0] * (len(prompt) - len(ids)) + [1] * (len(reply) + 1)
        ids = prompt + reply + [tokenizer.eos_token_id]
        replies.append(reply)
        messages += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": calculator(expression)},
        ]
    return ids, trained


def train_calculator_caller(seed: int = 0):
    """(model, tokenizer, seconds of CPU time the training took): the module doc's model."""
    cfg = ModelConfig(
        name="tiny:llama",
        tokenizer="char:ascii",
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        max_position_embeddings=2048,
        init_seed=seed,
    )
    model, tokenizer = load_model(cfg)
    rng = random.Random(seed)
    data = [_conversation(tokenizer, rng) for _ in range(128)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matmuls: one thread is as fast, and spins less on a shared machine
    start = time.process_time()
    model.train()
    try:
        for step in range(STEPS):
            if step < SHORT_STEPS:  # windows: the reply's format, cheaply
                rows = []
                for _ in range(BATCH):
                    ids, trained = data[rng.randrange(len(data))]
                    at = rng.randrange(len(ids) - WINDOW + 1)
                    rows.append((ids[at : at + WINDOW], trained[at : at + WINDOW]))
            else:  # whole conversations: the later turns' long contexts
                rows = [data[rng.randrange(len(data))] for _ in range(LONG_BATCH)]
            width = max(len(r[0]) for r in rows)
            ids = torch.tensor([r[0] + [0] * (width - len(r[0])) for r in rows])
            attention = torch.tensor([[1] * len(r[0]) + [0] * (width - len(r[0])) for r in rows])
            target = torch.tensor([r[1] + [0] * (width - len(r[1])) for r in rows])[:, 1:].bool()
            for group in optimizer.param_groups:  # cosine decay to 0
                group["lr"] = LR * 0.5 * (1 + math.cos(math.pi * step / STEPS))
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits[target], ids[:, 1:][target])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    seconds = time.process_time() - start
    with torch.no_grad():
        model.model.norm.weight.mul_(SHARPEN)
    return model.eval(), tokenizer, seconds


@pytest.fixture(scope="session")
def calculator_model():
    """(model, tokenizer): trained once per test session (module doc)."""
    model, tokenizer, _ = train_calculator_caller()
    return model, tokenizer


class RequestLog:
    """The HTTP requests made under ``/sessions/<id>/``, per session id, in the order they arrived:
    dicts of ``route``, ``status`` (of the response) and ``body`` (the request's JSON)."""

    def __init__(self):
        self.by_session: dict[str, list[dict]] = collections.defaultdict(list)

    def wrap(self, original):
        from lmforge.serve.sessions import PREFIX

        log = self

        async def recording(middleware, scope, receive, send):
            if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
                return await original(middleware, scope, receive, send)
            session, _, route = scope["path"][len(PREFIX) :].partition("/")
            entry = {"route": route, "status": None, "raw": b""}
            log.by_session[session].append(entry)

            async def receive_logged():
                message = await receive()
                if message["type"] == "http.request":
                    entry["raw"] += message.get("body", b"")
                return message

            async def send_logged(message):
                if message["type"] == "http.response.start":
                    entry["status"] = message["status"]
                await send(message)

            await original(middleware, scope, receive_logged, send_logged)

        return recording

    def model_calls(self, session_id: str) -> list[dict]:
        """The session's answered chat / completions requests, each with its parsed ``body``."""
        return [
            {**e, "body": json.loads(e["raw"])}
            for e in self.by_session.get(session_id, [])
            if e["status"] == 200 and e["route"].endswith(("chat/completions", "v1/completions"))
        ]


class Gateway:
    """A gateway server on the trained model (``PolicyServer`` with a ``SessionRecorder``), the request
    log, and ``run``: episodes of an agent function through lmforge's own ``AgentRunner``."""

    TEMPERATURE = 1.0
    MAX_TOKENS = 128

    def __init__(self, model, tokenizer, log: RequestLog):
        from lmforge.rl.sources.served import PolicyServer
        from lmforge.serve.sessions import SessionRecorder

        self.model, self.tokenizer, self.log = model, tokenizer, log
        self.recorder = SessionRecorder()
        self.server = PolicyServer(model, tokenizer, 8, "agents-test", sessions=self.recorder)
        self.stop_ids = self.server.served.stop_token_ids

    def run(self, function, problems: list[dict], group_size: int = 2, seed: int = 0, args: dict | None = None):
        """The episodes (``AgentEpisode``, calls recorded) of ``function`` on ``problems``, all at once."""
        from lmforge.envs.episode import episode_seed
        from lmforge.rl.sources.agent import AgentRunner
        from lmforge.serve.sessions import RunSampling

        runner = AgentRunner(function, args or {}, self.server.url, self.recorder, concurrency=0, timeout_s=120.0)
        run = RunSampling(
            self.TEMPERATURE,
            1.0,
            0,
            self.MAX_TOKENS,
            seed=0,
            seed_of=lambda number, call: episode_seed(seed, number, call),
        )
        episodes = runner.run(problems, group_size, lambda number: dataclasses.replace(run, seed=number))
        for episode in episodes:
            assert episode.end == "ok", f"episode {episode.number} ended as {episode.end}: {episode.error}"
        return episodes


@pytest.fixture(scope="module")
def recording_gateway(calculator_model):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    from lmforge.serve.sessions import SessionPaths

    log, threads = RequestLog(), torch.get_num_threads()
    # One thread for the server's tiny forwards (set before its thread starts): two threads spinning on a
    # busy 2-core machine made each call ~10x slower (3 s instead of 0.3 s here).
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as patch:  # observes the requests; passes each on unchanged
            patch.setattr(SessionPaths, "__call__", log.wrap(SessionPaths.__call__))
            served = Gateway(*calculator_model, log)
            yield served
            served.server.stop()
    finally:
        torch.set_num_threads(threads)
