"""One call of the verifier pool's work: the items (sample x verifier) still to run, their
results as the workers report them, the per-verifier breaker, and the summary
(`ScoreDetails`). `VerifierPool` (pool.py) runs it."""

from __future__ import annotations

import collections
from collections.abc import Mapping

import numpy as np

from jaxrl_llm.verifiers import worker as wire
from jaxrl_llm.verifiers.report import ScoreDetails

_MAX_MESSAGES = 8


class WorkBatch:
    """Bookkeeping of one `score` call: [N, K] values and statuses, the item queue, and
    the breaker (per verifier, calls in a row that cost a worker or a timeout)."""

    def __init__(self, specs, completions, examples, breaker_after: int, raw: bool = False):
        self.specs, self.completions, self.examples = specs, completions, examples
        self.k = len(specs)
        self.values = np.zeros((len(completions), self.k), object if raw else float)
        self.notes: dict[int, str] = {}  # sample -> why its (first) failed call failed
        self.status = np.full((len(completions), self.k), -1, np.int8)
        self.queue = collections.deque(range(len(completions) * self.k))
        self.messages: list[str] = []
        self.first_error: str | None = None
        self.remaining = len(completions) * self.k
        self.breaker_after = breaker_after
        self.costly_in_a_row = [0] * self.k
        self.tripped: dict[int, str] = {}

    def record(self, item: int, value: float, status: int, message: str, costly=False) -> None:
        """One finished call; `costly`: it timed out or killed its worker."""
        sample, k = divmod(item, self.k)
        self._finish(sample, k, value, status, message)
        self.costly_in_a_row[k] = self.costly_in_a_row[k] + 1 if costly else 0
        if self.costly_in_a_row[k] >= self.breaker_after and k not in self.tripped:
            self._trip(k, message)

    def _finish(self, sample: int, k: int, value: float, status: int, message: str) -> None:
        self.values[sample, k] = value if status == wire.OK else 0.0
        self.status[sample, k] = status
        self.remaining -= 1
        if status == wire.OK:
            return
        self.notes.setdefault(sample, message)
        line = f"{self.specs[k].label} sample {sample}: {message}"
        if len(self.messages) < _MAX_MESSAGES:
            self.messages.append(line)
        if self.first_error is None and status in (wire.ERROR, wire.TIMEOUT):
            self.first_error = line

    def _trip(self, k: int, last: str) -> None:
        """Stops calling verifier k in this batch: its queued samples score 0, as errors."""
        why = f"{self.breaker_after} calls in a row timed out or killed their worker (last: {last})"
        self.tripped[k] = why
        kept = collections.deque()
        for item in self.queue:
            sample, kk = divmod(item, self.k)
            if kk == k:
                self._finish(sample, k, 0.0, wire.ERROR, f"not called: {why}")
            else:
                kept.append(item)
        self.queue = kept

    def chunk(self, size: int):
        """Up to `size` queued items and the message that runs them. Items of a tripped
        verifier (requeued from a worker that died after the trip) are finished here as
        not called, so a tripped verifier never runs again in this batch."""
        items = []
        while self.queue and len(items) < size:
            item = self.queue.popleft()
            sample, k = divmod(item, self.k)
            if k in self.tripped:
                self._finish(sample, k, 0.0, wire.ERROR, f"not called: {self.tripped[k]}")
            else:
                items.append(item)
        runs = [(item, item // self.k, item % self.k) for item in items]
        samples = {s: (self.completions[s], self.examples[s]) for _, s, _ in runs}
        return items, ("run", runs, samples)

    def details(self) -> tuple[np.ndarray, ScoreDetails]:
        labels = [s.label for s in self.specs]
        weights = np.array([s.weight for s in self.specs])

        def count(*codes):
            hits = np.isin(self.status, codes)
            return {name: int(np.sum(hits[:, k])) for k, name in enumerate(labels)}

        return self.values @ weights, ScoreDetails(
            per_verifier={name: self.values[:, k].copy() for k, name in enumerate(labels)},
            weights=dict(zip(labels, weights.tolist(), strict=True)),
            errors=count(wire.ERROR),
            timeouts=count(wire.TIMEOUT, wire.OWN_TIMEOUT),
            messages=self.messages,
            failed=count(wire.ERROR, wire.TIMEOUT),
            num_samples=len(self.completions),
            first_error=self.first_error,
            tripped={labels[k]: why for k, why in self.tripped.items()},
        )


def check_inputs(completions, examples, num_tokens) -> list[dict]:
    if len(completions) != len(examples):
        raise ValueError(f"{len(completions)} completions but {len(examples)} examples")
    for i, (text, example) in enumerate(zip(completions, examples, strict=True)):
        if not isinstance(text, str):
            raise TypeError(f"completions[{i}] is {type(text).__name__}, expected str")
        if not isinstance(example, Mapping):
            raise TypeError(f"examples[{i}] is {type(example).__name__}, expected a dict")
    if num_tokens is None:
        return list(examples)
    if len(num_tokens) != len(completions):
        raise ValueError(f"{len(num_tokens)} num_tokens for {len(completions)} completions")
    return [{**ex, "num_tokens": int(n)} for ex, n in zip(examples, num_tokens, strict=True)]
