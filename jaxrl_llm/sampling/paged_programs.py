"""The paged engine's device programs: the page pool, the paged forward and the decode /
prefill chunks that `paged.PagedSampler` jits.

    pages = init_pages(model_cfg, pages=512, page_size=16)         # a zero pool (`Pages`)
    hidden, pages, routes, state = forward_paged(cfg, params, pages, tokens, mask, table, ...)
    pages, slots = decode_chunk(cfg, params, pages, slots, prompt_logits, key, stops, steps, spec)
    pages, prompt_logits, routes = prefill_chunk(cfg, params, pages, prompt_logits, index, ...)

A hybrid model (Qwen3.5) keeps its full-attention layers' keys/values in the pages and
each sequence's Gated DeltaNet state (`gated_deltanet.LinearState`: the last K - 1
convolution inputs and the [Hv, Dk, Dv] float32 recurrence, per DeltaNet layer) in one
of the pool's state rows (`Pages.state`, [L', R, ...]), which does not grow with the
sequence. A call reads each sequence's state from one row and writes it to another (a
prompt's rows start from its prefill's row; `NO_STATE`: start from zero, or write
nowhere).

These are pure functions of device arrays (shapes in their docstrings), kept apart from the
host side (`paged.PagedSampler`: programs, sizes, results; `paged_turns.TurnSession`: slots
and pages between chunks) so the math reads on its own and a benchmark or test can run it
without an engine. `row_bucket` and `table_width` pick the few program shapes the host
compiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm import models
from jaxrl_llm.models.gated_deltanet import LinearState, zero_state
from jaxrl_llm.sampling.paged_pool import NULL_PAGE
from jaxrl_llm.sampling.sampling import sample_tokens
from jaxrl_llm.sampling.spec import RolloutSpec


@struct.dataclass
class Pages:
    """The page pool of every layer: k, v [L, pages, page_size, K, H] (page 0: null), or
    head-major [K, L, pages, page_size, H] when `pallas` (decode runs the Pallas TPU
    kernel, which reads a layer's pages as [K, pages, page_size, H]). A model with full
    layers of their own head size (`cfg.split_attention`): k, v hold its sliding layers
    and `wide` the full layers' (k, v) [Lg, pages, page_size, Kg, Hg], over the same page
    ids (a page holds the same slots of every layer). A hybrid model: k, v hold its
    full-attention layers and `state` the DeltaNet state rows, a `LinearState` of conv
    [L', R, K - 1, C] and ssm [L', R, Hv, Dk, Dv] (float32)."""

    k: jax.Array
    v: jax.Array
    pallas: bool = struct.field(pytree_node=False, default=False)
    wide: tuple | None = None
    state: LinearState | None = None

    @property
    def page_size(self) -> int:
        return self.k.shape[3 if self.pallas else 2]

    @property
    def pools(self):
        """The pools as `models.paged_forward` takes them: (k, v), or with `wide` the
        pair ((k, v), wide)."""
        return (self.k, self.v) if self.wide is None else ((self.k, self.v), self.wide)

    def with_pools(self, pools) -> Pages:
        """The inverse of `pools`."""
        if self.wide is None:
            return self.replace(k=pools[0], v=pools[1])
        (k, v), wide = pools
        return self.replace(k=k, v=v, wide=wide)


def init_pages(
    cfg, pages: int, page_size: int, dtype=jnp.float32, pallas: bool = False, state_rows: int = 0
) -> Pages:
    """A zero pool; a hybrid model's with `state_rows` zero DeltaNet state rows."""
    L, K, H = cfg.cache_layers(), cfg.num_kv_heads, cfg.head_dim  # layers keeping keys
    shape = (K, L, pages, page_size, H) if pallas else (L, pages, page_size, K, H)
    wide = None
    if cfg.split_attention:
        if pallas:
            raise ValueError("the Pallas page pool holds one head size; this model has two")
        Kg, Hg = cfg.full_kv_heads, cfg.full_head_dim
        wide_shape = (cfg.cache_layers("wide"), pages, page_size, Kg, Hg)
        wide = (jnp.zeros(wide_shape, dtype), jnp.zeros(wide_shape, dtype))
    state = None
    if cfg.hybrid:
        state = zero_state(cfg, state_rows, dtype, (sum(cfg.linear_layers),))
    k, v = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    return Pages(k=k, v=v, pallas=pallas, wide=wide, state=state)


def read_state(pages: Pages, rows):
    """The DeltaNet state of state rows `rows` [B] ([L', B, ...]; zeros at `NO_STATE`),
    or None for a model without one."""
    if pages.state is None:
        return None
    return jax.tree.map(lambda c: jnp.take(c, rows, axis=1, mode="fill", fill_value=0), pages.state)


def write_state(pages: Pages, rows, state) -> Pages:
    """pages with `state` [L', B, ...] written to state rows `rows` [B] (`NO_STATE`: not
    written)."""
    if pages.state is None:
        return pages
    put = lambda c, x: c.at[:, rows].set(x.astype(c.dtype), mode="drop")  # noqa: E731
    return pages.replace(state=jax.tree.map(put, pages.state, state))


def gather_pages(pages: Pages, table):
    """The keys/values of each sequence in slot order: table [B, M] page ids ->
    (k, v) [L, B, M * page_size, K, H] (with `Pages.wide`, the pair of those of the
    sliding layers and of the full layers). The portable pool layout only."""
    if pages.pallas:
        raise ValueError("the gather path reads the portable pool layout, not the Pallas one")
    B, M = table.shape

    def gather(pool):
        L, _, S, K, H = pool.shape
        return jnp.take(pool, table, axis=1).reshape(L, B, M * S, K, H)

    return jax.tree.map(gather, pages.pools)


IMPLS = ("pages", "gather")  # forward_paged's attention paths
ATTENTION = ("auto", "pages", "gather", "pallas")  # PagedSampler's attention settings


def uses_pallas(cfg, attention: str, dtype, backend: str, page_size: int = 16) -> bool:
    """Whether the engine's pool is the Pallas kernel's (decode steps run the TPU kernel):
    `attention="pallas"`, or "auto" on TPU for a model without sliding-window layers, a
    bfloat16 pool (the kernel reads keys and values in bfloat16, so a float32 pool keeps
    the portable path's precision), head_dim a multiple of 128 and page_size of 16 (the
    kernel's VMEM blocks [pages, page_size, head_dim] on Mosaic's bfloat16 tiling; other
    shapes keep the portable path rather than risk a kernel that does not lower)."""
    if attention == "pallas":
        return True
    return (
        attention == "auto"
        and backend == "tpu"
        and not cfg.windowed
        and not cfg.split_attention
        and jnp.dtype(dtype) == jnp.bfloat16
        and cfg.head_dim % 128 == 0
        and page_size % 16 == 0
    )


def forward_paged(
    cfg,
    params,
    pages: Pages,
    tokens,
    mask,
    table,
    start,
    length,
    layers=None,
    impl: str = "pages",
    state=None,
):
    """tokens [B, T] (mask [B, T]) after each sequence's slots [start, length) in its pages
    -> (final-normed hidden [B, T, D], pages with the real tokens' keys/values written at
    slots length .. length + T - 1, the MoE layers' top-k experts of the tokens
    [B, T, L, k] or None for a dense model, a hybrid model's DeltaNet state after the
    real tokens or None). Masked tokens write to the null page. state: a hybrid model's
    state of each sequence before the tokens, [L', B, ...] (`read_state`).

    impl: "pages", each layer writes its new keys/values to its pages and attends to
    them in place through the table (`models.paged_forward`; decode calls run the Pallas
    TPU kernel when the pool is its layout, `Pages.pallas`); "gather", the portable
    reference: every layer's pages gathered into a dense [L, B, M * page_size] prefix,
    `models.forward_after_prefix` over it, the new keys/values scattered after. The
    two agree within rounding at the real tokens (hidden and routes of masked tokens
    are not read)."""
    if impl == "pages":
        hidden, pools, own, state = models.paged_forward(
            cfg,
            params,
            tokens,
            mask,
            pages.pools,
            table,
            start,
            length,
            layers,
            null_page=NULL_PAGE,
            pallas=pages.pallas,
            state=state,
        )
        return hidden, pages.with_pools(pools), own, state
    if impl != "gather":
        raise ValueError(f"forward_paged: impl={impl!r}, expected one of {IMPLS}")
    if cfg.hybrid:  # forward_after_prefix carries keys/values, not a recurrent state
        raise ValueError("forward_paged: impl='gather' has no recurrent state (hybrid model)")
    B, T = tokens.shape
    prefix = gather_pages(pages, table)
    slot = jnp.arange(pages.page_size * table.shape[1])
    before = (slot[None] >= start[:, None]) & (slot[None] < length[:, None])
    hidden, new, own = models.forward_after_prefix(
        cfg, params, tokens, mask, prefix, before, with_routes=True, layers=layers
    )  # new: the tokens' (k, v) [L, B, T, K, H], as the pools
    index = length[:, None] + jnp.arange(T)[None]  # [B, T] slot of each token
    M, S = table.shape[1], pages.page_size
    page = jnp.take_along_axis(table, jnp.minimum(index // S, M - 1), axis=1)
    page = jnp.where(mask, page, NULL_PAGE)
    offset = index % S
    pools = jax.tree.map(
        lambda pool, x: pool.at[:, page, offset].set(x.astype(pool.dtype)), pages.pools, new
    )
    return hidden, pages.with_pools(pools), own, None


def row_bucket(rows: int, slots: int) -> int:
    """Slots a decode program runs for `rows` occupied ones: a power of two or 1.5x one
    (4, 6, 8, 12, 16, 24, ...), at least 4 (a smaller program saves little) and at most
    `slots`: a few compiled programs, and at most a third of a program's rows empty (where
    a step's cost follows its rows, as on CPU, the empty ones are paid in full)."""
    b = max(4, 1 << max(0, rows - 1).bit_length())
    if b >= 8 and rows <= 3 * b // 4:
        b = 3 * b // 4
    return min(slots, b)


def table_width(pages: int, limit: int) -> int:
    """Page-table columns a program reads for sequences of up to `pages` pages: a power
    of two >= pages (at least 2), at most `limit`: a few compiled programs."""
    return min(limit, 1 << max(1, pages - 1).bit_length())


@struct.dataclass
class Slots:
    """The decode slots (device arrays [S] unless noted); the host fills and reads them
    between chunks."""

    table: jax.Array  # [S, M] int32 page ids
    start: jax.Array  # first valid slot (padding before it)
    length: jax.Array  # slots written (the next token's slot)
    cap: jax.Array  # slots the sequence's pages hold
    last: jax.Array  # the pending token (drawn, not yet in the cache)
    fresh: jax.Array  # bool: nothing drawn yet; the first draw reads the prompt's logits
    live: jax.Array  # bool: drawing
    stopped: jax.Array  # bool: ended by a stop id
    n: jax.Array  # tokens drawn by the row
    budget: jax.Array  # the row's max_new_tokens
    row: jax.Array  # the row's index in the request (its random key)
    prompt: jax.Array  # the row's prompt index (which logits a fresh slot reads)
    tokens: jax.Array  # [S, T] int32
    logprobs: jax.Array  # [S, T] float32
    # MoE models: the experts of each drawn token, recorded in the step that feeds it
    # (the last drawn token is never fed: -1); [S, T, L, k] int16. None: dense model.
    routes: jax.Array | None = None
    # A hybrid model: the slot's DeltaNet state row (`Pages.state`), written after the
    # chunk, and the row the chunk starts from (its prompt's for a row that has not fed a
    # token yet, then its own); `NO_STATE` in an empty slot. None: no recurrent state.
    state: jax.Array | None = None
    state_from: jax.Array | None = None


def _draw(key, rows, counts, logits, spec: RolloutSpec):
    """One draw per slot with its own key: fold_in(fold_in(key, row), count)."""
    keys = jax.vmap(lambda r, c: jax.random.fold_in(jax.random.fold_in(key, r), c))(rows, counts)

    def one(k, lg):
        tok, lp = sample_tokens(k, lg[None], spec.temperature, spec.top_k, spec.top_p)
        return tok[0], lp[0]

    return jax.vmap(one)(keys, logits)


def decode_chunk(
    cfg,
    params,
    pages: Pages,
    s: Slots,
    prompt_logits,
    key,
    stops,
    steps,
    spec,
    impl: str = "pages",
    layers=None,
):
    """Up to `steps` decode steps of every slot (a slot steps while it is live and its
    pages have room) -> (pages, slots). One step: the pending token of each slot goes
    through the model (fresh slots: none, they read their prompt's logits), then every
    live slot draws its next token. impl: `forward_paged`'s; layers: unrolled layers'
    parameters already sliced (`PagedSampler.weights`), else sliced here."""
    S, T = s.tokens.shape
    every = jnp.arange(S)
    # Unrolled layers (scan_layers=False): their parameters sliced once, not every step.
    if layers is None and not cfg.scan_layers:
        layers = models.layer_params(params)

    def body(carry):
        i, pages, s, state = carry
        feed = s.live & ~s.fresh & (s.length < s.cap)
        hidden, pages, own, state = forward_paged(
            cfg,
            params,
            pages,
            s.last[:, None],
            feed[:, None],
            s.table,
            s.start,
            s.length,
            layers,
            impl,
            state,
        )
        logits = models.project(cfg, params, hidden[:, 0])
        logits = jnp.where(s.fresh[:, None], jnp.take(prompt_logits, s.prompt, axis=0), logits)
        draw = s.live & (s.fresh | feed)
        tok, lp = _draw(key, s.row, s.n, logits, spec)
        col = jnp.minimum(s.n, T - 1)
        put = lambda buf, x: buf.at[every, col].set(jnp.where(draw, x, buf[every, col]))  # noqa: E731
        routes = s.routes
        if routes is not None:  # the fed token (drawn n - 1) is routed in this step
            fed = jnp.maximum(s.n - 1, 0)
            old = routes[every, fed]
            routes = routes.at[every, fed].set(
                jnp.where(feed[:, None, None], own[:, 0].astype(routes.dtype), old)
            )
        n = s.n + draw
        hit = draw & jnp.isin(tok, stops)
        s = s.replace(
            length=s.length + feed,
            last=jnp.where(draw, tok, s.last),
            fresh=s.fresh & ~draw,
            live=s.live & ~hit & ~(draw & (n >= s.budget)),
            stopped=s.stopped | hit,
            n=n,
            tokens=put(s.tokens, tok),
            logprobs=put(s.logprobs, lp),
            routes=routes,
        )
        return i + 1, pages, s, state

    def more(carry):
        i, _, s, _ = carry
        return (i < steps) & jnp.any(s.live & (s.fresh | (s.length < s.cap)))

    # The slots' DeltaNet state is read from the pool once, carried densely through the
    # steps and written back once (a masked step leaves a row's state as it was).
    state = read_state(pages, s.state_from)
    _, pages, s, state = jax.lax.while_loop(more, body, (jnp.int32(0), pages, s, state))
    if state is not None:
        pages, s = write_state(pages, s.state, state), s.replace(state_from=s.state)
    return pages, s


def prefill_chunk(
    cfg,
    params,
    pages: Pages,
    prompt_logits,
    index,
    tokens,
    mask,
    table,
    start,
    length,
    impl: str = "pages",
    layers=None,
    states=None,
):
    """One chunk of each of b sequences (tokens, mask [b, C]) into their pages; the logits
    after each one's last real token go to prompt_logits[index] (index [b]) -> (pages,
    prompt_logits, the chunk's MoE routes [b, C, L, k] int16, -1 at masked tokens; None:
    dense model). A row with no real token writes only to the null page (its logits row
    is not read). impl, layers: `decode_chunk`'s. states: a hybrid model's (from, to)
    [b] state rows each sequence's DeltaNet state is read from and written to."""
    state = None if states is None else read_state(pages, states[0])
    hidden, pages, own, state = forward_paged(
        cfg, params, pages, tokens, mask, table, start, length, layers, impl, state
    )
    if state is not None:
        pages = write_state(pages, states[1], state)
    logits = models.project(cfg, params, models.last_hidden(hidden, mask))
    if own is not None:
        own = jnp.where(mask[:, :, None, None], own.astype(models.ROUTE_DTYPE), -1)
    return pages, prompt_logits.at[index].set(logits), own


def ahead_of_time(engine, params, rows: int, prompts: int, width: int, spec) -> list:
    """`engine`'s (a `paged.PagedSampler`) decode chunk (every slot, the full page table)
    and prefill chunk (one per prompt) with abstract arguments at the sizes a session
    picks for `prompts` prompts of `width` tokens giving `rows` rows, its state replicated
    on the mesh as the engine puts it: [(name, jitted program, args, kwargs)] for
    compiling ahead of a run (`jaxrl_llm.tpu.compile_for`)."""
    cfg, T = engine.cfg, spec.max_new_tokens
    S, PS, C = engine.slots or rows, engine.page_size, engine.prefill_chunk
    pages = engine.pages or 1 + -(-rows * (width + T) // PS)
    M = -(-(-(-(width + T) // C) * C + C) // PS)  # page-table columns (`paged_pool.fit`)
    everywhere = NamedSharding(engine.mesh, P())

    def a(shape, dt=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dt, sharding=everywhere)

    dtype = jax.tree.leaves(params)[0].dtype
    prompt_rows = min(prompts, S + 1)  # `PagedSampler.stream`'s; state rows as `Pool`'s
    shapes = engine.pool(cfg, pages, PS, dtype, shapes=True, state_rows=prompt_rows + 1 + S)
    pool = jax.tree.map(lambda x: a(x.shape, x.dtype), shapes)
    routes = None
    if cfg.moe:
        routes = a((S, T, cfg.num_layers, cfg.num_experts_per_tok), models.ROUTE_DTYPE)
    rows = {k: a((S,)) for k in ("state", "state_from")} if cfg.hybrid else {}
    ints = {k: a((S,)) for k in ("start", "length", "cap", "last", "n", "budget", "row", "prompt")}
    flags = {k: a((S,), bool) for k in ("fresh", "live", "stopped")}
    slots = Slots(
        table=a((S, M)),
        tokens=a((S, T)),
        logprobs=a((S, T), jnp.float32),
        routes=routes,
        **ints,
        **flags,
        **rows,
    )
    logits = a((prompt_rows + 1, cfg.vocab_size), jnp.float32)
    weights = (params, None)  # an unrolled model's layers are then sliced in the program
    decode_args = (weights, pool, slots, logits, a((2,), jnp.uint32), a((1,)))
    b = 1 << (prompts - 1).bit_length()
    prefill_args = (weights, pool, logits, a((b,)), a((b, C)), a((b, C), bool), a((b, M)))
    prefill_args += (a((b,)), a((b,)), (a((b,)), a((b,))) if cfg.hybrid else None)
    return [
        ("paged decode", engine.decode, decode_args, dict(steps=engine.chunk_steps, spec=spec)),
        ("paged prefill", engine.prefill, prefill_args, {}),
    ]
