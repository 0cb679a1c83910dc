"""Attention under context parallelism: with a mesh `context` axis, the sequence is split
over devices everywhere but in attention, where each device needs every position of its
keys and values. `context_attention` moves that axis from the sequence to the heads around
attention (an all-to-all each way) and runs attention per device inside `jax.shard_map`;
`local_kv_heads` picks the key / value heads a device's share of query heads reads under
GQA when the axes do not divide the key / value heads.

`block.Block` calls `context_attention` wherever a layer attends without a KV cache or
page pool (teacher-forced forwards, prefix-extended forwards). It is kept apart from the
layer because it concerns the mesh layout, not the model's math: without a context axis
it is exactly `attention.attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrl_llm.models.attention import attention
from jaxrl_llm.models.partitioning import (
    context_size,
    heads_spec,
    rows_spec,
    shard_heads,
    shard_sequence,
)


def context_attention(q, k, v, mask, *args, sinks=None, **kwargs) -> jax.Array:
    """`attention` with the mesh's `context` axis (if > 1) moved from the sequence to the
    heads around it: q, k, v go to every position of a share of the heads (an
    all-to-all over `context`, `partitioning.shard_heads`), the output back to a share
    of the positions (`shard_sequence`). Without a context axis this is `attention`.

    Between the two, attention runs per device inside `jax.shard_map` (q / k / v split
    on heads over ('tensor', 'context') and on rows over the batch axes, the mask's
    per-row arrays on rows only), so each device computes its heads and nothing else
    whatever the implementation: the partitioner does not carry the heads split through
    the blockwise path's block layout and loops, and would otherwise replicate them.
    Key / value heads the axes do not divide come whole to every device, which takes
    those its query heads read (`local_kv_heads`). sinks [N]: attention sinks, split like
    the query heads."""
    if context_size() == 1:
        return attention(q, k, v, mask, *args, sinks=sinks, **kwargs)
    q, k, v = shard_heads(q), shard_heads(k, "kv"), shard_heads(v, "kv")
    q_spec, kv_spec = heads_spec(q.shape), heads_spec(k.shape)
    mask_spec = jax.tree.map(lambda x: rows_spec(jnp.shape(x)), mask)
    heads_axes, num_heads = q_spec[2], q.shape[2]

    def local(q, k, v, mask, *sinks):
        if kv_spec[2] is None and heads_axes is not None:
            shard = jax.lax.axis_index(heads_axes)
            k, v = local_kv_heads(k, v, q.shape[2], num_heads, shard)
        return attention(q, k, v, mask, *args, sinks=sinks[0] if sinks else None, **kwargs)

    extra = () if sinks is None else (sinks,)
    out = jax.shard_map(
        local,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(q_spec, kv_spec, kv_spec, mask_spec) + ((P(heads_axes),) if extra else ()),
        out_specs=q_spec,
        check_vma=False,
    )(q, k, v, mask, *extra)
    return shard_sequence(out)


def local_kv_heads(k, v, n: int, num_heads: int, shard) -> tuple[jax.Array, jax.Array]:
    """Of every key / value head [B,S,K,H], those that query-head shard `shard` (traced;
    query heads shard * n .. shard * n + n - 1 of `num_heads`) reads under GQA (query
    head i reads kv head i // (num_heads / K)), ordered so that GQA over the n local
    query heads pairs them right: the one kv head when the shard lies within one group,
    else one kv head per query head. (A shard of whole groups means the kv heads divide
    like the query heads, and they arrive split.)"""
    G = num_heads // k.shape[2]  # query heads per kv head
    first = shard * n
    if G % n == 0:
        return tuple(jax.lax.dynamic_slice_in_dim(x, first // G, 1, axis=2) for x in (k, v))
    heads = (first + jnp.arange(n)) // G
    return jnp.take(k, heads, axis=2), jnp.take(v, heads, axis=2)
