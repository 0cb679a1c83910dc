"""The rollout sampler against HF `generate`, teacher-forced log-probs and numpy references."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_reference import VOCAB, hf_model
from tiny_run import teacher_forced_logprobs, tiny_model_config

from jaxrl_llm import config as config_lib
from jaxrl_llm import models, parallel, sampling

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [11], [40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            model = hf_model(arch, seed=11)
            d = tmp_path_factory.mktemp(arch)
            model.save_pretrained(d)
            cache[arch] = (model, *models.load_hf(d))
        return cache[arch]

    return get


def hf_greedy(model, prompts, max_new):
    """transformers' greedy tokens after left-padded prompts (no end token)."""
    P = max(map(len, prompts))
    ids = torch.zeros((len(prompts), P), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :], mask[i, P - len(p) :] = torch.tensor(p), 1
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
            # Gemma 4 with KV sharing: see `hf_reference.hf_logits`
            output_hidden_states=bool(getattr(model.config, "num_kv_shared_layers", 0)),
            return_dict_in_generate=True,
        )
    return out.sequences[:, P:].numpy()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_greedy_equals_hf_generate(tiny, arch):
    """Greedy tokens == HF `generate`; for Gemma 3 (sliding window 4) prompt and
    completion run well past the window."""
    model, cfg, params = tiny(arch)
    out = sampling.generate(cfg, params, PROMPTS, max_new_tokens=12, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.tokens), hf_greedy(model, PROMPTS, 12))
    assert np.all(np.asarray(out.finish) == sampling.FINISH_LENGTH)
    assert np.all(np.asarray(out.lengths) == 12)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (7, 0.9)])
def test_logprobs_equal_teacher_forced(tiny, top_k, top_p):
    _, cfg, params = tiny("qwen3")
    out = sampling.generate(
        cfg,
        params,
        PROMPTS,
        max_new_tokens=10,
        num_samples=3,
        temperature=0.7,
        top_k=top_k,
        top_p=top_p,
        seed=1,
    )
    ref = teacher_forced_logprobs(cfg, params, out, 0.7)
    mask = np.asarray(out.mask)
    assert np.abs(np.asarray(out.logprobs) - ref)[mask].max() <= 1e-4
    assert np.all(np.asarray(out.logprobs)[~mask] == 0)


def numpy_top_k(logits, k):
    out = logits.copy()
    for row in out:
        kth = np.sort(row)[::-1][k - 1]
        row[row < kth] = -np.inf
    return out


def numpy_top_p(logits, p):
    out = logits.copy()
    for row in out:
        order = np.argsort(-row, kind="stable")
        probs = np.exp(row[order] - row[order].max())
        probs /= probs.sum()
        kept, mass = [], 0.0
        for idx, pr in zip(order, probs, strict=True):
            if mass >= p:
                break
            kept.append(idx)
            mass += pr
        threshold = row[kept].min()
        row[row < threshold] = -np.inf
    return out


def test_top_k_top_p_masks_match_numpy():
    rng = np.random.RandomState(0)
    logits = rng.randn(6, 20).astype(np.float32)
    logits[0, :4] = 3.0  # ties at the top
    for k in (1, 3, 5, 19):
        np.testing.assert_array_equal(
            np.asarray(sampling.top_k_mask(jnp.asarray(logits), k)), numpy_top_k(logits, k)
        )
    for p in (0.05, 0.5, 0.9, 0.999):
        np.testing.assert_array_equal(
            np.asarray(sampling.top_p_mask(jnp.asarray(logits), p)), numpy_top_p(logits, p)
        )


