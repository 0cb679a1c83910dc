"""Token log-probabilities and entropies from final hidden states, in chunks over the sequence.

With logits z = s(h W) / tau (tau = the sampling temperature; s the model's final-logit
soft-capping c tanh(x / c), Gemma 4's, or the identity):
  log pi(y_t) = z_{t, y_t} - logsumexp(z_t),   H_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_{t,v}.

The [N, T, V] logits are never held at once: T is cut into chunks of C positions, a
`lax.map` walks the chunks, and (remat=True) the backward pass recomputes one chunk's
[N, C, V] logits instead of storing them all. When the logits are kept (small [N, T, V]),
there are at most `UNROLL_CHUNKS` chunks and their [D, V] weight gradients together fit
`UNROLL_GRAD_BYTES`, the chunks are straight-line code instead of a `lax.map`, so each kept
chunk stays in its own buffer. Peak memory is O(N C V) instead of
O(N T V); with vocabularies of ~150k this is what makes long completions fit. Each chunk
has a hand-written backward (`_chunk_bwd`): the logits' cotangent
g_logp (onehot - p) - g_H p (z - sum p z) is one fused pass over [N, C, V] followed by the
matmul's pullback, where autodiff of the forward took several passes over [N, C, V] (and
kept the softmax besides the logits; benchmarks/RESULTS.md, "update").
Chunking runs over T, not over the flattened N * T tokens, so each chunk keeps the batch's
sharding over devices.

Numerics: the matmul accumulates in float32 (`preferred_element_type`) and the softmax,
logsumexp and entropy are float32, whatever the dtype of h and W (bf16 stays bf16 in
memory). When h and W differ in dtype both are cast to the wider one first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_llm.models.layer_math import softcap as soft_cap
from jaxrl_llm.models.partitioning import context_size

SAVE_LOGITS_BYTES = 512 * 2**20  # remat=None: keep the logits for the backward up to this
UNROLL_CHUNKS = 16  # logits kept: up to this many chunks run as straight-line code
# ... and only while their weight gradients ([D, V] in W's dtype) held together stay below
# this: straight-line chunks each make their own, and XLA sums them in one fusion that
# reads them all, so all of them are live at once; a `lax.map` sums them in its carry.
UNROLL_GRAD_BYTES = 256 * 2**20


def _logits(h, w, temperature: float, softcap: float | None):
    """h [N, C, D], w [D, V] -> z = s(h W) / tau, [N, C, V] float32 (one 2-D matmul)."""
    n, c, d = h.shape
    z = jnp.matmul(h.reshape(n * c, d), w, preferred_element_type=jnp.float32)
    return soft_cap(z.reshape(n, c, -1), softcap) / temperature


def _stats(z, targets):
    """(log pi(target), entropy, logsumexp) of logits z [N, C, V], one exp per element."""
    m = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z - m)
    total = jnp.sum(e, axis=-1)
    lse = m[..., 0] + jnp.log(total)
    mean_z = jnp.sum(e * z, axis=-1) / total
    return _target_logits(z, targets) - lse, lse - mean_z, lse


def _target_logits(z, targets):
    """z[..., targets]. A gather reads N * C logits; the one-hot select-and-sum it replaces
    was two more passes over [N, C, V] on CPU (the select is materialized before the
    reduction). Where the vocabulary axis is sharded over an explicit mesh axis the gather
    has no sharding rule, so there the one-hot form stays (a local sum, then an all-reduce).
    """
    spec = getattr(jax.typeof(z).sharding, "spec", ())
    if len(spec) == z.ndim and spec[-1] is not None:
        is_target = jnp.arange(z.shape[-1]) == targets[..., None]
        return jnp.sum(jnp.where(is_target, z, 0.0), axis=-1)
    return jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunk_logprobs(h, w, targets, temperature: float, save_logits: bool, softcap):
    """h [N, C, D], w [D, V], targets [N, C] -> (logp [N, C], entropy [N, C]) float32."""
    logp, entropy, _ = _stats(_logits(h, w, temperature, softcap), targets)
    return logp, entropy


def _chunk_fwd(h, w, targets, temperature, save_logits, softcap):
    z = _logits(h, w, temperature, softcap)
    logp, entropy, lse = _stats(z, targets)
    return (logp, entropy), (h, w, targets, lse, entropy, z if save_logits else None)


def _chunk_bwd(temperature, save_logits, softcap, res, cotangents):
    """d logp / dz = onehot(y) - p;  d H / dz = -p (z - sum p z): the [N, C, V] cotangent
    in one fused elementwise pass, then the matmul's own pullback (JAX's transpose rule,
    so a vocabulary sharded over an explicit mesh axis gets its reduction right)."""
    h, w, targets, lse, entropy, z = res
    g_logp, g_ent = cotangents
    if z is None:
        z = _logits(h, w, temperature, softcap)  # remat: recompute, not store [N, C, V]
    p = jnp.exp(z - lse[..., None])
    is_target = jnp.arange(z.shape[-1]) == targets[..., None]
    mean_z = (lse - entropy)[..., None]
    dz = g_logp[..., None] * (is_target - p) - g_ent[..., None] * p * (z - mean_z)
    _, pullback = jax.vjp(lambda h, w: _logits(h, w, temperature, softcap), h, w)
    dh, dw = pullback(dz)
    return dh, dw, None


_chunk_logprobs.defvjp(_chunk_fwd, _chunk_bwd)


def _chunks(x: jax.Array, n_chunks: int, c: int, strided: bool) -> jax.Array:
    """[N, n_chunks * c, ...] -> [n_chunks, N, c, ...]: chunk i holds positions
    i*c .. i*c + c - 1, or (strided) positions i, i + n_chunks, i + 2 n_chunks, ..."""
    n, rest = x.shape[0], x.shape[2:]
    if strided:
        return jnp.moveaxis(x.reshape(n, c, n_chunks, *rest), 2, 0)
    return x.reshape(n, n_chunks, c, *rest).swapaxes(0, 1)


def token_logprobs(
    hidden: jax.Array,
    unembed: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int = 128,
    remat: bool | None = None,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Chunked log pi(target) and entropy per position.

    hidden [N, T, D] (after the final norm; hidden[:, t] is the state that predicts
    targets[:, t], i.e. already shifted by one against the input ids), unembed [D, V]
    (lm_head, or the embedding transposed when tied), targets [N, T] int ->
    (logp [N, T], entropy [N, T]) float32.
    Differentiable w.r.t. hidden and unembed. chunk_size: positions per chunk (the peak
    holds [N, chunk_size, V] float32); remat: recompute each chunk's logits in the
    backward pass instead of keeping them. None (default) keeps them when all of them,
    [N, T, V] float32, fit in `SAVE_LOGITS_BYTES` (a small micro-batch: the recompute is a
    whole extra unembedding matmul) and recomputes otherwise (long completions, large
    vocabularies: memory decides). softcap: the model's final-logit soft-capping
    (`ModelConfig.final_logit_softcapping`), None for none.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: must be >= 1")
    n, t, d = hidden.shape
    if remat is None:
        remat = n * t * unembed.shape[-1] * 4 > SAVE_LOGITS_BYTES
    dtype = jnp.promote_types(hidden.dtype, unembed.dtype)
    hidden, unembed = hidden.astype(dtype), unembed.astype(dtype)
    c = min(chunk_size, t)
    n_chunks = -(-t // c)
    pad = n_chunks * c - t
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # Chunk i: positions i*c .. i*c + c - 1; with the positions split over a mesh
    # `context` axis, positions i, i + n_chunks, ... instead, so that every chunk spans
    # all the devices' shares and each device computes its positions of every chunk (a
    # contiguous chunk lies on one device's share, and the partitioner has each of the
    # devices compute all of it).
    strided = context_size() > 1
    h_chunks, t_chunks = (_chunks(x, n_chunks, c, strided) for x in (hidden, targets))

    def one_chunk(xs):
        return _chunk_logprobs(xs[0], unembed, xs[1], temperature, not remat, softcap)

    grad_bytes = n_chunks * unembed.size * unembed.dtype.itemsize  # the chunks' weight gradients
    few = n_chunks == 1 or (n_chunks <= UNROLL_CHUNKS and grad_bytes <= UNROLL_GRAD_BYTES)
    if not remat and few:
        # Straight-line chunks: each keeps its own logits buffer for the backward. Under
        # lax.map the kept logits are stacked into one [n_chunks, N, C, V] array, which XLA
        # zero-fills and then copies every chunk into (two extra passes over the logits);
        # but the map's backward adds each chunk's weight gradient to one sum as it goes.
        outs = [one_chunk((h_chunks[i], t_chunks[i])) for i in range(n_chunks)]
        logp, entropy = (jnp.stack(x) for x in zip(*outs, strict=True))
    else:
        logp, entropy = jax.lax.map(one_chunk, (h_chunks, t_chunks))

    def unchunk(x):  # [n_chunks, N, C] -> [N, T]
        x = x.transpose(1, 2, 0) if strided else x.swapaxes(0, 1)
        return x.reshape(n, n_chunks * c)[:, :t]

    return unchunk(logp), unchunk(entropy)
