"""rollout.mode='split': a thread that samples and scores on the rollout mesh, ahead of
the learner by at most `rollout.max_staleness` parameter versions; `Threaded` is the
rollout source (`sources`) over it.

    handoff = Handoff(params, version=step, consumed=data.state())
    RolloutThread(sampling, config, start=step, handoff=handoff)
    item = handoff.take(step)                 # the learner: step's rollout, scored
    ...update...
    handoff.publish(new_params, version=step + 1)
    handoff.close()                           # stops the thread

Single-turn, the thread body is written once against the engine's 'stream' session
(`sampling.engine.StepStream`: submit, swap, run_chunk, output). It draws step s's
prompts and queues them as soon as the parameters the session draws with have a version
v >= s - max_staleness (and are the newest published); after each `run_chunk` it scores
the steps whose rows have all ended and hands them over; the learner takes them in data
order. So the learner's update u trains on rows of version v with u - v <= max_staleness,
max_staleness = 0 is the synchronous schedule, and at most max_staleness + 1 rollouts
wait for the learner. Newer parameters published by the learner go in between chunks:
without `rollout.partial` once no step is in flight (every row is drawn by the version
that started it); with it at once (the rows in flight draw on with them).

- Static engine (`StaticStream`): a queued step is sampled when the session reaches it,
  with the newest parameters then (one program, or with `rollout.partial`
  `partial_chunk` tokens at a time, the KV cache recomputed by newer parameters between
  chunks, `Sampler.refresh`); `token_versions` [T] gives each completion column's version
  (every row's column j was drawn by the same parameters).
- Paged engine (`PagedStream`): one engine session across steps; step s + 1's rows take
  the slots step s's short rows leave while its long rows still decode. A swap with
  partial rollouts preempts the rows in flight (recomputed by the new parameters).
  `token_versions` [N, T] gives the version that drew each token (-1 past the row's end).

- Rollout workers (`rollout.workers`, `workers.remote.RemoteStream`): the same stream
  over worker processes, each step sampled whole by one of them (docs/workers.md); on a
  trainer of several processes, process 0's thread only (`shared`).

A row's `policy_version` is the version that started it, the step's version the oldest
of its rows.

Data position: `consumed` is the data iterator's position after the last batch the learner
took, what a checkpoint stores; batches sampled but not taken are drawn again on resume.
An exception in the thread reaches the learner at its next `take`.

Multi-turn (`player`: an `EnvRollout` or `AgentRollout`) goes through the same body, its
steps a 'stream' session of their own (`PlayerStream`): each run_chunk plays the oldest
queued step to the end with the newest parameters within the bound; with
`rollout.partial`, before each turn after the first the player switches to the newest
published parameters (the KV cache recomputed by them, `envs.play`; on the paged engine
between decode chunks, and so the gateway's `sampling.serve`). `token_versions` is then
[N, T]: the version that drew each completion token, -1 on observation tokens. 'overlap'
with environments is this thread with a bound of 1 on the training mesh: step s + 1's
trajectories are played while step s's reference and update run.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models import lora
from jaxrl_llm.rollout.sources import Rollout, Sampling
from jaxrl_llm.sampling.engine import RowsLost, open_session


@dataclasses.dataclass
class Item:
    """One step's rollout: prompts, outputs (on the rollout mesh), scores, the version
    that sampled it, the data position after its prompts, and the thread's timings."""

    step: int
    batch: object
    out: object
    scored: object
    version: int
    position: object
    wait_s: float  # waiting for parameters within the staleness bound
    sample_s: float
    score_s: float
    token_versions: np.ndarray  # [T] version of each column, or [N, T] (multi-turn)