def chi2_critical(df, z=3.09):
    """Wilson-Hilferty approximation of the chi-square quantile (z=3.09: 0.999)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.3, 5, 1.0), (0.9, 0, 0.8)]
)
def test_sampled_frequencies_match_softmax(temperature, top_k, top_p):
    logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0], np.float32)
    n = 40000
    tokens, _ = jax.jit(sampling.sample_tokens, static_argnums=(2, 3, 4))(
        jax.random.key(42), jnp.tile(logits, (n, 1)), temperature, top_k, top_p
    )
    counts = np.bincount(np.asarray(tokens), minlength=len(logits))

    def expected(logits):
        z = logits / temperature
        if top_k:
            z = numpy_top_k(z[None], top_k)[0]
        if top_p < 1:
            z = numpy_top_p(z[None], top_p)[0]
        probs = np.exp(z - z.max())
        return probs / probs.sum()

    def chi2(probs):
        support = probs > 0
        assert counts[~support].sum() == 0, "sampled a filtered-out token"
        e = n * probs[support]
        return ((counts[support] - e) ** 2 / e).sum(), support.sum() - 1

    stat, df = chi2(expected(logits))
    assert stat < chi2_critical(df), (stat, df)
    # The same test rejects a wrong distribution (temperature ignored).
    wrong = np.exp(logits - logits.max())
    wrong[expected(logits) == 0] = 0
    if temperature != 1.0:
        wrong_stat, _ = chi2(wrong / wrong.sum())
        assert wrong_stat > chi2_critical(df), wrong_stat


def test_group_rows_share_one_prefill(tiny):
    _, cfg, params = tiny("qwen2")
    ids, mask = sampling.pad_prompts(PROMPTS[:2], 0)
    logits, cache = jax.jit(sampling.prefill_groups, static_argnums=(0, 4, 5))(
        cfg, params, ids, mask, 3, 40
    )
    single_logits, single = models.prefill(
        cfg, params, ids[1:2], mask[1:2], models.init_cache(cfg, 1, 40)
    )
    for g in range(3):
        row = 3 + g  # prompt 1's rows
        np.testing.assert_allclose(cache.k[:, row], single.k[:, 0], atol=1e-5)
        np.testing.assert_array_equal(cache.valid[row], single.valid[0])
        np.testing.assert_allclose(logits[row], single_logits[0], atol=1e-5)
    np.testing.assert_array_equal(cache.k[:, 0], cache.k[:, 2])


def test_group_sampling_greedy_identical_sampled_differ(tiny):
    _, cfg, params = tiny("qwen3")
    greedy = sampling.generate(cfg, params, PROMPTS[:2], 8, num_samples=4, temperature=0.0)
    toks = np.asarray(greedy.tokens).reshape(2, 4, 8)
    assert np.all(toks == toks[:, :1])
    sampled = sampling.generate(cfg, params, PROMPTS[:2], 8, num_samples=4, temperature=1.0, seed=3)
    toks = np.asarray(sampled.tokens).reshape(2, 4, 8)
    assert all(len({tuple(r) for r in group}) > 1 for group in toks)


def test_sharded_equals_unsharded(tiny):
    _, cfg, params = tiny("qwen3")
    kw = dict(max_new_tokens=8, num_samples=2, temperature=1.0, seed=5, step=0)
    ref = sampling.generate(cfg, params, PROMPTS, **kw)
    mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    sharded_params = jax.device_put(params, models.param_shardings(cfg, mesh))
    out = sampling.generate(cfg, sharded_params, PROMPTS, mesh=mesh, **kw)
    assert out.tokens.sharding.spec[0] == parallel.BATCH_AXES
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=1e-4)
    # 3 prompts do not divide the 4-way batch: padded with dummy rows, then dropped.
    odd = sampling.generate(cfg, sharded_params, PROMPTS[:3], mesh=mesh, **kw)
    np.testing.assert_array_equal(np.asarray(odd.tokens), np.asarray(ref.tokens)[:6])


def test_unrolled_layers_per_layer_cache(tiny):
    """scan_layers=False: one cache array per layer, layers unrolled in prefill and decode,
    each layer's parameters sliced once before the decode loop. Same samples as the scan."""
    model, cfg, params = tiny("qwen3")
    unrolled = dataclasses.replace(cfg, scan_layers=False)
    cache = models.init_cache(unrolled, 2, 40)
    assert isinstance(cache.k, tuple) and len(cache.k) == cfg.num_layers
    assert cache.k[0].shape == (2, cfg.num_kv_heads, cfg.head_dim, 40) and cache.max_len == 40
    greedy = sampling.generate(unrolled, params, PROMPTS, max_new_tokens=12, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(greedy.tokens), hf_greedy(model, PROMPTS, 12))
    kw = dict(max_new_tokens=8, num_samples=2, temperature=1.0, seed=5, step=0)
    ref = sampling.generate(cfg, params, PROMPTS, **kw)
    mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    sharded_params = jax.device_put(params, models.param_shardings(cfg, mesh))
    for out in (
        sampling.generate(unrolled, params, PROMPTS, **kw),
        sampling.generate(unrolled, sharded_params, PROMPTS, mesh=mesh, **kw),
    ):
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
        np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=1e-5)
    # Group prefill repeats every layer's cache rows.
    ids, mask = sampling.pad_prompts(PROMPTS[:2], 0)
    _, grouped = sampling.prefill_groups(unrolled, params, ids, mask, 3, 40)
    _, scanned = sampling.prefill_groups(cfg, params, ids, mask, 3, 40)
    for layer in range(cfg.num_layers):
        np.testing.assert_allclose(grouped.k[layer], scanned.k[layer], atol=1e-5)
        np.testing.assert_allclose(grouped.v[layer], scanned.v[layer], atol=1e-5)


