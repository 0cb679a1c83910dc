"""The decoder's functional API: a plain params dict in, hidden states / logits / caches out.

`params` is a plain nested dict of arrays (`{'embed', 'layers': {...}, 'final_norm',
'lm_head'?}`), the pure-dict form of the NNX state of `layers.Transformer`; each function
merges it into the module inside the traced function, so the sampler, the reference
model and the update step all read the same arrays without copies.

Three paths share the layer code (`block.Block`), each with its cache object (`caches`):
- `forward`: a full sequence, with a padding mask (left or right), position ids and
  optional segment ids for packed sequences.
- `forward_after_prefix`: a sequence after a prefix whose per-layer keys/values an
  earlier call returned (a GRPO group's shared prompt); trains like `forward`.
- `extend`: T new tokens appended to a preallocated KV cache (`kv_cache.KVCache`), each
  row with its own mask (masked tokens take a slot but are never attended to and do not
  advance the row's positions). Prefill is `extend` of the prompt into an empty cache;
  decoding is `extend` of one token per row.

Position ids default to the number of real tokens before each token, so a left-padded
row gets the same positions as its unpadded self (as in HF `generate`). Every path
describes its mask by its structure (`attention.Mask`: token order, padding, segments,
positions), never as a [B, T, S] array, so `cfg.attention` can run it in memory linear
in T. Sliding-window layers (Gemma 3) see a key only from queries fewer than
`cfg.sliding_window` positions after it (`layer_math.layer_mask`): position ids, not slots,
so padding never narrows the window; with a KV cache every slot is kept and the window is
a mask over the full-length cache. With a per-layer
cache (`cfg.scan_layers=False`) the caller may slice each layer's parameters once
(`layer_params`) instead of in every decode step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_llm.errors import UnsupportedModelError
from jaxrl_llm.models._nnx import nnx
from jaxrl_llm.models.attention import Mask, causal_mask
from jaxrl_llm.models.caches import PagedCache, PrefixCache, layer_cache
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.kv_cache import KVCache
from jaxrl_llm.models.layer_math import softcap
from jaxrl_llm.models.layers import Transformer
from jaxrl_llm.models.paged_attention import paged_inputs

Params = dict


# ------------------------------------------------------------------------ functional API
@functools.lru_cache(maxsize=32)
def abstract_model(cfg: ModelConfig, dtype=jnp.float32):
    """(graphdef, abstract state) of the model; no arrays are allocated."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0), dtype)))


def _model(cfg: ModelConfig, params: Params) -> Transformer:
    return nnx.merge(abstract_model(cfg)[0], params)


def layer_params(params: Params) -> dict:
    """Every row of each stacked layer parameter, sliced out once (for `decode_step`):
    {name: [row 0, row 1, ...]}. A parameter is stacked over every layer, or (an MoE model
    with dense-MLP layers) over the layers of its MLP kind; `segments.layer_slice` picks
    layer i's rows."""
    return {n: [a[j] for j in range(a.shape[0])] for n, a in params["layers"].items()}


def default_positions(attention_mask: jax.Array, segment_ids: jax.Array | None = None):
    """Position ids [B,T]: real tokens before this one (within its segment, if given)."""
    mask = attention_mask.astype(jnp.int32)
    if segment_ids is None:
        return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
    new_segment = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1
    )
    running = jnp.cumsum(mask, axis=-1)
    start = jax.lax.cummax(jnp.where(new_segment, running - mask, 0), axis=1)
    return jnp.maximum(running - start - 1, 0)


def forward(
    cfg: ModelConfig,
    params: Params,
    tokens,
    attention_mask=None,
    positions=None,
    segment_ids=None,
    dropout=None,
    routes=None,
    with_routes: bool = False,
    layers=None,
):
    """Full-sequence forward: tokens [B,T] -> final-normed hidden states [B,T,D].
    dropout: a key for LoRA dropout (`cfg.lora.dropout` > 0), None for none.
    routes: [B,T,L,k] experts for the MoE layers to use instead of their own top-k
    (routing replay), None for their own. with_routes: return (hidden, the MoE layers' own
    top-k [B,T,L,k] int32, or None for a dense model). layers: each layer's parameters
    already sliced (`layer_params`), read instead of `params["layers"]` by a Python loop
    over the layers (the update's unrolled model: `rl.gradients`)."""
    B, T = tokens.shape
    if cfg.hybrid and segment_ids is not None:
        raise UnsupportedModelError(
            "optim.packing: a hybrid (Gated DeltaNet) model cannot run packed sequences yet "
            "(segment_ids); set optim.packing='off'"
        )
    if attention_mask is None:
        attention_mask = jnp.ones((B, T), bool)
    attention_mask = attention_mask.astype(bool)
    if positions is None:
        positions = default_positions(attention_mask, segment_ids)
    mask = causal_mask(attention_mask, positions, segment_ids)
    hidden, _, own = _model(cfg, params)(
        tokens, positions, mask, layers=layers, dropout=dropout, routes=layer_major(routes)
    )
    return (hidden, token_major(own)) if with_routes else hidden


