"""`python_tests`: run the completion's code against the row's assert-style tests, sandboxed.

The code is the last fenced ```python block of the completion (the whole text when there
is none). Tests come from the row in either common shape:

- MBPP: `tests` is a list of snippets (`"assert f(2) == 4"`), `test_setup` optional code;
- HumanEval: `tests` is one string defining `check(candidate)` and `entry_point` names the
  function; `check(<entry_point>)` is then run as the single test.

Reward: 1.0 when every test passes (or the fraction passed with `partial=True`), 0.0 when
any fails, the code crashes, or a limit is hit. A run past the sandbox's wall-clock limit
raises `VerifierTimeout`, which the pool scores 0 and counts in `verifier/timeouts`. A run
that ends early (`os._exit(0)`, `sys.exit(0)` before the tests) never counts as passing.
"""

from __future__ import annotations

from jaxrl_llm.verifiers.extract import code_block
from jaxrl_llm.verifiers.registry import VerifierTimeout
from jaxrl_llm.verifiers.sandbox import Limits, run_python


def row_tests(example: dict, tests_key: str = "tests", setup_key: str = "test_setup"):
    """(tests, setup) from a row, in the MBPP or HumanEval shape described above.

    Raises:
      KeyError / TypeError: the row has no tests or they have the wrong type.
    """
    if tests_key not in example:
        raise KeyError(f"python_tests: example has no field {tests_key!r} ({sorted(example)})")
    tests = example[tests_key]
    if isinstance(tests, str):
        tests = [tests]
        if example.get("entry_point"):
            tests = [tests[0] + f"\n\ncheck({example['entry_point']})\n"]
    if not isinstance(tests, list | tuple) or not all(isinstance(t, str) for t in tests):
        raise TypeError(f"python_tests: {tests_key!r} must be a string or a list of strings")
    if not tests:
        raise ValueError(f"python_tests: {tests_key!r} is empty; nothing to verify against")
    setup = example.get(setup_key) or ""
    if not isinstance(setup, str):
        raise TypeError(f"python_tests: {setup_key!r} must be a string")
    return list(tests), setup


def python_tests(
    completion: str,
    example: dict,
    tests_key: str = "tests",
    setup_key: str = "test_setup",
    partial: bool = False,
    cpu_s: int = 2,
    wall_s: float = 4.0,
    memory_mb: int = 512,
) -> float:
    """Fraction of the row's tests the completion's code passes in the sandbox (see module).

    Args:
      completion: the model's decoded text.
      example: the row; `example[tests_key]` holds the tests.
      tests_key: field with the tests; setup_key: optional field with setup code.
      partial: reward passed/total instead of all-or-nothing.
      cpu_s, wall_s, memory_mb: sandbox limits for the whole run (code + all tests). The
        pool's `timeout_s` must exceed `wall_s` (the pool checks), with room for the
        interpreter's start-up, or slow runs count as verifier timeouts, not failed code.

    Raises:
      VerifierTimeout: the code ran past `wall_s` (the pool scores it 0 and counts it).
    """
    tests, setup = row_tests(example, tests_key, setup_key)
    limits = Limits(cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb)
    result = run_python(code_block(completion), tests, setup=setup, limits=limits)
    if result.status == "timeout":
        raise VerifierTimeout(f"the code ran past the sandbox's wall_s={wall_s:g} s")
    if result.status == "passed":
        return 1.0
    if partial and result.status == "failed":
        return result.passed / result.total
    return 0.0
