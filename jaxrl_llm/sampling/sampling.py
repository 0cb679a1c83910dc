"""Choosing the next token: temperature, top-k, top-p (nucleus), greedy.

Order, as in HF `generate`: logits / temperature, then top-k, then top-p on what is left.
The log-prob returned with each token is under the temperature-scaled FULL distribution,
log softmax(logits / temperature)[token], which is what the trainer recomputes from a
teacher-forced forward; top-k / top-p only decide which tokens may be drawn. With greedy
decoding (temperature 0) the log-prob is under the untempered distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def top_k_mask(logits: jax.Array, k: int) -> jax.Array:
    """Keeps the k largest logits of each row (ties at the k-th value kept). [..., V]."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits < kth, NEG_INF, logits)


def top_p_mask(logits: jax.Array, p: float) -> jax.Array:
    """Keeps the smallest set of most likely tokens whose probability mass reaches p.

    The most likely token is always kept; ties at the threshold are kept. [..., V].
    """
    if p >= 1.0:
        return logits
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < p
    threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < threshold, NEG_INF, logits)


def sample_tokens(
    key: jax.Array,
    logits: jax.Array,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """logits [N, V] float32 -> (tokens [N] int32, logprobs [N] float32).

    temperature == 0 means greedy. `temperature`, `top_k`, `top_p` are Python numbers
    (static under jit).
    """
    logits = logits.astype(jnp.float32)
    if temperature == 0.0:
        tokens = jnp.argmax(logits, axis=-1)
        logp = jax.nn.log_softmax(logits, axis=-1)
    else:
        scaled = logits / temperature
        logp = jax.nn.log_softmax(scaled, axis=-1)
        filtered = top_p_mask(top_k_mask(scaled, top_k), top_p)
        tokens = jax.random.categorical(key, filtered, axis=-1)
    tokens = tokens.astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
