import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lmforge.core.config import OptimConfig
from lmforge.core.errors import TrainingError
from lmforge.losses.policy import sft_loss
from lmforge.runtime.optim import (
    BatchOrder,
    Precision,
    build_optimizer,
    check_finite,
    count_loss_tokens,
    logits_at,
    lr_factor,
    optimizer_step,
    param_groups,
    shifted_targets,
)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=23,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).float()


def make_rows(seed=0, n=8):
    """Rows of different lengths with a prompt part (no loss) and a completion part (loss)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        prompt_len, completion_len = 2 + i % 3, 1 + (i * 5) % 7
        ids = torch.randint(1, 23, (prompt_len + completion_len,), generator=gen)
        labels = ids.clone()
        labels[:prompt_len] = -100
        rows.append((ids, labels))
    return rows


def collate(rows):
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (ids, lab) in enumerate(rows):
        input_ids[r, : len(ids)], labels[r, : len(ids)], mask[r, : len(ids)] = ids, lab, 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def step_grads(model, batches):
    model.zero_grad(set_to_none=True)
    total = sum(count_loss_tokens(b["labels"]) for b in batches)
    loss_sum = 0.0
    for b in batches:
        positions, targets = shifted_targets(b["labels"])
        logits = logits_at(model, b["input_ids"], b["attention_mask"], positions)
        loss, _ = sft_loss(logits, targets, total)
        loss.backward()
        loss_sum += loss.item()
    return loss_sum, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_accumulation_matches_one_batch_with_unequal_micro_batches():
    model = tiny_model()
    rows = make_rows()
    full_loss, full_grads = step_grads(model, [collate(rows)])
    splits = [rows[:1], rows[1:4], rows[4:6], rows[6:]]  # 1, 3, 2, 2 rows; different padding
    counts = [count_loss_tokens(collate(s)["labels"]) for s in splits]
    assert len(set(counts)) > 1, "the test needs micro-batches with unequal token counts"
    acc_loss, acc_grads = step_grads(model, [collate(s) for s in splits])
    assert abs(full_loss - acc_loss) < 1e-6
    for name, grad in full_grads.items():
        torch.testing.assert_close(acc_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    # ...and a per-micro-batch mean (the common mistake) would not match:
    wrong = sum(step_grads(model, [collate(s)])[0] for s in splits) / len(splits)
    assert abs(wrong - full_loss) > 1e-3


def test_sft_loss_value_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0)], [math.log(2.0), 0.0]])
    targets = torch.tensor([1, 1])
    loss, metrics = sft_loss(logits, targets, num_loss_tokens=4)
    # -log(3/4) - log(1/3), divided by the 4 tokens of the whole step
    expected = (-math.log(3 / 4) - math.log(1 / 3)) / 4
    torch.testing.assert_close(loss, torch.tensor(expected), rtol=0, atol=1e-7)
    assert int(metrics["num_tokens"]) == 2


def test_logits_at_equals_full_forward():
    model = tiny_model()
    batch = collate(make_rows(n=4))
    positions, _ = shifted_targets(batch["labels"])
    fast = logits_at(model, batch["input_ids"], batch["attention_mask"], positions)
    full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[positions]
    torch.testing.assert_close(fast, full, rtol=0, atol=1e-5)


def test_logits_at_equals_full_forward_for_a_scaled_head():
    # Granite divides lm_head's output by config.logits_scaling: it must not take the head-only path
    # (it did: log-probs from unscaled logits in SFT, RL and the DPO pair forward)
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    model = GraniteForCausalLM(
        GraniteConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            logits_scaling=4.0,
        )
    )
    ids = torch.randint(0, 64, (2, 7))
    mask = torch.ones_like(ids)
    positions = torch.zeros_like(ids, dtype=torch.bool)
    positions[:, 3:6] = True
    full = model(input_ids=ids, attention_mask=mask).logits[positions]
    torch.testing.assert_close(logits_at(model, ids, mask, positions), full, rtol=0, atol=1e-5)


def test_lr_schedule_values():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1, schedule="cosine")
    assert [lr_factor(s, cfg, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, cfg, 14) == 1.0  # first decay step starts at the peak
    assert abs(lr_factor(13, cfg, 14) - 0.1) < 1e-12  # last step reaches the minimum
    mid = lr_factor(8, cfg, 14)  # progress (8 - 4) / 9
    assert abs(mid - (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 9)))) < 1e-12
    lin = OptimConfig(lr=1.0, warmup_steps=0, min_lr_ratio=0.0, schedule="linear")
    assert [lr_factor(s, lin, 5) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    const = OptimConfig(lr=1.0, warmup_steps=2, schedule="constant")
    assert [lr_factor(s, const, 5) for s in range(5)] == [0.5, 1.0, 1.0, 1.0, 1.0]


def test_no_decay_groups():
    model = tiny_model()
    decay, skip = param_groups(model, 0.1, ["bias", "norm", "embed"])
    names = {id(p): n for n, p in model.named_parameters()}
    assert all("norm" not in names[id(p)] and "embed" not in names[id(p)] for p in decay["params"])
    assert any("embed_tokens" in names[id(p)] for p in skip["params"])
    assert skip["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1


def test_adamw_decoupled_decay_and_clipping():
    # One parameter, known gradient: check the AdamW update and that clipping uses the global norm.
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    model = torch.nn.Module()
    model.weight = w
    cfg = OptimConfig(
        lr=0.1, weight_decay=0.5, no_decay=[], beta1=0.9, beta2=0.999, eps=1e-8, schedule="constant", max_grad_norm=1.0
    )
    opt = build_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    w.grad = torch.tensor([30.0, 40.0])  # norm 50 -> clipped to (0.6, 0.8)
    norm = optimizer_step(model, opt, sched, Precision(torch.device("cpu"), torch.float32), 1.0)
    assert abs(norm.item() - 50.0) < 1e-5  # the pre-clip norm is reported
    # first Adam step: m_hat/sqrt(v_hat) = sign(g) = 1 ; decay is decoupled: w -= lr * wd * w
    expected = torch.tensor([3.0, 4.0]) * (1 - 0.1 * 0.5) - 0.1 * torch.ones(2)
    torch.testing.assert_close(w.detach(), expected, rtol=0, atol=1e-6)


def test_batch_order_resumes_exactly():
    a = BatchOrder(10, 3, seed=5)
    seq = [a.next() for _ in range(7)]
    b = BatchOrder(10, 3, seed=5)
    for _ in range(4):
        b.next()
    state = b.state_dict()
    c = BatchOrder(10, 3, seed=5)
    c.load_state_dict(state)
    assert [c.next() for _ in range(3)] == seq[4:]
    assert sorted(sum(seq[:3], [])) == sorted(set(sum(seq[:3], [])))  # no repeats within an epoch


def test_non_finite_loss_is_a_clear_error():
    with pytest.raises(TrainingError, match="non-finite loss .* step 7"):
        check_finite(torch.tensor(float("nan")), 7)


# ----------------------------------------------------------------------------- mixed precision on CPU
# The CUDA paths (bf16 / fp16 autocast, the grad scaler) run their logic on CPU as well: torch's
# GradScaler and autocast accept the CPU device, so the scaler's unscale-before-clip, its skip of
# non-finite steps and its state on resume are checked here; tests/gpu covers the CUDA kernels.


def linear_model(weights):
    model = torch.nn.Linear(len(weights), 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([weights]))
    return model


def sgd_step(model, precision, x, max_grad_norm):
    """loss = w . x, so dloss/dw = x; one optimizer_step with plain SGD (lr 1): w <- w - clip(x)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loss = model(torch.tensor([x])).sum()
    precision.backward(loss)
    return optimizer_step(model, optimizer, scheduler, precision, max_grad_norm)


