"""Shape rewards: a regex format check and DAPO's soft overlong penalty.

Overlong penalty (DAPO, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
eq. 13), counted in TOKENS: with L_max = `max_len` and buffer L_c = `buffer`,

    r_len(n) = 0                               n <= L_max - L_c
             = ((L_max - L_c) - n) / L_c       L_max - L_c < n <= L_max
             = -1                              n > L_max

Characters are not tokens (a token is ~4 characters of English and ~1 of Chinese), so the
count comes from the sampler: the trainer passes each completion's token count as
`example["num_tokens"]`. Without it the verifier tokenizes with `tokenizer` (a local path or
hub name, loaded once per worker process).
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


def overlong_penalty(num_tokens: int, max_len: int, buffer: int) -> float:
    """DAPO's r_len(n) above, for one completion of `num_tokens` tokens."""
    if buffer <= 0 or buffer > max_len:
        raise ValueError(f"overlong: need 0 < buffer <= max_len, got {buffer=} {max_len=}")
    if num_tokens <= max_len - buffer:
        return 0.0
    if num_tokens <= max_len:
        return ((max_len - buffer) - num_tokens) / buffer
    return -1.0


@functools.lru_cache(maxsize=4)
def _load_tokenizer(name: str):
    from transformers import AutoTokenizer  # heavy: only when a tokenizer is really needed

    return AutoTokenizer.from_pretrained(name)


def overlong(
    completion: str,
    example: dict,
    max_len: int,
    buffer: int,
    length_key: str = "num_tokens",
    tokenizer: str = "",
) -> float:
    """DAPO soft overlong penalty in [-1, 0] for a completion.

    Args:
      completion: the model's decoded text; tokenized only when `example` lacks the count.
      example: the row; `example[length_key]` is the completion's length in tokens.
      max_len: L_max, the completion length (tokens) above which the penalty is -1.
      buffer: L_c, the width of the linear ramp below `max_len`.
      length_key: which field holds the token count.
      tokenizer: local path or hub name used only when the count is absent.
    """
    if length_key in example:
        num_tokens = int(example[length_key])
    elif tokenizer:
        num_tokens = len(_load_tokenizer(tokenizer)(completion, add_special_tokens=False).input_ids)
    else:
        raise KeyError(
            f"overlong: example has no {length_key!r} (the completion's token count, passed by "
            "the trainer as num_tokens=) and no `tokenizer` option to count tokens with"
        )
    return overlong_penalty(num_tokens, max_len, buffer)
