"""What a layer attends to, one object per kind: the block calls `cache.attend` (and a
Gated DeltaNet layer `cache.deltanet`) and has one path; the layer loop in
`layers.Transformer` asks the cache how it runs (`loop`) and exists once.

    kind           built by                            attends to                 loop
    NoCache        transformer.forward                 the sequence itself        scan
    PrefixCache    transformer.forward_after_prefix    earlier tokens' k, v first scan / unrolled
    DenseCache     transformer.extend (kv_cache)       the [L, ...] cache         scan
    PerLayerCache  extend, cfg.scan_layers=False       one cache array per layer  unrolled
    PagedCache     transformer.paged_forward           the layer's pool pages     scan / unrolled

Each is a pytree carried through the layer loop. Its `rows` are per-layer values the loop
slices for each layer ([L, ...] in) and stacks from each layer (out): a prefix's keys and
values in, the layer's own out. Gemma 4's KV-shared layers (`ModelConfig.kv_sharing`)
attend with k = v = None: the caches that store keys read the storing layer's row (the
loop passes its row as `layer`), the teacher-forced ones the `shared` keys/values the
storing layer `keep`s, which the loop hands on. "unrolled": a Python loop over each layer's own
parameter slices (`transformer.layer_params`, sliced once before a decode loop);
"scan_unrolled": the scan traced once per layer (`cfg.scan_layers=False`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl_llm.models.attention import cached_attention, cached_blockwise, resolve
from jaxrl_llm.models.context_parallel import context_attention
from jaxrl_llm.models.gated_deltanet import LinearState, gated_deltanet
from jaxrl_llm.models.paged_attention import PagedWrite, paged_attention, write_layer
from jaxrl_llm.parallel import target


def _scan(cfg) -> str:
    """A teacher-forced loop: the scan, unrolled where `cfg.scan_layers` is off (the
    backward then reads each layer's residuals where they were computed)."""
    return "scan" if cfg.scan_layers else "scan_unrolled"


@struct.dataclass
class NoCache:
    """A full sequence attending to itself (training, the reference forward)."""

    rows: Any = None
    shared: Any = None

    def loop(self, cfg, layers) -> str:
        return _scan(cfg) if layers is None else "unrolled"

    def swap(self):
        """Nothing is stored per attention kind (`DenseCache.swap`)."""
        return self

    def keep(self, k, v):
        """What a KV-shared layer attends over in this layer's place: its k, v."""
        return k, v

    def attend(self, cfg, layer, q, k, v, mask, sinks):
        """q [B,T,N,H] over this layer's k, v [B,T,K,H] (None: a KV-shared layer's,
        `shared`) -> ([B,T,N,H], self)."""
        k, v = self.shared if k is None else (k, v)
        a = context_attention(q, k, v, mask, cfg.attention, cfg.attention_block, sinks=sinks)
        return a, self

    def deltanet(self, cfg, layer, w, h, mask):
        """The Gated DeltaNet over h [B,T,D] from a zero state -> ([B,T,D], self)."""
        real = mask.k_valid[:, -h.shape[1] :]
        return gated_deltanet(cfg, w, h, real, None)[0], self


@struct.dataclass
class PrefixCache:
    """Tokens after P earlier ones whose keys/values are given: rows (k, v) [L,B,P,K,H]
    going in (one layer's [B,P,K,H] inside the loop), this sequence's own (k, v)
    [L,B,T,K,H] (after RoPE, for a later suffix) coming out. Differentiable."""

    rows: Any = None
    shared: Any = None

    def loop(self, cfg, layers) -> str:
        return _scan(cfg) if layers is None else "unrolled"

    def swap(self):
        """The rows are sliced per attention kind by the layer loop (`DenseCache.swap`)."""
        return self

    def keep(self, k, v):
        """What a KV-shared layer attends over in this layer's place: the prefix's keys /
        values, then this layer's own."""
        pk, pv = self.rows
        return (
            jnp.concatenate([pk.astype(k.dtype), k], axis=1),
            jnp.concatenate([pv.astype(v.dtype), v], axis=1),
        )

    def attend(self, cfg, layer, q, k, v, mask, sinks):
        """q [B,T,N,H] over the prefix's keys/values, then this layer's own k, v (None: a
        KV-shared layer's, `shared`; its rows are then its storing layer's)."""
        ck, cv = self.keep(k, v) if k is not None else self.shared
        a = context_attention(q, ck, cv, mask, cfg.attention, cfg.attention_block, sinks=sinks)
        own = (k, v) if k is not None else (ck[:, -q.shape[1] :], cv[:, -q.shape[1] :])
        return a, self.replace(rows=own)


def _write(c, new, start):
    return jax.lax.dynamic_update_slice(c, new.astype(c.dtype), start)


def cached(cfg, q, kt, v, mask, sinks=None):
    """q [B,T,N,H] over a layer's cache kt [B,K,H,S], v [B,K,S,H] (`kv_cache.KVCache`'s
    layout): the full score matrix for decode and short prefill, key blocks
    (`cached_blockwise`) where `cfg.attention` would not hold [T, S]."""
    T, S = q.shape[1], v.shape[-2]
    if T > 1 and resolve(cfg.attention, target.backend(), T, S) != "xla":
        return cached_blockwise(q, kt, v, mask, cfg.attention_block, sinks)
    kt, v = kt.astype(q.dtype), v.astype(q.dtype)
    return cached_attention(q, kt, v, mask.dense(), sinks)


@struct.dataclass
class DenseCache:
    """A `kv_cache.KVCache`'s keys/values of every layer, k [L,B,K,H,S] and v [L,B,K,S,H],
    carried through the layer scan and written in place at slots index..index+T of the
    layer's row; a hybrid model's Gated DeltaNet layers' `LinearState` [L', B, ...] too
    (k / v then hold its full-attention layers only; `layer` is a row among its kind).
    With `cfg.split_attention`, k / v hold the sliding layers and `wide` the (k, v) of
    the full layers, [Lg, B, Kg, Hg, S] / [Lg, B, Kg, S, Hg]."""

    k: jax.Array
    v: jax.Array
    index: jax.Array
    state: LinearState | None = None
    rows: Any = None
    wide: tuple | None = None
    shared: Any = None

    def loop(self, cfg, layers) -> str:
        return "scan"

    def keep(self, k, v):
        """Nothing: a KV-shared layer reads its storing layer's cache row."""
        return None

    def swap(self):
        """The cache with its two attention kinds' keys/values exchanged: the layer loop
        swaps before and after a run of full layers of their own head size, so `attend`
        always writes and reads k / v."""
        if self.wide is None:
            return self
        return self.replace(k=self.wide[0], v=self.wide[1], wide=(self.k, self.v))

    def attend(self, cfg, layer, q, k, v, mask, sinks):
        """Writes k, v [B,T,K,H] (as [B,K,H,T] / [B,K,T,H]) at [layer] (None: a KV-shared
        layer, which writes nothing), then q [B,T,N,H] over the layer's S slots."""
        ck, cv = self.k, self.v
        if k is not None:
            ck = _write(ck, k.transpose(0, 2, 3, 1)[None], (layer, 0, 0, 0, self.index))
            cv = _write(cv, v.transpose(0, 2, 1, 3)[None], (layer, 0, 0, self.index, 0))
        kt, vt = (jax.lax.dynamic_index_in_dim(c, layer, keepdims=False) for c in (ck, cv))
        return cached(cfg, q, kt, vt, mask, sinks), self.replace(k=ck, v=cv)

    def deltanet(self, cfg, layer, w, h, mask):
        """The Gated DeltaNet from the layer's state: one new token per row step by step,
        several chunked -> ([B,T,D], the cache with the layer's state updated)."""
        real = jax.lax.dynamic_slice_in_dim(mask.k_valid, self.index, h.shape[1], axis=1)
        return _deltanet(self, cfg, layer, w, h, real)


def _deltanet(cache, cfg, layer, w, h, real):
    """Layer `layer`'s Gated DeltaNet over h [B,T,D] (real [B,T]: its real tokens) from
    cache.state [L', B, ...]: one new token per row step by step, several chunked ->
    ([B,T,D], the cache with the layer's state updated)."""
    state = jax.tree.map(
        lambda c: jax.lax.dynamic_index_in_dim(c, layer, keepdims=False), cache.state
    )
    a, new = gated_deltanet(cfg, w, h, real, state, step=h.shape[1] == 1)
    state = jax.tree.map(
        lambda c, n: jax.lax.dynamic_update_index_in_dim(c, n.astype(c.dtype), layer, 0),
        cache.state,
        new,
    )
    return a, cache.replace(state=state)


@struct.dataclass
class PerLayerCache:
    """A `kv_cache.KVCache` of L per-layer arrays (`cfg.scan_layers=False`): k, v tuples
    of [B,K,H,S] / [B,K,S,H]; the layers run unrolled, each reading its own buffer in
    place rather than a slice of an [L, ...] array."""

    k: tuple
    v: tuple
    index: jax.Array
    rows: Any = None
    shared: Any = None

    def loop(self, cfg, layers) -> str:
        return "unrolled"

    def keep(self, k, v):
        """Nothing: a KV-shared layer reads its storing layer's arrays."""
        return None

    def attend(self, cfg, layer: int, q, k, v, mask, sinks):
        """Writes k, v into layer `layer`'s arrays at slot index.., then attends (k None:
        a KV-shared layer reads them)."""
        if k is None:
            return cached(cfg, q, self.k[layer], self.v[layer], mask, sinks), self
        kt = _write(self.k[layer], k.transpose(0, 2, 3, 1), (0, 0, 0, self.index))
        vt = _write(self.v[layer], v.transpose(0, 2, 1, 3), (0, 0, self.index, 0))
        a = cached(cfg, q, kt, vt, mask, sinks)
        return a, self.replace(k=_put(self.k, layer, kt), v=_put(self.v, layer, vt))


def _put(arrays: tuple, i: int, a) -> tuple:
    return (*arrays[:i], a, *arrays[i + 1 :])


@struct.dataclass
class PagedCache:
    """The page pool (k, v) [L, pages, page_size, K, H] (head-major with `where.pallas`)
    and where a call's new tokens go (`paged_attention.PagedWrite`): each layer writes
    its new keys/values to its pages, then reads its pages of each row. With
    `cfg.split_attention` `pool` holds the sliding layers and `wide` the full layers'
    (k, v) [Lg, pages, page_size, Kg, Hg], over the same page ids."""

    pool: tuple
    where: PagedWrite
    rows: Any = None
    wide: tuple | None = None  # `cfg.split_attention`: the full layers' pool (k, v)
    # A hybrid model: each row's Gated DeltaNet state [L', B, ...] (`DenseCache.state`)
    # and which of the call's tokens are real, real [B, T] (a masked one leaves it alone).
    state: LinearState | None = None
    real: jax.Array | None = None
    shared: Any = None

    def loop(self, cfg, layers) -> str:
        return "scan" if layers is None else "unrolled"

    def keep(self, k, v):
        """Nothing: a KV-shared layer reads its storing layer's pages."""
        return None

    def swap(self):
        """The pools of the two attention kinds exchanged (`DenseCache.swap`); the page
        ids and table are the same for both."""
        if self.wide is None:
            return self
        return self.replace(pool=self.wide, wide=self.pool)

    def attend(self, cfg, layer, q, k, v, mask, sinks):
        """Writes k, v [B,T,K,H] to the layer's pages (None: a KV-shared layer, which
        writes nothing), then q over each row's pages."""
        pool = self.pool if k is None else write_layer(self.pool, layer, k, v, self.where)
        impl, block = cfg.attention, cfg.attention_block
        a = paged_attention(q, pool, layer, self.where, mask, impl, block, sinks)
        return a, self.replace(pool=pool)

    def deltanet(self, cfg, layer, w, h, mask):
        """The Gated DeltaNet from each row's state (`DenseCache.deltanet`'s one path)."""
        return _deltanet(self, cfg, layer, w, h, self.real)


def layer_cache(cache):
    """The layer loop's view of a `kv_cache.KVCache`: per-layer arrays or stacked ones."""
    if isinstance(cache.k, tuple):
        return PerLayerCache(k=cache.k, v=cache.v, index=cache.index)
    return DenseCache(k=cache.k, v=cache.v, index=cache.index, state=cache.state, wide=cache.wide)
