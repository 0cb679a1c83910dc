"""Attention paths (`models.attention`) against the full-matrix reference and HF PyTorch.

Every mask kind the model builds (causal with left / right / hole padding, packed
segments, a traced sliding window, keys after a prefix) is checked on values and on the
gradients of q, k and v, with GQA and block sizes that do not divide the sequence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import hf_logits, hf_model, padded_batch

from jaxrl_llm import models
from jaxrl_llm.models import attention as A

B, T, N, K, H = 3, 13, 6, 2, 8  # GQA: 3 query heads per kv head


def numpy_mask(valid, qpos, kpos, segments=None, window=None, prefix_valid=None):
    """The mask as a plain loop: causal over [prefix, sequence], padding keys hidden,
    segments apart, position ids within the window, a token always sees itself."""
    P = 0 if prefix_valid is None else prefix_valid.shape[1]
    kv = valid if P == 0 else np.concatenate([prefix_valid, valid], 1)
    out = np.zeros((valid.shape[0], valid.shape[1], P + valid.shape[1]), bool)
    for b, t, s in np.ndindex(*out.shape):
        ok = s <= P + t and kv[b, s]
        if segments is not None:
            ok = ok and segments[b, t] == segments[b, s]
        if window is not None:
            ok = ok and qpos[b, t] - kpos[b, s] < window
        out[b, t, s] = ok or s == P + t
    return out


def case(kind, dtype=jnp.float32, seed=0):
    """(q, k, v, Mask, numpy mask) of one mask kind."""
    rng = np.random.default_rng(seed)
    valid = np.ones((B, T), bool)
    valid[1, :4] = False  # left padding
    valid[2, 5:7] = False  # a hole (prompt padding between prompt and completion)
    valid[2, -2:] = False  # right padding
    segments, window, prefix_valid, P = None, None, None, 0
    if kind == "segments":
        segments = np.repeat(np.array([[0] * 5 + [1] * 4 + [2] * 4]), B, 0).astype(np.int32)
    if kind == "window":
        window = 3
    if kind == "prefix":
        P = 5
        prefix_valid = np.ones((B, P), bool)
        prefix_valid[0, :2] = False
    seg = None if segments is None else jnp.asarray(segments)
    qpos = np.asarray(models.default_positions(jnp.asarray(valid), seg))
    if kind == "prefix":
        before = prefix_valid.sum(1, keepdims=True)
        qpos = np.maximum(before + np.cumsum(valid, 1) - 1, 0)
        ppos = np.maximum(np.cumsum(prefix_valid, 1) - 1, 0)
        kpos = np.concatenate([ppos, qpos], 1)
        mask = A.causal_mask(
            jnp.asarray(valid),
            jnp.asarray(qpos, jnp.int32),
            None,
            jnp.asarray(prefix_valid),
            jnp.asarray(ppos, jnp.int32),
        )
    else:
        kpos = qpos
        mask = A.causal_mask(jnp.asarray(valid), jnp.asarray(qpos, jnp.int32), seg)
    want = numpy_mask(valid, qpos, kpos, segments, window, prefix_valid)
    if window is not None:
        mask = mask.replace(window=jnp.asarray(window, jnp.int32))
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(B, P + T, K, H)), dtype) for _ in range(2))
    return q, k, v, mask, want


KINDS = ["padding", "segments", "window", "prefix"]


@pytest.mark.parametrize("kind", KINDS)
def test_structural_mask_equals_loop(kind):
    _, _, _, mask, want = case(kind)
    np.testing.assert_array_equal(np.asarray(mask.dense()), want)


def values_and_grads(fn, q, k, v, seed=1, rows=None):
    """fn's output and the gradients of sum(out * g), g random (zero outside `rows` [B,T]
    where given: rows whose output a model never reads)."""
    g = jnp.asarray(np.random.default_rng(seed).normal(size=q.shape), jnp.float32)
    if rows is not None:
        g = jnp.where(rows[..., None, None], g, 0.0)

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * g)

    return jax.jit(fn)(q, k, v), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("kind", KINDS)
def test_blockwise_equals_xla_float32(kind, block=4):
    q, k, v, mask, want = case(kind)
    ref_out, ref_grads = values_and_grads(lambda *a: A.attention(*a, jnp.asarray(want)), q, k, v)
    out, grads = values_and_grads(lambda *a: A.blockwise(*a, mask, block), q, k, v)
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    # the dispatching entry point, xla from the structure
    xla = jax.jit(lambda *a: A.attention(*a, mask, "xla"))(q, k, v)
    np.testing.assert_allclose(xla, ref_out, atol=1e-6)


def test_blockwise_equals_xla_bfloat16():
    q, k, v, mask, want = case("padding", jnp.bfloat16)
    ref_out, ref_grads = values_and_grads(lambda *a: A.attention(*a, jnp.asarray(want)), q, k, v)
    out, grads = values_and_grads(lambda *a: A.blockwise(*a, mask, 4), q, k, v)
    f32 = case("padding", jnp.float32)
    exact, _ = values_and_grads(lambda *a: A.attention(*a, jnp.asarray(want)), *f32[:3])
    # both within bfloat16 rounding of the float32 result, and of each other
    bf16_err = float(jnp.max(jnp.abs(ref_out.astype(jnp.float32) - exact)))
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - exact)))
    assert err <= max(2 * bf16_err, 2e-2), (err, bf16_err)
    for a, b in zip(grads, ref_grads, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 5e-2 * max(1.0, np.abs(b).max()), np.abs(a - b).max()


@pytest.mark.parametrize("kind", ["segments", "prefix"])
def test_pallas_splash_interpret_equals_blockwise(kind):
    """The TPU splash kernel in Pallas interpret mode on CPU (padding in every case):
    values and gradients equal the portable path on real query rows (a padding query's
    row, which no model reads, is left to the kernel)."""
    q, k, v, mask, _ = case(kind)
    real = _real_queries(mask)
    out, grads = values_and_grads(
        lambda *a: A.pallas(*a, mask, 128, interpret=True), q, k, v, rows=real
    )
    ref_out, ref_grads = values_and_grads(lambda *a: A.blockwise(*a, mask, 4), q, k, v, rows=real)
    r = real[..., None, None]
    np.testing.assert_allclose(np.where(r, out, 0), np.where(r, ref_out, 0), atol=1e-5)
    for a, b in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def _real_queries(mask):
    P = mask.k_valid.shape[1] - mask.q_idx.shape[0]
    return np.asarray(mask.k_valid)[:, P:]


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_model_logits_blockwise_match_hf(tmp_path, arch):
    """The whole decoder with attention=blockwise (blocks of 4 tokens, so the padded
    batch spans several blocks and Gemma's window of 4 crosses them) against HF."""
    model = hf_model(arch)
    model.save_pretrained(tmp_path)
    cfg, params = models.load_hf(tmp_path, attention="blockwise", attention_block=4)
    ids, mask = padded_batch()
    got = np.asarray(models.logits(cfg, params, ids, mask))
    want = hf_logits(model, ids, mask)
    diff = np.abs(got - want)[mask].max()
    assert diff <= 1e-4, diff


def test_model_logits_blockwise_sharded_match_hf(tmp_path):
    """blockwise on a 2 x 4 mesh (weights over fsdp and tensor, the batch over fsdp)."""
    from jaxrl_llm import parallel

    model = hf_model("qwen3")
    model.save_pretrained(tmp_path)
    mesh = parallel.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
    cfg, params = models.load_hf(tmp_path, mesh=mesh, attention="blockwise", attention_block=4)
    ids, mask = padded_batch(seed=2, batch=4)
    got = models.logits(cfg, params, *parallel.shard_batch((ids, mask), mesh))
    diff = np.abs(np.asarray(got) - hf_logits(model, ids, mask))[mask].max()
    assert diff <= 1e-4, diff


def test_pallas_refuses_sliding_window(tmp_path):
    hf_model("gemma3").save_pretrained(tmp_path)
    with pytest.raises(models.UnsupportedModelError, match="model.attention='pallas'"):
        models.load_hf(tmp_path, attention="pallas")


def test_auto_picks_by_backend_and_length():
    assert A.resolve("auto", "gpu", 8, 8) == "cudnn"
    assert A.resolve("auto", "tpu", 8, 8) == "pallas"
    assert A.resolve("auto", "cpu", 256, 256) == "xla"
    assert A.resolve("auto", "cpu", 16384, 16384) == "blockwise"
    assert A.resolve("blockwise", "gpu") == "blockwise"


def test_chunked_prefill_equals_one_shot():
    """Prefill in chunks of 4 tokens (two full chunks and a remainder; blockwise attention
    over the cache in blocks of 4) gives the one-shot prefill's logits and cache: Gemma 3,
    so the sliding window (4 positions) reaches across chunks and blocks."""
    from tiny_run import tiny_gemma3_config

    cfg = tiny_gemma3_config(attention="xla")
    params = models.init_params(cfg, seed=0)
    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 11)), jnp.int32)
    mask = np.ones((3, 11), bool)
    mask[1, :6] = False  # left padding past the first chunk
    mask[2, 9:] = False  # the remainder chunk is padding only
    mask = jnp.asarray(mask)

    def run(cfg):
        cache = models.init_cache(cfg, 3, 16)
        return jax.jit(models.prefill, static_argnums=0)(cfg, params, ids, mask, cache)

    want_logits, want = run(cfg)
    got_logits, got = run(cfg.replace(prefill_chunk=4, attention="blockwise", attention_block=4))
    np.testing.assert_allclose(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(got.valid, want.valid)
    np.testing.assert_array_equal(got.pos, want.pos)
    assert int(got.index) == int(want.index) == 11
    valid = np.asarray(want.valid)
    gk, wk = np.asarray(got.k), np.asarray(want.k)  # [L,B,K,H,S]: compared on valid slots
    for b in range(3):
        np.testing.assert_allclose(gk[:, b][..., valid[b]], wk[:, b][..., valid[b]], atol=1e-5)
        gv, wv = np.asarray(got.v)[:, b], np.asarray(want.v)[:, b]  # [L,K,S,H]
        np.testing.assert_allclose(gv[:, :, valid[b]], wv[:, :, valid[b]], atol=1e-5)


def grad_temporaries(cfg, T: int) -> int:
    """XLA's compiled temporaries (bytes) of the model's forward + backward over one row of
    T tokens, parameters float32 (compile only)."""
    specs = models.param_specs(cfg)
    params = models.params.unflatten(
        {p: jax.ShapeDtypeStruct(s.shape, jnp.float32) for p, s in specs.items()}
    )
    grad = jax.jit(jax.grad(lambda p, tok: jnp.sum(models.forward(cfg, p, tok))))
    tokens = jax.ShapeDtypeStruct((1, T), jnp.int32)
    return grad.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_training_memory_grows_linearly():
    """XLA's compiled memory of the scanned model's forward + backward (remat full) at 512
    and 2048 tokens: blockwise temporaries grow with T (4x the tokens, about 4x), the
    full matrix's with T^2. A mask hoisted out of the block loops by autodiff of the
    layer scan (`attention._block_mask`) made blockwise grow like the full matrix."""
    from tiny_run import tiny_model_config

    def temporaries(attention, T):
        cfg = tiny_model_config(attention=attention, attention_block=64, remat="full")
        return grad_temporaries(cfg, T)

    growth = temporaries("blockwise", 2048) / temporaries("blockwise", 512)
    assert growth <= 5.0, growth
    assert temporaries("xla", 2048) / temporaries("xla", 512) >= 10.0  # the contrast
