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

from jaxrl_llm.registry import Registry


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


def _has_step(obj) -> bool:
    return inspect.isclass(obj) and callable(getattr(obj, "step", None))


ENVS = Registry(
    "environment",
    builtins={
        "calculator": "jaxrl_llm.envs.calculator:Calculator",
        "guess_number": "jaxrl_llm.envs.guess_number:GuessNumber",
        "python_tool": "jaxrl_llm.envs.python_tool:PythonTool",
    },
    kind="ClassName",
    check=_has_step,
    expected="a class with a step method",
    build=lambda cls, options: cls(**options),
    options_key="env.options",
)
BUILTINS = ENVS.builtins
register = ENVS.register
canonical = ENVS.canonical
resolve = ENVS.resolve
get = ENVS.get

check_options = ENVS.check_options
