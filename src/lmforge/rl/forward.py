"""The forwards of an RL update: logprobs (and entropy) of the trained tokens through the parallel
root, with the LM head on those positions only and a prompt shared by a group run once; the
reference policy; the FLOP counts of what ran.

Everything here reads ``batch.trained_mask`` and ``batch.positions`` (``lmforge.rl.batch``): the
tokens the policy sampled, one span or several per row.
"""

from __future__ import annotations

import copy
import inspect

import torch
from transformers.cache_utils import DynamicCache

from ..model import load, lora
from ..parallel.wrap import run_forward
from ..runtime.optim import PLAIN_HEAD_MODELS, Precision, decoder_of, logits_at
from .batch import TrainBatch, scatter_completion, trained_ends

Tensor = torch.Tensor


def completion_logprobs(
    logits: Tensor, batch: TrainBatch, temperature: float, entropy_grad: bool = False
) -> tuple[Tensor, Tensor]:
    """Logits (N, V) at ``batch.positions`` -> logprobs and entropy (B, C) of softmax(logits / T) on
    the trained tokens, 0 elsewhere.

    T is the sampling temperature: the ratio and the entropy must be of the distribution the
    completions were drawn from. The entropy carries a gradient only if ``entropy_grad``.
    """
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
    mask = batch.trained_mask.bool()
    # One log_softmax over the (N, V) logits serves both the picked logprobs and the entropy: fewer
    # full-vocabulary passes than a logsumexp for one and a second log_softmax for the other.
    all_logprobs = torch.log_softmax(scaled, dim=-1)  # (N, V)
    logprobs = all_logprobs.gather(-1, batch.completion_ids[mask][:, None]).squeeze(-1)  # (N,)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(all_logprobs.exp() * all_logprobs).sum(-1)  # (N,)
    return scatter_completion(logprobs, mask), scatter_completion(entropy, mask)


def shares_prompts(model, batch: TrainBatch) -> bool:
    """Whether :func:`shared_prompt_logits` applies: a plain-head model without gradient checkpointing
    (which turns the KV cache off in training), and rows that share a prompt."""
    return (
        batch.group_index is not None
        and batch.prompt_lens is not None
        and getattr(getattr(model, "config", None), "model_type", "") in PLAIN_HEAD_MODELS
        and decoder_of(model) is not None
        and not load.activation_checkpointing(model)
        and len(torch.unique(batch.group_index)) < batch.num_rows
    )


def trained_width(trained_mask: Tensor) -> int:
    """Completion columns up to a row's last trained token, the most of any row (0 if none): the
    columns after it are environment tokens or padding that predict nothing trained and, attention
    being causal, change no logit before them."""
    return int(trained_ends(trained_mask).max()) if trained_mask.numel() else 0


def completion_extent(batch: TrainBatch) -> int:
    """The completion columns :func:`shared_prompt_logits` runs: up to the last trained one
    (:func:`trained_width`), and at least 2 where there are, so that whether the completion call runs
    depends on the batch's width only: every rank then calls the model body the same number of times
    (FSDP2 gathers each layer's weights in each call)."""
    return max(trained_width(batch.trained_mask), min(batch.completion_ids.shape[1], 2))


