"""The paged engine's attention over its page pool, read in place per layer
(`models.paged_forward`, `forward_paged(impl="pages")`), against the gather path
(`impl="gather"`: every layer's pages gathered, `models.forward_after_prefix` over them)
and against the full forward of the rows' sequences."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import tiny_gemma3_config, tiny_glm_config, tiny_model_config

from jaxrl_llm import models
from jaxrl_llm.sampling.paged import PagedSampler
from jaxrl_llm.sampling.paged_programs import Pages, forward_paged, init_pages, uses_pallas

PS, POOL = 4, 20  # page size, pages in the pool (page 0: null)


CONFIGS = {
    "qwen3": lambda: tiny_model_config(),
    "qwen3_unrolled": lambda: tiny_model_config(scan_layers=False),
    "glm_moe": tiny_glm_config,
    "gemma3_window": tiny_gemma3_config,
}


@functools.cache
def model(name):
    cfg = CONFIGS[name]()
    return cfg, models.init_params(cfg, seed=5)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("impl", "unrolled"))
def run(cfg, params, pages, tokens, mask, table, start, length, impl, unrolled=False):
    layers = models.layer_params(params) if unrolled else None
    out = forward_paged(cfg, params, pages, tokens, mask, table, start, length, layers, impl)
    return out[:3]  # (hidden, pages, routes): no recurrent state here


def scenario(cfg, T):
    """A random pool and 4 rows: rows 0 and 1 share a prompt's pages (slots 3..11 real,
    their own pages after); row 2 a shorter sequence with its new tokens' first one
    masked (T > 1) or its only one masked (T = 1: a row that does not feed); row 3
    empty (all masked, null table)."""
    rng = np.random.default_rng(T)
    L, K, H = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    shape = (L, POOL, PS, K, H)
    pages = Pages(
        k=jnp.asarray(rng.normal(size=shape), jnp.float32),
        v=jnp.asarray(rng.normal(size=shape), jnp.float32),
    )
    table = np.array(
        [[1, 2, 3, 4, 5, 6, 0, 0], [1, 2, 3, 7, 8, 9, 0, 0], [10, 11, 12, 13, 0, 0, 0, 0], [0] * 8],
        np.int32,
    )
    start = np.array([3, 3, 1, 0], np.int32)
    length = np.array([12, 12, 6, 0], np.int32)
    tokens = rng.integers(1, cfg.vocab_size, (4, T)).astype(np.int32)
    mask = np.ones((4, T), bool)
    mask[2, 0] = False
    mask[3] = False
    return pages, tokens, mask, table, start, length


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("T", [1, 5])
def test_pages_equal_the_gather_path(name, T):
    """Prefill chunk (T = 5) and decode step (T = 1): the real tokens' hidden states within
    1e-5, every page but the null one written alike (the new tokens' keys/values at their
    slots, through shared and own pages), and an MoE model's routes equal."""
    cfg, params = model(name)
    pages, *rest = scenario(cfg, T)
    unrolled = name == "qwen3_unrolled"
    out = {
        impl: run(cfg, params, pages, *rest, impl=impl, unrolled=unrolled)
        for impl in ("pages", "gather")
    }
    mask = rest[1]
    (h, p, r), (h_ref, p_ref, r_ref) = out["pages"], out["gather"]
    np.testing.assert_allclose(np.asarray(h)[mask], np.asarray(h_ref)[mask], atol=1e-5)
    for got, ref in ((p.k, p_ref.k), (p.v, p_ref.v)):
        np.testing.assert_allclose(np.asarray(got)[:, 1:], np.asarray(ref)[:, 1:], atol=1e-5)
    # rows 0 and 1's first new token went to their own pages (4, 7) at offset 0
    for page in (4, 7):
        assert not np.allclose(np.asarray(p.k)[:, page, 0], np.asarray(pages.k)[:, page, 0])
    if cfg.moe:
        np.testing.assert_array_equal(np.asarray(r)[mask], np.asarray(r_ref)[mask])
        assert (np.asarray(r)[mask][:, 0] == -1).all()  # the dense first layer
        assert (np.asarray(r)[mask][:, 1:] >= 0).all()
    else:
        assert r is None and r_ref is None


