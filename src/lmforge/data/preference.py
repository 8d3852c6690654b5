"""Preference data: rows of a prompt with a chosen and a rejected completion -> token pairs.

Row formats (JSONL, one object per line, or any table source of docs/data.md with the same columns,
mapped with ``data.columns`` where they are named otherwise; other keys are ignored):

    {"prompt": "37+48=", "chosen": "58", "rejected": "57"}                       plain text
    {"prompt": [{"role": "user", "content": "Hi"}],                              conversational
     "chosen": [{"role": "assistant", "content": "Hello!"}],
     "rejected": [{"role": "assistant", "content": "Go away."}]}
    {"chosen": [user, assistant, ...], "rejected": [user, assistant, ...]}        implicit prompt

In the conversational format ``chosen`` / ``rejected`` may also be plain strings (one assistant
message); in the implicit-prompt format the prompt is the longest common prefix of the two message
lists, and each remainder must start with an assistant message.

Each side becomes an SFT example (lmforge.data.sft), so a pair is tokenized exactly as SFT would
tokenize the prompt with that completion: the raw format ``ids(prompt) + ids(completion) + [eos]``,
or the chat template (``data.use_chat_template``: auto = the tokenizer's own template). The loss mask
is the completion only: its tokens and eos in the raw format; its assistant messages and the
end-of-turn token that closes each in the chat format, never the prompt's history.

Bad rows. A row that is not a pair (missing or mistyped keys, malformed messages) is a DataError
naming the file and line. Pairs that carry no preference are skipped and counted: ``num_identical``
(chosen = rejected, as text or, after tokenizing and truncation, as tokens) and ``num_empty`` (a
completion with no text). Over-long pairs follow SFT's truncation policy on each side: ``right``
cuts to ``max_len`` (``num_truncated``) and drops the pair if a side keeps no completion token;
``drop`` drops every pair with a side longer than ``max_len`` (``num_dropped``). No pair left is an
error.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..core.errors import DataError
from ..model.safe_encode import holds_special
from .sft import SFTExample, chat_example, collate_sft, raw_example, row_errors, uses_chat_format
from .source import read_rows

# The names a preference row is read from: what data.columns may map.
COLUMN_NAMES = ("prompt", "chosen", "rejected")
_FORMATS = (
    "each row needs 'chosen' and 'rejected' with a 'prompt' (strings, or lists of {role, content} "
    "messages), or 'chosen' and 'rejected' as whole conversations that share their prompt"
)


# ----------------------------------------------------------------------------- checking rows


def _check_messages(value: object, where: str, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: '{key}' must be a string or a non-empty list of {{role, content}} messages, got {value!r:.80}"
        )
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not all(isinstance(message.get(k), str) for k in ("role", "content")):
            raise DataError(
                f"{where}: {key}[{i}] must be an object with string 'role' and 'content', got {message!r:.80}"
            )
    return value


def _as_completion(value: object, where: str, key: str, chat: bool) -> str | list[dict]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}] if chat else value
    messages = _check_messages(value, where, key)
    if messages[0]["role"] != "assistant":
        raise DataError(
            f"{where}: '{key}' must start with an assistant message (the completion), got role {messages[0]['role']!r}"
        )
    return messages


def check_pair_row(row: object, where: str) -> dict:
    """A row as ``{"prompt": str, "chosen": str, "rejected": str}`` or, conversational,
    ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``; DataError naming
    ``where`` otherwise."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object, got {type(row).__name__}; {_FORMATS}")
    missing = [key for key in ("chosen", "rejected") if key not in row]
    if missing:
        raise DataError(
            f"{where}: row has no {' or '.join(map(repr, missing))} (its keys: "
            f"{', '.join(sorted(row)) or 'none'}); {_FORMATS}; map other column names with "
            "data.columns, e.g. {chosen: response_a, rejected: response_b}"
        )
    if "prompt" not in row:  # implicit prompt: the shared start of two conversations
        chosen = _check_messages(row["chosen"], where, "chosen")
        rejected = _check_messages(row["rejected"], where, "rejected")
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        if shared == 0:
            raise DataError(
                f"{where}: without a 'prompt', 'chosen' and 'rejected' must be conversations that "
                "start with the same messages (the prompt); these differ from the first message"
            )
        if chosen == rejected:
            return {"prompt": chosen[:-1], "chosen": chosen[-1:], "rejected": rejected[-1:]}
        return {
            "prompt": chosen[:shared],
            "chosen": _as_completion(chosen[shared:], where, "chosen", True),
            "rejected": _as_completion(rejected[shared:], where, "rejected", True),
        }
    prompt = row["prompt"]
    if isinstance(prompt, str):
        for key in ("chosen", "rejected"):
            if not isinstance(row[key], str):
                raise DataError(
                    f"{where}: with a string 'prompt', '{key}' must be a string too, got {type(row[key]).__name__}"
                )
        return {"prompt": prompt, "chosen": row["chosen"], "rejected": row["rejected"]}
    prompt = _check_messages(prompt, where, "prompt")
    return {"prompt": prompt, **{key: _as_completion(row[key], where, key, True) for key in ("chosen", "rejected")}}


