"""vLLM rollout backend without vLLM: output conversion, request mapping, weight-sync names and
values, sleep/wake bookkeeping and the install / CUDA / version errors, all against fakes shaped
like vLLM's objects (RequestOutput, CompletionOutput, Logprob, LLM, worker)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import types
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import transformers

from lmforge.core.errors import ConfigError
from lmforge.model.tokenizer import char_tokenizer
from lmforge.rollout.engine import SamplingParams
from lmforge.rollout.vllm_backend import (
    VLLMEngine,
    import_vllm,
    load_weights_on_worker,
    row_seeds,
    to_rollout_batch,
    vllm_named_weights,
    vllm_sampling_params,
)

PAD, EOS = 0, 2
PROMPTS = [[1, 5, 6], [1, 7]]


# ----------------------------------------------------------------------------- vLLM-shaped outputs


@dataclass
class Logprob:
    logprob: float
    rank: int = 1
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str
    stop_reason: Any = None
    index: int = 0
    text: str = ""


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


def completion(tokens, values, finish, stop_reason=None):
    # A likelier, unsampled entry first at each position (as with logprobs=N) must not be picked up.
    entries = [{tok + 100: Logprob(-0.01, rank=1), tok: Logprob(v, rank=2)} for tok, v in zip(tokens, values)]
    return CompletionOutput(list(tokens), entries, finish, stop_reason)


def four_rows():
    return [
        completion([9, 2], [-0.5, -0.25], "stop", stop_reason=2),  # stop token: kept, masked in
        completion([9, 8, 7], [-1.0, -2.0, -3.0], "length"),  # hit max_tokens
        completion([4], [-0.75], "stop", stop_reason="\n"),  # stop string
        completion([3, 2], [-1.5, -0.125], "length"),  # stop token at the last allowed step
    ]


def test_conversion_matches_engine_layout():
    rows = four_rows()
    outputs = [RequestOutput(PROMPTS[i // 2], [c]) for i, c in enumerate(rows)]
    batch = to_rollout_batch(outputs, PROMPTS, num_samples=2, stop_token_ids=[EOS], pad_token_id=PAD)
    assert batch.prompt_ids.tolist() == [[1, 5, 6], [1, 5, 6], [0, 1, 7], [0, 1, 7]]
    assert batch.prompt_mask.tolist() == [[1, 1, 1], [1, 1, 1], [0, 1, 1], [0, 1, 1]]
    assert batch.completion_ids.tolist() == [[9, 2, 0], [9, 8, 7], [4, 0, 0], [3, 2, 0]]
    assert batch.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]]
    expected = torch.tensor([[-0.5, -0.25, 0], [-1, -2, -3], [-0.75, 0, 0], [-1.5, -0.125, 0]])
    torch.testing.assert_close(batch.logprobs, expected, rtol=0, atol=0)
    assert batch.logprobs.dtype == torch.float32
    assert batch.group_index.tolist() == [0, 0, 1, 1]
    assert batch.prompt_lens.tolist() == [3, 3, 2, 2]
    assert batch.completion_lens.tolist() == [2, 3, 1, 2]
    assert batch.truncated.tolist() == [False, True, False, False]
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "group_index"):
        assert getattr(batch, name).dtype == torch.long, name


def test_conversion_one_request_per_prompt_gives_the_same_batch():
    rows = four_rows()
    per_row = to_rollout_batch(
        [RequestOutput(PROMPTS[i // 2], [c]) for i, c in enumerate(rows)], PROMPTS, 2, [EOS], PAD
    )
    per_prompt = to_rollout_batch(
        [RequestOutput(PROMPTS[0], rows[:2]), RequestOutput(PROMPTS[1], rows[2:])], PROMPTS, 2, [EOS], PAD
    )
    # single-turn: every completion token trained, one sample per episode (no episode index)
    for name in ("trained_mask", "episode_index"):
        assert getattr(per_row, name) is None and getattr(per_prompt, name) is None, name
    for f in dataclasses.fields(per_row):
        if f.name not in ("trained_mask", "episode_index"):
            assert torch.equal(getattr(per_row, f.name), getattr(per_prompt, f.name)), f.name


@pytest.mark.parametrize(
    "breakage, error",
    [
        (lambda rows: rows[:3], ValueError),  # a completion missing
        (lambda rows: [dataclasses.replace(rows[0], logprobs=None), *rows[1:]], RuntimeError),
        (lambda rows: [dataclasses.replace(rows[0], finish_reason="abort"), *rows[1:]], RuntimeError),
        (
            lambda rows: [dataclasses.replace(rows[0], logprobs=[{7: Logprob(-1.0)}, {2: Logprob(-1.0)}]), *rows[1:]],
            RuntimeError,
        ),  # the sampled token 9 has no logprob entry
    ],
)
def test_conversion_rejects_malformed_outputs(breakage, error):
    outputs = [RequestOutput([1], [c]) for c in breakage(four_rows())]
    with pytest.raises(error):
        to_rollout_batch(outputs, PROMPTS, 2, [EOS], PAD)


# ----------------------------------------------------------------------------- a fake vllm module


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.top_k = kwargs.get("top_k", -1)  # this "version" spells top-k off as -1


@dataclasses.dataclass
class FakeEngineArgs:
    model: str = ""
    logprobs_mode: str = "raw_logprobs"


class FakeVLLMModel:
    """vLLM's model as the weight sync sees it: checkpoint-named parameters, load_weights by name."""

    def __init__(self, hf_model, extra: tuple[str, ...] = ()):
        self.hf, self.extra, self.received = hf_model, extra, []

    def named_parameters(self):
        yield from self.hf.named_parameters()
        for name in self.extra:
            yield name, torch.zeros(1)

    def load_weights(self, weights):
        params = dict(self.hf.named_parameters())
        self.received.append([name for name, _ in weights])
        for name, tensor in weights:
            params[name].data.copy_(tensor)
        return {name for name, _ in weights}


