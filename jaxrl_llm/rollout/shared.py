"""rollout.workers on a trainer of several processes (a multi-host trainer): process 0's
rollout thread draws every process's prompts from the workers, and each step's rollout
is shared with the other processes on the main thread.

    source = Shared(sampling, config)        # every process; modes.make_source picks it
    ro = source.next(step, params, clock)    # every process, in step: collectives

One trainer world runs one multi-controller program, so the rollout workers' stream
(`workers.remote.RemoteStream`) is opened by process 0 only: its rollout thread
(`thread.Threaded`) reads whole global batches (`data.PromptIterator.whole`) and submits
each step whole, with the key a one-process trainer gives it, so the workers draw what
they draw for one process. Every collective runs on the main thread of every process,
in the same order, at the same point of a step (a collective issued from the rollout
thread would interleave with the update's in another order on each process):

1. the new parameters' host copy, gathered from every process (`weights.host_copy`, the
   same one the one-process thread makes), published to process 0's thread;
2. step's rollout, which process 0 takes from its thread, broadcast to the others
   (`parallel.share`: the `SampleOutput` fields and the thread's metrics), made global
   arrays on the training mesh from the whole numpy values.

Scoring then runs on the main thread of each process for its own rows (the step's
`score`, as in 'overlap' on several hosts), not overlapped with the update as in one
process; each process's batch and data position come from its own iterator, which
advances one batch per step as process 0's whole one does.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxrl_llm import parallel
from jaxrl_llm.rollout.sources import Rollout, Sampling
from jaxrl_llm.rollout.thread import Threaded
from jaxrl_llm.sampling.decode import SampleOutput
from jaxrl_llm.workers import weights


class Shared:
    """rollout.mode='split' with rollout.workers on a trainer of several processes (module
    docstring); a rollout source as `thread.Threaded`."""

    def __init__(self, s: Sampling, config):
        self.s, self.config, self.inner = s, config, None
        self.base = None  # LoRA: the frozen base's host copy, gathered once

    def next(self, step: int, params, clock) -> Rollout:
        with jax.transfer_guard("allow"):  # explicit transfer points, both collectives
            return self._next(step, params, clock)

    def _next(self, step: int, params, clock) -> Rollout:
        host = weights.host_copy(params, self.s.workers.dtype, self.base)
        self.base = host.base
        request = None
        if jax.process_index() == 0:
            if self.inner is None:  # started here: the data position is the restored one
                whole = dataclasses.replace(self.s, data=self.s.data.whole(), scorer=_unscored)
                self.inner = Threaded(whole, self.config)
            item = self.inner.take(step, host, clock)
            lengths = np.asarray(item.out.lengths)
            fields = dict(
                version=item.version,
                metrics=self.inner.metrics(step, item, lengths, clock),
                seconds=clock.seconds,
            )
            arrays = {f: getattr(item.out, f) for f in _FIELDS if getattr(item.out, f) is not None}
            request = ("rollout", fields, arrays)
        _, fields, arrays = parallel.share(request)
        clock.seconds |= fields["seconds"]
        # the whole values, the same on every process -> global arrays, rows sharded
        out = SampleOutput(
            **parallel.shard_batch(arrays, self.s.mesh), num_generations=self.s.spec.num_generations
        )
        batch = next(self.s.data)  # this process's prompts, for its scoring
        return Rollout(
            out=out,
            batch=batch,
            version=fields["version"],
            position=self.s.data.state(),
            metrics=fields["metrics"],
        )

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


# The `SampleOutput` fields a rollout carries (num_generations is the spec's).
_FIELDS = tuple(f.name for f in dataclasses.fields(SampleOutput) if f.name != "num_generations")


def _unscored(out, batch):
    """Process 0's thread scores nothing: each process scores its own rows."""
    return None