def load_preference_rows(
    path: str, split: str = "train", subset: str = "", columns: dict[str, str] | None = None
) -> list[dict]:
    """The checked pairs of any source (lmforge.data.source.read_rows): JSONL, Parquet, CSV, Arrow, a
    ``save_to_disk`` directory or a cached hub id; ``columns`` maps prompt / chosen / rejected."""
    found = read_rows(str(path), split, subset, columns, what="preference data file")
    return [check_pair_row(row, where) for row, where in zip(found.rows, found.where)]


def row_texts(rows: list[dict]) -> list[str]:
    """Every text of checked rows (for lmforge.model.tokenizer.check_unknown_tokens)."""
    texts = []
    for row in rows:
        for key in COLUMN_NAMES:
            value = row[key]
            texts.extend([value] if isinstance(value, str) else [m["content"] for m in value])
    return texts


# ----------------------------------------------------------------------------- pairs from a task


def no_carry_completion(prompt: str, completion: str) -> str | None:
    """The addition task's answer with every carry dropped, in the completion's digit order
    (``"37+48="``, completion ``"58"`` -> 7+8 -> 5, 3+4 -> 7: ``"57"``); None if not an a+b prompt."""
    match = re.fullmatch(r"(\d+)\+(\d+)=", prompt)
    if not match:
        return None
    a, b = (m[::-1] for m in match.groups())  # least significant digit first
    digits = "".join(
        str((int(a[i]) if i < len(a) else 0) + (int(b[i]) if i < len(b) else 0))[-1] for i in range(max(len(a), len(b)))
    )
    total = str(int(match.group(1)) + int(match.group(2)))
    return digits if completion == total[::-1] else digits[::-1].lstrip("0") or "0"


def off_by_one_completions(completion: str) -> list[str]:
    """The completion with one digit moved up or down by one (every such variant)."""
    out = []
    for i, char in enumerate(completion):
        if char.isdigit():
            for step in (-1, 1):
                out.append(completion[:i] + str((int(char) + step) % 10) + completion[i + 1 :])
    return out


def wrong_completion(prompt: str, completion: str, rng: random.Random) -> str | None:
    """A plausible wrong answer: the answer without its carries (half the time, where that is wrong),
    else one digit off by one. None when the completion has no digit."""
    no_carry = no_carry_completion(prompt, completion)
    if no_carry is not None and no_carry != completion and rng.random() < 0.5:
        return no_carry
    variants = [v for v in off_by_one_completions(completion) if v != completion]
    return rng.choice(variants) if variants else None


def pairs_from_task(task, n: int, seed: int, split: str, model_answers: list[str] | None = None) -> list[dict]:
    """``n`` text pairs from a synthetic task's problems (lmforge.data.tasks): chosen = the target
    completion, rejected = :func:`wrong_completion` (seeded by ``seed`` and ``split``).

    ``model_answers``: a model's completion of each of the ``n`` problems (same order); where one is
    wrong (and not blank) it is the rejected answer instead: the mistakes that model actually makes.
    """
    rng = random.Random(f"pairs|{task.spec}|{seed}|{split}")
    problems = task.make_problems(n, seed, split)
    if model_answers is not None and len(model_answers) != len(problems):
        raise ValueError(f"model_answers has {len(model_answers)} completions for {len(problems)} problems")
    rows = []
    for index, problem in enumerate(problems):
        answer = model_answers[index].strip() if model_answers is not None else ""
        if answer and not task.is_correct(answer, problem):
            rows.append({"prompt": problem.prompt, "chosen": problem.completion, "rejected": answer})
            continue
        wrong = wrong_completion(problem.prompt, problem.completion, rng)
        if wrong is None:
            raise DataError(
                f"task {task.spec!r}: no wrong answer can be made for {problem.prompt!r} -> "
                f"{problem.completion!r} (pairs are made for completions with digits)"
            )
        rows.append({"prompt": problem.prompt, "chosen": problem.completion, "rejected": wrong})
    return rows


# ----------------------------------------------------------------------------- tokenizing


class PreferencePair(NamedTuple):
    chosen: SFTExample  # input_ids, loss_mask (1 on the completion)
    rejected: SFTExample