def shared_prompt_logits(model, batch: TrainBatch) -> Tensor:
    """Logits (N, V) that predict the trained tokens, as ``logits_at`` on the packed rows, with each
    prompt run once per group instead of once per row.

    The distinct prompts go through the model body once, left-padded with positions counting real
    tokens (as in the sampler); their KV cache is repeated for each group's rows; then each row's
    completion tokens (environment tokens included) but the last of :func:`completion_extent` run
    against it. The last prompt position and the completion positions predict the completion
    tokens. Attention is causal, so a prompt position never sees a completion and this is the packed
    forward's computation, in fewer rows; autograd sums the gradient of a shared prompt over its rows.
    The LM head runs only where the next token is trained.
    """
    body = decoder_of(model)
    _, inverse = torch.unique(batch.group_index, return_inverse=True)  # (B,) row -> its distinct prompt
    first = torch.zeros(int(inverse.max()) + 1, dtype=torch.long, device=inverse.device)
    first.scatter_(0, inverse, torch.arange(len(inverse), device=inverse.device))  # a row of each prompt
    lens = batch.prompt_lens
    width = int(lens.max())
    source = torch.arange(width, device=lens.device) - (width - lens[first, None])  # (U, P) packed column
    prompt_mask = (source >= 0).long()
    prompt_ids = batch.input_ids[first].gather(1, source.clamp(min=0)) * prompt_mask
    cache = DynamicCache()  # filled in place by the model
    cache_kwarg = {"cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values": cache}
    prompt_out = body(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=source.clamp(min=0),
        use_cache=True,
        **cache_kwarg,
    )
    hidden = prompt_out.last_hidden_state[inverse, -1:]  # (B, 1, H): predicts completion token 0
    extent = completion_extent(batch)  # C' <= C
    completion_in = batch.completion_ids[
        :, : extent - 1
    ].clone()  # (B, C' - 1); a copy: the sampler's may be inference tensors
    if completion_in.shape[1]:
        cache.batch_select_indices(inverse)  # differentiable gather: each row gets its prompt's keys / values
        steps = torch.arange(completion_in.shape[1], device=lens.device)
        mask = torch.cat([prompt_mask[inverse], torch.ones_like(completion_in)], dim=1)
        out = body(
            input_ids=completion_in,
            attention_mask=mask,
            position_ids=lens[:, None] + steps,
            use_cache=True,
            **cache_kwarg,
        )
        hidden = torch.cat([hidden, out.last_hidden_state], dim=1)  # (B, C', H)
    return model.get_output_embeddings()(hidden[batch.trained_mask[:, :extent].bool()])


def completion_logits(model, batch: TrainBatch) -> Tensor:
    """Logits (N, V) that predict ``batch``'s trained tokens: the LM head runs on those positions
    only, and a prompt shared by several rows runs once where the model allows."""
    if shares_prompts(model, batch):
        return shared_prompt_logits(model, batch)
    return logits_at(model, batch.input_ids, batch.attention_mask, batch.positions)


def policy_logprobs(
    model, batch: TrainBatch, temperature: float, precision: Precision, entropy_grad: bool = False, wrapped=None
) -> tuple[Tensor, Tensor]:
    """One forward of ``model`` on ``batch`` -> logprobs and entropy (B, C) of the trained tokens.

    ``wrapped``: the parallel root that holds ``model`` (training forwards go through it, so DDP and
    FSDP2 see them); None for a model that is not trained (the reference).
    """
    with precision.autocast():
        if wrapped is None:
            logits = completion_logits(model, batch)  # (N, V)
        else:
            logits = run_forward(wrapped, completion_logits, model, batch)
    return completion_logprobs(logits, batch, temperature, entropy_grad)


def matmul_weights(model) -> tuple[int, int]:
    """(body, head): weights of the linear layers a token goes through in the transformer body, and
    the LM head's. Norm weights and the embedding lookup do no matmul and are not counted."""
    head_weight = model.get_output_embeddings().weight
    body = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight is not head_weight
    )
    return body, head_weight.numel()


def _distinct_prompts(part: TrainBatch) -> tuple[int, int]:
    """(distinct prompts, longest of them) of rows that carry their group and prompt lengths."""
    lens = dict(zip(part.group_index.tolist(), part.prompt_lens.tolist()))
    return len(lens), max(lens.values())


def forward_flops(model, micro: TrainBatch, share_prompts: bool = True) -> float:
    """Matmul FLOPs of one forward over the micro-batch ``micro`` as the trainer runs it: its distinct
    prompts once (left-padded) and then every row's completion columns but the last of
    :func:`completion_extent` (:func:`shared_prompt_logits`), or the packed rows with their padding;
    the LM head only where the next token is trained."""
    body, head = matmul_weights(model)
    if share_prompts and shares_prompts(model, micro):
        distinct, width = _distinct_prompts(micro)
        tokens = distinct * width + micro.num_rows * max(completion_extent(micro) - 1, 0)
    else:
        tokens = micro.input_ids.numel()
    return 2.0 * (body * tokens + head * int(micro.trained_mask.sum()))


