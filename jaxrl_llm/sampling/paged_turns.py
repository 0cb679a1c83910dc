"""Multi-turn rollouts on the paged engine: a row that ends a turn gives its decode slot
to another row and keeps its pages while its environment works.

    session = TurnSession(engine, params, version, spec, seed=0, step=s, slots=S, pages=P,
                          prompts=B)
    session.submit(ids, mask, turn_tokens, live)      # bucketed prompts, G rows each
    session.add(r, ids, turn_tokens)                  # or one row with its own prompt
    while session.busy or <environment steps in flight>:
        for r in session.run_chunk():                  # rows whose turn ended in the chunk
            t = session.result(r)                       # its turn: t.tokens[t.turn_from:]
            ...                                         # the caller steps r's environment
        session.resume(r, observation_ids, turn_tokens) # when its observation is back
        session.end(r)                                  # or: its trajectory is over

A row decodes a turn in a slot until it draws a turn stop id (`spec.stop_ids`) or spends
its turn budget; then it leaves the slot (the next waiting row takes it) but keeps its
pages: its own and its reference on its prompt's pages, shared by the prompt's G rows.
Its last drawn token is pending (not in the cache). When the caller resumes it, the
pending token and the observation's ids are prefilled into the row's own pages at its
length (chunks of `prefill_chunk` tokens, batched with the other prefills of the chunk);
the logits after the observation's last token are its first draw of the next turn (read
from a logits row of its new slot), so the KV cache holds exactly what the static
sampler's `append` gives it. `end` returns a row's pages.

Pages run short: before any decoding row is preempted, rows that hold pages outside a
slot (parked on their environment, or waiting for a slot) are evicted, the most recently
parked first; a new trajectory waits for free pages rather than evict. An evicted or
preempted row comes back by recompute: its prompt and completion so far (sampled and
observation tokens) prefilled into its own pages, or its completion only, appended on its
prompt's pages while they are there (an evicted row keeps its reference on them: the G
rows of a prompt are often evicted together, and each would recompute it); a row that
drew nothing yet goes back to its prompt's shared pages.

Row r draws its t-th sampled token of the whole trajectory with
fold_in(fold_in(fold_in(key(seed), step), k), t), k its key row (r, or key_base + r for
`submit(..., key_base=)`), whatever slot, chunk, neighbours or evictions it had, so
greedy decoding draws the static sampler's tokens. The single-turn engine
(`paged_schedule.Session`) is this session with each row ended at its first turn.

MoE routes (`routes`; `paged_schedule.rows_output` lays them out as the static loop): each
token's experts from the forward that first fed it: a prompt's from its first shared
prefill, a sampled token's from the decode step that feeds it, the pending token and an
observation's ids from the prefill that appends them (or, for a row evicted before they
were appended, from its recompute). A recompute feeds tokens again and keeps the routes
they already have; each row's last drawn token, never fed, keeps -1.

A hybrid model (Qwen3.5): a row holds a recurrent-state row of its own for as long as it
holds pages (`Pool.state_free`; taken when it is seated, returned with its own pages),
so its Gated DeltaNet state waits with it while it is parked: its first turn starts from
its prompt's state (written once by the prompt's prefill), an append continues from its
own row (or from the prompt's, for a completion recomputed on the prompt's pages), a full
recompute starts from zero. When no state row is free a row waits, or evicts parked rows
as it would for pages.

Partial rollouts (`swap`, between chunks): newer parameters replace the old ones; every
row in a slot is preempted and every parked row evicted, the prompts' pages dropped, so
each row comes back by recompute under the new parameters (prompt and completion so far
prefilled) and draws on with them. Each sampled token records the version that drew it.

A row's record and the prefill that seats it (first turn, append, recompute) are
`paged_rows`'; admission, eviction, preemption and the decode chunk are here.
"""

from __future__ import annotations

import numpy as np

from jaxrl_llm.sampling import paged_pool as pp
from jaxrl_llm.sampling import paged_rows
from jaxrl_llm.sampling.paged_rows import Traj


