"""Running episodes token-in / token-out. Two ways to batch the turns (``env.continuous``,
docs/environments.md "Rollouts"): ``run_continuous`` puts every turn in one running batch of a
``rollout.continuous.ContinuousDecoder`` and an episode's next turn joins it as soon as its
environment step returns (its KV cache kept meanwhile); ``run`` decodes every active episode in one
engine call per round and steps the round's environments in parallel. Either way environment calls
run on worker threads with a timeout, and the tokens of an episode are exactly what the policy
sampled plus the template's rendering of the environment's messages.

The token rule (docs/environments.md, "Tokens and masks"). An episode's ids are its first prompt
(``reset``'s messages rendered with the generation prompt), then, turn after turn, the ids the
policy sampled -- appended verbatim, stop token included, never decoded and encoded again -- and
the environment's tokens: the conversation with the new messages is rendered in full
(``toolcalls.render_messages``), the text the episode's tokens stand for so far (the first prompt,
each turn's decoded sample with its stop token, each earlier delta) must be a prefix of it, and
the rest of the rendering, tokenized alone, is the delta. A template that does not render the
conversation prefix by prefix (one that rewrites earlier turns, e.g. drops old ``<think>`` blocks)
fails that check: the episode then ends there, counted as ``num_template_mismatches`` (its tokens
so far are kept and trained), rather than train on ids the policy never saw. A message's text is
encoded as text (``model.safe_encode``): its special-token strings never become control tokens, only the
template's own structure does.

Limits, each counted when hit, each ending the episode cleanly: turns (``max_turns``), tokens after
the first prompt (``max_episode_tokens``: a turn that would pass it is cut to fit), invalid tool
calls (``max_invalid_calls``, counted by the environment in ``state.counts``), seconds per
environment call (``timeout_s``). A tool result longer than ``max_tool_result_tokens`` is cut to
that many tokens (counted) and the episode goes on. An environment that raises, hangs or returns
something malformed ends its episode, counted and logged; the others go on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from ..model.safe_encode import ControlTextError, Rendered, encode_rendered, encode_text, render_marked
from ..rollout import RolloutBatch, SamplingParams
from ..rollout.continuous import ContinuousDecoder
from ..rollout.timed_calls import TimedCalls
from .base import EpisodeState, MalformedReply, Message, check_messages, check_step_result
from .tool_env import INVALID_CALLS
from .toolcalls import render_messages

logger = logging.getLogger(__name__)

# How an episode ended: the environment said done, a limit was hit, or something failed.
LIMITS = ("turns", "episode_tokens", "invalid_calls")
FAILURES = {
    "env_error": "env_errors",
    "timeout": "tool_timeouts",
    "malformed": "num_malformed_replies",
    "template": "num_template_mismatches",
}
# More characters than any token stands for in practice: a tool result is cut to this many per allowed
# token before it is tokenized (the cut itself is then made in tokens).
MAX_CHARS_PER_TOKEN = 32
GenerateFn = Callable[[list[list[int]], SamplingParams, int], RolloutBatch]  # (prompts, params, num_samples)
ROUND_SEED_STRIDE = 998_244_353  # a prime far from the step (1) and rank (1_000_000_007) strides of step_seed
EPISODE_SEED_STRIDE = 2_147_483_647  # a prime far from the three strides above


def round_seed(seed: int, round_: int) -> int:
    """The sampler's seed for round ``round_`` of a batch sampled with ``seed``. Round 0 keeps ``seed``
    (a one-turn episode samples as a single-turn rollout does); later rounds step by a large prime, so
    round r of step s does not reuse the draws of round 0 of step s + r (``seed + r`` did)."""
    return seed + round_ * ROUND_SEED_STRIDE


def episode_seed(seed: int, episode: int, turn: int) -> int:
    """The continuous runner's seed for turn ``turn`` of episode ``episode`` (its index in the batch) of
    a batch sampled with ``seed``: each turn draws from its own generator, so its tokens do not depend
    on which other episodes share its decode steps, nor on when their environments answer."""
    return (seed + (episode + 1) * EPISODE_SEED_STRIDE + turn * ROUND_SEED_STRIDE) % 2**63


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """The ``env.*`` limits (rl/config.py EnvConfig); 0 means no limit for the counts and the timeout."""

    max_turns: int = 8
    max_episode_tokens: int = 512
    max_tool_result_tokens: int = 256
    timeout_s: float = 10.0
    max_invalid_calls: int = 3


@dataclasses.dataclass
class Episode:
    """One episode's conversation, tokens and outcome (``ids`` etc. are everything after the prompt)."""

    state: EpisodeState
    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    ids: list[int] = dataclasses.field(default_factory=list)
    trained: list[int] = dataclasses.field(default_factory=list)  # 1 on the policy's sampled ids
    logprobs: list[float] = dataclasses.field(default_factory=list)  # the sampler's, 0 off the trained ids
    text: str = ""  # what the ids stand for, as the template renders it (the prefix check)
    budget: int = 0  # tokens this episode may still add after its prompt
    rewards: dict[str, float] = dataclasses.field(default_factory=dict)  # the environment's parts, summed
    end: str = ""  # "" while running, "done", a limit of LIMITS or a failure of FAILURES
    num_empty: int = 0  # replies with no text
    num_cut_results: int = 0  # tool results cut to max_tool_result_tokens
    final_text: str = ""  # the last reply without special tokens (what the reward functions score)
    overlong_prompt: int = 0  # the first prompt's length when it alone filled the model's context (0: it fit)
    turn_rewards: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (index in ids of a turn's
    # last sampled token, the sum of the reward parts of the step that answered it)

    @property
    def num_trained(self) -> int:
        return sum(self.trained)


def env_calls(workers: int, timeout_s: float) -> TimedCalls:
    """The pool the runner calls the environment on (``rollout.timed_calls``): threads only, since an
    environment holds its state in this process (the episodes' ``EpisodeState``, its connections),
    each call limited to ``env.tool_timeout_s`` from when a thread takes it."""
    return TimedCalls(workers, timeout_s, "env.tool_timeout_s", name="env")


class EpisodeRunner:
    """Runs a batch of episodes of ``env`` (module doc). ``workers`` threads call the environment."""

    def __init__(self, env, tokenizer, limits: EpisodeLimits, workers: int, context: int | None = None):
        self.env, self.tokenizer, self.limits, self.context = env, tokenizer, limits, context
        self.tools = list(getattr(env, "tools", None) or [])
        self.calls = env_calls(workers, limits.timeout_s)

    def close(self) -> None:
        self.calls.close()

    # ------------------------------------------------------------------------- environment calls

    def _call_all(self, calls: list[Callable[[], Any]]) -> list[tuple[str, Any]]:
        """Run ``calls`` on the pool and wait for every one (``TimedCalls.wait_all``)."""
        for i, call in enumerate(calls):
            self.calls.submit(i, call)
        results = self.calls.wait_all()
        return [results[i] for i in range(len(calls))]

    # ------------------------------------------------------------------------- the token rule

    def render(self, messages: list[Message]) -> Rendered:
        """The conversation with the generation prompt, and where its messages' special-token strings
        landed (``model.safe_encode``: they are encoded as text, only the template's are control tokens)."""
        return render_marked(
            self.tokenizer,
            lambda msgs, tools: render_messages(self.tokenizer, msgs, tools, add_generation_prompt=True),
            messages,
            self.tools,
        )

    def encode(self, text: str) -> list[int]:
        """The ids of a message's ``text``, as plain text (``model.safe_encode.encode_text``)."""
        return encode_text(self.tokenizer, text)

    def _start(self, episode: Episode, outcome: tuple[str, Any]) -> None:
        """Fill the episode from its ``reset`` outcome: messages, prompt ids, budget; or end it."""
        status, value = outcome
        if status == "ok":
            try:
                episode.state.messages = list(check_messages(value, "reset"))
                if not episode.state.messages:
                    raise MalformedReply("reset returned no messages")
                rendered = self.render(episode.state.messages)
                episode.text, episode.prompt_ids = rendered.text, encode_rendered(self.tokenizer, rendered)
            except MalformedReply as exc:
                status, value = "malformed", str(exc)
            except ControlTextError as exc:
                status, value = "template", str(exc)
        if status != "ok":
            _log_failure(episode, status, "reset", value)
            episode.end = "env_error" if status == "error" else status
            episode.prompt_ids = [self.tokenizer.eos_token_id]  # a row with nothing to train
        budget = self.limits.max_episode_tokens
        if self.context is not None:
            budget = min(budget, self.context - len(episode.prompt_ids))
        episode.budget = budget
        if budget < 1 and not episode.end:  # the first prompt alone fills the model's context
            episode.end, episode.overlong_prompt = "episode_tokens", len(episode.prompt_ids)
            episode.prompt_ids = [self.tokenizer.eos_token_id]  # a row with nothing to train, that fits

    def _add_turn(self, episode: Episode, sampled: list[int], logprobs: list[float], stop_ids: set[int]) -> None:
        """Append the policy's sampled ids verbatim (cut to the episode's budget) and its message."""
        if len(sampled) > episode.budget:
            sampled, logprobs = sampled[: episode.budget], logprobs[: episode.budget]
            episode.end = "episode_tokens"
        episode.ids += sampled
        episode.trained += [1] * len(sampled)
        episode.logprobs += logprobs
        episode.budget -= len(sampled)
        body = sampled[:-1] if sampled and sampled[-1] in stop_ids else sampled
        # The message holds the reply as sampled, special tokens too, so that the template renders
        # exactly the sampled stream; the reward functions read it without them, as in single-turn runs.
        content = self.tokenizer.decode(body, skip_special_tokens=False)
        episode.final_text = self.tokenizer.decode(body, skip_special_tokens=True)
        episode.num_empty += not episode.final_text.strip()
        episode.text += self.tokenizer.decode(sampled, skip_special_tokens=False)
        episode.state.messages.append({"role": "assistant", "content": content})
        episode.state.turn += 1

    def _cap_results(self, episode: Episode, messages: list[Message]) -> list[Message]:
        """Tool results longer than ``max_tool_result_tokens`` cut to that many tokens (counted). Only
        their first ``MAX_CHARS_PER_TOKEN`` characters per allowed token are tokenized: megabytes of
        output took seconds to tokenize here (5 MB: 17 s), outside ``env.tool_timeout_s``."""
        cap, out = self.limits.max_tool_result_tokens, []
        for message in messages:
            if cap and message["role"] == "tool":
                head = message["content"][: cap * MAX_CHARS_PER_TOKEN]
                ids = self.encode(head)
                if len(ids) > cap or len(head) < len(message["content"]):
                    episode.num_cut_results += 1
                    message = {**message, "content": self.tokenizer.decode(ids[:cap]) + " [cut]"}
            out.append(message)
        return out

    def _answer(self, episode: Episode, outcome: tuple[str, Any]) -> None:
        """Apply the environment's answer to the last turn: rewards, limits, the delta tokens."""
        status, value = outcome
        if status == "ok":
            try:
                value = check_step_result(value)
            except MalformedReply as exc:
                status, value = "malformed", str(exc)
        if status != "ok":
            _log_failure(episode, status, "step", value)
            episode.end = "env_error" if status == "error" else status
            return
        for name, part in value.reward.items():
            episode.rewards[name] = episode.rewards.get(name, 0.0) + float(part)
        if value.reward:
            episode.turn_rewards.append((len(episode.ids) - 1, sum(map(float, value.reward.values()))))
        limits, state = self.limits, episode.state
        if value.done:
            episode.end = "done"
        elif limits.max_invalid_calls and state.counts.get(INVALID_CALLS, 0) >= limits.max_invalid_calls:
            episode.end = "invalid_calls"
        elif limits.max_turns and state.turn >= limits.max_turns:
            episode.end = "turns"
        if episode.end:
            return
        state.messages.extend(self._cap_results(episode, value.messages))
        try:
            full = self.render(state.messages)
        except ControlTextError as exc:
            _log_failure(episode, "template", "render", str(exc))
            episode.end = "template"
            return
        if not full.text.startswith(episode.text):
            _log_failure(
                episode,
                "template",
                "render",
                "the chat template's rendering of the conversation does "
                "not start with the episode's tokens so far (it rewrites earlier turns)",
            )
            episode.end = "template"
            return
        delta = encode_rendered(self.tokenizer, full.cut(len(episode.text)))
        if len(delta) >= episode.budget:  # no room left for a reply after it
            episode.end = "episode_tokens"
            return
        episode.ids += delta
        episode.trained += [0] * len(delta)
        episode.logprobs += [0.0] * len(delta)
        episode.budget -= len(delta)
        episode.text = full.text

    # ------------------------------------------------------------------------- a batch

    def run(
        self, generate: GenerateFn, problems: Sequence[Any], group_size: int, params: SamplingParams
    ) -> tuple[list[Episode], dict]:
        """``group_size`` episodes of each problem (a problem's adjacent), run to their ends.

        Round r samples every active episode in one ``generate`` call (seed :func:`round_seed`; in
        round 0 a group shares its prompt, sampled ``group_size`` times, as a single-turn rollout
        is), then steps their environments in parallel. Returns the episodes and the batch's
        timings (``time_generation``, ``time_env``).
        """
        episodes = [Episode(EpisodeState(problem)) for problem in problems for _ in range(group_size)]
        start = time.perf_counter()
        outcomes = self._call_all([_bind(self.env.reset, e.state.problem, e.state) for e in episodes])
        for episode, outcome in zip(episodes, outcomes):
            self._start(episode, outcome)
        times = {"time_generation": 0.0, "time_env": time.perf_counter() - start}
        stop_ids = set(params.stop_token_ids)
        for round_ in range(self.limits.max_turns or 1 << 30):
            active = [e for e in episodes if not e.end]
            if not active:
                break
            start = time.perf_counter()
            self._sample(generate, active, group_size if round_ == 0 else 1, params, round_, stop_ids)
            taking = [e for e in active if not e.end]
            middle = time.perf_counter()
            outcomes = self._call_all([_bind(self.env.step, e.state, e.state.messages[-1]) for e in taking])
            for episode, outcome in zip(taking, outcomes):
                self._answer(episode, outcome)
            times["time_generation"] += middle - start
            times["time_env"] += time.perf_counter() - middle
        return episodes, times

    def _sample(
        self,
        generate: GenerateFn,
        active: list[Episode],
        group_size: int,
        params: SamplingParams,
        round_: int,
        stop_ids: set[int],
    ) -> None:
        """One engine call for every active episode; a group whose prompts are one is prefilled once."""
        histories = [e.prompt_ids + e.ids for e in active]
        shared = (
            group_size > 1
            and len(active) % group_size == 0
            and all(histories[i] == histories[i - i % group_size] for i in range(len(active)))
        )
        prompts = histories[::group_size] if shared else histories
        most = max(e.budget for e in active) + 1  # one more than fits: a turn that would pass its budget is cut
        params = dataclasses.replace(
            params,
            seed=None if params.seed is None else round_seed(params.seed, round_),
            max_new_tokens=min(params.max_new_tokens, most),
        )
        rollout = generate(prompts, params, group_size if shared else 1)
        for row, episode in enumerate(active):
            n = int(rollout.completion_lens[row])
            self._add_turn(
                episode, rollout.completion_ids[row, :n].tolist(), rollout.logprobs[row, :n].tolist(), stop_ids
            )

    def run_continuous(
        self, decoder: ContinuousDecoder, problems: Sequence[Any], group_size: int, params: SamplingParams
    ) -> tuple[list[Episode], dict]:
        """The episodes of :meth:`run`, without rounds: each turn is a row of ``decoder``'s running
        batch. When a turn ends, its environment step goes to the worker pool (with the same timeout)
        while the other rows keep decoding, and the next turn joins the batch as soon as the step
        returns; the decoder keeps the episode's KV cache meanwhile, so only the new tokens are
        prefilled. Each turn samples with :func:`episode_seed`. ``time_generation`` is the time spent
        in decode steps, ``time_env`` the time the decoder sat idle waiting for an environment.
        """
        episodes = [Episode(EpisodeState(problem)) for problem in problems for _ in range(group_size)]
        times = {"time_generation": 0.0, "time_env": 0.0}
        try:
            self._play(decoder, episodes, params, times)
        except BaseException:
            self.calls.abandon()
            raise
        return episodes, times

    def _play(self, decoder: ContinuousDecoder, episodes: list[Episode], params: SamplingParams, times: dict) -> None:
        """``run_continuous``'s loop: admit the turns whose environment answered, decode one step, hand
        the finished turns to the environment, until every episode has ended."""
        stop_ids = set(params.stop_token_ids)
        for index, episode in enumerate(episodes):
            self.calls.submit((index, "reset"), _bind(self.env.reset, episode.state.problem, episode.state))
        while self.calls.num_pending or decoder.busy:
            start = time.perf_counter()
            for (index, call), outcome in self.calls.poll(wait=not decoder.busy):
                episode = episodes[index]
                (self._start if call == "reset" else self._answer)(episode, outcome)
                if episode.end:
                    decoder.release(index)
                    continue
                seed = None if params.seed is None else episode_seed(params.seed, index, episode.state.turn)
                turn_params = dataclasses.replace(
                    params, seed=seed, max_new_tokens=min(params.max_new_tokens, episode.budget + 1)
                )  # one more than fits, as in run
                decoder.admit(index, episode.prompt_ids + episode.ids, turn_params)
            middle = time.perf_counter()
            times["time_env"] += middle - start
            for row in decoder.step():
                episode = episodes[row.key]
                self._add_turn(episode, row.token_ids, row.logprobs, stop_ids)
                if episode.end:
                    decoder.release(row.key)
                else:
                    step = _bind(self.env.step, episode.state, episode.state.messages[-1])
                    self.calls.submit((row.key, "step"), step)
            times["time_generation"] += time.perf_counter() - middle


def _bind(fn: Callable, *args) -> Callable[[], Any]:
    return lambda: fn(*args)


def _log_failure(episode: Episode, status: str, call: str, text: Any) -> None:
    logger.warning(
        "environment %s failed (%s) in turn %d; the episode ends: %s", call, status, episode.state.turn, str(text)[:300]
    )


def save_episodes(run_dir: Path, step: int, episodes: list[Episode], totals: Sequence[float], printer=print) -> None:
    """Append whole episodes (every message with its role, the reward, how it ended) to ``samples.jsonl``
    and print the last message of each."""
    with open(Path(run_dir) / "samples.jsonl", "a") as handle:
        for episode, total in zip(episodes, totals):
            handle.write(
                json.dumps(
                    {
                        "step": step,
                        "messages": episode.state.messages,
                        "reward": float(total),
                        "turns": episode.state.turn,
                        "end": episode.end,
                    },
                    default=str,
                )
                + "\n"
            )
            printer(
                f"  episode | {episode.state.turn} turn(s), {episode.end}, reward {float(total):g} | "
                f"{episode.final_text!r}"
            )
