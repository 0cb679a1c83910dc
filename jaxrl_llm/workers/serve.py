"""A rollout worker: its own JAX world (process, devices, mesh) serving a stream session
(`sampling.engine.StepStream`) or multi-turn rows (`TurnRows`, `workers.turns`) to a
trainer over TCP.

    JAXRL_WORKER_TOKEN=<secret> python -m jaxrl_llm.workers.serve \
        --config=configs/quickstart.py --port=7070 [--host=0.0.0.0] [--config.KEY=VALUE ...]

The config is the trainer's: it names the model (its shapes only: the weights come from
the trainer), the worker's mesh (`mesh.rollout`, the rollout mesh's shape, over this
process's devices) and its engine (`rollout.engine`, `rollout.paged.*`, `train.seed`,
`rollout.bucket_steps`); the trainer (`workers.remote.RemoteStream`) sends the rest. It
is checked as a synchronous run's on this process's devices with that mesh
(`worker_config`), so its rollout batch must split over it. Requests, one frame each
(`wire`), answered in order:

- `open` (kind, spec, chunk, pad_id, seed): builds the engine (once per pad id) and
  answers what it is (row_keys, prompt_multiple); kind 'stream' (default): a new session
  opens with the next weights; kind 'turns': the `turns`, `turn_run` and `turn_output`
  requests (`serve_turns.handle`) play a part of a step's rows on a turns session of the
  weights held (a swap reaches it).
- `weights` (version; every parameter as an array, `weights`): placed on the mesh, the
  session's `swap` (or its opening). Transfer sync (`open` with sync 'transfer', answered
  with the devices' `slices`): the frame carries the trainer's transfer address and a uuid
  per process instead, and each process pulls its shards (`transfer.Puller`). LoRA:
  part 'base' (the frozen base, once per connection: kept), then part 'adapters' each
  sync (lora, dtype): merged into the base on this worker's devices (`weights.Merger`),
  then as above.
- `submit` (step, key; prompt_ids, prompt_mask): the session's `submit`.
- `run`: one `run_chunk` when busy -> the steps finished, each `SampleOutput` field and
  the token_versions as arrays `<step>/<field>`, and the session's version, busy,
  in_flight, detail, stats.
- `close`: ends the connection.

A worker may be several processes, one JAX world (`JAXRL_DISTRIBUTED=1` on each, as a
multi-host run): process 0 listens and answers, and shares each request with the others,
which run it too (`follow`). The static engine takes each process's part of a step's
prompts; the paged engine's host state is replicated, each process running the whole
batch (`serve_turns.own_rows`; docs/workers.md#a-worker-of-several-hosts).

One trainer connection at a time, authorized by the shared secret in `JAXRL_WORKER_TOKEN`
(`wire.authorize`); a new connection starts a new session, and the session ends with its
connection, however that ends (closed, broken when an answer is sent, or its host silent
past `KEEPALIVE`), so a trainer started again finds the worker free. The engines, and the
programs they compiled, stay for the next trainer. An exception in a request is answered
with one `error` frame and the worker goes on.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import select
import socket
import sys

import jax
import numpy as np

from jaxrl_llm import config as config_lib
from jaxrl_llm import parallel, sampling
from jaxrl_llm.config import model_shapes
from jaxrl_llm.config.checks_rollout import check_worker_processes
from jaxrl_llm.errors import UserError
from jaxrl_llm.parallel import distributed
from jaxrl_llm.rollout.sources import make_sampler
from jaxrl_llm.sampling.engine import open_session
from jaxrl_llm.workers import serve_turns, transfer, weights, wire

HELLO_TIMEOUT_S = 10.0  # a connection that does not say hello by then is dropped
# A trainer whose host vanished (no FIN, no RST reaches the worker) would hold the worker
# in a read forever (or, with an answer not yet acknowledged, in TCP's retransmissions
# for many minutes), and a restarted trainer would wait behind it. TCP keep-alive probes
# the idle connection, and TCP_USER_TIMEOUT bounds how long sent bytes may go
# unacknowledged: the connection breaks after idle + interval * probes seconds without a
# word from the trainer's host (Linux; other systems keep their defaults). A trainer that
# is alive answers the probes and acknowledges from its kernel, however long it sends
# nothing; an answer it leaves unread until it fills the socket buffers counts as silence
# too (Linux counts a full receive window against TCP_USER_TIMEOUT), so the trainer reads
# every worker's answer as it comes (`fleet._read_answers`). (seconds idle before the
# first probe, between probes, probes)
KEEPALIVE = (20, 5, 4)  # 40 s: within the 60 s a restarted trainer waits for a worker
# A worker of several processes: while process 0 waits (for a trainer, or its next
# request) it tells the others so this often, so that none waits in a collective for long.
IDLE_S = 5.0


class Worker:
    """The engine and its stream session behind one trainer connection."""

    def __init__(self, raw_config, devices=None):
        # Checked as a run's config is, with the speed settings the trainer picks too.
        # Every process gets every request (`follow`): checked as one process's config.
        prepared = config_lib.prepare(worker_config(raw_config), devices, process_count=1)
        self.config = config = prepared.config
        check_worker_processes(config, jax.process_count())
        self.cfg = model_shapes.model_config(config)  # shapes only: the weights come later
        self.mesh = parallel.make_mesh(config_lib.mesh_axes(config.mesh), devices)
        self.engines: dict = {}  # pad id -> engine
        self.merger = weights.Merger(self.cfg, self.mesh)  # LoRA: base + adapters
        self.puller = None  # transfer sync: `transfer.Puller`, from the first that asks
        self.reset()

    def reset(self) -> None:
        self.engine, self.spec, self.chunk, self.session = None, None, 0, None
        self.kind, self.params, self.version, self.turns = "stream", None, None, None
        self.merger.base = None  # LoRA: each trainer sends its base again
        self.own, self.known = (0, 0), {}  # a turns session's (`serve_turns.handle`)

    def handle(self, kind: str, fields: dict, arrays: dict) -> tuple[dict, dict]:
        """One request -> the reply's (fields, arrays)."""
        if kind == "open":
            return self._open(fields), {}
        if self.engine is None:
            raise wire.WorkerError(f"{kind!r} before 'open'")
        if kind == "weights":
            part = fields.get("part")
            if part == "base":
                self.merger.set_base(arrays)
                return {}, {}
            if part == "adapters":
                params = self.merger.merge(arrays, fields["lora"], fields["dtype"])
            elif "uuids" in fields:
                params = self._pull(fields)
            else:
                params = weights.place(arrays, self.cfg, self.mesh)
            self.params, self.version = params, fields["version"]
            if self.kind == "turns":
                if self.turns is not None:  # partial rollouts: the rows draw on with them
                    self.turns.swap(params, self.version)
            elif self.session is None:
                self.session = open_session(
                    self.engine, "stream", params, self.version, self.spec, chunk=self.chunk
                )
            else:
                self.session.swap(params, self.version)
            return {"version": fields["version"]}, {}
        if self.params is None:
            raise wire.WorkerError(f"{kind!r} before the first weights")
        if kind in serve_turns.REQUESTS:
            if self.kind != "turns":
                raise wire.WorkerError(f"{kind!r} on a {self.kind!r} connection")
            self.turns, answer = serve_turns.handle(self, kind, fields, arrays)
            return answer
        if self.kind != "stream":
            raise wire.WorkerError(f"{kind!r} on a {self.kind!r} connection")
        if kind == "submit":
            own = functools.partial(serve_turns.own_rows, self.engine)
            ids, mask = own(arrays["prompt_ids"]), own(arrays["prompt_mask"])
            self.session.submit(fields["step"], ids, mask, fields["key"])
            return {}, {}
        if kind == "run":
            return self._run()
        raise wire.WorkerError(f"unknown request {kind!r}")

    def _open(self, fields: dict) -> dict:
        seed = self.config.train.seed
        if fields["seed"] != seed:
            raise wire.WorkerError(
                f"train.seed: the trainer samples with {fields['seed']}, this worker's "
                f"config has {seed}; start the worker with the trainer's config"
            )
        pad = int(fields["pad_id"])
        if pad not in self.engines:
            self.engines[pad] = make_sampler(self.config, self.cfg, self.mesh, pad)
        self.engine, self.session, self.turns = self.engines[pad], None, None
        self.kind = fields.get("kind", "stream")
        if self.kind == "stream":
            self.spec = sampling.RolloutSpec(**fields["spec"])
            self.chunk = int(fields["chunk"])
        engine = self.engine
        answer = dict(
            devices=len(self.mesh.devices.flat),
            engine=type(engine).__name__,
            row_keys=bool(engine.row_keys),
            # a batch splits over the engine's mesh, and over the processes (`own_rows`)
            prompt_multiple=math.lcm(int(engine.prompt_multiple), serve_turns.processes(engine)),
        )
        if fields.get("sync") == "transfer":  # where each device's shards go
            if self.puller is None:
                self.puller = transfer.Puller(self.cfg, self.mesh)
            answer["slices"] = self.puller.layout
        return answer

    def _pull(self, fields: dict) -> dict:
        """A transfer sync: this process's shards pulled from the trainer's devices, then
        a barrier, so that process 0 answers once every process holds them."""
        if self.puller is None:
            raise wire.WorkerError("a transfer sync on a connection not opened for one")
        params = jax.block_until_ready(self.puller.pull(fields))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("weights pulled")
        return params

    def _run(self) -> tuple[dict, dict]:
        s = self.session
        steps = s.run_chunk() if s.busy else []
        arrays = {}
        for step in steps:
            out, token_versions = s.output(step)
            for f in dataclasses.fields(out):
                value = getattr(out, f.name)
                if value is not None and f.name != "num_generations":
                    arrays[f"{step}/{f.name}"] = parallel.to_host(value)
            arrays[f"{step}/token_versions"] = np.asarray(token_versions, np.int32)
        stats = {k: v for k, v in s.stats.items() if isinstance(v, int | float)}
        fields = dict(
            steps=[int(x) for x in steps],
            version=int(s.version),
            busy=bool(s.busy),
            in_flight=bool(s.in_flight),
            detail=s.detail,
            stats=stats,
        )
        return fields, arrays