@dataclass
class PreferenceData:
    """Tokenized pairs and the counts of what was skipped or cut."""

    pairs: list[PreferencePair] = field(default_factory=list)
    num_truncated: int = 0  # a side cut to max_len, pair kept
    num_dropped: int = 0  # too long: "drop", or a side with no completion token left after "right"
    num_identical: int = 0  # chosen = rejected: no preference to learn
    num_empty: int = 0  # a completion without text
    num_special_text: int = 0  # pairs whose text held special-token strings, encoded as text

    def __len__(self) -> int:
        return len(self.pairs)

    def report(self, max_len: int, truncation: str) -> str:
        """One line of what was skipped or cut ('' when nothing was)."""
        parts = [
            f"{self.num_identical} with chosen = rejected skipped" if self.num_identical else "",
            f"{self.num_empty} with an empty completion skipped" if self.num_empty else "",
            f"{self.num_truncated} truncated to {max_len} tokens" if self.num_truncated else "",
            f"{self.num_dropped} dropped as too long (data.truncation={truncation})" if self.num_dropped else "",
            f"{self.num_special_text} with special-token strings in their text, encoded as text (docs/data.md)"
            if self.num_special_text
            else "",
        ]
        return "; ".join(p for p in parts if p)


def _is_empty(completion: str | list[dict]) -> bool:
    texts = [completion] if isinstance(completion, str) else [m["content"] for m in completion]
    return not any(text.strip() for text in texts)


def encode_side(tokenizer, prompt, completion, chat: bool) -> SFTExample:
    """One side of a pair tokenized as training sees it (loss on the completion only); the reward model
    (lmforge.rollout.reward_model) scores a completion through it too, so both read the same tokens."""
    if isinstance(prompt, list):  # conversational: the completion's assistant turns are trained
        return chat_example(tokenizer, prompt + completion, True, trained_from=len(prompt))
    if chat:
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        return chat_example(tokenizer, messages, True, trained_from=1)
    return raw_example(tokenizer, prompt, completion, True)


def _fit(example: SFTExample, max_len: int) -> SFTExample | None:
    """``example`` cut to ``max_len`` tokens; None if no trained token is left."""
    cut = SFTExample(example.input_ids[:max_len], example.loss_mask[:max_len])
    return cut if any(cut.loss_mask) else None


def tokenize_pairs(
    rows: list[dict], tokenizer, max_len: int, use_chat_template: str = "auto", truncation: str = "right"
) -> PreferenceData:
    """Checked rows (:func:`check_pair_row`) -> token pairs, with the skips of the module doc."""
    if truncation not in ("right", "drop"):
        raise ValueError(f"truncation must be 'right' or 'drop', got {truncation!r}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; every completion ends with it")
    chat = uses_chat_format(tokenizer, use_chat_template)
    data = PreferenceData()
    for number, row in enumerate(rows, start=1):
        row = check_pair_row(row, f"row {number}")
        if _is_empty(row["chosen"]) or _is_empty(row["rejected"]):
            data.num_empty += 1
            continue
        if row["chosen"] == row["rejected"]:
            data.num_identical += 1
            continue
        with row_errors(f"row {number}"):
            sides = [encode_side(tokenizer, row["prompt"], row[key], chat) for key in ("chosen", "rejected")]
        data.num_special_text += holds_special(tokenizer, [row["prompt"], row["chosen"], row["rejected"]])
        too_long = any(len(side.input_ids) > max_len for side in sides)
        if too_long:
            sides = [_fit(side, max_len) for side in sides] if truncation == "right" else [None]
            if None in sides:
                data.num_dropped += 1
                continue
        if sides[0] == sides[1]:  # equal as tokens (e.g. they differ only past max_len)
            data.num_identical += 1
            continue
        data.num_truncated += too_long
        data.pairs.append(PreferencePair(*sides))
    if not data.pairs:
        raise DataError(
            f"none of the {len(rows)} preference rows is left to train on: "
            f"{data.report(max_len, truncation) or 'no rows'}"
        )
    return data


def collate_pairs(pairs: list[PreferencePair], pad_id: int) -> dict[str, torch.Tensor]:
    """One batch of 2B rows for one forward: the B chosen sides, then the B rejected ones
    (:func:`lmforge.data.sft.collate_sft`: ``input_ids``, ``labels`` -100 off the completion,
    ``attention_mask``, each (2B, T))."""
    if not pairs:
        raise ValueError("collate_pairs: empty batch")
    return collate_sft([p.chosen for p in pairs] + [p.rejected for p in pairs], pad_id)
