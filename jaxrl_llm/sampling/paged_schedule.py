"""The paged engine's host side: a `Session` queues requests' rows, gives them slots and
pages between decode chunks, and collects what they drew.

    session = Session(engine, params, version, spec, seed_step=..., slots=S, pages=P, ...)
    session.submit(key, prompt_ids, prompt_mask, budgets, key_base)   # a batch of prompts
    while session.busy:
        for key in session.run_chunk():        # one decode chunk; requests that finished
            drawn, logprobs, stopped, versions, token_versions = session.pop(key)
    session.swap(new_params, new_version)      # newer parameters between chunks

`PagedSampler.sample` is one request run to the end; a streaming source keeps one session
across training steps (the next steps' prompts queue behind the current ones, so the slots
stay full) and swaps parameters in as the learner publishes them. A swap either waits for
the slots to empty (the caller's choice: every row then has one version) or, for partial
rollouts, preempts every row in flight and drops the prompts' pages: each row comes back
with its prompt and tokens so far prefilled by the new parameters (the recompute path of
preemption) and draws on with them. Each drawn token records the version that drew it.

Row r of a request submitted with key_base k draws with key
fold_in(fold_in(fold_in(key(seed), salt), k + r), t) for its t-th token (seed_step =
(seed, salt)), whatever slot, chunk, neighbours or parameters it had.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxrl_llm.sampling.paged_pool import NULL_PAGE, PagePool


@dataclasses.dataclass
class _Request:
    """A submitted batch: its prompts (bucketed), G, per-row budgets and results."""

    ids: np.ndarray
    mask: np.ndarray
    G: int
    budgets: np.ndarray
    key_base: int
    drawn: list
    logprobs: list
    versions: list  # per row: the version of each drawn token
    started: np.ndarray  # per row: the version that started it (-1: not yet)
    stopped: np.ndarray
    left: int  # rows not ended
    routes: list  # MoE: per row, its drawn tokens' recorded routes [n, L, k] (None: not yet)
    prompt_routes: dict  # MoE: prompt b -> its real tokens' routes [p, L, k] (first prefill)


@dataclasses.dataclass
class _Row:
    """A row waiting for a slot: its request and index, and the tokens / log-probs /
    versions it drew before it was preempted (none for a fresh row)."""

    req: object
    row: int
    drawn: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)
    routes: np.ndarray | None = None  # MoE: the drawn tokens' recorded routes [n, L, k]


@dataclasses.dataclass
class _Slot:
    """An occupied slot: its row, the pages it owns, its shared prompt (or None), the pages
    its table holds, and its tokens' versions."""

    item: _Row
    mine: list
    shared: object
    held: int