class FakeLLM:
    """Records what it is asked; ``generate`` answers each request with [last prompt token + 1, EOS]."""

    extra_params: tuple[str, ...] = ()

    def __init__(self, model: str, **kwargs):
        self.path, self.kwargs, self.calls, self.requests = model, kwargs, [], []
        self.llm_engine = types.SimpleNamespace(model_executor=object())  # in-process, as the engine needs
        config = transformers.AutoConfig.from_pretrained(model)
        self.vllm_model = FakeVLLMModel(transformers.AutoModelForCausalLM.from_config(config), self.extra_params)
        self.worker = types.SimpleNamespace(get_model=lambda: self.vllm_model)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append("rpc")
        return [method(self.worker, *args, **(kwargs or {}))]

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        self.requests.append((prompts, sampling_params))
        tokens = [[p["prompt_token_ids"][-1] + 1, EOS] for p in prompts]
        return [
            RequestOutput(p["prompt_token_ids"], [completion(t, [-0.5, -0.25], "stop", EOS)])
            for p, t in zip(prompts, tokens)
        ]

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")


def make_fake_vllm(llm_class=FakeLLM, engine_args=FakeEngineArgs):
    module = types.ModuleType("vllm")
    module.__version__ = "0.0.fake"
    module.LLM, module.SamplingParams, module.EngineArgs = llm_class, FakeSamplingParams, engine_args
    return module


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)  # restored after the test
    module = make_fake_vllm()
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


def tiny_model(tied: bool = False):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )
    return transformers.LlamaForCausalLM(config)


@pytest.fixture
def tokenizer():
    return char_tokenizer("0123456789+=\n")