class TurnSession:
    """Continuous batching of multi-turn rows over one page pool (`paged_pool.Pool`).

    Args:
      engine, params, version: the `PagedSampler`, the parameters decoding starts with
        and their version.
      spec: the `RolloutSpec`; max_new_tokens bounds a trajectory's completion (sampled
        and appended tokens), stop_ids end a turn.
      seed, step: the keys' base (fold_in(key(seed), step)).
      slots, pages: decode slots and KV pages (the null page included).
      prompts: prompts in the batch (their first-draw logits rows; a parked row keeps its
        prompt's pages and logits row).
    """

    def __init__(
        self,
        engine,
        params,
        version: int,
        spec,
        *,
        seed: int,
        step: int,
        slots: int,
        pages: int,
        prompts: int,
        holders: int | None = None,
    ):
        seed_step = engine.put(np.array([seed, step], np.uint32))
        # A hybrid model's state rows for rows that hold pages, in a slot or parked: the
        # slots' and `holders` more (default one per row of the prompts given); more rows
        # wait for one or evict, as they would for pages.
        if holders is None:
            holders = prompts * spec.num_generations
        holders = max(1, holders) if engine.cfg.hybrid else 0
        # Logits rows [0, prompts): prompts; then the scratch row; then one per slot: the
        # first-draw logits of a row resumed or recomputed into that slot.
        self.pool = pp.Pool(
            engine,
            params,
            version,
            spec,
            seed_step=seed_step,
            slots=slots,
            pages=pages,
            prompt_rows=prompts,
            slot_rows=True,
            holder_rows=holders,
        )
        self.trajs: dict = {}
        self.holders: dict = {}  # row -> its Traj, holding pages outside a slot, parked order
        self.pool.stats.update(evicted=0, appends=0, prompt_kept=0)  # and `Pool.stats`
        self.prompt_routes: dict = {}  # MoE: prompt -> its real tokens' routes [p, L, k]

    stats = property(lambda self: self.pool.stats, doc="The pool's counters (`Pool.stats`).")
    version = property(lambda self: self.pool.version, doc="The parameters' version.")

    # ------------------------------------------------------------------------ rows
    def submit(
        self, ids: np.ndarray, mask: np.ndarray, turn_tokens, live=None, *, name=None, key_base=0
    ) -> list:
        """Queues the G rows of every prompt of ids / mask [B, width] (bucketed) whose
        live[r] is true (B * G flags; None: all) -> their names: r, or (name, r) to tell
        the batch's rows from other batches'. Row r draws with key row key_base + r, at
        most turn_tokens (an int, or [B * G] per row) in its first turn."""
        B, width = ids.shape
        G = self.pool.spec.num_generations
        pp.fit(self.pool, width)
        budgets = np.broadcast_to(np.asarray(turn_tokens), (B * G,))
        named = (lambda i: i) if name is None else (lambda i: (name, i))
        rows = []
        for r in range(B * G):
            b = r // G
            if (live is None or live[r]) and mask[b].any():
                prompt, budget = ids[b][mask[b]], int(budgets[r])
                t = Traj(row=named(r), b=named(b), key=key_base + r, prompt=prompt, budget=budget)
                self._queue(t)
                rows.append(t.row)
        return rows

    def add(self, r: int, ids, turn_tokens: int) -> None:
        """Queues row r (an id not used before in the session) with its own prompt `ids`
        (real ids, no padding), drawing at most turn_tokens in its first turn: rows that
        come one at a time (`submit` queues a batch of prompts at once). Its prompt's
        pages and first-draw logits row are its own (shared with no other row)."""
        prompt = np.asarray(ids, np.int32)
        pp.fit(self.pool, len(prompt))
        t = Traj(row=int(r), b=("row", int(r)), key=int(r), prompt=prompt, budget=int(turn_tokens))
        self._queue(t)

    def _queue(self, t: Traj) -> None:
        cfg = self.pool.engine.cfg
        if cfg.moe:
            t.routes = np.full((self.pool.T, cfg.num_layers, cfg.num_experts_per_tok), -1, np.int16)
        self.trajs[t.row] = t
        self.pool.waiting.append(t)

    @property
    def busy(self) -> bool:
        """Rows wait for a slot or decode."""
        return bool(self.pool.waiting or self.pool.order)

    @property
    def decoding(self) -> int:
        """Rows in a slot."""
        return len(self.pool.order)

    def resume(self, r: int, ids, turn_tokens: int) -> None:
        """Row r goes on: `ids` (not sampled) follow its turn, then it draws at most
        turn_tokens more. It waits for a slot ahead of rows that have not started."""
        t, waiting = self.trajs[r], self.pool.waiting
        ids = [int(x) for x in ids]
        t.tokens += ids
        t.sampled += [False] * len(ids)
        t.logprobs += [0.0] * len(ids)
        t.versions += [-1] * len(ids)
        t.turn_from, t.budget = len(t.tokens), t.n + int(turn_tokens)
        i = 0
        while i < len(waiting) and waiting[i].tokens:
            i += 1
        waiting.insert(i, t)

    def end(self, r: int, forget: bool = False) -> None:
        """Row r's trajectory is over: its pages go back to the pool (forget: and the
        session forgets it; `result` first)."""
        t = self.trajs.pop(r) if forget else self.trajs[r]
        self._unpage(t)
        pp.unshare(self.pool, t.shared)
        t.shared = None

    def result(self, r: int) -> Traj:
        return self.trajs[r]

    def swap(self, params, version: int) -> None:
        """Decodes on with `params` (version `version`): the keys and values of every row
        were computed by the older parameters, so rows in slots are preempted (the oldest
        ends up first in line), parked rows evicted and the prompts' pages dropped; each
        row comes back by recompute under `params` (a row that drew nothing by a new
        prefill of its prompt). Tokens drawn so far keep their log-probs and versions."""
        for s in reversed(list(self.pool.order)):
            self._preempt(s, count=False)
        for t in list(self.holders.values()):
            self._unpage(t)
        for t in self.trajs.values():
            t.shared = None
        pp.reweigh(self.pool, params, version)

    # ------------------------------------------------------------------------ pages
    def _unpage(self, t: Traj) -> None:
        """Returns t's own pages; its reference on its prompt's pages stays (it comes back
        on them, recomputing its completion only; `end` drops it)."""
        pp.give_back(self.pool, t.mine)
        t.table, t.mine, t.length, t.base = [], [], 0, 0
        self.holders.pop(t.row, None)
        if t.state is not None:
            self.pool.state_free.append(t.state)
            t.state = None

    def _evict_one(self, keep=None) -> bool:
        """Evicts the most recently parked row that holds pages outside a slot (not
        `keep`); when none does, drops the prompt reference an evicted row kept (not
        `keep`'s) -> whether there was one."""
        for t in reversed(self.holders.values()):  # no copy: it returns after a change
            if t is not keep:
                self._unpage(t)
                self.pool.stats["evicted"] += 1
                return True
        for t in self.trajs.values():
            if (
                t.tokens
                and not t.table
                and t.shared is not None
                and (keep is None or t.shared != keep.b)
            ):
                pp.unshare(self.pool, t.shared)
                t.shared = None
                return True
        return False

    # ------------------------------------------------------------------------ slots
    def _admit(self) -> None:
        """Seats waiting rows in free slots while the pool has pages for them: a row that
        has started evicts parked rows for its pages (any row does when nothing decodes)."""
        pool = self.pool
        while pool.waiting and None in pool.owner:
            s = pool.owner.index(None)
            t = pool.waiting[0]
            cost = paged_rows.cost(self.pool, t)
            while self._short(t, cost) and (t.tokens or not pool.order) and self._evict_one(t):
                pass
            if pool.order and self._short(t, cost):
                return
            prompt_row = self._seat(t, s)
            if prompt_row is None:
                return
            pool.waiting.popleft()
            self.holders.pop(t.row, None)
            t.seated = t.n
            pp.seat(
                pool,
                s,
                t,
                start=t.start,
                length=t.length,
                n=t.n,
                budget=t.budget,
                row=t.key,
                prompt=prompt_row,
                state=t.state,
                # a first turn starts from its prompt's state (a prompt's logits row is
                # its state row), the others from what their prefill wrote
                state_from=prompt_row if prompt_row < pool.scratch else None,
            )

    def _short(self, t: Traj, cost: int) -> bool:
        """The pool lacks the pages to seat t (`paged_pool.short`), or a hybrid model's
        state row for it."""
        lacks_row = self.pool.engine.cfg.hybrid and t.state is None and not self.pool.state_free
        return pp.short(self.pool, cost) > 0 or lacks_row

    def _seat(self, t: Traj, s: int) -> int | None:
        """Queues t's prefill for slot s -> the logits row of its next draw (None: the
        pool lacks the pages, or a hybrid model's state row)."""
        pool = self.pool
        took = pool.engine.cfg.hybrid and t.state is None
        if took:
            if not pool.state_free:
                return None
            t.state = pool.state_free.pop()
        row = paged_rows.queue_prefill(self.pool, self.prompt_routes, t, s)
        if row is None and took:
            pool.state_free.append(t.state)
            t.state = None
        return row

    def _preempt(self, s: int, count: bool = True) -> None:
        """Slot s's row leaves it and its pages; it waits first in line (recompute)."""
        t = self.pool.owner[s]
        pp.vacate(self.pool, s)
        self._unpage(t)
        self.pool.waiting.appendleft(t)
        self.pool.stats["preempted"] += count

    def run_chunk(self) -> list:
        """Seats waiting rows, decodes one chunk of the occupied slots -> the rows whose
        turn ended in it (they left their slots and keep their pages)."""
        pool = self.pool
        if not self.busy:
            return []
        self._admit()
        pp.run_prefills(pool)
        pp.grow(pool, self._preempt, self._evict_one)
        if not pool.order:
            head = pool.waiting[0] if pool.waiting else None
            if head is not None and all(t is head for t in self.holders.values()):
                raise RuntimeError("paged engine: no trajectory fits the page pool")
            return []  # what waits needs the pages of rows parked on their environments
        h = pp.decode(pool)
        ended = []
        for s in list(pool.order):
            t = pool.owner[s]
            n = int(h["n"][s])
            new = h["tokens"][s, t.n : n].tolist()
            t.at += range(len(t.tokens), len(t.tokens) + len(new))
            t.tokens += new
            t.sampled += [True] * len(new)
            t.logprobs += h["logprobs"][s, t.n : n].tolist()
            t.versions += [self.version] * len(new)
            t.n, t.length = n, int(h["length"][s])
            if t.routes is not None and n > t.seated:  # fed in the slot: all but the last
                fed = np.arange(t.seated, n - 1)
                t.routes[np.asarray(t.at, np.int64)[fed]] = h["routes"][s, fed]
                t.fed = len(t.tokens) - 1
            if not h["live"][s]:  # its turn ended: the slot goes, the pages stay
                t.stopped = bool(h["stopped"][s])
                pp.vacate(pool, s)
                self.holders[t.row] = t
                ended.append(t.row)
        return ended
