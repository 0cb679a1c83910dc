"""`RemoteStream`: the stream seam (`sampling.engine.StepStream`) over rollout workers, each
its own JAX world (`workers.serve`), so the rollout thread is written once for both.

    workers = Workers(("10.0.0.7:7070", "10.0.0.8:7070"), token, pad_id=pad,
                      seed=config.train.seed)
    stream = open_session(workers, "stream", params, version, spec, chunk=0)  # RemoteStream
    stream.submit(step, prompt_ids, prompt_mask, key)    # to the least loaded worker
    stream.swap(params, version)        # one host copy, pushed to every worker (`weights`)
    for step in stream.run_chunk():     # every busy worker runs one chunk, in parallel
        out, token_versions = stream.output(step)        # numpy, as the worker's session
    stream.close()

A step is sampled whole by one worker, with the key the trainer gives, so it draws what a
local session draws with the same parameters (bfloat16 on the wire: the local session's
parameters cast to bfloat16).

Losing a worker: a connection that breaks (the process killed, the host gone) while a
request is sent or answered takes the worker out of the set; the steps it held and had
not returned are submitted again, whole, to the others (`stats['requeued']`), which hold
the newest weights, so their rows are drawn once more from the start, and by the newest
version. A step is returned once: only by the worker it is assigned to now. When no
worker is left, `WorkerError`. A worker's own error (an `error` frame) is raised as is.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from jaxrl_llm.errors import UserError
from jaxrl_llm.sampling.decode import SampleOutput
from jaxrl_llm.sampling.engine import SESSIONS
from jaxrl_llm.workers import weights, wire


@dataclasses.dataclass(frozen=True)
class Workers:
    """Rollout workers as an engine for `sampling.open_session` ('stream' only): their
    host:port addresses, the shared token, the pad id and seed their engines sample with
    (a worker refuses another seed), and the dtype the weights cross the wire in
    (`weights.host_copy`; None: each parameter's own)."""

    addresses: tuple
    token: str = dataclasses.field(repr=False)
    pad_id: int = 0
    seed: int = 0
    dtype: str | None = "bfloat16"
    connect_timeout_s: float = 60.0


@dataclasses.dataclass(eq=False)
class _Link:
    """One worker's connection and the steps it holds."""

    address: str
    sock: object
    steps: set = dataclasses.field(default_factory=set)
    in_flight: bool = False
    alive: bool = True


class RemoteStream:
    """`StepStream` over `workers` (a `Workers`); args as `StaticStream`'s."""

    def __init__(self, workers: Workers, params, version: int, spec, *, chunk: int = 0):
        w = workers
        self.spec, self.dtype, self.version, self.detail = spec, w.dtype, version, "remote"
        self.links = [_Link(a, wire.connect(a, w.token, w.connect_timeout_s)) for a in w.addresses]
        self.queued: dict = {}  # step -> (prompt_ids, prompt_mask, key): not returned yet
        self.finished: dict = {}  # step -> (output, token_versions)
        self.orphans: list = []  # steps of lost workers, not given to another yet
        self.stats = {"decode_chunks": 0, "swaps": 0, "requeued": 0, "workers_lost": 0}
        opened = dict(spec=dataclasses.asdict(spec), chunk=chunk, pad_id=w.pad_id, seed=w.seed)
        self._exchange(self.links, "open", opened)
        self._push(params, version)

    busy = property(lambda self: bool(self.queued))
    in_flight = property(lambda self: any(k.in_flight for k in self.alive))
    alive = property(lambda self: [k for k in self.links if k.alive])

    def submit(self, step: int, prompt_ids, prompt_mask, key: int) -> None:
        self.queued[step] = (np.asarray(prompt_ids), np.asarray(prompt_mask), int(key))
        self._assign(step)

    def swap(self, params, version: int) -> None:
        """Every worker samples on with `params` (as its own session's swap)."""
        self._push(params, version)
        self.stats["swaps"] += 1

    def run_chunk(self) -> list:
        """One chunk on every worker holding steps (sent to all, then answered) -> the
        steps returned, each once."""
        self.stats["decode_chunks"] += 1
        done = []
        for link, (fields, arrays) in self._exchange([k for k in self.alive if k.steps], "run"):
            link.in_flight, self.detail = fields["in_flight"], fields["detail"]
            for step in fields["steps"]:
                if step in link.steps:  # else it was taken from this worker: not twice
                    link.steps.discard(step)
                    self.queued.pop(step)
                    self.finished[step] = _output(arrays, step, self.spec.num_generations)
                    done.append(step)
        return done

    def output(self, step: int) -> tuple:
        return self.finished.pop(step)

    def close(self) -> None:
        for link in self.alive:
            try:
                wire.send(link.sock, "close")
            except OSError:
                pass
            link.sock.close()
            link.alive = False

    # ------------------------------------------------------------------ the workers
    def _push(self, params, version: int) -> None:
        host = weights.host_copy(params, self.dtype)  # one copy for every worker
        self._exchange(self.alive, "weights", {"version": int(version)}, host)
        self.version = version

    def _assign(self, step: int) -> None:
        """Gives `step` to the alive worker holding fewest steps (another if it dies)."""
        alive = self.alive
        if not alive:
            lost = ", ".join(k.address for k in self.links)
            raise wire.WorkerError(f"every rollout worker is gone ({lost})")
        link = min(alive, key=lambda k: len(k.steps))
        link.steps.add(step)  # before sending: a death while sending requeues it
        ids, mask, key = self.queued[step]
        fields = {"step": int(step), "key": key}
        self._exchange([link], "submit", fields, {"prompt_ids": ids, "prompt_mask": mask})

    def _exchange(self, links, kind: str, fields=None, arrays=None) -> list:
        """The request sent to each of `links`, then each answer read -> [(link, (fields,
        arrays))] of the workers that answered; a broken connection is a lost worker."""
        sent = []
        for link in links:
            try:
                wire.send(link.sock, kind, fields, arrays)
                sent.append(link)
            except OSError:
                self._lost(link)
        answers = []
        for link in sent:
            if not link.alive:
                continue
            try:
                _, got_fields, got_arrays = wire.recv(link.sock)
            except (wire.Closed, OSError):
                self._lost(link)
                continue
            answers.append((link, (got_fields, got_arrays)))
        # Every answer is read before a lost worker's steps go out: a submit now would
        # read another request's answer.
        while self.orphans:
            self._assign(self.orphans.pop(0))
        return answers

    def _lost(self, link: _Link) -> None:
        """`link`'s worker is gone: its steps go to the others (once the exchange in
        progress has its answers)."""
        if not link.alive:
            return
        link.alive = False
        link.sock.close()
        self.stats["workers_lost"] += 1
        self.stats["requeued"] += len(link.steps)
        self.orphans += sorted(link.steps)
        link.steps = set()


def _output(arrays: dict, step: int, num_generations: int) -> tuple:
    """The step's (SampleOutput, token_versions) from a `run` answer's arrays."""
    prefix = f"{step}/"
    got = {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
    token_versions = got.pop("token_versions")
    return SampleOutput(**got, num_generations=num_generations), token_versions


def rollout_workers(c, pad_id: int):
    """The rollout worker processes of `rollout.workers` (None for 0): their addresses,
    the token from the environment, and the engine settings they must share; the weights
    cross in the model's dtype, so the workers sample what a rollout mesh here would."""
    if not c.rollout.workers:
        return None
    token = os.environ.get(wire.TOKEN_ENV, "")
    if not token:
        raise UserError(
            wire.TOKEN_ENV,
            f"not set, and rollout.workers={c.rollout.workers}",
            "export the shared secret the workers were started with",
        )
    addresses = tuple(a.strip() for a in c.rollout.worker_addresses.split(",") if a.strip())
    return Workers(addresses, token, pad_id=pad_id, seed=c.train.seed, dtype=c.model.dtype)


SESSIONS[Workers] = {"stream": RemoteStream}  # open_session(workers, "stream", ...)
