"""The accelerators' own attention kernels behind `model.attention` (`attention.py` holds
the dispatch, the structural `Mask` these take, and the portable paths they are tested
against): cuDNN's fused attention on GPU and the Pallas splash-attention kernel on TPU.

Both take q [B,T,N,H], k/v [B,S,K,H] and an `attention.Mask`, and return [B,T,N,H].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def cudnn(q, k, v, mask) -> jax.Array:
    """cuDNN's fused attention (GPU). The mask goes in dense ([B,1,T,S] bool): cuDNN's
    structural masks (causal, right padding by lengths, a static window) cannot express
    holes of left padding, segments or a traced per-layer window."""
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask.dense()[:, None], scale=q.shape[-1] ** -0.5, implementation="cudnn"
    )


def pallas(q, k, v, mask, block: int = 512, interpret: bool = False):
    """The TPU splash-attention kernel, one MQA kernel per kv head (its G query heads).

    Causality is the kernel's block-sparse causal mask (offset by a prefix, S - T);
    padding keys and segments become segment ids (a padding key's id differs from every
    query's), so a padding query sees no key and its row is left to the kernel (its
    output is never read). Sequences are padded to whole blocks. No sliding window. With
    a mesh of several devices set around the trace (`rl.batch.context_mesh` sets it on
    TPU), the kernel runs per device in `jax.shard_map`."""
    if mask.window is not None:
        raise ValueError("model.attention='pallas' has no sliding window; use 'blockwise'")
    B, T = q.shape[:2]
    S = k.shape[1]
    seg_q = jnp.zeros((B, T), jnp.int32) if mask.q_seg is None else mask.q_seg
    seg_k = jnp.zeros((B, S), jnp.int32) if mask.k_seg is None else mask.k_seg
    seg_k = jnp.where(mask.k_valid, seg_k, -1)
    local = functools.partial(_splash, block=block, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return local(q, k, v, seg_q, seg_k)
    # A Mosaic kernel is not partitioned by XLA: on a mesh it runs per device, on its rows
    # and (where `tensor` splits the kv heads) its heads.
    from jaxrl_llm.models import partitioning

    spec = partitioning.logical_to_spec(("batch", None, "kv_heads", None), k.shape, mesh)
    rows = P(spec[0], None)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(spec, spec, spec, rows, rows),
        out_specs=spec,
        check_vma=False,
    )(q, k, v, seg_q, seg_k)


def _splash(q, k, v, seg_q, seg_k, block: int, interpret: bool):
    """`pallas` on one device's rows: q [B,T,N,H], k / v [B,S,K,H], seg_q [B,T], seg_k
    [B,S] (-1 at padding keys) -> [B,T,N,H]."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as masks,
    )

    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    bq, bk = min(block, _round_up(T, 128)), min(block, _round_up(S, 128))
    tp, sp = _round_up(T, bq) - T, _round_up(S, bk) - S
    seg_q = jnp.pad(seg_q, ((0, 0), (0, tp)), constant_values=-2)
    seg_k = jnp.pad(seg_k, ((0, 0), (0, sp)), constant_values=-1)
    q = jnp.pad(q * jnp.asarray(H**-0.5, q.dtype), ((0, 0), (0, tp), (0, 0), (0, 0)))
    k, v = (jnp.pad(x, ((0, 0), (0, sp), (0, 0), (0, 0))) for x in (k, v))
    causal = masks.CausalMask((T + tp, S + sp), offset=S - T)
    sizes = splash.BlockSizes(
        block_q=bq,
        block_kv=bk,
        block_kv_compute=bk,
        block_q_dkv=bq,
        block_kv_dkv=bk,
        block_kv_dkv_compute=bk,
        block_q_dq=bq,
        block_kv_dq=bk,
    )
    kernel = splash.make_splash_mqa_single_device(
        masks.MultiHeadMask([causal] * G), block_sizes=sizes, interpret=interpret
    )
    # q [B,T,K,G,H] -> [B,K,G,T,H]; k, v -> [B,K,S,H]
    qr = q.reshape(B, T + tp, K, G, H).transpose(0, 2, 3, 1, 4)
    kr, vr = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def one(qh, kh, vh, sq, sk):
        return kernel(qh, kh, vh, segment_ids=splash.SegmentIds(q=sq, kv=sk))

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None, None))
    o = jax.vmap(per_head)(qr, kr, vr, seg_q, seg_k)  # [B,K,G,T,H]
    return o.transpose(0, 3, 1, 2, 4).reshape(B, T + tp, N, H)[:, :T]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m
