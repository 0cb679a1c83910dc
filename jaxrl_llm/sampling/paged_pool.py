"""The page pool and decode slots of a paged engine session: one `Pool` record and the
plain functions that change it (`queue_prefill` / `run_prefills`, `seat`, `grow`,
`decode`, `vacate`, `unshare`, `reweigh`).

A `Pool` holds the KV pages (a free list, page 0 the null page), the page-table columns,
the prompts' shared pages and first-draw logits rows, the slots' host arrays, the waiting
line and the prefill queue. A hybrid model's recurrent state rows (`Pages.state`) are
numbered as the logits rows: a prompt's state after its prefill sits in its logits row
(its G rows start from it), slot s's row in row `state_row(pool, s)`, and a multi-turn
row, whose state outlives its slot while it is parked, holds a row of its own
(`holder_rows`, `state_free`); a row that is recomputed starts from zero.

Which rows fill the slots and what they keep is the scheduler's: `paged_turns.TurnSession`
(multi-turn rows that park on their environments; `paged_schedule.Session` queues
single-turn requests on one, streamed across training steps), holding one pool. A
slot's holder (the scheduler's row record) has `table` (the pages
its page table holds: a prompt's shared ones, then its own) and `mine` (its own pages).
The engine is reached through its public programs (`PagedSampler.put`, `prefill`,
`decode_slots`, `weights`, `pool`).
"""

from __future__ import annotations

import collections
import contextlib
import math
from typing import NamedTuple

import jax
import numpy as np

from jaxrl_llm import errors

NULL_PAGE = 0  # writes of masked tokens go here; never read unmasked
NO_STATE = 2**31 - 1  # a state row past the pool's: read as zeros, written nowhere
PREFILL_BATCH = 8  # sequences prefilled by one program (batches of 1, 2, 4 or 8)


class Pool:
    """A page pool, decode slots and their host state over one engine: a record, changed
    by this module's functions.

    Args:
      engine: the `PagedSampler` whose programs run the chunks and prefills.
      params, version: the parameters decoding starts with, and their version.
      spec: the `RolloutSpec` every row samples with.
      seed_step: (seed, salt) on device, uint32 [2] (the keys' base).
      slots: sequences decoded at once.
      pages: KV pages in the pool, the null page included.
      prompt_rows: prompts whose first-draw logits are held at once (a slot whose prompt
        has no free row waits).
      slot_rows: also a first-draw logits row per slot (a resumed or recomputed row's).
      holder_rows: a hybrid model's recurrent-state rows that rows take for as long as
        they hold pages, in a slot or not (`state_free`).
    """

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
        slot_rows: bool = False,
        holder_rows: int = 0,
    ):
        e, T, S = engine, spec.max_new_tokens, slots
        self.engine, self.version, self.spec, self.seed_step = e, int(version), spec, seed_step
        self.weights = e.weights(params)  # the programs' parameters (`PagedSampler.weights`)
        self.T, self.C, self.PS, self.total = T, e.prefill_chunk, e.page_size, pages
        self.M = 1  # page-table columns (grows with the widest request)
        self.free = list(range(pages - 1, 0, -1))  # page 0: the null page
        self.prompt_pages: dict = {}  # prompt key -> [pages, padded, start, rows, logits row]
        self.logit_rows = list(range(prompt_rows - 1, -1, -1))
        self.scratch = prompt_rows  # prompt_logits row of a recompute's prefill (not read)
        self.waiting: collections.deque = collections.deque()  # holders waiting for a slot
        self.owner: list = [None] * S  # slot -> its holder (None: free)
        self.order: list = []  # occupied slots, oldest first
        self.stats = dict(
            decode_chunks=0, prefills=0, prefill_calls=0, preempted=0, peak_pages=0, swaps=0
        )
        self.prefills: list = []  # `Prefill` jobs (`run_prefills`)
        z = lambda *shape, dtype=np.int32: np.zeros(shape, dtype)  # noqa: E731
        self.host = dict(
            table=z(S, 1),
            start=z(S),
            length=z(S),
            cap=z(S),
            last=z(S),
            fresh=z(S, dtype=bool),
            live=z(S, dtype=bool),
            stopped=z(S, dtype=bool),
            n=z(S),
            budget=z(S),
            row=z(S),
            prompt=z(S),
            tokens=z(S, T),
            logprobs=z(S, T, dtype=np.float32),
        )
        cfg = e.cfg
        if cfg.moe:  # each drawn token's experts (sampling/decode.py's routes)
            shape = (S, T, cfg.num_layers, cfg.num_experts_per_tok)
            self.host["routes"] = np.full(shape, -1, np.int16)
        self.dtype = params["embed"].dtype
        self.pages = None
        # A hybrid model's state rows: the logits rows' (prompts, then the scratch row),
        # then one per slot.
        self.state_rows = prompt_rows + 1 + S + holder_rows
        # (with holder rows, the slots' rows are holders' too: a row decodes in its own)
        self.state_free = list(range(self.state_rows - 1, prompt_rows, -1)) if holder_rows else []
        with out_of_memory(self):
            # Blocked on: an allocation that fails is reported here, not by a later program.
            pool = e.pool(cfg, pages, self.PS, self.dtype, state_rows=self.state_rows)
            self.pages = jax.block_until_ready(pool)
        rows = np.zeros((prompt_rows + 1 + S * slot_rows, cfg.vocab_size), np.float32)
        self.prompt_logits = e.put(rows)
        if cfg.hybrid:  # each slot's DeltaNet state row, and the one its next chunk reads
            self.host["state"] = np.full(S, NO_STATE, np.int32)
            self.host["state_from"] = np.full(S, NO_STATE, np.int32)
        self.stats["state_bytes_per_row"] = e.state_bytes(self.dtype)
        self.stops = e.put(np.asarray(spec.stop_ids or (-1,), np.int32))


