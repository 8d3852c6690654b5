"""Held-out evaluation: exact-match accuracy on a synthetic task, accuracy / reward / pass@k of held-out
prompt rows under the configured rewards, and sampled generations."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..data.sft import encode_prompts
from .engine import SamplingParams, generate


def completion_texts(tokenizer, rollout) -> list[str]:
    """The generated text of each row of a ``RolloutBatch`` (masked tokens, no special tokens)."""
    return [
        tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
        for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)
    ]


@torch.no_grad()
def complete_ids(
    model,
    tokenizer,
    prompts: list[list[int]],
    max_new_tokens: int,
    batch_size: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    lengths: list[int] | None = None,
) -> list[str]:
    """Greedy (or sampled) completions of token-id prompts, decoded without special tokens. Each
    completion's length in tokens (stop token included) is appended to ``lengths`` when it is given."""
    was_training = model.training
    model.eval()
    params = SamplingParams(
        temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=[tokenizer.eos_token_id], seed=seed
    )
    texts = []
    for start in range(0, len(prompts), batch_size):
        out = generate(model, prompts[start : start + batch_size], params, pad_token_id=tokenizer.pad_token_id)
        texts.extend(completion_texts(tokenizer, out))
        if lengths is not None:
            lengths.extend(out.completion_lens.tolist())
    model.train(was_training)
    return texts


def complete(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    chat: bool = False,
    batch_size: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[str]:
    """Completions of text prompts (raw, or as one user turn through the chat template)."""
    ids = encode_prompts(tokenizer, prompts, chat)
    return complete_ids(model, tokenizer, ids, max_new_tokens, batch_size, temperature, seed)


def task_accuracy(model, tokenizer, task, problems, max_new_tokens: int, chat: bool = False) -> tuple[float, list[str]]:
    """Fraction of ``problems`` the model answers exactly (greedy), and the completions."""
    texts = complete(model, tokenizer, [p.prompt for p in problems], max_new_tokens, chat)
    correct = sum(task.is_correct(text, p) for text, p in zip(texts, problems))
    return correct / max(len(problems), 1), texts


def save_samples(run_dir: Path, step: int, prompts: list[str], texts: list[str], printer=print) -> None:
    """Print a few generations and append them to ``samples.jsonl``."""
    with open(Path(run_dir) / "samples.jsonl", "a") as handle:
        for prompt, text in zip(prompts, texts):
            handle.write(json.dumps({"step": step, "prompt": prompt, "completion": text}) + "\n")
            printer(f"  sample | {prompt!r} -> {text!r}")


def held_out_evaluator(
    tokenizer,
    problems: list,
    chat: bool,
    max_new_tokens: int,
    task=None,
    reward_specs: list[tuple] | None = None,
    pass_k: int = 0,
    temperature: float = 1.0,
    seed: int = 0,
    max_prompt_len: int = 0,
    reward_kwargs: dict | None = None,
    reward_timeout_s: float = 10.0,
    reward_workers: int = 0,
):
    """``evaluate(model, step) -> (metrics, prompt texts, greedy completions)`` on held-out problems.

    ``problems`` are task Problems (``task`` given: correct = ``task.is_correct``) or data rows with a
    ``prompt`` (correct = the first of the ``reward_specs`` rewards scores >= 1, i.e. full marks; the
    rewards run with failures scored 0, never stopping the run). Metrics: ``accuracy`` of the greedy
    completions; for rows also ``eval_reward``, the mean weighted sum of all the rewards; with
    ``pass_k`` > 0, ``pass_at_k``: the fraction of problems with at least one correct completion
    among ``pass_k`` sampled at ``temperature`` (seeded by ``seed`` + step). Prompts longer than
    ``max_prompt_len`` tokens keep their last ``max_prompt_len`` tokens. The rewards get each
    completion's length in tokens and ``reward_kwargs`` (e.g. ``max_new_tokens`` for ``overlong``), as
    in training, and run with the training's ``reward_timeout_s`` / ``reward_workers``. The returned
    function has a ``close()`` that stops the reward workers (call it when the run ends).
    """
    from .rewards import RewardSet

    texts_in = [p.prompt if task is not None else p["prompt"] for p in problems]
    prompt_ids = encode_prompts(tokenizer, texts_in, chat, "held-out prompt")
    if max_prompt_len:
        prompt_ids = [ids[-max_prompt_len:] for ids in prompt_ids]
    rewards = (
        None
        if task is not None
        else RewardSet(
            reward_specs or [("exact", 1.0)],
            max_failure_fraction=1.0,
            timeout_s=reward_timeout_s,
            workers=reward_workers,
        )
    )

    def score(texts: list[str], rows: list, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(correct (N,) bool, weighted reward (N,) or None)."""
        if rewards is None:
            return torch.tensor([bool(task.is_correct(t, p)) for t, p in zip(texts, rows)]), None
        out = rewards(texts, rows, completion_lens=lengths, **(reward_kwargs or {}))
        return out.per_function[:, 0] >= 1.0, out.total

    def evaluate(model, step: int) -> tuple[dict, list[str], list[str]]:
        lengths: list[int] = []
        texts = complete_ids(model, tokenizer, prompt_ids, max_new_tokens, lengths=lengths)
        correct, total = score(texts, problems, lengths)
        metrics = {"accuracy": correct.float().mean().item() if len(problems) else 0.0}
        if total is not None:
            metrics["eval_reward"] = total.mean().item()
        if pass_k > 0:
            repeated = [ids for ids in prompt_ids for _ in range(pass_k)]
            sample_lengths: list[int] = []
            samples = complete_ids(
                model,
                tokenizer,
                repeated,
                max_new_tokens,
                temperature=temperature,
                seed=seed + step,
                lengths=sample_lengths,
            )
            hits, _ = score(samples, [p for p in problems for _ in range(pass_k)], sample_lengths)
            metrics["pass_at_k"] = hits.view(len(problems), pass_k).any(dim=1).float().mean().item()
        return metrics, texts_in, texts

    evaluate.close = rewards.close if rewards is not None else (lambda: None)
    return evaluate
