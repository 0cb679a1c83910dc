"""rollout.mode='split': a thread that samples and scores on the rollout mesh, ahead of
the learner by at most `rollout.max_staleness` parameter versions; `Threaded` is the
rollout source (`sources`) over it.

    handoff = Handoff(params, version=step, consumed=data.state())
    RolloutThread(sampling, config, start=step, handoff=handoff)
    item = handoff.take(step)                 # the learner: step's rollout, scored
    ...update...
    handoff.publish(new_params, version=step + 1)
    handoff.close()                           # stops the thread

The thread produces the rollouts of steps start, start + 1, ... in order. Before it draws
step s's prompts it waits until the newest published parameters have version
v >= s - max_staleness, samples with them (recording v per row) and scores the batch on
the host; the learner takes step s's item when it gets there. So the learner's update u
trains on a batch of version v with u - v <= max_staleness, and max_staleness = 0 is the
synchronous schedule. At most max_staleness + 1 rollouts wait for the learner.

Data position: `consumed` is the data iterator's position after the last batch the learner
took, what a checkpoint stores; batches sampled but not taken are drawn again on resume.
An exception in the thread reaches the learner at its next `take`.

Partial rollouts (`rollout.partial`): the thread decodes `partial_chunk` tokens at a
time; when newer parameters were published in between it recomputes the rollout's KV
cache with them (`Sampler.refresh`) and decodes on with them. A row's `policy_version` is
the version that started it; `token_versions` [T] gives the version of each completion
column (every row's column j was drawn by the same parameters).

Multi-turn (`player`: an `EnvRollout`): the thread plays step s's trajectories to the end
with the parameters it started them with; with `rollout.partial`, before each turn after
the first it switches to the newest published parameters (the KV cache recomputed by
them, `envs.play`; on the paged engine between decode chunks, and so the gateway's
`sampling.serve`).
`token_versions` is then [N, T]: the version that drew each
completion token, -1 on observation tokens. 'overlap' with environments is this thread
with a bound of 1 on the training mesh: step s + 1's trajectories are played while step
s's reference and update run.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.rollout.sources import Rollout, Sampling, bucket


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


class RolloutThread:
    """Samples and scores steps start, start + 1, ... with `s` (a `sources.Sampling` on
    the rollout mesh), within the staleness bound of `config.rollout` (or
    `max_staleness`); with a `player` (an `EnvRollout`) it plays multi-turn trajectories.
    It runs on the `Handoff` it is given, from which the learner takes its steps."""

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
        self.partial_chunk = r.partial_chunk if r.partial else 0
        self.handoff = handoff
        handoff.start(s, self._run, start)

    def _run(self, start: int) -> None:
        """Produces steps start, start + 1, ... in order, each within the bound."""
        for step in range(start, self.num_steps):
            waited = time.perf_counter()
            got = self.handoff.wait(lambda v, s=step: v >= s - self.max_staleness)
            if got is None:
                return
            self._produce(step, *got, time.perf_counter() - waited)

    def _produce(self, step: int, params, version: int, wait_s: float) -> None:
        batch = next(self.s.data)
        position = self.s.data.state()
        start = time.perf_counter()
        if self.player is not None:  # multi-turn: the environments score as they play
            with self.s.compile_log.program("sampler", "multi-turn", runs=True):
                refresh = self.handoff.newest if self.partial_chunk else None
                out, scored, columns = self.player(
                    params, batch, step, version=version, refresh=refresh
                )
            jax.block_until_ready(out.tokens)
            sampled = time.perf_counter()
        elif self.partial_chunk:
            out, columns = self._partial(batch, step, params, version)
        else:
            out = self.s.sample(params, batch, step, version=version)
            columns = np.full(self.s.spec.max_new_tokens, version)
        if self.player is None:
            jax.block_until_ready(out.tokens)
            sampled = time.perf_counter()
            scored = self.s.scorer(out, batch)
        item = Item(
            step=step,
            batch=batch,
            out=out,
            scored=scored,
            version=version,
            position=position,
            wait_s=wait_s,
            sample_s=sampled - start,
            score_s=time.perf_counter() - sampled,
            token_versions=columns,
        )
        self.handoff.put(item)

    def _partial(self, batch, step: int, params, version: int):
        """The rollout decoded partial_chunk tokens at a time, switching to the newest
        parameters between chunks -> (output, version of each column)."""
        sampler, spec, log = self.s.sampler, self.s.spec, self.s.compile_log
        T, chunk = spec.max_new_tokens, self.partial_chunk
        columns = np.full(T, version)
        state = sampler.start(
            params, batch.prompt_ids, batch.prompt_mask, spec, step, version=version
        )
        for first in range(0, T, chunk):
            newest, newest_version = self.handoff.newest()
            # Each chunk's cache width is a program of its own, compiled at first use (at
            # most MAX_PARTIAL_CHUNKS of them, `config.checks_rollout`): each says so in a line.
            detail = f"{bucket(state)}, partial tokens {first}-{min(first + chunk, T)}"
            with log.program("sampler", detail, runs=True):
                if newest_version != version and first:
                    if bool(jax.device_get(state.done).all()):
                        break  # every row has stopped: nothing left to draw
                    state, params, version = sampler.refresh(newest, state), newest, newest_version
                columns[first:] = version
                state = sampler.decode(params, state, min(chunk, T - first))
        return sampler.result(state), columns


class Threaded:
    """rollout.mode='split' as a rollout source: the thread starts at the first step with
    the parameters given (already on the rollout mesh: `Run.sampler_params`); each later
    step publishes the parameters it is given before it takes its rollout, which moves to
    the training mesh.

    `thread` names the thread's class: `RolloutThread`, or `paged_stream.PagedStream`
    (the paged engine's session across steps). With a `player` (multi-turn), or a
    `PagedStream`, it also serves 'overlap' (`max_staleness=1`, one mesh):
    the thread then gets a copy of the parameters (`copy=True`), since the update donates
    the ones the step holds while the thread still plays with them."""

    def __init__(
        self,
        s: Sampling,
        config,
        *,
        player=None,
        max_staleness: int | None = None,
        copy: bool = False,
        thread=None,
    ):
        self.s, self.config, self.handoff = s, config, None
        self.player, self.max_staleness, self.copy = player, max_staleness, copy
        self.make_thread = thread or RolloutThread  # or `paged_stream.PagedStream`

    def next(self, step: int, params, clock) -> Rollout:
        if self.copy:
            params = jax.tree.map(jnp.copy, params)
        if self.handoff is None:
            self.handoff = Handoff(params, step, self.s.data.state())
            self.make_thread(
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
        out = jax.device_put(item.out, self.s.row_sharding)  # rollout -> training mesh
        metrics = {
            "perf/rollout_wait_s": item.wait_s,
            "perf/learner_wait_s": clock.seconds["learner_wait"],
        }
        metrics |= token_staleness(step, item)
        return Rollout(
            out=out,
            batch=item.batch,
            version=item.version,
            position=item.position,
            scored=item.scored,
            metrics=metrics,
        )

    def close(self) -> None:
        if self.handoff is not None:
            self.handoff.close()
        if self.player is not None:
            self.player.close()


def token_staleness(step: int, item: Item) -> dict:
    """The mean staleness over completion tokens (sampled ones, in multi-turn), and the
    fraction of rows with tokens of a newer version than the one that started them
    (partial rollouts)."""
    lengths, v = np.asarray(item.scored.lengths), item.token_versions
    rows = [v[:n] for n in lengths] if v.ndim == 1 else [r[r >= 0] for r in v]
    per_token = [step - r for r in rows]
    tokens = np.concatenate(per_token) if per_token else np.zeros(0)
    later = [bool((r > item.version).any()) for r in rows]
    return {
        "rollout/token_staleness_mean": float(tokens.mean()) if tokens.size else 0.0,
        "rollout/partial_frac": float(np.mean(later)) if later else 0.0,
    }
