"""Chunked logprobs / entropy against numpy (values, analytic gradients) and full logits."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.rl.logprobs import token_logprobs


def _inputs(seed, n=2, t=7, d=8, v=33):
    rng = np.random.default_rng(seed)
    h = rng.normal(0, 1, (n, t, d)).astype(np.float32)
    w = rng.normal(0, 0.5, (d, v)).astype(np.float32)
    y = rng.integers(0, v, (n, t))
    return h, w, y


def numpy_reference(h, w, y, temperature, a, b, softcap=None):
    """Values and analytic gradients of sum(a * logp + b * entropy) in float64.

    d logp / dz = onehot(y) - p;  d H / dz_v = -p_v (z_v - sum_u p_u z_u);  z = s(h W) / tau,
    s(x) = c tanh(x / c) (soft-capping; the identity when c is None), s'(x) = 1 - tanh^2.
    """
    h, w = h.astype(np.float64), w.astype(np.float64)
    x = h @ w
    slope = 1.0 if softcap is None else 1.0 - np.tanh(x / softcap) ** 2
    z = (x if softcap is None else softcap * np.tanh(x / softcap)) / temperature
    z_max = z.max(-1, keepdims=True)
    lse = z_max[..., 0] + np.log(np.exp(z - z_max).sum(-1))
    p = np.exp(z - lse[..., None])
    logp = np.take_along_axis(z, y[..., None], -1)[..., 0] - lse
    mean_z = (p * z).sum(-1)
    entropy = lse - mean_z
    onehot = np.eye(w.shape[1])[y]
    dz = a[..., None] * (onehot - p) - b[..., None] * p * (z - mean_z[..., None])
    dz *= slope / temperature
    return logp, entropy, dz @ w.T, np.einsum("ntd,ntv->dv", h, dz)


def full_logits(h, w, y, temperature, softcap=None):
    """The straightforward version that holds [N, T, V] (what chunking avoids)."""
    z = jnp.einsum("ntd,dv->ntv", h, w, preferred_element_type=jnp.float32)
    z = (z if softcap is None else softcap * jnp.tanh(z / softcap)) / temperature
    logp_all = jax.nn.log_softmax(z, axis=-1)
    logp = jnp.take_along_axis(logp_all, y[..., None], axis=-1)[..., 0]
    return logp, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)


def _weighted(fn, a, b):
    def loss(h, w, y):
        logp, ent = fn(h, w, y)
        return jnp.sum(a * logp + b * ent)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


@pytest.mark.parametrize(
    "chunk_size,temperature,softcap",
    [(1, 1.0, None), (3, 0.7, None), (7, 1.3, None), (64, 1.0, None), (3, 0.7, 1.5)],
)
def test_values_and_gradients_match_numpy(chunk_size, temperature, softcap):
    """softcap 1.5: Gemma 4's final-logit soft-capping, bending logits of up to ~5.5."""
    h, w, y = _inputs(0)
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(2,) + y.shape)
    fn = functools.partial(
        token_logprobs, temperature=temperature, chunk_size=chunk_size, softcap=softcap
    )
    logp, ent = jax.jit(fn)(h, w, y)
    ref_logp, ref_ent, ref_gh, ref_gw = numpy_reference(h, w, y, temperature, a, b, softcap)
    np.testing.assert_allclose(np.asarray(logp), ref_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), ref_ent, rtol=1e-5, atol=1e-5)
    gh, gw = _weighted(fn, a, b)(h, w, y)
    np.testing.assert_allclose(np.asarray(gh), ref_gh, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), ref_gw, rtol=1e-4, atol=1e-5)
    full = functools.partial(full_logits, temperature=temperature, softcap=softcap)
    gh_full, gw_full = _weighted(full, a, b)(h, w, y)
    np.testing.assert_allclose(np.asarray(gh), np.asarray(gh_full), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(gw_full), rtol=1e-5, atol=1e-6)


def test_bfloat16_inputs_compute_in_float32():
    h, w, y = _inputs(2, d=16, v=50)
    hb, wb = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    logp, ent = token_logprobs(hb, wb, y, chunk_size=3)
    assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32
    # Reference from the same bf16-rounded numbers, in float64: only accumulation differs.
    ones = np.ones(y.shape)
    ref_logp, ref_ent, *_ = numpy_reference(
        np.asarray(hb, np.float32), np.asarray(wb, np.float32), y, 1.0, ones, ones
    )
    np.testing.assert_allclose(np.asarray(logp), ref_logp, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ent), ref_ent, rtol=1e-4, atol=1e-4)
    gh, gw = jax.grad(lambda a, b: jnp.sum(token_logprobs(a, b, y)[0]), argnums=(0, 1))(hb, wb)
    assert gh.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(gw, np.float32)))