def assert_same_weights(vllm_model: FakeVLLMModel, model):
    theirs = dict(vllm_model.hf.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(theirs[name], param), name


# ----------------------------------------------------------------------------- requests


def test_sampling_params_map_to_vllm():
    vllm = make_fake_vllm()
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12, stop_token_ids=[EOS], seed=5)
    out = vllm_sampling_params(vllm, params, num_rows=4)
    assert len(out) == 4
    kwargs = out[0].kwargs
    assert {
        k: kwargs[k]
        for k in (
            "n",
            "temperature",
            "top_p",
            "top_k",
            "max_tokens",
            "stop_token_ids",
            "ignore_eos",
            "logprobs",
            "detokenize",
        )
    } == {
        "n": 1,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "max_tokens": 12,
        "stop_token_ids": [EOS],
        "ignore_eos": True,
        "logprobs": 0,
        "detokenize": False,
    }
    assert "stop" not in kwargs
    seeds = [p.kwargs["seed"] for p in out]
    assert seeds == row_seeds(5, 4) and len(set(seeds)) == 4  # per-row, reproducible, distinct
    assert row_seeds(6, 4) != seeds and row_seeds(None, 3) == [None] * 3

    with_strings = vllm_sampling_params(vllm, SamplingParams(top_k=5, stop_strings=["\n"]), 1)[0].kwargs
    assert with_strings["stop"] == ["\n"] and "detokenize" not in with_strings and with_strings["top_k"] == 5


# ----------------------------------------------------------------------------- weight names


@pytest.mark.parametrize("tied", [False, True])
def test_named_weights_one_per_parameter_tied_sent_as_embedding(tied):
    model = tiny_model(tied)
    weights = vllm_named_weights(model)
    names = [name for name, _ in weights]
    assert names == [name for name, _ in model.named_parameters()]
    assert ("lm_head.weight" in names) is not tied and "model.embed_tokens.weight" in names
    params = dict(model.named_parameters())
    for name, tensor in weights:  # views of the trainer's parameters, not copies
        assert tensor.data_ptr() == params[name].data_ptr() and not tensor.requires_grad


def test_named_weights_prefer_embedding_name_whatever_the_registration_order():
    class HeadFirst(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(4, 10, bias=False)
            self.model = torch.nn.Module()
            self.model.embed_tokens = torch.nn.Embedding(10, 4)
            self.lm_head.weight = self.model.embed_tokens.weight

    model = HeadFirst()
    assert next(iter(dict(model.named_parameters()))) == "lm_head.weight"
    assert [n for n, _ in vllm_named_weights(model)] == ["model.embed_tokens.weight"]


def test_named_weights_strip_wrapper_prefixes():
    model = tiny_model()
    compiled = torch.nn.Module()
    compiled._orig_mod = model  # where torch.compile's wrapper keeps the model
    wrapped = torch.nn.Module()
    wrapped.module = compiled  # and DDP's
    assert next(iter(dict(wrapped.named_parameters()))).startswith("module._orig_mod.")
    assert [n for n, _ in vllm_named_weights(wrapped)] == [n for n, _ in model.named_parameters()]


def test_worker_load_reports_unreached_parameters():
    model = tiny_model()
    target = FakeVLLMModel(tiny_model(), extra=("model.extra.weight",))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    missing = load_weights_on_worker(types.SimpleNamespace(get_model=lambda: target), vllm_named_weights(model))
    assert missing == ["model.extra.weight"]
    assert_same_weights(target, model)
    # Older workers have no get_model: the model is reached through model_runner.model.
    old_worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=FakeVLLMModel(tiny_model())))
    assert load_weights_on_worker(old_worker, vllm_named_weights(model)) == []


# ----------------------------------------------------------------------------- the engine on a fake LLM


def test_engine_builds_colocated_dummy_llm_and_syncs(fake_vllm, tokenizer):
    model = tiny_model()
    engine = VLLMEngine(model, tokenizer, gpu_memory_utilization=0.25, max_model_len=64)
    llm = engine.llm
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert llm.kwargs == dict(
        dtype="bfloat16",
        seed=0,
        gpu_memory_utilization=0.25,
        max_model_len=64,
        enable_sleep_mode=False,
        logprobs_mode="processed_logprobs",
        load_format="dummy",
    )
    config = json.loads(open(os.path.join(llm.path, "config.json")).read())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert os.path.exists(os.path.join(llm.path, "tokenizer_config.json"))
    assert llm.calls == ["rpc", "reset_prefix_cache"]  # dummy weights replaced at once
    assert_same_weights(llm.vllm_model, model)


