"""The paged engine's single-turn host side: a `Session` queues requests' rows on a
`paged_turns.TurnSession` whose rows end at their first turn, and collects what they drew.

    session = Session(engine, params, version, spec, seed=0, step=s, slots=S, pages=P, ...)
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

One scheduler serves both: a single-turn row is a multi-turn row whose first turn is its
last (its turn stops are the spec's stop ids, its turn budget its max_new_tokens), ended
(its pages given back) as soon as its turn ends. Admission, prompt pages shared by a
prompt's G rows, preemption and recompute, a hybrid model's state rows and MoE routes are
`TurnSession`'s.

Row r of a request submitted with key_base k draws with key
fold_in(fold_in(fold_in(key(seed), step), k + r), t) for its t-th token, whatever slot,
chunk, neighbours or parameters it had.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_llm.parallel import mesh as mesh_lib
from jaxrl_llm.sampling.decode import FINISH_LENGTH, FINISH_STOP, SampleOutput
from jaxrl_llm.sampling.paged_turns import TurnSession


@dataclasses.dataclass
class _Request:
    """A submitted batch: its prompts (bucketed), its rows' trajectories as they end, and
    how many of its rows have not ended."""

    ids: np.ndarray
    mask: np.ndarray
    ended: dict  # row -> its `paged_rows.Traj`
    left: int


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
        seed: int,
        step: int,
        slots: int,
        pages: int,
        prompt_rows: int,
    ):
        # A row holds a hybrid model's state row only while it holds a slot (it ends
        # when its turn does, and a preempted row is recomputed): no holders beyond them.
        self.turns = TurnSession(
            engine,
            params,
            version,
            spec,
            seed=seed,
            step=step,
            slots=slots,
            pages=pages,
            prompts=prompt_rows,
            holders=0,
        )
        self.requests: dict = {}
        self.done: list = []  # keys of requests whose rows all ended, in completion order

    stats = property(lambda self: self.turns.stats, doc="The pool's counters (`Pool.stats`).")
    version = property(lambda self: self.turns.version, doc="The parameters' version.")

    def submit(
        self, key, ids: np.ndarray, mask: np.ndarray, budgets: np.ndarray, key_base: int = 0
    ) -> None:
        """Queues the G rows of every prompt of ids / mask [B, width] (bucketed), after
        the rows already waiting; budgets [B * G] max_new_tokens per row."""
        rows = self.turns.submit(ids, mask, budgets, name=key, key_base=int(key_base))
        self.requests[key] = _Request(ids=ids, mask=mask, ended={}, left=len(rows))
        if not rows:  # dummy rows draw nothing
            self.done.append(key)

    @property
    def busy(self) -> bool:
        """Rows wait or decode, or a finished request was not collected yet."""
        return bool(self.in_flight or self.done)

    @property
    def in_flight(self) -> bool:
        """Rows wait for a slot or hold one."""
        return self.turns.busy

    def swap(self, params, version: int) -> None:
        """Decodes on with `params` (version `version`). Rows in flight are preempted and
        come back prefilled by them (their tokens so far kept, with their versions); the
        prompts' pages and first-draw logits are dropped, so they are prefilled anew."""
        self.turns.swap(params, version)

    def run_chunk(self) -> list:
        """Admits waiting rows, decodes one chunk of every slot, collects the rows that
        ended -> the keys of requests finished since the last call, in completion order."""
        for row in self.turns.run_chunk():
            key, r = row
            req = self.requests[key]
            req.ended[r] = self.turns.result(row)
            self.turns.end(row, forget=True)
            req.left -= 1
            if req.left == 0:
                self.done.append(key)
        done, self.done = self.done, []
        return done

    def output(self, key):
        """A finished request's results -> (`SampleOutput` on the engine's rows,
        token_versions [N, T]: the version that drew each token, -1 past each row's end).
        Each row's policy_version is the version of its first token; MoE routes: its
        prompt's from their first prefill, then its drawn tokens'."""
        req, turns = self.requests.pop(key), self.turns
        B, T = req.ids.shape[0], turns.pool.spec.max_new_tokens
        prompts = {
            b: turns.prompt_routes.pop((key, b))
            for b in range(B)
            if (key, b) in turns.prompt_routes
        }
        out, tv = rows_output(turns.pool, req.ids, req.mask, req.ended, T, prompts)
        row_sharding = turns.pool.engine.row_sharding
        return mesh_lib.put(out, row_sharding), tv


def rows_output(pool, ids, mask, rows: dict, T: int, prompt_routes: dict):
    """Rows {i: `paged_rows.Traj`} of the B * G over prompts ids / mask [B, width]
    (missing: a row that drew nothing) -> (`SampleOutput` on the host, T columns,
    token_versions [B * G, T]: the version that drew each token, -1 on appended ones and
    past the end). Sampled tokens have loss mask 1, appended ones 0; finish FINISH_STOP
    where the row's last turn stopped, else FINISH_LENGTH; policy_version the version of
    a row's first token (a row without one: the oldest of the others, or the pool's)."""
    e, G = pool.engine, pool.spec.num_generations
    n = ids.shape[0] * G
    tokens = np.full((n, T), e.pad_id, np.int32)
    real, sampled = np.zeros((n, T), bool), np.zeros((n, T), bool)
    logprobs = np.zeros((n, T), np.float32)
    tv = np.full((n, T), -1, np.int32)
    lengths, stopped = np.zeros(n, np.int32), np.zeros(n, bool)
    first = np.full(n, -1, np.int64)
    for i, t in rows.items():
        L = lengths[i] = len(t.tokens)
        tokens[i, :L], real[i, :L], sampled[i, :L] = t.tokens, True, t.sampled
        logprobs[i, :L], tv[i, :L], stopped[i] = t.logprobs, t.versions, t.stopped
        first[i] = next((v for v in t.versions if v >= 0), -1)
    oldest = first[first >= 0].min() if (first >= 0).any() else pool.version
    routes = None
    if e.cfg.moe:
        routes = static_routes(
            e.cfg, ids, mask, n, T, prompt_routes, {i: t.routes for i, t in rows.items()}
        )
    out = SampleOutput(
        tokens=tokens,
        mask=real,
        loss_mask=sampled,
        logprobs=logprobs,
        lengths=lengths,
        finish=np.where(stopped, FINISH_STOP, FINISH_LENGTH).astype(np.int32),
        prompt_tokens=np.repeat(ids, G, axis=0),
        prompt_mask=np.repeat(mask, G, axis=0),
        policy_version=np.where(first >= 0, first, oldest).astype(np.int32),
        num_generations=G,
        routes=routes,
    )
    return out, tv


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
