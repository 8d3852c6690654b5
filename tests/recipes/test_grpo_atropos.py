"""``lmforge grpo rollout.backend=atropos`` against a scripted Atropos API and weight server (in-process,
plain http.server): the pulled batch trains exactly as the same rollout sampled in process, staleness is
measured and bounded, weights are pushed every ``push_every`` steps, a dead API is retried with backoff
and then stops the run with its checkpoints intact, and a malformed batch names its field."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from lmforge.core.config import ModelConfig, load_config
from lmforge.core.errors import ConfigError
from lmforge.model.load import load_model
from lmforge.recipes.grpo import GRPOConfig, run_grpo
from lmforge.rl.sources import atropos as atropos_source
from lmforge.rl.sources import sampled as sampled_source
from lmforge.rl.sources.atropos_client import AtroposError

TINY = dict(name="tiny:llama", tokenizer="char", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32)
ARGS = [f"model.{k}={v}" for k, v in TINY.items()] + [
    "data.task=addition",
    "data.num_train=64",
    "data.num_eval=0",
    "rollout.num_prompts=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "rewards.functions=[parity]",
    "train.max_steps=2",
    "train.micro_batch_size=2",
    "train.save_every=0",
    "train.threads=1",
    "optim.lr=1e-2",
    "logging.progress=false",
    # KL to the reference, two mini-batches (old logprobs recomputed), IS against the sampler's logprobs
    "algo.preset=grpo",
    "algo.num_mini_batches=2",
    "algo.is_level=token",
]
FAST_API = [
    "rollout.api_poll_s=0.01",
    "rollout.api_retries=2",
    "rollout.api_backoff_s=0.05",
    "rollout.api_timeout_s=20",
]


class FakeServices:
    """An Atropos API (/register, /batch answered from a script) and an lmforge-serve weight endpoint.

    ``batches``: the /batch replies in order, each a list of groups, None (``{"batch": null}``) or an int
    (that HTTP status); once the script is used up, ``after`` answers (default ``{"batch": null}``).
    """

    def __init__(self, batches=(), after=None):
        self.batches, self.after = list(batches), after
        self.registered, self.pushed, self.batch_calls = [], [], 0
        self.version = 0
        services = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/batch":
                    services.batch_calls += 1
                    item = services.batches.pop(0) if services.batches else services.after
                    if isinstance(item, int):
                        return self.reply(item, {"detail": "scripted failure"})
                    return self.reply(200, {"batch": item})
                if self.path == "/v1/weights":
                    return self.reply(200, {"weight_version": services.version})
                self.reply(404, {})

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path == "/register":
                    services.registered.append(json.loads(body))
                    return self.reply(200, {"uuid": 7})
                if self.path.startswith("/v1/weights/tensors"):
                    from safetensors.torch import load

                    version = int(self.path.split("version=")[1])
                    services.pushed.append((version, load(body)))
                    services.version = version
                    return self.reply(200, {"weight_version": version})
                self.reply(404, {})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def services():
    made = []

    def make(*args, **kwargs):
        made.append(FakeServices(*args, **kwargs))
        return made[-1]

    yield make
    for s in made:
        s.close()


def to_groups(rollout, rewards, group_size, version=None):
    """An in-process rollout as the Atropos groups an environment would post for it."""
    groups = []
    for start in range(0, rollout.prompt_ids.shape[0], group_size):
        group = {
            "tokens": [],
            "masks": [],
            "scores": [],
            "inference_logprobs": [],
            "generation_params": None if version is None else {"weight_version": version},
        }
        for b in range(start, start + group_size):
            prompt = rollout.prompt_ids[b][rollout.prompt_mask[b].bool()].tolist()
            n = int(rollout.completion_lens[b])
            completion = rollout.completion_ids[b, :n].tolist()
            group["tokens"].append(prompt + completion)
            group["masks"].append([-100] * len(prompt) + completion)
            group["scores"].append(float(rewards[b]))
            group["inference_logprobs"].append([1.0] * len(prompt) + rollout.logprobs[b, :n].tolist())
        groups.append(group)
    return groups


def tiny():
    return load_model(ModelConfig(**TINY))


def run(tmp_path, name, extra, model=None):
    model, tokenizer = model or tiny()
    result = run_grpo(
        load_config(GRPOConfig, None, ARGS + [f"train.output_dir={tmp_path / name}"] + extra), model, tokenizer
    )
    return model, result


def metrics(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["kind"] == "train"}


def test_pulled_batch_trains_exactly_as_the_same_rollout_in_process(tmp_path, services, monkeypatch):
    # Run A samples in process; every step's rollout and rewards are recorded. Run B pulls the same
    # rollouts as Atropos groups (tokens, masks, scores, inference logprobs): same weights after 2 steps.
    sampled = []
    real = sampled_source.sample_and_score

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        sampled.append((out[0], out[1].total.clone()))
        return out

    monkeypatch.setattr(sampled_source, "sample_and_score", recording)
    in_process, result_a = run(tmp_path, "inprocess", [])
    monkeypatch.setattr(sampled_source, "sample_and_score", real)
    assert len(sampled) == 2 and sampled[0][0].logprobs is not None
    # the two steps' rewards differ within groups, so the update is not zero
    assert any(float(rewards.std()) > 0 for _, rewards in sampled)

    api = services([to_groups(r, rewards, 4, version=k) for k, (r, rewards) in enumerate(sampled)])
    pulled, result_b = run(
        tmp_path,
        "atropos",
        ["rollout.backend=atropos", f"rollout.api_url={api.url}", f"rollout.server_url={api.url}"] + FAST_API,
    )
    start, _ = tiny()
    moved = max(float((a - s).detach().abs().max()) for a, s in zip(in_process.parameters(), start.parameters()))
    assert moved > 1e-3, "the in-process run did not move the weights: nothing is compared"
    for (name, a), b in zip(in_process.named_parameters(), pulled.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=f"{name} differs")
    a, b = metrics(result_a["run_dir"]), metrics(result_b["run_dir"])
    for step in (1, 2):
        for key in ("reward", "loss", "kl", "grad_norm", "rollout_diff_abs_max", "rollout_ratio_mean"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-6), (step, key)
        assert b[step]["staleness_max"] == 0 and b[step]["atropos_dropped_stale_groups"] == 0
    assert api.registered == [
        {
            "wandb_group": "",
            "wandb_project": "",
            "batch_size": 8,
            "max_token_len": api.registered[0]["max_token_len"],
            "checkpoint_dir": "",
            "save_checkpoint_interval": 2,
            "starting_step": 0,
            "num_steps": 2,
        }
    ]
    assert [v for v, _ in api.pushed] == [1, 2]  # push_every=1: after each step, versioned by the step
    for name, tensor in in_process.state_dict().items():  # the last push carries the final weights
        torch.testing.assert_close(api.pushed[-1][1][name], tensor, rtol=0, atol=0)


def test_ppo_pulled_batch_trains_as_the_same_rollout_in_process(tmp_path, services, monkeypatch):
    """``lmforge ppo`` takes the same backend (the rollout hook is shared): the same check, with PPO's
    value head, GAE and KL penalty in the reward."""
    from lmforge.recipes.ppo import PPOConfig, run_ppo

    args = [a for a in ARGS if not a.startswith("algo.")] + [
        "algo.is_level=token",
        "algo.num_mini_batches=2",
        "algo.kl_coef=0.05",
    ]
    sampled, real = [], sampled_source.sample_and_score

    def recording(*a, **k):
        out = real(*a, **k)
        sampled.append((out[0], out[1].total.clone()))
        return out

    def ppo(name, extra):
        model, tokenizer = tiny()
        result = run_ppo(
            load_config(PPOConfig, None, args + [f"train.output_dir={tmp_path / name}"] + extra), model, tokenizer
        )
        return model, result

    monkeypatch.setattr(sampled_source, "sample_and_score", recording)
    in_process, result_a = ppo("inprocess", [])
    monkeypatch.setattr(sampled_source, "sample_and_score", real)
    api = services([to_groups(r, rewards, 4, version=k) for k, (r, rewards) in enumerate(sampled)])
    pulled, result_b = ppo("atropos", ["rollout.backend=atropos", f"rollout.api_url={api.url}"] + FAST_API)
    start, _ = tiny()
    assert max(float((a - s).detach().abs().max()) for a, s in zip(in_process.parameters(), start.parameters())) > 1e-3
    for (name, a), b in zip(in_process.named_parameters(), pulled.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=f"{name} differs")
    a, b = metrics(result_a["run_dir"]), metrics(result_b["run_dir"])
    for step in (1, 2):
        for key in ("reward", "loss", "grad_norm", "rollout_diff_abs_max"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-6), (step, key)


def synthetic_groups(tokenizer, versions, seed=0):
    """Well-formed groups of 4 rows: a 5-token prompt, 1-4 completion tokens, scores with variance."""
    g = torch.Generator().manual_seed(seed)
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    groups = []
    for version in versions:
        group = {
            "tokens": [],
            "masks": [],
            "scores": [],
            "inference_logprobs": [],
            "generation_params": None if version is None else {"weight_version": version},
        }
        prompt = [digits[int(i)] for i in torch.randint(0, 10, (5,), generator=g)]
        for r in range(4):
            completion = [digits[int(i)] for i in torch.randint(0, 10, (1 + r % 4,), generator=g)]
            group["tokens"].append(prompt + completion)
            group["masks"].append([-100] * 5 + completion)
            group["scores"].append(float(r % 2))
            group["inference_logprobs"].append([1.0] * 5 + [-2.3] * len(completion))
        groups.append(group)
    return groups


def test_stale_groups_are_dropped_counted_and_push_every(tmp_path, services):
    _, tokenizer = tiny()
    # step 1 (weights v0) gets 3 groups: uses 2, keeps 1; step 2 (v0 weights still, push_every=2) ...
    # step 3 (v2): the kept v0 group is 2 behind (> max_staleness=1), dropped; a v0 group in the next
    # batch too; v1 / v2 groups are used (staleness 1 and 0).
    script = [
        synthetic_groups(tokenizer, [0, 0, 0]),
        synthetic_groups(tokenizer, [0, 0], 1),
        synthetic_groups(tokenizer, [0, 2, 1], 2),
        synthetic_groups(tokenizer, [2, 2], 3),
    ]
    api = services(script)
    _, result = run(
        tmp_path,
        "stale",
        [
            "rollout.backend=atropos",
            f"rollout.api_url={api.url}",
            "algo.is_level=none",
            f"rollout.server_url={api.url}",
            "rollout.push_every=2",
            "rollout.max_staleness=1",
            "train.max_steps=4",
        ]
        + FAST_API,
    )
    m = metrics(result["run_dir"])
    assert [m[k]["atropos_dropped_stale_groups"] for k in (1, 2, 3, 4)] == [0, 0, 2, 0]
    assert [m[k]["atropos_dropped_stale_total"] for k in (1, 2, 3, 4)] == [0, 0, 2, 2]
    assert [m[k]["staleness_max"] for k in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert m[3]["staleness_mean"] == pytest.approx(0.5) and m[4]["staleness_mean"] == pytest.approx(1.0)
    assert [v for v, _ in api.pushed] == [2, 4]  # push_every=2 over 4 steps


def rl_checkpoint_weights(step_dir):
    """The model weights a checkpoint holds (its HF ``model/`` directory)."""
    from safetensors.torch import load_file

    return load_file(str(next((Path(step_dir) / "model").glob("*.safetensors"))))


def test_api_down_retries_with_backoff_then_stops_resumably(tmp_path, services):
    _, tokenizer = tiny()
    api = services([synthetic_groups(tokenizer, [None, None]), synthetic_groups(tokenizer, [None, None], 1)], after=503)
    extra = [
        "rollout.backend=atropos",
        f"rollout.api_url={api.url}",
        "algo.is_level=none",
        "train.max_steps=3",
        "train.save_every=1",
    ] + FAST_API
    start = time.monotonic()
    with pytest.raises(AtroposError, match=r"GET .*/batch failed after 3 attempts \(last: status 503.*resumed"):
        run(tmp_path, "down", extra)
    calls_after_the_two_batches = api.batch_calls - 2
    assert calls_after_the_two_batches == 3  # one try + api_retries=2 retries
    assert time.monotonic() - start >= 0.05 + 0.1  # backoff 0.05 s, then 0.1 s
    checkpoints = sorted(p.name for p in (tmp_path / "down" / "checkpoints").iterdir())
    assert checkpoints == ["step-000001", "step-000002"]
    # the API is back: the run resumes from its last checkpoint and finishes
    api.after = None
    api.batches = [synthetic_groups(tokenizer, [None, None], 2)]
    resume = [f"train.resume={tmp_path / 'down' / 'checkpoints' / 'step-000002'}", f"rollout.server_url={api.url}"]
    api.version = 5  # an inference server ahead of the resumed step: refused, it must be restarted first
    with pytest.raises(AtroposError, match="serves weight version 5, but the run resumed at step 2"):
        run(tmp_path, "down", extra + resume)
    api.version = 0
    _, result = run(tmp_path, "down", extra + resume)
    assert sorted(metrics(result["run_dir"])) == [1, 2, 3]
    assert api.registered[-1]["starting_step"] == 2
    # the resumed weights went to the server as version 2 before the first pull, step 3's after it
    assert [v for v, _ in api.pushed] == [2, 3]
    saved = rl_checkpoint_weights(tmp_path / "down" / "checkpoints" / "step-000002")
    for name, tensor in saved.items():
        torch.testing.assert_close(api.pushed[0][1][name], tensor, rtol=0, atol=0)

    dead = services()
    dead.close()  # nothing listens there any more: connection refused, retried, then the error
    with pytest.raises(AtroposError, match="POST .*/register failed after 3 attempts.*run-api"):
        run(tmp_path, "dead", ["rollout.backend=atropos", f"rollout.api_url={dead.url}"] + FAST_API)


@pytest.mark.parametrize(
    "field,breaks,needle",
    [
        ("masks", lambda g: g.pop("masks"), "field 'masks' is missing"),
        ("scores", lambda g: g["scores"].__setitem__(1, "high"), "row 1: field 'scores' holds 'high'"),
        ("tokens", lambda g: g["tokens"].pop(), "field 'tokens' holds 3 rows, but rollout.group_size=4"),
        ("inference_logprobs", lambda g: g["inference_logprobs"][2].pop(), "row 2: 8 inference_logprobs for 9 tokens"),
        ("masks", lambda g: g["masks"].__setitem__(0, [-100] * len(g["tokens"][0])), "row 0: every mask entry is -100"),
    ],
)
def test_malformed_batch_names_the_field(tmp_path, services, field, breaks, needle):
    _, tokenizer = tiny()
    groups = synthetic_groups(tokenizer, [None, None])
    if field == "inference_logprobs":
        groups[1]["tokens"][2] = groups[1]["tokens"][2][:5] + [groups[1]["tokens"][2][5]] * 4
        groups[1]["masks"][2] = [-100] * 5 + groups[1]["tokens"][2][5:]
        groups[1]["inference_logprobs"][2] = [1.0] * 5 + [-1.0] * 4
    breaks(groups[1])
    api = services([groups])
    with pytest.raises(AtroposError, match="batch group 1") as info:
        run(tmp_path, "bad", ["rollout.backend=atropos", f"rollout.api_url={api.url}"] + FAST_API)
    assert needle in str(info.value)


def test_atropos_backend_needs_an_api_url():
    with pytest.raises(ConfigError, match="rollout.api_url"):
        load_config(GRPOConfig, None, ARGS + ["rollout.backend=atropos"])


def test_qat_with_the_atropos_backend_is_refused(tmp_path):
    """The inference server would sample the master weights, not the fake-quantized model trained."""
    with pytest.raises(ConfigError, match="train.qat needs rollout.backend=inprocess.*backend=atropos"):
        run_grpo(
            load_config(
                GRPOConfig,
                None,
                ARGS
                + [
                    "rollout.backend=atropos",
                    "rollout.api_url=http://127.0.0.1:9",
                    "train.qat=ternary",
                    f"train.output_dir={tmp_path / 'run'}",
                ],
            )
        )
    assert not (tmp_path / "run" / "checkpoints").exists()


RANKS_ARGS = [
    "rollout.backend=atropos",
    "rewards.functions=[exact]",
    "algo.preset=",
    "algo.num_mini_batches=1",
    "optim.eps=1e-3",
    "optim.weight_decay=0.0",
    "optim.schedule=constant",
    "train.dtype=fp32",
] + FAST_API


def rank_worker(rank: int, world: int, port: int, api_url: str, out: str) -> None:
    """A spawned gloo rank under torchrun's environment: the whole ``lmforge grpo`` run."""
    import os

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    converted, real = [], atropos_source.batch_to_rollout

    def recording(groups, pad_token_id):  # how many groups each conversion on this rank took
        converted.append(len(groups))
        return real(groups, pad_token_id)

    atropos_source.batch_to_rollout = recording
    run_grpo(
        load_config(GRPOConfig, None, ARGS + RANKS_ARGS + [f"rollout.api_url={api_url}", f"train.output_dir={out}"])
    )
    (Path(out) / f"converted-{rank}.json").write_text(json.dumps(converted))


