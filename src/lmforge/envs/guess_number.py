"""``guess_number``: find a secret number in a range, told "higher" or "lower" after each wrong guess.

The problems are the ``guess_number`` task's: with ``data.task: guess_number:high=100`` every game
opens with the same user message, ``"guess 1-100"``; with ``guess_number:high=100,min_width=10`` each
game opens on its own range, e.g. ``"guess 23-87"``. The secret is the problem's answer. Each
assistant message is one guess, a number written alone::

    user       guess 1-100
    assistant  50
    user       lower
    assistant  25
    user       higher
    assistant  37            (the secret: the episode ends)

Rewards (parts of the last step): ``solved`` 1.0 when a guess is the secret, and then ``speed``:
``speed_bonus`` for every guess of ``max_guesses`` left unused, so of two games that both solve, the
shorter scores higher, and an episode reaches full marks (reward >= 1, the held-out ``accuracy``)
exactly when it solves. A reply that is not a whole number in the opening range is answered
``"invalid"``, counted in ``state.counts["invalid_guesses"]`` and costs its guess. After
``max_guesses`` guesses without the secret the episode ends unsolved (reward 0).

``show_range=True`` adds the numbers still possible to every answer (``"lower 1-49"``, ``"higher 26-49"``,
``"invalid 26-49"``): the game for a tiny model, which then has to read the last message, not infer the
interval from the whole history, to play validly -- and still has to aim within it to play fast.

:meth:`GuessNumber.demonstration` is the scripted player of the SFT warm-up (lmforge.envs.demos): by
default it guesses uniformly among the numbers the feedback so far leaves possible, a valid but slow
strategy (about 2 ln N guesses; halving the range takes about log2 N), which RL can then shorten.
``demo_mix`` gives each demonstrated game one of several strategies, drawn per game with the given
weights, e.g. ``{halving: 0.3, stride: 0.7}``:

- ``uniform``: a number drawn uniformly among those still possible (the default);
- ``halving``: the middle of the numbers still possible, ``(low + high) // 2`` -- at most
  ``ceil(log2(N + 1))`` guesses, 7 for 1-100;
- ``stride``: the lowest number still possible plus 9 (at most the highest): steps of ten up from 1,
  then down one at a time inside the last ten -- valid but slow (for 1-100, 10.0 guesses on average,
  19 at most).

A mix of ``halving`` and ``stride`` teaches both. Measured (docs/environments.md, "What was
measured"): with random openings (``guess_number:high=100,min_width=10``) and a ``{halving: 0.5,
stride: 0.5}`` warm-up, greedy play mostly strides; GRPO moves it towards the middle of the range and
raises held-out success while the turns to solve fall. With the one opening ``guess 1-100`` it did not:
the held-out secrets are lost at one-number ranges that only their own games reach.
"""

from __future__ import annotations

import math
import random
import re

from ..core.errors import ConfigError
from .base import EpisodeState, Message, StepResult

_OPENING = re.compile(r"guess (\d+)-(\d+)")
DEMO_STRATEGIES = ("uniform", "halving", "stride")
INVALID_GUESSES = "invalid_guesses"  # the state.counts key of replies that are not a number in range


class GuessNumber:
    """The guessing game of the module doc; ``max_guesses`` ends an unsolved game, ``speed_bonus`` is the
    reward per unused guess of a solved one, ``show_range`` adds the numbers still possible to each answer."""

    tools: list[dict] = []

    def __init__(
        self,
        max_guesses: int = 8,
        speed_bonus: float = 0.1,
        show_range: bool = False,
        demo_mix: dict[str, float] | None = None,
    ):
        if max_guesses < 1:
            raise ValueError(f"max_guesses must be >= 1, got {max_guesses}")
        if not speed_bonus >= 0:
            raise ValueError(f"speed_bonus must be >= 0, got {speed_bonus}")
        self.max_guesses = max_guesses
        self.speed_bonus = speed_bonus
        self.show_range = bool(show_range)
        if demo_mix is None:
            demo_mix = {"uniform": 1.0}
        if not isinstance(demo_mix, dict) or not demo_mix:
            raise ValueError(
                f"demo_mix must be a mapping of strategy -> weight, e.g. {{halving: 0.3, stride: 0.7}}, "
                f"got {demo_mix!r}"
            )
        mix = dict(demo_mix)
        unknown = sorted(map(str, set(mix) - set(DEMO_STRATEGIES)))
        if unknown:
            raise ValueError(f"demo_mix: unknown strategy {unknown}; the strategies are {list(DEMO_STRATEGIES)}")
        if (
            any(isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < math.inf for w in mix.values())
            or not sum(mix.values()) > 0
        ):
            raise ValueError(f"demo_mix: weights must be finite numbers >= 0 with a positive sum, got {mix}")
        self.demo_mix = mix

    def reset(self, problem, state: EpisodeState) -> list[Message]:
        prompt, answer = (
            (problem["prompt"], problem["answer"]) if isinstance(problem, dict) else (problem.prompt, problem.answer)
        )
        opening = _OPENING.fullmatch(prompt.strip())
        low, high = (int(opening.group(1)), int(opening.group(2))) if opening else (0, -1)
        if not opening or low < 1 or not str(answer).isdigit() or not low <= int(answer) <= high:
            raise ConfigError(
                f"guess_number: a problem needs the prompt 'guess L-H' (1 <= L) and a secret from L "
                f"to H as its answer, got prompt {prompt!r} and answer {answer!r}; use "
                "data.task=guess_number (lmforge.data.tasks.GuessNumber)"
            )
        state.info.update(low=low, high=high, secret=int(answer), guesses=[], low_bound=low, high_bound=high)
        return [{"role": "user", "content": prompt.strip()}]

    def step(self, state: EpisodeState, message: Message) -> StepResult:
        info = state.info
        text = message["content"].strip()
        guess = int(text) if text.isascii() and text.isdigit() else None
        info["guesses"].append(guess)
        if guess is None or not info["low"] <= guess <= info["high"]:
            state.counts[INVALID_GUESSES] = state.counts.get(INVALID_GUESSES, 0) + 1
            reply = "invalid"
        elif guess == info["secret"]:
            unused = self.max_guesses - len(info["guesses"])
            return StepResult([], {"solved": 1.0, "speed": self.speed_bonus * unused}, done=True)
        elif guess < info["secret"]:
            info["low_bound"] = max(info["low_bound"], guess + 1)
            reply = "higher"
        else:
            info["high_bound"] = min(info["high_bound"], guess - 1)
            reply = "lower"
        if len(info["guesses"]) >= self.max_guesses:
            return StepResult([], {"solved": 0.0, "speed": 0.0}, done=True)
        if self.show_range:
            reply = f"{reply} {info['low_bound']}-{info['high_bound']}"
        return StepResult([{"role": "user", "content": reply}], {}, done=False)

    def demonstration(self, state: EpisodeState, rng: random.Random) -> str:
        """The scripted player's next guess by its strategy for this game, drawn from ``demo_mix`` at the
        game's first guess (module doc)."""
        info = state.info
        if "demo_strategy" not in info:
            names = list(self.demo_mix)
            info["demo_strategy"] = (
                names[0] if len(names) == 1 else rng.choices(names, weights=[self.demo_mix[n] for n in names])[0]
            )
        low, high = info["low_bound"], info["high_bound"]
        if info["demo_strategy"] == "halving":
            return str((low + high) // 2)
        if info["demo_strategy"] == "stride":
            return str(min(low + 9, high))
        return str(rng.randint(low, high))
