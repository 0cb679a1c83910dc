"""The paged engine's single-turn host side: a `Session` queues requests' rows, gives them
slots and pages of its `paged_pool.Pool` between decode chunks, and collects what they
drew.

    session = Session(engine, params, version, spec, seed_step=..., slots=S, pages=P, ...)
    session.submit(key, prompt_ids, prompt_mask, budgets, key_base)   # a batch of prompts
    while session.busy:
        for key in session.run_chunk():        # one decode chunk; requests that finished
            out, token_versions = session.output(key)
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

import jax
import numpy as np

from jaxrl_llm.sampling import paged_pool as pp
from jaxrl_llm.sampling.decode import FINISH_LENGTH, FINISH_STOP, SampleOutput


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
    """A row of a request: its request and index, the tokens / log-probs / versions it
    drew before it was last preempted (none for a fresh row), and in a slot the pages its
    table holds, its own pages and its shared prompt (or None)."""

    req: object
    row: int
    drawn: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)
    routes: np.ndarray | None = None  # MoE: the drawn tokens' recorded routes [n, L, k]
    table: list = dataclasses.field(default_factory=list)
    mine: list = dataclasses.field(default_factory=list)
    shared: object = None


class Session:
    """Continuous batching of the rows of any number of requests over one page pool
    (`paged_pool.Pool`'s arguments; `spec` the one every request samples with)."""

    def __init__(
        self,
        engine,
        params,
        version: int,
        spec,
        *,
        seed_step,
        slots: int,
        pages: int,
        prompt_rows: int,
    ):
        self.pool = pp.Pool(
            engine,
            params,
            version,
            spec,
            seed_step=seed_step,
            slots=slots,
            pages=pages,
            prompt_rows=prompt_rows,
        )
        self.requests: dict = {}
        self.done: list = []  # keys of requests whose rows all ended, in completion order

    stats = property(lambda self: self.pool.stats, doc="The pool's counters (`Pool.stats`).")
    version = property(lambda self: self.pool.version, doc="The parameters' version.")

    # -------------------------------------------------------------------- requests
    def submit(
        self, key, ids: np.ndarray, mask: np.ndarray, budgets: np.ndarray, key_base: int = 0
    ) -> None:
        """Queues the G rows of every prompt of ids / mask [B, width] (bucketed), after
        the rows already waiting; budgets [B * G] max_new_tokens per row."""
        B, width = ids.shape
        G = self.pool.spec.num_generations
        N = B * G
        pp.fit(self.pool, width)
        req = _Request(
            ids=ids,
            mask=mask,
            G=G,
            budgets=budgets,
            key_base=int(key_base),
            drawn=[[] for _ in range(N)],
            logprobs=[[] for _ in range(N)],
            versions=[[] for _ in range(N)],
            started=np.full(N, -1, np.int64),
            stopped=np.zeros(N, bool),
            left=0,
            routes=[None] * N,
            prompt_routes={},
        )
        lengths = mask.sum(axis=1)
        rows = [r for r in range(N) if lengths[r // G]]  # dummy rows draw nothing
        req.left = len(rows)
        self.requests[key] = req
        self.pool.waiting.extend(_Row(key, r) for r in rows)
        if not rows:
            self.done.append(key)

    @property
    def busy(self) -> bool:
        """Rows wait or decode, or a finished request was not collected yet."""
        return bool(self.in_flight or self.done)

    @property
    def in_flight(self) -> bool:
        """Rows wait for a slot or hold one."""
        return bool(self.pool.waiting or self.pool.order)

    def output(self, key):
        """A finished request's results -> (`SampleOutput` on the engine's rows,
        token_versions [N, T]: the version that drew each token, -1 past each row's end).
        Each row's policy_version is the version that started it; MoE routes: its
        prompt's from their first prefill, then its drawn tokens'."""
        req, e, spec = self.requests.pop(key), self.pool.engine, self.pool.spec
        G, T, N = spec.num_generations, spec.max_new_tokens, len(req.drawn)
        tokens = np.full((N, T), e.pad_id, np.int32)
        lps = np.zeros((N, T), np.float32)
        tv = np.full((N, T), -1, np.int32)
        lengths = np.array([len(d) for d in req.drawn], np.int32)
        for i in range(N):
            tokens[i, : lengths[i]], lps[i, : lengths[i]] = req.drawn[i], req.logprobs[i]
            tv[i, : len(req.versions[i])] = req.versions[i]
        started = req.started
        first = started[started >= 0].min() if (started >= 0).any() else self.version
        routes = None
        if e.cfg.moe:
            routes = static_routes(
                e.cfg, req.ids, req.mask, N, T, req.prompt_routes, dict(enumerate(req.routes))
            )
        real = np.arange(T)[None] < lengths[:, None]
        out = SampleOutput(
            tokens=tokens,
            mask=real,
            loss_mask=real,
            logprobs=lps,
            lengths=lengths,
            finish=np.where(req.stopped, FINISH_STOP, FINISH_LENGTH).astype(np.int32),
            prompt_tokens=np.repeat(req.ids, G, axis=0),
            prompt_mask=np.repeat(req.mask, G, axis=0),
            policy_version=np.where(started >= 0, started, first).astype(np.int32),
            num_generations=G,
            routes=routes,
        )
        return jax.tree.map(lambda x: jax.device_put(x, e.row_sharding), out), tv

    def swap(self, params, version: int) -> None:
        """Decodes on with `params` (version `version`). Rows in flight are preempted and
        come back prefilled by them (their tokens so far kept, with their versions); the
        prompts' pages and first-draw logits are dropped, so they are prefilled anew."""
        for s in reversed(list(self.pool.order)):  # youngest first: the oldest ends up first
            self._preempt(s, count=False)
        pp.reweigh(self.pool, params, version)

    # ------------------------------------------------------------------------ slots
    def _admit(self) -> None:
        """Fills free slots with waiting rows while the pool has pages for them."""
        pool, pad = self.pool, self.pool.engine.pad_id
        while pool.waiting and None in pool.owner:
            s = pool.owner.index(None)
            item = pool.waiting[0]
            req = self.requests[item.req]
            b = item.row // req.G
            pkey = (item.req, b)
            real = req.ids[b][req.mask[b]]
            # Admitted only with pages for its prefill and first chunk left over after the
            # next chunk of the rows already in.
            on_prompt = not item.drawn and pkey in pool.prompt_pages
            cost = 0 if on_prompt else pp.pages_of(pool, len(real) + len(item.drawn))
            if pool.order and pp.short(pool, cost) > 0:
                return
            if item.drawn:  # preempted: its prompt and tokens so far, recomputed
                seq = np.concatenate([real, item.drawn[:-1]])
                # (a hybrid model's state from zero, into the slot's state row)
                got = pp.queue_prefill(pool, seq, pool.scratch, state_to=pp.state_row(pool, s))
                if got is None:
                    return
                own, padded, start = got
                item.table, item.mine, item.shared, logits = list(own), own, None, pool.scratch
                state_from = None
            else:
                if pkey not in pool.prompt_pages:
                    if not pool.logit_rows:
                        return
                    record = None
                    if pool.engine.cfg.moe and b not in req.prompt_routes:
                        record = functools.partial(req.prompt_routes.__setitem__, b)
                    got = pp.queue_prefill(pool, real, pool.logit_rows[-1], record)
                    if got is None:
                        return
                    # The rows that will read these pages: this prompt's fresh waiting rows.
                    rows = sum(
                        1 for w in pool.waiting if (w.req, w.row // req.G) == pkey and not w.drawn
                    )
                    pool.prompt_pages[pkey] = [*got, rows, pool.logit_rows.pop()]
                pages, padded, start, _, logits = pool.prompt_pages[pkey]
                item.table, item.mine, item.shared = list(pages), [], pkey
                state_from = logits  # the prompt's state row is its logits row
            pool.waiting.popleft()
            n = len(item.drawn)
            pp.seat(
                pool,
                s,
                item,
                start=start,
                length=padded,
                last=item.drawn[-1] if n else pad,
                n=n,
                budget=req.budgets[item.row],
                row=req.key_base + item.row,
                prompt=logits,
                drawn=item.drawn,
                logprobs=item.logprobs,
                routes=item.routes,
                state_from=state_from,
            )
            if req.started[item.row] < 0:
                req.started[item.row] = self.version

    def _release(self, s: int) -> None:
        slot = self.pool.owner[s]
        pp.give_back(self.pool, slot.mine)
        pp.unshare(self.pool, slot.shared)
        pp.vacate(self.pool, s)

    def _preempt(self, s: int, count: bool = True) -> None:
        pool = self.pool
        h, slot = pool.host, pool.owner[s]
        n = int(h["n"][s])
        routes = h["routes"][s, :n].copy() if "routes" in h else None
        item = dataclasses.replace(
            slot, drawn=list(h["tokens"][s, :n]), logprobs=list(h["logprobs"][s, :n]), routes=routes
        )
        if n == 0 and slot.shared in pool.prompt_pages:
            pool.prompt_pages[slot.shared][3] += 1  # it comes back to the same prompt
        self._release(s)
        pool.waiting.appendleft(item)
        pool.stats["preempted"] += count

    def run_chunk(self) -> list:
        """Admits waiting rows, decodes one chunk of every slot, collects the rows that
        ended -> the keys of requests finished since the last call, in completion order."""
        pool = self.pool
        if self.in_flight:
            self._admit()
            pp.run_prefills(pool)
            pp.grow(pool, self._preempt)
            if not pool.order:
                raise RuntimeError("paged engine: no sequence fits the page pool")
            before = pool.host["n"].copy()
            h = pp.decode(pool)
            for s in list(pool.order):
                item = pool.owner[s]
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


def static_routes(cfg, ids, mask, n: int, T: int, prompt_routes: dict, rows: dict):
    """Routes [n, width + T, L, k] int16 as the static sampler lays them out, for n rows
    over prompts ids / mask [B, width] (G = n // B rows each): each prompt's real tokens'
    routes (prompt_routes[b], from its one prefill) in every row of its group, then the
    row's completion tokens' (rows[i], from the forward that fed each; the last drawn
    one, never fed: -1); -1 at padding and past the end."""
    B, width = ids.shape
    G = n // B
    out = np.full((n, width + T, cfg.num_layers, cfg.num_experts_per_tok), -1, np.int16)
    for i in range(n):
        if i // G in prompt_routes:
            out[i, :width][mask[i // G]] = prompt_routes[i // G]
        if rows.get(i) is not None:
            out[i, width : width + len(rows[i])] = rows[i]
    return out
