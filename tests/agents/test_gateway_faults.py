"""The agent gateway under bad input (issue 36 "Bad input", items 2 and 3): sessions (``serve/sessions.py``)
through a real server on a tiny ASCII-character model, and agents that fail in every way an ``AgentRunner``
/ the agent source must survive (``rl/sources/agent.py``): each counted and logged with its episode, the
step going on, a clear error only when the whole batch is unusable."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from lmforge.core.config import ModelConfig
from lmforge.core.errors import ConfigError, TrainingError
from lmforge.model.load import load_model
from lmforge.rl.config import RolloutConfig
from lmforge.rl.sources.agent import AgentRunner, agent_sampler, episode_reward, load_agent, report, score
from lmforge.rl.sources.agent_samples import merge_calls
from lmforge.rollout import RewardSet
from lmforge.serve.sessions import RunSampling, SessionRecorder

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

RUN = RunSampling(temperature=1.0, max_tokens=8, seed=3, seed_of=lambda seed, call: seed * 1000 + call)
LONG = RunSampling(temperature=1.0, max_tokens=1500, seed=4, seed_of=lambda seed, call: seed * 1000 + call)


@pytest.fixture(scope="module")
def gateway():
    """A server with a SessionRecorder on a tiny random Llama over the ASCII character tokenizer."""
    from lmforge.serve.app import ServedModel, ThreadedServer

    model, tokenizer = load_model(
        ModelConfig(
            name="tiny:llama",
            tokenizer="char:ascii",
            hidden_size=32,
            num_layers=2,
            num_heads=2,
            max_position_embeddings=2048,
            init_seed=0,
        )
    )
    recorder = SessionRecorder()
    server = ThreadedServer(
        ServedModel(model.eval(), tokenizer, "gateway-test", max_batch_rows=8, gather_s=0.005, sessions=recorder)
    )
    yield SimpleNamespace(url=server.url, recorder=recorder, tokenizer=tokenizer)
    assert server.stop(), "the server thread did not stop"


@pytest.fixture
def recorder(gateway):
    gateway.recorder.drain()
    return gateway.recorder


def post(gateway, session: str | None, route: str, body: dict) -> httpx.Response:
    base = gateway.url if session is None else f"{gateway.url}/sessions/{session}"
    return httpx.post(f"{base}{route}", json=body, timeout=60)


def chat(gateway, session, messages, **extra) -> httpx.Response:
    return post(gateway, session, "/v1/chat/completions", {"model": "anything", "messages": messages, **extra})


def encode(gateway, text: str) -> list[int]:
    return gateway.tokenizer.encode(text, add_special_tokens=False)


# ----------------------------------------------------------------------------- sessions through the server


def test_a_chat_continuation_is_built_from_the_recorded_ids(gateway, recorder):
    session = recorder.open(RUN)
    messages = [{"role": "user", "content": "hi"}]
    first = chat(gateway, session.id, messages)
    assert first.status_code == 200, first.text
    reply = first.json()["choices"][0]["message"]
    messages += [reply, {"role": "user", "content": "more"}]
    assert chat(gateway, session.id, messages).status_code == 200
    calls = recorder.close(session)
    assert [c.endpoint for c in calls] == ["chat", "chat"]
    a, b = calls
    assert a.prompt_ids == encode(gateway, "<|user|>\nhi<eos>\n<|assistant|>\n")
    # the previous prompt + its sampled ids, exactly; then the template's end of turn (what the sampled ids do
    # not already hold) and the new user turn
    closing = "\n" if a.token_ids[-1] == gateway.tokenizer.eos_token_id else "<eos>\n"
    assert b.prompt_ids == a.prompt_ids + a.token_ids + encode(
        gateway, closing + "<|user|>\nmore<eos>\n<|assistant|>\n"
    )
    assert session.counts["text_rendered_turns"] == 0
    assert len(merge_calls(calls)) == 1  # one multi-turn sample


def test_a_reply_whose_text_lacks_a_sampled_id_is_continued_from_the_ids(gateway, recorder):
    """A reply that ended on a stop id of the request's own (honoured as sent) has that id among its sampled
    ids but not in its text: re-tokenizing the text would drop it; the continuation keeps it."""
    session = recorder.open(RUN)
    stops = [i for i in range(3, gateway.tokenizer.vocab_size)]  # every id but pad, unk, eos: one token, then stop
    messages = [{"role": "user", "content": "hi"}]
    reply = chat(gateway, session.id, messages, stop_token_ids=stops).json()["choices"][0]["message"]
    messages += [reply, {"role": "user", "content": "more"}]
    assert chat(gateway, session.id, messages).status_code == 200
    a, b = recorder.close(session)
    assert a.finish_reason == "stop" and a.token_ids[-1] in stops
    assert gateway.tokenizer.decode(a.token_ids[-1:]) not in (reply["content"] or "")
    assert b.prompt_ids == a.prompt_ids + a.token_ids + encode(gateway, "<eos>\n<|user|>\nmore<eos>\n<|assistant|>\n")
    assert session.counts["text_rendered_turns"] == 0 and len(merge_calls([a, b])) == 1


def test_an_edited_assistant_message_is_rendered_from_its_text_and_counted(gateway, recorder):
    session = recorder.open(RUN)
    messages = [{"role": "user", "content": "hi"}]
    assert chat(gateway, session.id, messages).status_code == 200
    # replaced, not appended to: with character tokens an appended edit still extends the sampled ids
    edited = {"role": "assistant", "content": "[summary]"}
    messages += [edited, {"role": "user", "content": "more"}]
    assert chat(gateway, session.id, messages).status_code == 200
    a, b = recorder.close(session)
    text = gateway.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert b.prompt_ids == encode(gateway, text)
    assert session.counts["text_rendered_turns"] == 1
    assert len(merge_calls([a, b])) == 2  # it does not extend the first call: a second sample


def test_the_runs_sampling_overrides_the_requests_and_is_counted(gateway, recorder):
    asked = {
        "temperature": 0.2,
        "top_p": 0.5,
        "max_tokens": 3,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.4,
        "seed": 77,
    }
    plain, overridden = recorder.open(RUN), recorder.open(RUN)
    messages = [{"role": "user", "content": "hello"}]
    for session, extra in ((plain, {}), (overridden, asked)):
        response = chat(gateway, session.id, messages, ignore_eos=True, **extra)  # ignore_eos: honoured as sent
        assert response.status_code == 200, response.text
    [want], [got] = recorder.close(plain), recorder.close(overridden)
    # the run's temperature, top_p, penalties, budget and seed: the same tokens and logprobs as the plain call
    assert len(got.token_ids) == RUN.max_tokens and got.finish_reason == "length"
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    assert {k: v for k, v in overridden.counts.items() if k.startswith("override_")} == {
        f"override_{k}": 1 for k in asked
    }
    assert not any(k.startswith("override_") for k in plain.counts)


def test_n_above_one_is_refused(gateway, recorder):
    session = recorder.open(RUN)
    response = chat(gateway, session.id, [{"role": "user", "content": "hi"}], n=2)
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"
    assert recorder.close(session) == [] and session.counts["refused_calls"] == 1


@pytest.mark.parametrize(
    "body",
    [
        {"messages": "hi"},  # not a list of messages
        {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},  # a field of the wrong type
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "a b"}}]},
        {},  # no messages at all
    ],
)
def test_a_malformed_request_is_a_400_counted_on_its_session_and_logged(gateway, recorder, body, caplog):
    session = recorder.open(RUN)
    response = post(gateway, session.id, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert post(gateway, session.id, "/v1/chat/completions", {"messages": "again"}).status_code == 400
    assert recorder.close(session) == [] and session.counts["refused_calls"] == 2
    episode = SimpleNamespace(number=7, session=session, end="ok", calls=[], error="")
    with caplog.at_level(logging.WARNING, logger="lmforge.rl.sources.agent"):
        counts = report([episode], [[]], recorder.drain())
    assert counts["num_refused_calls"] == 2
    assert f"agent episode 7 (session {session.id}): 2 call(s) refused" in caplog.text


def test_the_report_has_the_same_keys_whatever_was_counted(recorder):
    """Under torchrun the ranks' metrics are reduced by position (rl.batch.reduce_rollout_metrics): a count that
    one rank has and another not (an override, a text-rendered turn) must not change the keys."""

    def step(counts: dict, late: dict) -> dict:
        session = SimpleNamespace(id="s", counts=Counter(counts))
        return report([SimpleNamespace(number=0, session=session, end="ok", calls=[1], error="")], [[1]], Counter(late))

    quiet = step({}, {})
    busy = step({"override_temperature": 2, "text_rendered_turns": 1}, {"late_calls": 1})
    assert list(quiet) == list(busy)
    assert busy["num_override_temperature"] == 2 and busy["num_late_calls"] == 1 and quiet["num_late_calls"] == 0


def test_an_unknown_session_is_a_404_and_counted(gateway, recorder):
    response = chat(gateway, "0123456789abcdef01234567", [{"role": "user", "content": "hi"}])
    assert response.status_code == 404 and response.json()["error"]["code"] == "session_not_found"
    assert recorder.drain() == {"unknown_session_calls": 1}


def test_a_call_after_the_session_closed_is_a_404_and_counted_late(gateway, recorder):
    session = recorder.open(RUN)
    assert recorder.close(session) == []
    response = chat(gateway, session.id, [{"role": "user", "content": "hi"}])
    assert response.status_code == 404 and "ended" in response.json()["error"]["message"]
    assert recorder.drain() == {"late_calls": 1}
    assert session.calls == []


def test_forgotten_sessions_stay_known_as_ended_up_to_a_limit(monkeypatch):
    from lmforge.serve import sessions

    monkeypatch.setattr(sessions, "FORGOTTEN_KEPT", 2)
    recorder = SessionRecorder()
    opened = [recorder.open(RUN) for _ in range(3)]
    for session in opened:
        recorder.close(session)
    recorder.forget(opened)
    for session, message in zip(opened, ["no session", "has ended", "has ended"]):  # the oldest id is dropped
        token = sessions._SESSION.set(session.id)
        try:
            with pytest.raises(sessions.SessionNotFound, match=message):
                recorder.current()
        finally:
            sessions._SESSION.reset(token)
    assert recorder.drain() == {"unknown_session_calls": 1, "late_calls": 2}


def test_a_reply_from_another_session_is_not_continued_from_its_ids(gateway, recorder):
    """Sessions are separate: an episode that sends another's reply gets it rendered from text (counted), and
    no call of one session enters the other's record."""
    mine, other = recorder.open(RUN), recorder.open(RUN)
    messages = [{"role": "user", "content": "hi"}]
    reply = chat(gateway, other.id, messages).json()["choices"][0]["message"]
    assert chat(gateway, mine.id, messages + [reply, {"role": "user", "content": "more"}]).status_code == 200
    [theirs], [call] = recorder.close(other), recorder.close(mine)
    assert mine.counts["text_rendered_turns"] == 1 and other.counts["text_rendered_turns"] == 0
    assert call.prompt_ids[: len(theirs.prompt_ids)] == theirs.prompt_ids  # the same conversation, but as text


