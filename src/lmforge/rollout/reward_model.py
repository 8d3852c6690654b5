"""A reward model: a causal LM's body with a scalar head, saved and loaded as transformers'
``AutoModelForSequenceClassification`` with ``num_labels=1`` (for Llama, ``LlamaForSequenceClassification``:
the body under ``model``, the head ``score``, a Linear(hidden, 1) without bias).

The reward of a sequence is the head applied to the body's last hidden state at the sequence's last
non-pad token, exactly as transformers pools (the rightmost position whose id is not
``config.pad_token_id``), so what ``lmforge rm`` trains, what ``rewards.functions=[rm:DIR]`` scores
and what ``AutoModelForSequenceClassification.from_pretrained(DIR)`` computes are one function
(:func:`sequence_rewards`). A text is tokenized as a preference pair's side is (lmforge.data.preference:
``prompt + completion + eos``, or the chat template), so the reward of an RL completion is read at
the same place as in training. The math and its tests: docs/reward-models.md.
"""

from __future__ import annotations

import copy
import functools
import json
import threading
from pathlib import Path

import torch

from ..core.config import ModelConfig
from ..core.errors import ConfigError
from ..data.preference import encode_side
from ..data.sft import collate_sft, uses_chat_format
from ..model.load import context_length, load_tokenizer_for

HEAD = "ForSequenceClassification"


def from_causal_lm(model: torch.nn.Module, tokenizer) -> torch.nn.Module:
    """The reward model that starts from ``model`` (an HF causal LM): the same body, a new scalar head.

    The head starts at zero, so every reward is 0 at step 0 and the Bradley-Terry loss is log 2 there:
    training starts from "no preference" rather than from a random ranking.
    """
    from transformers import AutoModelForSequenceClassification

    if tokenizer.pad_token_id is None:
        raise ConfigError(
            "a reward model needs a pad token (its reward is read at the last non-pad token); the tokenizer has none"
        )
    config = copy.deepcopy(model.config)
    config.num_labels, config.pad_token_id = 1, tokenizer.pad_token_id
    config.id2label, config.label2id = {0: "reward"}, {"reward": 0}
    try:
        reward_model = AutoModelForSequenceClassification.from_config(config)
    except ValueError as exc:
        raise ConfigError(
            f"transformers has no sequence-classification head for model type {config.model_type!r}: {exc}"
        ) from exc
    config.architectures = [type(reward_model).__name__]
    body = getattr(model, model.base_model_prefix)
    getattr(reward_model, reward_model.base_model_prefix).load_state_dict(body.state_dict())
    with torch.no_grad():
        reward_model.score.weight.zero_()
    return reward_model.to(next(model.parameters()).dtype)


