"""Token log-probabilities and entropies from final hidden states, in chunks over the sequence.

With logits z = h W / tau (tau = the sampling temperature):
  log pi(y_t) = z_{t, y_t} - logsumexp(z_t),   H_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_{t,v}.

The [N, T, V] logits are never held at once: T is cut into chunks of C positions, a
`lax.map` walks the chunks, and each chunk's function is wrapped in `jax.checkpoint`, so
the backward pass recomputes one chunk's [N, C, V] logits instead of storing them all. Peak
memory is O(N C V) instead of O(N T V); with vocabularies of ~150k this is what makes
long completions fit. Chunking runs over T, not over the flattened N * T tokens, so each
chunk keeps the batch's sharding over devices.

Numerics: the matmul accumulates in float32 (`preferred_element_type`) and the softmax,
logsumexp and entropy are float32, whatever the dtype of h and W (bf16 stays bf16 in
memory). When h and W differ in dtype both are cast to the wider one first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _chunk_logprobs(h, w, targets, temperature: float):
    """h [N, C, D], w [D, V], targets [N, C] -> (logp [N, C], entropy [N, C]) float32."""
    logits = jnp.einsum("ncd,dv->ncv", h, w, preferred_element_type=jnp.float32)
    logits = logits / temperature
    lse = jax.nn.logsumexp(logits, axis=-1)
    # A one-hot contraction rather than a gather: it stays valid (and fused) when the
    # vocabulary axis is sharded over an explicit mesh axis.
    is_target = jnp.arange(logits.shape[-1]) == targets[..., None]
    target_logit = jnp.sum(logits * is_target.astype(logits.dtype), axis=-1)
    probs = jnp.exp(logits - lse[..., None])
    entropy = lse - jnp.sum(probs * logits, axis=-1)
    return target_logit - lse, entropy


def token_logprobs(
    hidden: jax.Array,
    unembed: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int = 128,
    remat: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Chunked log pi(target) and entropy per position.

    hidden [N, T, D] (after the final norm; hidden[:, t] is the state that predicts
    targets[:, t], i.e. already shifted by one against the input ids), unembed [D, V]
    (lm_head, or the embedding transposed when tied), targets [N, T] int ->
    (logp [N, T], entropy [N, T]) float32.
    Differentiable w.r.t. hidden and unembed. chunk_size: positions per chunk (the peak
    holds [N, chunk_size, V] float32); remat: recompute each chunk in the backward pass
    (turn off only when memory is plentiful and the recompute matters).
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: must be >= 1")
    n, t, d = hidden.shape
    dtype = jnp.promote_types(hidden.dtype, unembed.dtype)
    hidden, unembed = hidden.astype(dtype), unembed.astype(dtype)
    c = min(chunk_size, t)
    n_chunks = -(-t // c)
    pad = n_chunks * c - t
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    h_chunks = hidden.reshape(n, n_chunks, c, d).swapaxes(0, 1)
    t_chunks = targets.reshape(n, n_chunks, c).swapaxes(0, 1)

    def one_chunk(w, h, y):
        return _chunk_logprobs(h, w, y, temperature)

    if remat:
        one_chunk = jax.checkpoint(one_chunk)
    logp, entropy = jax.lax.map(lambda xs: one_chunk(unembed, *xs), (h_chunks, t_chunks))

    def unchunk(x):
        return x.swapaxes(0, 1).reshape(n, n_chunks * c)[:, :t]

    return unchunk(logp), unchunk(entropy)
