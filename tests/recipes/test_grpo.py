"""GRPO recipe on a tiny in-process model: an end-to-end run, bit-exact resume, the on-policy
shortcut, importance sampling without rollout logprobs, presets and config errors."""

import copy
import dataclasses

import pytest
import torch
from run_records import assert_resume_is_bit_exact, records

from lmforge import cli, rl
from lmforge.core.config import ModelConfig, OptimConfig, load_config
from lmforge.core.errors import ConfigError, TrainingError
from lmforge.model.load import load_model
from lmforge.parallel.context import ParallelContext
from lmforge.recipes.grpo import GRPOConfig, advantages_of, micro_loss, run_grpo
from lmforge.rl import config as rl_config
from lmforge.rl import updates as rl_update
from lmforge.rollout import RewardSet, SamplingParams, generate
from lmforge.runtime.optim import Precision, Updater, logits_at
from lmforge.runtime.run import Run

TINY = [
    "model.tokenizer=char",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.max_position_embeddings=32",
]
ARGS = TINY + [
    "data.task=addition",
    "data.num_train=64",
    "data.num_eval=8",
    "rollout.num_prompts=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "rewards.functions=[parity]",
    "train.max_steps=4",
    "train.micro_batch_size=2",
    "train.save_every=2",
    "train.keep_last=10",
    "train.eval_every=2",
    "train.max_new_tokens=4",
    "train.threads=1",
    "optim.lr=1e-2",
    "logging.progress=false",
    # the fullest path: KL to a reference (grpo preset), two passes of two mini-batches of
    # two micro-batches each, so old logprobs are recomputed and the ratio leaves 1
    "algo.preset=grpo",
    "algo.num_iterations=2",
    "algo.num_mini_batches=2",
]
STEP_KEYS = {
    "reward",
    "reward_std",
    "reward_parity",
    "reward_failures",
    "frac_zero_variance_groups",
    "num_zero_variance_groups",
    "completion_len_mean",
    "completion_len_max",
    "truncated_frac",
    "kl",
    "entropy",
    "clip_frac_low",
    "clip_frac_high",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "rollout_diff_mean",
    "rollout_diff_abs_mean",
    "rollout_diff_abs_max",
    "rollout_ratio_mean",
    "rollout_ratio_frac_low",
    "rollout_ratio_frac_high",
    "pg_loss",
    "loss",
    "grad_norm",
    "lr",
    "time_generation",
    "time_scoring",
    "time_training",
    "step_time",
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo") / "run"
    result = run_grpo(load_config(GRPOConfig, None, ARGS + [f"train.output_dir={out}"]))
    return out, result


def test_run_logs_every_metric_and_checkpoints(reference):
    out, result = reference
    train = records(out)
    assert sorted(train) == [1, 2, 3, 4]
    for step, record in train.items():
        assert STEP_KEYS <= set(record), f"step {step} lacks {sorted(STEP_KEYS - set(record))}"
    assert sorted(records(out, "eval")) == [0, 2, 4]
    assert set(result) >= {"accuracy", "accuracy_before", "run_dir"}
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step-000002", "step-000004"]
    assert (out / "final" / "model.safetensors").is_file() and (out / "summary.json").is_file()
    assert any(r["grad_norm"] > 0 for r in train.values()), "no step had a learning signal"
    # trainer and sampler agree at the same temperature: numerical noise only
    assert all(r["rollout_diff_abs_max"] < 1e-4 for r in train.values())
    # two passes: the second sees moved weights, so old logprobs were not the current ones
    assert any(r["ratio_max"] > 1 + 1e-6 or r["ratio_min"] < 1 - 1e-6 for r in train.values())


def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(reference, tmp_path):
    out, _ = reference
    assert_resume_is_bit_exact(
        run_grpo, GRPOConfig, ARGS, out, tmp_path / "resumed", 2, ("loss", "reward", "kl", "grad_norm")
    )


def tiny_batch(temperature=1.0):
    """A tiny model and a packed rollout of 2 prompts x 4 samples with fixed advantages."""
    model, tokenizer = load_model(
        ModelConfig(
            name="tiny:llama", tokenizer="char", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32
        )
    )
    prompts = rl.build_prompts(rl_config.RLDataConfig(task="addition", num_train=8, num_eval=0), tokenizer, seed=0)
    rollout_cfg = rl_config.RolloutConfig(num_prompts=2, group_size=4, max_new_tokens=4, temperature=temperature)
    rollout, _, _ = rl.sample_and_score(
        rl.PolicyEngine(model), tokenizer, prompts, [0, 1], rollout_cfg, RewardSet([("exact", 1.0)]), 0
    )
    batch = rl.pack_rollout(rollout, tokenizer.pad_token_id, need_rollout_logprobs=False)
    batch = batch.with_(advantages=torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25]))
    return model, batch