def test_cache_lengths():
    assert sampling.cache_lengths(64, 128, 4) == (96, 128, 160, 192)
    assert sampling.cache_lengths(20, 64, 4) == (40, 56, 72, 84)  # multiples of 8, then full
    assert sampling.cache_lengths(16, 20, 1) == (36,)
    assert sampling.cache_lengths(16, 3, 8) == (19,)  # rounded past the full length: one
    assert sampling.cache_lengths(16, 1, 4) == (17,)  # no decode step
    assert config_lib.base_config().rollout.cache_segments == sampling.CACHE_SEGMENTS


@pytest.mark.parametrize("scan_layers", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_cache_segments_same_samples(tiny, scan_layers):
    """Decoding in segments over a growing cache gives the samples of one loop over the
    full cache: greedy as HF generate, sampled tokens and log-probs as one segment (also
    sharded, and with rows stopping early)."""
    model, cfg, params = tiny("qwen3")
    cfg = dataclasses.replace(cfg, scan_layers=scan_layers)
    assert sampling.cache_lengths(16, 20, 3) == (24, 32, 36)  # PROMPTS' bucket is 16
    greedy = sampling.generate(cfg, params, PROMPTS, 20, temperature=0.0, cache_segments=3)
    np.testing.assert_array_equal(np.asarray(greedy.tokens), hf_greedy(model, PROMPTS, 20))
    mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    sharded_params = jax.device_put(params, models.param_shardings(cfg, mesh))
    for stop_ids in [(), tuple(range(0, VOCAB, 7))]:  # the second ends most rows early
        kw = dict(max_new_tokens=20, num_samples=2, seed=5, step=0, stop_ids=stop_ids)
        ref = sampling.generate(cfg, params, PROMPTS, **kw)
        for out in (
            sampling.generate(cfg, params, PROMPTS, cache_segments=3, **kw),
            sampling.generate(cfg, sharded_params, PROMPTS, mesh=mesh, cache_segments=3, **kw),
        ):
            for field in ("tokens", "lengths", "finish"):
                np.testing.assert_array_equal(getattr(out, field), getattr(ref, field))
            np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
        if stop_ids:
            assert (np.asarray(ref.finish) == sampling.FINISH_STOP).sum() >= 4


def test_grow_cache():
    cfg = tiny_model_config()
    for c in (cfg, dataclasses.replace(cfg, scan_layers=False)):
        cache = models.init_cache(c, 3, 5)
        cache = cache.replace(
            k=jax.tree.map(lambda a: a + 1, cache.k), valid=cache.valid.at[:, :2].set(True)
        )
        grown = models.grow_cache(cache, 9)
        assert grown.max_len == 9 and grown.valid.shape == (3, 9)
        assert not np.asarray(grown.valid)[:, 2:].any() and np.asarray(grown.valid)[:, :2].all()
        for old, new in zip(jax.tree.leaves(cache.k), jax.tree.leaves(grown.k), strict=True):
            assert new.shape[-1] == 9
            np.testing.assert_array_equal(new[..., :5], old)
            assert not np.asarray(new[..., 5:]).any()
        for v in jax.tree.leaves(grown.v):
            assert v.shape[-2:] == (9, 8)
        with pytest.raises(ValueError, match="max_len 4 < the cache's 5 slots"):
            models.grow_cache(cache, 4)


def test_cache_rows():
    cfg = tiny_model_config()
    row = np.arange(3).reshape(3, 1, 1, 1)  # each row's arrays hold its own index
    for c in (cfg, dataclasses.replace(cfg, scan_layers=False)):
        cache = models.init_cache(c, 3, 5)
        cache = cache.replace(
            k=jax.tree.map(lambda a: a + row, cache.k),
            v=jax.tree.map(lambda a: a - row, cache.v),
            valid=cache.valid.at[1, :2].set(True),
            pos=jnp.asarray([4, 5, 6], jnp.int32),
        )
        picked = models.cache_rows(cache, jnp.asarray([2, 1, 1, 0]))
        for k, v in zip(jax.tree.leaves(picked.k), jax.tree.leaves(picked.v), strict=True):
            assert k.shape[-4] == 4
            # every entry of row i is +-(its source row): min == max == that
            for x, sign in ((np.asarray(k), 1), (np.asarray(v), -1)):
                want = np.broadcast_to(sign * np.array([2, 1, 1, 0]), x.shape[:-3])
                np.testing.assert_array_equal(x.max(axis=(-1, -2, -3)), want)
                np.testing.assert_array_equal(x.min(axis=(-1, -2, -3)), want)
        np.testing.assert_array_equal(picked.valid.sum(-1), [0, 2, 2, 0])
        np.testing.assert_array_equal(picked.pos, [6, 5, 5, 4])
        assert int(picked.index) == int(cache.index)


def test_stop_ids_end_rows(tiny):
    _, cfg, params = tiny("llama")
    free = np.asarray(sampling.generate(cfg, params, PROMPTS, 10, temperature=0.0).tokens)
    stop = int(free[0, 3])
    out = sampling.generate(
        cfg, params, PROMPTS, 10, temperature=0.0, stop_ids=(stop, 95), pad_id=0
    )
    tokens, lengths, finish = (np.asarray(x) for x in (out.tokens, out.lengths, out.finish))
    for i, row in enumerate(free):
        hits = np.nonzero(np.isin(row, [stop, 95]))[0]
        n = hits[0] + 1 if hits.size else 10
        assert lengths[i] == n
        assert finish[i] == (sampling.FINISH_STOP if hits.size else sampling.FINISH_LENGTH)
        np.testing.assert_array_equal(tokens[i, :n], row[:n])
        assert np.all(tokens[i, n:] == 0) and not np.asarray(out.mask)[i, n:].any()
    assert lengths[0] <= 4


def test_same_bucket_does_not_recompile(tiny):
    _, cfg, params = tiny("qwen2")
    sampler = sampling.Sampler(cfg)
    spec = sampling.RolloutSpec(max_new_tokens=4)

    def sample(prompts, step=None):
        sampler.sample(params, *sampling.pad_prompts(prompts, 0), spec, step)

    sample([[1, 2, 3], [4, 5]])
    sample([[1] * 14, [4, 5, 6, 7]])
    sample([[9] * 16, [3]], step=7)
    assert dict(sampler.traces) == {("sample", (2, 16)): 1}
    sample([[1] * 17, [4]])  # next bucket: one more program
    sample([[1] * 24, [4]])
    assert sampler.traces["sample", (2, 24)] == 1 and sum(sampler.traces.values()) == 2
    assert sampling.Sampler(cfg).traces == {}  # counters belong to the sampler


def test_bucket_lengths():
    ladders = {
        1: [16, 32, 64, 128, 256, 512],
        2: [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512],
        4: [16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256],
        8: [16, 18, 20, 22, 24, 26, 28, 30, 32, 36, 40, 44, 48, 52, 56, 60, 64],
    }
    for steps, buckets in ladders.items():
        for n in range(1, buckets[-1] + 1):
            b = sampling.bucket_length(n, steps)
            assert b == min(x for x in buckets if x >= n), (steps, n)
            assert b == 16 or b < (1 + 1 / steps) * n, (steps, n)  # padding < 100% / steps
    assert sampling.bucket_length(18) == 24  # the default: 2 steps
    with pytest.raises(ValueError, match="bucket steps=3"):
        sampling.bucket_length(18, 3)
    ids, mask = sampling.pad_prompts([[1] * 18, [2] * 5], pad_id=0, bucket_steps=4)
    assert ids.shape == (2, 20) and mask.sum(1).tolist() == [18, 5] and not mask[1, :15].any()


def test_sampler_reads_prompts_as_data_pads_them(tiny):
    """Left-padded host arrays at the data pipeline's width are cut (or padded) to the
    bucket of `bucket_steps`, without unpadding; what is not left-padded is refused."""
    _, cfg, params = tiny("qwen2")
    lengths = np.array([18, 12])
    ids = np.ones((2, 32), np.int32)  # a data batch: prompts left-padded to 32
    mask = np.arange(32)[None] >= 32 - lengths[:, None]
    spec = sampling.RolloutSpec(max_new_tokens=2)
    for steps, width in [(2, 24), (4, 20), (8, 18)]:
        out = sampling.Sampler(cfg, bucket_steps=steps).sample(params, ids, mask, spec, 0)
        assert out.prompt_tokens.shape[1] == width, steps
        np.testing.assert_array_equal(np.asarray(out.prompt_mask).sum(1), lengths)
    narrow = sampling.Sampler(cfg).bucketed(ids[:, -18:], mask[:, -18:])  # padded up to 24
    assert narrow[0].shape == (2, 24) and narrow[1].sum() == lengths.sum()
    with pytest.raises(ValueError, match="left-padded"):
        sampling.Sampler(cfg).sample(params, ids, mask[:, ::-1], spec, 0)
    with pytest.raises(ValueError, match="cache_segments=0"):
        sampling.Sampler(cfg, cache_segments=0)
    with pytest.raises(ValueError, match="bucket_steps=3"):
        sampling.Sampler(cfg, bucket_steps=3)


def test_key_from_seed_and_step(tiny):
    _, cfg, params = tiny("qwen2")
    run = lambda **kw: np.asarray(  # noqa: E731
        sampling.generate(cfg, params, PROMPTS, 8, num_samples=2, **kw).tokens
    )
    np.testing.assert_array_equal(run(seed=0, step=3), run(seed=0, step=3))
    assert not np.array_equal(run(seed=0, step=3), run(seed=0, step=4))
    assert not np.array_equal(run(seed=0, step=3), run(seed=1, step=3))
    # Without a step, a call draws as step 0: no counter of calls moves the key.
    np.testing.assert_array_equal(run(seed=9), run(seed=9, step=0))
    assert not np.array_equal(run(seed=9, step=0), run(seed=9, step=1))


def test_generate_with_another_seed_compiles_nothing(tiny):
    """The seed is an argument of the sampler's program, not what selects it: a second
    `generate` with another seed traces, lowers and compiles nothing (no event of JAX's
    compile pipeline), and draws other tokens."""
    _, cfg, params = tiny("qwen2")
    kw = dict(max_new_tokens=6, num_samples=2, step=0, cache_segments=5)  # no other test's
    events = []

    def listen(event, duration_secs, **_):
        if event.startswith("/jax/core/compile/"):
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        first = np.asarray(sampling.generate(cfg, params, PROMPTS, seed=1, **kw).tokens)
        first_events, events[:] = list(events), []
        second = np.asarray(sampling.generate(cfg, params, PROMPTS, seed=2, **kw).tokens)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert "/jax/core/compile/jaxpr_trace_duration" in first_events  # the listener hears
    assert events == []
    assert not np.array_equal(first, second)


def test_same_seed_and_step_draw_the_same_whatever_came_between(tiny):
    """No random state outlives a call: the same `generate` call returns the same tokens
    after calls with other seeds, other steps and none; a `seed=` given to a call draws
    as a sampler made with that seed (`sample`, and `start` + `decode`)."""
    _, cfg, params = tiny("qwen2")
    run = lambda **kw: np.asarray(  # noqa: E731
        sampling.generate(cfg, params, PROMPTS, 8, num_samples=2, **kw).tokens
    )
    before = run(seed=7, step=2)
    for kw in (dict(seed=7), dict(seed=7, step=3), dict(seed=8, step=2), dict(seed=7)):
        run(**kw)
    np.testing.assert_array_equal(run(seed=7, step=2), before)
    spec = sampling.RolloutSpec(num_generations=2, max_new_tokens=8)
    ids, mask = sampling.pad_prompts(PROMPTS, 0)
    own = np.asarray(sampling.Sampler(cfg, seed=3).sample(params, ids, mask, spec, 1).tokens)
    sampler = sampling.Sampler(cfg, seed=0)
    given = sampler.sample(params, ids, mask, spec, 1, seed=3)
    resumed = sampler.result(
        sampler.decode(params, sampler.start(params, ids, mask, spec, 1, seed=3))
    )
    np.testing.assert_array_equal(np.asarray(given.tokens), own)
    np.testing.assert_array_equal(np.asarray(resumed.tokens), own)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(prompts=[]), r"non-empty list of token-id lists"),
        (dict(prompts=[[1], []]), r"prompts\[1\]: expected a non-empty list"),
        (dict(prompts=[[1, VOCAB]]), rf"prompts\[0\]: token id outside \[0, {VOCAB}\)"),
        (dict(max_new_tokens=0), r"max_new_tokens=0"),
        (dict(top_p=0.0), r"top_p=0.0"),
        (dict(temperature=-1.0), r"temperature=-1.0"),
        (dict(stop_ids=(VOCAB,)), r"stop_ids: 96 is outside"),
        (dict(max_new_tokens=250), r"exceeds the model's max_position_embeddings 256"),
        (dict(cache_segments=0), r"cache_segments=0: must be >= 1"),
    ],
)
def test_bad_arguments(tiny, kwargs, message):
    _, cfg, params = tiny("qwen2")
    args = dict(prompts=PROMPTS, max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=message):
        sampling.generate(cfg, params, **args)


