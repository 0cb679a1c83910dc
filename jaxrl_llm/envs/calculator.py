"""`calculator`: the model asks `<calc>expression</calc>` and reads the value; a turn
without a call is its final answer, scored by a verifier.

    reset(example)  -> None: the data row's prompt (tell the model about <calc> there)
    step("<calc>12 * 59</calc>")  -> Step("708")
    step("12 * 59 = 708\n#### 708") -> Step(reward=gsm8k(answer, example), done=True)

Expressions are parsed with `ast` and evaluated node by node against a whitelist
(numbers, + - * / // % **, unary minus, parentheses), never with `eval`: anything else
(names, calls, attributes, strings) is an error shown to the model as `error: ...`.
Exponents and magnitudes are bounded so that `9**9**9` is an error, not a hang.
"""

from __future__ import annotations

import ast
import operator
import re

from jaxrl_llm import verifiers
from jaxrl_llm.envs.base import Env, Step

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_CHARS, MAX_EXPONENT, MAX_MAGNITUDE = 200, 64, 10**30


def evaluate(expression: str):
    """The value of an arithmetic expression (int or float); ValueError saying why not."""
    if len(expression) > MAX_CHARS:
        raise ValueError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None
    return _value(tree.body)


def _value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent above {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("too large") from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ValueError("too large" if not isinstance(value, complex) else "not real")
        return value
    raise ValueError(f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)")


def show(value) -> str:
    """A value as the model reads it: integers exactly, floats to 10 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.10g}"


class Calculator(Env):
    """Options: verifier (scores the final answer against the row), answer_key."""

    def __init__(self, verifier: str = "gsm8k", answer_key: str = "answer"):
        self.verifier, self.answer_key = verifier, answer_key
        self.example: dict = {}

    def reset(self, example):
        self.example = dict(example)
        return None

    def step(self, action: str) -> Step:
        calls = CALL.findall(action)
        if not calls:
            score = verifiers.get(self.verifier, answer_key=self.answer_key)(action, self.example)
            return Step(reward=float(score), done=True, info={"correct": float(score > 0.5)})
        try:
            return Step(observation=show(evaluate(calls[0])), info={"tool_calls": 1.0})
        except ValueError as err:
            return Step(observation=f"error: {err}", info={"tool_calls": 1.0, "tool_errors": 1.0})