def test_on_policy_shortcut_equals_recomputed_old_logprobs():
    model, batch = tiny_batch()
    algo = load_config(GRPOConfig, None, ["data.task=addition", "algo.entropy_coef=0.01"]).algo.resolved()
    precision, counts = Precision(torch.device("cpu"), torch.float32), rl.global_counts(batch, 4)

    def loss_and_grads(old_logprobs):
        model.zero_grad()
        logprobs, entropy = rl.policy_logprobs(model, batch, 1.0, precision, entropy_grad=True)
        loss, _ = micro_loss(
            logprobs,
            entropy,
            dataclasses.replace(batch, old_logprobs=old_logprobs),
            rl_config.policy_spec(algo),
            counts,
        )
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    shortcut_loss, shortcut_grads = loss_and_grads(None)
    old_logprobs = rl.batch_logprobs(model, batch, batch.num_rows, 1.0, precision)
    recomputed_loss, recomputed_grads = loss_and_grads(old_logprobs)
    torch.testing.assert_close(shortcut_loss, recomputed_loss, rtol=0, atol=1e-7)
    assert any(g.abs().max() > 1e-4 for g in shortcut_grads)
    for got, want in zip(shortcut_grads, recomputed_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


def grpo_updates(model, batch, algo, updater, micro_batch_size, rows_to_train=None, flops_of=None, **plan) -> dict:
    """The update loop of ``grpo_step`` on a fixed batch: ``rl.Updates`` with the recipe's ``micro_loss``
    (``plan``: ``rl.UpdatePlan``'s options) -> the update metrics."""
    precision, spec = updater.precision, rl_config.policy_spec(algo)
    updates = rl.Updates(
        batch,
        rl.UpdatePlan(algo.num_iterations, algo.num_mini_batches, micro_batch_size, 4, **plan),
        updater,
        1,
        rows_to_train=rows_to_train,
        flops_of=flops_of,
    )
    for update in updates:
        for micro in update:
            logprobs, entropy = rl.policy_logprobs(model, micro, 1.0, precision, entropy_grad=spec.entropy_coef != 0)
            loss, metrics = micro_loss(logprobs, entropy, micro, spec, update.counts)
            update.backward(loss, metrics)
        update.step()
    return updates.metrics()


def run_update(model, batch, algo, **options):
    """Two passes of ``algo``'s mini-batches on a copy of ``model`` (AdamW, lr 1e-2, constant)
    -> (the copy's weights, update metrics)."""
    model = copy.deepcopy(model)
    precision = Precision(torch.device("cpu"), torch.float32)
    updater = Updater.build(model, OptimConfig(lr=1e-2, schedule="constant", weight_decay=0.0), 8, precision)
    metrics = grpo_updates(model, batch, algo, updater, 4, **options)
    return [p.detach().clone() for p in model.parameters()], metrics


def test_skipping_zero_advantage_rows_gives_the_same_update(monkeypatch):
    """Rows 1 and 3 of the first mini-batch (one micro-batch of 4) and the whole second mini-batch
    have advantage 0: skipping them must leave the weights of two passes where running them puts
    them, including the second mini-batch's update on a zero gradient (AdamW momentum alone)."""
    model, batch = tiny_batch()
    batch = batch.with_(advantages=torch.tensor([1.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    algo = load_config(
        GRPOConfig, None, ["data.task=addition", "algo.preset=dapo", "algo.num_iterations=2", "algo.num_mini_batches=2"]
    ).algo.resolved()
    batch = batch.with_(
        old_logprobs=rl.batch_logprobs(model, batch, 4, 1.0, Precision(torch.device("cpu"), torch.float32))
    )
    want, full = run_update(model, batch, algo)
    got, skipped = run_update(model, batch, algo, rows_to_train=rl.informative_rows(batch.advantages))
    assert skipped["frac_rows_trained"] == 2 / 8
    assert float(skipped["loss"]) == pytest.approx(float(full["loss"]), abs=1e-7)
    assert float(skipped["grad_norm_max"]) == pytest.approx(float(full["grad_norm_max"]), rel=1e-5)
    moved = max(float((w - p.detach()).abs().max()) for w, p in zip(want, model.parameters()))
    assert moved > 1e-3
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    # the zero-gradient updates matter: without them the weights end elsewhere
    monkeypatch.setattr(rl_update, "_zero_missing_grads", lambda module: None)
    without, _ = run_update(model, batch, algo, rows_to_train=rl.informative_rows(batch.advantages))
    assert max(float((w - g).abs().max()) for w, g in zip(want, without)) > 1e-4


def test_micro_batches_cut_from_length_sorted_rows_give_the_same_update(monkeypatch):
    """``rl.UpdatePlan(length_order=True)`` may cut micro-batches from rows sorted informative-first,
    longest first, where their forwards cost fewer FLOPs: the weights after two passes equal those of
    one micro-batch per mini-batch, for an aggregation normalised by global counts."""
    model, batch = tiny_batch()
    shortest = int(batch.attention_mask.sum(1).min())
    mask = torch.zeros_like(batch.attention_mask)
    mask[:, :shortest] = 1
    mask[[0, 2, 5, 7], shortest - 1] = 0  # these rows one token shorter than the others
    mixed = batch.with_(attention_mask=mask)
    assert rl_update.micro_batch_order(mixed).tolist() == [1, 3, 4, 6, 0, 2, 5, 7]
    informative = torch.tensor([True, False, False, True, True, False, True, True])
    assert rl_update.micro_batch_order(mixed, informative).tolist() == [3, 4, 6, 0, 7, 1, 2, 5]
    # the sorted rows are kept where they cost less (here: padded width x rows), else contiguous ones
    padded = lambda micro: micro.num_rows * int(micro.attention_mask.sum(1).max())  # noqa: E731
    ctx = ParallelContext()
    assert rl_update._micro_batch_plan(mixed, 4, None, ctx, True, padded)[1][0].tolist() == [1, 3, 4, 6]
    assert rl_update._micro_batch_plan(mixed, 4, None, ctx, False, padded)[1][0].tolist() == [0, 1, 2, 3]
    assert rl_update._micro_batch_plan(batch, 4, None, ctx, True, padded)[1][0].tolist() == [0, 1, 2, 3]  # a tie

    batch = batch.with_(advantages=torch.tensor([0.0, 1.0, 0.0, -1.0, 0.0, 0.5, 0.0, -0.5]))
    informative = rl.informative_rows(batch.advantages)
    algo = load_config(
        GRPOConfig, None, ["data.task=addition", "algo.preset=dapo", "algo.num_iterations=2", "algo.num_mini_batches=1"]
    ).algo.resolved()
    precision = Precision(torch.device("cpu"), torch.float32)
    batch = batch.with_(old_logprobs=rl.batch_logprobs(model, batch, 8, 1.0, precision))
    results, chosen = [], []
    plan = rl_update._micro_batch_plan
    monkeypatch.setattr(rl_update, "_micro_batch_plan", lambda *a: chosen.append(plan(*a)) or chosen[-1])
    cost = lambda micro: 1e3 + padded(micro)  # noqa: E731 -- a cost per forward: fewer, fuller micro-batches win
    for micro_batch_size, rows, length_order in ((8, None, False), (2, informative, True), (3, None, True)):
        trained = copy.deepcopy(model)
        updater = Updater.build(trained, OptimConfig(lr=1e-2, schedule="constant", weight_decay=0.0), 8, precision)
        grpo_updates(
            trained,
            batch,
            algo,
            updater,
            micro_batch_size,
            rows_to_train=rows,
            flops_of=cost,
            length_order=length_order,
        )
        results.append([p.detach() for p in trained.parameters()])
    assert max(float((w - p.detach()).abs().max()) for w, p in zip(results[0], model.parameters())) > 1e-2
    for cut in results[1:]:  # AdamW turns float rounding of near-zero gradients into up to ~3e-5 here
        for whole, got in zip(results[0], cut):
            torch.testing.assert_close(got, whole, rtol=0, atol=1e-4)
    # the second run took the sorted cut: its 4 informative rows in 2 micro-batches, not 4
    assert [len(rows) for rows in chosen[1][1]] == [2, 2]


def test_first_mini_batch_takes_pi_old_from_its_own_forward():
    """``first_on_policy``: the first update's pi_old is its own forward, so the old logprobs of
    its rows need not be computed; the result equals that of recomputed old logprobs."""
    model, batch = tiny_batch()
    algo = load_config(
        GRPOConfig, None, ["data.task=addition", "algo.preset=dapo", "algo.num_mini_batches=2"]
    ).algo.resolved()
    recomputed = rl.batch_logprobs(model, batch, 4, 1.0, Precision(torch.device("cpu"), torch.float32))
    want, _ = run_update(model, dataclasses.replace(batch, old_logprobs=recomputed), algo)
    unread = recomputed.clone()
    unread[:4] = float("nan")  # the first mini-batch's rows: never read
    got, metrics = run_update(model, dataclasses.replace(batch, old_logprobs=unread), algo, first_on_policy=True)
    assert torch.isfinite(metrics["loss"])
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


MATMUL_OPS = ("aten.mm", "aten.addmm", "aten.bmm")


def measured_matmul_flops(fn) -> int:
    """Matmul FLOPs torch actually dispatched while ``fn`` ran (attention-score kernels left out, as
    ``step_flops`` leaves them out); an independent count, not a restatement of the formula."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return sum(v for op, v in counter.get_flop_counts()["Global"].items() if str(op) in MATMUL_OPS)


def test_step_flops_partition_the_parameters():
    model, _ = tiny_batch()
    body, head = Run.matmul_params(model)
    embedding = model.get_input_embeddings().weight
    untied = 0 if model.get_output_embeddings().weight is embedding else embedding.numel()
    assert body + head + untied == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("micro_batch_size", [8, 1], ids=["shared-prompts", "packed-rows"])
def test_step_flops_equal_the_matmul_flops_torch_runs(micro_batch_size):
    model, tokenizer = load_model(
        ModelConfig(
            name="tiny:llama", tokenizer="char", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32
        )
    )
    prompts = rl.build_prompts(rl_config.RLDataConfig(task="addition", num_train=8, num_eval=0), tokenizer, seed=0)
    cfg = rl_config.RolloutConfig(num_prompts=2, group_size=4, max_new_tokens=4)
    rollouts = []
    sampling = measured_matmul_flops(
        lambda: rollouts.append(
            rl.sample_and_score(
                rl.PolicyEngine(model), tokenizer, prompts, [0, 1], cfg, RewardSet([("exact", 1.0)]), 0
            )[0]
        )
    )
    rollout = rollouts[0]
    batch = rl.pack_rollout(rollout, tokenizer.pad_token_id, need_rollout_logprobs=False)
    assert len(set(batch.trained_mask.sum(1).tolist())) > 1  # completions of different lengths
    precision = Precision(torch.device("cpu"), torch.float32)

    def train_pass(batch):  # forward + backward of every micro-batch, as the rl.Updates loop runs them
        for rows in torch.arange(batch.num_rows).split(micro_batch_size):
            logprobs, _ = rl.policy_logprobs(model, batch.select(rows), 1.0, precision)
            logprobs.sum().backward()

    # and with each row's last token untrained (an environment's), which the shared forward does not run
    last = rollout.completion_mask.cumsum(1) == rollout.completion_mask.sum(1, keepdim=True)
    tail = rl.pack_rollout(
        dataclasses.replace(rollout, trained_mask=rollout.completion_mask * ~last),
        tokenizer.pad_token_id,
        need_rollout_logprobs=False,
    )
    for part in (batch, tail):
        training = measured_matmul_flops(lambda: train_pass(part))
        forward_only = measured_matmul_flops(lambda: rl.batch_logprobs(model, part, micro_batch_size, 1.0, precision))
        want = sampling + training + forward_only
        assert rl.step_flops(model, part, micro_batch_size, 1, 1) == pytest.approx(want, rel=0.01)


def test_shared_prompt_forward_equals_the_packed_forward():
    # each prompt runs once per group (its KV cache repeated for the group's rows): the same logits and
    # gradients as the packed rows, for prompts of different lengths, completions that stop early, and
    # a micro-batch with partial groups
    model, tokenizer = load_model(
        ModelConfig(
            name="tiny:llama", tokenizer="char", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32
        )
    )
    prompts = [tokenizer.encode("12+34="), tokenizer.encode("1+2="), tokenizer.encode("123+45=")]
    assert len({len(p) for p in prompts}) == 3
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=[tokenizer.eos_token_id, 5, 9], seed=1)
    rollout = generate(model, prompts, params, num_samples=3, pad_token_id=tokenizer.pad_token_id)
    assert len(set(rollout.completion_lens.tolist())) > 1
    batch = rl.pack_rollout(rollout, tokenizer.pad_token_id, need_rollout_logprobs=False)
    # a multi-turn row's last trained token may be followed by environment tokens: untrain each row's
    # last token, so that the shared forward stops a column short of the completion width
    last = rollout.completion_mask.cumsum(1) == rollout.completion_mask.sum(1, keepdim=True)
    untrained_tail = dataclasses.replace(rollout, trained_mask=rollout.completion_mask * ~last)
    tail_batch = rl.pack_rollout(untrained_tail, tokenizer.pad_token_id, need_rollout_logprobs=False)
    assert rl.trained_width(tail_batch.trained_mask) == tail_batch.completion_ids.shape[1] - 1
    model.train()
    for micro in [
        b.select(rows) for b in (batch, tail_batch) for rows in (torch.arange(9), torch.tensor([1, 2, 3, 4, 7]))
    ]:
        assert rl.shares_prompts(model, micro)
        results = []
        for forward in (
            lambda: rl.shared_prompt_logits(model, micro),
            lambda: logits_at(model, micro.input_ids, micro.attention_mask, micro.positions),
        ):
            model.zero_grad()
            logits = forward()
            (logits.logsumexp(-1).sum() + logits[:, 3].sum()).backward()
            results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
        (shared, shared_grads), (packed, packed_grads) = results
        assert shared.shape == packed.shape == (int(micro.trained_mask.sum()), len(tokenizer))
        torch.testing.assert_close(shared, packed, rtol=0, atol=1e-5)
        for got, want in zip(shared_grads, packed_grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_packed_rows_reproduce_the_sampler_logprobs():
    # at T != 1, so that training logprobs of softmax(logits) instead of softmax(logits / T) fail
    model, batch = tiny_batch(temperature=0.7)
    precision = Precision(torch.device("cpu"), torch.float32)
    logprobs = rl.batch_logprobs(model, batch, 3, 0.7, precision)
    mask = batch.trained_mask.bool()
    torch.testing.assert_close(logprobs[mask], batch.rollout_logprobs[mask], rtol=0, atol=1e-5)
    assert (logprobs[~mask] == 0).all()


def test_importance_sampling_without_rollout_logprobs_fails_loudly(tmp_path, monkeypatch):
    from lmforge.rl.sources import inprocess

    real_generate = inprocess.generate
    monkeypatch.setattr(
        inprocess, "generate", lambda *a, **k: dataclasses.replace(real_generate(*a, **k), logprobs=None)
    )
    cfg = load_config(GRPOConfig, None, ARGS + [f"train.output_dir={tmp_path}", "algo.is_level=token"])
    with pytest.raises(TrainingError, match="is_level"):
        run_grpo(cfg)


def test_bf16_sampler_copy_follows_the_policy_and_is_corrected_by_importance_sampling(reference, tmp_path):
    out = tmp_path / "bf16"
    run_grpo(
        load_config(GRPOConfig, None, ARGS + [f"train.output_dir={out}", "rollout.dtype=bf16", "algo.is_level=token"])
    )
    train, fp32 = records(out), records(reference[0])
    assert sorted(train) == [1, 2, 3, 4]
    # the samples come from the bf16 copy: the trainer's fp32 logprobs differ by rounding, far more
    # than the fp32 sampler's noise (< 1e-4 above) and far less than a different policy would
    for step, record in train.items():
        assert 1e-4 < record["rollout_diff_abs_max"] < 0.5, (step, record["rollout_diff_abs_max"])
        assert record["rollout_diff_abs_max"] > 10 * fp32[step]["rollout_diff_abs_max"]
    # the copy was synced each step: after optimizer steps it still tracks the moved policy
    assert train[4]["rollout_diff_abs_mean"] < 0.05


def test_bf16_sampler_without_importance_sampling_says_so(tmp_path, capsys):
    run_grpo(
        load_config(
            GRPOConfig,
            None,
            ARGS + [f"train.output_dir={tmp_path}", "rollout.dtype=bf16", "train.max_steps=1", "train.eval_every=0"],
        )
    )
    assert "algo.is_level=token corrects for it" in capsys.readouterr().out


def test_nan_loss_stops_the_run_before_the_update(tmp_path, monkeypatch):
    import lmforge.recipes.grpo as grpo

    real = grpo.micro_loss

    def poisoned(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss * float("nan"), metrics

    monkeypatch.setattr(grpo, "micro_loss", poisoned)
    model, tokenizer = load_model(
        ModelConfig(
            name="tiny:llama", tokenizer="char", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32
        )
    )
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TrainingError, match="non-finite loss .* step 1"):
        run_grpo(load_config(GRPOConfig, None, ARGS + [f"train.output_dir={tmp_path}"]), model, tokenizer)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # no update was applied


def test_importance_sampling_with_truncated_sampling_is_a_config_error(tmp_path):
    cfg = load_config(
        GRPOConfig, None, ARGS + [f"train.output_dir={tmp_path}", "algo.is_level=sequence", "rollout.top_k=5"]
    )
    with pytest.raises(ConfigError, match="top_k"):
        run_grpo(cfg)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            [],
            dict(
                advantage="group_norm",
                loss_type="token_clip",
                aggregation="seq_mean_token_mean",
                eps_low=0.2,
                eps_high=0.2,
                kl_coef=0.0,
            ),
        ),
        (["algo.preset=dapo"], dict(aggregation="global_token_mean", eps_low=0.2, eps_high=0.28, kl_coef=0.0)),
        (["algo.preset=dapo", "algo.eps_high=0.3"], dict(eps_high=0.3)),
        (["algo.preset=dr_grpo"], dict(advantage="group_mean", aggregation="seq_sum_max_len")),
        (["algo.preset=gspo"], dict(loss_type="gspo", eps_low=3e-4, eps_high=4e-4)),
        (["algo.loss_type=gspo_token"], dict(eps_low=3e-4, eps_high=4e-4)),
        (["algo.preset=dapo", "algo.loss_type=gspo"], dict(eps_low=3e-4, eps_high=4e-4)),
        (["algo.loss_type=gspo", "algo.eps_low=1e-3"], dict(eps_low=1e-3, eps_high=4e-4)),
        (["algo.preset=rloo"], dict(advantage="rloo", aggregation="seq_sum_max_len")),
        (["algo.preset=grpo", "algo.kl_coef=0"], dict(kl_coef=0.0)),
    ],
)
def test_presets_and_explicit_keys(overrides, expected):
    algo = load_config(GRPOConfig, None, ["data.task=addition", *overrides]).algo.resolved()
    assert {key: getattr(algo, key) for key in expected} == expected


@pytest.mark.parametrize(
    "override, message",
    [
        ("algo.preset=grpoo", "valid: grpo, dr_grpo, dapo, gspo, rloo"),
        ("algo.loss_type=ppo", "valid: token_clip, gspo, gspo_token"),
        ("algo.aggregation=mean", "algo.aggregation='mean' is not known"),
        ("algo.advantage=gae", "valid: group_norm, group_mean, rloo, batch_norm"),
        ("algo.kl_estimator=k4", "algo.kl_estimator"),
        ("algo.is_level=tokens", "valid: none, token, sequence"),
        ("algo.dual_clip=0.5", "dual_clip"),
        ("rollout.temperature=0", "rollout.temperature"),
        ("rollout.dtype=fp8", "expected one of 'same', 'bf16', 'fp16'"),
        (["rollout.backend=vllm", "rollout.dtype=bf16"], "applies to the inprocess backend"),
        ("rewards.functions=[{nme: exact}]", "rewards.functions\\[0\\]"),
    ],
)
def test_bad_config_is_a_clear_error(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(GRPOConfig, None, ["data.task=addition", *([override] if isinstance(override, str) else override)])


def test_cli_reports_a_bad_preset(capsys):
    assert cli.main(["grpo", "data.task=addition", "algo.preset=nope"]) == 2
    assert "algo.preset='nope' is not known" in capsys.readouterr().err


@pytest.mark.parametrize("advantage", ["group_norm", "group_mean"])
def test_advantages_of_hands_std_eps_to_std_normalising_estimators_only(advantage):
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    algo = load_config(
        GRPOConfig, None, ["data.task=addition", f"algo.advantage={advantage}", "algo.std_eps=1.0"]
    ).algo.resolved()
    got, _ = advantages_of(rewards, algo, 4)
    grouped = rewards.view(2, 4)
    centred = grouped - grouped.mean(1, keepdim=True)
    want = centred / (grouped.std(1, keepdim=True) + 1.0) if advantage == "group_norm" else centred
    torch.testing.assert_close(got, want.flatten(), rtol=0, atol=1e-7)
