"""Environments the environment tests name as `tests/envs_for_tests.py:Class`."""

import os
import time

from jaxrl_llm import envs


class Scripted(envs.Env):
    """Fixed observations, whatever the action: turn k answers OBSERVATIONS[k]; done (reward
    1) after `turns` actions (the row's `turns` field, if it has one). The exactness
    tests' environment."""

    OBSERVATIONS = ["12", "3+4=", "56", "7", "89"]

    def __init__(self, turns: int = 3):
        self.turns, self.k = turns, 0

    def reset(self, example):
        self.turns = example.get("turns", self.turns)
        return example.get("question")

    def step(self, action):
        self.k += 1
        if self.k >= self.turns:
            return envs.Step(reward=1.0, done=True, info={"chars": float(len(action))})
        return envs.Step(self.OBSERVATIONS[self.k - 1], reward=0.5, info={"chars": len(action)})


class Hostile(envs.Env):
    """Misbehaves on the step the row's `mode` names; fine otherwise (reward 1 at once)."""

    def reset(self, example):
        self.mode = example["mode"]
        if self.mode == "reset_raises":
            raise RuntimeError("reset failed")
        return None

    def step(self, action):
        mode = self.mode
        if mode == "raises":
            raise ValueError("boom")
        if mode == "hangs":
            time.sleep(60)
        if mode == "spins":
            while True:
                pass
        if mode == "crashes":
            os._exit(3)
        if mode == "bad_reward":
            return envs.Step(reward="1.0", done=True)
        if mode == "bad_info":
            return envs.Step(reward=1.0, done=True, info={"x": "text"})
        if mode == "not_a_step":
            return 1.0
        if mode == "slow":  # passes the trajectory's limit over two steps, not a step's
            time.sleep(0.6)
            return envs.Step("again", reward=1.0)
        return envs.Step(reward=1.0, done=True)


class OddLength(envs.Env):
    """One action; reward 1 when its text has an odd length (the evaluation test's check)."""

    def reset(self, example):
        return None

    def step(self, action):
        return envs.Step(reward=float(len(action) % 2), done=True)


class Sleepy(envs.Env):
    """Scripted's turns after a `delay_s` sleep per step, with observations of
    `obs_chars[k]` characters at turn k (the row's `turns` and `obs_chars` fields, if it has
    them): the paged multi-turn tests' and benchmark's environment. `mark`: a file each
    step creates first (a test waits for it: a turn has ended)."""

    def __init__(self, turns: int = 3, delay_s: float = 0.2, obs_chars=(2, 9, 4, 14, 6), mark=None):
        self.turns, self.delay_s, self.obs_chars, self.k = turns, delay_s, obs_chars, 0
        self.mark = mark

    def reset(self, example):
        self.turns = example.get("turns", self.turns)
        self.obs_chars = example.get("obs_chars", self.obs_chars)
        return example.get("question")

    def step(self, action):
        if self.mark:
            open(self.mark, "a").close()
        time.sleep(self.delay_s)
        self.k += 1
        if self.k >= self.turns:
            return envs.Step(reward=1.0, done=True)
        width = self.obs_chars[(self.k - 1) % len(self.obs_chars)]
        return envs.Step("".join(str((self.k + j) % 10) for j in range(width)), reward=0.5)


class Meet(envs.Env):
    """A step leaves its mark in the row's `dir` and waits (up to 20 s) for the mark of
    the row named `other`: it answers "met" when the other's step ran at the same time,
    else "alone". The env pool's lanes test's environment."""

    def reset(self, example):
        self.dir, self.me, self.other = example["dir"], example["me"], example["other"]
        return "go"

    def step(self, action):
        open(os.path.join(self.dir, self.me), "w").close()
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline:
            if os.path.exists(os.path.join(self.dir, self.other)):
                return envs.Step("met")
            time.sleep(0.01)
        return envs.Step("alone")
