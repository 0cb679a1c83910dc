"""rollout.engine='paged' in 'overlap' and 'split': one engine session kept across steps,
its slots filled with the next steps' prompts, finished steps handed to the learner.

    PagedStream(sampling, config, start=step, handoff=handoff)   # as `RolloutThread`
    item = handoff.take(step)
    handoff.publish(new_params, version=step + 1)

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
version that drew each token (-1 past the row's end). The hand-off with the learner, the
data position and resume are `RolloutThread`'s (`rollout.thread.Handoff`): `consumed` is
the position after the last step taken, and the steps drawn but not taken are drawn again
by a resumed run.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxrl_llm.rollout.thread import Handoff, Item


class PagedStream:
    """A rollout thread over a streaming paged engine session, on the `Handoff` it is
    given (as `RolloutThread`)."""

    def __init__(
        self,
        s,
        config,
        start: int,
        handoff: Handoff,
        *,
        player=None,
        max_staleness: int | None = None,
    ):
        if player is not None:
            raise ValueError("the paged stream samples single-turn rollouts")
        r = config.rollout
        self.s, self.num_steps, self.partial = s, config.train.num_steps, bool(r.partial)
        self.max_staleness = r.max_staleness if max_staleness is None else max_staleness
        self.stats: dict = {}  # the session's counters, after each chunk
        self.handoff = handoff
        handoff.start(s, self._run, start)

    def _run(self, start: int) -> None:
        s, spec = self.s, self.s.spec
        session, pending = None, {}  # step -> (batch, position, queued at, waited)
        step, waited = start, time.perf_counter()
        while True:
            got = self.handoff.wait(lambda v: True)
            if got is None:
                return
            params, version = got
            if session is not None and version != session.version:
                if self.partial or not session.in_flight:
                    session.swap(params, version)
            current = version if session is None else session.version
            # Queue the next steps the bound allows (without partial, none on parameters
            # older than the newest: they wait for the swap).
            while (
                step < self.num_steps
                and current >= step - self.max_staleness
                and current == version
            ):
                batch = next(s.data)
                position = s.data.state()
                ids, mask = s.sampler.bucketed(batch.prompt_ids, batch.prompt_mask)
                rows = ids.shape[0] * spec.num_generations
                if session is None:
                    session = s.sampler.stream(params, version, spec, width=ids.shape[1], rows=rows)
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
            self.handoff.wait(lambda v, was=version: v != was)  # idle: newer parameters

    def _hand_over(self, session, step: int, queued) -> None:
        batch, position, start, wait_s = queued
        out, token_versions = session.output(step)
        jax.block_until_ready(out.tokens)
        sampled = time.perf_counter()
        scored = self.s.scorer(out, batch)
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
