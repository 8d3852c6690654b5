"""The exactness check of the agent gateway's proofs (issue 36 item 4): an episode's recorded calls, the
conversation each request carried, the samples ``merge_calls`` made of them and the trainer's logprobs on
the packed batch, checked against each other. Written independently of the gateway's own prompt
building: the reference prompt of a call is the tokenizer's chat template applied to the messages the
client sent, with each assistant turn's text replaced by the ids the server sampled for it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from agent_calculator import TOOLS, calculator  # noqa: E402, F401 - the example agent's own tool and schema

_MARK = "@@REPLY{}@@"
_MARK_RE = re.compile(r"@@REPLY(\d+)@@")


def _text(content) -> str:
    if isinstance(content, list):  # content parts
        return "".join(part.get("text", "") for part in content)
    return content or ""


def reference_prompt(tokenizer, messages: list[dict], tools: list[dict] | None, replies: list[list[int]]) -> list[int]:
    """The prompt ids a token-exact server builds for ``messages``: the chat template's text (with the
    generation prompt) encoded piece by piece, the k-th assistant message standing for ``replies[k]``
    (the ids sampled for it, its stop id left out: the template writes the end of turn)."""
    marked, k = [], 0
    for message in messages:
        if message["role"] == "assistant":
            marked.append({"role": "assistant", "content": _MARK.format(k)})
            k += 1
        else:
            marked.append({**message, "content": _text(message.get("content"))})
    if k > len(replies):
        raise AssertionError(
            f"the conversation holds {k} assistant messages but only {len(replies)} replies were sampled before it"
        )
    text = tokenizer.apply_chat_template(marked, tools=tools or None, tokenize=False, add_generation_prompt=True)
    ids, pieces = [], _MARK_RE.split(text)
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            ids += tokenizer.encode(piece, add_special_tokens=False) if piece else []
        else:
            ids += replies[int(piece)]
    return ids


def _sampled(call, stop_ids) -> list[int]:
    """A call's sampled ids without the stop id that ended it (the template writes its end of turn)."""
    ids = list(call.token_ids)
    return ids[:-1] if call.finish_reason == "stop" and ids and ids[-1] in stop_ids else ids


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_prompts(episode, requests: list[dict], tokenizer, stop_ids) -> list[str]:
    """Every answered request of the episode recorded, in order, and each call's prompt the reference
    prompt of the conversation it was sent (the earlier replies as their sampled ids, the rest as the
    template's text): the problems found."""
    calls, problems = episode.calls, []
    where = f"episode {episode.number}"
    if len(calls) != len(requests):
        problems.append(f"{where}: {len(requests)} requests answered but {len(calls)} calls recorded")
    if [c.index for c in calls] != list(range(len(calls))):
        problems.append(f"{where}: call indices {[c.index for c in calls]}")
    for k, (call, request) in enumerate(zip(calls, requests)):
        body = request["body"]
        expected = reference_prompt(
            tokenizer, body["messages"], body.get("tools"), [_sampled(c, stop_ids) for c in calls[:k]]
        )
        if call.prompt_ids != expected:
            at = _first_difference(call.prompt_ids, expected)
            problems.append(
                f"{where}, call {k}: the prompt differs from the conversation with its replies' sampled "
                f"ids at token {at} of {len(expected)}: server "
                f"{tokenizer.decode(call.prompt_ids[at - 10 : at + 10])!r} vs "
                f"{tokenizer.decode(expected[at - 10 : at + 10])!r}"
            )
    return problems


def check_samples(episode, samples) -> list[str]:
    """Each call's sampled ids and logprobs a trained span of a sample, right after its prompt as the
    server built it; every trained token some call's; one sample for the whole episode."""
    problems, used = [], [set() for _ in samples]
    where = f"episode {episode.number}"
    for call in episode.calls:
        start, end = len(call.prompt_ids), len(call.prompt_ids) + len(call.token_ids)
        found = None
        for s, sample in enumerate(samples):
            span = range(start - sample.prompt_len, end - sample.prompt_len)
            if (
                sample.ids[:start] == call.prompt_ids
                and sample.ids[start:end] == call.token_ids
                and span.start >= 0
                and all(sample.trained[i] == 1 for i in span)
                and not used[s] & set(span)
                and [sample.logprobs[i] for i in span] == list(call.logprobs)
            ):
                found = s
                used[s] |= set(span)
                break
        if found is None:
            problems.append(
                f"{where}, call {call.index}: its {len(call.token_ids)} sampled ids are not a trained span "
                "of any sample after its own prompt, with its logprobs"
            )
    for s, sample in enumerate(samples):
        extra = [i for i, t in enumerate(sample.trained) if t and i not in used[s]]
        if extra:
            problems.append(
                f"{where}, sample {s}: {len(extra)} trained tokens that no call sampled (from column {extra[0]})"
            )
    if len(samples) != 1:
        problems.append(f"{where}: {len(samples)} samples, not 1 (its calls do not extend each other)")
    return problems


def trainer_gap(model, samples_of_episodes: list[list], tokenizer, temperature: float) -> float:
    """The largest |trainer logprob - recorded logprob| over the trained tokens of the step's rows:
    ``agent_rollout`` -> ``pack_rollout`` -> ``batch_logprobs`` at ``temperature`` in fp32, the GRPO
    trainer's own path (a shared first prompt run once, as it does)."""
    import torch

    from lmforge.rl.batch import pack_rollout
    from lmforge.rl.forward import batch_logprobs
    from lmforge.rl.sources.agent_samples import agent_rollout
    from lmforge.runtime.optim import Precision

    rollout = agent_rollout(samples_of_episodes, tokenizer.pad_token_id, tokenizer.eos_token_id)
    batch = pack_rollout(rollout, tokenizer.pad_token_id, need_rollout_logprobs=True)
    trainer = batch_logprobs(model, batch, 4, temperature, Precision(torch.device("cpu"), torch.float32))
    mask = rollout.trained.bool()
    return float((trainer[mask] - rollout.logprobs[mask]).abs().max())


def check_exact(gateway, episodes, tolerance: float = 1e-5) -> dict:
    """The whole check (module doc) on a run's ``episodes``: raises AssertionError naming each problem;
    returns the figures (``max_abs_diff``, ``calls``, ``samples_per_episode``)."""
    from lmforge.rl.sources.agent import report
    from lmforge.rl.sources.agent_samples import merge_calls

    problems, samples = [], [merge_calls(e.calls) for e in episodes]
    for episode, episode_samples in zip(episodes, samples):
        requests = gateway.log.model_calls(episode.session.id)
        problems += check_prompts(episode, requests, gateway.tokenizer, gateway.stop_ids)
        problems += check_samples(episode, episode_samples)
    gap = trainer_gap(gateway.model, samples, gateway.tokenizer, gateway.TEMPERATURE)
    if not gap <= tolerance:
        problems.append(f"trainer logprobs differ from the recorded ones by up to {gap:.3g} (> {tolerance:g})")
    counts = report(episodes, samples, gateway.recorder.drain())
    assert not problems, "\n".join(problems)
    return {
        "max_abs_diff": gap,
        "calls": [len(e.calls) for e in episodes],
        "samples_per_episode": counts["samples_per_episode"],
        "counts": counts,
    }
