"""Reward shaping and group filtering around the advantage estimators (DAPO).

- Overlong penalty (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
  System at Scale", eq. 13), counted in TOKENS: with L_max = `max_len` and buffer
  L_c = `buffer`,

      r_len(n) = 0                               n <= L_max - L_c
               = ((L_max - L_c) - n) / L_c       L_max - L_c < n <= L_max
               = -1                              n > L_max

  added to the verifiers' reward of a completion of n tokens (`algo.overlong_penalty`,
  L_c = `algo.overlong_buffer_frac` * `rollout.max_new_tokens`).
- Dynamic sampling (DAPO): a group whose G rewards are all equal has zero advantage under
  every group estimator, so it carries no gradient; `degenerate_groups` finds them, and
  the rollout replaces them with newly sampled groups (`rollout.fill_mixed_groups`).

Both accept numpy or jax arrays (the rollout applies them on the host, where the rewards
are; the group estimators use the same test on device).
"""

from __future__ import annotations

import numpy as np


def overlong_penalty(lengths, max_len: int, buffer: int):
    """DAPO's r_len of each completion: lengths [N] (tokens) -> [N] float32 in [-1, 0]."""
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong buffer={buffer}: need 0 < buffer <= max_len={max_len}")
    start = max_len - buffer
    lengths = np.asarray(lengths, np.float32) if isinstance(lengths, list) else lengths
    ramp = ((start - lengths) / buffer).clip(-1.0, 0.0)
    return (ramp * (lengths > start)).astype(np.float32)


def degenerate_groups(rewards, num_generations: int):
    """rewards [N] (or [B, G]) -> [B] bool: True where the group's G rewards are all equal."""
    groups = rewards.reshape(-1, num_generations)
    return groups.max(axis=-1) == groups.min(axis=-1)
