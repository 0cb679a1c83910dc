"""Multi-turn environments: the model acts, the environment answers, for several turns.

    from jaxrl_llm import envs

    class Echo(envs.Env):                     # in a file, e.g. my_envs.py
        def reset(self, example):
            return example["question"]        # the prompt (text or chat messages)
        def step(self, action):               # the text of the model's turn
            return envs.Step("again?", reward=float("42" in action), done="42" in action)

    config.env.name = "my_envs.py:Echo"       # or calculator, guess_number, python_tool

Environments run in worker processes (`EnvPool`); the trainer's turn loop (`play`)
appends their observations to the sampler's KV cache. See docs/envs.md. The turn loop
(and JAX with it) is imported on first use: the workers import this package, and an
environment should not pay for JAX.
"""

from jaxrl_llm.envs.base import BUILTINS, Env, Step, get, register, resolve
from jaxrl_llm.envs.hubs import check_options
from jaxrl_llm.envs.pool import EnvPool, Trajectory, replicate
from jaxrl_llm.envs.render import Renderer
from jaxrl_llm.envs.schedule import turns_at
from jaxrl_llm.envs.tool_calls import ToolEnv, parse_tool_calls

__all__ = [
    "ToolEnv",
    "parse_tool_calls",
    "BUILTINS",
    "Env",
    "EnvPool",
    "Renderer",
    "Step",
    "Trajectory",
    "TurnSettings",
    "Turns",
    "check_options",
    "fit",
    "get",
    "play",
    "register",
    "replicate",
    "resolve",
    "turns_at",
]

_LOOP = ("TurnSettings", "Turns", "play")


def __getattr__(name):
    if name in _LOOP:
        from jaxrl_llm.envs import loop

        return getattr(loop, name)
    if name == "fit":
        from jaxrl_llm.sampling import engine

        return engine.fit
    raise AttributeError(f"module 'jaxrl_llm.envs' has no attribute {name!r}")
