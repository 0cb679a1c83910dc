"""What a scoring call reports (`ScoreDetails`), and the trainer's policy on failures
(`ErrorBudget`).

    budget = ErrorBudget(max_error_rate=0.5, max_failed_steps=3)
    for step in ...:
        rewards, details = pool.score(specs, texts, examples)
        if line := budget.check(details, step):   # raises VerifierFailure on the last straw
            print(line, file=sys.stderr)

A verifier that fails on most samples is a bug (a missing field, a typo in a reward file,
a dependency the workers lack), and a run that goes on with reward 0 everywhere trains
nothing. A step where some verifier failed on more than `max_error_rate` of its calls is
a failed step: `check` returns one warning line naming the verifier and its first error;
`max_failed_steps` failed steps in a row stop the run with that error.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_llm.errors import UserError


@dataclasses.dataclass
class ScoreDetails:
    """Everything `score` learned besides the summed reward.

    Attributes:
      per_verifier: label -> [N] float64 raw (unweighted) scores; 0 where the call failed.
      weights: label -> weight used in the sum.
      errors: label -> calls that raised, returned something other than a finite number,
        hit the memory limit, killed their worker, or were skipped by the breaker.
      timeouts: label -> calls past the pool's `timeout_s`, and calls that reported their
        own time limit (the sandbox's `wall_s` in `python_tests`).
      failed: label -> calls that count against the verifier: `errors` plus the pool's
        timeouts (not a verifier's own time limit: code that loops is the model's fault).
      num_samples: N, the calls per verifier.
      first_error: the first failure counted in `failed`, `"<label> sample <i>: <error>"`.
      tripped: label -> why the breaker stopped calling it for the rest of the batch.
      messages: the first few failures of any kind, for the logs.
      key: the config key a label is named under in the warning and the stop
        (`rewards.<label>`; environments: `env.name`, their label the name).
      unit: what one of the `num_samples` calls is ("calls"; environments:
        "trajectories").
      fix: what to do, in the stop's line (empty: the verifiers' advice).
    """

    per_verifier: dict[str, np.ndarray]
    weights: dict[str, float]
    errors: dict[str, int]
    timeouts: dict[str, int]
    messages: list[str]
    failed: dict[str, int] = dataclasses.field(default_factory=dict)
    num_samples: int = 0
    first_error: str | None = None
    tripped: dict[str, str] = dataclasses.field(default_factory=dict)
    key: str = "rewards.{label}"
    unit: str = "calls"
    fix: str = ""

    def error_rates(self) -> dict[str, float]:
        """label -> fraction of its calls in `failed` (0 for an empty batch)."""
        return {
            k: v / self.num_samples if self.num_samples else 0.0 for k, v in self.failed.items()
        }

    def metrics(self) -> dict[str, float]:
        """Flat metrics: `reward/<label>` (mean raw score), `verifier/errors`,
        `verifier/timeouts`, `verifier/error_rate` (the worst verifier's)."""
        out = {f"reward/{label}": float(np.mean(v)) for label, v in self.per_verifier.items()}
        out["verifier/errors"] = float(sum(self.errors.values()))
        out["verifier/timeouts"] = float(sum(self.timeouts.values()))
        out["verifier/error_rate"] = max(self.error_rates().values(), default=0.0)
        return out


class VerifierFailure(UserError):
    """A verifier failed on most samples for `max_failed_steps` steps in a row."""


class ErrorBudget:
    """How many verifier failures a run tolerates (see module docstring).

    Args:
      max_error_rate: a step fails when some verifier's `ScoreDetails.error_rates()`
        is above this (`train.max_verifier_error_rate`).
      max_failed_steps: this many failed steps in a row stop the run; 0 never stops
        (`train.max_failed_steps`).
    """

    def __init__(self, max_error_rate: float = 0.5, max_failed_steps: int = 3):
        if not 0.0 <= max_error_rate <= 1.0:
            raise ValueError(f"max_error_rate={max_error_rate}: must be in [0, 1]")
        if max_failed_steps < 0:
            raise ValueError(f"max_failed_steps={max_failed_steps}: must be >= 0 (0 = never)")
        self.max_error_rate, self.max_failed_steps = max_error_rate, max_failed_steps
        self.failed_in_a_row = 0

    def check(
        self, details: ScoreDetails, step: int | None = None, rates: dict | None = None
    ) -> str | None:
        """Counts this step; returns a warning line when it failed, else None.

        Args:
          details: the step's `ScoreDetails` (this host's).
          step: named in the warning.
          rates: label -> error rate to judge instead of `details.error_rates()`. With
            several hosts pass the rates averaged over all of them, so that every host
            decides the same (a stop on one host alone would hang the others).

        Raises:
          VerifierFailure: the `max_failed_steps`-th failed step in a row.
        """
        local = rates is None
        rates = details.error_rates() if local else rates
        over = {label: rate for label, rate in rates.items() if rate > self.max_error_rate}
        if not over:
            self.failed_in_a_row = 0
            return None
        self.failed_in_a_row += 1
        label = max(over, key=over.get)
        what = _describe(details, label, over[label], local)
        key = details.key.format(label=label)
        if self.max_failed_steps and self.failed_in_a_row >= self.max_failed_steps:
            raise VerifierFailure(
                key,
                f"{what} ({self.failed_in_a_row} steps in a row)",
                (details.fix or "fix the verifier or the rows it reads")
                + " (train.max_verifier_error_rate and train.max_failed_steps set what is "
                "tolerated)",
            )
        where = f"step {step}: " if step is not None else ""
        left = self.max_failed_steps - self.failed_in_a_row
        until = f"; the run stops after {left} more such steps" if self.max_failed_steps else ""
        return f"warning: {where}{key}: {what}{until}"


def _describe(details: ScoreDetails, label: str, rate: float, local: bool) -> str:
    unit = details.unit
    calls = f"{details.num_samples} {unit}" if local else f"{unit} on all hosts"
    tripped = details.tripped.get(label)
    return (
        f"{rate:.0%} of {calls} failed"
        + (f", then the breaker stopped calling it: {tripped}" if tripped else "")
        + f"; first error: {details.first_error or '(on another host)'}"
    )
