"""`Fleet`: the trainer's connections to its rollout workers (each its own JAX world,
`workers.serve`) and the weights they hold. The sessions over them give the workers their
rows: `remote.RemoteStream` (single-turn steps) and `turns.RemoteTurns` (multi-turn rows).

    fleet = Fleet(workers, {"kind": "stream", ...})  # `Workers`; the 'open' request's fields
    fleet.connect()                        # every worker given (or listed) that answers
    fleet.push(params, version)            # one copy, to every worker (`weights`, `transfer`)
    answers = fleet.exchange(links, kind, fields, arrays)   # one request each, in parallel
    answers = fleet.exchange_each([(link, fields, arrays), ...], kind)   # each its own
    fleet.refresh()                        # between steps: who joined, who left, who is back

Losing a worker: a connection that breaks (the process killed, the host gone), or that
stays silent for `Workers.timeout_s` (`rollout.worker_timeout_s`: the process stopped,
the host hung) while a request is sent or answered, takes the worker out of the fleet
(`lost`); what the session gave it (`_Link.steps`) goes to the session's `reassign` once
the exchange in progress has every answer (`stats['requeued']` counts it).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time

from jaxrl_llm.errors import UserError
from jaxrl_llm.workers import weights, wire


@dataclasses.dataclass(frozen=True)
class Workers:
    """Rollout workers as an engine for `sampling.open_session` ('stream': a
    `RemoteStream` with a fleet of its own): their host:port addresses, the shared token,
    the pad id and seed their engines sample with (a worker refuses another seed), and the
    dtype the weights cross the wire in (`weights.host_copy`; None: each parameter's
    own)."""

    addresses: tuple
    token: str = dataclasses.field(repr=False)
    pad_id: int = 0
    seed: int = 0
    dtype: str | None = "bfloat16"
    connect_timeout_s: float = 60.0
    timeout_s: float = 600.0  # silence while an answer is owed -> the worker is dropped
    # A file of addresses instead (`rollout.worker_addresses=@path`), read again before
    # each step is given out: an address added joins, one removed leaves once its steps
    # are back. `addresses` is then ignored. The opening waits up to connect_timeout_s
    # (`rollout.worker_start_s`) for every address given (from a file: `min_workers` of
    # those listed), then opens with those that answered (`Fleet._first_connections`).
    addresses_file: str | None = None
    min_workers: int = 1
    # A lost worker, or a listed one that did not answer, is tried again this long after
    # (`rollout.worker_retry_s`), before a step is given out.
    retry_s: float = 30.0
    # TLS (`rollout.worker_tls_ca`): the PEM file the workers' certificates must chain to;
    # None: plain TCP.
    tls_ca: str | None = None
    # LoRA (`model.lora`): the adapters the workers merge into the base (a
    # `models.LoraConfig`); None: the parameters sent are the plain model's.
    lora: object = None
    # How the weights reach the workers (`rollout.worker_sync`): 'host' (`weights`: one
    # host copy, sent over each link) or 'transfer' (`transfer`: each worker process
    # pulls its shards from this process's devices; the link carries the uuids).
    sync: str = "host"


JOIN_TIMEOUT_S = 5.0  # the connection to a joining worker (the rollout waits for it)


@dataclasses.dataclass(eq=False)
class _Link:
    """One worker's connection and what its session holds there."""

    address: str
    sock: object
    steps: set = dataclasses.field(default_factory=set)
    last: int = -1  # when it was last given work (`Fleet.pick`); -1: never
    in_flight: bool = False
    alive: bool = True
    leaving: bool = False  # no longer listed: takes no new work, closed once it holds none
    has_base: bool = False  # LoRA: holds the base weights (sent once per connection)
    layout: dict | None = None  # transfer sync: its devices' slices (`transfer.slices`)
    # What its 'open' answer says of its engine (`_opened`): whether each row draws with
    # its own key, and what a batch's prompts must be a multiple of.
    row_keys: bool = False
    prompt_multiple: int = 1


