"""``lmforge serve --api-key`` (bearer check, 401 in OpenAI's shape, /health and /metrics open) and
``GET /metrics`` in Prometheus' text format, parsed back (``serve/middleware.py``)."""

from __future__ import annotations

import argparse
import functools
import re
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

SAMPLE = re.compile(r"^([a-z_]+)(?:\{(.*)\})? (\S+)$")


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    """{(name, ((label, value), ...)): value}; every sample's metric has HELP and TYPE lines before it."""
    samples, declared = {}, set()
    for line in text.splitlines():
        if line.startswith("# "):
            _, keyword, name = line.split()[:3]
            declared.add((keyword, name))
            continue
        name, labels, value = SAMPLE.match(line).groups()
        assert {("HELP", name), ("TYPE", name)} <= declared, f"{name} has no HELP / TYPE line before it"
        pairs = tuple(tuple(p.split("=", 1)) for p in labels.split(",")) if labels else ()
        samples[(name, tuple((k, v.strip('"')) for k, v in pairs))] = float(value)
    return samples


def metric(samples, name: str, **labels) -> float:
    return samples[(name, tuple(labels.items()))]


def test_metrics_count_requests_tokens_and_steps(server):
    url = server.url
    prompts = ["1+2=", "34+5="]
    completions = [
        httpx.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 5, "ignore_eos": True}, timeout=60).json()
        for p in prompts
    ]
    assert httpx.post(url + "/v1/completions", json={"prompt": "1", "best_of": 2}, timeout=30).status_code == 400
    assert httpx.get(url + "/v1/nowhere", timeout=30).status_code == 404
    assert httpx.get(url + "/v1/models/tiny-test", timeout=30).status_code == 200
    response = httpx.get(url + "/metrics", timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = parse_metrics(response.text)
    assert metric(samples, "lmforge_requests_total", route="/v1/completions", status="200") == 2
    assert metric(samples, "lmforge_requests_total", route="/v1/completions", status="400") == 1
    assert metric(samples, "lmforge_requests_total", route="other", status="404") == 1
    assert metric(samples, "lmforge_requests_total", route="/v1/models/{model_id:path}", status="200") == 1
    assert metric(samples, "lmforge_prompt_tokens_total") == sum(c["usage"]["prompt_tokens"] for c in completions)
    assert metric(samples, "lmforge_generation_tokens_total") == 10
    # one request after the other, 5 tokens each: a decode step after every token but the last
    assert metric(samples, "lmforge_decode_steps_total") == 8
    assert metric(samples, "lmforge_weight_version") == 0
    assert metric(samples, "lmforge_rows_running") == 0 and metric(samples, "lmforge_requests_waiting") == 0
    assert metric(samples, "lmforge_batch_rows_max") == 32 and metric(samples, "lmforge_batch_occupancy") == 0


def test_metrics_show_the_queue_and_the_batch(server, monkeypatch):
    """With room for one row, a second request waits while the first decodes."""
    scheduler = server.served.scheduler
    scheduler.max_batch_rows = 1
    step = scheduler._step

    def slow_step():  # 20 ms a decode step: the window to poll in lasts ~0.8 s, not 40 ms, on a fast machine too
        time.sleep(0.02)
        step()

    monkeypatch.setattr(scheduler, "_step", slow_step)
    body = {"prompt": "1+2=", "max_tokens": 40, "ignore_eos": True}
    threads = [
        threading.Thread(
            target=httpx.post, args=(server.url + "/v1/completions",), kwargs={"json": body, "timeout": 120}
        )
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    seen, deadline = None, time.monotonic() + 30
    while time.monotonic() < deadline:
        samples = parse_metrics(httpx.get(server.url + "/metrics", timeout=30).text)
        if metric(samples, "lmforge_requests_waiting") == 1 and metric(samples, "lmforge_rows_running") == 1:
            seen = samples  # (the first may still be prefilling, neither waiting nor running: polled past it)
            break
        time.sleep(0.01)
    for thread in threads:
        thread.join(120)
    assert seen is not None, "never saw one request decoding and one waiting"
    assert metric(seen, "lmforge_batch_occupancy") == 1.0


@pytest.fixture
def keyed(serve_model, make_tiny, monkeypatch):
    """A server started with an API key (build_app(served, api_key="sesame"))."""
    from lmforge.serve import app

    monkeypatch.setattr(app, "build_app", functools.partial(app.build_app, api_key="sesame"))
    return serve_model(*make_tiny())


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}, {"Authorization": "Bearer sesame2"}]
)
def test_an_api_key_guards_the_api(keyed, headers):
    for method, path, body in (
        ("POST", "/v1/completions", {"prompt": "1", "max_tokens": 1}),
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}]}),
        ("POST", "/inference/v1/generate", {"token_ids": [5]}),
        ("POST", "/tokenize", {"prompt": "1"}),
        ("POST", "/v1/responses", {"input": "1"}),
        ("GET", "/v1/weights", None),
        ("GET", "/nowhere", None),
    ):
        response = httpx.request(method, keyed.url + path, json=body, headers=headers, timeout=30)
        assert response.status_code == 401, (path, response.text)
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"


def test_the_right_key_opens_it_and_health_and_metrics_stay_open(keyed):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key="sesame", max_retries=0)
    assert client.completions.create(model="tiny-test", prompt="1+1=", max_tokens=2).choices[0].finish_reason
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(keyed.url + "/health", timeout=30).status_code == 200
    samples = parse_metrics(httpx.get(keyed.url + "/metrics", timeout=30).text)
    assert metric(samples, "lmforge_requests_total", route="/v1/completions", status="200") == 1
    assert metric(samples, "lmforge_requests_total", route="/v1/models", status="401") == 1


def test_the_cli_takes_the_key_from_the_flag_or_the_environment(monkeypatch):
    from lmforge.serve.command import add_parser

    def parse(*argv):
        parser = argparse.ArgumentParser()
        add_parser(parser.add_subparsers())
        return parser, parser.parse_args(["serve", "tiny:llama", *argv])

    monkeypatch.delenv("LMFORGE_API_KEY", raising=False)
    assert parse()[1].api_key is None
    monkeypatch.setenv("LMFORGE_API_KEY", "from-env")
    parser, args = parse()
    assert args.api_key == "from-env"
    assert parse("--api-key", "flag")[1].api_key == "flag"
    serve_help = parser._subparsers._group_actions[0].choices["serve"].format_help()
    assert "--api-key" in serve_help and "LMFORGE_API_KEY" in serve_help


def test_the_bearer_scheme_is_case_insensitive(keyed):
    for header in ("bearer sesame", "BEARER sesame", "Bearer  sesame"):
        response = httpx.get(keyed.url + "/v1/models", headers={"Authorization": header}, timeout=30)
        assert response.status_code == 200, header