class Handoff:
    """What the learner and a rollout thread share, under one lock: the newest published
    parameters and their version, the steps produced and not taken yet, the thread's
    error and the stop flag. `consumed` is the data position after the last step taken.
    `start` runs a thread's body (`body(start_step)`) under `s.guard()`, an exception
    going to the learner at its next `take`."""

    def __init__(self, params, version: int, consumed):
        self.consumed = consumed
        self._params, self._version = params, version
        self._items: dict[int, Item] = {}
        self._error: BaseException | None = None
        self._stopping = False
        self._cond = threading.Condition()
        self._thread = None

    def start(self, s: Sampling, body, step: int) -> None:
        def loop():
            try:
                with s.guard():
                    body(step)
            except BaseException as err:  # noqa: BLE001  (handed to the learner)
                with self._cond:
                    self._error = err
                    self._cond.notify_all()

        self._thread = threading.Thread(target=loop, name="rollout", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the learner's side
    def publish(self, params, version: int) -> None:
        """New parameters (already on the rollout mesh) and their version."""
        with self._cond:
            self._params, self._version = params, version
            self._cond.notify_all()

    def newest(self):
        """The newest published parameters and their version."""
        with self._cond:
            return self._params, self._version

    def take(self, step: int) -> Item:
        """Step's rollout, waiting for the thread if needed."""
        with self._cond:
            self._cond.wait_for(lambda: step in self._items or self._error is not None)
            if step not in self._items:
                raise RuntimeError("the rollout thread failed") from self._error
            item = self._items.pop(step)
            self.consumed = item.position
            return item

    def close(self) -> None:
        """Stops the thread after the rollout it is working on; idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    # ------------------------------------------------------------- the thread's side
    def wait(self, ready, timeout=None):
        """Waits until ready(newest version) or a stop -> (params, version) at that
        moment, or None when the thread is to stop."""
        with self._cond:
            self._cond.wait_for(lambda: self._stopping or ready(self._version), timeout)
            return None if self._stopping else (self._params, self._version)

    def put(self, item: Item) -> None:
        with self._cond:
            self._items[item.step] = item
            self._cond.notify_all()


# `Fleet.stats` (rollout workers) logged each step: connected now, joined, lost, timed out,
# redrawn; the last weight sync's seconds and GB.
WORKER_COUNTERS = (
    "workers",
    "workers_joined",
    "workers_lost",
    "workers_timed_out",
    "requeued",
    "weight_sync_s",
    "weight_sync_gb",
)


class RolloutThread:
    """Samples and scores steps start, start + 1, ... with `s` (a `sources.Sampling` on
    the rollout mesh), within the staleness bound of `config.rollout` (or
    `max_staleness`), on a 'stream' session of its engine (`sampling.open_session`) or,
    with a `player`, of the player's multi-turn steps (`PlayerStream`). It runs on the
    `Handoff` it is given, from which the learner takes its steps."""

    def __init__(
        self,
        s: Sampling,
        config,
        start: int,
        handoff: Handoff,
        *,
        player=None,
        max_staleness: int | None = None,
    ):
        r = config.rollout
        self.s, self.num_steps, self.player = s, config.train.num_steps, player
        self.max_staleness = r.max_staleness if max_staleness is None else max_staleness
        self.partial = bool(r.partial)
        self.partial_chunk = r.partial_chunk if r.partial else 0
        self.stats: dict = {}  # the stream session's counters, after each chunk
        self.handoff = handoff
        handoff.start(s, self._stream, start)

    def _open(self, params, version: int, pending: dict):
        """The stream session (the engine's, the rollout workers', or the player's) and
        how a finished step is scored: `score(step, out, batch)`."""
        s = self.s
        if self.player is not None:
            newest = self.handoff.newest if self.partial_chunk else None
            session = PlayerStream(
                self.player, params, version, lambda step: pending[step][0], newest
            )
            return session, session.scored
        engine = s.sampler if s.workers is None else s.workers  # rollout.workers
        session = open_session(engine, "stream", params, version, s.spec, chunk=self.partial_chunk)
        return session, lambda step, out, batch: s.scorer(out, batch)

    def _stream(self, start: int) -> None:
        """Queues steps start, start + 1, ... on one stream session as the bound allows
        and hands each over, scored, as its rows end (module docstring). A step's wait_s is
        the time the thread sat idle for parameters before queueing it; its sample_s runs
        from its queueing or the previous hand-over, whichever is later, to its end."""
        s = self.s
        session, pending = None, {}  # step -> (batch, position, queued at, waited)
        step, idle, handed = start, 0.0, 0.0
        while True:
            got = self.handoff.wait(lambda v: True)
            if got is None:
                return
            params, version = got
            if session is None:
                session, score = self._open(params, version, pending)
            if version != session.version and (self.partial or not session.in_flight):
                session.swap(params, version)
            # Queue the steps the bound allows (without partial, none on parameters older
            # than the newest: they wait for the swap).
            while (
                step < self.num_steps
                and session.version >= step - self.max_staleness
                and session.version == version
            ):
                batch = next(s.data)
                position = s.data.state()
                session.submit(step, batch.prompt_ids, batch.prompt_mask, step * s.rounds)
                pending[step] = (batch, position, time.perf_counter(), idle)
                step, idle = step + 1, 0.0
            if session.busy:
                with s.compile_log.program("sampler", runs=True) as compiled:
                    finished = session.run_chunk()
                    compiled.detail = session.detail
                for done in finished:
                    batch, position, queued, waited = pending.pop(done)
                    since = max(queued, handed)
                    self._hand_over(session, score, done, batch, position, since, waited)
                    handed = time.perf_counter()
                self.stats = dict(session.stats)
                continue
            began = time.perf_counter()
            self.handoff.wait(lambda v, was=version: v != was)  # idle: newer parameters
            idle += time.perf_counter() - began

    def _hand_over(self, session, score, step: int, batch, position, start, wait_s) -> None:
        out, token_versions = session.output(step)
        jax.block_until_ready(out.tokens)
        sampled = time.perf_counter()
        scored = score(step, out, batch)
        self.handoff.put(
            Item(
                step=step,
                batch=batch,
                out=out,
                scored=scored,
                version=int(np.min(np.asarray(out.policy_version))),
                position=position,
                wait_s=wait_s,
                sample_s=sampled - start,
                score_s=time.perf_counter() - sampled,
                token_versions=token_versions,
            )
        )


class PlayerStream:
    """A player's multi-turn steps (an `EnvRollout`, or the agents' `AgentRollout`) as a
    'stream' session (`sampling.engine.StepStream`), so the rollout thread has one body
    for single- and multi-turn steps. `run_chunk` plays the oldest queued step to the end
    with the parameters the session has then: a swap falls between steps, so each step
    starts on the newest parameters within the bound; with `rollout.partial` the player
    also takes the newest published ones before each turn after the first (`newest`:
    `envs.play`'s refresh). A player reads the rows' examples, not only their ids, so the
    session reads each queued step's data batch from the thread (`batches`); its scores
    are the player's own (`scored`). A rollout worker lost with a step's rows
    (`sampling.engine.RowsLost`) costs a replay of the step on the workers left."""

    detail, in_flight = "multi-turn", False  # no step is ever left half played

    def __init__(self, player, params, version: int, batches, newest=None):
        self.player, self.params, self.version = player, params, version
        self.batches, self.newest = batches, newest
        self.queued, self.done = [], {}
        self.stats = getattr(player, "stats", {})  # rollout workers: `Fleet.stats`

    @property
    def busy(self) -> bool:
        return bool(self.queued)

    def submit(self, step: int, prompt_ids, prompt_mask, key: int) -> None:
        del prompt_ids, prompt_mask, key  # the player reads the batch; its keys are the step's
        self.queued.append(step)

    def swap(self, params, version: int) -> None:
        self.params, self.version = params, version

    def run_chunk(self) -> list:
        step = self.queued.pop(0)
        while True:
            try:
                self.done[step] = self.player(
                    self.params, self.batches(step), step, version=self.version, refresh=self.newest
                )
                return [step]
            except RowsLost as err:  # a rollout worker died with the rows: all again, elsewhere
                logging.warning("%s: step %d played again on the workers left", err, step)

    def output(self, step: int) -> tuple:
        out, _, token_versions = self.done[step]
        return out, token_versions

    def scored(self, step: int, out, batch):
        del out, batch
        return self.done.pop(step)[1]


def owned(params):
    """A copy of what the update donates: the whole tree, or of parameters with LoRA
    adapters (sent unmerged to rollout workers) the adapters alone, the frozen base
    (never donated, `rl.state`) shared as it is."""
    if lora.has_adapters(params):
        adapters, base = lora.split(params)
        return lora.combine(base, jax.tree.map(jnp.copy, adapters))
    return jax.tree.map(jnp.copy, params)


class Threaded:
    """rollout.mode='split' as a rollout source: the thread starts at the first step with
    the parameters given (already on the rollout mesh: `Run.sampler_params`); each later
    step publishes the parameters it is given before it takes its rollout, which moves to
    the training mesh.

    With a `player` (multi-turn), or an engine that does not dispatch ahead (the paged
    one), it also serves 'overlap' (`max_staleness=1`, one mesh): the thread then gets a
    copy of the parameters (`copy=True`), since the update donates the ones the step
    holds while the thread still samples with them (`owned`)."""

    def __init__(
        self,
        s: Sampling,
        config,
        *,
        player=None,
        max_staleness: int | None = None,
        copy: bool = False,
    ):
        self.s, self.config, self.handoff, self.thread = s, config, None, None
        self.player, self.max_staleness, self.copy = player, max_staleness, copy

    def next(self, step: int, params, clock) -> Rollout:
        item = self.take(step, params, clock)
        out = jax.device_put(item.out, self.s.row_sharding)  # rollout -> training mesh
        return Rollout(
            out=out,
            batch=item.batch,
            version=item.version,
            position=item.position,
            scored=item.scored,
            metrics=self.metrics(step, item, item.scored.lengths, clock),
        )

    def take(self, step: int, params, clock) -> Item:
        """Publishes `params` as version `step` (the first call starts the thread with
        them) and waits for step's rollout."""
        if self.copy:
            params = owned(params)
        if self.handoff is None:
            self.handoff = Handoff(params, step, self.s.data.state())
            self.thread = RolloutThread(
                self.s,
                self.config,
                step,
                self.handoff,
                player=self.player,
                max_staleness=self.max_staleness,
            )
        else:
            self.handoff.publish(params, step)
        item = self.handoff.take(step)  # waits while the thread is behind
        clock.mark("learner_wait")
        clock.seconds |= {"sample": item.sample_s, "score": item.score_s}
        return item

    def metrics(self, step: int, item: Item, lengths, clock) -> dict:
        """The step's host metrics from the thread: waits, staleness, rollout workers."""
        metrics = {
            "perf/rollout_wait_s": item.wait_s,
            "perf/learner_wait_s": clock.seconds["learner_wait"],
        }
        metrics |= token_staleness(step, item, lengths)
        stats = self.thread.stats  # rollout workers: those lost so far, their steps redrawn
        return metrics | {f"rollout/{k}": stats[k] for k in WORKER_COUNTERS if k in stats}

    def close(self) -> None:
        if self.handoff is not None:
            self.handoff.close()
        if self.player is not None:
            self.player.close()


def token_staleness(step: int, item: Item, lengths) -> dict:
    """The mean staleness over completion tokens (sampled ones, in multi-turn), and the
    fraction of rows with tokens of a newer version than the one that started them
    (partial rollouts); `lengths`: the rows' completion lengths."""
    lengths, v = np.asarray(lengths), item.token_versions
    rows = [v[:n] for n in lengths] if v.ndim == 1 else [r[r >= 0] for r in v]
    per_token = [step - r for r in rows]
    tokens = np.concatenate(per_token) if per_token else np.zeros(0)
    later = [bool((r > item.version).any()) for r in rows]
    return {
        "rollout/token_staleness_mean": float(tokens.mean()) if tokens.size else 0.0,
        "rollout/partial_frac": float(np.mean(later)) if later else 0.0,
    }
