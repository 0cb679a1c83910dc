"""LaTeX answer equivalence (MATH, AIME, ...) through the `math-verify` package.

math-verify parses both answers to sympy and compares them symbolically and numerically, so
`\\frac{1}{2}`, `0.5` and `\\frac{2}{4}` agree and `x^2+1` equals `1+x^2`. The completion's
answer is taken from `\\boxed{}` first; several different boxed answers parse as a set and
do not equal a single reference, so hedging scores 0.

math-verify enforces its own time limits with `signal.alarm`, which works only in a
process's main thread; off the main thread they are switched off and the pool's timeout is
the only guard.
"""

from __future__ import annotations

import threading

from jaxrl_llm.verifiers.extract import boxed_contents


def _timeout() -> int | None:
    return 5 if threading.current_thread() is threading.main_thread() else None


def _parse_reference(answer: str):
    from math_verify import parse  # sympy import: ~0.3 s, paid once per worker

    text = str(answer).strip()
    # A bare reference (`\frac{1}{2}`) needs math delimiters for the LaTeX extractor.
    if "\\boxed" not in text and "$" not in text:
        text = f"${text}$"
    return parse(text, parsing_timeout=_timeout())


def math_answer(
    completion: str, example: dict, answer_key: str = "answer", require_boxed: bool = False
) -> float:
    """1.0 when the completion's final answer is mathematically equal to the reference.

    Args:
      completion: the model's decoded text.
      example: the row; `example[answer_key]` is the reference answer in LaTeX or plain
        text (`\\frac{1}{2}`, `$x^2$`, or a full solution ending in `\\boxed{...}`).
      answer_key: which field holds the reference.
      require_boxed: score 0 unless the completion has a `\\boxed{}` answer (otherwise the
        last math expression in the text is used).
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    if answer_key not in example:
        raise KeyError(f"math: example has no field {answer_key!r} (fields: {sorted(example)})")
    gold = _parse_reference(example[answer_key])
    if not gold:
        raise ValueError(f"math: cannot parse reference answer {str(example[answer_key])!r}")
    if require_boxed and not boxed_contents(completion):
        return 0.0
    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    predicted = parse(completion, extraction_config=config, parsing_timeout=_timeout())
    if not predicted:
        return 0.0
    return float(verify(gold, predicted, timeout_seconds=_timeout()))
