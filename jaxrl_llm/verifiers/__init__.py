"""Verifiers: reward functions `(completion, example) -> float`, run in a process pool.

    from jaxrl_llm import verifiers
    fn = verifiers.get("gsm8k")                   # (completion, example) -> float
    rewards, details = verifiers.score(
        [("gsm8k", 1.0, {}), ("format", 0.1, {"pattern": r"^<answer>.*</answer>$"})],
        completions, examples, workers=2, timeout_s=5.0)

In a training loop keep one `VerifierPool` open and call `pool.score` every step, and
give each step's details to an `ErrorBudget` (warns, then stops a run whose verifiers fail).
"""

from jaxrl_llm.verifiers.pool import PoolError, VerifierPool, score
from jaxrl_llm.verifiers.registry import (
    BUILTINS,
    VerifierSpec,
    VerifierTimeout,
    get,
    parse_specs,
    register,
)
from jaxrl_llm.verifiers.report import ErrorBudget, ScoreDetails, VerifierFailure
from jaxrl_llm.verifiers.sandbox import Limits, SandboxResult, isolation, run_python

__all__ = [
    "BUILTINS",
    "ErrorBudget",
    "Limits",
    "PoolError",
    "SandboxResult",
    "ScoreDetails",
    "VerifierPool",
    "VerifierFailure",
    "VerifierSpec",
    "VerifierTimeout",
    "get",
    "isolation",
    "parse_specs",
    "register",
    "run_python",
    "score",
]
