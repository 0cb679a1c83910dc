"""The KV cache of the sampler: preallocated keys/values of every layer, grown in segments.

cache = init_cache(cfg, batch, max_len)       # empty; `transformer.extend` fills it
cache = cache_rows(cache, rows)               # pick / repeat rows (a prompt per sample)
cache = grow_cache(cache, longer)             # room for more slots (invalid, empty)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.gated_deltanet import LinearState, zero_state


@struct.dataclass
class KVCache:
    """Preallocated keys/values of every layer, written in place by `extend`.

    All rows advance together: `index` is the next slot for every row; a row's padding
    slots stay `valid=False` and are never attended to.

    Layout: per (row, kv head), keys are stored transposed ([H, S]) and values as [S, H],
    so a decode step's score matmul ([G, H] x [H, S]) and value matmul ([G, S] x [S, H])
    read the layer's slice as stored. Keys stored [S, H] (the score matmul contracting
    both operands' minor axis) ran much slower per score matmul on XLA:CPU, and a
    [B, S, K, H] layout cost a transposing copy of every layer's slice per token
    (benchmarks/RESULTS.md, "sampler").
    """

    k: jax.Array | tuple  # [L, B, K, H, S]: transposed, as the score matmul reads it
    v: jax.Array | tuple  # [L, B, K, S, H]
    valid: jax.Array  # [B, S] bool: the slot holds a real token
    pos: jax.Array  # [B] int32: position id of each row's next token
    index: jax.Array  # [] int32: next slot to write
    # A hybrid model (Qwen3.5): k / v hold its full-attention layers only, and each row's
    # Gated DeltaNet state (conv [L', B, K-1, C], ssm [L', B, Hv, Dk, Dv]) sits here.
    state: LinearState | None = None
    # Gemma 4 with full layers of their own head size (`cfg.split_attention`): k / v hold
    # its sliding layers, `wide` the full layers' (k [Lg, B, Kg, Hg, S], v [Lg, B, Kg, S, Hg]).
    wide: tuple | None = None

    @property
    def max_len(self) -> int:
        return jax.tree.leaves(self.v)[0].shape[-2]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An empty cache. With `cfg.scan_layers=False` k and v are tuples of L per-layer arrays
    ([B, K, H, S] / [B, K, S, H]) and `extend` runs the layers unrolled: each layer's matmuls
    then read its cache buffer in place instead of a copy of its slice of an [L, ...] array.
    """
    n_linear = sum(cfg.linear_layers)
    # the layers that keep keys/values (`cache_layers`: not Gemma 4's KV-shared ones)
    k, v = _zeros(cfg.cache_layers(), batch, cfg.num_kv_heads, cfg.head_dim, max_len, dtype)
    wide = None
    if cfg.split_attention:
        Lg = cfg.cache_layers("wide")
        wide = _zeros(Lg, batch, cfg.full_kv_heads, cfg.full_head_dim, max_len, dtype)
    elif not cfg.scan_layers and not cfg.hybrid:  # two kinds' caches stay stacked
        k, v = tuple(k), tuple(v)
    return KVCache(
        k=k,
        v=v,
        wide=wide,
        valid=jnp.zeros((batch, max_len), bool),
        pos=jnp.zeros((batch,), jnp.int32),
        index=jnp.zeros((), jnp.int32),
        state=zero_state(cfg, batch, dtype, (n_linear,)) if cfg.hybrid else None,
    )


def _zeros(L: int, batch: int, K: int, H: int, S: int, dtype) -> tuple:
    """Empty keys [L, B, K, H, S] and values [L, B, K, S, H]."""
    return jnp.zeros((L, batch, K, H, S), dtype), jnp.zeros((L, batch, K, S, H), dtype)


def cache_rows(cache: KVCache, rows: jax.Array) -> KVCache:
    """The cache of rows `rows` [B'] (indices into its B rows; repeats allowed), e.g. one
    prefilled prompt's cache for each of its G samples."""

    def take(x, axis):
        return jnp.take(x, rows, axis=axis)

    return cache.replace(
        k=jax.tree.map(lambda c: take(c, c.ndim - 4), cache.k),  # the batch axis
        v=jax.tree.map(lambda c: take(c, c.ndim - 4), cache.v),
        valid=take(cache.valid, 0),
        pos=take(cache.pos, 0),
        state=jax.tree.map(lambda c: take(c, 1), cache.state),  # [L', B, ...]: rows too
        wide=jax.tree.map(lambda c: take(c, 1), cache.wide),  # [Lg, B, ...]
    )


def grow_cache(cache: KVCache, max_len: int) -> KVCache:
    """The cache with room for `max_len` slots: empty (invalid) slots appended.

    Attention reads every slot of the cache it is given, filled or not; a decode loop in
    segments (`sampling`) starts with a short cache and grows it between segments, so each
    token reads only about as many slots as are filled. One copy of the cache per call."""
    pad = max_len - cache.max_len
    if pad < 0:
        raise ValueError(f"grow_cache: max_len {max_len} < the cache's {cache.max_len} slots")
    if pad == 0:
        return cache

    def grow(c, axis):  # axis from the end: the slot axis of k [.., H, S] / v [.., S, H]
        widths = [(0, 0)] * c.ndim
        widths[c.ndim - axis] = (0, pad)
        return jnp.pad(c, widths)

    return cache.replace(
        k=jax.tree.map(lambda c: grow(c, 1), cache.k),
        v=jax.tree.map(lambda c: grow(c, 2), cache.v),
        valid=grow(cache.valid, 1),
        wide=None if cache.wide is None else (grow(cache.wide[0], 1), grow(cache.wide[1], 2)),
    )