def layer_major(routes):
    """Recorded routes [B,T,L,k] -> the layer scan's [L,B,T,k] (None stays None)."""
    return None if routes is None else jnp.moveaxis(routes, 2, 0)


def token_major(routes):
    """The layer scan's [L,B,T,k] -> [B,T,L,k] (None stays None)."""
    return None if routes is None else jnp.moveaxis(routes, 0, 2)


def forward_after_prefix(
    cfg: ModelConfig,
    params: Params,
    tokens,
    attention_mask,
    prefix=None,
    prefix_mask=None,
    dropout=None,
    routes=None,
    with_routes: bool = False,
    layers=None,
    recompute: bool = False,
):
    """`forward` of tokens that follow a prefix already run: (hidden [B,T,D], keys/values).

    tokens, attention_mask [B,T]; prefix: the (k, v) [L,B,P,K,H] this function returned
    for the prefix (None: no prefix; with `cfg.split_attention` a pair of them, the
    sliding layers' and the full layers', `empty_prefix`), prefix_mask [B,P] its real
    tokens. The tokens'
    positions continue after the prefix's real tokens and they attend to all of them, so
    hidden equals `forward` of the concatenation [prefix, tokens] at the tokens'
    positions. Returns the keys/values of `tokens` ([L,B,T,K,H] each) for a later suffix.
    Differentiable w.r.t. params and prefix; e.g. a prompt run once for the G samples of
    its GRPO group (`rl.prefix.prefix_logprobs`). dropout, routes [B,T,L,k], with_routes
    (then a third result, the own top-k [B,T,L,k]): as in `forward`. layers: optional
    `layer_params(params)` (inference: the layers run unrolled over them, sliced once
    by the caller, e.g. before a decode loop). recompute: with `layers`, each layer's
    backward recomputes its forward instead of keeping its activations
    (`layers.recompute_in_backward`).
    """
    B, T = tokens.shape
    if cfg.hybrid:
        raise UnsupportedModelError(
            "forward_after_prefix: a hybrid (Gated DeltaNet) model's prefix is a recurrent "
            "state, not keys/values; not supported yet (the trainer's shared-prompt "
            "log-probs and the paged engine use it)"
        )
    attention_mask = attention_mask.astype(bool)
    if prefix is None:
        prefix = empty_prefix(cfg, B, params["embed"].dtype)
        prefix_mask = jnp.zeros((B, 0), bool)
    prefix_mask = prefix_mask.astype(bool)
    before = prefix_mask.sum(-1, dtype=jnp.int32)[:, None]
    positions = jnp.maximum(before + jnp.cumsum(attention_mask, -1, dtype=jnp.int32) - 1, 0)
    prefix_pos = jnp.maximum(jnp.cumsum(prefix_mask, -1, dtype=jnp.int32) - 1, 0)
    mask = causal_mask(attention_mask, positions, None, prefix_mask, prefix_pos)
    hidden, cache, own = _model(cfg, params)(
        tokens,
        positions,
        mask,
        PrefixCache(rows=prefix),
        layers,
        dropout,
        layer_major(routes),
        recompute,
    )
    return (hidden, cache.rows, token_major(own)) if with_routes else (hidden, cache.rows)


