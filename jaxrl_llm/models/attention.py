"""Grouped-query attention behind one switch (`ModelConfig.attention`), over a mask given
by its structure rather than as a [B, T, S] matrix.

A `Mask` says which keys each query sees from per-token data only:

    query t sees key s  <=>  (k_idx[s] <= q_idx[t]  and  k_valid[b, s]
                              and q_seg[b, t] == k_seg[b, s]              (segments, packing)
                              and q_pos[b, t] - k_pos[b, s] < window)     (sliding window)
                          or  k_idx[s] == q_idx[t]                        (a token sees itself)

q_idx / k_idx order queries and keys in one sequence (a prefix's keys first, a KV cache's
slots), so causality never needs a [T, S] array; the window compares position ids (not
slots), so padding never narrows it; the self term keeps a padding query's row non-empty.

Implementations (`IMPLEMENTATIONS`), each equal to `xla` within rounding:
- `xla`: the full [B, N, T, S] float32 score matrix and a hand-written backward (the
  flash-attention formulas, probabilities recomputed). The exact reference; memory grows
  with T * S.
- `blockwise`: online softmax over key blocks for each block of queries, and a backward
  that recomputes the probabilities block by block; only q, k, v, the output and the row
  logsumexp are kept, so memory is linear in T. Query/key block pairs that the mask
  leaves empty (above the causal diagonal, outside the window) are skipped.
- `cudnn`: cuDNN's fused attention (`jax.nn.dot_product_attention`, GPU only), given the
  mask as a dense [B, T, S] boolean (no float score matrix is kept).
- `pallas`: the TPU splash-attention kernel (`jax.experimental.pallas.ops.tpu`), with
  padding and segments as segment ids and causality as its block-sparse causal mask
  (`interpret=True` runs it on CPU, for tests). No sliding window (refused).
The two kernels live in `attention_kernels.py`.

Attention sinks (GPT-OSS): `sinks` [N], a learned logit per query head that joins every
row's softmax denominator as a key with a zero value,

    o_t = sum_s exp(x_ts) v_s / (exp(sink) + sum_s exp(x_ts)),

so a head can attend to nothing. `xla` and `blockwise` take them (the online softmax
starts from the sink as a key already seen: running max = sink, sum = 1), with their
gradient d sink = -sum_t exp(sink - lse_t) (g_t . o_t); the two kernels do not (`auto`
then means `blockwise`; asking for them is refused in `ModelConfig`).
`auto` picks by backend (`resolve`; on GPU `blockwise` for float32 inputs, on TPU for a
sliding window). `cached_attention` is the forward over one layer of
the sampler's KV cache in its stored layout (`kv_cache.KVCache`); a query block of
prefill over a long cache goes through `blockwise` (`cached_blockwise`). Scores and
softmax are float32 whatever the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl_llm.models.attention_kernels import cudnn, pallas
from jaxrl_llm.models.config_checks import ATTENTION_IMPLEMENTATIONS as IMPLEMENTATIONS
from jaxrl_llm.parallel import target

DEFAULT_BLOCK = 512  # query and key block of `blockwise`
# `auto` on CPU: the full score matrix up to this many query x key pairs (faster on short
# sequences), blockwise above (benchmarks/RESULTS.md, "attention memory").
CPU_XLA_MAX_PAIRS = 2048 * 2048
_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # masked score: finite, so no NaN rows
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


@struct.dataclass
class Mask:
    """The structure of an attention mask (module docstring). Shapes: q_idx [T] (shared
    by the batch) or [B,T] (each row's queries at their own slots, e.g. paged rows of
    different lengths; the `xla` and `blockwise` paths), k_idx [S] int32 (shared by the
    batch); k_valid [B,S] bool; q_pos [B,T], k_pos [B,S] int32;
    q_seg [B,T] / k_seg [B,S] int32 or None (no segments); window: int32 scalar (traced:
    a layer's kind may pick it) or None (no window)."""

    q_idx: jax.Array
    k_idx: jax.Array
    k_valid: jax.Array
    q_pos: jax.Array
    k_pos: jax.Array
    q_seg: jax.Array | None = None
    k_seg: jax.Array | None = None
    window: jax.Array | None = None

    def block(self, q: slice | None = None, k: slice | None = None) -> jax.Array:
        """The dense mask [B, Tq, Sk] of queries q and keys k (slices; None = all)."""
        q = q or slice(None)
        k = k or slice(None)
        qi, ki = self.q_idx[..., q], self.k_idx[k]
        qi = (qi if qi.ndim == 2 else qi[None])[:, :, None]  # [B or 1, Tq, 1]
        m = (ki[None, None, :] <= qi) & self.k_valid[:, None, k]
        if self.q_seg is not None:
            m &= self.q_seg[:, q, None] == self.k_seg[:, None, k]
        if self.window is not None:
            m &= self.q_pos[:, q, None] - self.k_pos[:, None, k] < self.window
        return m | (ki[None, None, :] == qi)

    def dense(self) -> jax.Array:
        """[B, T, S] bool: the whole mask (the `xla` and `cudnn` paths, decode)."""
        return self.block()


def causal_mask(
    valid, positions=None, segment_ids=None, prefix_valid=None, prefix_pos=None
) -> Mask:
    """The mask of a sequence (valid [B,T]) after an optional prefix (prefix_valid [B,P]):
    causal over [prefix, sequence], padding keys hidden, segments kept apart."""
    B, T = valid.shape
    P = 0 if prefix_valid is None else prefix_valid.shape[1]
    positions = jnp.zeros((B, T), jnp.int32) if positions is None else positions
    k_valid, k_pos = valid, positions
    if P:
        k_valid = jnp.concatenate([prefix_valid, valid], axis=1)
        k_pos = jnp.concatenate([prefix_pos, positions], axis=1)
    return Mask(
        q_idx=P + jnp.arange(T, dtype=jnp.int32),
        k_idx=jnp.arange(P + T, dtype=jnp.int32),
        k_valid=k_valid,
        q_pos=positions,
        k_pos=k_pos,
        q_seg=segment_ids,
        k_seg=segment_ids,
    )


def resolve(name: str, backend: str, t: int = 0, s: int = 0) -> str:
    """The implementation `auto` means on `backend` for T queries over S keys: cuDNN on
    GPU, splash on TPU, on CPU the full matrix for short sequences and blockwise above
    `CPU_XLA_MAX_PAIRS` query x key pairs."""
    if name != "auto":
        return name
    if backend == "gpu":
        return "cudnn"
    if backend == "tpu":
        return "pallas"
    return "xla" if t * s <= CPU_XLA_MAX_PAIRS else "blockwise"


def attention(q, k, v, mask, implementation: str = "xla", block: int = DEFAULT_BLOCK, sinks=None):
    """GQA attention. q [B,T,N,H], k/v [B,S,K,H], mask a `Mask` (or, `xla` only, a dense
    [B,T,S] bool) -> [B,T,N,H]. implementation: one of `IMPLEMENTATIONS`. sinks: [N]
    attention-sink logits or None (module docstring)."""
    if not isinstance(mask, Mask):
        return _attention_vjp(q, k, v, mask, sinks)
    name = resolve(implementation, target.backend(), q.shape[1], k.shape[1])
    if sinks is not None and name in ("cudnn", "pallas"):
        if implementation != "auto":
            raise ValueError(f"model.attention={implementation!r} has no attention sinks")
        name = "blockwise"
    if implementation == "auto" and name == "pallas" and mask.window is not None:
        name = "blockwise"  # splash has no position-based window
    if implementation == "auto" and name == "cudnn" and q.dtype not in _CUDNN_DTYPES:
        name = "blockwise"  # cuDNN's fused attention takes 16-bit inputs only
    if name == "xla":
        return _attention_vjp(q, k, v, mask.dense(), sinks)
    if name == "blockwise":
        return blockwise(q, k, v, mask, block, sinks)
    if name == "cudnn":
        return cudnn(q, k, v, mask)
    if name == "pallas":
        return pallas(q, k, v, mask, block)
    raise ValueError(f"model.attention={implementation!r}: expected one of {IMPLEMENTATIONS}")


def cached_attention(q, kt, v, mask, sinks=None) -> jax.Array:
    """`attention` (forward only) over one layer of the KV cache, in the cache's layout:
    kt [B,K,H,S] (keys transposed), v [B,K,S,H], mask [B,T,S] bool. Both matmuls then
    read the cache slice as it is, each with its contraction on the operand's leading
    axis."""
    B, T, N, H = q.shape
    K = kt.shape[1]
    qr, mr = _q_rows(q, K), _mask_rows(mask, N // K)
    return _unrows(_attention_rows(qr, kt, v, mr, "bkhs", _sink_rows(sinks, K, T))[0], B, T, N, H)


def cached_blockwise(q, kt, v, mask: Mask, block: int = DEFAULT_BLOCK, sinks=None) -> jax.Array:
    """`cached_attention` without the [B,N,T,S] scores: the cache read in key blocks
    (prefill of a long prompt, a chunk at a time). Forward only."""
    k = kt.transpose(0, 3, 1, 2).astype(q.dtype)
    return blockwise(q, k, v.transpose(0, 2, 1, 3).astype(q.dtype), mask, block, sinks)


# ------------------------------------------------------------------- xla: full matrix
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


def _sink_rows(sinks, K, T):
    """sinks [N] -> [1,K,G*T,1] float32 (row g * T + t of kv head k is query head k G + g),
    or None."""
    if sinks is None:
        return None
    G = sinks.shape[0] // K
    rows = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(K, G, 1), (K, G, T))
    return rows.reshape(1, K, G * T, 1)


def _unrows(o, B, T, N, H):
    K = o.shape[1]
    return o.reshape(B, K, N // K, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)


def _scores(qr, kr, mr, scale, k_layout="bksh"):
    s = jnp.einsum(f"bkrh,{k_layout}->bkrs", qr, kr, preferred_element_type=jnp.float32)
    return jnp.where(mr, s * scale, _NEG)


def _attention_rows(qr, kr, vr, mr, k_layout="bksh", sinks=None):
    """Row-layout attention -> (o [B,K,R,H], row logsumexp [B,K,R,1]). sinks: [1,K,R,1]
    float32 (`_sink_rows`) or None."""
    s = _scores(qr, kr, mr, qr.shape[-1] ** -0.5, k_layout)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, sinks)
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp(sinks - m)
    o = jnp.einsum("bkrs,bksh->bkrh", (e / total).astype(vr.dtype), vr)
    return o, m + jnp.log(total)


def _attention(q, k, v, mask, sinks):
    B, T, N, H = q.shape
    qr, kr, vr, mr = _rows(q, k, v, mask)
    o, lse = _attention_rows(qr, kr, vr, mr, sinks=_sink_rows(sinks, k.shape[2], T))
    return _unrows(o, B, T, N, H), (qr, kr, vr, mr, o, lse)


@jax.custom_vjp
def _attention_vjp(q, k, v, mask, sinks=None):
    """Full-matrix attention, mask [B,T,S], sinks [N] or None. The backward is written
    out (the flash-attention formulas): only q, k, v, the output and the row logsumexp
    are kept and the probabilities are recomputed; autodiff kept every layer's
    [B, N, T, S] probabilities (benchmarks/RESULTS.md, "model")."""
    return _attention(q, k, v, mask, sinks)[0]


def _attention_fwd(q, k, v, mask, sinks=None):
    out, res = _attention(q, k, v, mask, sinks)
    return out, (*res, q.shape, k.shape, sinks)


def _sink_grad(sinks, lse, delta, shape):
    """d sink = -sum over rows of exp(sink - lse) * delta, from per-row lse and delta of
    `shape` (B, K, G, rows per query head, 1) -> [N] in the sinks' dtype."""
    B, K, G = shape[:3]
    s = sinks.astype(jnp.float32).reshape(1, K, G, 1, 1)
    p = jnp.exp(s - lse.reshape(shape)) * delta.reshape(shape)
    return -jnp.sum(p, axis=(0, 3, 4)).reshape(K * G).astype(sinks.dtype)


def _attention_bwd(res, g):
    qr, kr, vr, mr, o, lse, q_shape, k_shape, sinks = res
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
    dsinks = None if sinks is None else _sink_grad(sinks, lse, delta, (B, K, N // K, T, 1))
    return dq, dk, dv.transpose(0, 2, 1, 3), None, dsinks


_attention_vjp.defvjp(_attention_fwd, _attention_bwd)


# ------------------------------------------------------------- blockwise: O(T) memory
def blockwise(q, k, v, mask: Mask, block: int = DEFAULT_BLOCK, sinks=None) -> jax.Array:
    """`attention` in query x key blocks of at most `block` tokens. q [B,T,N,H], k/v
    [B,S,K,H] -> [B,T,N,H]. T and S are padded to whole blocks (padding keys invalid,
    padding queries dropped). sinks: [N] or None."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    bq, bk = min(block, T), min(block, S)
    tp, sp = -(-T // bq) * bq - T, -(-S // bk) * bk - S
    if tp or sp:
        q = jnp.pad(q, ((0, 0), (0, tp), (0, 0), (0, 0)))
        k, v = (jnp.pad(x, ((0, 0), (0, sp), (0, 0), (0, 0))) for x in (k, v))
        mask = _pad_mask(mask, tp, sp)
    # [B,T,N,H] -> [nq,B,K,G,bq,H]; [B,S,K,H] -> [nk,B,K,bk,H]
    qb = q.reshape(B, -1, bq, K, N // K, H).transpose(1, 0, 3, 4, 2, 5)
    kb, vb = (x.reshape(B, -1, bk, K, H).transpose(1, 0, 3, 2, 4) for x in (k, v))
    o = _blockwise_vjp(qb, kb, vb, mask, sinks)
    return o.transpose(1, 0, 4, 2, 3, 5).reshape(B, T + tp, N, H)[:, :T]


def _pad_mask(mask: Mask, tp: int, sp: int) -> Mask:
    def pad(x, n, value):
        if x is None or not n:
            return x
        return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n)], constant_values=value)

    return mask.replace(
        q_idx=pad(mask.q_idx, tp, -2),  # sees no key: a padding query's row is dropped
        k_idx=pad(mask.k_idx, sp, -1),
        k_valid=pad(mask.k_valid, sp, False),
        q_pos=pad(mask.q_pos, tp, 0),
        k_pos=pad(mask.k_pos, sp, 0),
        q_seg=pad(mask.q_seg, tp, -2),
        k_seg=pad(mask.k_seg, sp, -1),
    )


def _block_mask(mask: Mask, i, j, bq: int, bk: int, anchor) -> jax.Array:
    """The dense mask [B,bq,bk] of query block i and key block j (traced indices).

    anchor: an array of this block's data. Autodiff of the layer scan hoists loop-invariant
    work out of it: the masks of every (i, j) pair, which depend only on the mask, would
    be computed once and stacked, [nq, nk, B, bq, bk] (quadratic in T). Indices that
    depend on the block's data (i + 0 * anything, as integers) keep that work here."""
    first = anchor.reshape(-1)[0]
    zero = jnp.logical_and(first != first, False).astype(jnp.int32)
    i, j = i + zero, j + zero

    def take(x, n, start):
        return None if x is None else jax.lax.dynamic_slice_in_dim(x, start, n, axis=x.ndim - 1)

    qs, ks = i * bq, j * bk
    sub = Mask(
        q_idx=take(mask.q_idx, bq, qs),
        k_idx=take(mask.k_idx, bk, ks),
        k_valid=take(mask.k_valid, bk, ks),
        q_pos=take(mask.q_pos, bq, qs),
        k_pos=take(mask.k_pos, bk, ks),
        q_seg=take(mask.q_seg, bq, qs),
        k_seg=take(mask.k_seg, bk, ks),
        window=mask.window,
    )
    return sub.dense()


def _block_scores(qi, kj, m, scale):
    """qi [B,K,G,bq,H], kj [B,K,bk,H], m [B,bq,bk] -> masked scaled scores, float32."""
    s = jnp.einsum("bkgqh,bksh->bkgqs", qi, kj, preferred_element_type=jnp.float32)
    return jnp.where(m[:, None, None], s * scale, _NEG)


def _blockwise_forward(qb, kb, vb, mask, sinks=None):
    """-> (o [nq,B,K,G,bq,H], lse [nq,B,K,G,bq,1] float32). sinks [N]: the running max
    starts at the sink and the sum at 1 (the sink seen as a key of value zero)."""
    nq, bq, bk, H = qb.shape[0], qb.shape[4], kb.shape[3], qb.shape[-1]
    scale = H**-0.5

    def q_block(i):
        qi = qb[i]

        def k_step(carry, j):
            m = _block_mask(mask, i, j, bq, bk, qi)

            def visit(carry):
                mx, total, acc = carry
                s = _block_scores(qi, kb[j], m, scale)
                new = jnp.maximum(mx, jnp.max(s, axis=-1, keepdims=True))
                p, corr = jnp.exp(s - new), jnp.exp(mx - new)
                pv = jnp.einsum(
                    "bkgqs,bksh->bkgqh",
                    p.astype(vb.dtype),
                    vb[j],
                    preferred_element_type=jnp.float32,
                )
                return new, total * corr + jnp.sum(p, -1, keepdims=True), acc * corr + pv

            return jax.lax.cond(jnp.any(m), visit, lambda c: c, carry), None

        shape = qi.shape[:-1] + (1,)
        init = (
            jnp.full(shape, _NEG, jnp.float32),
            jnp.zeros(shape, jnp.float32),
            jnp.zeros(qi.shape, jnp.float32),
        )
        if sinks is not None:
            K, G = qi.shape[1:3]
            s = sinks.astype(jnp.float32).reshape(1, K, G, 1, 1)
            init = (jnp.broadcast_to(s, shape), jnp.ones(shape, jnp.float32), init[2])
        (mx, total, acc), _ = jax.lax.scan(k_step, init, jnp.arange(kb.shape[0]))
        total = jnp.maximum(total, jnp.finfo(jnp.float32).tiny)  # a row that saw nothing
        return (acc / total).astype(qb.dtype), mx + jnp.log(total)

    return jax.lax.map(q_block, jnp.arange(nq))


@jax.custom_vjp
def _blockwise_vjp(qb, kb, vb, mask, sinks=None):
    return _blockwise_forward(qb, kb, vb, mask, sinks)[0]


def _blockwise_fwd(qb, kb, vb, mask, sinks=None):
    o, lse = _blockwise_forward(qb, kb, vb, mask, sinks)
    return o, (qb, kb, vb, mask, o, lse, sinks)


def _blockwise_bwd(res, g):
    """Per query block, a scan over key blocks: p = exp(s - lse) recomputed, then
    dv += p^T g, ds = p (g v^T - delta) / sqrt(H), dq += ds k, dk += ds^T q."""
    qb, kb, vb, mask, o, lse, sinks = res
    bq, bk, H = qb.shape[4], kb.shape[3], qb.shape[-1]
    scale = H**-0.5
    delta = jnp.sum(g.astype(jnp.float32) * o.astype(jnp.float32), -1, keepdims=True)

    def q_block(carry, i):
        dk, dv = carry
        qi, gi, lse_i, delta_i = qb[i], g[i], lse[i], delta[i]

        def k_step(dq, j):
            m = _block_mask(mask, i, j, bq, bk, gi)

            def visit(dq):
                p = jnp.exp(_block_scores(qi, kb[j], m, scale) - lse_i)
                dvj = jnp.einsum(
                    "bkgqs,bkgqh->bksh", p.astype(gi.dtype), gi, preferred_element_type=jnp.float32
                )
                dp = jnp.einsum("bkgqh,bksh->bkgqs", gi, vb[j], preferred_element_type=jnp.float32)
                ds = (p * (dp - delta_i) * scale).astype(qi.dtype)
                dq = dq + jnp.einsum(
                    "bkgqs,bksh->bkgqh", ds, kb[j], preferred_element_type=jnp.float32
                )
                dkj = jnp.einsum("bkgqs,bkgqh->bksh", ds, qi, preferred_element_type=jnp.float32)
                return dq, dkj, dvj

            def skip(dq):
                zero = jnp.zeros(kb.shape[1:], jnp.float32)
                return dq, zero, zero

            dq, dkj, dvj = jax.lax.cond(jnp.any(m), visit, skip, dq)
            return dq, (dkj, dvj)

        dq, (dkb, dvb) = jax.lax.scan(
            k_step, jnp.zeros(qi.shape, jnp.float32), jnp.arange(kb.shape[0])
        )
        return (dk + dkb, dv + dvb), dq.astype(qb.dtype)

    zeros = jnp.zeros(kb.shape, jnp.float32)
    (dk, dv), dq = jax.lax.scan(q_block, (zeros, zeros), jnp.arange(qb.shape[0]))
    dsinks = None
    if sinks is not None:  # rows: (nq, B) first, then (K, G), then bq
        nq, B, K, G, bq = qb.shape[:5]
        row = lambda x: x.transpose(1, 2, 3, 0, 4, 5).reshape(B, K, G, nq * bq, 1)  # noqa: E731
        dsinks = _sink_grad(sinks, row(lse), row(delta), (B, K, G, nq * bq, 1))
    return dq, dk.astype(kb.dtype), dv.astype(vb.dtype), None, dsinks


_blockwise_vjp.defvjp(_blockwise_fwd, _blockwise_bwd)
