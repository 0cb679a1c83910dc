"""`guess_number`: find a secret integer; the environment answers "higher" or "lower".

    reset(example) -> "Guess my number between 1 and 100. ..."
    step("50") -> Step("higher"), step("75") -> Step("lower"), ...
    step("62") -> Step(reward=decay ** (guesses - 1), done=True)

The secret is the row's `secret` field when it has one, else derived from a hash of the
row, so the G trajectories of a prompt (and a rerun) chase the same number. A turn
without a number is answered with a reminder and costs a guess.
"""

from __future__ import annotations

import hashlib
import json
import re

from jaxrl_llm.envs.base import Env, Step

_NUMBER = re.compile(r"-?\d+")


class GuessNumber(Env):
    """Options: low, high (inclusive range), decay (reward per extra guess)."""

    def __init__(self, low: int = 1, high: int = 100, decay: float = 0.9):
        if low > high or not 0 <= decay <= 1:
            raise ValueError(
                f"guess_number: need low <= high and 0 <= decay <= 1, got {low=}, {high=}, {decay=}"
            )
        self.low, self.high, self.decay = low, high, decay
        self.secret, self.guesses = low, 0

    def reset(self, example):
        if "secret" in example:
            self.secret = int(example["secret"])
        else:
            digest = hashlib.sha256(json.dumps(example, sort_keys=True, default=str).encode())
            self.secret = self.low + int(digest.hexdigest(), 16) % (self.high - self.low + 1)
        return (
            f"Guess my number between {self.low} and {self.high}. Answer with one number; "
            "I will say higher or lower."
        )

    def step(self, action: str) -> Step:
        self.guesses += 1
        numbers = _NUMBER.findall(action)
        if not numbers:
            return Step(observation="Answer with a number.", info={"invalid": 1.0})
        guess = int(numbers[-1])
        if guess == self.secret:
            reward = self.decay ** (self.guesses - 1)
            return Step(
                observation="",
                reward=reward,
                done=True,
                info={"found": 1.0, "guesses": float(self.guesses)},
            )
        return Step(observation="higher" if guess < self.secret else "lower")
