"""Attention over a page pool: each layer reads its own pages in place, through the rows'
page tables, inside the layer loop (`transformer.paged_forward`).

The pool holds every layer's keys and values in fixed-size pages, k / v [L, pages,
page_size, K, H] (after RoPE, as the layer computes them); a row's tokens sit at slots
0, 1, ... of the pages its table [B, M] lists, slot s in page table[s // page_size] at
offset s % page_size. A call runs T new tokens of each row after its slots
[start, length): in each layer the new tokens' keys/values are first written at slots
length .. length + T - 1 (a masked token's to the null page, which no query reads
unmasked), then the queries attend to that layer's pages of the row, gathered through
the table for this layer only, under one mask (`paged_mask`) that holds the earlier
tokens [start, length), the new tokens causally, the padding and a sliding window. So a
layer reads its pages once, and no [L, B, pages * page_size] copy of the whole cache nor
a per-layer copy that appends the new tokens is made; the rest of the layer (norms, q/k
norms, RoPE incl. partial rotary, GQA, the MLP or experts) is the model's own code
(`block.Block`).

On TPU the pool can be laid out head-major, k / v [K, L, pages, page_size, H]
(`PagedWrite.pallas`): a decode call (one new token per row) of a layer without a
sliding window then runs the Pallas TPU paged-attention kernel (`paged_kernel`); every
other call reads the same pool through the portable path here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl_llm.models.attention import Mask, attention, resolve
from jaxrl_llm.models.paged_kernel import decode_attention
from jaxrl_llm.parallel import target


@struct.dataclass
class PagedWrite:
    """Where a call's new tokens go: page [B, T] (the null page for masked tokens) and
    offset [B, T] in it; table [B, M]: the rows' page tables (what each layer reads);
    start, length [B]: the rows' earlier slots [start, length). pallas: the pool is
    head-major [K, L, P, S, H] and decode calls run the Pallas kernel (else [L, P, S, K,
    H], the portable path only)."""

    table: jax.Array
    page: jax.Array
    offset: jax.Array
    start: jax.Array
    length: jax.Array
    pallas: bool = struct.field(pytree_node=False, default=False)


def paged_inputs(
    table, start, length, mask, page_size: int, null_page: int = 0, pallas: bool = False
):
    """(positions [B, T], `Mask` over the M * page_size slots a row's table covers,
    `PagedWrite`) of T new tokens (mask [B, T]) after each row's slots [start, length).

    Positions continue after the row's length - start earlier tokens (a masked token
    does not advance them); a slot before `length` holds position slot - start. A query at
    slot length + t sees the earlier slots [start, length) and the real new tokens up to
    its own slot. The new tokens must fit the table: length + T <= M * page_size (a token
    beyond it is written to the table's last page, as the gather path does). pallas:
    `PagedWrite.pallas`."""
    B, T = mask.shape
    M = table.shape[1]
    width = M * page_size
    mask = mask.astype(bool)
    start, length = start.astype(jnp.int32), length.astype(jnp.int32)
    before = jnp.maximum(length - start, 0)[:, None]  # earlier tokens (none: a prompt's start)
    positions = jnp.maximum(before + jnp.cumsum(mask, -1, dtype=jnp.int32) - 1, 0)
    index = length[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # [B, T] slots
    page = jnp.take_along_axis(table, jnp.minimum(index // page_size, M - 1), axis=1)
    write = PagedWrite(
        table=table,
        page=jnp.where(mask, page, null_page),
        offset=index % page_size,
        start=start,
        length=length,
        pallas=pallas,
    )
    slot = jnp.arange(width, dtype=jnp.int32)[None]  # [1, W]
    new = slot - length[:, None]  # the new token a slot holds (0 .. T-1), if any
    at = jnp.clip(new, 0, T - 1)
    is_new = (new >= 0) & (new < T)
    earlier = (slot >= start[:, None]) & (slot < length[:, None])
    valid = earlier | (is_new & jnp.take_along_axis(mask, at, axis=1))
    k_pos = jnp.where(is_new, jnp.take_along_axis(positions, at, axis=1), slot - start[:, None])
    pmask = Mask(q_idx=index, k_idx=slot[0], k_valid=valid, q_pos=positions, k_pos=k_pos)
    return positions, pmask, write


def write_layer(pool, layer, k, v, where: PagedWrite):
    """This layer's new keys/values k, v [B, T, K, H] into the pool (k, v) [L, P, S, K, H]
    at [layer, page, offset] (in place when the pool's buffer is donated or carried); a
    head-major pool [K, L, P, S, H] (`where.pallas`) at [:, layer, page, offset]."""
    pk, pv = pool
    if where.pallas:
        k, v = k.transpose(2, 0, 1, 3), v.transpose(2, 0, 1, 3)  # [K, B, T, H]
        return (
            pk.at[:, layer, where.page, where.offset].set(k.astype(pk.dtype)),
            pv.at[:, layer, where.page, where.offset].set(v.astype(pv.dtype)),
        )
    return (
        pk.at[layer, where.page, where.offset].set(k.astype(pk.dtype)),
        pv.at[layer, where.page, where.offset].set(v.astype(pv.dtype)),
    )


def layer_pages(pool, layer, table, pallas: bool = False):
    """Layer `layer`'s keys and values of each row, in slot order: [B, M * S, K, H] each,
    one gather from the pool (the layer's pages only; no slice of the layer is copied).
    pallas: the pool is head-major [K, L, P, S, H] (`PagedWrite.pallas`)."""
    pk, pv = pool
    if pallas:
        K, L, P, S, H = pk.shape
        B, M = table.shape

        def take_heads(x):
            pages = jnp.take(x.reshape(K, L * P, S, H), table + layer * P, axis=1)
            return pages.reshape(K, B, M * S, H).transpose(1, 2, 0, 3)

        return take_heads(pk), take_heads(pv)
    L, P, S, K, H = pk.shape
    B, M = table.shape
    rows = table + layer * P

    def take(x):
        return jnp.take(x.reshape(L * P, S, K, H), rows, axis=0).reshape(B, M * S, K, H)

    return take(pk), take(pv)


def paged_attention(
    q,
    pool,
    layer,
    where: PagedWrite,
    mask: Mask,
    implementation="auto",
    block: int = 512,
    sinks=None,
):
    """q [B, T, N, H] of the new tokens over layer `layer`'s pages of each row (written
    with the new tokens already, `write_layer`) -> [B, T, N, H]. mask: `paged_inputs`'
    (with this layer's window, if any). The full score matrix over the table's slots, or
    key blocks where `implementation` would not hold it (`blockwise`); the accelerators'
    kernels take no per-row query slots, so they run as `blockwise` here. A head-major
    pool (`where.pallas`): a decode call (T = 1) without a window runs the Pallas TPU
    kernel (`paged_kernel.decode_attention`, in interpret mode off TPU); with attention
    sinks [N] (which the kernel lacks) the portable path."""
    if where.pallas and q.shape[1] == 1 and mask.window is None and sinks is None:
        return decode_attention(q, pool, layer, where.table, where.start, where.length)
    k, v = layer_pages(pool, layer, where.table, where.pallas)
    name = resolve(implementation, target.backend(), q.shape[1], k.shape[1])
    name = "xla" if name == "xla" else "blockwise"
    return attention(q, k.astype(q.dtype), v.astype(q.dtype), mask, name, block, sinks)