class Fleet:
    """Connections to `workers` (a `Workers`), each opened with the 'open' request's
    `opened` fields (the session kind and its settings; the pad id and seed are added),
    and the version of the weights they hold. `reassign(item)` takes each item a lost
    worker held (`_Link.steps`) once the exchange in progress has every answer."""

    def __init__(self, workers: Workers, opened: dict, reassign=None):
        w = workers
        self.workers, self.dtype, self.reassign = w, w.dtype, reassign
        self.opened = opened | dict(pad_id=w.pad_id, seed=w.seed, sync=w.sync)
        self.offer = None  # transfer sync: the server the workers pull from (`transfer.Offer`)
        self.tls = wire.client_context(w.tls_ca) if w.tls_ca else None
        self.file_seen, self.tried = None, {}  # the file's (mtime, size); address -> when
        self.links: list = []
        self.orphans: list = []  # what lost workers held, not reassigned yet
        self.given = 0  # work given out (each link's `last` counts from it)
        # The last sync's copy (a `weights.Host`; transfer: the cast arrays on this
        # process's devices) and its version: kept for a worker that joins.
        self.host, self.version = None, None
        self.stats = {
            "requeued": 0,
            "workers_lost": 0,
            "workers_timed_out": 0,
            "workers_joined": 0,
            "workers": 0,
        }

    alive = property(lambda self: [k for k in self.links if k.alive])

    def connect(self) -> None:
        """Opens the first connections (`_first_connections`). A worker that refuses the
        session (another seed, say) raises its `WorkerError` here, every connection closed
        first: a worker serves one trainer at a time, and one left open would keep it
        from the next trainer until the socket is collected."""
        self.links = [_Link(a, sock) for a, sock in self._first_connections()]
        self.stats["workers"] = len(self.links)
        try:
            self._opened(self.exchange(self.links, "open", self.opened))
        except BaseException:
            self.close()
            raise

    def pick(self) -> _Link:
        """The alive worker holding least, of those the one given work least recently (a
        worker that joins takes the next; one item at a time goes round the workers)."""
        return self.spread(1)[0]

    def spread(self, n: int) -> list:
        """Up to `n` alive workers (at least one), in `pick`'s order: what one item's parts
        go to (`turns.RemoteTurns`)."""
        alive = [k for k in self.alive if not k.leaving] or self.alive
        if not alive:
            lost = ", ".join(k.address for k in self.links)
            raise wire.WorkerError(f"every rollout worker is gone ({lost})")
        links = sorted(alive, key=lambda k: (len(k.steps), k.last))[: max(1, n)]
        for link in links:
            link.last, self.given = self.given, self.given + 1
        return links

    def push(self, params, version: int) -> None:
        """`params` to every worker, as version `version`. `stats['weight_sync_s']`: how
        long it took (the copy, the sends, every worker's placement and answer);
        `stats['weight_sync_gb']`: what each worker received (LoRA: the adapters)."""
        start = time.perf_counter()
        if self.workers.sync == "transfer":
            host = self._transfer_copy(params)
        else:
            base = self.host.base if self.host is not None else None  # LoRA: copied once
            host = weights.host_copy(params, self.dtype, base)  # one copy for every worker
        self._send_weights(self.alive, host, version)
        self.host, self.version = host, version
        self.stats["weight_sync_s"] = round(time.perf_counter() - start, 4)
        self.stats["weight_sync_gb"] = round(sum(x.nbytes for x in host.values()) / 1e9, 6)

    def close(self) -> None:
        for link in self.alive:
            self.close_link(link)

    def close_link(self, link: _Link) -> None:
        try:
            wire.send(link.sock, "close")
        except OSError:
            pass
        link.sock.close()
        link.alive = False
        self.stats["workers"] = len(self.alive)

    def exchange(self, links, kind: str, fields=None, arrays=None) -> list:
        """The request sent to each of `links`, then each answer read -> [(link, (fields,
        arrays))] of the workers that answered; a broken connection is a lost worker."""
        return self.exchange_each([(link, fields, arrays) for link in links], kind)

    def exchange_each(self, requests, kind: str) -> list:
        """`exchange` with each worker's own request: [(link, fields, arrays)]."""
        sent = []
        for link, fields, arrays in requests:
            try:
                wire.send(link.sock, kind, fields, arrays)
                sent.append(link)
            except OSError as err:
                self.lost(link, err)
        answers = []
        sent = [k for k in sent if k.alive]
        for link, got in zip(sent, _read_answers([k.sock for k in sent]), strict=True):
            if isinstance(got, Exception):
                self.lost(link, got)
                continue
            answers.append((link, got[1:]))
        # Every answer is read before a lost worker's work goes out: a request sent now
        # would read another request's answer.
        while self.orphans:
            item = self.orphans.pop(0)
            if self.reassign is not None:
                self.reassign(item)
        return answers

    def lost(self, link: _Link, err: Exception | None = None) -> None:
        """`link`'s worker is gone (its connection broke, or it was silent for `timeout_s`
        while it owed an answer: a frame cut short cannot be resumed, so a silent worker is
        dropped as a dead one): what it held goes to `reassign` (once the exchange in
        progress has its answers)."""
        if not link.alive:
            return
        link.alive = False
        link.sock.close()
        self.stats["workers_lost"] += 1
        self.stats["workers_timed_out"] += isinstance(err, TimeoutError)
        self.stats["workers"] = len(self.alive)
        self.tried[link.address] = time.monotonic()  # listed in a file: tried again later
        self.stats["requeued"] += len(link.steps)
        self.orphans += sorted(link.steps)
        link.steps = set()

    def refresh(self) -> None:
        """Workers newly listed in the file join (connected, opened, given the weights the
        others hold); workers no longer listed leave (no new work; closed once they hold
        none). A listed (or given) worker that does not answer, or was lost, is tried
        again after `retry_s`: restarted at its address, it joins anew."""
        path, seen, retry_s = self.workers.addresses_file, None, self.workers.retry_s
        try:
            st = os.stat(path) if path else None
            seen = st and (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            pass
        now = time.monotonic()
        retry = any(now - t >= retry_s for t in self.tried.values())
        if seen == self.file_seen and not retry:
            return
        self.file_seen = seen
        listed = self._listed()
        for link in self.alive:
            link.leaving = link.address not in listed
        here = {k.address for k in self.alive}
        for a in listed:
            if a in here or (a in self.tried and now - self.tried[a] < retry_s):
                continue
            try:
                link = _Link(a, self._connect(a, JOIN_TIMEOUT_S))
            except OSError:
                self.tried[a] = now
                continue
            self.tried.pop(a, None)
            self.links.append(link)
            self._opened(self.exchange([link], "open", self.opened))
            if self.host is not None:
                self._send_weights([link], self.host, self.version)
            if link.alive:
                self.stats["workers_joined"] += 1
        self.stats["workers"] = len(self.alive)

    def _opened(self, answers) -> None:
        """What the workers' 'open' answers say of their engines."""
        for link, (fields, _) in answers:
            link.row_keys = bool(fields.get("row_keys"))
            link.prompt_multiple = int(fields.get("prompt_multiple", 1))
            link.layout = fields.get("slices")
            if self.workers.sync == "transfer" and link.layout is None:
                raise wire.WorkerError(
                    f"worker {link.address} does not serve rollout.worker_sync='transfer'"
                )

    # ------------------------------------------------------------------ connections
    def _connect(self, address: str, timeout_s: float, hello_s: float | None = None):
        """An authorized connection (within `timeout_s`; its hello answered within
        `hello_s`, default the same) whose reads and writes give up after
        `Workers.timeout_s` of silence (socket.timeout, an OSError: the worker is then
        lost)."""
        sock = wire.connect(address, self.workers.token, timeout_s, hello_s, self.tls)
        sock.settimeout(self.workers.timeout_s)
        return sock

    def _first_connections(self) -> list:
        """[(address, socket)] of the workers to open with. Every address listed (given, or
        in the file) is tried, again every 0.5 s while it cannot be reached (a worker still
        starting: refused, its name not in DNS yet), until all given answer (from a file:
        `min_workers` of those it lists), for up to connect_timeout_s. Then the run starts
        with those that answered, if any, and one warning names the others: they are tried
        again every `retry_s` as workers lost in the run are (`refresh`), so one that comes
        up joins. None answered: `WorkerError`."""
        w = self.workers
        deadline = time.monotonic() + w.connect_timeout_s
        got, errors = {}, {}
        while True:
            listed = self._listed()
            for a in listed:
                if a not in got:
                    try:  # a host that drops the SYN costs JOIN_TIMEOUT_S; a worker that
                        # accepted waits for its answer (still finishing an old trainer's
                        # chunk) up to the deadline
                        hello_s = max(1.0, deadline - time.monotonic())
                        got[a] = self._connect(a, JOIN_TIMEOUT_S, hello_s)
                    except OSError as err:
                        errors[a] = err
            want = w.min_workers if w.addresses_file else len(listed)
            if len(got) >= want or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        where = f" listed in {w.addresses_file}" if w.addresses_file else ""
        if not got:
            raise wire.WorkerError(
                f"none of the rollout workers{where} answered within "
                f"{w.connect_timeout_s:.0f} s: "
                + (", ".join(f"{a} ({errors.get(a)})" for a in listed) or "none listed")
            )
        missing = [a for a in listed if a not in got]
        if missing:
            logging.warning(
                "rollout workers %s did not answer within %.0f s: starting on %d of %d "
                "(rollout.workers=%d), trying them again every %.0f s",
                ", ".join(missing),
                w.connect_timeout_s,
                len(got),
                len(listed),
                w.min_workers,
                w.retry_s,
            )
            now = time.monotonic()
            self.tried.update((a, now) for a in missing)  # as if lost now: `refresh`
        return list(got.items())

    def _listed(self) -> list:
        """The addresses in the file (host:port, separated by commas or white space), or
        the ones given."""
        path = self.workers.addresses_file
        if not path:
            return list(self.workers.addresses)
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            return []
        except OSError as err:
            raise UserError("rollout.worker_addresses", f"cannot read {path}: {err}") from None
        listed = [a for a in text.replace(",", " ").split() if a]
        for a in listed:
            host, _, port = a.rpartition(":")
            if not host or not port.isdigit():
                raise UserError("rollout.worker_addresses", f"{path}: {a!r} is not host:port")
        return listed

    def _transfer_copy(self, params) -> dict:
        """A transfer sync's copy: `params` cast on this process's devices, the server
        they are offered from started at the first (on this host's address toward the
        first worker's)."""
        from jaxrl_llm.models import lora

        if isinstance(params, weights.Host) or lora.has_adapters(params):
            raise UserError(
                "rollout.worker_sync",
                "'transfer' sends whole weights from a trainer of one process: with LoRA, "
                "or from a trainer of several processes, use 'host'",
            )
        if self.offer is None:
            from jaxrl_llm.workers import transfer

            self.offer = transfer.Offer(toward=self.alive[0].sock.getpeername()[0])
        return self.offer.cast(params, self.dtype)

    def _send_weights(self, links, host, version: int) -> None:
        """`host` (a `weights.Host`; transfer: `_transfer_copy`'s) to each of `links`;
        LoRA: the base first to those that lack it, then the adapters. A transfer sync
        offers each link its slices; one that a lost worker left unpulled goes with the
        server, replaced then."""
        fields = {"version": int(version)}
        if self.workers.sync == "transfer":
            links = [k for k in links if k.alive]
            asked = [(k, fields | self.offer.offer(host, k.layout), None) for k in links]
            if len(self.exchange_each(asked, "weights")) < len(links):
                self.offer.reset()
            return
        if host.base is not None:
            if self.workers.lora is None:
                raise UserError("rollout.workers", "LoRA parameters, but Workers.lora is None")
            need = [k for k in links if k.alive and not k.has_base]
            for link, _ in self.exchange(need, "weights", {"part": "base"}, host.base):
                link.has_base = True
            lora = weights.lora_settings(self.workers.lora)
            fields |= {"part": "adapters", "lora": lora, "dtype": host.dtype}
        self.exchange([k for k in links if k.alive], "weights", fields, host)


def _read_answers(socks: list) -> list:
    """One answer frame read from each of `socks`, or the error that cut it short, read
    from all at once (a thread each). An answer left unread while another worker's is
    awaited fills the socket buffers; the worker's send then waits on a full window, which
    Linux counts against the worker's TCP_USER_TIMEOUT (`serve.KEEPALIVE`), and the
    worker would drop a trainer that is alive."""

    def read(sock):
        try:
            return wire.recv(sock)
        except (wire.Closed, OSError) as err:
            return err

    if len(socks) <= 1:
        return [read(s) for s in socks]
    with concurrent.futures.ThreadPoolExecutor(len(socks)) as pool:
        return list(pool.map(read, socks))