def sequence_rewards(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) right-padded ids and mask -> (B,) rewards: the head at each row's last non-pad token
    (transformers' own pooling, inside the model's forward)."""
    # (B, 1) -> (B,); a copy, not a view: FSDP2 hooks the root's output for its backward, and warns on views
    return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0].clone()


def check_reward_model_dir(path: str | Path) -> dict:
    """The config.json of a reward-model directory; ConfigError saying why ``path`` is not one."""
    path = Path(path)
    what = (
        "a reward model is a directory written by `lmforge rm` (or any transformers "
        "AutoModelForSequenceClassification with num_labels=1): config.json, weights, tokenizer"
    )
    if not path.is_dir():
        raise ConfigError(f"reward model {str(path)!r}: no such directory; {what}")
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"reward model {str(path)!r}: no config.json; {what}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"reward model {str(path)!r}: cannot read config.json ({exc}); {what}") from None
    architectures = config.get("architectures") or []
    if not any(str(a).endswith(HEAD) for a in architectures):
        raise ConfigError(
            f"reward model {str(path)!r} is not one: its config.json names architectures "
            f"{architectures} (a causal LM?), not a *{HEAD}; {what}"
        )
    num_labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
    if num_labels != 1:
        raise ConfigError(
            f"reward model {str(path)!r} is a classifier with {num_labels} labels, not a scalar "
            f"reward (num_labels=1); {what}"
        )
    return config


def load_reward_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` of a reward-model directory (checked first: :func:`check_reward_model_dir`)."""
    from transformers import AutoModelForSequenceClassification

    check_reward_model_dir(path)
    tokenizer = load_tokenizer_for(ModelConfig(name=str(path)))
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            str(path), dtype=dtype, output_loading_info=True
        )
    except Exception as exc:
        raise ConfigError(
            f"reward model {str(path)!r}: transformers cannot load it ({type(exc).__name__}: {exc})"
        ) from exc
    missing = sorted(info.get("missing_keys") or [])
    if missing:  # transformers fills them with random values: a random head scores noise, and the run exits 0
        raise ConfigError(
            f"reward model {str(path)!r}: its weights lack {len(missing)} tensor(s) the config's "
            f"{model.config.architectures} needs ({', '.join(missing[:5])}), which would be random; "
            "its config names a scoring head its weights do not hold (a causal LM's weights under a "
            "reward model's config.json?). Point rm: at the directory `lmforge rm` wrote (its final/ "
            "or a step-N/model/), or train one with `lmforge rm CONFIG`"
        )
    if model.config.pad_token_id is None:
        raise ConfigError(
            f"reward model {str(path)!r}: config.json has no pad_token_id (the reward is read at "
            "the last non-pad token)"
        )
    return model.eval().requires_grad_(False), tokenizer


def _prompt_of(problem) -> str | list[dict]:
    prompt = problem.get("prompt") if isinstance(problem, dict) else getattr(problem, "prompt", None)
    if not isinstance(prompt, (str, list)):
        raise ValueError(
            f"the rm reward scores prompt + completion, but this problem has no 'prompt' ({type(problem).__name__})"
        )
    return prompt


class RewardModelReward:
    """``rewards.functions=[rm:DIR]``: a batched reward (lmforge.rollout.rewards.RewardSet calls it
    once per batch, ``fn(completions, problems) -> one float per completion``, under the reward
    timeout) that scores each prompt + completion with the reward model in DIR, ``batch_size`` texts
    per forward. A text longer than the model's context keeps its last tokens (where the reward is
    read). ``use_chat_template`` as in training (auto = the tokenizer's own template)."""

    batched = True

    def __init__(self, path: str):
        self.path = path
        self.model, self.tokenizer = load_reward_model(path)
        self.lock = threading.Lock()  # a call abandoned at its timeout may still be running

    def __call__(
        self, completions: list[str], problems: list, batch_size: int = 32, use_chat_template: str = "auto"
    ) -> list[float]:
        chat = uses_chat_format(self.tokenizer, use_chat_template)
        limit = context_length(self.model) or None
        sides = []
        for completion, problem in zip(completions, problems):
            side = encode_side(self.tokenizer, _prompt_of(problem), completion, chat)
            ids = side.input_ids[-limit:] if limit else side.input_ids
            sides.append(side._replace(input_ids=ids, loss_mask=[1] * len(ids)))
        rewards = []
        with self.lock, torch.no_grad():
            for k in range(0, len(sides), batch_size):
                batch = collate_sft(sides[k : k + batch_size], self.tokenizer.pad_token_id)
                rewards += sequence_rewards(self.model, batch["input_ids"], batch["attention_mask"]).float().tolist()
        return rewards

    @staticmethod
    def check_kwargs(batch_size: int = 32, use_chat_template: str = "auto") -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if use_chat_template not in ("auto", "on", "off"):
            raise ValueError(f"use_chat_template must be auto, on or off, got {use_chat_template!r}")


@functools.lru_cache(maxsize=4)
def reward_model_reward(path: str) -> RewardModelReward:
    """The ``rm:PATH`` reward, loaded once per path and process."""
    return RewardModelReward(path)