def empty_prefix(cfg: ModelConfig, batch: int, dtype):
    """The keys/values of no prefix: (k, v) [L, B, 0, K, H]; with `cfg.split_attention`
    a pair of those, the sliding layers' and the full layers' ([Lg, B, 0, Kg, Hg])."""

    def empty(L, K, H):
        return jnp.zeros((L, batch, 0, K, H), dtype), jnp.zeros((L, batch, 0, K, H), dtype)

    if not cfg.split_attention:
        return empty(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    kinds = cfg.attention_kinds
    return (
        empty(kinds.count("softmax"), cfg.num_kv_heads, cfg.head_dim),
        empty(kinds.count("wide"), cfg.full_kv_heads, cfg.full_head_dim),
    )


def paged_forward(
    cfg: ModelConfig,
    params: Params,
    tokens,
    attention_mask,
    pool,
    table,
    start,
    length,
    layers=None,
    null_page: int = 0,
    pallas: bool = False,
    state=None,
):
    """T new tokens of each row after its slots [start, length) in a page pool ->
    (final-normed hidden [B,T,D], the pool with the real tokens' keys/values written at
    slots length .. length + T - 1, the MoE layers' own top-k [B,T,L,k] or None, the
    rows' recurrent state after the real tokens or None).

    tokens, attention_mask [B,T]; pool: (k, v) [L, pages, page_size, K, H] (with
    `cfg.split_attention` the pair of the sliding layers' and the full layers' (k, v)
    [Lg, pages, page_size, Kg, Hg], given back the same way); table [B, M]
    each row's page ids (slot s in page table[s // page_size]); start, length [B]. Masked
    tokens write to page `null_page` and are attended to by no real token. Each layer
    writes and reads its own pages in place (`paged_attention`): hidden equals `forward`
    of the row's tokens [start, length) followed by the real new tokens, at the new
    tokens' positions. layers: as in `forward_after_prefix` (inference, unrolled).
    pallas: the pool is head-major, (k, v) [K, L, pages, page_size, H], and decode calls
    (T = 1) run the Pallas TPU kernel (`paged_attention.PagedWrite.pallas`). state: a
    hybrid model's Gated DeltaNet state of each row before the new tokens
    (`gated_deltanet.LinearState` [L', B, ...]; the pool then holds the full-attention
    layers only); hidden is `forward`'s when state is that after the row's earlier
    tokens [start, length) (zeros before a prompt's first token). Forward only (the
    sampler's engine)."""
    if cfg.hybrid and state is None:
        raise ValueError("paged_forward: a hybrid model needs its rows' recurrent state")
    page_size = jax.tree.leaves(pool)[0].shape[3 if pallas else 2]
    positions, mask, where = paged_inputs(
        table, start, length, attention_mask, page_size, null_page, pallas
    )
    wide = None
    if cfg.split_attention:
        pool, wide = pool
    real = attention_mask.astype(bool)
    cache = PagedCache(pool=tuple(pool), where=where, wide=wide, state=state, real=real)
    hidden, cache, own = _model(cfg, params)(tokens, positions, mask, cache, layers)
    pool = cache.pool if wide is None else (cache.pool, cache.wide)
    return hidden, pool, token_major(own), cache.state


def unembed_matrix(cfg: ModelConfig, params: Params) -> jax.Array:
    """The output projection W [D, V] (the transposed embedding when tied)."""
    return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def project(cfg: ModelConfig, params: Params, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> float32 logits [..., V] (soft-capped: `layer_math.softcap`)."""
    w = unembed_matrix(cfg, params)
    z = jnp.einsum("...d,dv->...v", hidden, w, preferred_element_type=jnp.float32)
    return softcap(z, cfg.final_logit_softcapping)


@functools.partial(jax.jit, static_argnums=0)
def logits(
    cfg: ModelConfig,
    params: Params,
    input_ids,
    attention_mask=None,
    positions=None,
    segment_ids=None,
) -> jax.Array:
    """Float32 logits [B,T,V] for a (left- or right-) padded batch. Jitted."""
    hidden = forward(cfg, params, input_ids, attention_mask, positions, segment_ids)
    return project(cfg, params, hidden)


def extend(
    cfg: ModelConfig,
    params: Params,
    tokens,
    attention_mask,
    cache: KVCache,
    layers=None,
    with_routes: bool = False,
):
    """Appends tokens [B,T] (attention_mask [B,T]) to the cache.

    Returns (hidden [B,T,D], new cache), and with_routes the MoE layers' top-k experts of
    the tokens [B,T,L,k] (None for a dense model). Slots index..index+T-1 are written; a
    token attends to the cache's valid slots up to and including its own. layers: optional
    `layer_params(params)` for a per-layer cache (`init_cache`).
    """
    B, T = tokens.shape
    attention_mask = attention_mask.astype(bool)
    S = cache.max_len
    new = jax.lax.dynamic_update_slice(jnp.zeros((B, S), bool), attention_mask, (0, cache.index))
    valid = cache.valid | new
    positions = cache.pos[:, None] + default_positions(attention_mask)
    # a valid slot's position id: the real tokens written before it (as `pos` counts them)
    slot_pos = jnp.cumsum(valid, axis=-1, dtype=jnp.int32) - 1
    mask = Mask(
        q_idx=cache.index + jnp.arange(T, dtype=jnp.int32),
        k_idx=jnp.arange(S, dtype=jnp.int32),
        k_valid=valid,
        q_pos=positions,
        k_pos=slot_pos,
    )
    model = _model(cfg, params)
    hidden, kv, own = model(tokens, positions, mask, layer_cache(cache), layers)
    new_cache = cache.replace(
        k=kv.k,
        v=kv.v,
        valid=valid,
        pos=cache.pos + attention_mask.sum(-1, dtype=jnp.int32),
        index=cache.index + T,
        state=None if cache.state is None else kv.state,  # a hybrid model's DeltaNet state
        wide=None
        if cache.wide is None
        else kv.wide,  # the own-sized full layers' keys/values (`cfg.split_attention`)
    )
    return (hidden, new_cache, token_major(own)) if with_routes else (hidden, new_cache)


def last_hidden(hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """Hidden state of each row's last real token: hidden [B,T,D], mask [B,T] -> [B,D].

    The highest index with mask=1 (left or right padding, or holes); a row without any
    real token gives its last position."""
    T = attention_mask.shape[1]
    last = T - 1 - jnp.argmax(attention_mask[:, ::-1].astype(bool), axis=-1)
    return jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]


def prefill(
    cfg: ModelConfig,
    params: Params,
    tokens,
    attention_mask,
    cache: KVCache,
    with_routes: bool = False,
):
    """Prompt [B,T] into an empty cache -> (logits of each row's last real token [B,V], cache),
    and with_routes the MoE layers' top-k of the prompt tokens [B,T,L,k] (None: dense).

    With `cfg.prefill_chunk` = C > 0 and T > C the prompt goes in as chunks of C tokens
    (a `lax.scan` of `extend`, then the remainder), each attending to the cache so far:
    the activations of one chunk instead of the whole prompt, the same cache and logits.
    """
    C, (B, T) = cfg.prefill_chunk, tokens.shape
    if not C or T <= C:
        hidden, cache, own = extend(cfg, params, tokens, attention_mask, cache, with_routes=True)
        logits = project(cfg, params, last_hidden(hidden, attention_mask))
        return (logits, cache, own) if with_routes else (logits, cache)
    attention_mask = attention_mask.astype(bool)

    def chunk(carry, xs):
        cache, last = carry
        hidden, cache, own = extend(cfg, params, xs[0], xs[1], cache, with_routes=True)
        seen = xs[1].any(-1)[:, None]  # rows with a real token here: their latest so far
        return (cache, jnp.where(seen, last_hidden(hidden, xs[1]), last)), own

    n = T // C
    split = lambda x: x[:, : n * C].reshape(B, n, C).swapaxes(0, 1)  # noqa: E731
    last = jnp.zeros((B, cfg.hidden_size), params["embed"].dtype)
    carry, own = jax.lax.scan(chunk, (cache, last), (split(tokens), split(attention_mask)))
    if own is not None:  # [n, B, C, L, k] -> [B, n * C, L, k]
        own = own.swapaxes(0, 1).reshape(B, n * C, *own.shape[3:])
    if n * C < T:
        carry, rest = chunk(carry, (tokens[:, n * C :], attention_mask[:, n * C :]))
        own = None if own is None else jnp.concatenate([own, rest], axis=1)
    cache, last = carry
    logits = project(cfg, params, last)
    return (logits, cache, own) if with_routes else (logits, cache)


def decode_step(
    cfg: ModelConfig,
    params: Params,
    tokens,
    cache: KVCache,
    layers=None,
    real=None,
    with_routes: bool = False,
):
    """One new token per row, tokens [B] -> (logits [B,V], cache). layers: see `extend`.

    real [B] bool (default all): rows whose token is real; the others take the slot
    without being attended to later (e.g. rows that have finished). with_routes: a third
    result, the MoE layers' top-k of the tokens [B,1,L,k] (None for a dense model)."""
    mask = jnp.ones_like(tokens[:, None], bool) if real is None else real[:, None]
    hidden, cache, own = extend(cfg, params, tokens[:, None], mask, cache, layers, True)
    logits = project(cfg, params, hidden[:, 0])
    return (logits, cache, own) if with_routes else (logits, cache)
