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


BLOCK = 256  # vocabulary block of the two-level sampler


def _blocks(logits: jax.Array) -> jax.Array:
    """[N, V] -> [N, ceil(V / BLOCK), BLOCK], padded with -inf."""
    N, V = logits.shape
    nb = -(-V // BLOCK)
    padded = jnp.pad(logits, ((0, 0), (0, nb * BLOCK - V)), constant_values=NEG_INF)
    return padded.reshape(N, nb, BLOCK)


def _last_true(x: jax.Array) -> jax.Array:
    """Index of the last True along the last axis (0 if none)."""
    return x.shape[-1] - 1 - jnp.argmax(x[..., ::-1], axis=-1)


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """argmax over the vocabulary in two levels ([N, V] -> [N]); the first maximum wins.

    A flat argmax over ~32k-150k entries is a slow variadic reduction on XLA:CPU; a max per
    block, then an argmax over blocks and one within the chosen block, reads V once."""
    blocks = _blocks(logits)
    b = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
    within = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]
    return b * BLOCK + jnp.argmax(within, axis=-1)


def inverse_cdf_sample(key: jax.Array, logits: jax.Array) -> jax.Array:
    """Draws from softmax(logits) [N, V] -> [N] with ONE uniform per row.

    Gumbel-max (`jax.random.categorical`) draws V random numbers per row, most of a decode
    step's time on CPU at a 32k vocabulary. Here: a uniform u scaled by the total mass picks
    the block whose CDF step contains it, then the token within that block. Float rounding
    can never select a zero-probability block or token (both are clamped to the last one
    with mass)."""
    blocks = jnp.exp(_blocks(logits) - jnp.max(logits, axis=-1)[:, None, None])
    return _sample_blocks(key, blocks, blocks.sum(-1))


def _sample_blocks(key: jax.Array, blocks: jax.Array, mass: jax.Array) -> jax.Array:
    """The inverse-CDF draw from unnormalised weights blocks [N, nb, BLOCK] (mass: their
    block sums [N, nb])."""
    cdf = jnp.cumsum(mass, axis=-1)
    u = jax.random.uniform(key, (blocks.shape[0], 1), jnp.float32) * cdf[:, -1:]
    b = jnp.minimum(jnp.sum(cdf <= u, axis=-1), _last_true(mass > 0))
    u_in = u[:, 0] - jnp.take_along_axis(cdf - mass, b[:, None], axis=1)[:, 0]
    within = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]  # [N, BLOCK]
    j = jnp.sum(jnp.cumsum(within, axis=-1) <= u_in[:, None], axis=-1)
    return b * BLOCK + jnp.minimum(j, _last_true(within > 0))


def _token_logprob(logits: jax.Array, tokens: jax.Array, lse: jax.Array) -> jax.Array:
    """log softmax(logits)[token] without the [N, V] log-softmax: one gather, one subtract."""
    return jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse


def sample_tokens(
    key: jax.Array,
    logits: jax.Array,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """logits [N, V] float32 -> (tokens [N] int32, logprobs [N] float32).

    temperature == 0 means greedy. `temperature`, `top_k`, `top_p` are Python numbers
    (static under jit). Without top-k / top-p, one exp pass over [N, V] serves both the
    draw and the log-prob's normaliser.
    """
    logits = logits.astype(jnp.float32)
    if temperature == 0.0:
        tokens = greedy_tokens(logits)
        return tokens.astype(jnp.int32), _token_logprob(logits, tokens, _logsumexp(logits))
    scaled = logits / temperature
    m = jnp.max(scaled, axis=-1)
    blocks = jnp.exp(_blocks(scaled) - m[:, None, None])  # padding: exp(-inf) = 0
    mass = blocks.sum(-1)
    # The barrier keeps XLA from rewriting mass.sum(-1) as a second reduction over all of
    # [N, V] (reduce of a reduce -> one reduce): a whole extra pass over the logits.
    lse = m + jnp.log(jax.lax.optimization_barrier(mass).sum(-1))
    if 0 < top_k < logits.shape[-1] or top_p < 1.0:
        tokens = inverse_cdf_sample(key, top_p_mask(top_k_mask(scaled, top_k), top_p))
    else:
        tokens = _sample_blocks(key, blocks, mass)
    tokens = tokens.astype(jnp.int32)
    return tokens, _token_logprob(scaled, tokens, lse)


def _logsumexp(x: jax.Array) -> jax.Array:
    m = jnp.max(x, axis=-1)
    return m + jnp.log(jnp.sum(jnp.exp(x - m[:, None]), axis=-1))