def worker_config(config):
    """The trainer's config as this worker's world sees it: a synchronous run whose mesh is
    the rollout mesh's shape (`mesh.rollout`) over the worker's devices."""
    c = copy.deepcopy(config)
    with c.unlocked():
        c.mesh.update(config_lib.mesh_axes(c.mesh.rollout))
        c.mesh.rollout_devices = 0
        c.rollout.mode, c.rollout.partial, c.rollout.workers = "sync", False, 0
    return c


def serve(worker: Worker, listener: socket.socket, token: str, tls=None) -> None:
    """Answers trainer connections one after another, forever; one line each when a
    trainer connects and when it goes (with the steps sampled for it). tls: a
    `wire.server_context`, every connection then encrypted. In a worker of several
    processes this is process 0's loop; the others `follow` it."""
    while True:
        _wait_readable(listener)
        conn, peer = listener.accept()
        conn.settimeout(HELLO_TIMEOUT_S)  # the TLS handshake and the hello
        if tls is not None and (conn := wire.accept_tls(conn, tls)) is None:
            continue
        with conn:
            try:
                if not wire.authorize(conn, token):
                    continue
            except OSError:
                continue
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keep_alive(conn)
            peer = "{}:{}".format(*peer[:2])
            print(f"trainer {peer} connected", flush=True)
            try:
                sampled = _answer(worker, conn)
                print(f"trainer {peer} gone: {sampled} steps sampled", flush=True)
            finally:
                parallel.share(("reset", {}, {}))
                worker.reset()  # the session goes with its trainer (a paged one's cache too)


