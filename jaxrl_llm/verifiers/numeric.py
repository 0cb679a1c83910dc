"""Numeric final answers (GSM8K, the synthetic `arithmetic` task): extraction and exact compare.

Where the answer is looked for, in order of priority:

1. after `####` (the GSM8K convention);
2. inside `\\boxed{}`;
3. otherwise the last number in the completion.

When the chosen form appears several times with DIFFERENT values (`\\boxed{3} ... \\boxed{4}`)
the completion scores 0: a model must not earn reward by hedging over several answers.
Numbers are compared exactly as fractions (`0.5 == 1/2`, `1,000 == 1000.0`), so no float
tolerance can turn a wrong answer into a right one.
"""

from __future__ import annotations

import re
from fractions import Fraction

from jaxrl_llm.verifiers.extract import boxed_contents, hash_answers

# A sign only where it cannot be a binary minus: `10-4` ends in 4, not -4.
_NUMBER = re.compile(
    r"(?P<sign>(?<![\w)\].])[-−])?\s?\\?\$?\s?"
    r"(?P<num>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:/(?P<den>\d+)(?![\d/]|\.\d))?"
)
_FRACTION = re.compile(r"^(-?)\\[dt]?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$|^(-?[\d.]+)/(-?[\d.]+)$")
_LATEX_NOISE = re.compile(r"\\[,!;: ]|\\left|\\right|\{,\}|\\%|%|\\\$|\$|\\text\{[^}]*\}|\\mathrm")


def numbers(text: str) -> list[Fraction]:
    """Every number in `text`, in order, as exact fractions.

    Thousands separators are accepted only in valid groups (`1,000` is one number, `1,2`
    is two), a trailing sentence dot is not part of the number (`5.` is 5), `3/4` is one
    value, and `-` or the Unicode minus `−` is a sign only at the start of a term.
    """
    found = []
    for match in _NUMBER.finditer(text):
        value = Fraction(match.group("num").replace(",", ""))
        if match.group("den") and int(match.group("den")):
            value /= int(match.group("den"))
        found.append(-value if match.group("sign") else value)
    return found


def parse_answer(text: str) -> Fraction | None:
    """One answer segment (`18`, `$1,000.`, `\\frac{3}{4}`, `18 dollars`) -> its value.

    A whole-segment fraction is read as one value (`3/4` is 0.75, not 3); otherwise the
    first number in the segment counts, so units after the number are ignored.
    """
    cleaned = _LATEX_NOISE.sub("", text).replace("−", "-").replace(" ", "").rstrip(".")
    fraction = _FRACTION.match(cleaned.replace(",", ""))
    if fraction:
        groups = fraction.groups()
        sign, num, den = (groups[0], groups[1], groups[2]) if groups[1] else ("", *groups[3:])
        try:
            value = Fraction(num) / Fraction(den)
        except (ValueError, ZeroDivisionError):
            return None
        return -value if sign else value
    found = numbers(text.replace("{,}", ","))
    return found[0] if found else None


def final_answer(completion: str) -> Fraction | None:
    """The completion's final numeric answer by the priority rules above; None if absent
    or ambiguous (several different values in the winning form)."""
    for candidates in (hash_answers(completion), boxed_contents(completion)):
        if candidates:
            values = {parse_answer(candidate) for candidate in candidates}
            return values.pop() if len(values) == 1 else None
    found = numbers(completion)
    return found[-1] if found else None


def reference_answer(answer) -> Fraction:
    """The dataset's reference (`"... #### 72"`, `"72"`, `72`) as a fraction.

    Raises:
      ValueError: the reference is not a number; a data problem, so it must surface as a
        verifier error rather than silently score 0.
    """
    if isinstance(answer, bool):
        raise ValueError(f"reference answer {answer!r} is a bool, not a number")
    if isinstance(answer, int):
        return Fraction(answer)
    if isinstance(answer, float):
        return Fraction(repr(answer))  # 0.1 means the decimal 0.1, not its binary float
    text = str(answer)
    segments = hash_answers(text)
    value = parse_answer(segments[-1] if segments else text)
    if value is None:
        raise ValueError(f"reference answer {text[-80:]!r} has no number")
    return value


def gsm8k(completion: str, example: dict, answer_key: str = "answer") -> float:
    """1.0 when the completion's final number equals the reference `example[answer_key]`.

    Args:
      completion: the model's decoded text.
      example: the dataset row; `example[answer_key]` is the reference (GSM8K's full
        solution ending in `#### 72`, a bare `"72"`, or a number).
      answer_key: which field holds the reference.
    """
    if answer_key not in example:
        raise KeyError(f"gsm8k: example has no field {answer_key!r} (fields: {sorted(example)})")
    predicted = final_answer(completion)
    return float(predicted is not None and predicted == reference_answer(example[answer_key]))