@contextlib.contextmanager
def out_of_memory(pool: Pool):
    """Device out of memory while the pool is allocated or a program over it runs: one
    line naming the pool's size and `rollout.paged.pages`, the setting that sizes it (the
    generic line would suggest the update's batch and remat)."""
    try:
        yield
    except Exception as err:
        if not errors.out_of_memory(err):
            raise
        raise errors.UserError(_out_of_memory_line(pool, err)) from err


def _out_of_memory_line(pool: Pool, err: BaseException) -> str:
    e = pool.engine
    shapes = e.pool(e.cfg, pool.total, pool.PS, pool.dtype, shapes=True)
    size = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    cause = str(err).strip().splitlines()[0][:200]
    pages = f"{pool.total} pages of {pool.PS} tokens, {size / 2**30:,.2f} GiB of KV cache"
    if e.cfg.hybrid:
        row = e.state_bytes(pool.dtype)
        pages += (
            f" and {pool.state_rows} recurrent-state rows of {row / 2**20:,.1f} MiB "
            "(one per slot and per prompt held)"
        )
    if e.pages:
        return (
            f"rollout.paged.pages={pool.total}: device out of memory ({cause}) with a "
            f"page pool of {pages}; lower rollout.paged.pages (0 = automatic)"
        )
    return (
        f"rollout.paged.pages=0: device out of memory ({cause}) with the automatic page "
        f"pool of {pages}; set rollout.paged.pages below {pool.total}, or lower "
        "rollout.batch_size or rollout.max_new_tokens (they size the automatic pool)"
    )


