"""Tests for lmforge.antidistill.ads: proxy gradient, cross-rank reduction, ADS logits, lockstep sampler.

Two kinds of tiny model: ``TinyLM`` (pure torch, exact in fp64; also used by the spawned gloo ranks,
which therefore never import transformers) and a 2-layer ``LlamaForCausalLM`` built in-process.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os

import pytest
import torch
from torch import nn

from lmforge.antidistill.ads import (
    OBJECTIVE,
    ads_generate,
    ads_logits,
    check_same_tokenizer,
    clean_param_name,
    eps_from_reference,
    lam_from_reference,
    load_gradient,
    perturbed_copies,
    proxy_gradient,
    random_direction,
    save_gradient,
    sequence_mean_nll,
)
from lmforge.parallel.context import free_port as _free_port
from lmforge.rollout.engine import SamplingParams, generate, sample_token

VOCAB = 32


class TinyLM(nn.Module):
    """Pure-torch causal LM: embeddings, one causal attention layer, tanh MLP, head. Returns logits."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(64, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.mlp_in = nn.Linear(dim, 2 * dim)
        self.mlp_out = nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        num_rows, width = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = torch.arange(width).expand(num_rows, width)
        h = self.embed(input_ids) + self.pos(position_ids)  # (B, T, D)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, T, T)
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        allowed = (causal & attention_mask[:, None, :].bool()) | torch.eye(width, dtype=torch.bool)
        h = h + torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v
        h = h + self.mlp_out(torch.tanh(self.mlp_in(h)))
        return self.head(h)  # (B, T, V)


class PrefixWrapper(nn.Module):
    """Adds a ``module.`` prefix to every parameter name, as DDP does."""

    def __init__(self, inner):
        super().__init__()
        self.module = inner

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class CompiledLike(nn.Module):
    """Adds an ``_orig_mod.`` prefix, as torch.compile's OptimizedModule does."""

    def __init__(self, inner):
        super().__init__()
        self._orig_mod = inner

    def forward(self, *args, **kwargs):
        return self._orig_mod(*args, **kwargs)


def make_traces(num: int, seed: int = 1, vocab: int = VOCAB):
    """``num`` (input_ids, loss_mask) traces of different lengths; the completion starts mid-way."""
    gen = torch.Generator().manual_seed(seed)
    traces = []
    for i in range(num):
        length = 6 + (3 * i) % 7
        ids = torch.randint(0, vocab, (length,), generator=gen)
        loss_mask = torch.zeros(length, dtype=torch.long)
        loss_mask[2 + i % 3 :] = 1
        traces.append((ids, loss_mask))
    return traces


def collate(traces, left: bool = False):
    """Pad traces to one (B, T) batch with zeros, on the right (default) or the left."""
    width = max(len(ids) for ids, _ in traces)
    out = [torch.zeros(len(traces), width, dtype=torch.long) for _ in range(3)]
    for row, (ids, loss_mask) in enumerate(traces):
        cols = slice(width - len(ids), width) if left else slice(0, len(ids))
        out[0][row, cols], out[1][row, cols], out[2][row, cols] = ids, 1, loss_mask
    return {"input_ids": out[0], "attention_mask": out[1], "loss_mask": out[2]}


def tiny_llama(
    seed: int = 0, vocab: int = 64, dtype=torch.float32, init: float = 0.02, tie: bool = False, dropout: float = 0.0
):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=init,
        tie_word_embeddings=tie,
        attn_implementation="eager",
        attention_dropout=dropout,
    )
    return LlamaForCausalLM(cfg).to(dtype).eval()


def rel_error(approx, exact) -> float:
    return float((approx - exact).norm() / exact.norm())


def angle_deg(a, b) -> float:
    cos = torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0)
    return math.degrees(math.acos(float(cos.clamp(-1, 1))))


# ----------------------------------------------------------------------------- proxy gradient


