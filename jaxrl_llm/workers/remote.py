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
parameters cast to bfloat16). LoRA parameters (base + adapters): each sync sends the
adapters alone, the frozen base once per worker connection, and the worker merges them
(`weights.Merger`; `Workers.lora` names rank, alpha and targets).

The connections, the weights the workers hold and who joins or leaves are a `fleet.Fleet`
of the stream's own. Losing a worker (`Fleet.lost`: its connection broke, or it was
silent for `Workers.timeout_s` while it owed an answer) takes it out of the set; the
steps it held and had not returned are submitted again, whole, to the others
(`stats['requeued']`), which hold the newest weights, so their rows are drawn once more
from the start, and by the newest version. A step is returned once: only by the worker it
is assigned to now. When no worker is left, `WorkerError`. A worker's own error (an
`error` frame) is raised as is.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from jaxrl_llm import config as config_lib
from jaxrl_llm.errors import UserError
from jaxrl_llm.sampling.decode import SampleOutput
from jaxrl_llm.sampling.engine import SESSIONS
from jaxrl_llm.workers import wire
from jaxrl_llm.workers.fleet import Fleet, Workers

__all__ = ["RemoteStream", "Workers", "rollout_workers"]


class RemoteStream:
    """`StepStream` over `workers` (a `Workers`); args as `StaticStream`'s."""

    def __init__(self, workers: Workers, params, version: int, spec, *, chunk: int = 0):
        self.spec, self.detail = spec, "remote"
        opened = dict(kind="stream", spec=dataclasses.asdict(spec), chunk=chunk)
        self.fleet = Fleet(workers, opened, reassign=self._assign)
        self.queued: dict = {}  # step -> (prompt_ids, prompt_mask, key): not returned yet
        self.finished: dict = {}  # step -> (output, token_versions)
        self.stats = self.fleet.stats  # the workers' counters, and the stream's
        self.stats.update(decode_chunks=0, swaps=0)
        self.fleet.connect()
        try:
            self.fleet.push(params, version)
        except BaseException:  # the connections closed, as `Fleet.connect`'s on a refusal
            self.fleet.close()
            raise

    busy = property(lambda self: bool(self.queued))
    in_flight = property(lambda self: any(k.in_flight for k in self.fleet.alive))
    version = property(lambda self: self.fleet.version)
    links = property(lambda self: self.fleet.links)
    host = property(lambda self: self.fleet.host, doc="The last sync's host copy.")

    def submit(self, step: int, prompt_ids, prompt_mask, key: int) -> None:
        self.fleet.refresh()  # between steps: who joined, who left, who is back
        self.queued[step] = (np.asarray(prompt_ids), np.asarray(prompt_mask), int(key))
        self._assign(step)

    def swap(self, params, version: int) -> None:
        """Every worker samples on with `params` (as its own session's swap)."""
        self.fleet.push(params, version)
        self.stats["swaps"] += 1

    def run_chunk(self) -> list:
        """One chunk on every worker holding steps (sent to all, then answered) -> the
        steps returned, each once."""
        fleet = self.fleet
        self.stats["decode_chunks"] += 1
        done = []
        for link, (fields, arrays) in fleet.exchange([k for k in fleet.alive if k.steps], "run"):
            link.in_flight, self.detail = fields["in_flight"], fields["detail"]
            for step in fields["steps"]:
                if step in link.steps:  # else it was taken from this worker: not twice
                    link.steps.discard(step)
                    self.queued.pop(step)
                    self.finished[step] = _output(arrays, step, self.spec.num_generations)
                    done.append(step)
        for link in fleet.alive:
            if link.leaving and not link.steps:
                fleet.close_link(link)
        return done

    def output(self, step: int) -> tuple:
        return self.finished.pop(step)

    def close(self) -> None:
        self.fleet.close()

    def _assign(self, step: int) -> None:
        """Gives `step` to the worker `Fleet.pick` names; another if it dies."""
        link = self.fleet.pick()
        link.steps.add(step)  # before sending: a death while sending requeues it
        ids, mask, key = self.queued[step]
        fields = {"step": int(step), "key": key}
        self.fleet.exchange([link], "submit", fields, {"prompt_ids": ids, "prompt_mask": mask})


def _output(arrays: dict, step: int, num_generations: int) -> tuple:
    """The step's (SampleOutput, token_versions) from a `run` answer's arrays."""
    prefix = f"{step}/"
    got = {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
    token_versions = got.pop("token_versions")
    return SampleOutput(**got, num_generations=num_generations), token_versions


def rollout_workers(c, pad_id: int):
    """The rollout worker processes of `rollout.workers` (None for 0): their addresses (or
    the file that lists them, `@path`), the token from the environment, and the engine
    settings they must share; the weights cross in the model's dtype, so the workers
    sample what a rollout mesh here would."""
    if not c.rollout.workers:
        return None
    token = os.environ.get(wire.TOKEN_ENV, "")
    if not token:
        raise UserError(
            wire.TOKEN_ENV,
            f"not set, and rollout.workers={c.rollout.workers}",
            "export the shared secret the workers were started with",
        )
    given = c.rollout.worker_addresses
    listed = given[1:] if given.startswith("@") else None  # a file, read between steps
    addresses = () if listed else tuple(a.strip() for a in given.split(",") if a.strip())
    return Workers(
        addresses,
        token,
        pad_id=pad_id,
        seed=c.train.seed,
        dtype=c.model.dtype,
        timeout_s=float(c.rollout.get("worker_timeout_s", 600.0)),
        connect_timeout_s=float(c.rollout.get("worker_start_s", 60.0)),
        retry_s=float(c.rollout.get("worker_retry_s", 30.0)),
        tls_ca=c.rollout.get("worker_tls_ca") or None,
        sync=c.rollout.get("worker_sync", "host"),
        lora=config_lib.lora_config(c),
        addresses_file=listed,
        min_workers=c.rollout.workers,
    )


SESSIONS[Workers] = {"stream": RemoteStream}  # open_session(workers, "stream", ...)