def _keep_alive(conn: socket.socket) -> None:
    """KEEPALIVE on `conn`: it breaks when the trainer's host stops answering."""
    idle, interval, probes = KEEPALIVE
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    options = {
        "TCP_KEEPIDLE": idle,
        "TCP_KEEPINTVL": interval,
        "TCP_KEEPCNT": probes,
        "TCP_USER_TIMEOUT": 1000 * (idle + interval * probes),  # milliseconds
    }
    for name, value in options.items():
        if hasattr(socket, name):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _answer(worker: Worker, conn: socket.socket) -> int:
    """Answers one trainer's requests until it closes or its connection breaks: a trainer
    killed while a request runs (say a chunk it asked for) is found gone when the answer
    is sent, one whose host vanished when the keep-alive probes go unanswered, and the
    worker waits for the next trainer as after a close. -> the steps it returned."""
    sampled = 0
    while True:
        try:
            _wait_readable(conn)
            kind, fields, arrays = wire.recv(conn)
        except (wire.WorkerError, ValueError, OSError):  # closed, broken, or not a frame
            return sampled  # the trainer went away: wait for the next one
        if kind == "close":
            reply, answer = ({}, {}), "ok"
        else:
            parallel.share((kind, fields, arrays))  # the worker's other processes run it too
            try:
                reply, answer = worker.handle(kind, fields, arrays), "ok"
                sampled += len(reply[0].get("steps", ()))  # 'run', 'turn_output
            except Exception as err:  # noqa: BLE001  (answered: the trainer raises it)
                reply, answer = ({"message": f"{type(err).__name__}: {err}"}, {}), "error"
        try:
            wire.send(conn, answer, *reply)
        except OSError:
            return sampled  # the trainer died while it waited for this answer
        if kind == "close":
            return sampled


