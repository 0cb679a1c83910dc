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

# The trainer keeps rewards in float32: a reward finite in float64 but past this is inf there.
FLOAT32_MAX = 3.4028234663852886e38


def call(action: str, request: dict):
    """request: {"env", "options", "op": "reset" | "step", "state", "example", "max_chars"}
    -> (state bytes, observation, reward, done, info, seconds, refused). Raises on anything
    an environment returns that the trainer cannot use (the pool counts it as an error).

    `max_chars` bounds the observation's length in characters (None: no bound; -1: the
    trainer does not need it, the last turn). A step's observation past it is not sent
    back: observation None and `refused` its length, so a 50 MB text never reaches the
    trainer. A reset's is an error (the prompt cannot fit data.max_prompt_len)."""
    start = time.monotonic()
    bound = request.get("max_chars")
    if request["op"] == "reset":
        env = base.get(request["env"], **request["options"])
        observation = env.reset(request["example"])
        _check_observation(observation, "reset")
        size = _chars(observation)
        if bound is not None and size > bound:
            raise ValueError(
                f"reset returned a prompt of {size:,} characters, more than any prompt of "
                f"data.max_prompt_len tokens can have with this tokenizer ({bound:,})"
            )
        return pickle.dumps(env), observation, 0.0, False, {}, time.monotonic() - start, 0
    base.resolve(request["env"])  # a file's module must be loaded before its class unpickles
    env = pickle.loads(request["state"])
    step = env.step(action)
    if not isinstance(step, base.Step):
        raise TypeError(f"step returned {type(step).__name__}, expected envs.Step")
    reward = step.reward
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise TypeError(f"Step.reward is {type(reward).__name__}, expected a number")
    if not math.isfinite(reward) or abs(reward) > FLOAT32_MAX:
        raise ValueError(
            f"Step.reward is {reward:g}, not a finite float32 (the trainer's reward type); "
            "return a reward within +-3.4e38"
        )
    info = dict(step.info or {})
    for key, value in info.items():
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise TypeError(f"Step.info[{key!r}] = {value!r}: expected a finite number")
    done, observation, refused = bool(step.done), step.observation, 0
    if not done:
        _check_observation(observation, "step")
        size = _chars(observation)
        if bound == -1:
            observation = None
        elif bound is not None and size > bound:
            observation, refused = None, max(size, 1)
    state = b"" if done else pickle.dumps(env)
    info = {str(k): float(v) for k, v in info.items()}
    return state, observation, float(reward), done, info, time.monotonic() - start, refused


def _chars(observation) -> int:
    """Characters of an observation: its text, or its messages' roles and contents."""
    if isinstance(observation, list):
        return sum(len(str(m.get("role", ""))) + len(m["content"]) for m in observation)
    return len(observation or "")


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
