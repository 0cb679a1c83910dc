"""The sampler's device programs as pure functions over a resumable `DecodeState`.

    state = start(cfg, params, prompt_ids, prompt_mask, seed_index, spec, ...)  # prefill
    state = decode(cfg, params, state, max_new_tokens, stop_ids, ...)           # sample
    state = append(cfg, params, state, token_ids, token_mask, ...)              # e.g. a tool
    state = refresh(cfg, new_params, state, ...)       # decode on with other parameters
    out = result(state)                                                         # SampleOutput

`start` prefills each of the B prompts once and repeats its KV cache for its G rows
(prompt-major: rows b * G ... b * G + G - 1). `decode` runs a `lax.while_loop` of
single-token steps until every row has stopped (a stop id) or the call's budget is
spent, in cache segments: each loop runs over a cache just long enough for its tokens and
the cache grows between loops (`cache_lengths`). `append` writes given tokens into every
row's cache in one forward, without re-reading earlier tokens; they are marked as not
sampled (loss mask 0, no log-prob). Each call continues where the last one stopped, so
start + decode(a) + decode(b) draws exactly what start + decode(a + b) draws, and
start + append(x) + decode attends to what a prefill of the concatenated prompt would.

Layout. All rows share one slot index (`KVCache.index`); a row that has stopped takes its
slots as invalid ones (never attended to, positions not advanced). The completion
buffers are slot-aligned (column j is cache slot P + j), so a row that stopped before an
append has a hole; `result` compacts every row to its real tokens, left-aligned, which is
what the teacher-forced recompute reads (token t predicted at the position before it).

Routes (mixture-of-experts models). Every token the model reads records the experts its
MoE layers chose for it ([L, k] per token, int16; -1 where none was recorded): the prompt
in the group's prefill, a sampled token in the step that feeds it, appended tokens in the
forward that appends them. The trainer can replay them (`rl.batch`, routing replay), so
that its forwards route each token as the sampler did. A drawn token that is never fed
(the last one) predicts nothing the trainer scores and keeps -1.

Pending token. The token drawn last is not yet in the cache (its hidden state would only
be needed to draw another one): `decode` feeds it at the start of its next step, `append`
feeds it before the appended tokens. `maybe_pending` (static) says whether a state may
hold such tokens, so that the single-turn path (start + decode) does exactly the forward
passes of one prefill and T - 1 decode steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl_llm import models
from jaxrl_llm.models.partitioning import logical_to_sharding
from jaxrl_llm.sampling.sampling import sample_tokens
from jaxrl_llm.sampling.spec import RolloutSpec

FINISH_STOP, FINISH_LENGTH = 1, 2


@struct.dataclass
class SampleOutput:
    """Rollouts, N = B * G rows, prompt-major (the G rows of a prompt are consecutive).

    The completion of row n is tokens[n, :lengths[n]]: sampled tokens and, in multi-turn
    rollouts, appended ones (loss_mask False, log-prob 0)."""

    tokens: jax.Array  # [N, T] int32 completion ids, pad_id after the end
    mask: jax.Array  # [N, T] bool: real completion tokens (attended; the stop token included)
    loss_mask: jax.Array  # [N, T] bool: sampled tokens (a subset of mask)
    logprobs: jax.Array  # [N, T] float32 behaviour log-probs at the spec's temperature; 0 off
    lengths: jax.Array  # [N] int32
    finish: jax.Array  # [N] int32: FINISH_STOP or FINISH_LENGTH
    prompt_tokens: jax.Array  # [N, P] int32, left-padded
    prompt_mask: jax.Array  # [N, P] bool
    policy_version: jax.Array  # [N] int32: the parameter version that sampled the row
    num_generations: int = struct.field(pytree_node=False, default=1)  # G
    # MoE models: the experts each token was routed to, prompt then completion, aligned
    # with concat(prompt_tokens, tokens); [N, P + T, L, k] int16, -1 = not recorded.
    # None for a dense model.
    routes: jax.Array | None = None


@struct.dataclass
class DecodeState:
    """A rollout in progress (device arrays; spec, end and maybe_pending are static)."""

    cache: models.KVCache  # N rows; slots [0, P) the prompt
    prompt_tokens: jax.Array  # [N, P] int32
    prompt_mask: jax.Array  # [N, P] bool
    tokens: jax.Array  # [N, C] int32, column j = cache slot P + j
    mask: jax.Array  # [N, C] bool: real tokens
    appended: jax.Array  # [N, C] bool: written by `append` (not sampled)
    logprobs: jax.Array  # [N, C] float32
    logits: jax.Array  # [N, V] float32 next-token logits (valid when not maybe_pending)
    last: jax.Array  # [N] int32: the pending token
    pending: jax.Array  # [N] bool: `last` is real and not yet in the cache
    done: jax.Array  # [N] bool: stopped by a stop id
    t: jax.Array  # [] int32: draws so far (the key index of the next one)
    key: jax.Array  # typed PRNG key of this rollout
    policy_version: jax.Array  # [N] int32
    spec: RolloutSpec = struct.field(pytree_node=False)
    end: int = struct.field(pytree_node=False)  # bound on slots used, pending included
    maybe_pending: bool = struct.field(pytree_node=False, default=False)
    prompt_routes: jax.Array | None = None  # [N, P, L, k] int16 (MoE models)
    routes: jax.Array | None = None  # [N, C, L, k] int16, column-aligned, -1 = none


@struct.dataclass
class _Loop:
    n: jax.Array  # draws in this decode call
    t: jax.Array
    cache: models.KVCache
    tokens: jax.Array
    mask: jax.Array
    logprobs: jax.Array
    last: jax.Array
    pending: jax.Array
    done: jax.Array
    routes: jax.Array | None = None


def _put_routes(buf, own, col):
    """Routes [N, F, L, k] into the column-aligned buffer [N, C, L, k] at column col."""
    if buf is None:
        return None
    return jax.lax.dynamic_update_slice(buf, own.astype(buf.dtype), (0, col, 0, 0))


def _widen_routes(routes, columns: int):
    if routes is None:
        return None
    pad = max(0, columns - routes.shape[1])
    return jnp.pad(routes, ((0, 0), (0, pad), (0, 0), (0, 0)), constant_values=-1)


def fit_routes(routes, prompt_len: int, prompt_to: int, width: int):
    """`SampleOutput.routes` [N, P + T, L, k] of a rollout whose prompt (P = prompt_len
    columns) is left-padded to `prompt_to` and whose completion columns are cut or padded
    to `width`, as its tokens are; new columns -1 (no route). None stays None."""
    if routes is None:
        return None
    prompt, completion = routes[:, :prompt_len], routes[:, prompt_len : prompt_len + width]
    pad = lambda x, cols: jnp.pad(  # noqa: E731
        x, ((0, 0), cols, (0, 0), (0, 0)), constant_values=-1
    )
    prompt = pad(prompt, (prompt_to - prompt_len, 0))
    completion = pad(completion, (0, width - completion.shape[1]))
    return jnp.concatenate([prompt, completion], axis=1)


def cache_lengths(start: int, count: int, segments: int) -> tuple[int, ...]:
    """KV cache length of each decode segment, for `count` draws after `start` slots; the
    last is start + count.

    A decode step's attention reads every slot of its cache, filled or not. With
    `segments` > 1 the decode loop runs in that many parts, each over a cache just long
    enough for its steps (lengths rounded up to a multiple of 8) and grown in between
    (`models.grow_cache`, one copy of the cache): a token reads the filled slots plus at
    most a segment's worth instead of the full length, for up to `segments` compiled loop
    bodies instead of one. While the cache grows the old and the new one coexist: the
    cache's peak memory is under twice one full-length cache.
    """
    full = start + count
    n = max(1, min(segments, count - 1))
    ends = (start + -(-count * i // n) for i in range(1, n + 1))
    return tuple(sorted({min(full, -(-e // 8) * 8) for e in ends}))


def constrain_cache(cache: models.KVCache, mesh) -> models.KVCache:
    """The cache's rows sharded over ('data', 'fsdp'), its heads as the weights' rules."""
    if mesh is None:
        return cache
    k_axes = ("layers", "batch", "kv_heads", "head_dim", "cache_seq")
    v_axes = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")
    rows = logical_to_sharding(("batch", "cache_seq"), cache.valid.shape, mesh)
    wsc = jax.lax.with_sharding_constraint

    def constrain(c, axes):  # [L, ...] or per layer
        return wsc(c, logical_to_sharding(axes[-c.ndim :], c.shape, mesh))

    return cache.replace(
        k=jax.tree.map(lambda c: constrain(c, k_axes), cache.k),
        v=jax.tree.map(lambda c: constrain(c, v_axes), cache.v),
        valid=wsc(cache.valid, rows),
        pos=wsc(cache.pos, logical_to_sharding(("batch",), cache.pos.shape, mesh)),
    )


def prefill_groups(
    cfg,
    params,
    prompt_ids,
    prompt_mask,
    num_generations: int,
    max_len,
    mesh=None,
    with_routes: bool = False,
):
    """Prefills B prompts once and repeats each cache row G times.

    Returns (last-token logits [B*G, V], cache with B*G rows of length max_len), and with
    `with_routes` the prompt tokens' MoE routes [B*G, P, L, k] int16 (None: dense model).
    """
    B, G = prompt_ids.shape[0], num_generations
    cache = models.init_cache(cfg, B, max_len, params["embed"].dtype)
    logits, cache, own = models.prefill(
        cfg, params, prompt_ids, prompt_mask, constrain_cache(cache, mesh), with_routes=True
    )
    cache = models.cache_rows(cache, jnp.arange(B * G) // G)
    routes = None if own is None else jnp.repeat(own.astype(models.ROUTE_DTYPE), G, axis=0)
    logits, cache = jnp.repeat(logits, G, axis=0), constrain_cache(cache, mesh)
    return (logits, cache, routes) if with_routes else (logits, cache)


def _widen(x, columns: int, fill):
    """[N, C] -> [N, max(C, columns)], new columns = fill (buffers only ever grow)."""
    return jnp.pad(x, ((0, 0), (0, max(0, columns - x.shape[1]))), constant_values=fill)


def start(
    cfg, params, prompt_ids, prompt_mask, seed_index, spec: RolloutSpec, pad_id, segments, mesh=None
) -> DecodeState:
    """Group-shared prefill -> a state ready to `decode`. prompt_ids, prompt_mask [B, P]
    left-padded; seed_index [3] uint32 = (seed, call index, policy version)."""
    # The key is derived on device from (seed, call index): building it on the host would
    # be an implicit transfer, an error under jax.transfer_guard("disallow").
    key = jax.random.fold_in(jax.random.key(seed_index[0]), seed_index[1])
    G, (B, P), T = spec.num_generations, prompt_ids.shape, spec.max_new_tokens
    first = cache_lengths(P, T, segments)[0]
    logits, cache, prompt_routes = prefill_groups(
        cfg, params, prompt_ids, prompt_mask, G, first, mesh, with_routes=True
    )
    N = B * G
    routes = None
    if prompt_routes is not None:
        routes = jnp.full((N, T, *prompt_routes.shape[2:]), -1, prompt_routes.dtype)
    return DecodeState(
        cache=cache,
        prompt_tokens=jnp.repeat(prompt_ids, G, axis=0),
        prompt_mask=jnp.repeat(prompt_mask, G, axis=0),
        tokens=jnp.full((N, T), pad_id, jnp.int32),
        mask=jnp.zeros((N, T), bool),
        appended=jnp.zeros((N, T), bool),
        logprobs=jnp.zeros((N, T), jnp.float32),
        logits=logits,
        last=jnp.full((N,), pad_id, jnp.int32),
        pending=jnp.zeros((N,), bool),
        done=jnp.zeros((N,), bool),
        t=jnp.int32(0),
        key=key,
        policy_version=jnp.full((N,), seed_index[2], jnp.int32),
        spec=spec,
        end=P,
        prompt_routes=prompt_routes,
        routes=routes,
    )


def _write(s, col, tok, lp, live):
    """Draw results into column `col` of the buffers (rows not live: padding, unmasked)."""
    put = lambda buf, x: jax.lax.dynamic_update_slice(buf, x[:, None], (0, col))  # noqa: E731
    return dict(
        tokens=put(s.tokens, tok),
        mask=put(s.mask, live),
        logprobs=put(s.logprobs, lp),
    )


def _draw(state: DecodeState, loop: _Loop, logits, stop_ids, pad_id) -> _Loop:
    """Draws the next token of every live row from logits [N, V] at column index - P."""
    spec = state.spec
    tok, lp = sample_tokens(
        jax.random.fold_in(state.key, loop.t), logits, spec.temperature, spec.top_k, spec.top_p
    )
    live = ~loop.done
    tok = jnp.where(live, tok, pad_id)
    lp = jnp.where(live, lp, 0.0)
    col = loop.cache.index - state.prompt_tokens.shape[1]
    return loop.replace(
        n=loop.n + 1,
        t=loop.t + 1,
        last=tok,
        pending=live,
        done=loop.done | (live & jnp.isin(tok, stop_ids)),
        **_write(loop, col, tok, lp, live),
    )


def decode(
    cfg,
    params,
    state: DecodeState,
    max_new_tokens: int,
    stop_ids,
    pad_id,
    segments,
    mesh=None,
    final: bool = False,
) -> DecodeState:
    """Up to `max_new_tokens` draws per row, until every row has stopped -> new state.

    final (static): the state is not decoded or appended to again (a single-turn rollout).
    A stopped row's cache is then never read again, so its steps need not mark their slots
    invalid (`decode_step` without `real`, one mask less per step)."""
    P = state.prompt_tokens.shape[1]
    need = state.end + max_new_tokens
    stops = jnp.asarray(stop_ids or (-1,), jnp.int32)
    widen = lambda x, fill: _widen(x, need - P, fill)  # noqa: E731
    loop = _Loop(
        n=jnp.int32(0),
        t=state.t,
        cache=state.cache,
        tokens=widen(state.tokens, pad_id),
        mask=widen(state.mask, False),
        logprobs=widen(state.logprobs, 0.0),
        last=state.last,
        pending=state.pending,
        done=state.done,
        routes=_widen_routes(state.routes, need - P),
    )
    if not state.maybe_pending:  # the next token's logits are known: draw it now
        loop = _draw(state, loop, state.logits, stops, pad_id)
    # A per-layer cache (scan_layers=False) runs the layers unrolled: their parameters are
    # sliced once here, not in every decode step (XLA did not hoist those copies).
    layers = None if cfg.scan_layers else models.layer_params(params)

    def body(loop: _Loop) -> _Loop:
        real = None if final else loop.pending
        logits, cache, own = models.decode_step(
            cfg, params, loop.last, loop.cache, layers, real, with_routes=True
        )
        routes = _put_routes(loop.routes, own, loop.cache.index - P)  # the fed token's
        loop = loop.replace(cache=constrain_cache(cache, mesh), routes=routes)
        return _draw(state, loop, logits, stops, pad_id)

    # One loop per cache segment: a step feeds the pending token at slot `index`, so a
    # cache of S slots serves the steps with index < S; then it grows to the next length.
    for S in cache_lengths(state.end, max_new_tokens, segments):
        if S > loop.cache.max_len:
            loop = loop.replace(cache=constrain_cache(models.grow_cache(loop.cache, S), mesh))

        def more(loop, S=S):
            return (loop.n < max_new_tokens) & (loop.cache.index < S) & ~jnp.all(loop.done)

        loop = jax.lax.while_loop(more, body, loop)
    return state.replace(
        cache=loop.cache,
        tokens=loop.tokens,
        mask=loop.mask,
        appended=widen(state.appended, False),
        logprobs=loop.logprobs,
        last=loop.last,
        pending=loop.pending,
        done=loop.done,
        t=loop.t,
        end=need,
        maybe_pending=True,
        routes=loop.routes,
    )


def append(
    cfg, params, state: DecodeState, token_ids, token_mask, pad_id, mesh=None, end=None
) -> DecodeState:
    """Writes token_ids [N, A] (token_mask [N, A]: each row's real ones) into the cache
    after each row's tokens, in one forward -> new state. Rows that receive a token are
    live again (not done); the tokens are not sampled (loss mask 0, log-prob 0). end
    (static, >= state.end + A): the new state's bound on slots, for a caller that rounds
    it up so that later programs meet fewer shapes (the slots past the tokens stay
    holes)."""
    P, A = state.prompt_tokens.shape[1], token_ids.shape[1]
    token_ids, token_mask = token_ids.astype(jnp.int32), token_mask.astype(bool)
    need = state.end + A if end is None else end
    cache = state.cache
    if need > cache.max_len:
        cache = constrain_cache(models.grow_cache(cache, -(-need // 8) * 8), mesh)
    feed, feed_mask = token_ids, token_mask
    if state.maybe_pending:  # the last drawn token goes in first
        feed = jnp.concatenate([state.last[:, None], token_ids], axis=1)
        feed_mask = jnp.concatenate([state.pending[:, None], token_mask], axis=1)
    col = cache.index + feed.shape[1] - A - P
    routes = _widen_routes(state.routes, need - P)
    routes_col = cache.index - P  # the feed's first column (the pending token's, if any)
    hidden, cache, own = models.extend(cfg, params, feed, feed_mask, cache, with_routes=True)
    fed = jnp.any(feed_mask, axis=1)
    logits = models.project(cfg, params, models.last_hidden(hidden, feed_mask))
    put = lambda buf, x, fill: jax.lax.dynamic_update_slice(  # noqa: E731
        _widen(buf, need - P, fill), x, (0, col)
    )
    return state.replace(
        cache=constrain_cache(cache, mesh),
        tokens=put(state.tokens, jnp.where(token_mask, token_ids, pad_id), pad_id),
        mask=put(state.mask, token_mask, False),
        appended=put(state.appended, token_mask, False),
        logprobs=put(state.logprobs, jnp.zeros(token_mask.shape, jnp.float32), 0.0),
        logits=jnp.where(fed[:, None], logits, state.logits),
        pending=jnp.zeros_like(state.pending),
        done=state.done & ~jnp.any(token_mask, axis=1),
        end=need,
        maybe_pending=False,
        routes=_put_routes(routes, own, routes_col),
    )


def refresh(cfg, params, state: DecodeState, mesh=None) -> DecodeState:
    """The state with its KV cache recomputed by `params` over every token so far (prompt,
    completions, appended and pending tokens), so that decoding on with `params` draws
    exactly what they would draw after that whole sequence (partial rollouts: a generation
    that continues with newer parameters). The tokens, masks and log-probs drawn so far are
    kept; each row's prompt is prefilled again (no group sharing)."""
    P = state.prompt_tokens.shape[1]
    columns = state.end - P
    ids = jnp.concatenate([state.prompt_tokens, state.tokens[:, :columns]], axis=1)
    mask = jnp.concatenate([state.prompt_mask, state.mask[:, :columns]], axis=1)
    size = max(state.cache.max_len, -(-state.end // 8) * 8)
    cache = models.init_cache(cfg, ids.shape[0], size, params["embed"].dtype)
    logits, cache = models.prefill(cfg, params, ids, mask, constrain_cache(cache, mesh))
    return state.replace(
        cache=constrain_cache(cache, mesh),
        logits=logits,
        pending=jnp.zeros_like(state.pending),
        maybe_pending=False,
    )


def result(state: DecodeState, pad_id) -> SampleOutput:
    """The rollouts so far, each row's real tokens compacted to the left (stable order)."""
    order = jnp.argsort((~state.mask).astype(jnp.int32), axis=1, stable=True)
    take = lambda x: jnp.take_along_axis(x, order, axis=1)  # noqa: E731
    mask = take(state.mask)
    sampled = mask & ~take(state.appended)
    routes = None
    if state.routes is not None:
        order4 = order[:, :, None, None]
        completion = jnp.take_along_axis(state.routes, order4, axis=1)
        completion = jnp.where(mask[:, :, None, None], completion, -1)
        routes = jnp.concatenate([state.prompt_routes, completion], axis=1)
    return SampleOutput(
        tokens=jnp.where(mask, take(state.tokens), pad_id),
        mask=mask,
        loss_mask=sampled,
        logprobs=jnp.where(sampled, take(state.logprobs), 0.0),
        lengths=mask.sum(axis=1, dtype=jnp.int32),
        finish=jnp.where(state.done, FINISH_STOP, FINISH_LENGTH).astype(jnp.int32),
        prompt_tokens=state.prompt_tokens,
        prompt_mask=state.prompt_mask,
        policy_version=state.policy_version,
        num_generations=state.spec.num_generations,
        routes=routes,
    )
