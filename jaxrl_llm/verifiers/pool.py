"""A long-lived process pool that scores completions with verifiers, outside the trainer.

Why not `multiprocessing.Pool` / `ProcessPoolExecutor`: neither can stop one hung task (a
catastrophic regex, an endless sympy simplification) without stopping everything, and the
executor breaks for good when a worker dies. Here each worker is a plain subprocess on two
pipes; the parent watches a deadline per (sample, verifier) item, kills a worker that passes
it, replaces dead workers, and puts the rest of their batch back in the queue.

Failures cost at most a bounded amount: a verifier whose calls keep killing their worker
or timing out (`breaker_after` in a row) is not called again for the rest of the batch;
its remaining samples score 0, each counted as an error, and `ScoreDetails.tripped` says
why. Workers cap their memory (`memory_mb`); a worker whose call ran out of it is replaced
(a leak stays with the old one). Workers kill whatever processes a call leaves behind
(see worker.py). `ErrorBudget` (report.py) turns a batch's failures into the
trainer's warning or stop.

Items go out in small chunks (fewer round trips for fast verifiers like `gsm8k`); a worker
reports each item as it finishes, which starts the clock for the next one, so the timeout
stays per item. Results are written by item index, so order always matches the input.
Workers are started with `python -c` rather than `multiprocessing`'s spawn, so they do not
re-import the trainer's `__main__` (and JAX with it).
"""

from __future__ import annotations

import inspect
import json
import os
import select
import subprocess
import threading
import time
import weakref
from collections.abc import Mapping, Sequence

import numpy as np

from jaxrl_llm.errors import UserError
from jaxrl_llm.verifiers import worker as wire
from jaxrl_llm.verifiers.registry import parse_specs, resolve
from jaxrl_llm.verifiers.report import ScoreDetails
from jaxrl_llm.verifiers.work import WorkBatch, check_inputs

_MAX_START_FAILURES = 3


class PoolError(UserError, RuntimeError):
    """The verifiers cannot run at all (they fail to import or to start in a worker)."""


