"""The worker side of an environment call: one `reset` or `step`, in a pool worker.

The host sends the environment's pickled state with each call and gets the new state
back, so workers keep nothing between calls: any worker may serve any step, and a worker
that crashes or hangs loses only that call (the trajectory ends; the host counts it).
`call` is run by `VerifierPool.call` under the pool's timeout, memory cap and
leftover-process reaping.
"""

from __future__ import annotations

import math
import numbers
import pickle
import time

from jaxrl_llm.envs import base


def call(action: str, request: dict):
    """request: {"env", "options", "op": "reset" | "step", "state", "example"} ->
    (state bytes, observation, reward, done, info, seconds). Raises on anything an
    environment returns that the trainer cannot use (the pool counts it as an error)."""
    start = time.monotonic()
    if request["op"] == "reset":
        env = base.get(request["env"], **request["options"])
        observation = env.reset(request["example"])
        _check_observation(observation, "reset")
        return pickle.dumps(env), observation, 0.0, False, {}, time.monotonic() - start
    base.resolve(request["env"])  # a file's module must be loaded before its class unpickles
    env = pickle.loads(request["state"])
    step = env.step(action)
    if not isinstance(step, base.Step):
        raise TypeError(f"step returned {type(step).__name__}, expected envs.Step")
    reward = step.reward
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise TypeError(f"Step.reward is {type(reward).__name__}, expected a number")
    if not math.isfinite(reward):
        raise ValueError(f"Step.reward is {reward}")
    info = dict(step.info or {})
    for key, value in info.items():
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise TypeError(f"Step.info[{key!r}] = {value!r}: expected a finite number")
    done = bool(step.done)
    if not done:
        _check_observation(step.observation, "step")
    state = b"" if done else pickle.dumps(env)
    info = {str(k): float(v) for k, v in info.items()}
    return state, step.observation, float(reward), done, info, time.monotonic() - start


def _check_observation(observation, where: str) -> None:
    if observation is None and where == "reset":
        return
    if isinstance(observation, str):
        return
    if isinstance(observation, list) and all(
        isinstance(m, dict) and isinstance(m.get("content"), str) for m in observation
    ):
        return
    raise TypeError(
        f"{where} returned an observation of type {type(observation).__name__}: expected "
        "text or a list of chat messages {'role': ..., 'content': str}"
    )