# -------------------------------------------------------------- resumable: start / decode / append
def _rows(lists, pad=0):
    """Token-id lists -> right-padded (ids [N, A], mask [N, A])."""
    width = max(1, max(map(len, lists)))
    ids = np.full((len(lists), width), pad, np.int32)
    mask = np.zeros((len(lists), width), bool)
    for i, row in enumerate(lists):
        ids[i, : len(row)], mask[i, : len(row)] = row, True
    return ids, mask


def _mesh_and_params(cfg, params, sharded):
    if not sharded:
        return None, params
    mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    return mesh, jax.device_put(params, models.param_shardings(cfg, mesh))


APPENDED = [
    [33, 34, 35, 36, 37],
    [],
    [50, 51],
    [60],
    [70, 71, 72],
    [80, 81, 82, 83, 84, 85],
    [90],
    [91, 92],
]


def _start_append_cases():
    """Greedy / sampled x one device / mesh x scanned / unrolled layers: two crossing
    cases in the default tier, the other six in the slow one."""
    for temperature, t_id in ((0.0, "greedy"), (0.8, "sampled")):
        for sharded, s_id in ((False, "one_device"), (True, "mesh")):
            for scan, l_id in ((True, "scanned"), (False, "unrolled")):
                kept = (t_id, s_id, l_id) in {
                    ("greedy", "mesh", "unrolled"),
                    ("sampled", "one_device", "scanned"),
                }
                marks = () if kept else pytest.mark.slow
                yield pytest.param(
                    scan, sharded, temperature, marks=marks, id=f"{t_id}-{s_id}-{l_id}"
                )


