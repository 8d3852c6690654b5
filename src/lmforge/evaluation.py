"""Held-out evaluation: exact-match accuracy on a synthetic task and sampled generations."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .data.sft import encode_prompt
from .rollout.engine import SamplingParams, generate


def completion_texts(tokenizer, rollout) -> list[str]:
    """The generated text of each row of a ``RolloutBatch`` (masked tokens, no special tokens)."""
    return [tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
            for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]


@torch.no_grad()
def complete_ids(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 64,
                 temperature: float = 0.0, seed: int = 0) -> list[str]:
    """Greedy (or sampled) completions of token-id prompts, decoded without special tokens."""
    was_training = model.training
    model.eval()
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                            stop_token_ids=[tokenizer.eos_token_id], seed=seed)
    texts = []
    for start in range(0, len(prompts), batch_size):
        out = generate(model, prompts[start:start + batch_size], params, pad_token_id=tokenizer.pad_token_id)
        texts.extend(completion_texts(tokenizer, out))
    model.train(was_training)
    return texts


def complete(model, tokenizer, prompts: list[str], max_new_tokens: int, chat: bool = False,
             batch_size: int = 64, temperature: float = 0.0, seed: int = 0) -> list[str]:
    """Completions of text prompts (raw, or as one user turn through the chat template)."""
    ids = [encode_prompt(tokenizer, p, chat) for p in prompts]
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