@pytest.mark.parametrize("name", ["qwen3", "gemma3_window"])
def test_prefill_then_decode_equals_the_full_forward(name):
    """Two left-padded prompts prefilled through the pages in chunks of 4 (a page of
    padding only is the null page), then two decode steps: each token's hidden state
    equals `models.forward` of the whole sequence (the sliding window of 4 positions
    included: the sequence is longer than it)."""
    cfg, params = model(name)
    L, K, H = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    pages = Pages(k=jnp.zeros((L, POOL, PS, K, H)), v=jnp.zeros((L, POOL, PS, K, H)))
    table = np.array([[8, 1, 2, 3, 0, 0], [0, 5, 6, 7, 0, 0]], np.int32)
    hidden, ref, real = prefill_then_decode(cfg, params, pages, table)
    np.testing.assert_allclose(hidden[real], ref[real], atol=1e-5)


def prefill_then_decode(cfg, params, pages, table, width=12):
    """Two random prompts of 9 and 6 tokens left-padded to `width` slots, prefilled
    through `table`'s pages in chunks of 4, then two decode steps -> (hidden states
    [2, width + 2, D] of every slot, `models.forward`'s of the whole sequences, the real
    slots [2, width + 2])."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (9, 6)]
    start = np.array([width - 9, width - 6], np.int32)
    ids = np.zeros((2, width + 2), np.int32)
    for i, s in enumerate(seqs):
        ids[i, start[i] : width] = s
    ids[:, width:] = rng.integers(1, cfg.vocab_size, (2, 2))
    hidden = []
    for c in range(0, width, 4):  # prefill chunks of 4
        mask = np.arange(c, c + 4)[None] >= start[:, None]
        h, pages, _ = run(
            cfg,
            params,
            pages,
            ids[:, c : c + 4],
            mask,
            table,
            start,
            np.full(2, c, np.int32),
            impl="pages",
        )
        hidden.append(np.asarray(h))
    for t in range(2):  # decode steps
        h, pages, _ = run(
            cfg,
            params,
            pages,
            ids[:, width + t : width + t + 1],
            np.ones((2, 1), bool),
            table,
            start,
            np.full(2, width + t, np.int32),
            impl="pages",
        )
        hidden.append(np.asarray(h))
    real = np.arange(width + 2)[None] >= start[:, None]
    ref = models.forward(cfg, params, jnp.asarray(ids), jnp.asarray(real))
    return np.concatenate(hidden, axis=1), np.asarray(ref), real


def bf16(x):
    """Values that bfloat16 holds exactly: the Pallas kernel reads keys and values in
    bfloat16, so on these it matches the float32 portable path to rounding."""
    return jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)


def test_pallas_decode_equals_the_portable_path():
    """One decode step of a layer through the Pallas TPU kernel (interpret mode on CPU,
    pool head-major) against the portable path on the same pool laid out [L, P, S, K, H]:
    GQA (4 query heads over 2), shuffled page tables, rows starting mid-page (the
    kernel's whole pages merged with the partial first page), at a page boundary and at
    slot 0, of different lengths, and a row that does not feed (not compared)."""
    from jaxrl_llm.models.paged_attention import paged_attention, paged_inputs, write_layer

    rng = np.random.default_rng(1)
    L, P, S, K, N, H = 3, 24, 4, 2, 4, 8
    pk, pv = (bf16(rng.normal(size=(L, P, S, K, H))) for _ in range(2))
    pages = rng.permutation(np.arange(1, P))
    table = np.zeros((5, 8), np.int32)
    for row, (a, b) in enumerate(((0, 6), (6, 11), (11, 14), (14, 22), (22, 23))):
        table[row, : b - a] = pages[a:b]
    start = np.array([3, 4, 1, 0, 2], np.int32)
    length = np.array([21, 17, 9, 31, 3], np.int32)
    feed = np.array([[True], [True], [False], [True], [True]])
    q, k, v = (bf16(rng.normal(size=(5, 1, n, H))) for n in (N, K, K))

    @functools.partial(jax.jit, static_argnums=0)
    def step(pallas, pool, layer):
        _, mask, where = paged_inputs(table, start, length, feed, S, 0, pallas)
        pool = write_layer(pool, layer, k, v, where)
        return paged_attention(q, pool, layer, where, mask, "xla")

    heads = tuple(x.transpose(3, 0, 1, 2, 4) for x in (pk, pv))  # [K, L, P, S, H]
    got = np.asarray(step(True, heads, 1))[feed[:, 0]]
    want = np.asarray(step(False, (pk, pv), 1))[feed[:, 0]]
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.abs(want).max() > 0.1


def test_pallas_pool_prefill_then_decode_equals_the_full_forward():
    """The engine's Pallas pool layout through the model (`forward_paged`, prefill chunks
    on the portable path over the head-major pool, then two decode steps through the
    kernel): prefill within 1e-5 of `models.forward`, decode within the kernel's
    bfloat16 reading of float32 keys and values."""
    cfg, params = model("qwen3")
    pages = init_pages(cfg, POOL, PS, pallas=True)
    width = 12
    table = np.array([[8, 1, 2, 3, 0, 0, 0, 0], [0, 5, 6, 7, 0, 0, 0, 0]], np.int32)
    table[:, 3:5] = [[9, 10], [11, 12]]  # own pages after the prompts' last page
    hidden, ref, real = prefill_then_decode(cfg, params, pages, table, width)
    pre = real[:, :width]
    np.testing.assert_allclose(hidden[:, :width][pre], ref[:, :width][pre], atol=1e-5)
    np.testing.assert_allclose(hidden[:, width:], ref[:, width:], atol=1e-2)


def test_auto_picks_the_kernel_on_tpu_only():
    """`PagedSampler(attention="auto")` lays the pool out for the kernel on TPU for a
    bfloat16 model without sliding windows, head_dim 128; elsewhere (CPU, GPU, float32,
    windows, head_dim 64, page_size 8) it keeps the portable layout, whose programs are
    unchanged."""
    cfg, gemma = tiny_model_config(), tiny_gemma3_config()
    cfg = cfg.replace(head_dim=128)
    assert uses_pallas(cfg, "auto", jnp.bfloat16, "tpu")
    assert not uses_pallas(cfg.replace(head_dim=64), "auto", jnp.bfloat16, "tpu")
    assert not uses_pallas(cfg, "auto", jnp.bfloat16, "tpu", page_size=8)
    for c, attention, dtype, backend in (
        (cfg, "auto", jnp.bfloat16, "cpu"),
        (cfg, "auto", jnp.bfloat16, "gpu"),
        (cfg, "auto", jnp.float32, "tpu"),
        (gemma, "auto", jnp.bfloat16, "tpu"),
        (cfg, "pages", jnp.bfloat16, "tpu"),
    ):
        assert not uses_pallas(c, attention, dtype, backend)
    assert uses_pallas(cfg, "pallas", jnp.float32, "cpu")
    pool = PagedSampler(cfg, attention="pallas").pool(cfg, 6, PS, jnp.float32)
    assert pool.pallas and pool.page_size == PS
    assert pool.k.shape == (cfg.num_kv_heads, cfg.num_layers, 6, PS, cfg.head_dim)
    assert not PagedSampler(cfg).pool(cfg, 6, PS, jnp.float32).pallas  # CPU: portable
    with pytest.raises(ValueError, match="sliding window"):
        PagedSampler(gemma, attention="pallas")