class VerifierPool:
    """Scores batches of completions in worker processes; create once, reuse every step.

    Example:
      >>> with VerifierPool(workers=2, timeout_s=5.0) as pool:
      ...     rewards, details = pool.score([("gsm8k", 1.0)], ["... #### 4"], [{"answer": "4"}])

    Args:
      workers: worker processes (default: CPU count).
      timeout_s: wall-clock limit per (sample, verifier) call; past it the worker is
        killed and replaced and the call scores 0 (`verifier/timeouts`).
      recycle_after: replace a worker after this many calls, bounding slow leaks (sympy's
        caches grow without limit).
      start_timeout_s: how long a new worker may take to import the verifiers.
      memory_mb: address space each worker may add once its verifiers are loaded; a call
        allocating beyond it gets MemoryError (an error for that sample). 0: no cap.
      breaker_after: a verifier whose calls time out or kill their worker this many times
        in a row is not called again in that batch (`ScoreDetails.tripped`).
    """

    def __init__(
        self,
        workers: int | None = None,
        timeout_s: float = 10.0,
        recycle_after: int = 20_000,
        start_timeout_s: float = 120.0,
        memory_mb: int = 2048,
        breaker_after: int = 5,
    ):
        workers = workers or os.cpu_count() or 1
        if workers < 1 or not timeout_s > 0 or recycle_after < 1 or breaker_after < 1:
            raise ValueError(
                f"need workers >= 1, timeout_s > 0, recycle_after >= 1, breaker_after >= 1; "
                f"got {workers=}, {timeout_s=}, {recycle_after=}, {breaker_after=}"
            )
        if memory_mb < 0:
            raise ValueError(f"memory_mb={memory_mb}: must be >= 0 (0 = no cap)")
        self.timeout_s, self.recycle_after, self.start_timeout_s = (
            timeout_s,
            recycle_after,
            start_timeout_s,
        )
        self.memory_mb, self.breaker_after = memory_mb, breaker_after
        self.restarts = 0  # workers replaced after a crash or timeout, over the pool's life
        self._workers: list[wire.WorkerProcess | None] = [None] * workers
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, wire.shutdown, self._workers)

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stops the workers; idempotent. Also runs at garbage collection and exit."""
        self._finalizer()

    def score(
        self,
        specs,
        completions: Sequence[str],
        examples: Sequence[Mapping],
        num_tokens: Sequence[int] | None = None,
    ) -> tuple[np.ndarray, ScoreDetails]:
        """Sum of weighted verifier scores per completion.

        Args:
          specs: reward terms, anything `parse_specs` accepts.
          completions: [N] decoded texts.
          examples: [N] dataset rows (repeat a prompt's row for each of its G samples).
          num_tokens: [N] completion lengths in tokens, given to verifiers as
            `example["num_tokens"]` (for verifiers that weigh length).

        Returns:
          rewards: [N] float64, sum_k weight_k * score_k; a failed call contributes 0.
          details: `ScoreDetails` (per-verifier scores, error and timeout counts).
        """
        if not self._finalizer.alive:
            raise RuntimeError("VerifierPool.score called after close()")
        specs = parse_specs(specs)
        self._check_wall_limits(specs)
        examples = check_inputs(completions, examples, num_tokens)
        batch = WorkBatch(specs, list(completions), examples, self.breaker_after)
        key, wire_specs = _wire(specs)
        with self._lock:
            try:
                self._run(batch, key, wire_specs)
            except BaseException:
                self._kill_active()  # their results would belong to this aborted batch
                raise
        return batch.details()

    def prepare(self, specs) -> None:
        """Starts every worker and has it load `specs` now, without waiting: the first
        `score` with the same specs then finds them loaded (or loading) instead of paying
        for the interpreters and the verifiers' imports itself. A trainer calls it before
        its start-up work (model load, compilation), which then overlaps with it."""
        specs = parse_specs(specs)
        self._check_wall_limits(specs)
        key, wire_specs = _wire(specs)
        with self._lock:
            for i, w in enumerate(self._workers):
                if w is None:
                    w = self._workers[i] = wire.WorkerProcess(0.9 * self.timeout_s, self.memory_mb)
                if w.idle and w.key != key:
                    w.loading_since = time.monotonic()
                    if not w.send(("specs", key, wire_specs)):
                        w.kill()  # replaced by the next score
                        self._workers[i] = None

    def call(
        self,
        name: str,
        texts: Sequence[str],
        examples: Sequence[Mapping],
        breaker_after: int | None = None,
    ) -> list:
        """Calls the function `name` (`(text, example) -> any picklable value`, named as a
        verifier is) once per input, with the pool's timeouts, memory cap and crash
        isolation -> [(value, status, message)] in input order; status is `worker.OK`,
        `ERROR` or `TIMEOUT`, value None unless OK. What the environments run on.
        `breaker_after`: this call's breaker (default the pool's)."""
        if not self._finalizer.alive:
            raise RuntimeError("VerifierPool.call after close()")
        spec = parse_specs([name])[0]
        examples = check_inputs(texts, examples, None)
        breaker_after = breaker_after or self.breaker_after
        batch = WorkBatch([spec], list(texts), examples, breaker_after, raw=True)
        wire_specs = [(spec.name, {}, True)]
        with self._lock:
            try:
                self._run(batch, json.dumps(wire_specs), wire_specs)
            except BaseException:
                self._kill_active()
                raise
        ok = batch.status[:, 0] == wire.OK
        timeouts = np.isin(batch.status[:, 0], (wire.TIMEOUT, wire.OWN_TIMEOUT))
        return [
            (
                batch.values[i, 0] if ok[i] else None,
                wire.OK if ok[i] else wire.TIMEOUT if timeouts[i] else wire.ERROR,
                batch.notes.get(i, ""),
            )
            for i in range(len(texts))
        ]

    def _check_wall_limits(self, specs) -> None:
        """A sandbox wall limit above the pool's timeout would turn slow code into
        verifier timeouts; refuse the combination up front."""
        for spec in specs:
            wall = spec.options.get("wall_s")
            if wall is None and spec.name == "python_tests":
                wall = inspect.signature(resolve(spec.name)).parameters["wall_s"].default
            if wall is not None and wall >= self.timeout_s:
                raise ValueError(
                    f"rewards.{spec.label}.options.wall_s={wall} must be below the verifier "
                    f"pool's timeout_s={self.timeout_s} (leave ~1 s for interpreter start-up)"
                )

    def _run(self, batch: WorkBatch, key: str, wire_specs) -> None:
        start_failures = 0
        while batch.remaining:
            self._dispatch(batch, key, wire_specs)
            active = {w.fd: w for w in self._workers if w is not None and not w.idle}
            poller = select.poll()
            for fd in active:
                poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll(1000 * self._wait_s(active.values())):
                start_failures += self._receive(active[fd], batch, key)
                if start_failures > _MAX_START_FAILURES:
                    raise PoolError(
                        "rewards",
                        "verifier workers keep dying while loading the verifiers",
                        "check that the reward modules import in a fresh python (their "
                        "stderr is above)",
                    )
            self._enforce_deadlines(batch)

    def _dispatch(self, batch: WorkBatch, key: str, wire_specs) -> None:
        per_worker = max(1, len(batch.queue) // (4 * len(self._workers)))
        for i, w in enumerate(self._workers):
            if w is not None and w.idle and w.done >= self.recycle_after:
                wire.shutdown([w])
                w = self._workers[i] = None
            if w is None:
                w = self._workers[i] = wire.WorkerProcess(0.9 * self.timeout_s, self.memory_mb)
            if not w.idle:
                continue
            if w.key != key:
                w.loading_since = time.monotonic()
                if not w.send(("specs", key, wire_specs)):
                    self._retire(w, batch)
            elif batch.queue:
                items, message = batch.chunk(min(per_worker, 32))
                if not items:  # what was left belonged to tripped verifiers
                    continue
                w.busy.extend(items)
                w.since = time.monotonic()
                if not w.send(message):
                    self._retire(w, batch)  # died while idle: its items never ran

    def _retire(
        self, w: wire.WorkerProcess, batch: WorkBatch, status: int | None = None, why: str = ""
    ):
        """Kills `w`; its current item gets `status` (None: requeued like the rest)."""
        items = list(w.busy)
        w.busy.clear()
        if items and status is not None:
            batch.queue.extendleft(reversed(items[1:]))  # before a trip can sort the queue
            batch.record(items[0], 0.0, status, why, costly=True)
        else:
            batch.queue.extendleft(reversed(items))
        w.kill()
        self._workers[self._workers.index(w)] = None
        self.restarts += 1

    def _receive(self, w: wire.WorkerProcess, batch: WorkBatch, key: str) -> int:
        """Handles one message from `w`; returns 1 if it died while starting, else 0."""
        try:
            message = wire.receive(w.fd)
        except (EOFError, OSError):
            try:
                why = f"worker died ({w.exit_info_within(1.0)})"
            except subprocess.TimeoutExpired:
                why = "worker closed its result pipe"
            starting = w.loading_since is not None
            self._retire(w, batch, wire.ERROR, why)
            return int(starting)
        if message[0] == "ready" and message[1] == key:
            w.key, w.loading_since = key, None
        elif message[0] == "spec_error":
            raise PoolError("rewards", f"a verifier failed to load in a worker: {message[2]}")
        elif message[0] == "result":
            _, item, value, status, text = message
            if not w.busy or w.busy[0] != item:
                raise RuntimeError(f"verifier worker protocol error: result for item {item}")
            w.busy.popleft()
            batch.record(item, value, status, text, costly=status == wire.TIMEOUT)
            w.done += 1
            w.since = time.monotonic()
            if status == wire.ERROR and text.startswith("MemoryError"):
                self._retire(w, batch)  # what it leaked stays with it; its queue goes back
        return 0

    def _wait_s(self, active) -> float:
        """Seconds until the nearest deadline among `active` workers (at most 1)."""
        now, wait = time.monotonic(), 1.0
        for w in active:
            if w.loading_since is not None:
                wait = min(wait, w.loading_since + self.start_timeout_s - now)
            else:
                wait = min(wait, w.since + self.timeout_s - now)
        return max(wait, 0.0)

    def _enforce_deadlines(self, batch: WorkBatch) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if w is None:
                continue
            if w.busy and now > w.since + self.timeout_s:
                why = f"no result within {self.timeout_s:g} s (worker killed)"
                self._retire(w, batch, wire.TIMEOUT, why)
            elif w.loading_since is not None and now > w.loading_since + self.start_timeout_s:
                raise PoolError(
                    "rewards",
                    f"a verifier worker did not load the verifiers within "
                    f"{self.start_timeout_s:g} s",
                    "check what the reward modules do at import time",
                )

    def _kill_active(self) -> None:
        for i, w in enumerate(self._workers):
            if w is not None and not w.idle:
                w.kill()
                self._workers[i] = None


def _wire(specs) -> tuple[str, list]:
    """(key, message) of a parsed spec list: what a worker loads, and the key it reports."""
    wire_specs = [(s.name, s.options) for s in specs]
    return json.dumps(wire_specs, sort_keys=True, default=repr), wire_specs


def score(
    specs,
    completions: Sequence[str],
    examples: Sequence[Mapping],
    workers: int = 2,
    timeout_s: float = 5.0,
    num_tokens: Sequence[int] | None = None,
) -> tuple[np.ndarray, ScoreDetails]:
    """One-off scoring with a temporary `VerifierPool` (see `VerifierPool.score`).

    A training loop should keep one `VerifierPool` open instead: starting workers and
    importing the verifiers costs about a second.
    """
    with VerifierPool(workers=workers, timeout_s=timeout_s) as pool:
        return pool.score(specs, completions, examples, num_tokens=num_tokens)