@pytest.mark.parametrize("unroll_chunks", [16, 0], ids=["straight_line_chunks", "lax_map"])
def test_no_remat_gives_same_gradients(monkeypatch, unroll_chunks):
    """Kept logits (chunks as straight-line code, or stacked by lax.map) == recomputed."""
    from jaxrl_llm.rl import logprobs

    monkeypatch.setattr(logprobs, "UNROLL_CHUNKS", unroll_chunks)
    h, w, y = _inputs(3)
    a, b = np.ones(y.shape), np.full(y.shape, 0.5)
    with_remat = _weighted(functools.partial(token_logprobs, chunk_size=2, remat=True), a, b)
    with_remat = with_remat(h, w, y)
    without = _weighted(functools.partial(token_logprobs, chunk_size=2, remat=False), a, b)
    for x, z in zip(with_remat, without(h, w, y), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(z), rtol=1e-6, atol=1e-7)


def _temp_bytes(fn, *args):
    try:
        stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    except Exception:  # backend without a memory analysis
        stats = None
    if stats is None or not hasattr(stats, "temp_size_in_bytes"):
        pytest.skip("compiled memory_analysis unavailable on this backend")
    return stats.temp_size_in_bytes


def test_chunked_backward_never_holds_full_logits():
    n, t, d, v = 2, 256, 16, 16384
    h = jax.ShapeDtypeStruct((n, t, d), jnp.float32)
    w = jax.ShapeDtypeStruct((d, v), jnp.float32)
    y = jax.ShapeDtypeStruct((n, t), jnp.int32)

    def grads(fn):
        return jax.grad(lambda h, w, y: jnp.sum(sum(fn(h, w, y))), argnums=(0, 1))

    logits_bytes = n * t * v * 4  # 32 MiB; one chunk's logits are 2 MiB
    full = _temp_bytes(grads(functools.partial(full_logits, temperature=1.0)), h, w, y)
    remat = functools.partial(token_logprobs, chunk_size=16, remat=True)
    chunked = _temp_bytes(grads(remat), h, w, y)
    no_remat = functools.partial(token_logprobs, chunk_size=16, remat=False)
    assert full >= logits_bytes
    assert chunked < logits_bytes / 3 and chunked * 10 < full, (chunked, full)
    # Without remat the backward keeps every chunk's residuals: the whole point of remat.
    assert _temp_bytes(grads(no_remat), h, w, y) >= logits_bytes


def test_kept_logits_sum_chunk_weight_gradients_as_they_go(monkeypatch):
    """Straight-line chunks each make a [D, V] weight gradient and XLA sums them in one
    fusion that reads them all; beyond `UNROLL_GRAD_BYTES` the chunks run under lax.map,
    whose backward adds each chunk's to one sum: a few gradients live, not one a chunk."""
    from jaxrl_llm.rl import logprobs

    n, t, d, v = 2, 8, 64, 32768  # 8 one-position chunks; each weight gradient 8 MiB
    h = jax.ShapeDtypeStruct((n, t, d), jnp.float32)
    w = jax.ShapeDtypeStruct((d, v), jnp.float32)
    y = jax.ShapeDtypeStruct((n, t), jnp.int32)
    f = functools.partial(token_logprobs, chunk_size=1, remat=False)
    one = d * v * 4

    def temps(limit):  # a new function each time: jax caches traces by function
        monkeypatch.setattr(logprobs, "UNROLL_GRAD_BYTES", limit)
        grads = jax.grad(lambda h, w, y: jnp.sum(sum(f(h, w, y))), argnums=(0, 1))
        return _temp_bytes(grads, h, w, y)

    unrolled = temps(t * one)  # all 8 chunks straight-line
    mapped = temps(t * one - 1)  # one byte short: lax.map
    assert unrolled >= (t - 1) * one, unrolled / one  # all but one beside the output
    assert mapped <= 4 * one, mapped / one  # the sum, one chunk's, the unembedding's copy


def test_default_keeps_small_logits_and_recomputes_large_ones():
    """remat=None: keep [N, T, V] logits for the backward only while they are small."""
    from jaxrl_llm.rl import logprobs

    d, v = 8, 4096
    w = jax.ShapeDtypeStruct((d, v), jnp.float32)

    def temp(n, t):
        h = jax.ShapeDtypeStruct((n, t, d), jnp.float32)
        y = jax.ShapeDtypeStruct((n, t), jnp.int32)
        f = functools.partial(token_logprobs, chunk_size=4)
        return _temp_bytes(jax.grad(lambda h, w, y: jnp.sum(f(h, w, y)[0])), h, w, y)

    small = 2 * 16 * v * 4  # 0.5 MiB of logits: kept
    assert small <= logprobs.SAVE_LOGITS_BYTES and temp(2, 16) >= small
    big_n = logprobs.SAVE_LOGITS_BYTES // (16 * v * 4) + 1  # just over the limit: recomputed
    assert temp(big_n, 16) < 0.75 * big_n * 16 * v * 4  # kept, they would all be there