@pytest.mark.slow  # 78 s on the busy 2-core machine: two spawned ranks start torch and transformers
def test_two_ranks_rank_zero_pulls_and_each_trains_its_share(tmp_path, services):
    import socket

    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    _, tokenizer = tiny()
    script = [synthetic_groups(tokenizer, [None, None], seed) for seed in (0, 1)]
    single_api, ranks_api = services(script), services([list(s) for s in script])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(tmp_path, "single", RANKS_ARGS + [f"rollout.api_url={single_api.url}"])
    finally:
        torch.set_num_threads(threads)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(
        rank_worker, args=(2, port, ranks_api.url, str(tmp_path / "ranks")), nprocs=2, start_method="spawn", join=True
    )
    # rank 0 alone talked to the API: one registration, one GET /batch per step
    assert len(ranks_api.registered) == 1 and ranks_api.batch_calls == 2
    # rank 0 checks each step's 2 groups, then each rank converts its own 1 group to train on
    assert json.loads((tmp_path / "ranks" / "converted-0.json").read_text()) == [2, 1, 2, 1]
    assert json.loads((tmp_path / "ranks" / "converted-1.json").read_text()) == [1, 1]
    want = load_file(str(tmp_path / "single" / "final" / "model.safetensors"))
    got = load_file(str(tmp_path / "ranks" / "final" / "model.safetensors"))
    start = tiny()[0].state_dict()
    assert max(float((want[k] - start[k]).abs().max()) for k in want) > 1e-3  # the runs trained
    for key in want:  # each rank trained one group of each step: together, the single process's update
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=2e-5, msg=key)
    a, b = metrics(tmp_path / "single"), metrics(tmp_path / "ranks")
    for step in (1, 2):
        assert b[step]["reward"] == a[step]["reward"]  # over the step's whole batch, on every rank
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=2e-5, abs=1e-7)


def test_a_refused_weight_push_is_not_retried(monkeypatch):
    """A 4xx from the inference server (wrong names, a version that does not increase) is an error at
    once, naming the version; a 5xx is retried (rollout.api_retries), then an error."""
    from types import SimpleNamespace

    import httpx

    calls = []

    def answering(method, url, **kwargs):
        calls.append(kwargs["params"]["version"])
        return httpx.Response(status, json={"error": "unexpected names"})

    monkeypatch.setattr(httpx, "request", answering)
    source = object.__new__(atropos_source.AtroposSource)
    source.rollout = SimpleNamespace(
        server_url="http://127.0.0.1:9", api_retries=3, api_backoff_s=0.0, push_timeout_s=600.0
    )
    model = torch.nn.Linear(2, 2)
    status = 400
    with pytest.raises(AtroposError, match="pushing weights version 5 .* was refused \\(400\\)"):
        source._push(model, 5)
    assert calls == [5]
    status = 503
    with pytest.raises(AtroposError, match="after 4 attempts"):
        source._push(model, 6)
    assert calls == [5, 6, 6, 6, 6]