@pytest.mark.parametrize("tied", [False, True])
def test_sync_weights_pushes_current_parameters(fake_vllm, tokenizer, tied):
    model = tiny_model(tied)
    engine = VLLMEngine(model, tokenizer)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-2.0)  # an optimizer step
    engine.sync_weights(model)
    assert_same_weights(engine.llm.vllm_model, model)
    received = engine.llm.vllm_model.received[-1]
    assert ("lm_head.weight" in received) is not tied
    assert engine.llm.calls[-1] == "reset_prefix_cache"


def test_generate_sends_rows_in_group_order(fake_vllm, tokenizer):
    engine = VLLMEngine(tiny_model(), tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=[EOS], seed=7)
    batch = engine.generate(PROMPTS, params, num_samples=3)
    requests, sampling = engine.llm.requests[-1]
    assert requests == [{"prompt_token_ids": p} for p in PROMPTS for _ in range(3)]
    assert [s.kwargs["seed"] for s in sampling] == row_seeds(7, 6)
    assert batch.group_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert batch.completion_ids.tolist() == [[7, EOS]] * 3 + [[8, EOS]] * 3
    assert batch.prompt_ids.tolist() == [[1, 5, 6]] * 3 + [[PAD, 1, 7]] * 3
    assert batch.truncated.tolist() == [False] * 6
    torch.testing.assert_close(batch.logprobs, torch.tensor([[-0.5, -0.25]] * 6), rtol=0, atol=0)


def test_generate_checks_inputs(fake_vllm, tokenizer):
    engine = VLLMEngine(tiny_model(), tokenizer, max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=6))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[1], []], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="num_samples"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2), num_samples=0)
    assert engine.llm.requests == []  # nothing reached vLLM


def test_sleep_discards_weights_until_synced(fake_vllm, tokenizer):
    model = tiny_model()
    with pytest.raises(RuntimeError, match="enable_sleep_mode"):
        VLLMEngine(model, tokenizer).sleep()
    engine = VLLMEngine(model, tokenizer, enable_sleep_mode=True)
    params = SamplingParams(max_new_tokens=2, stop_token_ids=[EOS])
    engine.sleep()  # level 2: weights and KV cache dropped
    with pytest.raises(RuntimeError, match="sync_weights"):
        engine.generate(PROMPTS, params)
    engine.wake_up()
    with pytest.raises(RuntimeError, match="sync_weights"):  # awake, but the weights are garbage
        engine.generate(PROMPTS, params)
    engine.sleep()
    engine.llm.calls.clear()
    engine.sync_weights(model)
    # Weights woken and loaded before the KV cache is reallocated; prefix cache dropped.
    assert engine.llm.calls == [("wake_up", ["weights"]), "rpc", ("wake_up", ["kv_cache"]), "reset_prefix_cache"]
    engine.generate(PROMPTS, params)
    engine.sleep(level=1)  # weights kept in CPU memory: wake_up alone suffices
    engine.wake_up()
    engine.generate(PROMPTS, params)


def test_sync_refuses_an_incomplete_load(fake_vllm, tokenizer, monkeypatch):
    monkeypatch.setattr(FakeLLM, "extra_params", ("model.layers.0.extra.weight",))
    with pytest.raises(RuntimeError, match="model.layers.0.extra.weight"):
        VLLMEngine(tiny_model(), tokenizer)