def follow(worker: Worker) -> None:
    """Processes 1.. of a worker of several processes, forever: each request process 0
    shares (`parallel.share`) handled as process 0 handles it, since the engine's programs span
    every process's devices and each process runs each of them; process 0 answers."""
    while True:
        kind, fields, arrays = parallel.share(None)
        if kind == "reset":
            worker.reset()
        elif kind != "idle":
            try:
                worker.handle(kind, fields, arrays)
            except Exception as err:  # noqa: BLE001  (process 0 answers it: the same error)
                print(f"process {jax.process_index()}: {kind}: {err!r}", file=sys.stderr)


def _wait_readable(sock: socket.socket) -> None:
    """Returns once `sock` has something to read (a trainer connecting, a request); in a
    worker of several processes the others are told 'idle' every IDLE_S meanwhile."""
    if jax.process_count() > 1 and not getattr(sock, "pending", lambda: 0)():  # TLS-buffered
        while not select.select([sock], [], [], IDLE_S)[0]:
            parallel.share(("idle", {}, {}))


def main(argv) -> None:
    from absl import flags

    del argv
    token = os.environ.get(wire.TOKEN_ENV, "")
    if not token:
        raise UserError(
            wire.TOKEN_ENV, "not set", "export the shared secret the trainer's workers use"
        )
    cert, key = flags.FLAGS.tls_cert, flags.FLAGS.tls_key
    if bool(cert) != bool(key):
        raise UserError("--tls_cert / --tls_key", "give both (PEM files) or neither")
    tls = wire.server_context(cert, key) if cert else None  # checked before the model loads
    distributed.initialize()  # a worker of several processes (JAXRL_DISTRIBUTED=1)
    config = flags.FLAGS.config
    worker = Worker(config)
    if jax.process_index() > 0:
        follow(worker)  # process 0 listens and answers; the others run what it runs
    listener = wire.listen(flags.FLAGS.host, flags.FLAGS.port)
    host, port = listener.getsockname()[:2]
    print(f"worker listening{' with TLS' if tls else ''} on {host}:{port}", flush=True)
    serve(worker, listener, token, tls)


if __name__ == "__main__":
    from absl import flags

    from jaxrl_llm.errors import config_command

    flags.DEFINE_string("host", "127.0.0.1", "address to listen on (0.0.0.0: every one)")
    flags.DEFINE_integer("port", 0, "port to listen on (0: a free one, printed)")
    flags.DEFINE_string("tls_cert", "", "PEM certificate chain: serve over TLS (with --tls_key)")
    flags.DEFINE_string("tls_key", "", "PEM private key of --tls_cert")
    sys.exit(
        config_command(
            main,
            "configs/<experiment>.py: the model, mesh and engine of this worker",
            "unused by a worker",
            workdir_required=False,
        )
    )