def test_proxy_gradient_matches_slow_per_sequence_loop():
    """The objective is the mean over sequences of per-sequence mean NLL (not a token mean)."""
    model = TinyLM().double()
    traces = make_traces(5)
    grads, meta = proxy_gradient(model, [collate(traces[:2]), collate(traces[2:], left=True)])

    seq_grads, tok_sum, num_tok = [], None, 0
    for ids, loss_mask in traces:  # one unpadded sequence at a time, NLL one position at a time
        logits = model(ids[None])[0]
        nlls = [-torch.log_softmax(logits[t - 1], -1)[ids[t]] for t in range(1, len(ids)) if loss_mask[t]]
        g = torch.autograd.grad(torch.stack(nlls).mean(), list(model.parameters()))
        seq_grads.append(g)
        g_sum = [x * len(nlls) for x in g]  # gradient of this sequence's NLL sum
        tok_sum = g_sum if tok_sum is None else [a + b for a, b in zip(tok_sum, g_sum)]
        num_tok += len(nlls)
    names = [n for n, _ in model.named_parameters()]
    for i, name in enumerate(names):
        expected = sum(g[i] for g in seq_grads) / len(traces)
        torch.testing.assert_close(grads[name], expected, rtol=1e-10, atol=1e-13)
    token_mean = torch.cat([(t / num_tok).flatten() for t in tok_sum])
    ours = torch.cat([grads[n].flatten() for n in names])
    assert rel_error(ours, token_mean) > 1e-2  # the two definitions are distinguishable here
    assert meta["num_sequences"] == 5 and meta["num_tokens"] == num_tok and meta["objective"] == OBJECTIVE
    assert meta["world_size"] == 1


def test_unequal_batches_equal_one_batch():
    model = TinyLM().double()
    traces = make_traces(7)
    one, meta_one = proxy_gradient(model, [collate(traces)])
    split, meta_split = proxy_gradient(
        model, [collate(traces[:1]), collate(traces[1:5], left=True), collate(traces[5:])]
    )
    assert one.keys() == split.keys()
    for name in one:
        torch.testing.assert_close(split[name], one[name], rtol=1e-12, atol=1e-15)
    assert meta_one["num_sequences"] == meta_split["num_sequences"] == 7
    assert meta_one["num_tokens"] == meta_split["num_tokens"]
    assert meta_split["grad_norm"] == pytest.approx(meta_one["grad_norm"], rel=1e-12)


def test_proxy_gradient_fp32_accumulators_for_bf16_model_and_progress():
    model = TinyLM().to(torch.bfloat16)
    calls = []
    grads, _ = proxy_gradient(
        model, [collate(make_traces(2)), collate(make_traces(3, seed=2))], progress=lambda b, s: calls.append((b, s))
    )
    assert all(g.dtype == torch.float32 for g in grads.values())
    assert calls == [(1, 2), (2, 5)]
    assert all(p.grad is None for p in model.parameters()) and model.training


def test_proxy_gradient_rejects_bad_input():
    model = TinyLM().double()
    batch = collate(make_traces(2))
    batch["loss_mask"][1] = 0
    with pytest.raises(ValueError, match=r"rows \[1\] have no completion tokens"):
        proxy_gradient(model, [batch])
    with pytest.raises(ValueError, match="lacks"):
        proxy_gradient(model, [{"input_ids": batch["input_ids"]}])
    with pytest.raises(ValueError, match="no sequences"):
        proxy_gradient(model, [])
    bad = collate(make_traces(2))
    bad["loss_mask"] = bad["loss_mask"][:, :-1]
    with pytest.raises(ValueError, match="must match"):
        sequence_mean_nll(model, **bad)


def test_clean_param_name_hand_values():
    assert clean_param_name("module._orig_mod.head.weight") == "head.weight"
    assert clean_param_name("_orig_mod.module.head.weight") == "head.weight"
    assert (
        clean_param_name("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.mlp.weight")
        == "model.layers.0.mlp.weight"
    )
    assert clean_param_name("model.layers.0._checkpoint_wrapped_module.mlp.weight") == "model.layers.0.mlp.weight"
    assert clean_param_name("model.module_list.0.weight") == "model.module_list.0.weight"


@pytest.mark.parametrize("wrap", [PrefixWrapper, CompiledLike, lambda m: PrefixWrapper(CompiledLike(m))])
def test_wrapped_model_saves_clean_names(wrap, tmp_path):
    inner = TinyLM().double()
    batches = [collate(make_traces(3))]
    bare, _ = proxy_gradient(inner, batches)
    wrapped = wrap(inner)
    assert any(n.startswith(("module.", "_orig_mod.")) for n, _ in wrapped.named_parameters())
    grads, meta = proxy_gradient(wrapped, batches)
    save_gradient(grads, meta, tmp_path / "g.safetensors")
    loaded, _ = load_gradient(tmp_path / "g.safetensors")
    assert set(loaded) == {n for n, _ in inner.named_parameters()}
    for name in bare:
        assert torch.equal(loaded[name], bare[name])
    plus, _ = perturbed_copies(wrapped, loaded, eps=1e-2)  # a wrapped proxy perturbs too
    plus_params = {clean_param_name(n): p for n, p in plus.named_parameters()}
    torch.testing.assert_close(
        plus_params["head.weight"], inner.head.weight + 1e-2 * bare["head.weight"], rtol=0, atol=1e-15
    )


