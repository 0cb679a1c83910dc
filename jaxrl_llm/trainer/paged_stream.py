"""rollout.engine='paged' in 'overlap' and 'split': one engine session kept across steps,
its slots filled with the next steps' prompts, finished steps handed to the learner.

    thread = PagedStream(sampling, config, start=step, params=params, version=step)
    item = thread.take(step)          # as `rollout_thread.RolloutThread`
    thread.publish(new_params, version=step + 1)

A thread runs one `sampling.PagedSampler.stream` session. It draws step s's prompts and
queues its rows behind those already in the engine as soon as the parameters it decodes
with have a version v >= s - max_staleness, so the rows of step s + 1 take the slots that
step s's short rows leave while its long rows still decode. After each decode chunk it
scores the steps whose rows have all ended and hands them over; the learner takes them in
data order (`take` waits for its step). Newer parameters published by the learner go in
between chunks:

- rollout.partial=False: every row is drawn by the version that started it. The thread
  queues no new step while newer parameters wait; once the rows in the engine end, it
  swaps them in and goes on.
- rollout.partial=True: the swap happens at the next chunk; the rows in flight are
  recomputed by the new parameters (their prompt and tokens so far prefilled anew, the
  engine's preemption path) and draw on with them.

Each row's `policy_version` is the version that started it (what max_staleness bounds;
the step's version is the oldest of its rows), and `Item.token_versions` [N, T] gives the
version that drew each token (-1 past the row's end). Data position and resume are
`RolloutThread`'s: `consumed` is the position after the last step taken, and the steps
drawn but not taken are drawn again by a resumed run.
"""

from __future__ import annotations

import threading
import time

import jax
import numpy as np

from jaxrl_llm.trainer.rollout_thread import Item


class PagedStream:
    """`RolloutThread`'s interface over a streaming paged engine session."""

    def __init__(self, s, config, start: int, params, version: int, *, player=None,
                 max_staleness: int | None = None):  # fmt: skip
        if player is not None:
            raise ValueError("the paged stream samples single-turn rollouts")
        r = config.rollout
        self.s, self.num_steps = s, config.train.num_steps
        self.max_staleness = r.max_staleness if max_staleness is None else max_staleness
        self.partial = bool(r.partial)
        self.consumed = s.data.state()
        self._params, self._version = params, version
        self._items: dict[int, Item] = {}
        self._error: BaseException | None = None
        self._stopping = False
        self._cond = threading.Condition()
        self.stats: dict = {}
        self._thread = threading.Thread(target=self._loop, args=(start,), name="rollout-paged",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def publish(self, params, version: int) -> None:
        with self._cond:
            self._params, self._version = params, version
            self._cond.notify_all()

    def newest(self):
        with self._cond:
            return self._params, self._version

    def take(self, step: int) -> Item:
        with self._cond:
            self._cond.wait_for(lambda: step in self._items or self._error is not None)
            if step not in self._items:
                raise RuntimeError("the rollout thread failed") from self._error
            item = self._items.pop(step)
            self.consumed = item.position
            return item

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    # ------------------------------------------------------------------ the thread
    def _loop(self, start: int) -> None:
        try:
            with self.s.guard():
                self._run(start)
        except BaseException as err:  # noqa: BLE001  (handed to the learner)
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def _run(self, start: int) -> None:
        s, spec = self.s, self.s.spec
        session, pending = None, {}  # step -> (batch, position, ids, mask, queued at, waited)
        step, waited = start, time.perf_counter()
        while True:
            with self._cond:
                if self._stopping:
                    return
                params, version = self._params, self._version
            if session is not None and version != session.version:
                if self.partial or not (session.waiting or session.in_flight):
                    session.swap(params, version)
            current = version if session is None else session.version
            # Queue the next steps the bound allows (without partial, none on parameters
            # older than the newest: they wait for the swap).
            while (step < self.num_steps and current >= step - self.max_staleness
                   and current == version):  # fmt: skip
                batch = next(s.data)
                position = s.data.state()
                ids, mask = s.sampler.bucketed(batch.prompt_ids, batch.prompt_mask)
                rows = ids.shape[0] * spec.num_generations
                if session is None:
                    session = s.sampler.stream(params, version, spec, width=ids.shape[1],
                                               rows=rows)  # fmt: skip
                budgets = np.full(rows, spec.max_new_tokens, np.int64)
                session.submit(step, ids, mask, budgets, key_base=step * rows)
                now = time.perf_counter()
                pending[step] = (batch, position, now, now - waited)
                step, waited = step + 1, now
            if session is not None and session.busy:
                with s.compile_log.program("sampler", "paged stream", runs=True):
                    finished = session.run_chunk()
                for done in finished:
                    self._hand_over(session, done, pending.pop(done))
                self.stats = dict(session.stats)
                continue
            with self._cond:  # idle: wait for newer parameters (or the end)
                self._cond.wait_for(lambda v=version: self._stopping or self._version != v)

    def _hand_over(self, session, step: int, queued) -> None:
        batch, position, start, wait_s = queued
        out, token_versions = session.output(step)
        jax.block_until_ready(out.tokens)
        sampled = time.perf_counter()
        scored = self.s.scorer(out, batch)
        item = Item(
            step=step, batch=batch, out=out, scored=scored,
            version=int(np.min(np.asarray(out.policy_version))), position=position,
            wait_s=wait_s, sample_s=sampled - start, score_s=time.perf_counter() - sampled,
            token_versions=token_versions,
        )  # fmt: skip
        with self._cond:
            self._items[step] = item
            self._cond.notify_all()
