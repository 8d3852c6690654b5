"""``textarena``: TextArena's single-player games (``pip install 'lmforge[textarena]'``), played unmodified.

``env.name=textarena env.args={game: GuessTheNumber-v0} data.task=seeds`` trains on the game
TextArena registers under that id (``ta.make(game)``, with its own wrappers). Each problem is a seed:
``reset`` deals the game ``env.reset(num_players=1, seed=<the problem's answer>)``, so held-out
problems are games dealt by unseen seeds. What maps to what:

- the game's first observations (its prompt, and a board where it shows one) -> one user message;
- an assistant message -> ``env.step(text)``, through the game's action wrappers (TextArena's
  ``ActionFormattingWrapper`` puts a bare move in brackets);
- the observations a step adds -> the next user message. Only the game's messages, not the echo of
  the player's own move (the conversation already holds it), and one turn's news, not the history
  again: TextArena's observation wrappers, which rebuild the whole history as one string for agents
  without memory, are bypassed (a chat holds the history; the new observations are read from the
  innermost game);
- the game over (``done``) -> the reward part ``game``: the reward TextArena gives player 0 (1 for a
  win; a game's share of completion or 0 for a loss; some games give -1 for invalid moves). A win is
  full marks, so the held-out ``accuracy`` is the win rate. How it ended is kept in
  ``state.info["outcome"]``.

Invalid moves are the game's business (TextArena answers one with a message and ends the game at the
next); ``env.max_turns`` ends games longer than the game's own turn limit.

TextArena's games draw from Python's global ``random`` (``State`` seeds it at reset), and the runner
steps episodes in parallel threads. Each game therefore gets its own stream: every call into a game
runs under one lock with ``random``'s state swapped for the game's, and the process's own state put
back after, so a game depends only on its seed and its moves, whatever the thread order (games that
draw from numpy's global generator, e.g. Sokoban, are not covered: their deals are not reproducible
from the seed in TextArena either). Two-player games need an opponent and are refused.
"""

from __future__ import annotations

import contextlib
import random
import threading
from typing import Any, Iterator

from ..core.errors import ConfigError
from .base import EpisodeState, Message, StepResult

INSTALL_HINT = "pip install 'lmforge[textarena]' (textarena==0.7.4)"
_RANDOM_LOCK = threading.Lock()  # one game at a time holds the global `random` (module doc)


def _textarena():
    try:
        import textarena
    except ImportError as exc:
        raise ConfigError(
            f"env.name=textarena needs the textarena package, which is not installed ({exc}); {INSTALL_HINT}"
        ) from exc
    return textarena


@contextlib.contextmanager
def _game_random(info: dict) -> Iterator[None]:
    """Run the block with the global ``random`` holding this game's state (``info["random_state"]``,
    absent before reset, which seeds it), then save the game's state and restore the process's."""
    with _RANDOM_LOCK:
        outer = random.getstate()
        if "random_state" in info:
            random.setstate(info["random_state"])
        try:
            yield
        finally:
            info["random_state"] = random.getstate()
            random.setstate(outer)


def game_seed(problem: Any) -> int:
    """The seed a problem deals: its answer (``data.task=seeds``), a whole number."""
    answer = problem["answer"] if isinstance(problem, dict) else getattr(problem, "answer", None)
    text = str(answer).strip()
    if not text.isdigit():
        raise ConfigError(
            f"env.name=textarena deals each game from the problem's answer as a seed; got answer "
            f"{answer!r}, not a whole number; use data.task=seeds"
        )
    return int(text)


class TextArenaGame:
    """The TextArena game registered as ``game`` (module doc). One instance serves every episode: each
    episode's game object lives in its ``state.info["game"]``."""

    tools: list[dict] = []

    def __init__(self, game: str):
        ta = _textarena()
        self.ta, self.game = ta, game
        try:  # a game that cannot be played fails here, at the start of the run
            probe = self.new_game()
            with _game_random({}):
                probe.reset(num_players=1, seed=0)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"env.args.game={game!r}: TextArena cannot start it as a single-player game "
                f"({type(exc).__name__}: {exc}); env.name=textarena plays single-player games "
                "(two-player games need an opponent; some games need data files, e.g. nltk's "
                "word lists for Wordle)"
            ) from exc

    def new_game(self):
        try:
            return self.ta.make(self.game)
        except ValueError as exc:  # "Environment X not found in registry."
            raise ConfigError(
                f"env.args.game={self.game!r} is not a TextArena game id ({exc}); the ids are the "
                "keys of textarena.envs.registration.ENV_REGISTRY, e.g. GuessTheNumber-v0, "
                "TowerOfHanoi-v0, Mastermind-v0, Minesweeper-v0"
            ) from exc

    def reset(self, problem: Any, state: EpisodeState) -> list[Message]:
        game = self.new_game()
        with _game_random(state.info):
            game.reset(num_players=1, seed=game_seed(problem))
            text = self._news(game)
        state.info["game"] = game
        return [{"role": "user", "content": text}]

    def step(self, state: EpisodeState, message: Message) -> StepResult:
        game = state.info["game"]
        with _game_random(state.info):
            done, _ = game.step(message["content"])
            text = self._news(game)
            if not done:
                return StepResult([{"role": "user", "content": text}], {}, done=False)
            rewards, game_info = game.close()
        if not rewards or 0 not in rewards:
            raise RuntimeError(f"TextArena game {self.game!r} ended without a reward for player 0 ({rewards!r})")
        state.info["outcome"] = game_info.get(0, {}).get("reason", "")
        return StepResult([], {"game": float(rewards[0])}, done=True)

    def _news(self, game) -> str:
        """The game's observations since the last call, without the echo of the player's own move."""
        while isinstance(game, self.ta.Wrapper):  # past the observation wrappers (module doc)
            game = game.env
        _, observations = game.get_observation()
        own_move = self.ta.ObservationType.PLAYER_ACTION
        return "\n".join(text for _, text, kind in observations if kind != own_move)