def test_save_load_roundtrip_metadata(tmp_path):
    model = TinyLM()
    grads, meta = proxy_gradient(model, [collate(make_traces(4))], model_id="tiny/TinyLM")
    path = tmp_path / "grads.safetensors"
    save_gradient(grads, meta, path)
    loaded, loaded_meta = load_gradient(path)
    assert loaded.keys() == grads.keys() and all(torch.equal(loaded[k], grads[k]) for k in grads)
    assert loaded_meta == meta  # ints, the float norm (repr round-trips) and strings come back exactly
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    assert loaded_meta["grad_norm"] == pytest.approx(norm, rel=1e-12)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        raw = f.metadata()
    assert raw["num_sequences"] == "4" and raw["model_id"] == "tiny/TinyLM"


# ----------------------------------------------------------------------------- cross-rank reduction


def _gloo_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        model = nn.parallel.DistributedDataParallel(TinyLM().double())  # names get a module. prefix
        traces = make_traces(8)
        # Unequal shards and batch counts: rank 0 holds 3 sequences in 2 batches, rank 1 holds 5 in 2.
        shard = [traces[0:2], traces[2:3]] if rank == 0 else [traces[3:6], traces[6:8]]
        grads, meta = proxy_gradient(model, [collate(t) for t in shard])
        save_gradient(grads, meta, os.path.join(out_dir, f"rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


@pytest.mark.e2e  # two spawned processes with a gloo group: ~5-10 s
def test_two_gloo_ranks_equal_one_rank_on_all_data(tmp_path):
    import torch.multiprocessing as mp

    # spawn, not fork: a child forked after the parent's OpenMP thread pool has started (any earlier
    # test that ran a matmul) can deadlock on its first parallel region.
    mp.start_processes(_gloo_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    expected, expected_meta = proxy_gradient(TinyLM().double(), [collate(make_traces(8))])
    for rank in range(2):
        grads, meta = load_gradient(tmp_path / f"rank{rank}.safetensors")
        assert set(grads) == set(expected)  # no module. prefix
        for name in expected:
            torch.testing.assert_close(grads[name], expected[name], rtol=1e-12, atol=1e-15)
        assert meta["world_size"] == 2 and meta["num_sequences"] == 8
        assert meta["num_tokens"] == expected_meta["num_tokens"]


# ----------------------------------------------------------------------------- perturbed copies


def test_perturbed_copies_fp64_exact_and_original_untouched():
    model = TinyLM().double()
    grads, _ = proxy_gradient(model, [collate(make_traces(3))])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    plus, minus = perturbed_copies(model, grads, eps=1e-2)
    p_plus, p_minus = dict(plus.named_parameters()), dict(minus.named_parameters())
    for name, theta in before.items():
        torch.testing.assert_close(p_plus[name], theta + 1e-2 * grads[name], rtol=0, atol=1e-15)
        torch.testing.assert_close(p_minus[name], theta - 1e-2 * grads[name], rtol=0, atol=1e-15)
        assert torch.equal(dict(model.named_parameters())[name], theta)
        assert not p_plus[name].requires_grad
    assert not plus.training and not minus.training


def test_perturbed_copies_bf16_update_in_fp32_then_cast():
    model = TinyLM().to(torch.bfloat16)
    grads, _ = proxy_gradient(model, [collate(make_traces(3))])
    plus, minus = perturbed_copies(model, grads, eps=1e-2)
    for name, theta in model.named_parameters():
        assert torch.equal(dict(plus.named_parameters())[name], (theta.float() + 1e-2 * grads[name]).bfloat16())
        assert torch.equal(dict(minus.named_parameters())[name], (theta.float() - 1e-2 * grads[name]).bfloat16())


def test_perturbed_copies_tied_embedding_perturbed_once():
    model = tiny_llama(dtype=torch.float64, tie=True)
    grads, _ = proxy_gradient(model, [collate(make_traces(2, vocab=64))])
    assert "lm_head.weight" not in grads  # tied: named_parameters yields it once
    plus, _ = perturbed_copies(model, grads, eps=1e-2)
    assert plus.lm_head.weight is plus.model.embed_tokens.weight
    torch.testing.assert_close(
        plus.lm_head.weight, model.lm_head.weight + 1e-2 * grads["model.embed_tokens.weight"], rtol=0, atol=1e-15
    )


def test_perturbed_copies_rejects_mismatched_gradients():
    model = TinyLM()
    grads, _ = proxy_gradient(model, [collate(make_traces(2))])
    with pytest.raises(ValueError, match="match no proxy parameter"):
        perturbed_copies(model, {**grads, "extra.weight": torch.zeros(2)}, eps=1e-2)
    with pytest.raises(ValueError, match="has shape"):
        perturbed_copies(model, {**grads, "head.bias": torch.zeros(VOCAB + 1)}, eps=1e-2)
    with pytest.raises(ValueError, match="eps must be > 0"):
        perturbed_copies(model, grads, eps=0.0)


# ----------------------------------------------------------------------------- finite difference vs JVP

# torch.func.jvp loads forward-AD decompositions through the deprecated torch.jit.script (torch-internal).
quiet_jvp = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")


def _fd_and_jvp(model, grads, inputs, eps_values):
    """Central differences (z(theta+eps g) - z(theta-eps g)) / 2eps for each eps, and the exact JVP."""
    from torch.func import functional_call, jvp

    params = {n: p.detach() for n, p in model.named_parameters()}
    tangents = {n: grads[n].to(p.dtype) for n, p in params.items()}

    def logits_of(p):
        out = functional_call(model, p, (inputs,))
        return out.logits if hasattr(out, "logits") else out

    _, exact = jvp(logits_of, (params,), (tangents,))
    fds = []
    for eps in eps_values:
        plus, minus = perturbed_copies(model, grads, eps)
        with torch.no_grad():
            fds.append(
                (logits_of(dict(plus.named_parameters())).double() - logits_of(dict(minus.named_parameters())).double())
                / (2 * eps)
            )
    return fds, exact.double()


@quiet_jvp
def test_finite_difference_is_second_order_accurate_in_fp64():
    """Central difference error = eps^2/6 * third derivative: halving eps divides the error by ~4."""
    model = TinyLM().double()
    grads, _ = proxy_gradient(model, [collate(make_traces(4))])
    inputs = make_traces(1, seed=5)[0][0][None]
    eps_values = [8e-2, 4e-2, 2e-2, 1e-2]
    fds, exact = _fd_and_jvp(model, grads, inputs, eps_values)
    errors = [rel_error(fd, exact) for fd in fds]
    for coarse, fine in zip(errors, errors[1:]):
        assert 3.2 < coarse / fine < 4.8, errors  # one-sided differences would give ~2
    assert errors[-1] < 1e-5


@quiet_jvp
def test_finite_difference_rounding_fp32_vs_fp64():
    """At tiny eps rounding (~u/eps) dominates: fp32 degrades, fp64 stays accurate."""
    model64 = TinyLM().double()
    grads, _ = proxy_gradient(model64, [collate(make_traces(4))])
    inputs = make_traces(1, seed=5)[0][0][None]
    (fd64_small,), exact = _fd_and_jvp(model64, grads, inputs, [1e-5])
    fd32_mid, fd32_small = _fd_and_jvp(model64.float(), grads, inputs, [1e-2, 1e-5])[0]
    err64_small, err32_mid, err32_small = (rel_error(fd, exact) for fd in (fd64_small, fd32_mid, fd32_small))
    assert err64_small < 1e-7  # truncation ~eps^2 = 1e-10, rounding ~1e-16/1e-5
    assert err32_small > 10 * err32_mid  # fp32: rounding 6e-8 * |z| / eps overtakes truncation
    assert err32_small > 1e3 * err64_small


@quiet_jvp
def test_finite_difference_angle_tiny_llama_fp32_eps_1e2():
    """fp32 tiny Llama at eps = 1e-2: the ADS term points along the exact directional derivative.

    Bound: |FD - J| / |J| <= C eps^2 + rounding. C eps^2 is the fp64 error at 2 eps divided by 4
    (second order), x1.5 for higher-order terms; rounding <= 100 u32 |z| / (eps |J|) (u32 = 2^-24,
    100 for error growth through the layers). sin(angle) <= relative error.
    """
    model64 = tiny_llama(dtype=torch.float64, init=0.1)
    grads, _ = proxy_gradient(model64, [collate(make_traces(4, vocab=64))])
    inputs = make_traces(2, seed=7, vocab=64)[1][0][None]
    (fd64_coarse,), exact = _fd_and_jvp(model64, grads, inputs, [2e-2])
    (fd32,), _ = _fd_and_jvp(tiny_llama(dtype=torch.float64, init=0.1).float(), grads, inputs, [1e-2])
    with torch.no_grad():
        logits_norm = float(model64(inputs).logits.norm())
    truncation = 1.5 * rel_error(fd64_coarse, exact) / 4
    rounding = 100 * 2.0**-24 * logits_norm / (1e-2 * float(exact.norm()))
    bound = truncation + rounding
    err = rel_error(fd32, exact)
    assert err < bound, (err, truncation, rounding)
    assert angle_deg(fd32, exact) < math.degrees(math.asin(min(1.0, bound)))


def test_ads_term_predicts_heldout_loss_change_of_one_sgd_step():
    """Sign convention: lam > 0 favours tokens whose SGD step would *raise* the proxy's held-out loss.

    Training the proxy on token x: theta' = theta + lr * grad log p(x). First order:
    L(theta') - L(theta) = lr * <g, grad log p(x)> = lr * d/deps log p(x; theta + eps g).
    """
    model = TinyLM().double()
    heldout = [collate(make_traces(4))]
    grads, _ = proxy_gradient(model, heldout)

    def heldout_loss(m):
        with torch.no_grad():
            return float(sequence_mean_nll(m, **heldout[0])[0].mean())

    context = make_traces(1, seed=9)[0][0][None]
    plus, minus = perturbed_copies(model, grads, eps=1e-3)
    with torch.no_grad():
        term = (torch.log_softmax(plus(context)[0, -1], -1) - torch.log_softmax(minus(context)[0, -1], -1)) / 2e-3
    base, lr = heldout_loss(model), 1e-4
    for token in (int(term.argmax()), int(term.argmin())):
        trained = TinyLM().double()
        logp = torch.log_softmax(trained(context)[0, -1], -1)[token]
        step = torch.autograd.grad(logp, list(trained.parameters()))
        with torch.no_grad():
            for p, s in zip(trained.parameters(), step):
                p.add_(lr * s)
        change = heldout_loss(trained) - base
        assert change == pytest.approx(lr * float(term[token]), rel=2e-2)
    assert term.max() > 0 > term.min()


# ----------------------------------------------------------------------------- ADS logits


def test_ads_logits_hand_value_and_lam_zero():
    teacher = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    plus = torch.tensor([[0.5, 0.0, -0.5]], dtype=torch.float64)
    minus = torch.tensor([[0.3, 0.0, -0.1]], dtype=torch.float64)
    # z/T = [0.5, 1, 1.5]; (plus - minus)/(2 eps) = [0.2, 0, -0.4] / 0.02 = [10, 0, -20]; * lam = [1, 0, -2]
    out = ads_logits(teacher, plus, minus, temperature=2.0, lam=0.1, eps=1e-2)
    torch.testing.assert_close(out, torch.tensor([[1.5, 1.0, -0.5]], dtype=torch.float64), rtol=0, atol=1e-12)
    teacher32 = torch.randn(4, 50)
    zero = ads_logits(teacher32, torch.randn(4, 50), torch.randn(4, 50), temperature=0.7, lam=0.0, eps=1e-2)
    assert torch.equal(zero, teacher32 / 0.7)
    with pytest.raises(ValueError, match="temperature > 0"):
        ads_logits(teacher, plus, minus, temperature=0.0, lam=0.1, eps=1e-2)
    with pytest.raises(ValueError, match="vocab_size"):
        ads_logits(teacher, plus[:, :2], minus[:, :2], temperature=1.0, lam=0.1, eps=1e-2)


def test_reference_conversion_hand_values_and_checks():
    # lam = lam_ref / (W T): 3e-3 / (8 * 0.6) = 6.25e-4; eps = eps_ref / W: 1e-2 / 8 = 1.25e-3
    assert lam_from_reference(3e-3, 0.6, 8) == pytest.approx(6.25e-4, rel=1e-12)
    assert eps_from_reference(1e-2, 8) == pytest.approx(1.25e-3, rel=1e-12)
    assert lam_from_reference(0.15, 1.0, 1) == pytest.approx(0.15, rel=1e-12)
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="reference_world_size"):
            lam_from_reference(0.1, 1.0, bad)
    with pytest.raises(ValueError, match="temperature"):
        lam_from_reference(0.1, 0.0, 8)
    with pytest.raises(ValueError, match="eps_reference"):
        eps_from_reference(0.0, 8)


def _reference_ddp_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """What the reference save_grad.py does on each rank: batch size 1, loss = token-mean NLL x batch
    size, backward through DDP (which averages over ranks on every backward), accumulate .grad, divide
    by the global number of sequences, and save rank 0's tensors (the cross-rank sum was discarded)."""
    import torch.distributed as dist

    from lmforge.antidistill.ads import sequence_mean_nll

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        model = nn.parallel.DistributedDataParallel(TinyLM().double())
        traces = make_traces(8)[rank::world_size]  # 4 each: DDP needs the same number of backwards per rank
        accumulated = {n: torch.zeros_like(p) for n, p in model.module.named_parameters()}
        for trace in traces:
            batch = collate([trace])
            nll, _ = sequence_mean_nll(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
            (nll.sum()).backward()  # the DDP hooks average .grad over the ranks here
            for n, p in model.module.named_parameters():
                accumulated[n] += p.grad
            model.zero_grad()
        total = torch.tensor([len(traces)])
        dist.all_reduce(total)
        if rank == 0:
            torch.save({n: g / int(total) for n, g in accumulated.items()}, os.path.join(out_dir, "reference.pt"))
        dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()


def test_reference_conversion_against_two_rank_ddp_averaged_gradient(tmp_path):
    """The reference's saved gradient is g / W; converting (lam_ref, eps_ref) with W reproduces its logits."""
    import torch.multiprocessing as mp

    world = 2
    mp.start_processes(
        _reference_ddp_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True, start_method="spawn"
    )
    reference_grads = torch.load(tmp_path / "reference.pt")
    proxy = TinyLM().double()
    true_grads, _ = proxy_gradient(proxy, [collate(make_traces(8))])
    for name, g in true_grads.items():
        torch.testing.assert_close(reference_grads[name], g / world, rtol=1e-10, atol=1e-14)
    # Reference sampling: proxies at theta +- eps_ref * g_ref, term added before dividing by T.
    temperature, lam_ref, eps_ref = 0.7, 0.05, 1e-2
    inputs = make_traces(2, seed=9)[1][0][None]  # (1, T)
    teacher = TinyLM(seed=3).double()
    with torch.no_grad():
        z = teacher(inputs)[0]
        zp, zm = (m(inputs)[0] for m in perturbed_copies(proxy, reference_grads, eps_ref))
        reference_logits = (z + lam_ref * (zp - zm) / (2 * eps_ref)) / temperature
        eps = eps_from_reference(eps_ref, world)
        ours_plus, ours_minus = (m(inputs)[0] for m in perturbed_copies(proxy, true_grads, eps))
        ours = ads_logits(z, ours_plus, ours_minus, temperature, lam_from_reference(lam_ref, temperature, world), eps)
        unscaled = ads_logits(z, ours_plus, ours_minus, temperature, lam_from_reference(lam_ref, temperature, 1), eps)
    torch.testing.assert_close(torch.log_softmax(ours, -1), torch.log_softmax(reference_logits, -1), rtol=0, atol=1e-9)
    # Without the world-size factor the ADS term is twice the reference's: a visible difference.
    term = (reference_logits - z / temperature).abs().max()
    assert float(term) > 1e-3
    torch.testing.assert_close(
        unscaled - z / temperature, 2 * (reference_logits - z / temperature), rtol=1e-6, atol=1e-9
    )


def test_logits_and_logprobs_give_same_sampling_distribution():
    teacher, plus, minus = (tiny_llama(seed=s, dtype=torch.float64) for s in (0, 1, 2))
    inputs = make_traces(3, seed=4, vocab=64)[2][0][None]
    with torch.no_grad():
        zt, zp, zm = (m(inputs).logits[0] for m in (teacher, plus, minus))  # (T, V)
    from_logits = ads_logits(zt, zp, zm, temperature=0.8, lam=0.05, eps=1e-2)
    from_logprobs = ads_logits(zt, torch.log_softmax(zp, -1), torch.log_softmax(zm, -1), 0.8, 0.05, 1e-2)
    shift = from_logits - from_logprobs  # (T, V): constant over the vocabulary, different per position
    assert float(shift.abs().mean()) > 1e-3
    torch.testing.assert_close(shift, shift[:, :1].expand_as(shift), rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.softmax(from_logits, -1), torch.softmax(from_logprobs, -1), rtol=0, atol=1e-14)


# ----------------------------------------------------------------------------- sampler

PROMPTS = [[5, 9, 2, 11], [7, 3], [1, 2, 3, 4, 5, 6]]


@pytest.fixture(scope="module")
def llamas():
    # fp32: in transformers 5.x a float64 Llama returns NaN for left-padded rows.
    return tuple(tiny_llama(seed=s, init=0.1) for s in (0, 1, 2))


def test_lam_zero_reproduces_engine_generate_token_for_token(llamas):
    teacher, plus, minus = llamas
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=10, stop_token_ids=[3], seed=123)
    plain = generate(teacher, PROMPTS, params, num_samples=2, pad_token_id=0)
    ads = ads_generate(teacher, plus, minus, PROMPTS, params, lam=0.0, eps=1e-2, num_samples=2)
    for field in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs", "truncated"):
        assert torch.equal(getattr(ads, field), getattr(plain, field)), field
    # Truncation renormalises the sampled distribution, so its logprobs are >= the untruncated teacher's.
    assert torch.all(ads.logprobs >= ads.teacher_logprobs - 1e-6)
    assert ads.completion_mask.sum() > len(PROMPTS)  # something was sampled
    strong = ads_generate(teacher, plus, minus, PROMPTS, params, lam=10.0, eps=1e-2, num_samples=2)
    assert not torch.equal(strong.completion_ids, plain.completion_ids)


@pytest.mark.parametrize("num_samples", [1, 3])
def test_lockstep_caches_match_full_recompute(llamas, num_samples):
    """All three KV caches are fed the sampled tokens, also when num_samples rows share one prompt's
    prefill: same tokens, teacher logprobs and per-step KL as recomputing every prefix from scratch."""
    teacher, plus, minus = llamas
    temperature, lam, eps = 0.9, 0.5, 1e-2
    params = SamplingParams(temperature=temperature, max_new_tokens=6, seed=7)
    ads = ads_generate(teacher, plus, minus, PROMPTS, params, lam=lam, eps=eps, num_samples=num_samples)

    rows = [p for p in PROMPTS for _ in range(num_samples)]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    gen = torch.Generator().manual_seed(7)
    teacher_logprobs, kls = [], []
    for _ in range(6):
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            zt, zp, zm = (
                m(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, -1].double()
                for m in (teacher, plus, minus)
            )
        adjusted = zt / temperature + lam * (zp - zm) / (2 * eps)
        tokens, _ = sample_token(adjusted.float(), dataclasses.replace(params, temperature=1.0), gen)
        p_ads, p_plain = torch.softmax(adjusted, -1), torch.softmax(zt / temperature, -1)
        kls.append((p_ads * (p_ads.log() - p_plain.log())).sum(-1, keepdim=True))
        teacher_logprobs.append(torch.log_softmax(zt / temperature, -1).gather(-1, tokens[:, None]))
        ids, mask = torch.cat([ids, tokens[:, None]], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    assert torch.equal(ads.completion_ids, ids[:, width:])
    if num_samples > 1:  # rows of one prompt share its prefill but must not share their samples
        groups = ads.completion_ids.view(len(PROMPTS), num_samples, -1)
        assert any(len({tuple(row.tolist()) for row in group}) > 1 for group in groups)
    torch.testing.assert_close(ads.teacher_logprobs.double(), torch.cat(teacher_logprobs, 1), rtol=0, atol=1e-5)
    expected_kl = torch.cat(kls, 1)
    assert float(expected_kl.min()) > 1e-3  # lam = 0.5 tilts every step visibly
    torch.testing.assert_close(ads.kl.double(), expected_kl, rtol=1e-3, atol=1e-6)


def test_kl_is_zero_at_lam_zero_and_grows_with_lam(llamas):
    teacher, plus, minus = llamas
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=3)
    kl = [
        float(ads_generate(teacher, plus, minus, PROMPTS, params, lam=lam, eps=1e-2).kl.mean())
        for lam in (0.0, 0.1, 0.5)
    ]
    assert kl[0] == 0.0
    assert 0 < kl[1] < kl[2]


def test_ads_generate_runs_in_eval_mode_and_restores_modes():
    """With attention dropout 0.5, a model left in train mode would sample from noisy logits."""
    teacher, plus, minus = (tiny_llama(seed=s, init=0.1, dropout=0.5) for s in (0, 1, 2))
    teacher.train()
    minus.train()
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=11)
    plain = generate(teacher, PROMPTS, params, pad_token_id=0)  # eval mode inside, restored after
    assert teacher.training
    ads = ads_generate(teacher, plus, minus, PROMPTS, params, lam=0.0, eps=1e-2)
    assert torch.equal(ads.completion_ids, plain.completion_ids)
    assert torch.equal(ads.logprobs, plain.logprobs)
    assert (teacher.training, plus.training, minus.training) == (True, False, True)
    # The dropout is real: a train-mode forward of the same input differs from an eval-mode one.
    inputs = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        noisy = teacher(inputs).logits
        clean = teacher.eval()(inputs).logits
    assert not torch.allclose(noisy, clean)


def test_random_direction_norm_matched_seeded_and_unrelated_to_g():
    grads = {"b": torch.tensor([3.0, 4.0]), "a": torch.zeros(2, 3, dtype=torch.float64)}  # norm 5
    rand = random_direction(grads, seed=0)
    assert {n: (t.shape, t.dtype) for n, t in rand.items()} == {n: (t.shape, t.dtype) for n, t in grads.items()}
    norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in rand.values()))
    assert norm == pytest.approx(5.0, rel=1e-6)
    again, other = random_direction(grads, seed=0), random_direction(grads, seed=1)
    assert all(torch.equal(rand[n], again[n]) for n in grads)
    assert not torch.equal(rand["b"], other["b"])
    model = TinyLM().double()
    g, _ = proxy_gradient(model, [collate(make_traces(4))])
    r = random_direction(g, seed=0)
    flat_g, flat_r = (torch.cat([d[n].flatten() for n in sorted(d)]) for d in (g, r))
    assert float(flat_r.norm()) == pytest.approx(float(flat_g.norm()), rel=1e-12)
    assert 80 < angle_deg(flat_g, flat_r) < 100  # thousands of dimensions: nearly orthogonal
    with pytest.raises(ValueError, match="zero"):
        random_direction({"a": torch.zeros(3)}, seed=0)