def test_engine_needs_collective_rpc_and_in_process_engine(monkeypatch, fake_vllm, tokenizer):
    class NoRPC(FakeLLM):
        collective_rpc = None

    class MultiProcess(FakeLLM):
        def __init__(self, model, **kwargs):
            super().__init__(model, **kwargs)
            self.llm_engine = types.SimpleNamespace()  # no model_executor: engine core elsewhere

    monkeypatch.setattr(fake_vllm, "LLM", NoRPC)
    with pytest.raises(RuntimeError, match="collective_rpc"):
        VLLMEngine(tiny_model(), tokenizer)
    monkeypatch.setattr(fake_vllm, "LLM", MultiProcess)
    with pytest.raises(RuntimeError, match="separate process"):
        VLLMEngine(tiny_model(), tokenizer)


def test_model_path_is_loaded_by_vllm_itself(fake_vllm, tokenizer, tmp_path):
    tiny_model().save_pretrained(tmp_path)
    engine = VLLMEngine(str(tmp_path), tokenizer, dtype="float16", seed=3, enforce_eager=True)
    assert engine.llm.path == str(tmp_path) and "load_format" not in engine.llm.kwargs
    assert engine.llm.kwargs["enforce_eager"] is True and engine.llm.kwargs["dtype"] == "float16"
    assert engine.llm.calls == []  # no sync until the trainer has weights to push


# ----------------------------------------------------------------------------- errors


def test_no_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "vllm", make_fake_vllm())
    with pytest.raises(ConfigError, match="CUDA GPU.*rollout.backend=inprocess"):  # the user's setting: exit 2
        import_vllm()


def test_missing_vllm_gives_install_hint(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail
    with pytest.raises(ImportError, match="pip install vllm"):
        import_vllm()


def test_vllm_without_logprobs_mode_is_refused(monkeypatch):
    @dataclasses.dataclass
    class OldEngineArgs:
        model: str = ""

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setitem(sys.modules, "vllm", make_fake_vllm(engine_args=OldEngineArgs))
    with pytest.raises(ImportError, match="0.10.2"):
        import_vllm()


# ----------------------------------------------------------------------------- the recipe selects it


def test_grpo_with_rollout_backend_vllm_samples_through_the_engine(fake_vllm, tmp_path, monkeypatch):
    # rollout.backend=vllm: the run builds a VLLMEngine (fake LLM), syncs the policy into it before
    # each rollout, and trains on what it returned (its logprobs, -0.5 / -0.25, are the rollout's)
    from lmforge.core.config import load_config
    from lmforge.recipes.grpo import GRPOConfig, run_grpo

    built = []
    monkeypatch.setattr(fake_vllm, "LLM", lambda model, **kw: built.append(FakeLLM(model, **kw)) or built[-1])
    run_grpo(
        load_config(
            GRPOConfig,
            None,
            [
                "model.tokenizer=char",
                "model.hidden_size=32",
                "model.num_layers=1",
                "model.num_heads=2",
                "model.max_position_embeddings=32",
                "data.task=addition",
                "data.num_train=8",
                "data.num_eval=0",
                "rollout.num_prompts=2",
                "rollout.group_size=2",
                "rollout.max_new_tokens=4",
                "rollout.backend=vllm",
                "rollout.vllm_gpu_memory_utilization=0.2",
                "algo.is_level=token",
                "train.device=cpu",
                # every row is trained (the tiny model scores 0): the metrics compare them
                "algo.skip_zero_advantage=false",
                "train.max_steps=2",
                "train.save_every=0",
                "train.threads=1",
                "logging.progress=false",
                f"train.output_dir={tmp_path}",
            ],
        )
    )
    assert len(built) == 1
    llm = built[0]
    assert llm.kwargs["gpu_memory_utilization"] == 0.2 and llm.kwargs["load_format"] == "dummy"
    assert len(llm.requests) == 2 and all(len(prompts) == 4 for prompts, _ in llm.requests)  # 2 x 2 rows per step
    assert llm.calls.count("rpc") == 3  # the weights: at build, then before each of the 2 rollouts
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 2 and all(
        r["rollout_diff_abs_max"] > 0.01 for r in train
    )  # the fake's logprobs, not the policy's