@pytest.mark.parametrize("scan_layers, sharded, temperature", list(_start_append_cases()))
def test_start_append_decode_equals_the_longer_prompt(tiny, scan_layers, sharded, temperature):
    """Tokens appended to each row's cache (ragged, one row none) then decoded == the
    prompt + those tokens prefilled and decoded: same tokens, log-probs to 1e-5; the
    appended tokens sit in the completion with loss mask 0 and no log-prob."""
    _, cfg, params = tiny("qwen3")
    cfg = dataclasses.replace(cfg, scan_layers=scan_layers)
    mesh, p = _mesh_and_params(cfg, params, sharded)
    G, T = 2, 9
    spec = sampling.RolloutSpec(G, T, temperature, stop_ids=tuple(range(0, VOCAB, 7)))
    sampler = sampling.Sampler(cfg, mesh, seed=4, cache_segments=2)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [11], [40, 41, 42, 43, 44]]
    state = sampler.start(p, *sampling.pad_prompts(prompts, 0), spec, step=3)
    state = sampler.append(p, state, *_rows(APPENDED))
    out = sampler.result(sampler.decode(p, state))
    longer = [prompts[i // G] + APPENDED[i] for i in range(len(prompts) * G)]
    ref_sampler = sampling.Sampler(cfg, mesh, seed=4, cache_segments=2)
    one = dataclasses.replace(spec, num_generations=1)  # each row its own prompt
    ref = ref_sampler.sample(p, *sampling.pad_prompts(longer, 0), one, step=3)
    a = np.array([len(x) for x in APPENDED])
    tokens, loss_mask, logprobs = (np.asarray(x) for x in (out.tokens, out.loss_mask, out.logprobs))
    ref_tokens, ref_lp, ref_len = (np.asarray(x) for x in (ref.tokens, ref.logprobs, ref.lengths))
    np.testing.assert_array_equal(np.asarray(out.lengths), a + ref_len)
    np.testing.assert_array_equal(np.asarray(out.finish), np.asarray(ref.finish))
    for i in range(len(a)):
        np.testing.assert_array_equal(tokens[i, : a[i]], APPENDED[i])
        assert not loss_mask[i, : a[i]].any() and not logprobs[i, : a[i]].any()
        sampled = slice(a[i], a[i] + ref_len[i])
        np.testing.assert_array_equal(tokens[i, sampled], ref_tokens[i, : ref_len[i]])
        assert loss_mask[i, sampled].all() and not loss_mask[i, a[i] + ref_len[i] :].any()
        np.testing.assert_allclose(logprobs[i, sampled], ref_lp[i, : ref_len[i]], atol=1e-5)
    if temperature:  # some rows stopped early (greedy rows may never meet a stop id)
        assert (np.asarray(ref.finish) == sampling.FINISH_STOP).any()


@pytest.mark.parametrize(
    "sharded", [pytest.param(False, marks=pytest.mark.slow), True], ids=["one_device", "mesh"]
)
def test_decode_twice_equals_one_decode(tiny, sharded):
    """decode(a) then decode(b) on the returned state == decode(a + b): the draws, the
    stops and the log-probs continue where the first call left them."""
    _, cfg, params = tiny("qwen2")
    mesh, p = _mesh_and_params(cfg, params, sharded)
    spec = sampling.RolloutSpec(3, 12, 1.0, stop_ids=tuple(range(0, VOCAB, 9)))
    ids, mask = sampling.pad_prompts(PROMPTS, 0)
    whole = sampling.Sampler(cfg, mesh, seed=2).sample(p, ids, mask, spec, step=5)
    sampler = sampling.Sampler(cfg, mesh, seed=2)
    state = sampler.start(p, ids, mask, spec, step=5)
    state = sampler.decode(p, state, max_new_tokens=5)
    first = sampler.result(state)
    assert int(np.asarray(first.lengths).max()) <= 5
    out = sampler.result(sampler.decode(p, state, max_new_tokens=7))
    for field in ("tokens", "mask", "loss_mask", "lengths", "finish"):
        np.testing.assert_array_equal(getattr(out, field), getattr(whole, field), err_msg=field)
    np.testing.assert_allclose(out.logprobs, whole.logprobs, atol=1e-5)
    assert 0 < (np.asarray(whole.finish) == sampling.FINISH_STOP).sum() < len(PROMPTS) * 3


def test_turns_with_tool_output_train_on_what_was_sampled(tiny):
    """Two turns: rows that stop on a tool-call token get a tool's output appended; rows
    that stopped otherwise stay done, rows that ran out of budget go on. `result` compacts
    each row (the slots of a row that waited are holes in the cache): the teacher-forced
    log-probs of the compacted rows equal the sampler's on every sampled token, and only
    sampled tokens are in the loss mask."""
    _, cfg, params = tiny("qwen3")
    tool_calls, eos = (9, 10, 11, 12), (13, 14, 15, 16)
    spec = sampling.RolloutSpec(4, 8, 1.0, stop_ids=(*tool_calls, *eos))
    sampler = sampling.Sampler(cfg, seed=1)
    state = sampler.start(params, *sampling.pad_prompts(PROMPTS, 0), spec, step=0)
    state = sampler.decode(params, state)
    first = sampler.result(state)
    n_first = np.asarray(first.lengths)
    stopped = np.asarray(first.finish) == sampling.FINISH_STOP
    last = np.asarray(first.tokens)[np.arange(len(n_first)), n_first - 1]
    called = stopped & np.isin(last, tool_calls)
    assert called.any() and (stopped & ~called).any()
    tool = [[20, 21, 22][: 1 + i % 3] if c else [] for i, c in enumerate(called)]
    state = sampler.append(params, state, *_rows(tool))
    out = sampler.result(sampler.decode(params, state, max_new_tokens=6, stop_ids=eos))
    lengths = np.asarray(out.lengths)
    n_tool = np.array([len(t) for t in tool])
    np.testing.assert_array_equal(np.asarray(out.loss_mask).sum(1) + n_tool, lengths)
    done = stopped & ~called
    np.testing.assert_array_equal(lengths[done], n_first[done])  # did not continue
    assert (lengths[called] > n_first[called] + n_tool[called]).all()
    assert (lengths[~stopped] > n_first[~stopped]).all()  # budget rows went on
    ref = teacher_forced_logprobs(cfg, params, out, 1.0)
    lm = np.asarray(out.loss_mask)
    assert np.abs(np.asarray(out.logprobs) - ref)[lm].max() <= 1e-4
    for i in np.nonzero(called)[0]:  # the tool output follows the tool call, no hole
        k = n_first[i]
        np.testing.assert_array_equal(np.asarray(out.tokens)[i, k : k + n_tool[i]], tool[i])


def test_append_checks_its_input(tiny):
    _, cfg, params = tiny("qwen2")
    spec = sampling.RolloutSpec(2, 4)
    sampler = sampling.Sampler(cfg)
    state = sampler.start(params, *sampling.pad_prompts(PROMPTS[:2], 0), spec, step=0)
    with pytest.raises(ValueError, match=r"append: token_ids \(3, 2\) and token_mask"):
        sampler.append(params, state, *_rows([[1, 2], [3], [4]]))
    with pytest.raises(ValueError, match=r"append: token_ids: token id outside \[0, 96\)"):
        sampler.append(params, state, *_rows([[1, 200], [3], [4], [5]]))
    with pytest.raises(ValueError, match="append .* exceeds the model's max_position_embeddings"):
        sampler.append(params, state, *_rows([[1] * 300] * 4))


def test_refresh_switches_parameters_mid_generation(tiny):
    """Partial rollouts: 4 tokens drawn by one set of parameters, then `refresh` and 6 more
    by another. Each token's log-prob is the teacher-forced one under the parameters that
    drew it; refreshing with the same parameters changes nothing."""
    _, cfg, params = tiny("qwen3")
    noise = jax.random.split(jax.random.key(5), len(jax.tree.leaves(params)))
    leaves = [
        x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
        for x, k in zip(jax.tree.leaves(params), noise, strict=True)
    ]
    newer = jax.tree.unflatten(jax.tree.structure(params), leaves)
    spec = sampling.RolloutSpec(3, 10, temperature=0.8, stop_ids=(3,))
    ids, mask = sampling.pad_prompts(PROMPTS, pad_id=0)
    sampler = sampling.Sampler(cfg, seed=4)

    def two_parts(second):
        state = sampler.start(params, ids, mask, spec, step=0)
        state = sampler.refresh(second, sampler.decode(params, state, 4))
        return sampler.result(sampler.decode(second, state, 6))

    out = two_parts(newer)
    first, later = np.arange(10) < 4, np.arange(10) >= 4
    m = np.asarray(out.mask)
    assert m[:, later].any() and not m.all()  # rows went on, some stopped at the stop id
    got = np.asarray(out.logprobs)
    for p, cols in ((params, first), (newer, later)):
        ref = teacher_forced_logprobs(cfg, p, out, 0.8)
        sel = m & cols[None, :]
        assert np.abs(got - ref)[sel].max() <= 1e-4
    same = two_parts(params)
    straight = sampler.sample(params, ids, mask, spec, step=0)
    np.testing.assert_array_equal(np.asarray(same.tokens), np.asarray(straight.tokens))
    np.testing.assert_allclose(np.asarray(same.logprobs), np.asarray(straight.logprobs), atol=1e-5)


def test_stop_ends_rows_that_still_had_budget(tiny):
    """Rows marked by `stop` draw nothing in later decodes (their length and finish stay);
    the others go on exactly as without the stop; an append makes a stopped row live."""
    _, cfg, params = tiny("qwen2")
    spec = sampling.RolloutSpec(2, 4, 1.0)
    ids, mask = sampling.pad_prompts(PROMPTS[:2], 0)
    sampler = sampling.Sampler(cfg, seed=3)
    state = sampler.decode(params, sampler.start(params, ids, mask, spec, step=0), 3)
    state = sampler.stop(state, [True, False, False, True])
    out = sampler.result(sampler.decode(params, state, 3))
    whole = sampling.Sampler(cfg, seed=3).sample(
        params, ids, mask, spec.replace(max_new_tokens=6), 0
    )
    np.testing.assert_array_equal(np.asarray(out.lengths), [3, 6, 6, 3])
    np.testing.assert_array_equal(np.asarray(out.tokens)[1:3], np.asarray(whole.tokens)[1:3])
    np.testing.assert_array_equal(
        np.asarray(out.tokens)[[0, 3], :3], np.asarray(whole.tokens)[[0, 3], :3]
    )
    with pytest.raises(ValueError, match=r"stop: rows \(3,\) must be \[4\]"):
        sampler.stop(state, [True, False, False])
