"""Grouped-query attention: the training form (custom backward) and the KV-cache form.

`attention` runs over full sequences with a hand-written backward (the flash-attention
formulas: only q, k, v, the output and the row logsumexp are kept, the probabilities are
recomputed); `cached_attention` is the forward over one layer of the KV cache in its
stored layout (`kv_cache.KVCache`). Both stack the G = N / K query heads that share a
key/value head as G * T rows of one matmul per (batch, kv head). Scores and softmax are
float32 whatever the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention(q, k, v, mask) -> jax.Array:
    """GQA attention. q [B,T,N,H], k/v [B,S,K,H], mask [B,T,S] bool -> [B,T,N,H].

    Scores and softmax in float32. The G = N / K query heads that share a key/value head
    are stacked as G * T rows of one matmul per (batch, kv head). The backward is written
    out (`_attention_bwd`, the flash-attention formulas): only q, k, v, the output and the
    row logsumexp are kept, and the probabilities are recomputed. Autodiff kept every
    layer's [B, N, T, S] probabilities and reshuffled them between layouts, several times
    the memory traffic of the matmuls themselves (benchmarks/RESULTS.md, "model").
    """
    return _attention_vjp(q, k, v, mask)


def cached_attention(q, kt, v, mask) -> jax.Array:
    """`attention` (forward only) over one layer of the KV cache, in the cache's layout:
    kt [B,K,H,S] (keys transposed), v [B,K,S,H]. Both matmuls then read the cache slice
    as it is, each with its contraction on the operand's leading axis."""
    B, T, N, H = q.shape
    qr, mr = _q_rows(q, kt.shape[1]), _mask_rows(mask, N // kt.shape[1])
    return _unrows(_attention_rows(qr, kt, v, mr, "bkhs")[0], B, T, N, H)


def _q_rows(q, K):
    """q [B,T,N,H] -> [B,K,G*T,H] (row = g * T + t)."""
    B, T, N, H = q.shape
    G = N // K
    return q.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)


def _mask_rows(mask, G):
    """mask [B,T,S] -> [B,1,G*T,S]."""
    B, T, S = mask.shape
    return jnp.broadcast_to(mask[:, None, None], (B, 1, G, T, S)).reshape(B, 1, G * T, S)


def _rows(q, k, v, mask):
    """q -> [B,K,G*T,H]; k, v [B,S,K,H] -> [B,K,S,H]; mask -> [B,1,G*T,S]."""
    K = k.shape[2]
    kr, vr = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    return _q_rows(q, K), kr, vr, _mask_rows(mask, q.shape[2] // K)


def _unrows(o, B, T, N, H):
    K = o.shape[1]
    return o.reshape(B, K, N // K, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)


def _scores(qr, kr, mr, scale, k_layout="bksh"):
    s = jnp.einsum(f"bkrh,{k_layout}->bkrs", qr, kr, preferred_element_type=jnp.float32)
    return jnp.where(mr, s * scale, -0.7 * jnp.finfo(jnp.float32).max)


def _attention_rows(qr, kr, vr, mr, k_layout="bksh"):
    """Row-layout attention -> (o [B,K,R,H], row logsumexp [B,K,R,1])."""
    s = _scores(qr, kr, mr, qr.shape[-1] ** -0.5, k_layout)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    o = jnp.einsum("bkrs,bksh->bkrh", (e / total).astype(vr.dtype), vr)
    return o, m + jnp.log(total)


def _attention(q, k, v, mask):
    B, T, N, H = q.shape
    qr, kr, vr, mr = _rows(q, k, v, mask)
    o, lse = _attention_rows(qr, kr, vr, mr)
    return _unrows(o, B, T, N, H), (qr, kr, vr, mr, o, lse)


@jax.custom_vjp
def _attention_vjp(q, k, v, mask):
    return _attention(q, k, v, mask)[0]


def _attention_fwd(q, k, v, mask):
    out, res = _attention(q, k, v, mask)
    return out, (*res, q.shape, k.shape)


def _attention_bwd(res, g):
    qr, kr, vr, mr, o, lse, q_shape, k_shape = res
    B, T, N, H = q_shape
    K = k_shape[2]
    gr = g.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4).reshape(o.shape)
    p = jnp.exp(_scores(qr, kr, mr, H**-0.5) - lse)  # [B,K,R,S] float32
    dv = jnp.einsum("bkrs,bkrh->bksh", p.astype(gr.dtype), gr)
    dp = jnp.einsum("bkrh,bksh->bkrs", gr, vr, preferred_element_type=jnp.float32)
    delta = jnp.sum(gr.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
    ds = (p * (dp - delta) * H**-0.5).astype(qr.dtype)
    dq = _unrows(jnp.einsum("bkrs,bksh->bkrh", ds, kr), B, T, N, H)
    dk = jnp.einsum("bkrs,bkrh->bksh", ds, qr).transpose(0, 2, 1, 3)
    return dq, dk, dv.transpose(0, 2, 1, 3), None


_attention_vjp.defvjp(_attention_fwd, _attention_bwd)
