"""``rl.updates.Updates``, the update phase a recipe's step iterates: the counts each update's loss is
normalised by, which rows and micro-batches run, where gradients are synced, the optimizer steps, and
the weights it leaves, against a hand-written loop of the same computation."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from lmforge import rl
from lmforge.core.config import ModelConfig, OptimConfig
from lmforge.losses.policy import Counts, PolicyLossSpec, policy_loss
from lmforge.model.load import load_model
from lmforge.parallel.context import ParallelContext
from lmforge.rl import config as rl_config
from lmforge.rollout import RewardSet
from lmforge.runtime.optim import Precision, Updater

PRECISION = Precision(torch.device("cpu"), torch.float32)
DAPO = PolicyLossSpec(loss_type="token_clip", aggregation="global_token_mean", eps_low=0.2, eps_high=0.28)
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25])


@pytest.fixture(scope="module")
def tiny():
    """A tiny model and a packed rollout of 2 prompts x 4 samples with fixed advantages and pi_old."""
    torch.manual_seed(0)
    model, tokenizer = load_model(
        ModelConfig(
            name="tiny:llama", tokenizer="char", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32
        )
    )
    prompts = rl.build_prompts(rl_config.RLDataConfig(task="addition", num_train=8, num_eval=0), tokenizer, seed=0)
    rollout_cfg = rl_config.RolloutConfig(num_prompts=2, group_size=4, max_new_tokens=4)
    rollout, _, _ = rl.sample_and_score(
        rl.PolicyEngine(model), tokenizer, prompts, [0, 1], rollout_cfg, RewardSet([("exact", 1.0)]), 0
    )
    batch = rl.pack_rollout(rollout, tokenizer.pad_token_id, need_rollout_logprobs=False).with_(advantages=ADVANTAGES)
    batch = batch.with_(old_logprobs=rl.batch_logprobs(model, batch, 8, 1.0, PRECISION))
    assert len(set(batch.trained_mask.sum(1).tolist())) > 1  # rows of different lengths: the counts differ
    return model, batch


def updater_of(model, num_updates: int = 16) -> Updater:
    return Updater.build(model, OptimConfig(lr=1e-2, schedule="constant", weight_decay=0.0), num_updates, PRECISION)


def micro_loss(model, micro, counts: Counts) -> tuple[torch.Tensor, dict]:
    """GRPO's loss of one micro-batch (pi_old from the micro-batch, or its own forward when None)."""
    logprobs, _ = rl.policy_logprobs(model, micro, 1.0, PRECISION)
    old = logprobs.detach() if micro.old_logprobs is None else micro.old_logprobs
    return policy_loss(logprobs, old, micro.advantages, micro.trained_mask, DAPO, counts)


def run(updates: rl.Updates, model, seen=None) -> dict:
    """The recipes' loop over ``updates``; ``seen`` collects (update, micro-batch) pairs."""
    for update in updates:
        for micro in update:
            if seen is not None:
                seen.append((update, micro))
            update.backward(*micro_loss(model, micro, update.counts))
        update.step()
    return updates.metrics()


class MirroredRanks(ParallelContext):
    """Two ranks that hold the same rows: a sum doubles, a max or min is the value; every
    collective is recorded as (op, values before)."""

    def __init__(self):
        super().__init__(rank=0, world_size=2)
        self.calls = []

    def all_reduce(self, tensor, op=torch.distributed.ReduceOp.SUM):
        self.calls.append((op, tensor.tolist()))
        if op == torch.distributed.ReduceOp.SUM:
            tensor.mul_(2)
        return tensor


