"""Decode attention over the page pool with the Pallas TPU paged-attention kernel that
ships with JAX (`jax.experimental.pallas.ops.tpu.paged_attention`): one new token per
row over its pages, read in place.

The kernel attends each row to the slots [0, length) of the pages its table lists, with
the pool laid out head-major, k / v [K, pages, page_size, H]. The engine's pool is then
[K, L, pages, page_size, H] (`PagedWrite.pallas`): a reshape to [K, L * pages, ...]
(no copy) gives the kernel every layer's pages at once, layer l's page p at l * pages + p.

A row's tokens do not start at slot 0: a prompt is left-padded so that it ends on a
page boundary (its G rows share its pages and write their own from the next page), so
its first page holds padding before slot `start`. The kernel has no per-row start, so
a row runs in two parts, merged by their softmax statistics:

- the kernel over the row's whole pages from page ceil(start / page_size) on, its table
  shifted to begin there (its lengths counted from there);
- the slots [start, ...) of the partial page before them (at most page_size - 1 slots),
  computed here in plain JAX.

The shipped `paged_attention` returns only the normalised output, so the kernel is
launched here as that function launches it (`pallas_call` of the same kernel body,
`paged_flash_attention_kernel_inline_seq_dim`, no quantisation, no megacore), keeping
the running max m and sum l it computes, which the merge needs. Off TPU it runs in
Pallas' TPU interpret mode (tests on CPU).

The kernel reads keys and values in bfloat16 (it casts the pages it loads), and its
matmuls run at the TPU's default precision: with a bfloat16 pool (a bfloat16 model) the
cast changes nothing. TPU constraints, from the kernel's VMEM blocks [pages_per_block,
page_size, head_dim] (not run on a TPU here): head_dim a multiple of 128 and page_size
a multiple of 8 (16 in bfloat16) keep the blocks on Mosaic's tiling; the scores are
scaled by the caller (the kernel does not scale q) and there is no sliding window.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel as shipped
from jax.sharding import PartitionSpec

from jaxrl_llm.parallel import target

BLOCK_TOKENS = 256  # keys per kernel block (pages_per_compute_block * page_size), at most


def pages_per_block(width: int, page_size: int) -> int:
    """The kernel's pages_per_compute_block for a table of `width` pages: the largest
    power of two that divides `width` with at most BLOCK_TOKENS keys (the kernel
    requires it to divide the table width; a larger block means fewer, longer DMAs)."""
    block = 1
    while width % (2 * block) == 0 and 2 * block * page_size <= BLOCK_TOKENS:
        block *= 2
    return block


def launch(q, k_pages, v_pages, lengths, page_indices, block: int):
    """The shipped kernel over q [B, N, H] (already scaled), k_pages / v_pages
    [K, P, S, H], lengths int32 [B], page_indices int32 [B, M] -> (o [B, N, H] float32,
    m [B, N], l [B, N]): o = sum_s exp(x_s - m) v_s / l over the slots [0, length) of
    the row's pages, x the scores. A row of length 0 gives o = 0, l = 0."""
    B, N, H = q.shape
    K, _, S, _ = k_pages.shape
    G, M = N // K, page_indices.shape[1]
    if G % 8:  # as the shipped wrapper: a [1, H] block per head keeps Mosaic's layout
        q = q.reshape(B, N, 1, H)
        spec = pl.BlockSpec((None, G, None, H), lambda core, b, h, *_: (b, h, 0, 0))
    else:
        spec = pl.BlockSpec((None, G, H), lambda core, b, h, *_: (b, h, 0))
    q = q.astype(jnp.float32)
    body = functools.partial(
        shipped.paged_flash_attention_kernel_inline_seq_dim,
        pages_per_sequence=M,
        batch_size=B,
        pages_per_compute_block=block,
        mask_value=shipped.DEFAULT_MASK_VALUE,
        attn_logits_soft_cap=None,
        megacore_mode=None,
    )
    buffer = pltpu.VMEM((2, block, S, H), k_pages.dtype)  # double-buffered page DMAs
    stat = jax.ShapeDtypeStruct((*q.shape[:-1], 1), jnp.float32)
    on_tpu = target.backend() == "tpu"
    o, m, total = pl.pallas_call(
        body,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            in_specs=[
                spec,
                pl.BlockSpec(memory_space=pl.ANY),
                None,
                pl.BlockSpec(memory_space=pl.ANY),
                None,
            ],
            out_specs=[spec, spec, spec],
            grid=(1, B, K),
            scratch_shapes=(
                buffer,
                None,
                buffer,
                None,
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SemaphoreType.DMA((2,)),
            ),
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")
        ),
        out_shape=[jax.ShapeDtypeStruct(q.shape, jnp.float32), stat, stat],
        interpret=False if on_tpu else pltpu.InterpretParams(),
    )(
        lengths.astype(jnp.int32),
        page_indices.reshape(-1).astype(jnp.int32),
        jnp.zeros((1,), jnp.int32),
        jnp.ones((1,), jnp.int32),  # buffer index, init flag
        q,
        k_pages,
        None,
        v_pages,
        None,
    )
    return o.reshape(B, N, H), m.reshape(B, N), total.reshape(B, N)


