"""The cases of test_equivalence.py, run in one process or in each spawned gloo rank.

Each case trains a tiny Llama for 3 optimizer steps on a fixed global batch and records the per-step
losses and the final weights. The batch is the same for every world size: SFT rows in the seeded
order, and for GRPO / PPO one rollout sampled with a fixed seed on every rank (identical, since the
model and the seed are), of which each rank keeps its share (``rl.rank_prompts``).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from lmforge import rl
from lmforge.core.config import LoggingConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from lmforge.losses.advantages import compute_advantages
from lmforge.model.load import load_model
from lmforge.parallel.wrap import full_state_dict
from lmforge.recipes import distill, dpo, grpo, ppo, rm
from lmforge.recipes.sft import SFTConfig
from lmforge.rl import config as rl_config
from lmforge.rl.config import RLDataConfig, RolloutConfig
from lmforge.rollout import RolloutBatch, SamplingParams, generate
from lmforge.rollout.reward_model import from_causal_lm
from lmforge.runtime.loop import build_state
from lmforge.runtime.optim import BatchOrder
from lmforge.runtime.run import start_run
from lmforge.supervised.sft_data import SFTDataConfig, build_data
from lmforge.supervised.step import supervised_step

STEPS = 3
MODEL = ModelConfig(
    name="tiny:llama",
    tokenizer="char",
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    max_position_embeddings=32,
    init_seed=0,
)
# AdamW's update lr * m / (sqrt(v) + eps) is ~ lr * sign(g) where |g| << eps: a gradient that differs in
# its last bits between two summation orders could flip such an update. eps = 1e-3 keeps the update
# Lipschitz in g (constant lr / eps = 10), so fp32 rounding in g stays fp32-sized in the weights.
OPTIM = OptimConfig(lr=1e-2, eps=1e-3, weight_decay=0.0, schedule="constant")


class Quiet:
    def print(self, *args, **kwargs):
        pass


def train_config(out: Path, micro: int, batch: int) -> TrainConfig:
    return TrainConfig(
        output_dir=str(out),
        max_steps=STEPS,
        batch_size=batch,
        micro_batch_size=micro,
        threads=1,
        dtype="fp32",
        device="cpu",
        gradient_checkpointing="off",
        save_every=0,
    )


def sft_case(out: Path, micro: int, strategy: str, grad_sync: str = "native") -> dict:
    cfg = SFTConfig(
        model=MODEL,
        data=SFTDataConfig(task="addition", num_train=64, num_val=8, max_len=32),
        optim=OPTIM,
        train=train_config(out, micro, batch=8),
        parallel=ParallelConfig(strategy=strategy, grad_sync=grad_sync),
        logging=LoggingConfig(progress=False),
    )
    model, tokenizer = load_model(cfg.model)
    run = start_run(cfg, "sft", model, seq_len=32, console=Quiet())
    data, _ = build_data(cfg.data, cfg.train.seed, cfg.model, tokenizer, lambda *_: None)
    state = build_state(run, model, tokenizer, BatchOrder(len(data.train_rows), 8, 0), STEPS)
    losses = [float(supervised_step(state, data, step)["loss"]) for step in range(1, STEPS + 1)]
    return {"losses": losses, "weights": full_state_dict(state.wrapped)}


def dpo_case(out: Path, micro: int, strategy: str, loss: str = "sigmoid") -> dict:
    """Preference pairs from the addition task, 8 pairs a step (16 rows: chosen and rejected), the
    frozen reference's logprobs computed per batch; the pair count of the step is the normaliser."""
    cfg = dpo.DPOConfig(
        model=MODEL,
        data=dpo.PreferenceDataConfig(task="addition", num_train=64, num_val=0, num_eval=0, max_len=32),
        algo=dpo.PreferenceAlgoConfig(loss=loss, beta=0.5),
        optim=OPTIM,
        train=train_config(out, micro, batch=8),
        parallel=ParallelConfig(strategy=strategy),
        logging=LoggingConfig(progress=False),
    )
    model, tokenizer = load_model(cfg.model)
    run = start_run(cfg, "dpo", model, seq_len=64, console=Quiet())
    pairs, _ = dpo.build_pairs(cfg.data, cfg.train, cfg.model, tokenizer, lambda *_: None)
    reference = dpo.make_reference(model, loss)
    state = build_state(run, model, tokenizer, BatchOrder(len(pairs), 8, 0), STEPS)
    losses = [float(dpo.dpo_step(state, pairs, cfg.algo, reference, step)["loss"]) for step in range(1, STEPS + 1)]
    return {"losses": losses, "weights": full_state_dict(state.wrapped)}