def test_counts_are_summed_once_per_update_over_micro_batches_and_ranks(tiny):
    model, batch = tiny
    model = copy.deepcopy(model)
    ctx = MirroredRanks()
    plan = rl.UpdatePlan(num_iterations=2, num_mini_batches=2, micro_batch_size=2, max_completion_len=4)
    seen = []
    run(rl.Updates(batch, plan, updater_of(model), 1, ctx), model, seen)
    sums = [values for _, values in ctx.calls if isinstance(values, list) and all(isinstance(v, int) for v in values)]
    assert len(sums) == 2  # one collective per mini-batch, on the first pass only; none per micro-batch
    halves = batch.trained_mask.sum(1).split(4)
    for position, (update, micro) in enumerate(seen):
        m = (position // 2) % 2  # two micro-batches per update, two updates per pass
        assert update.counts == Counts(
            num_seqs_global=8,
            num_loss_tokens_global=2 * int(halves[m].sum()),
            max_completion_len=4,
            num_micro_batches_global=4,
        )
        assert micro.num_rows == 2
    assert len({id(update) for update, _ in seen}) == 4


def test_zero_advantage_rows_do_not_run_and_keep_the_counts(tiny):
    model, batch = tiny
    model = copy.deepcopy(model)
    advantages = torch.tensor([1.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0])
    batch = batch.with_(advantages=advantages)
    plan = rl.UpdatePlan(num_iterations=1, num_mini_batches=1, micro_batch_size=2, max_completion_len=4)
    skipped, full = [], []
    metrics = run(
        rl.Updates(batch, plan, updater_of(model), 1, rows_to_train=rl.informative_rows(advantages)), model, skipped
    )
    run(rl.Updates(batch, plan, updater_of(copy.deepcopy(model)), 1), model, full)
    # the rows run are the informative ones, each micro-batch keeping only its own
    assert [micro.advantages.tolist() for _, micro in skipped] == [[1.0], [-1.0]]
    assert len(full) == 4
    assert skipped[0][0].counts == full[0][0].counts == Counts(8, int(batch.trained_mask.sum()), 4, 4)
    assert metrics["frac_rows_trained"] == 2 / 8


def test_a_micro_batch_without_rows_here_runs_whole_when_another_rank_has_some(tiny):
    """Every rank must make the same forwards (DDP and FSDP2 communicate inside them)."""
    model, batch = tiny
    model = copy.deepcopy(model)

    class OtherRankHasRowsEverywhere(MirroredRanks):
        def all_reduce(self, tensor, op=torch.distributed.ReduceOp.SUM):
            if op == torch.distributed.ReduceOp.MAX and tensor.dtype == torch.float32:
                tensor.fill_(1.0)  # the other rank has informative rows in every micro-batch
                return tensor
            return super().all_reduce(tensor, op)

    informative = torch.tensor([True, False, False, False, False, False, False, True])
    plan = rl.UpdatePlan(num_iterations=1, num_mini_batches=1, micro_batch_size=2, max_completion_len=4)
    seen = []
    run(
        rl.Updates(batch, plan, updater_of(model), 1, OtherRankHasRowsEverywhere(), rows_to_train=informative),
        model,
        seen,
    )
    assert [micro.num_rows for _, micro in seen] == [1, 2, 2, 1]  # rows 2-5 run whole: none is informative here


class RecordingRoot(torch.nn.Module):
    """A stand-in for a DDP root: ``no_sync`` is recorded, and whether a backward ran inside it."""

    def __init__(self):
        super().__init__()
        self.inside = False

    @contextlib.contextmanager
    def no_sync(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


def test_gradients_are_synced_on_the_last_micro_batch_only(tiny):
    model, batch = tiny
    model = copy.deepcopy(model)
    root = RecordingRoot()
    plan = rl.UpdatePlan(num_iterations=1, num_mini_batches=2, micro_batch_size=1, max_completion_len=4)
    updates = rl.Updates(batch.select(torch.arange(6)), plan, updater_of(model), 1, wrapped=root)
    synced = []
    for update in updates:
        for micro in update:
            loss, metrics = micro_loss(model, micro, update.counts)
            update.backward(loss, metrics)
            synced.append(not root.inside)
        update.step()
    assert synced == [False, False, True, False, False, True]


def test_missing_gradients_are_zeroed_when_no_micro_batch_runs(tiny):
    """An update whose rows all have advantage 0 steps AdamW on zero gradients, as the full
    computation would; a parameter whose .grad is None would be skipped by the optimizer."""
    model, batch = tiny
    model = copy.deepcopy(model)
    batch = batch.with_(advantages=torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0]))
    updater = updater_of(model)
    grads, real_step = [], updater.step

    def step(index):
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        return real_step(index)

    updater.step = step
    plan = rl.UpdatePlan(num_iterations=1, num_mini_batches=2, micro_batch_size=4, max_completion_len=4)
    seen = []
    run(rl.Updates(batch, plan, updater, 1, rows_to_train=rl.informative_rows(batch.advantages)), model, seen)
    assert len(seen) == 1 and len(grads) == 2  # the second update ran nothing and still stepped
    assert any(float(g.abs().max()) > 0 for g in grads[0])
    assert all(g is not None and not g.any() for g in grads[1])


