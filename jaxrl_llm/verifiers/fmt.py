"""The format verifier: a regex the completion must match (e.g. R1's <think>/<answer>).

DAPO's overlong penalty is not a verifier: the trainer adds it to the reward from the
sampled token counts (`rl.shaping.overlong_penalty`, `algo.overlong_penalty`).
"""

from __future__ import annotations

import functools
import re

DEFAULT_PATTERN = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"
_MODES = ("fullmatch", "search")


@functools.lru_cache(maxsize=64)
def _compile(pattern: str, flags: int) -> re.Pattern:
    return re.compile(pattern, flags)


def format_match(
    completion: str, example: dict, pattern: str = DEFAULT_PATTERN, mode: str = "fullmatch"
) -> float:
    """1.0 when the completion matches `pattern`, else 0.0.

    Args:
      completion: the model's decoded text.
      example: unused (the signature every verifier shares).
      pattern: a Python regex, compiled with DOTALL so `.` spans lines; the default asks
        for `<think>...</think><answer>...</answer>` and nothing else.
      mode: `fullmatch` (the whole completion must match) or `search` (anywhere).
    """
    del example
    if mode not in _MODES:
        raise ValueError(f"format: mode must be one of {_MODES}, got {mode!r}")
    regex = _compile(pattern, re.DOTALL)
    found = regex.fullmatch(completion) if mode == "fullmatch" else regex.search(completion)
    return float(found is not None)
