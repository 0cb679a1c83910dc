"""TextArena's single-player games as environments: `env.name=textarena/<game id>`.

    config.env.name = "textarena/GuessTheNumber-v0"     # pip install textarena==0.7.4

Each trajectory is one game: `reset` makes the game (`textarena.make`, its base
environment without the LLM wrappers, so it pickles between calls like any
environment), starts it for one player with a seed from the data row (its `seed` field,
else a hash of the row: the G trajectories of a prompt play the same game), and returns
the game's opening messages as the prompt. `step` plays the model's turn as the move;
the observation is the game's new messages (not the echo of the move). When the game
ends the reward is TextArena's reward for the player (1 for a win; a loss or an invalid
game scores as TextArena says, 0 or -1), and `info` counts `turns` and `invalid` (moves the
game rejected).
"""

from __future__ import annotations

import hashlib
import json

from jaxrl_llm.envs.base import Env, Step

PREFIX = "textarena/"
INSTALL = "pip install textarena==0.7.4"


def _textarena():
    try:
        import textarena
    except ImportError:
        raise ValueError(f"env.name='textarena/...' needs textarena: {INSTALL}") from None
    return textarena


def check_game(game: str) -> None:
    """ValueError naming env.name when the game id is unknown, the package missing, or
    the game cannot be made here (its code or data does not load in this Python: every
    reset would fail)."""
    ta = _textarena()
    known = sorted(ta.envs.registration.ENV_REGISTRY)
    if game not in known:
        import difflib

        close = difflib.get_close_matches(game, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f" ({len(known)} games)"
        raise ValueError(f"env.name='textarena/{game}': no TextArena game {game!r}{hint}")
    try:
        ta.make(game)
    except Exception as err:  # noqa: BLE001  (a game's module or data that does not load)
        reason = " ".join(f"{type(err).__name__}: {err}".split())[:300]
        raise ValueError(
            f"env.name='textarena/{game}': TextArena cannot make this game "
            f"here ({reason}); choose another game"
        ) from None


def _text(messages) -> str:
    """The game's messages (not the player's own moves) as one text."""
    ta = _textarena()
    move = ta.core.ObservationType.PLAYER_ACTION
    parts = [m[1] for m in messages if not (len(m) > 2 and m[2] == move)]
    return "\n".join(p.strip() for p in parts if p and p.strip())


class TextArenaGame(Env):
    """One single-player TextArena game per trajectory (see the module docstring)."""

    def __init__(self, game: str):
        self.game, self.env = game, None

    def reset(self, example):
        ta = _textarena()
        env = ta.make(self.game)
        while isinstance(env, ta.core.Wrapper):  # the base game: it pickles
            env = env.env
        seed = example.get("seed")
        if seed is None:
            digest = hashlib.sha256(json.dumps(example, sort_keys=True, default=str).encode())
            seed = int.from_bytes(digest.digest()[:4], "little")
        env.reset(num_players=1, seed=int(seed))
        self.env = env
        _, messages = env.get_observation()
        return _text(messages)

    def step(self, action):
        done, info = self.env.step(action)
        counts = {"turns": 1.0, "invalid": float(bool(info and info.get("invalid_move")))}
        if done:
            rewards, _ = self.env.close()
            return Step(reward=float((rewards or {}).get(0, 0.0)), done=True, info=counts)
        _, messages = self.env.get_observation()
        return Step(_text(messages), info=counts)
