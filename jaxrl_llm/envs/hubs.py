"""Environment hubs by name: `textarena/<game id>` -> TextArena's game
(`envs.textarena_games`); other names are the registry's (`base.ENVS`)."""

from __future__ import annotations

from jaxrl_llm.envs import base, textarena_games


def hub(name: str, options: dict) -> tuple[str, dict]:
    """A hub's name -> its adapter class's name and options; other names as they are.
    ValueError naming env.name for an unknown game or a missing package."""
    if name.startswith(textarena_games.PREFIX):
        game = name.removeprefix(textarena_games.PREFIX)
        textarena_games.check_game(game)
        return "jaxrl_llm.envs.textarena_games:TextArenaGame", {"game": game, **options}
    return name, dict(options)


def check_options(name: str, options) -> None:
    """`base.check_options`, hub names included."""
    base.check_options(*hub(name, dict(options)))
