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

import collections
import dataclasses
import functools

import jax
import numpy as np

NULL_PAGE = 0  # writes of masked tokens go here; never read unmasked
PREFILL_BATCH = 8  # sequences prefilled by one program (batches of 1, 2, 4 or 8)


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


class Session:
    """Continuous batching of the rows of any number of requests over one page pool.

    Args:
      engine: the `PagedSampler` whose programs run the chunks and prefills.
      params, version: the parameters decoding starts with, and their version.
      spec: the `RolloutSpec` every request samples with.
      seed_step: (seed, salt) on device, uint32 [2] (the keys' base).
      slots: sequences decoded at once.
      pages: KV pages in the pool, the null page included.
      prompt_rows: prompts whose first-draw logits are held at once (a slot whose prompt
        has no free row waits).
    """

    def __init__(self, engine, params, version: int, spec, *, seed_step, slots: int,
                 pages: int, prompt_rows: int):  # fmt: skip
        e = engine
        self.e, self.version, self.spec = e, int(version), spec
        self.weights = e.weights(params)  # the programs' parameters (`PagedSampler.weights`)
        self.seed_step = seed_step
        self.T, self.C, self.PS, self.S = spec.max_new_tokens, e.prefill_chunk, e.page_size, slots
        self.total = pages
        self.M = 1  # page-table columns (grows with the widest request)
        self.free = list(range(pages - 1, 0, -1))  # page 0: the null page
        self.prompt_pages: dict = {}  # (request, b) -> [pages, padded, start, rows, logits row]
        self.logit_rows = list(range(prompt_rows - 1, -1, -1))
        self.scratch = prompt_rows  # prompt_logits row of a resumed row's prefill (not read)
        self.waiting: collections.deque = collections.deque()
        self.owner: list = [None] * slots  # slot -> _Slot
        self.order: list = []  # occupied slots, oldest first
        self.requests: dict = {}
        self.done: list = []  # keys of requests whose rows all ended, in completion order
        self.stats = dict(decode_chunks=0, prefills=0, prefill_calls=0, preempted=0,
                          peak_pages=0, swaps=0)  # fmt: skip
        # Prefill jobs (`_run_prefills`): (sequence, lo, hi, offset, first, pages, logits
        # row, record or None)
        self.prefills: list = []
        T, S = self.T, slots
        z = lambda *shape, dtype=np.int32: np.zeros(shape, dtype)  # noqa: E731
        self.host = dict(
            table=z(S, 1), start=z(S), length=z(S), cap=z(S), last=z(S),
            fresh=z(S, dtype=bool), live=z(S, dtype=bool), stopped=z(S, dtype=bool), n=z(S),
            budget=z(S), row=z(S), prompt=z(S), tokens=z(S, T), logprobs=z(S, T, dtype=np.float32),
        )  # fmt: skip
        cfg = e.cfg
        if cfg.moe:  # each drawn token's experts (sampling/decode.py's routes)
            shape = (S, T, cfg.num_layers, cfg.num_experts_per_tok)
            self.host["routes"] = np.full(shape, -1, np.int16)
        dtype = params["embed"].dtype
        self.pages = e._pool(e.cfg, pages, self.PS, dtype)  # noqa: SLF001
        rows = np.zeros((prompt_rows + 1, e.cfg.vocab_size), np.float32)
        self.prompt_logits = e._put(rows)  # noqa: SLF001
        self.stops = e._put(np.asarray(spec.stop_ids or (-1,), np.int32))  # noqa: SLF001

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

    def _fit(self, width: int) -> None:
        """Page-table columns for a prompt of `width` tokens and all it may draw (or, in
        a multi-turn session, its whole trajectory); ValueError when the pool cannot
        hold one such sequence."""
        longest = -(-(width + self.T) // self.C) * self.C + self.C
        M = -(-longest // self.PS)
        if self.total < M + 1:
            raise ValueError(
                f"pages={self.total}: the pool must hold one whole sequence ({M} pages of "
                f"{self.PS} tokens) besides the null page"
            )
        if M > self.M:
            self.host["table"] = np.pad(self.host["table"], ((0, 0), (0, M - self.M)))
            self.M = M

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

    # ------------------------------------------------------------------------ pages
    def _take(self, count: int) -> list:
        return [self.free.pop() for _ in range(count)]

    def _width(self, pages: int) -> int:
        """Page-table columns a program reads: a power of two >= pages, at most M."""
        return min(self.M, 1 << max(1, pages - 1).bit_length())

    def _in_use(self) -> int:
        return self.total - 1 - len(self.free)

    def _drop_prompt(self, key) -> None:
        entry = self.prompt_pages.pop(key)
        self.free.extend(p for p in entry[0] if p != NULL_PAGE)
        self.logit_rows.append(entry[4])

    def _prefill(self, tokens: np.ndarray, index: int, record=None) -> tuple[list, int, int] | None:
        """Takes pages for a sequence (real token ids) and queues its prefill (run by
        `_run_prefills`) -> (pages, padded length, start), or None when the pool lacks
        the pages. record: None, or a function given the routes of the sequence's real
        tokens [p, L, k] (MoE)."""
        C, PS = self.C, self.PS
        p = len(tokens)
        padded = -(-p // C) * C
        start = padded - p
        first = start // PS  # pages before it hold only padding: the null page
        count = padded // PS - first
        if count > len(self.free):
            return None
        pages = [NULL_PAGE] * first + self._take(count)
        seq = np.full(padded, self.e.pad_id, np.int32)
        seq[start:] = tokens
        self.prefills.append((seq, start, padded, 0, start, pages, index, record))
        self.stats["prefills"] += 1
        return pages, padded, start

    def _run_prefills(self) -> None:
        """The queued prefills, up to PREFILL_BATCH per program (the batch padded to a
        power of two with empty rows). A job (seq, lo, hi, offset, first, pages, row,
        record) writes seq's tokens [lo, hi) at cache slots offset + their index, in
        chunks of C aligned at the end: the k-th of K calls feeds each job its chunk
        k - (K - its chunks), or nothing before its first chunk with a real token, so
        every job's last chunk is in the last call and its logits row ends with the
        logits after its last token. first: the table's first valid slot; record (MoE),
        if any, is given the routes of tokens [lo, hi) [hi - lo, L, k]. A batch of one
        chunk each runs in the narrowest window (page_size times a power of two) that
        holds every job's tokens: a prompt shorter than a chunk, an observation of a few
        tokens appended (`TurnSession`)."""
        C, e = self.C, self.e
        jobs, self.prefills = self.prefills, []
        for at in range(0, len(jobs), PREFILL_BATCH):
            batch = jobs[at : at + PREFILL_BATCH]
            b = 1 << (len(batch) - 1).bit_length()
            chunks = [len(j[0]) // C for j in batch]
            K = max(chunks)
            table = np.zeros((b, self._width(max(len(j[5]) for j in batch))), np.int32)
            start = np.zeros(b, np.int32)
            index = np.full(b, self.scratch, np.int32)
            for i, (_, _, _, _, first, pages, row, _) in enumerate(batch):
                table[i, : len(pages)], start[i], index[i] = pages, first, row
            owns = []
            W = C  # tokens per call: one chunk's window that holds every job's tokens
            most = max(hi - lo for _, lo, hi, *_ in batch)
            while K == 1 and W // 2 % self.PS == 0 and W // 2 >= max(most, 1):
                W //= 2
            for k in range(K):
                tokens = np.full((b, W), e.pad_id, np.int32)
                mask = np.zeros((b, W), bool)
                length = np.zeros(b, np.int32)
                for i, (seq, lo, hi, offset, *_) in enumerate(batch):
                    c = k - (K - chunks[i])
                    if c < lo // C:
                        continue  # before its first chunk with a real token
                    at = min(lo, C - W) if W < C else c * C  # (W < C: one chunk, c = 0)
                    tokens[i] = seq[at : at + W]
                    where = np.arange(at, at + W)
                    mask[i] = (where >= lo) & (where < hi)
                    length[i] = offset + at
                self.pages, self.prompt_logits, own = e._prefill(  # noqa: SLF001
                    self.weights, self.pages, self.prompt_logits,
                    *e._put((index, tokens, mask, table, start, length)),  # noqa: SLF001
                )  # fmt: skip
                owns.append(own)
                self.stats["prefill_calls"] += 1
            if owns[0] is not None and any(j[7] is not None for j in batch):
                owns = jax.device_get(owns)  # K x [b, W, L, k]
                for i, (_, lo, hi, *_, record) in enumerate(batch):
                    if record is not None:  # its chunks, in the last chunks[i] calls
                        got = np.concatenate([o[i] for o in owns[K - chunks[i] :]], axis=0)
                        shift = min(lo, C - W)  # where the window starts (0: W == C)
                        record(got[lo - shift : hi - shift])

    def _pages_of(self, tokens: int) -> int:
        """Pages a prefill of `tokens` tokens takes (those of padding only are null)."""
        padded = -(-tokens // self.C) * self.C
        return padded // self.PS - (padded - tokens) // self.PS

    def _need(self, s: int) -> int:
        """Pages slot s lacks for its next chunk of steps."""
        h = self.host
        end = int(h["length"][s]) + int(h["budget"][s]) - int(h["n"][s])
        want = min(int(h["length"][s]) + self.e.chunk_steps, end)
        return max(0, -(-want // self.PS) - self.owner[s].held)

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

    def _decode_occupied(self) -> dict:
        """One decode chunk of the occupied slots -> the slots' host arrays after it. The
        program runs over those slots and the table cut to the most pages any of them
        holds (`PagedSampler.decode_slots`)."""
        held = max(self.owner[s].held for s in self.order)
        self.pages, self.host = self.e.decode_slots(
            self.weights, self.pages, self.host, self.order, held, self.prompt_logits,
            self.seed_step, self.stops, self.spec,
        )  # fmt: skip
        self.stats["decode_chunks"] += 1
        return self.host

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
