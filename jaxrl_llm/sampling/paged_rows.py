"""A row of the paged engine's turn session (`paged_turns.TurnSession`) on the host: its
record (`Traj`: its completion so far, the pages it holds, its MoE routes), the pages it
takes to be seated (`cost`) and the prefill that seats it (`queue_prefill`): a first turn
on its prompt's shared pages, the pending token and an observation appended on its own,
or, after an eviction or a preemption, its completion recomputed on its prompt's pages
while they are there, else its prompt and completion.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxrl_llm.sampling import paged_pool as pp


@dataclasses.dataclass
class Traj:
    """A row's trajectory on the host: its completion so far and the pages it holds."""

    row: object  # its name (an int, or (name, r) for `submit(..., name=name)`)
    b: object  # its prompt (an index of `submit`'s batch, or ("row", r) for `add`)
    key: int  # its keys' row index
    prompt: np.ndarray  # the prompt's real ids
    tokens: list = dataclasses.field(default_factory=list)  # completion: sampled and appended
    sampled: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)  # -1 on appended tokens
    at: list = dataclasses.field(default_factory=list)  # completion index of each sampled one
    n: int = 0  # sampled tokens so far (the next draw's key index)
    seated: int = 0  # n when it took its slot (its slot's routes start there)
    budget: int = 0  # n at which the current turn ends
    turn_from: int = 0  # completion index where the current turn began
    stopped: bool = False  # the last turn ended on a stop id
    table: list = dataclasses.field(default_factory=list)  # pages: the prompt's, then its own
    mine: list = dataclasses.field(default_factory=list)  # its own pages
    shared: int | None = None  # the prompt whose pages it references
    start: int = 0  # first valid cache slot
    length: int = 0  # cache slots written
    base: int = 0  # cache slot of completion token 0
    routes: np.ndarray | None = None  # MoE: [T, L, k] int16 per completion token, -1: none
    fed: int = 0  # completion tokens whose routes are recorded (a prefix)
    state: int | None = None  # a hybrid model's own recurrent-state row, while it has pages

    @property
    def cached(self) -> int:
        """Completion tokens in the cache (the pending token and an observation not yet
        appended are not)."""
        return self.length - self.base if self.table else 0


def record_routes(t: Traj, first: int, routes: np.ndarray) -> None:
    """Routes [m, L, k] of t's completion tokens first .. first + m - 1 (a negative
    index: a prompt token), fed by a prefill: kept where t has none yet (a token's
    routes are its first feed's)."""
    end = first + len(routes)
    if end > t.fed:
        t.routes[t.fed : end] = routes[t.fed - first :]
        t.fed = end


def cost(pool, t: Traj) -> int:
    """Pages t takes to be seated (its prefill, before its first chunk)."""
    if t.table:
        return max(0, -(-(t.length + len(t.tokens) - t.cached) // pool.PS) - len(t.table))
    if t.tokens and t.b in pool.prompt_pages:  # its completion on its prompt's pages
        return -(-len(t.tokens) // pool.PS)
    if t.tokens:
        return pp.pages_of(pool, len(t.prompt) + len(t.tokens))
    return 0 if t.b in pool.prompt_pages else pp.pages_of(pool, len(t.prompt))


def queue_prefill(pool, prompt_routes: dict, t: Traj, s: int) -> int | None:
    """Queues the prefill that seats t in slot s of `pool` (its state row, a hybrid
    model's, taken) -> the logits row of its next draw, or None when the pool lacks the
    pages or a logits row: a row parked with its pages appends its pending token and
    observation; one evicted or preempted recomputes its completion on its prompt's
    pages while they are there, else its prompt and completion; a first turn takes its
    prompt's pages (the prompt's first row prefills them). MoE routes go to t
    (`record_routes`), a prompt's to `prompt_routes`."""
    logits = pool.scratch + 1 + s
    if t.tokens and not t.table and t.b in pool.prompt_pages:
        # Evicted or preempted while its prompt's pages stayed: it takes them again
        # (referenced still, unless a swap dropped them and they were prefilled anew),
        # and only its completion is recomputed, appended on them.
        entry = pool.prompt_pages[t.b]
        if t.shared is None:
            entry[3] += 1
        pool.stats["prompt_kept"] += 1
        t.shared, t.table, t.mine = t.b, list(entry[0]), []
        t.start, t.length, t.base = entry[2], entry[1], entry[1]
    if t.table:  # parked with its pages: the pending token and the observation
        add = t.tokens[t.cached :]
        need = cost(pool, t)
        if need > len(pool.free):
            return None
        new = pp.take(pool, need)
        t.table, t.mine = t.table + new, t.mine + new
        seq = np.full(-(-len(add) // pool.C) * pool.C, pool.engine.pad_id, np.int32)
        seq[: len(add)] = add
        record = None if t.routes is None else functools.partial(record_routes, t, t.cached)
        state = None
        if t.state is not None:  # after its own cached tokens, or its prompt's only
            state = (t.state if t.cached else pool.prompt_pages[t.shared][4], t.state)
        pool.prefills.append(
            pp.Prefill(seq, 0, len(add), t.length, t.start, list(t.table), logits, record, state)
        )
        t.length += len(add)
        pool.stats["appends"] += 1
        return logits
    if t.tokens:  # evicted or preempted: prompt and completion recomputed
        record = None
        if t.routes is not None:  # the prompt's tokens first: completion index -p
            record = functools.partial(record_routes, t, -len(t.prompt))
        seq = np.concatenate([t.prompt, t.tokens]).astype(np.int32)
        got = pp.queue_prefill(pool, seq, logits, record, state_to=t.state)
        if got is None:
            return None
        pages, padded, start = got
        t.table, t.mine = list(pages), [p for p in pages if p != pp.NULL_PAGE]
        t.start, t.length, t.base = start, padded, padded - len(t.tokens)
        return logits
    if t.b not in pool.prompt_pages:  # the first of its prompt's rows
        if not pool.logit_rows:
            return None
        record = None
        if t.routes is not None and t.b not in prompt_routes:
            record = functools.partial(prompt_routes.setdefault, t.b)
        got = pp.queue_prefill(pool, t.prompt, pool.logit_rows[-1], record)
        if got is None:
            return None
        rows = sum(1 for w in pool.waiting if w.b == t.b and not w.tokens and w.shared is None)
        pool.prompt_pages[t.b] = [*got, rows, pool.logit_rows.pop()]
    pages, padded, start, _, row = pool.prompt_pages[t.b]
    t.shared, t.table, t.mine = t.b, list(pages), []
    t.start, t.length, t.base = start, padded, padded
    return row