@pytest.mark.parametrize("num_iterations, num_mini_batches", [(1, 1), (2, 1), (1, 4), (3, 2)])
def test_one_optimizer_step_per_update(tiny, num_iterations, num_mini_batches):
    model, batch = tiny
    model = copy.deepcopy(model)
    updater = updater_of(model)
    calls, real_step = [], updater.step
    updater.step = lambda index: calls.append(index) or real_step(index)
    plan = rl.UpdatePlan(num_iterations, num_mini_batches, micro_batch_size=3, max_completion_len=4)
    run(rl.Updates(batch, plan, updater, 7), model)
    assert calls == [7] * (num_iterations * num_mini_batches) == [7] * plan.num_updates
    assert updater.scheduler.last_epoch == plan.num_updates


def test_a_loop_that_skips_backward_or_step_is_an_error(tiny):
    model, batch = tiny
    model = copy.deepcopy(model)
    plan = rl.UpdatePlan(num_iterations=1, num_mini_batches=2, micro_batch_size=4, max_completion_len=4)
    updates = rl.Updates(batch, plan, updater_of(model), 1)
    with pytest.raises(RuntimeError, match="update.step"):
        for update in updates:
            for micro in update:
                update.backward(*micro_loss(model, micro, update.counts))
    with pytest.raises(RuntimeError, match="update.backward"):
        for update in rl.Updates(batch, plan, updater_of(model), 1):
            for micro in update:
                pass


@pytest.mark.parametrize("first_on_policy", [False, True])
def test_first_on_policy_gives_the_first_update_no_pi_old(tiny, first_on_policy):
    model, batch = tiny
    model = copy.deepcopy(model)
    plan = rl.UpdatePlan(
        num_iterations=2, num_mini_batches=2, micro_batch_size=2, max_completion_len=4, first_on_policy=first_on_policy
    )
    seen = []
    run(rl.Updates(batch, plan, updater_of(model), 1), model, seen)
    has_pi_old = [micro.old_logprobs is not None for _, micro in seen]
    assert has_pi_old == [not first_on_policy] * 2 + [True] * 6  # two micro-batches per update


def hand_loop(model, batch, num_iterations: int, num_mini_batches: int, micro_batch_size: int) -> list[float]:
    """The update phase written out: contiguous mini-batches, each update's counts summed by hand, one
    backward per micro-batch, one optimizer step per update (the optimizer's own code). -> losses."""
    updater = updater_of(model)
    losses = []
    for _ in range(num_iterations):
        for mini_rows in torch.arange(batch.num_rows).tensor_split(num_mini_batches):
            mini = batch.select(mini_rows)
            micro_rows = list(torch.arange(mini.num_rows).split(micro_batch_size))
            counts = Counts(
                num_seqs_global=mini.num_rows,
                num_loss_tokens_global=int(mini.trained_mask.sum()),
                max_completion_len=4,
                num_micro_batches_global=len(micro_rows),
            )
            total = torch.zeros(())
            for rows in micro_rows:
                loss, _ = micro_loss(model, mini.select(rows), counts)
                loss.backward()
                total = total + loss.detach()
            updater.step(1)
            losses.append(float(total))
    return losses


def test_the_loop_leaves_the_weights_of_a_hand_written_loop_bit_for_bit(tiny):
    model, batch = tiny
    want_model, got_model = copy.deepcopy(model), copy.deepcopy(model)
    want_losses = hand_loop(want_model, batch, 2, 2, 3)
    plan = rl.UpdatePlan(num_iterations=2, num_mini_batches=2, micro_batch_size=3, max_completion_len=4)
    updates = rl.Updates(batch, plan, updater_of(got_model), 1)
    metrics = run(updates, got_model)
    assert [float(loss) for loss in updates.losses] == want_losses
    assert float(metrics["loss"]) == pytest.approx(sum(want_losses) / 4, rel=1e-6)
    moved = max(float((w - p).detach().abs().max()) for w, p in zip(want_model.parameters(), model.parameters()))
    assert moved > 1e-3
    for want, got in zip(want_model.parameters(), got_model.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