def fit(pool: Pool, width: int) -> None:
    """Page-table columns for a prompt of `width` tokens and all it may draw (or, in a
    multi-turn session, its whole trajectory); ValueError when the pool cannot hold one
    such sequence."""
    longest = -(-(width + pool.T) // pool.C) * pool.C + pool.C
    M = -(-longest // pool.PS)
    if pool.total < M + 1:
        raise ValueError(
            f"pages={pool.total}: the pool must hold one whole sequence ({M} pages of "
            f"{pool.PS} tokens) besides the null page"
        )
    if M > pool.M:
        pool.host["table"] = np.pad(pool.host["table"], ((0, 0), (0, M - pool.M)))
        pool.M = M


# ---------------------------------------------------------------------------- pages
def take(pool: Pool, count: int) -> list:
    return [pool.free.pop() for _ in range(count)]


def give_back(pool: Pool, pages: list) -> None:
    pool.free.extend(p for p in pages if p != NULL_PAGE)


def pages_of(pool: Pool, tokens: int) -> int:
    """Pages a prefill of `tokens` tokens takes (those of padding only are null)."""
    padded = -(-tokens // pool.C) * pool.C
    return padded // pool.PS - (padded - tokens) // pool.PS


def drop_prompt(pool: Pool, key) -> None:
    entry = pool.prompt_pages.pop(key)
    give_back(pool, entry[0])
    pool.logit_rows.append(entry[4])


def unshare(pool: Pool, key) -> None:
    """Drops one reference on prompt `key`'s pages (the last one returns them)."""
    if key is not None and key in pool.prompt_pages:
        entry = pool.prompt_pages[key]
        entry[3] -= 1
        if entry[3] == 0:
            drop_prompt(pool, key)


def reweigh(pool: Pool, params, version: int) -> None:
    """Decodes on with `params` (version `version`); every prompt's pages and first-draw
    logits are dropped (computed by the old ones), so they are prefilled anew. The caller
    has taken every row out of its slot first."""
    for key in list(pool.prompt_pages):
        drop_prompt(pool, key)
    pool.weights, pool.version = pool.engine.weights(params), int(version)
    pool.stats["swaps"] += 1


class Prefill(NamedTuple):
    """A prefill job (`run_prefills`): seq's tokens [lo, hi) written at cache slots offset
    + their index; first: the table's first valid slot; pages: the table; row: the
    logits row of the logits after its last token; record: None, or a function given the
    routes of tokens [lo, hi) [hi - lo, L, k] (MoE); state: a hybrid model's (from, to)
    state rows (the state before its first token: `NO_STATE` for zeros), else None."""

    seq: np.ndarray
    lo: int
    hi: int
    offset: int
    first: int
    pages: list
    row: int
    record: object = None
    state: tuple | None = None


def queue_prefill(pool: Pool, tokens: np.ndarray, index: int, record=None, state_to=None):
    """Takes pages for a sequence (real token ids) and queues its prefill (run by
    `run_prefills`) -> (pages, padded length, start), or None when the pool lacks the
    pages. record: None, or a function given the routes of the sequence's real tokens
    [p, L, k] (MoE). A hybrid model's state starts from zero and goes to state row
    `state_to` (None: `index`, the logits row)."""
    C, PS = pool.C, pool.PS
    p = len(tokens)
    padded = -(-p // C) * C
    start = padded - p
    first = start // PS  # pages before it hold only padding: the null page
    count = padded // PS - first
    if count > len(pool.free):
        return None
    pages = [NULL_PAGE] * first + take(pool, count)
    seq = np.full(padded, pool.engine.pad_id, np.int32)
    seq[start:] = tokens
    state = None
    if pool.engine.cfg.hybrid:
        state = (NO_STATE, index if state_to is None else state_to)
    pool.prefills.append(Prefill(seq, start, padded, 0, start, pages, index, record, state))
    pool.stats["prefills"] += 1
    return pages, padded, start


def run_prefills(pool: Pool) -> None:
    """The queued prefills, up to PREFILL_BATCH per program (the batch padded to a power
    of two with empty rows). A job (`Prefill`) writes seq's tokens [lo, hi) at cache
    slots offset + their index, in chunks of C aligned at the end: the k-th of K calls
    feeds each job its chunk k - (K - its chunks), or nothing before its first chunk with
    a real token, so every job's last chunk is in the last call and its logits row ends
    with the logits after its last token (and a hybrid model's state row with the state
    after it: the first chunk reads the job's start, the later ones its own row). A
    batch of one chunk each runs in the narrowest window (page_size times a power of
    two) that holds every job's tokens: a prompt shorter than a chunk, an observation of
    a few tokens appended (`TurnSession`)."""
    C, e = pool.C, pool.engine
    jobs, pool.prefills = [Prefill(*j) for j in pool.prefills], []
    for at in range(0, len(jobs), PREFILL_BATCH):
        batch = jobs[at : at + PREFILL_BATCH]
        b = 1 << (len(batch) - 1).bit_length()
        chunks = [len(j.seq) // C for j in batch]
        K = max(chunks)
        widest = max(len(j.pages) for j in batch)  # columns: a power of two >= pages, at most M
        table = np.zeros((b, min(pool.M, 1 << max(1, widest - 1).bit_length())), np.int32)
        start = np.zeros(b, np.int32)
        index = np.full(b, pool.scratch, np.int32)
        for i, job in enumerate(batch):
            table[i, : len(job.pages)], start[i], index[i] = job.pages, job.first, job.row
        owns = []
        W = C  # tokens per call: one chunk's window that holds every job's tokens
        most = max(j.hi - j.lo for j in batch)
        while K == 1 and W // 2 % pool.PS == 0 and W // 2 >= max(most, 1):
            W //= 2
        for k in range(K):
            tokens = np.full((b, W), e.pad_id, np.int32)
            mask = np.zeros((b, W), bool)
            length = np.zeros(b, np.int32)
            states = np.full((2, b), NO_STATE, np.int32)  # a hybrid model's (from, to)
            for i, job in enumerate(batch):
                seq, lo, hi, offset = job.seq, job.lo, job.hi, job.offset
                c = k - (K - chunks[i])
                if c < lo // C:
                    continue  # before its first chunk with a real token
                at = min(lo, C - W) if W < C else c * C  # (W < C: one chunk, c = 0)
                tokens[i] = seq[at : at + W]
                where = np.arange(at, at + W)
                mask[i] = (where >= lo) & (where < hi)
                length[i] = offset + at
                if job.state is not None:
                    states[:, i] = (job.state[0] if c == lo // C else job.state[1], job.state[1])
            with out_of_memory(pool):
                pool.pages, pool.prompt_logits, own = e.prefill(
                    pool.weights,
                    pool.pages,
                    pool.prompt_logits,
                    *e.put((index, tokens, mask, table, start, length)),
                    e.put(tuple(states)) if e.cfg.hybrid else None,
                )
            owns.append(own)
            pool.stats["prefill_calls"] += 1
        if owns[0] is not None and any(j.record is not None for j in batch):
            owns = jax.device_get(owns)  # K x [b, W, L, k]
            for i, job in enumerate(batch):
                if job.record is not None:  # its chunks, in the last chunks[i] calls
                    got = np.concatenate([o[i] for o in owns[K - chunks[i] :]], axis=0)
                    shift = min(job.lo, C - W)  # where the window starts (0: W == C)
                    job.record(got[job.lo - shift : job.hi - shift])


# ---------------------------------------------------------------------------- slots
def need(pool: Pool, s: int) -> int:
    """Pages slot s lacks for its next chunk of steps."""
    h = pool.host
    end = int(h["length"][s]) + int(h["budget"][s]) - int(h["n"][s])
    want = min(int(h["length"][s]) + pool.engine.chunk_steps, end)
    return max(0, -(-want // pool.PS) - len(pool.owner[s].table))


def short(pool: Pool, cost: int) -> int:
    """Pages the pool lacks to seat a row whose prefill takes `cost` pages and still give
    every occupied slot its next chunk (> 0: a row taken in now would be preempted at
    once, its prefill wasted)."""
    reserve = sum(need(pool, s) for s in pool.order)
    return cost + -(-pool.engine.chunk_steps // pool.PS) + 1 + reserve - len(pool.free)


def seat(
    pool: Pool,
    s: int,
    holder,
    *,
    start: int,
    length: int,
    n: int,
    budget: int,
    row: int,
    prompt: int,
    state=None,
    state_from=None,
):
    """`holder` takes free slot s: its page table `holder.table`, cache slots [start,
    length) valid, n tokens drawn before (the next one's key index), its first draw from
    logits row `prompt`, row index `row` (its keys), `budget` its draw limit. A hybrid
    model's row decodes in state row `state` (None: `state_row(pool, s)`), starting from
    state row `state_from` (None: that one, which its prefill wrote)."""
    h, pad = pool.host, pool.engine.pad_id
    if "state" in h:
        h["state"][s] = state_row(pool, s) if state is None else state
        h["state_from"][s] = h["state"][s] if state_from is None else state_from
    h["table"][s] = 0
    h["table"][s, : len(holder.table)] = holder.table
    h["start"][s], h["length"][s], h["cap"][s] = start, length, len(holder.table) * pool.PS
    h["last"][s], h["fresh"][s], h["live"][s], h["stopped"][s] = pad, True, True, False
    h["n"][s], h["budget"][s], h["row"][s], h["prompt"][s] = n, budget, row, prompt
    h["tokens"][s], h["logprobs"][s] = pad, 0
    if "routes" in h:
        h["routes"][s] = -1
    pool.owner[s] = holder
    pool.order.append(s)


def vacate(pool: Pool, s: int) -> None:
    pool.owner[s] = None
    pool.order.remove(s)
    pool.host["live"][s] = False
    if "state" in pool.host:  # an empty slot in a decode program writes no state row
        pool.host["state"][s] = pool.host["state_from"][s] = NO_STATE


def state_row(pool: Pool, s: int) -> int:
    """Slot s's recurrent-state row (a hybrid model's): after the logits rows'."""
    return pool.scratch + 1 + s


def grow(pool: Pool, preempt, evict=lambda: False) -> None:
    """Pages for the next chunk of every occupied slot, oldest first. When the pool runs
    short, `evict()` frees pages held outside the slots while it can (-> whether it
    did), then the youngest slots are preempted (`preempt(s)`), so the oldest always
    advances."""
    h = pool.host
    for s in list(pool.order):
        u = pool.owner[s]
        if u is None:
            continue
        want = need(pool, s)
        while want > len(pool.free) and evict():
            pass
        while want > len(pool.free) and pool.order[-1] != s:
            preempt(pool.order[-1])
        new = take(pool, min(want, len(pool.free)))
        h["table"][s, len(u.table) : len(u.table) + len(new)] = new
        u.table, u.mine = u.table + new, u.mine + new
        h["cap"][s] = len(u.table) * pool.PS
    in_use = pool.total - 1 - len(pool.free)
    pool.stats["peak_pages"] = max(pool.stats["peak_pages"], in_use)


def decode(pool: Pool) -> dict:
    """One decode chunk of the occupied slots -> the slots' host arrays after it. The
    program runs over those slots and the table cut to the most pages any of them holds
    (`PagedSampler.decode_slots`)."""
    held = max(len(pool.owner[s].table) for s in pool.order)
    with out_of_memory(pool):
        pool.pages, pool.host = pool.engine.decode_slots(
            pool.weights,
            pool.pages,
            pool.host,
            pool.order,
            held,
            pool.prompt_logits,
            pool.seed_step,
            pool.stops,
            pool.spec,
        )
    pool.stats["decode_chunks"] += 1
    return pool.host