def rm_case(out: Path, micro: int, strategy: str) -> dict:
    """A reward model (Bradley-Terry) on the addition pairs, 8 pairs a step (16 rows: chosen and
    rejected in one forward); the pair count of the step is the normaliser."""
    cfg = rm.RMConfig(
        model=MODEL,
        data=dpo.PreferenceDataConfig(task="addition", num_train=64, num_val=0, max_len=32),
        optim=OPTIM,
        train=train_config(out, micro, batch=8),
        parallel=ParallelConfig(strategy=strategy),
        logging=LoggingConfig(progress=False),
    )
    model, tokenizer = load_model(cfg.model)
    run = start_run(cfg, "rm", model, seq_len=64, console=Quiet())
    pairs, _ = rm.build_pairs(cfg.data, cfg.train, cfg.model, tokenizer, lambda *_: None)
    state = build_state(run, from_causal_lm(model, tokenizer), tokenizer, BatchOrder(len(pairs), 8, 0), STEPS)
    losses = [float(rm.rm_step(state, pairs, cfg.algo, step)["loss"]) for step in range(1, STEPS + 1)]
    return {"losses": losses, "weights": full_state_dict(state.wrapped)}


def fixed_rollout(model, tokenizer, prompts, num_prompts: int, group_size: int):
    """One rollout of the first ``num_prompts`` prompts, the same on every rank (fixed seed)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=[tokenizer.eos_token_id], seed=1234)
    with torch.no_grad():
        return generate(
            model.eval(),
            prompts.prompt_ids[:num_prompts],
            params,
            num_samples=group_size,
            pad_token_id=tokenizer.pad_token_id,
        )


ENV_IDS = [5, 6]  # environment / tool tokens put between the policy's first two tokens and the rest


def with_environment_tokens(rollout: RolloutBatch) -> RolloutBatch:
    """Each row as a multi-turn row: ``ENV_IDS`` after its first two tokens (after its only one, for a
    one-token completion), real but not trained, so its trained tokens are two separate spans."""
    rows, trained = [], []
    for ids, real in zip(rollout.completion_ids.tolist(), rollout.completion_mask.tolist()):
        ids, cut = ids[: sum(real)], min(2, sum(real))
        rows.append(ids[:cut] + ENV_IDS + ids[cut:])
        trained.append([1] * cut + [0] * len(ENV_IDS) + [1] * (len(ids) - cut))
    width = max(map(len, rows))
    pad = lambda values, fill: torch.tensor([v + [fill] * (width - len(v)) for v in values])  # noqa: E731
    real = pad([[1] * len(r) for r in rows], 0)
    return dataclasses.replace(
        rollout,
        completion_ids=pad(rows, 0),
        completion_mask=real,
        trained_mask=pad(trained, 0),
        logprobs=torch.zeros(real.shape),
        completion_lens=real.sum(1),
    )


def rank_rows(num_prompts: int, group_size: int, num_mini: int, ctx) -> torch.Tensor:
    prompts = rl.rank_prompts(list(range(num_prompts)), num_mini, ctx)
    return torch.tensor([p * group_size + g for p in prompts for g in range(group_size)])


def run_updates(state, batch, plan, step: int, loss_of, rows_to_train=None) -> float:
    """The recipes' update loop (``rl.Updates``) on a fixed batch, ``loss_of(micro, counts) -> (loss, metrics)``
    being the recipe's forward and ``micro_loss``; returns the step's loss."""
    updates = rl.Updates(
        batch, plan, state.updater, step, state.run.ctx, state.train.wrapped, rows_to_train=rows_to_train
    )
    for update in updates:
        for micro in update:
            update.backward(*loss_of(micro, update.counts))
        update.step()
    return float(updates.metrics()["loss"])


def rl_case(
    out: Path,
    recipe: str,
    aggregation: str,
    micro: int,
    strategy: str,
    num_mini: int = 1,
    skip: bool = False,
    spans: bool = False,
) -> dict:
    """``skip``: rewards with zero-advantage rows and whole zero-variance groups; several ranks skip
    those rows (``rows_to_train``, ``first_on_policy``), one process runs the full computation.
    ``spans``: every row multi-turn (:func:`with_environment_tokens`), trained on two spans."""
    num_prompts, group = 4, 4
    config_cls = grpo.GRPOConfig if recipe == "grpo" else ppo.PPOConfig
    algo_cls = grpo.GRPOAlgoConfig if recipe == "grpo" else ppo.PPOAlgoConfig
    cfg = config_cls(
        model=MODEL,
        data=RLDataConfig(task="addition", num_train=16, num_eval=0),
        rollout=RolloutConfig(num_prompts=num_prompts, group_size=group, max_new_tokens=4),
        algo=algo_cls(aggregation=aggregation, num_mini_batches=num_mini, kl_coef=0.0),
        optim=OPTIM,
        train=train_config(out, micro, batch=0),
        parallel=ParallelConfig(strategy=strategy),
        logging=LoggingConfig(progress=False),
    )
    algo = cfg.algo.resolved()
    model, tokenizer = load_model(cfg.model)
    rollout = fixed_rollout(model, tokenizer, rl.build_prompts(cfg.data, tokenizer, 0), num_prompts, group)
    if spans:
        rollout = with_environment_tokens(rollout)
    extra = {"value_head": ppo.ValueHead(model.config.hidden_size)} if recipe == "ppo" else None
    state = rl.prepare(cfg, recipe, algo, model, tokenizer, console=Quiet(), extra_modules=extra)
    ctx = state.run.ctx
    full = rl.pack_rollout(rollout, tokenizer.pad_token_id, need_rollout_logprobs=False)
    rewards = torch.tensor([float(i % 3 == 0) + 0.25 * (i % 2) for i in range(num_prompts * group)])
    if skip:  # group 0: rows 2 and 3 at the group mean; groups 1-3 all the same (advantage 0)
        rewards = torch.tensor([1.0, 0.0, 0.5, 0.5] + [1.0] * 4 + [0.5] * 4 + [0.0] * 4)
    skip_rows = skip and ctx.distributed  # several ranks skip rows; one process runs the full computation
    rows = rank_rows(num_prompts, group, num_mini, ctx)
    precision, wrapped, losses = state.updater.precision, state.train.wrapped, []
    spec = rl_config.policy_spec(algo)
    plan = rl.UpdatePlan(
        algo.num_iterations, num_mini, state.micro_batch_size, cfg.rollout.max_new_tokens, first_on_policy=skip_rows
    )
    for step in range(1, STEPS + 1):
        batch = full.select(rows)
        if recipe == "grpo":
            batch = batch.with_(advantages=grpo.advantages_of(rewards[rows], algo, group)[0])

            def loss_of(micro, counts):
                logprobs, entropy = rl.policy_logprobs(state.model, micro, 1.0, precision, wrapped=wrapped)
                return grpo.micro_loss(logprobs, entropy, micro, spec, counts)
        else:
            batch, _ = ppo.add_targets(
                state.model,
                extra["value_head"],
                None,
                algo,
                batch,
                rewards[rows],
                1.0,
                state.micro_batch_size,
                precision,
                wrapped=wrapped,
                ctx=ctx,
            )

            def loss_of(micro, counts):
                logprobs, entropy, values = ppo.policy_and_values(
                    state.model, extra["value_head"], micro, 1.0, precision, wrapped=wrapped
                )
                return ppo.micro_loss(logprobs, entropy, values, micro, spec, algo, counts)

        if num_mini > 1 and recipe == "grpo":  # the weights move between updates: old logprobs fixed first
            batch = batch.with_(
                old_logprobs=rl.batch_logprobs(
                    state.model, batch, state.micro_batch_size, 1.0, precision, wrapped=state.train.wrapped
                )
            )
            if skip_rows:  # the first mini-batch's rows are not read
                batch.old_logprobs[rl.mini_batch_rows(batch.num_rows, num_mini)[0]] = float("nan")
        rows_to_train = rl.informative_rows(batch.advantages) if skip_rows else None
        losses.append(run_updates(state, batch, plan, step, loss_of, rows_to_train))
    weights = full_state_dict(state.train.wrapped)
    if recipe == "ppo":
        weights.update({f"value_head.{k}": v for k, v in full_state_dict(state.train.wrapped, "value_head").items()})
    return {"losses": losses, "weights": weights}


TEACHER = dataclasses.replace(MODEL, init_seed=1)  # another tiny model with the student's tokenizer


def distill_config(out: Path, micro: int, strategy: str, batch: int, **sections) -> distill.DistillConfig:
    teacher = distill.TeacherConfig(
        **{f.name: getattr(TEACHER, f.name) for f in dataclasses.fields(TEACHER)}, dtype="fp32"
    )
    return distill.DistillConfig(
        model=MODEL,
        teacher=teacher,
        optim=OPTIM,
        train=train_config(out, micro, batch),
        parallel=ParallelConfig(strategy=strategy),
        logging=LoggingConfig(progress=False),
        **sections,
    )


def distill_case(out: Path, micro: int, strategy: str, signal: str) -> dict:
    """On-policy distillation of the fixed rollout: the teacher's logprobs of the sampled tokens (or its
    full distributions, ``signal=full``) with half a group-normalised task reward mixed in."""
    num_prompts, group = 4, 4
    cfg = distill_config(
        out,
        micro,
        strategy,
        batch=0,
        data=distill.PromptDataConfig(task="addition", num_train=16, num_eval=0),
        rollout=RolloutConfig(num_prompts=num_prompts, group_size=group, max_new_tokens=4),
        algo=distill.DistillAlgoConfig(reward_weight=0.5, signal=signal),
    )
    algo = cfg.algo.resolved()
    model, tokenizer = load_model(cfg.model)
    teacher = load_model(TEACHER)[0].eval().requires_grad_(False)
    rollout = fixed_rollout(model, tokenizer, rl.build_prompts(cfg.data, tokenizer, 0), num_prompts, group)
    state = rl.prepare(cfg, "distill", algo, model, tokenizer, console=Quiet())
    full = rl.pack_rollout(rollout, tokenizer.pad_token_id, need_rollout_logprobs=False)
    rewards = torch.tensor([float(i % 3 == 0) + 0.25 * (i % 2) for i in range(num_prompts * group)])
    advantages = compute_advantages("group_norm", rewards, group)[0]
    rows = rank_rows(num_prompts, group, 1, state.run.ctx)
    precision, wrapped, losses = state.updater.precision, state.train.wrapped, []
    spec = rl_config.policy_spec(algo)
    plan = rl.UpdatePlan(algo.num_iterations, algo.num_mini_batches, state.micro_batch_size, cfg.rollout.max_new_tokens)
    for step in range(1, STEPS + 1):
        batch = full.select(rows).with_(advantages=advantages[rows])
        if signal == "sampled":
            batch = batch.with_(ref_logprobs=rl.batch_logprobs(teacher, batch, state.micro_batch_size, 1.0, precision))

            def loss_of(micro, counts):
                logprobs, entropy = rl.policy_logprobs(state.model, micro, 1.0, precision, wrapped=wrapped)
                return distill.micro_loss(logprobs, entropy, micro, spec, algo.reward_weight, counts)
        else:

            def loss_of(micro, counts):
                return distill.full_micro_loss(
                    state.model, teacher, micro, spec, algo.reward_weight, 1.0, counts, precision, wrapped
                )

        losses.append(run_updates(state, batch, plan, step, loss_of))
    return {"losses": losses, "weights": full_state_dict(wrapped)}


def distill_logit_case(out: Path, micro: int, strategy: str) -> dict:
    """Logit distillation (forward KL at T = 2) on SFT rows in the seeded order."""
    cfg = distill_config(
        out,
        micro,
        strategy,
        batch=8,
        mode="logit",
        fixed_data=distill.FixedDataConfig(task="addition", num_train=64, num_val=8, max_len=32),
        algo=distill.DistillAlgoConfig(temperature=2.0),
    )
    model, tokenizer = load_model(cfg.model)
    teacher = load_model(TEACHER)[0].eval().requires_grad_(False)
    run = start_run(cfg, "distill", model, seq_len=32, console=Quiet())
    data, _ = build_data(cfg.fixed_data, cfg.train.seed, cfg.model, tokenizer, lambda *_: None)
    state = build_state(run, model, tokenizer, BatchOrder(len(data.train_rows), 8, 0), STEPS)
    losses = [float(distill.logit_step(state, data, teacher, 2.0, step)["loss"]) for step in range(1, STEPS + 1)]
    return {"losses": losses, "weights": full_state_dict(state.wrapped)}


CASES = {
    "sft": lambda out, micro, strategy: sft_case(out, micro, strategy),
    # DDP with lmforge's ring all-reduce as the gradient hook (FSDP2 refuses it: the case runs under ddp only)
    "sft-ring": lambda out, micro, strategy: sft_case(out, micro, strategy, "ring" if strategy == "ddp" else "native"),
    **{
        f"grpo-{agg}": (lambda agg: lambda out, micro, strategy: rl_case(out, "grpo", agg, micro, strategy))(agg)
        for agg in ("seq_mean_token_mean", "token_mean", "global_token_mean", "seq_sum_max_len")
    },
    "grpo-minibatches": lambda out, micro, strategy: rl_case(out, "grpo", "global_token_mean", micro, strategy, 2),
    "grpo-skip-zero-advantage": lambda out, micro, strategy: rl_case(
        out, "grpo", "global_token_mean", micro, strategy, 2, skip=True
    ),
    "ppo": lambda out, micro, strategy: rl_case(out, "ppo", "seq_mean_token_mean", micro, strategy),
    # multi-turn rows: trained tokens in two spans around environment tokens (DAPO's global token mean
    # over two mini-batches; PPO's GAE over the trained tokens, advantages whitened over all ranks)
    "grpo-spans": lambda out, micro, strategy: rl_case(
        out, "grpo", "global_token_mean", micro, strategy, 2, spans=True
    ),
    "ppo-spans": lambda out, micro, strategy: rl_case(out, "ppo", "seq_mean_token_mean", micro, strategy, spans=True),
    "dpo": lambda out, micro, strategy: dpo_case(out, micro, strategy),
    "simpo": lambda out, micro, strategy: dpo_case(out, micro, strategy, "simpo"),
    "rm": rm_case,
    "distill-sampled": lambda out, micro, strategy: distill_case(out, micro, strategy, "sampled"),
    "distill-full": lambda out, micro, strategy: distill_case(out, micro, strategy, "full"),
    "distill-logit": lambda out, micro, strategy: distill_logit_case(out, micro, strategy),
}


def run_cases(root: Path, plan: list[tuple[str, int]], strategy: str) -> dict:
    """``plan``: (case, micro-batch size) pairs; returns {case@micro: result}."""
    return {
        f"{name}@{micro}": CASES[name](root / f"{name}-{micro}-{strategy}", micro, strategy) for name, micro in plan
    }


def worker(rank: int, world: int, port: int, root: str, plan: list, strategy: str, result_path: str) -> None:
    """A spawned rank: torchrun's environment, then the cases; rank 0 saves the results."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    results = run_cases(Path(root), plan, strategy)
    if rank == 0:
        torch.save(results, result_path)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
