"""The Atropos trainer contract against atroposlib's real API server (`run-api`, started locally on a free
port; it runs offline): register, environments post scored groups, pull_batch turns them into a
RolloutBatch + rewards; staleness dropping, malformed batches, an unreachable API; and the loop with
lmforge serve in it: an environment samples from the server, the trainer pulls and pushes weights."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import torch

from lmforge.rl import pack_rollout
from lmforge.rl.sources.atropos_client import AtroposError, pull_batch, register

httpx = pytest.importorskip("httpx")
pytest.importorskip("atroposlib")
PAD = 0


@pytest.fixture(scope="module")
def api_url():
    run_api = shutil.which("run-api")
    if run_api is None:
        pytest.skip("atroposlib's run-api is not on PATH")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [run_api, "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/status", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "run-api did not start"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(30)


@pytest.fixture
def registered(api_url):
    """A fresh API state with a trainer registered for batches of 4 sequences."""
    httpx.get(api_url + "/reset_data", timeout=10)
    register(api_url, batch_size=4, max_token_len=64, num_steps=10)
    return api_url


def _post_group(
    url: str,
    rows: list[tuple[list[int], list[int], list[float]]],
    scores: list[float],
    version: int | None = None,
    **extra,
) -> None:
    """As an environment does: tokens = prompt + completion, masks -100 on the prompt, logprobs 1.0 there."""
    body = {
        "tokens": [p + c for p, c, _ in rows],
        "masks": [[-100] * len(p) + c for p, c, _ in rows],
        "scores": scores,
        "inference_logprobs": [[1.0] * len(p) + lp for p, _, lp in rows],
        **extra,
    }
    if version is not None:
        body["generation_params"] = {"weight_version": version}
    response = httpx.post(url + "/scored_data", json=body, timeout=10)
    assert response.status_code == 200, response.text


def test_pull_batch_builds_the_rollout_the_trainer_packs(registered):
    _post_group(
        registered,
        [([1, 5, 6], [7, 2], [-0.5, -0.25]), ([1, 5, 6], [8, 9, 2], [-1.0, -2.0, -0.125])],
        [1.0, 0.0],
        version=3,
    )
    _post_group(registered, [([1, 4], [7], [-0.75]), ([1, 4], [9, 9], [-0.5, -1.5])], [0.5, 0.25], version=4)
    rollout, rewards, metrics = pull_batch(registered, pad_token_id=PAD, trainer_step=5, poll_s=0.05, timeout_s=30)
    assert rollout.prompt_ids.tolist() == [[1, 5, 6], [1, 5, 6], [0, 1, 4], [0, 1, 4]]  # left-padded
    assert rollout.prompt_mask.tolist() == [[1, 1, 1], [1, 1, 1], [0, 1, 1], [0, 1, 1]]
    assert rollout.completion_ids.tolist() == [[7, 2, 0], [8, 9, 2], [7, 0, 0], [9, 9, 0]]  # right-padded
    assert rollout.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert rollout.logprobs.tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, -0.125], [-0.75, 0.0, 0.0], [-0.5, -1.5, 0.0]]
    assert rollout.group_index.tolist() == [0, 0, 1, 1] and rollout.prompt_lens.tolist() == [3, 3, 2, 2]
    assert rollout.completion_lens.tolist() == [2, 3, 1, 2] and not rollout.truncated.any()
    assert rewards.tolist() == [1.0, 0.0, 0.5, 0.25]
    assert float(metrics["staleness_mean"]) == 1.5 and float(metrics["staleness_max"]) == 2  # 5-3, 5-4
    assert float(metrics["atropos_dropped_stale_groups"]) == 0
    packed = pack_rollout(rollout, PAD, need_rollout_logprobs=True)  # what the GRPO loss consumes
    assert packed.input_ids.tolist() == [[1, 5, 6, 7, 2, 0], [1, 5, 6, 8, 9, 2], [1, 4, 7, 0, 0, 0], [1, 4, 9, 9, 0, 0]]


def test_stale_groups_are_dropped_and_counted(registered):
    _post_group(registered, [([1, 5], [7], [-0.5])] * 2, [1.0, 0.0], version=2)  # 10 - 2 = 8 steps old
    _post_group(registered, [([1, 4], [8], [-0.25])] * 2, [0.0, 1.0], version=9)  # 1 step old
    rollout, rewards, metrics = pull_batch(
        registered, pad_token_id=PAD, trainer_step=10, max_staleness=4, poll_s=0.05, timeout_s=30
    )
    assert rollout.completion_ids[:, 0].tolist() == [8, 8] and rewards.tolist() == [0.0, 1.0]
    assert float(metrics["atropos_dropped_stale_groups"]) == 1 and float(metrics["staleness_max"]) == 1


def test_a_multi_turn_row_trains_only_the_spans_its_mask_marks(registered):
    """Model turn [7, 8], tool output [30, 31] (masked, placeholder logprobs 1.0), model turn [9]: one
    completion of 5 tokens whose trained mask has two spans; the packed row predicts only those."""
    tokens = [1, 5, 7, 8, 30, 31, 9]
    masks = [-100, -100, 7, 8, -100, -100, 9]
    logprobs = [1.0, 1.0, -0.5, -0.25, 1.0, 1.0, -0.125]
    body = {
        "tokens": [tokens, tokens[:3]],
        "masks": [masks, masks[:3]],
        "scores": [1.0, 0.0],
        "inference_logprobs": [logprobs, logprobs[:3]],
    }
    assert httpx.post(registered + "/scored_data", json=body, timeout=10).status_code == 200
    _post_group(registered, [([1, 4], [8], [-0.25])] * 2, [0.0, 1.0])
    rollout, rewards, _ = pull_batch(registered, pad_token_id=PAD, poll_s=0.05, timeout_s=30)
    assert rollout.completion_ids[0].tolist() == [7, 8, 30, 31, 9]
    assert rollout.completion_mask[0].tolist() == [1, 1, 1, 1, 1]
    assert rollout.trained_mask[0].tolist() == [1, 1, 0, 0, 1]
    assert rollout.trained_mask[1].tolist() == [1, 0, 0, 0, 0] and rollout.completion_mask[1].tolist() == [
        1,
        0,
        0,
        0,
        0,
    ]
    assert rollout.logprobs[0].tolist() == [-0.5, -0.25, 0.0, 0.0, -0.125]  # the placeholders are not kept
    packed = pack_rollout(rollout, PAD, need_rollout_logprobs=True)
    assert packed.input_ids[0].tolist() == tokens
    # the logits at positions 1, 2 and 5 predict the trained tokens 7, 8 and 9; none predicts 30 or 31
    assert packed.positions[0].nonzero().flatten().tolist() == [1, 2, 5]
    assert packed.segment_ids[0].tolist() == [1, 1, 0, 0, 2]


@pytest.mark.parametrize(
    "rows, extra, needle",
    [
        (
            [([1, 5], [7], [-0.5]), ([1, 5], [7, 8], [-0.5])],
            {"masks": [[-100, -100, 7], [-100, -100, 7]]},
            "group 0 row 1: 4 tokens but 3 mask entries",
        ),
        (
            [([1, 5], [7], [-0.5])] * 2,
            {"inference_logprobs": [[1.0, 1.0, 1.0]] * 2},
            "group 0 row 0: an inference logprob on a completion token is 1 > 0",
        ),
        ([([1, 5], [7], [-0.5])] * 2, {"advantages": [[0.0, 0.0, 1.0]] * 2}, "group 0 carries per-token advantages"),
    ],
)
def test_malformed_batches_name_group_and_row(registered, rows, extra, needle):
    _post_group(registered, rows, [1.0, 0.0], **extra)
    _post_group(registered, [([1, 4], [8], [-0.25])] * 2, [0.0, 1.0])
    with pytest.raises(AtroposError, match=needle.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        pull_batch(registered, pad_token_id=PAD, poll_s=0.05, timeout_s=30)


def test_no_batch_in_time_and_unreachable_api(registered):
    with pytest.raises(AtroposError, match="no batch from .* within 0 s"):
        pull_batch(registered, pad_token_id=PAD, poll_s=0.05, timeout_s=0.2)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    start = time.monotonic()
    with pytest.raises(AtroposError, match="failed after 3 attempts .* is the Atropos API server"):
        pull_batch(dead, pad_token_id=PAD, retries=2, backoff_s=0.1)
    assert time.monotonic() - start >= 0.3  # backoff 0.1 + 0.2 s between the three attempts


def test_environment_samples_from_lmforge_serve_and_trainer_pushes_weights(registered, server, make_tiny):
    """The loop with the real pieces but the optimizer: an environment asks lmforge serve for 2 samples per
    prompt (token ids + logprobs + weight_version), scores them and posts the group; the trainer pulls the
    batch, gets exactly those ids and logprobs, and pushes new weights that the next samples report."""
    from lmforge.serve import push_weights

    def environment_step(prompt: list[int]) -> dict:
        body = httpx.post(
            server.url + "/v1/completions",
            timeout=60,
            json={"prompt": prompt, "n": 2, "max_tokens": 5, "logprobs": 1, "temperature": 1.0},
        ).json()
        rows = [(prompt, c["token_ids"], c["logprobs"]["token_logprobs"]) for c in body["choices"]]
        _post_group(
            registered, rows, [float(len(c["token_ids"])) for c in body["choices"]], version=body["weight_version"]
        )
        return body

    sampled = [environment_step([1, 5, 6]), environment_step([1, 7])]
    rollout, rewards, metrics = pull_batch(registered, pad_token_id=PAD, trainer_step=0, poll_s=0.05, timeout_s=30)
    for b, choice in enumerate(c for body in sampled for c in body["choices"]):
        length = len(choice["token_ids"])
        assert rollout.completion_ids[b, :length].tolist() == choice["token_ids"]
        torch.testing.assert_close(
            rollout.logprobs[b, :length], torch.tensor(choice["logprobs"]["token_logprobs"]), rtol=0, atol=0
        )
    assert float(metrics["staleness_max"]) == 0
    new_model, _ = make_tiny(seed=1)
    assert push_weights(server.url, new_model, version=1) == 1
    assert environment_step([1, 5, 6])["weight_version"] == 1


def _rank_worker(rank: int, port: int, urls: list[str], out_dir: str) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    try:
        rollout, rewards, _ = pull_batch(urls[rank], pad_token_id=PAD, poll_s=0.05, timeout_s=60, retries=0)
        torch.save(
            {"ids": rollout.completion_ids, "logprobs": rollout.logprobs, "rewards": rewards},
            f"{out_dir}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def test_rank_zero_fetches_and_broadcasts(registered, tmp_path):
    """Two gloo ranks: only rank 0 can reach the API (rank 1 is given a dead URL, so it would fail if it
    called it); both get the same batch."""
    import torch.multiprocessing as mp

    _post_group(registered, [([1, 5], [7, 2], [-0.5, -0.25])] * 2, [1.0, 0.0])
    _post_group(registered, [([1, 4], [8], [-0.75])] * 2, [0.0, 1.0])
    ports = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    mp.start_processes(
        _rank_worker,
        args=(ports[0], [registered, f"http://127.0.0.1:{ports[1]}"], str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    zero, one = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert zero["ids"].tolist() == one["ids"].tolist() == [[7, 2], [7, 2], [8, 0], [8, 0]]
    assert zero["rewards"].tolist() == one["rewards"].tolist() == [1.0, 0.0, 0.0, 1.0]
    torch.testing.assert_close(one["logprobs"], zero["logprobs"], rtol=0, atol=0)