def test_fp16_scaler_unscales_before_clipping():
    precision = Precision(torch.device("cpu"), torch.float16)
    scale = precision.scaler.get_scale()
    assert scale == 2.0**16  # torch's initial scale: the gradients below are 65536x too large until unscaled
    model = linear_model([1.0, 2.0])
    norm = sgd_step(model, precision, [3.0, 4.0], max_grad_norm=1.0)
    # by hand: the gradient is (3, 4), norm 5; clipped to norm 1 it is (0.6, 0.8)
    assert norm.item() == pytest.approx(5.0, rel=1e-6)  # the pre-clip norm of the *unscaled* gradient
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[1.0 - 0.6, 2.0 - 0.8]]), rtol=0, atol=1e-6)
    # clipping the scaled gradient (norm 5 * 65536) and unscaling after would move w by (0.6, 0.8) / 65536


def test_fp16_scaler_skips_a_non_finite_step_and_resumes_with_its_scale():
    precision = Precision(torch.device("cpu"), torch.float16)
    model = linear_model([1.0, 2.0])
    sgd_step(model, precision, [float("inf"), 1.0], max_grad_norm=0.0)
    # an inf gradient: the step is skipped (weights unchanged) and the scale halves (backoff 0.5)
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[1.0, 2.0]]), rtol=0, atol=0)
    assert precision.scaler.get_scale() == 2.0**15
    state = precision.state_dict()
    resumed = Precision(torch.device("cpu"), torch.float16)
    resumed.load_state_dict(state)
    assert resumed.scaler.get_scale() == 2.0**15  # not the fresh 2**16
    # and the resumed scaler keeps counting towards its growth interval where the first one was
    assert resumed.scaler.state_dict()["_growth_tracker"] == precision.scaler.state_dict()["_growth_tracker"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_on_cpu_runs_the_matmuls_in_the_chosen_dtype(dtype):
    precision = Precision(torch.device("cpu"), dtype)
    assert (precision.scaler is not None) == (dtype == torch.float16)  # a scaler for fp16 only
    model = tiny_model()
    ids = torch.tensor([[1, 5, 7, 9]])
    with precision.autocast():
        logits = model(input_ids=ids).logits
    assert logits.dtype == dtype
    with Precision(torch.device("cpu"), torch.float32).autocast():
        assert model(input_ids=ids).logits.dtype == torch.float32
