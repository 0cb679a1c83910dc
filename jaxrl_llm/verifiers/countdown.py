"""Countdown: combine the given numbers with + - * / and parentheses to reach the target.

The expression is parsed with Python's `ast` and evaluated by walking the tree with an
operator whitelist (numbers, the four binary operators, parentheses): never `eval`, so a
completion cannot run code, build huge powers, or call anything. Arithmetic is exact
(`fractions.Fraction`), so `6/4*2 == 3` holds and no float rounding can fake a hit.
"""

from __future__ import annotations

import ast
import collections
import operator
from fractions import Fraction

from jaxrl_llm.verifiers.extract import tagged

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_MAX_CHARS = 1000  # far above any real answer; bounds the parser's work on garbage


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """Exact value of a whitelisted expression tree; appends each literal to `used`."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ZeroDivisionError("division by zero")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"not allowed in a countdown expression: {ast.dump(node)[:60]}")


def parse_expression(text: str) -> tuple[Fraction, list[int]]:
    """`"(25 - 5) * 4"` -> (value, numbers used in order).

    `×` / `\\times` and `÷` / `\\div` read as `*` and `/`; an `= result` tail is dropped.
    Unary minus is rejected: it would create numbers that were not given.

    Raises:
      ValueError / SyntaxError / ZeroDivisionError: not a valid countdown expression.
    """
    expr = text.split("=")[0].replace("×", "*").replace("÷", "/").replace("\\times", "*")
    expr = expr.replace("\\div", "/").strip().strip("$").strip()
    if not expr or len(expr) > _MAX_CHARS:
        raise ValueError(f"expression is empty or longer than {_MAX_CHARS} characters")
    used: list[int] = []
    return _evaluate(ast.parse(expr, mode="eval"), used), used


def _candidate(completion: str, answer_tag: str) -> str | None:
    if answer_tag:
        return tagged(completion, answer_tag)
    lines = [line for line in completion.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


def countdown(
    completion: str,
    example: dict,
    answer_tag: str = "answer",
    use_all: bool = False,
    format_score: float = 0.0,
) -> float:
    """1.0 when the answer is an expression over `example["numbers"]` equal to
    `example["target"]`; `format_score` when it parses but misses; 0.0 otherwise.

    Args:
      completion: the model's decoded text.
      example: the row: `numbers` (list of ints) and `target` (int).
      answer_tag: the expression is read from the last `<answer_tag>...</answer_tag>`;
        empty string: from the last non-empty line.
      use_all: every given number must be used exactly once (TinyZero's rule); by default
        each may be used at most once.
      format_score: partial credit for a well-formed expression that misses the target or
        breaks the number rule (TinyZero uses 0.1).
    """
    for key in ("numbers", "target"):
        if key not in example:
            raise KeyError(f"countdown: example has no field {key!r} (fields: {sorted(example)})")
    text = _candidate(completion, answer_tag)
    if text is None:
        return 0.0
    try:
        value, used = parse_expression(text)
    except (ValueError, SyntaxError, ZeroDivisionError, RecursionError):
        return 0.0
    given = collections.Counter(int(n) for n in example["numbers"])
    counts = collections.Counter(used)
    fits = counts == given if use_all else not counts - given
    return 1.0 if fits and value == int(example["target"]) else float(format_score)
