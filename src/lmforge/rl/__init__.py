"""The RL layer of ``lmforge grpo`` / ``lmforge ppo``, one file per stage of a step, lowest first:

    config.py    the sections (rollout, rewards, data, algo) and how algorithm keys resolve
    prompts.py   the run's prompts, each rank's share of a step's prompts, the sampler's seeds
    batch.py     the stages of a step's data: a source's ScoredRollout -> the trainer's TrainBatch
                 (packed rows with a per-token trained mask: one span or several per row)
    forward.py   logprobs of the trained tokens through the parallel root; the reference; FLOPs
    sources/     where rows come from: one RolloutSource interface (base.py), one file per source
                 (inprocess, vllm, atropos, verifiers, agent, episodes; served and sampled shared), the overlap wrapper
                 over any of them, the registry; beside them what only they call (atropos_client, episode_batch)
    updates.py   Updates: the passes / mini-batches / micro-batches a recipe's step iterates, with
                 global counts, gradient sync, one optimizer step per update
    loop.py      prepare (build the run's parts from its config) and train_rl (the runtime loop)

The recipes (``lmforge.recipes.grpo``, ``.ppo``, ``.distill``) own their step, its loop and loss and import from here.
"""

from .batch import (
    ScoredRollout,
    TrainBatch,
    pack_rollout,
    reduce_rollout_metrics,
    scatter_completion,
    trained_ends,
    trained_spans,
)
from .forward import (
    batch_forward_flops,
    batch_logprobs,
    completion_logprobs,
    forward_flops,
    old_logprobs,
    policy_logprobs,
    reference_model,
    sampling_flops,
    shared_prompt_logits,
    shares_prompts,
    step_flops,
    trained_width,
)
from .loop import RLState, make_evaluate, prepare, synced_steps, train_rl
from .prompts import PromptSet, build_prompts, rank_prompts, step_seed
from .sources import SOURCES, RolloutSource, SourceSetup, make_source
from .sources.inprocess import PolicyEngine
from .sources.sampled import SampledSource, sample_and_score
from .updates import (
    Update,
    UpdatePlan,
    Updates,
    global_counts,
    informative_rows,
    micro_batch_order,
    mini_batch_rows,
    reduce_metrics,
)

__all__ = [
    "PolicyEngine",
    "PromptSet",
    "RLState",
    "RolloutSource",
    "SOURCES",
    "SampledSource",
    "ScoredRollout",
    "SourceSetup",
    "TrainBatch",
    "Update",
    "UpdatePlan",
    "Updates",
    "batch_forward_flops",
    "batch_logprobs",
    "build_prompts",
    "completion_logprobs",
    "forward_flops",
    "global_counts",
    "informative_rows",
    "make_evaluate",
    "make_source",
    "micro_batch_order",
    "mini_batch_rows",
    "old_logprobs",
    "pack_rollout",
    "policy_logprobs",
    "prepare",
    "rank_prompts",
    "reduce_metrics",
    "reduce_rollout_metrics",
    "reference_model",
    "sample_and_score",
    "sampling_flops",
    "scatter_completion",
    "shared_prompt_logits",
    "shares_prompts",
    "step_flops",
    "step_seed",
    "synced_steps",
    "train_rl",
    "trained_ends",
    "trained_spans",
    "trained_width",
]