def batch_forward_flops(model, batch: TrainBatch, micro_batch_size: int, share_prompts: bool = True) -> float:
    """:func:`forward_flops` of ``batch`` run in micro-batches of ``micro_batch_size`` rows."""
    return sum(
        forward_flops(model, batch.select(rows), share_prompts)
        for rows in torch.arange(batch.num_rows).split(micro_batch_size)
    )


def sampling_flops(model, batch: TrainBatch) -> float:
    """Matmul FLOPs of sampling ``batch`` with the engine: one prefill of the distinct prompts,
    left-padded to the longest, with the LM head on their last position, then C - 1 decode forwards
    of all B rows (C: the completion width)."""
    body, head = matmul_weights(model)
    num_rows, width = batch.completion_ids.shape
    if batch.group_index is not None and batch.prompt_lens is not None:
        distinct, longest = _distinct_prompts(batch)
    else:
        distinct, longest = num_rows, int(batch.prompt_lens.max())
    return 2.0 * (body * distinct * longest + head * distinct) + 2.0 * (body + head) * num_rows * (width - 1)


def step_flops(
    model, batch: TrainBatch, micro_batch_size: int, train_passes: int, forward_passes: int, share_prompts: bool = True
) -> float:
    """Matmul FLOPs of one RL step as lmforge runs it when every row is trained (attention scores
    are left out): :func:`sampling_flops`, then ``train_passes`` forward + backward (3x a forward)
    and ``forward_passes`` forward-only passes (old logprobs, reference model, values) over the batch
    in micro-batches (:func:`forward_flops`); ``share_prompts=False`` for trainers that always run
    the packed rows (PPO). Checked against the FLOPs torch dispatches:
    tests/recipes/test_grpo.py::test_step_flops_equal_the_matmul_flops_torch_runs.
    """
    forward = batch_forward_flops(model, batch, micro_batch_size, share_prompts)
    return sampling_flops(model, batch) + forward * (3 * train_passes + forward_passes)


@torch.no_grad()
def batch_logprobs(
    model, batch: TrainBatch, micro_batch_size: int, temperature: float, precision: Precision, wrapped=None
) -> Tensor:
    """(B, C) logprobs of ``model`` on the whole batch, in micro-batches, without gradients.
    ``model`` may be a LoRA policy's reference (:class:`model.lora.DisabledAdapters`): its base model."""
    if isinstance(model, lora.DisabledAdapters):
        with lora.adapters_disabled(model.model):
            return batch_logprobs(model.model, batch, micro_batch_size, temperature, precision, wrapped)
    parts = [
        policy_logprobs(model, batch.select(rows), temperature, precision, wrapped=wrapped)[0]
        for rows in torch.arange(batch.num_rows).split(micro_batch_size)
    ]
    return torch.cat(parts)


def reference_model(model, kl_coef: float):
    """A frozen copy of the starting policy, made only when the KL term is on (it costs a model).
    A LoRA policy's reference is its base model: the policy run with its adapters off, no copy."""
    if kl_coef <= 0:
        return None
    if lora.has_adapters(model):
        return lora.DisabledAdapters(model)
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


def old_logprobs(
    model, batch: TrainBatch, need: torch.Tensor, micro_batch_size: int, temperature: float, precision, wrapped=None
) -> tuple[torch.Tensor, float]:
    """pi_old of the rows ``need`` ((B,) bool, :meth:`lmforge.rl.updates.UpdatePlan.pi_old_rows`) for an update
    phase of several updates -> ((B, C) fp32 logprobs, their forward FLOPs). Other rows hold 0, never read."""
    out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32, device=batch.completion_ids.device)
    if not need.any():
        return out, 0.0
    part = batch.select(need.nonzero()[:, 0].to(batch.input_ids.device))
    out[need.to(out.device)] = batch_logprobs(
        model, part, micro_batch_size, temperature, precision, wrapped=wrapped
    ).float()
    return out, batch_forward_flops(model, part, micro_batch_size)
