"""Verifiers: reward functions `(completion, example) -> float`, run in a process pool.

    from jaxrl_llm import verifiers
    fn = verifiers.get("gsm8k")                   # (completion, example) -> float
    rewards, details = verifiers.score(
        [("gsm8k", 1.0, {}), ("format", 0.1, {"pattern": r"^<answer>.*</answer>$"})],
        completions, examples, workers=2, timeout_s=5.0)

In a training loop keep one `VerifierPool` open and call `pool.score` every step.
"""

from jaxrl_llm.verifiers.pool import ScoreDetails, VerifierPool, score
from jaxrl_llm.verifiers.registry import BUILTINS, VerifierSpec, get, parse_specs, register
from jaxrl_llm.verifiers.sandbox import Limits, SandboxResult, isolation, run_python

__all__ = [
    "BUILTINS",
    "Limits",
    "SandboxResult",
    "ScoreDetails",
    "VerifierPool",
    "VerifierSpec",
    "get",
    "isolation",
    "parse_specs",
    "register",
    "run_python",
    "score",
]