def test_ads_generate_vocab_size_and_argument_checks(llamas):
    teacher, _, _ = llamas
    wide_plus, wide_minus = tiny_llama(seed=1, vocab=72), tiny_llama(seed=2, vocab=72)  # padded embeddings
    params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=0)
    with pytest.raises(ValueError, match="vocab_size"):
        ads_generate(teacher, wide_plus, wide_minus, PROMPTS, params, lam=0.1, eps=1e-2)
    out = ads_generate(teacher, wide_plus, wide_minus, PROMPTS, params, lam=0.1, eps=1e-2, vocab_size=64)
    assert out.completion_ids.max() < 64
    with pytest.raises(ValueError, match="temperature > 0"):
        ads_generate(teacher, teacher, teacher, PROMPTS, SamplingParams(temperature=0.0), lam=0.1, eps=1e-2)
    with pytest.raises(ValueError, match="stop_token_ids only"):
        ads_generate(teacher, teacher, teacher, PROMPTS, SamplingParams(stop_strings=["x"]), lam=0.1, eps=1e-2)


# ----------------------------------------------------------------------------- tokenizers


def _tokenizer(vocab: dict[str, int], eos: str = "</s>"):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")),
        unk_token="[UNK]",
        pad_token="[PAD]",
        eos_token=eos,
    )


def test_check_same_tokenizer():
    base = {"[UNK]": 0, "[PAD]": 1, "</s>": 2, "<eot>": 3, "cat": 4, "dog": 5}
    check_same_tokenizer(_tokenizer(base), _tokenizer(dict(base)))
    with pytest.raises(ValueError, match=r"vocabulary size teacher=6 vs proxy=7.*'bird': teacher=None vs proxy=6"):
        check_same_tokenizer(_tokenizer(base), _tokenizer({**base, "bird": 6}))
    with pytest.raises(ValueError, match=r"eos_token_id teacher=2 vs proxy=3"):
        check_same_tokenizer(_tokenizer(base), _tokenizer(base, eos="<eot>"))
    swapped = {**base, "cat": 5, "dog": 4}
    with pytest.raises(ValueError, match=r"2 tokens have different ids, e.g. 'cat': teacher=4 vs proxy=5"):
        check_same_tokenizer(_tokenizer(base), _tokenizer(swapped))