class Session(PagePool):
    """Continuous batching of the rows of any number of requests over one page pool
    (`PagePool`'s pool, slots and programs; the same arguments, `spec` the one every
    request samples with)."""

    def __init__(self, engine, params, version: int, spec, *, seed_step, slots: int,
                 pages: int, prompt_rows: int):  # fmt: skip
        super().__init__(engine, params, version, spec, seed_step=seed_step, slots=slots,
                         pages=pages, prompt_rows=prompt_rows)  # fmt: skip
        self.requests: dict = {}
        self.done: list = []  # keys of requests whose rows all ended, in completion order

    # -------------------------------------------------------------------- requests
    def submit(self, key, ids: np.ndarray, mask: np.ndarray, budgets: np.ndarray,
               key_base: int = 0) -> None:  # fmt: skip
        """Queues the G rows of every prompt of ids / mask [B, width] (bucketed), after
        the rows already waiting; budgets [B * G] max_new_tokens per row."""
        B, width = ids.shape
        G = self.spec.num_generations
        N = B * G
        self._fit(width)
        req = _Request(
            ids=ids, mask=mask, G=G, budgets=budgets, key_base=int(key_base),
            drawn=[[] for _ in range(N)], logprobs=[[] for _ in range(N)],
            versions=[[] for _ in range(N)], started=np.full(N, -1, np.int64),
            stopped=np.zeros(N, bool), left=0, routes=[None] * N, prompt_routes={},
        )  # fmt: skip
        lengths = mask.sum(axis=1)
        rows = [r for r in range(N) if lengths[r // G]]  # dummy rows draw nothing
        req.left = len(rows)
        self.requests[key] = req
        self.waiting.extend(_Row(key, r) for r in rows)
        if not rows:
            self.done.append(key)

    @property
    def busy(self) -> bool:
        """Rows wait or decode, or a finished request was not collected yet."""
        return bool(self.waiting or self.order or self.done)

    @property
    def in_flight(self) -> bool:
        """Rows hold slots."""
        return bool(self.order)

    def started(self, key) -> bool:
        """Some row of the request has had a slot."""
        return bool((self.requests[key].started >= 0).any())

    def pop(self, key):
        """A finished request's results -> (drawn, logprobs, stopped, versions [N] (the
        version that started each row), token_versions [N, T] (-1 past each row's end))."""
        req = self.requests.pop(key)
        N = len(req.drawn)
        tv = np.full((N, self.T), -1, np.int32)
        for r, v in enumerate(req.versions):
            tv[r, : len(v)] = v
        started = req.started
        first = started[started >= 0].min() if (started >= 0).any() else self.version
        started = np.where(started >= 0, started, first).astype(np.int32)
        return req.drawn, req.logprobs, req.stopped, started, tv

    def routes(self, key) -> np.ndarray | None:
        """A finished request's `SampleOutput.routes` (MoE; None for a dense model): its
        prompts' routes from their first prefill, then each row's drawn tokens'."""
        if not self.e.cfg.moe:
            return None
        req = self.requests[key]
        return self.e._routes(req.ids, req.mask, self.spec, req.prompt_routes, req.routes)  # noqa: SLF001

    def output(self, key):
        """A finished request as (`SampleOutput` on the engine's rows, token_versions
        [N, T]): each row's policy_version is the version that started it."""
        ids, mask = self.requests[key].ids, self.requests[key].mask
        routes = self.routes(key)
        drawn, logprobs, stopped, started, tv = self.pop(key)
        out = self.e._output(ids, mask, self.spec, drawn, logprobs, stopped, started, routes)  # noqa: SLF001
        return out, tv

    def swap(self, params, version: int) -> None:
        """Decodes on with `params` (version `version`). Rows in flight are preempted and
        come back prefilled by them (their tokens so far kept, with their versions); the
        prompts' pages and first-draw logits are dropped, so they are prefilled anew."""
        for s in reversed(list(self.order)):  # youngest first: the oldest ends up first
            self._preempt(s, count=False)
        for key in list(self.prompt_pages):
            self._drop_prompt(key)
        self.weights, self.version = self.e.weights(params), int(version)
        self.stats["swaps"] += 1

    # ------------------------------------------------------------------------ slots
    def _admit(self) -> None:
        """Fills free slots with waiting rows while the pool has pages for them."""
        h = self.host
        while self.waiting and None in self.owner:
            s = self.owner.index(None)
            item = self.waiting[0]
            req = self.requests[item.req]
            b = item.row // req.G
            pkey = (item.req, b)
            real = req.ids[b][req.mask[b]]
            # Admitted only with pages for its prefill and first chunk left over after the
            # next chunk of the rows already in: a row taken in only to be preempted at
            # once would cost a prefill for nothing.
            fresh_prompt = not item.drawn and pkey not in self.prompt_pages
            cost = self._pages_of(len(real) + len(item.drawn)) if item.drawn or fresh_prompt else 0
            cost += -(-self.e.chunk_steps // self.PS) + 1
            reserve = sum(self._need(t) for t in self.order)
            if self.order and cost + reserve > len(self.free):
                return
            if item.drawn:  # preempted: its prompt and tokens so far, recomputed
                got = self._prefill(np.concatenate([real, item.drawn[:-1]]), self.scratch)
                if got is None:
                    return
                own, padded, start = got
                shared = None
            else:
                if pkey not in self.prompt_pages:
                    if not self.logit_rows:
                        return
                    record = None
                    if self.e.cfg.moe and b not in req.prompt_routes:
                        record = functools.partial(req.prompt_routes.__setitem__, b)
                    got = self._prefill(real, self.logit_rows[-1], record)
                    if got is None:
                        return
                    # The rows that will read these pages: this prompt's fresh waiting rows.
                    rows = sum(1 for w in self.waiting if (w.req, w.row // req.G) == pkey
                               and not w.drawn)  # fmt: skip
                    self.prompt_pages[pkey] = [*got, rows, self.logit_rows.pop()]
                pages, padded, start, _, logits_row = self.prompt_pages[pkey]
                own, shared = list(pages), pkey
            self.waiting.popleft()
            n = len(item.drawn)
            h["table"][s] = 0
            h["table"][s, : len(own)] = own
            h["start"][s], h["length"][s], h["cap"][s] = start, padded, padded
            h["last"][s] = item.drawn[-1] if n else self.e.pad_id
            h["fresh"][s], h["live"][s], h["stopped"][s] = n == 0, True, False
            h["n"][s], h["budget"][s] = n, req.budgets[item.row]
            h["row"][s] = req.key_base + item.row
            h["prompt"][s] = self.prompt_pages[pkey][4] if shared is not None else self.scratch
            h["tokens"][s] = self.e.pad_id
            h["tokens"][s, :n] = item.drawn
            h["logprobs"][s] = 0
            h["logprobs"][s, :n] = item.logprobs
            if "routes" in h:
                h["routes"][s] = -1
                if n:
                    h["routes"][s, :n] = item.routes
            if req.started[item.row] < 0:
                req.started[item.row] = self.version
            mine = [] if shared is not None else own
            self.owner[s] = _Slot(item, mine, shared, len(own))
            self.order.append(s)

    def _release(self, s: int) -> None:
        slot = self.owner[s]
        self.free.extend(p for p in slot.mine if p != NULL_PAGE)
        if slot.shared is not None and slot.shared in self.prompt_pages:
            entry = self.prompt_pages[slot.shared]
            entry[3] -= 1
            if entry[3] == 0:
                self._drop_prompt(slot.shared)
        self.owner[s] = None
        self.order.remove(s)
        self.host["live"][s] = False

    def _preempt(self, s: int, count: bool = True) -> None:
        h, slot = self.host, self.owner[s]
        n = int(h["n"][s])
        routes = h["routes"][s, :n].copy() if "routes" in h else None
        item = dataclasses.replace(slot.item, drawn=list(h["tokens"][s, :n]),
                                   logprobs=list(h["logprobs"][s, :n]), routes=routes)  # fmt: skip
        if n == 0 and slot.shared in self.prompt_pages:
            self.prompt_pages[slot.shared][3] += 1  # it comes back to the same prompt
        self._release(s)
        self.waiting.appendleft(item)
        self.stats["preempted"] += count

    def _grow(self) -> None:
        """Pages for the next chunk of every live slot, oldest first; the youngest are
        preempted when the pool runs short, so the oldest always advances."""
        h, PS = self.host, self.PS
        for s in list(self.order):
            if self.owner[s] is None:
                continue
            slot = self.owner[s]
            need = self._need(s)
            while need > len(self.free) and self.order[-1] != s:
                self._preempt(self.order[-1])
            got = min(need, len(self.free))
            new = self._take(got)
            h["table"][s, slot.held : slot.held + got] = new
            slot.mine.extend(new)
            slot.held += got
            h["cap"][s] = slot.held * PS
        self.stats["peak_pages"] = max(self.stats["peak_pages"], self._in_use())

    def run_chunk(self) -> list:
        """Admits waiting rows, decodes one chunk of every slot, collects the rows that
        ended -> the keys of requests finished since the last call, in completion order."""
        h = self.host
        if self.waiting or self.order:
            self._admit()
            self._run_prefills()
            self._grow()
            if not self.order:
                raise RuntimeError("paged engine: no sequence fits the page pool")
            before = h["n"].copy()
            h = self._decode_occupied()
            for s in list(self.order):
                item = self.owner[s].item
                item.versions.extend([self.version] * int(h["n"][s] - before[s]))
                if not h["live"][s]:
                    req, n = self.requests[item.req], int(h["n"][s])
                    req.drawn[item.row] = h["tokens"][s, :n].tolist()
                    req.logprobs[item.row] = h["logprobs"][s, :n].tolist()
                    req.versions[item.row] = list(item.versions)
                    req.stopped[item.row] = bool(h["stopped"][s])
                    if "routes" in h:
                        req.routes[item.row] = h["routes"][s, :n].copy()
                    req.left -= 1
                    self._release(s)
                    if req.left == 0:
                        self.done.append(item.req)
        done, self.done = self.done, []
        return done