def test_a_streamed_call_is_recorded_and_continued_like_any_other(gateway, recorder):
    session = recorder.open(RUN)
    url = f"{gateway.url}/sessions/{session.id}/v1/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    content = ""
    with httpx.stream("POST", url, json={"messages": messages, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                content += json.loads(line[5:])["choices"][0]["delta"].get("content") or ""
    messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "more"}]
    assert chat(gateway, session.id, messages).status_code == 200
    a, b = recorder.close(session)
    assert a.endpoint == "chat" and len(a.token_ids) == len(a.logprobs) > 0
    assert b.prompt_ids[: len(a.prompt_ids) + len(a.token_ids)] == a.prompt_ids + a.token_ids
    assert session.counts["text_rendered_turns"] == 0 and len(merge_calls([a, b])) == 1


def test_a_stream_the_client_hangs_up_on_is_not_recorded(gateway, recorder):
    session = recorder.open(LONG)
    url = f"{gateway.url}/sessions/{session.id}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # the first chunk, then hang up
    deadline = time.monotonic() + 20
    while session.counts["cancelled_calls"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert session.counts["cancelled_calls"] == 1
    assert recorder.close(session) == []


def test_a_completions_continuation_by_text_continues_the_ids(gateway, recorder):
    session = recorder.open(RUN)
    first = post(gateway, session.id, "/v1/completions", {"prompt": "abc"}).json()["choices"][0]["text"]
    assert post(gateway, session.id, "/v1/completions", {"prompt": "abc" + first + "def"}).status_code == 200
    a, b = recorder.close(session)
    assert a.endpoint == b.endpoint == "completions"
    assert a.prompt_ids == encode(gateway, "abc") and a.text == "abc" + first
    assert b.prompt_ids == a.prompt_ids + a.text_ids + encode(gateway, "def")
    assert len(merge_calls([a, b])) == 1


def test_responses_and_token_in_generate_under_a_session_are_recorded(gateway, recorder):
    session = recorder.open(RUN)
    response = post(gateway, session.id, "/v1/responses", {"model": "agent", "input": "hi"})
    assert response.status_code == 200, response.text
    ids = encode(gateway, "xyz")
    generated = post(gateway, session.id, "/inference/v1/generate", {"token_ids": ids, "sampling_params": {}})
    assert generated.status_code == 200, generated.text
    a, b = recorder.close(session)
    assert a.endpoint == "chat" and a.prompt_ids == encode(gateway, "<|user|>\nhi<eos>\n<|assistant|>\n")
    assert b.endpoint == "generate" and b.prompt_ids == ids
    assert b.token_ids == generated.json()["choices"][0]["token_ids"]
    assert len(b.token_ids) <= RUN.max_tokens  # the run's budget (generate defaults to the rest of the context)


def test_a_plain_call_on_a_gateway_works_and_is_not_recorded(gateway, recorder):
    session = recorder.open(RUN)
    response = post(
        gateway,
        None,
        "/v1/chat/completions",
        {"model": "gateway-test", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert response.status_code == 200, response.text
    assert recorder.close(session) == [] and recorder.drain() == {}


# ----------------------------------------------------------------------------- agents that misbehave

PROBLEMS = [{"prompt": "p0", "answer": "1"}, {"prompt": "p1", "answer": "2"}]


def runner(gateway, function, timeout_s: float = 30.0, concurrency: int = 0) -> AgentRunner:
    return AgentRunner(function, {}, gateway.url, gateway.recorder, concurrency, timeout_s)


def one_call(base_url: str, problem: dict) -> str:
    response = httpx.post(
        f"{base_url}/chat/completions", json={"messages": [{"role": "user", "content": problem["prompt"]}]}, timeout=60
    )
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"] or ""


def test_agent_failures_are_counted_logged_with_their_episode_and_the_step_goes_on(gateway, recorder, caplog):
    def agent(base_url, problem, episode):
        one_call(base_url, problem)
        if episode == 0:
            raise ValueError("the agent's own bug")
        if episode == 1:
            return None
        if episode == 2:
            return math.nan
        return [1.0]

    episodes = runner(gateway, agent).run(PROBLEMS, 2, lambda number: RUN)
    rewards, _ = score(episodes, None, None, 8)
    assert [e.end for e in episodes] == ["error", "bad_reward", "bad_reward", "bad_reward"]
    assert "ValueError: the agent's own bug" in episodes[0].error and "test_gateway_faults.py" in episodes[0].error
    assert rewards.tolist() == [0.0] * 4
    assert all(len(e.calls) == 1 for e in episodes)  # their calls were recorded, and still train
    with caplog.at_level(logging.WARNING, logger="lmforge.rl.sources.agent"):
        counts = report(episodes, [merge_calls(e.calls) for e in episodes], recorder.drain())
    assert counts["num_agent_errors"] == 1 and counts["num_agent_bad_rewards"] == 3
    assert counts["num_agent_timeouts"] == counts["num_agent_no_calls"] == 0
    for e in episodes:
        assert f"agent episode {e.number} (session {e.session.id}) ended as {e.end}" in caplog.text


def test_an_agent_that_hangs_ends_at_its_timeout_and_its_later_calls_are_refused(gateway, recorder):
    later: dict = {}
    done = threading.Event()

    def agent(base_url, problem, episode):
        if episode == 0:
            return 1.0  # never calls: the other's hang decides the run's time
        time.sleep(1.5)
        later["status"] = httpx.post(
            f"{base_url}/chat/completions", json={"messages": [{"role": "user", "content": "late"}]}, timeout=60
        ).status_code
        done.set()
        return 1.0

    start = time.monotonic()
    episodes = runner(gateway, agent, timeout_s=0.5).run(PROBLEMS[:1], 2, lambda number: RUN)
    assert time.monotonic() - start < 0.5 + 1.5  # the timeout and ~1 s (2 busy cores shared by several runs)
    assert [e.end for e in episodes] == ["ok", "timeout"] and episodes[1].calls == []
    assert done.wait(10) and later["status"] == 404
    counts = report(episodes, [merge_calls(e.calls) for e in episodes], recorder.drain())
    assert counts["num_agent_timeouts"] == 1 and counts["num_agent_no_calls"] == 2
    # counted late, though the step had ended (its session forgotten) before the call came
    assert counts["num_late_calls"] == 1 and counts["num_unknown_session_calls"] == 0


def test_a_call_still_decoding_at_the_timeout_is_cancelled_not_recorded(gateway, recorder):
    status: dict = {}

    def agent(base_url, problem):
        try:  # a 1500-token reply: far longer than the episode's wall clock
            response = httpx.post(
                f"{base_url}/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True},
                timeout=60,
            )
            status["code"], status["body"] = response.status_code, response.text
        except httpx.HTTPError as exc:
            status["code"] = type(exc).__name__
        return 1.0

    episodes = runner(gateway, agent, timeout_s=0.2).run(PROBLEMS[:1], 1, lambda number: LONG)
    assert episodes[0].end == "timeout" and episodes[0].calls == []
    deadline = time.monotonic() + 20
    while "code" not in status and time.monotonic() < deadline:
        time.sleep(0.02)
    # the reply the agent got was cut where the session ended (finish_reason "cancelled"), and nothing was recorded
    assert status["code"] == 200 and json.loads(status["body"])["choices"][0]["finish_reason"] == "cancelled"
    assert episodes[0].session.counts["cancelled_calls"] == 1


def test_at_most_concurrency_episodes_run_at_once_each_with_its_problem(gateway, recorder):
    lock, running, seen = threading.Lock(), [0], []
    pair = threading.Barrier(2, timeout=30)  # two at a time meet here, however slowly the threads start

    def agent(base_url, problem, episode, api_key):
        pair.wait()
        with lock:
            running[0] += 1
            seen.append((episode, problem["prompt"], running[0], api_key, base_url))
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        return 1.0

    episodes = runner(gateway, agent, concurrency=2).run(PROBLEMS, 2, lambda number: RUN)
    assert [e.end for e in episodes] == ["ok"] * 4
    assert sorted((n, p) for n, p, *_ in seen) == [(0, "p0"), (1, "p0"), (2, "p1"), (3, "p1")]  # groups adjacent
    assert max(r for _, _, r, *_ in seen) == 2
    urls = {url for *_, url in seen}
    assert len(urls) == 4 and all(url.startswith(f"{gateway.url}/sessions/") and url.endswith("/v1") for url in urls)
    assert {key for _, _, _, key, _ in seen} == {"lmforge"}
    recorder.drain()


def test_rewards_numbers_parts_and_text(gateway, recorder):
    assert episode_reward(True) == (1.0, {}, None)
    assert episode_reward(0.25) == (0.25, {}, None)
    np = pytest.importorskip("numpy")
    # numbers of NumPy and torch (an agent's own scoring often makes these) count as numbers
    assert episode_reward(np.float32(0.5)) == (0.5, {}, None) and episode_reward(np.bool_(True)) == (1.0, {}, None)
    assert episode_reward(torch.tensor(2.0)) == (2.0, {}, None)
    assert episode_reward({"a": np.int64(1), "b": torch.tensor([0.5])}) == (1.5, {"a": 1.0, "b": 0.5}, None)
    assert episode_reward({"correct": 1, "format": 0.5}) == (1.5, {"correct": 1.0, "format": 0.5}, None)
    assert episode_reward("42") == (None, {}, "42")
    for bad in (
        None,
        math.inf,
        math.nan,
        [1.0],
        {},
        {"a": math.nan},
        {"a": "1"},
        {1: 1.0},
        object(),
        np.float32("nan"),
        torch.tensor([1.0, 2.0]),
        b"1",
    ):
        assert episode_reward(bad) == (None, {}, None), bad

    def agent(base_url, problem, episode):
        one_call(base_url, problem)
        return [{"correct": 1.0, "format": 0.5}, {"correct": 0.0, "format": 0.25}, "1", "2"][episode]

    episodes = runner(gateway, agent).run(PROBLEMS, 2, lambda number: RUN)
    with pytest.raises(ConfigError, match="rewards.functions"):
        score(episodes, None, None, 8)
    rewards, means = score(episodes, RewardSet([("exact", 1.0)]), None, 8)
    # parts summed; text scored against the problem's answer (episodes 2 and 3 answer p1, whose answer is "2")
    assert rewards.tolist() == [1.5, 0.25, 0.0, 1.0]
    assert means == {"reward_correct": 0.25, "reward_format": 0.1875}
    assert [e.end for e in episodes] == ["ok"] * 4
    recorder.drain()


def test_an_async_agent_runs_and_its_calls_are_recorded(gateway, recorder):
    openai = pytest.importorskip("openai")

    async def agent(base_url, problem, model):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": problem["prompt"]}]
        reply = (await client.chat.completions.create(model=model, messages=messages)).choices[0].message
        messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        await client.chat.completions.create(model=model, messages=messages)
        await client.close()
        return 0.5

    episodes = runner(gateway, agent).run(PROBLEMS, 1, lambda number: RUN)
    assert [e.end for e in episodes] == ["ok", "ok"] and [e.returned for e in episodes] == [0.5, 0.5]
    assert [len(e.calls) for e in episodes] == [2, 2]
    assert all(len(merge_calls(e.calls)) == 1 for e in episodes)
    assert all(e.session.counts["text_rendered_turns"] == 0 for e in episodes)
    recorder.drain()


class OneRank:
    """A ParallelContext stand-in: one process, or (``others``) a rank whose other ranks had that many usable
    episodes."""

    def __init__(self, others: int | None = None):
        self.distributed, self.others = others is not None, others or 0

    def sum_counts(self, *counts):
        return [c + self.others for c in counts]

    def gather_objects(self, obj):
        return [obj]


def sampler_run(gateway, function, timeout_s: float = 30.0, ctx: OneRank | None = None):
    """The agent source's ``sample`` (``agent_sampler``) over PROBLEMS, 2 episodes each."""
    engine = SimpleNamespace(
        runner=runner(gateway, function, timeout_s), recorder=gateway.recorder, samples=[], ctx=ctx or OneRank()
    )
    cfg = RolloutConfig(backend="agent", agent_entry="x:y", num_prompts=2, group_size=2, max_new_tokens=8)
    prompts = SimpleNamespace(problems=PROBLEMS, task=None)
    return agent_sampler(engine)(engine, gateway.tokenizer, prompts, [0, 1], cfg, None, 5)


def test_the_step_goes_on_with_the_usable_episodes(gateway, recorder):
    def agent(base_url, problem, episode):
        if episode == 3:
            raise RuntimeError("down")
        if episode == 2:
            return 1.0  # never called the model: an empty row, nothing trained
        one_call(base_url, problem)
        return float(episode)

    rollout, rewards, metrics = sampler_run(gateway, agent)
    assert rollout.episode_index.tolist() == [0, 1, 2, 3]
    assert rewards.total.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert rollout.trained.sum(1).tolist()[2:] == [0, 0]
    assert metrics["num_agent_errors"] == 1 and metrics["num_agent_no_calls"] == 2


def test_a_batch_where_every_episode_fails_stops_with_the_first_error(gateway, recorder):
    def agent(base_url, problem, episode):
        if episode % 2:
            return 1.0  # never calls the model: not usable either
        raise RuntimeError(f"tool server down for episode {episode}")

    with pytest.raises(
        TrainingError, match="no agent episode of this step is usable.*RuntimeError: tool server down for episode 0"
    ):
        sampler_run(gateway, agent)
    with pytest.raises(TrainingError, match="no agent episode of this step is usable"):
        sampler_run(gateway, agent, ctx=OneRank(others=0))  # under torchrun, no rank had one either
    # under torchrun, a rank whose own share failed goes on when another rank's episodes are usable: the
    # batch is the step's, and this rank's rows train with reward 0
    rollout, rewards, metrics = sampler_run(gateway, agent, ctx=OneRank(others=3))
    assert rewards.total.tolist() == [0.0, 1.0, 0.0, 1.0] and int(rollout.trained.sum()) == 0
    assert metrics["num_agent_errors"] == 2 and metrics["num_agent_no_calls"] == 4


# ----------------------------------------------------------------------------- load_agent


def test_load_agent_by_file_and_by_module(tmp_path, monkeypatch):
    (tmp_path / "my_agent.py").write_text("def run(base_url, problem):\n    return 1.0\n")
    assert load_agent(f"{tmp_path / 'my_agent.py'}:run")("u", {}) == 1.0
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_agent("my_agent:run")("u", {}) == 1.0


def test_load_agent_errors_name_the_key_and_what_is_wrong(tmp_path):
    (tmp_path / "agent.py").write_text("def run(base_url, problem):\n    return 1.0\nnot_callable = 3\n")
    (tmp_path / "broken_import.py").write_text("import lmforge_no_such_package_xyz\n")
    (tmp_path / "broken_code.py").write_text("raise RuntimeError('config file missing')\n")
    cases = [
        (f"{tmp_path / 'missing.py'}:run", "no such file"),
        (f"{tmp_path / 'agent.py'}:walk", "has no function 'walk'"),
        (f"{tmp_path / 'agent.py'}:not_callable", "has no function 'not_callable'"),
        ("lmforge_no_such_module_xyz:run", "cannot import lmforge_no_such_module_xyz"),
        (f"{tmp_path / 'broken_import.py'}:run", "lmforge_no_such_package_xyz"),
        (f"{tmp_path / 'broken_code.py'}:run", "RuntimeError: config file missing (at "),
    ]
    for entry, message in cases:
        with pytest.raises(ConfigError, match="rollout.agent_entry") as raised:
            load_agent(entry)
        assert message in str(raised.value), (entry, str(raised.value))


def test_a_missing_dependency_of_an_agent_file_is_named_as_one(tmp_path):
    """The file was found: the module it imports is missing, not the file's directory from PYTHONPATH."""
    (tmp_path / "needs.py").write_text(
        "import lmforge_no_such_dependency_xyz\n\ndef run(base_url, problem):\n    return 1.0\n"
    )
    with pytest.raises(ConfigError) as raised:
        load_agent(f"{tmp_path / 'needs.py'}:run")
    text = str(raised.value)
    assert "No module named 'lmforge_no_such_dependency_xyz'" in text and "a module the agent imports" in text
    assert "PYTHONPATH" not in text


def test_a_signature_that_does_not_take_base_url_problem_and_args_is_refused_when_loaded(tmp_path):
    (tmp_path / "sig.py").write_text(
        "def one(problem):\n    return 1.0\n\ndef two(base_url, problem, *, turns=3):\n    return 1.0\n"
    )
    with pytest.raises(
        ConfigError,
        match=r"one\(problem\) \(.*sig.py:1\) cannot be called as function\(base_url, "
        r"problem, \*\*rollout.agent_args\)",
    ):
        load_agent(f"{tmp_path / 'sig.py'}:one")
    assert load_agent(f"{tmp_path / 'sig.py'}:two", {"turns": 2})("u", {}, turns=2) == 1.0
    with pytest.raises(ConfigError, match="unexpected keyword argument 'extra'"):
        load_agent(f"{tmp_path / 'sig.py'}:two", {"extra": 5})
    with pytest.raises(ConfigError, match="rollout.agent_args sets episode, which lmforge passes"):
        load_agent(f"{tmp_path / 'sig.py'}:two", {"episode": 3})


def test_agent_keys_without_the_agent_backend_are_refused():
    with pytest.raises(ConfigError, match="apply to rollout.backend=agent; this run's backend is inprocess"):
        RolloutConfig(agent_entry="my_agent.py:run").validate()


def test_a_step_with_no_usable_episode_says_why_when_nothing_raised(gateway, recorder):
    """Every episode returned a number without calling the model (it kept a client of another URL): the error
    says so, instead of 'the first error: none'."""
    runner = AgentRunner(lambda base_url, problem: 1.0, {}, gateway.url, recorder, 0, 30.0)
    engine = SimpleNamespace(
        runner=runner, recorder=recorder, ctx=SimpleNamespace(distributed=False, sum_counts=lambda *v: list(v))
    )
    prompts = SimpleNamespace(problems=[{"prompt": "1+1="}], task=None)
    cfg = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, group_size=2)
    with pytest.raises(
        TrainingError,
        match=r"2 episode\(s\) returned without a call recorded in their session "
        r"\(does the agent build its client from the base_url",
    ):
        agent_sampler(engine)(None, gateway.tokenizer, prompts, [0], cfg, None, 1)


def test_a_reward_part_named_like_a_metric_lmforge_logs_is_refused(gateway, recorder):
    def agent(base_url, problem):
        reply = httpx.post(f"{base_url}/completions", json={"prompt": "1+1=", "max_tokens": 2}, timeout=60)
        assert reply.status_code == 200, reply.text
        return {"std": 1.0, "format": 0.5}

    runner = AgentRunner(agent, {}, gateway.url, recorder, 0, 30.0)
    engine = SimpleNamespace(
        runner=runner, recorder=recorder, ctx=SimpleNamespace(distributed=False, sum_counts=lambda *v: list(v))
    )
    prompts = SimpleNamespace(problems=[{"prompt": "1+1="}], task=None)
    cfg = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, group_size=2)
    with pytest.raises(ConfigError, match="reward parts std would be logged as reward_std, a metric lmforge logs"):
        agent_sampler(engine)(None, gateway.tokenizer, prompts, [0], cfg, None, 1)


def test_an_agent_run_may_leave_rewards_functions_empty():
    """The agent's returned numbers are the reward: rewards.functions=[] is refused only for other runs."""
    from lmforge.core.config import load_config
    from lmforge.recipes.grpo import GRPOConfig
    from lmforge.rl.config import check_rl_config

    args = ["data.task=addition", "rewards.functions=[]"]
    cfg = load_config(GRPOConfig, None, args + ["rollout.backend=agent", "rollout.agent_entry=my_agent.py:run"])
    check_rl_config(cfg, cfg.algo.resolved())
    cfg = load_config(GRPOConfig, None, args)
    with pytest.raises(ConfigError, match="rewards.functions is empty"):
        check_rl_config(cfg, cfg.algo.resolved())
