"""The environment interface and the registry of environments by name.

An environment is a class with two methods; one instance plays one trajectory:

    class Echo(envs.Env):
        def reset(self, example):            # -> the first observation (the prompt)
            return example["question"]
        def step(self, action):              # action: the text of the model's turn
            return envs.Step("ok", reward=1.0, done=True, info={"chars": len(action)})

`reset` returns text (the user turn, rendered like a data prompt), a list of chat
messages, or None (the data row's own prompt). `step` returns a `Step`: the observation
(text, appended as the next turn; ignored when done), the reward of this turn, whether the
trajectory is over, and `info`: numbers logged as `env/<name>/<key>` means.

Instances run in worker processes and are pickled between calls (any worker may serve
any step), so an environment keeps its state in plain attributes. A name is a built-in
(`calculator`, `guess_number`, `python_tool`), a name given to `register`, or
`path/to/file.py:ClassName` / `package.module:ClassName`.
"""

from __future__ import annotations

import dataclasses
import inspect
import os

from jaxrl_llm.verifiers.registry import check_keywords, load_reference

BUILTINS = {
    "calculator": "jaxrl_llm.envs.calculator:Calculator",
    "guess_number": "jaxrl_llm.envs.guess_number:GuessNumber",
    "python_tool": "jaxrl_llm.envs.python_tool:PythonTool",
}
_REGISTERED: dict[str, str] = {}


@dataclasses.dataclass
class Step:
    """What an environment answers to one action.

    Attributes:
      observation: the next turn's text (or a list of chat messages); unused when done.
      reward: this turn's reward (the trajectory's reward is the final one plus, with
        `env.turn_reward_discount` > 0, the discounted earlier ones).
      done: the trajectory is over.
      info: numbers to log, as `env/<env name>/<key>` (means over the step's trajectories).
    """

    observation: object = ""
    reward: float = 0.0
    done: bool = False
    info: dict = dataclasses.field(default_factory=dict)


class Env:
    """Base class (optional: any class with `reset` and `step` will do). Keyword options
    from `env.options` go to `__init__`."""

    def reset(self, example: dict):
        """The first observation of a trajectory for this data row (None: its prompt)."""
        return None

    def step(self, action: str) -> Step:
        """The environment's answer to one action; every environment defines it."""
        raise NotImplementedError(f"{type(self).__name__} does not define step(action)")


def register(name: str):
    """Class decorator: make an environment class of an importable module available as
    `name` (its module must import in the pool's workers: not `__main__` or a notebook
    cell; for a one-off file use `path/to/file.py:ClassName`)."""

    def wrap(cls):
        if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
            raise ValueError(
                f"register({name!r}): {cls.__qualname__} must be a top-level class of an "
                "importable module, or be named as 'path/to/file.py:ClassName'"
            )
        _REGISTERED[name] = f"{cls.__module__}:{cls.__qualname__}"
        return cls

    return wrap


def canonical(name: str) -> str:
    """`name` with a relative `file.py:Class` path made absolute (workers may start in
    another directory), a built-in or registered name as its `module:Class`."""
    name = BUILTINS.get(name) or _REGISTERED.get(name) or name
    target, sep, attr = name.rpartition(":")
    if sep and (target.endswith(".py") or "/" in target):
        return f"{os.path.abspath(target)}:{attr}"
    return name


def resolve(name: str) -> type:
    """The class behind an environment name; ValueError naming it when there is none."""
    known = sorted(BUILTINS) + sorted(_REGISTERED)
    try:
        cls, _, attr = load_reference(canonical(name), f"environment {name!r}", known, "ClassName")
    except (ImportError, FileNotFoundError) as err:
        raise ValueError(f"environment {name!r}: {err}") from None
    if not inspect.isclass(cls) or not callable(getattr(cls, "step", None)):
        raise ValueError(f"environment {name!r}: {attr!r} is not a class with a step method")
    return cls


def get(name: str, **options):
    """A new instance of environment `name` with `options` (its __init__ keywords);
    ValueError naming an option it does not take."""
    cls = resolve(name)
    check_options(name, options)
    return cls(**options)


def check_options(name: str, options: dict) -> None:
    """Raises ValueError naming the environment when `options` do not fit its class: an
    option its `__init__` does not take, or one it needs (no default) that is missing."""
    params = list(inspect.signature(resolve(name)).parameters.values())
    check_keywords(f"environment {name!r}", params, options)
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    missing = [p.name for p in params
               if p.kind in named and p.default is p.empty and p.name not in options]  # fmt: skip
    if missing:
        raise ValueError(
            f"environment {name!r} needs option(s) {', '.join(map(repr, missing))}; set them "
            f"in env.options, e.g. env.options={{{missing[0]!r}: ...}}"
        )