def partial_page(q, k, v, valid):
    """Plain attention of q [B, N, H] (scaled) over one page per row, k / v [K, B, S, H],
    valid [B, S] -> (o [B, N, H] float32, m [B, N], l [B, N]) as `launch` gives them."""
    B, N, H = q.shape
    K = k.shape[0]
    qg = q.reshape(B, K, N // K, H).astype(jnp.float32)
    s = jnp.einsum("bkgh,kbsh->bkgs", qg, k.astype(jnp.float32))
    s = jnp.where(valid[:, None, None], s, -jnp.inf)
    m = s.max(-1)
    shift = jnp.where(jnp.isfinite(m), m, 0.0)[..., None]  # a row with no valid slot: m = -inf
    p = jnp.where(valid[:, None, None], jnp.exp(s - shift), 0.0)
    total = p.sum(-1)
    o = jnp.einsum("bkgs,kbsh->bkgh", p, v.astype(jnp.float32))
    o = o / jnp.maximum(total, 1e-30)[..., None]
    return o.reshape(B, N, H), m.reshape(B, N), total.reshape(B, N)


def merge(a, b):
    """Two softmax parts (o, m, l) over disjoint key sets -> o over their union."""
    (oa, ma, la), (ob, mb, lb) = a, b
    m = jnp.maximum(ma, mb)
    wa = jnp.where(la > 0, la * jnp.exp(ma - m), 0.0)
    wb = jnp.where(lb > 0, lb * jnp.exp(mb - m), 0.0)
    return (wa[..., None] * oa + wb[..., None] * ob) / jnp.maximum(wa + wb, 1e-30)[..., None]


def decode_attention(q, pool, layer, table, start, length):
    """One new token per row: q [B, 1, N, H] (unscaled, as the layer makes it) over the
    slots [start, length] of layer `layer`'s pages of each row (slot `length`: the new
    token's, written already), pool (k, v) [K, L, P, S, H], table [B, M] -> [B, 1, N, H]
    in q's dtype. Scores are scaled by head_dim ** -0.5, as `attention.attention`."""
    pk, pv = pool
    K, L, P, S, H = pk.shape
    B, M = table.shape
    dtype = q.dtype
    q = q[:, 0].astype(jnp.float32) * H**-0.5  # scaled in float32, as the portable scores
    k_pages, v_pages = pk.reshape(K, L * P, S, H), pv.reshape(K, L * P, S, H)
    start = start.astype(jnp.int32)
    end = jnp.minimum(length.astype(jnp.int32) + 1, M * S)  # a non-fed row may be full
    first = -(-start // S)  # the row's first whole page (table column)
    columns = jnp.minimum(first[:, None] + jnp.arange(M, dtype=jnp.int32)[None], M - 1)
    shifted = jnp.take_along_axis(table, columns, axis=1) + layer * P
    kernel = functools.partial(launch, block=pages_per_block(M, S))
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:  # XLA does not partition a Mosaic kernel: each
        # device runs it on the engine's replicated rows and pool
        every = PartitionSpec()
        kernel = jax.shard_map(kernel, mesh=mesh, in_specs=every, out_specs=every, check_vma=False)
    whole = kernel(q, k_pages, v_pages, jnp.maximum(end - first * S, 0), shifted)
    # The partial page before them: column first - 1, slots [start, first * S).
    column = jnp.maximum(first - 1, 0)
    page = jnp.take_along_axis(table, column[:, None], axis=1)[:, 0] + layer * P
    slot = column[:, None] * S + jnp.arange(S, dtype=jnp.int32)[None]
    valid = (slot >= start[:, None]) & (slot < jnp.minimum(first * S, end)[:, None])
    part = partial_page(q, jnp.take(k_pages, page, axis=1), jnp.take(v_pages, page, axis=1), valid)
    return merge(whole, part)[:, None].astype(dtype)
