"""Data parallelism changes how a step is computed, never what: 2 gloo ranks x B rows (DDP and FSDP2,
with and without accumulation) give the per-step losses and the weights after 3 optimizer steps of
1 process x 2B rows, for SFT (also with the ring all-reduce as DDP's gradient hook), GRPO under its four
aggregations (and with two mini-batches per step; and skipping zero-advantage
rows, against one process that runs them) and PPO (value head, GAE, advantages whitened over all ranks),
and both again on multi-turn rows whose trained tokens are two spans around environment tokens;
DPO (frozen reference, 8 preference pairs a step, chosen and rejected in one forward) and SimPO; a
reward model (Bradley-Terry, the same pairs, 1 pair per micro-batch on each rank too);
distillation: on-policy with the sampled and the full-vocabulary reverse KL (plus half a task reward), and
logit (forward KL at T = 2).

Tolerance: everything runs in fp32. What differs between the runs is the order of floating-point
sums (a loss is a sum of per-rank partial sums; a gradient the sum of two ranks' gradients; a
padded micro-batch has other matmul shapes), each step rounding at ~6e-8 relative. Over 3 AdamW
steps with eps = 1e-3 (equivalence_cases.OPTIM: the update is then Lipschitz in the gradient), the
observed differences were at most 1.2e-7 in a weight and 3e-6 relative in a loss. The bounds below
(weights 2e-5 absolute, for weights moved by ~3 x lr = 3e-2; losses 2e-5 relative) leave room for
other CPUs' kernels and stay far below a wrong normalisation: averaging instead of summing the two
ranks' gradients moved the weights by 1e-3 to 9e-3 from the reference (checked by breaking it once).
"""

from __future__ import annotations

import equivalence_cases as cases
import pytest
import torch
import torch.multiprocessing as mp

from lmforge.parallel.context import free_port

# (case, micro-batch size on one process) -> (micro-batch sizes on each of 2 ranks) that must agree.
# token_mean is a mean per micro-batch, so its reference is the one-process run with the same
# micro-batches (4 rows), not the one-micro-batch run: only the world size changes.
PLAN_1 = [
    ("sft", 8),
    ("sft-ring", 8),
    ("grpo-seq_mean_token_mean", 16),
    ("grpo-token_mean", 4),
    ("grpo-global_token_mean", 16),
    ("grpo-seq_sum_max_len", 16),
    ("grpo-minibatches", 8),
    ("grpo-skip-zero-advantage", 8),
    ("ppo", 16),
    ("grpo-spans", 8),
    ("ppo-spans", 16),
    ("dpo", 8),
    ("simpo", 8),
    ("rm", 8),
    ("distill-sampled", 16),
    ("distill-full", 16),
    ("distill-logit", 8),
]
PLAN_2 = {
    "sft": [4, 2],
    "sft-ring": [4, 2],
    "grpo-seq_mean_token_mean": [8, 4],
    "grpo-token_mean": [4],
    "grpo-global_token_mean": [8, 4],
    "grpo-seq_sum_max_len": [8, 4],
    "grpo-minibatches": [4, 2],
    "grpo-skip-zero-advantage": [4, 2],
    "ppo": [8, 4],
    "grpo-spans": [4, 2],
    "ppo-spans": [8, 4],
    "dpo": [4, 2],
    "simpo": [4],
    "rm": [4, 1],
    "distill-sampled": [8, 4],
    "distill-full": [8, 4],
    "distill-logit": [4, 2],
}
# The logit-distillation loss is a small KL (~5e-3 per token between two near-uniform tiny models) summed
# from O(1) terms p (log p - log q) in fp32: its rounding is ~1e-7 absolute (observed 1.3e-7, 3e-5
# relative), while its weights agree to 6e-8. Summing instead of averaging the ranks would double it.
LOSS_ABS = {"distill-logit": 3e-7}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("equivalence")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in each rank: the same kernels sample the same fixed rollout
    try:
        single = cases.run_cases(root / "w1", PLAN_1, "ddp")
    finally:
        torch.set_num_threads(threads)
    multi = {}
    plan = [(name, micro) for name, micros in PLAN_2.items() for micro in micros]
    for strategy in ("ddp", "fsdp2"):
        path = root / f"{strategy}.pt"
        mp.start_processes(
            cases.worker,
            args=(2, free_port(), str(root / strategy), plan, strategy, str(path)),
            nprocs=2,
            start_method="spawn",
            join=True,
        )
        multi[strategy] = torch.load(path, weights_only=False)
    return single, multi


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.parametrize("name", list(PLAN_2))
def test_two_ranks_match_one_process(results, name, strategy):
    single, multi = results
    reference = single[f"{name}@{dict(PLAN_1)[name]}"]
    for micro in PLAN_2[name]:
        got = multi[strategy][f"{name}@{micro}"]
        assert got["losses"] == pytest.approx(reference["losses"], rel=2e-5, abs=LOSS_ABS.get(name, 1e-7)), (
            name,
            micro,
        )
        assert got["weights"].keys() == reference["weights"].keys()
        worst = max((got["weights"][k] - reference["weights"][k]).abs().max().item() for k in got["weights"])
        assert worst < 2e-5, f"{name} micro={micro} {strategy}: weights differ by {worst:.2e}"


def test_the_steps_moved_the_weights(results):
    """The comparison above means something only if training changed the weights far beyond the bound."""
    single, _ = results
    from lmforge.model.load import load_model

    start = load_model(cases.MODEL)[0].state_dict()
    for key, result in single.items():
        moved = max((result["weights"][k] - start[k]).abs().max().item() for k in start if k in result["weights"])
        assert moved > 1e-3, f"{key}: weights moved only {moved:.1e}"
