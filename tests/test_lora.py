"""LoRA: adapters next to the base weights, step 0 = the base model, only adapters train.

References: the base model itself (B = 0 must change nothing, bit for bit), the plain
model on weights merged in float64 numpy, the chain rule through the merged weight for
the adapters' gradients, and a copy of the base taken before training.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_run import tiny_model_config

from jaxrl_llm import models, parallel, rl, sampling
from jaxrl_llm.models import layer_math, lora
from jaxrl_llm.models.transformer import abstract_model
from jaxrl_llm.rl import update as U

CFG = tiny_model_config()
LCFG = CFG.replace(lora=models.LoraConfig(rank=4, alpha=8.0))
IDS = jnp.array([[0, 0, 5, 9, 2, 7, 1, 3], [4, 8, 12, 16, 20, 24, 28, 32]])
MASK = jnp.array([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8], bool)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11]]
G = 4
SPEC = sampling.RolloutSpec(num_generations=G, max_new_tokens=5, temperature=1.0)


def mesh_2x4():
    return parallel.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})


@pytest.fixture(scope="module")
def base():
    return models.init_params(CFG, seed=0)


def trained_adapters(seed=1, scale=0.2):
    """Adapters with B != 0 (as after training), built in numpy."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: lora.init_adapters(LCFG))
    return jax.tree.map(
        lambda s: jnp.asarray(scale * rng.standard_normal(s.shape), jnp.float32), shapes
    )


def numpy_merged(base, adapters):
    """W + (alpha / r) A B per target, in float64 numpy: the reference for the adapted model."""
    out = jax.tree.map(np.asarray, base)
    s = LCFG.lora.scale
    for t in LCFG.lora.targets:
        a = np.asarray(adapters["layers"][t + "_lora_a"], np.float64)
        b = np.asarray(adapters["layers"][t + "_lora_b"], np.float64)
        w = out["layers"][t]
        L, r = a.shape[0], a.shape[-1]
        ab = np.stack([a[i].reshape(-1, r) @ b[i].reshape(r, -1) for i in range(L)])
        out["layers"][t] = (w.astype(np.float64) + s * ab.reshape(w.shape)).astype(np.float32)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step0_logits_equal_the_base_model(base, dtype):
    """B = 0 at init: the adapted model is the base model. The zero term is exact, but the
    adapted program fuses its projections differently, so on some CPUs (AVX-512) XLA
    rounds float32's base matmuls themselves differently (~1e-7 relative)."""
    b = jax.tree.map(lambda x: x.astype(dtype), base)
    adapters = lora.init_adapters(LCFG, seed=1, dtype=dtype)
    assert all(not np.any(np.asarray(v)) for k, v in adapters["layers"].items() if "_b" in k)
    ours = np.asarray(models.logits(LCFG, lora.combine(b, adapters), IDS, MASK), np.float32)
    plain = np.asarray(models.logits(CFG, b, IDS, MASK), np.float32)
    np.testing.assert_allclose(ours, plain, rtol=0, atol=1e-6 if dtype == "float32" else 0.0)


def test_adapted_and_merged_logits_equal_numpy_merged_weights(base):
    adapters = trained_adapters()
    params = lora.combine(base, adapters)
    expected = models.logits(CFG, numpy_merged(base, adapters), IDS, MASK)
    unmerged = models.logits(LCFG, params, IDS, MASK)
    merged = models.logits(CFG, lora.merge(LCFG, params), IDS, MASK)
    assert float(jnp.abs(unmerged - models.logits(CFG, base, IDS, MASK)).max()) > 0.1
    np.testing.assert_allclose(unmerged, expected, atol=2e-5, rtol=0)
    np.testing.assert_allclose(merged, expected, atol=2e-5, rtol=0)


def test_adapter_gradients_follow_the_chain_rule_through_the_merged_weight(base):
    """dL/dA = s dL/dW' B^T and dL/dB = s A^T dL/dW' with W' = W + s A B."""
    adapters = trained_adapters(seed=2)

    def nll(cfg, params):
        z = models.logits(cfg, params, IDS, MASK)
        return -jnp.mean(jax.nn.log_softmax(z)[:, :-1, :].max(-1))

    g = jax.grad(lambda a: nll(LCFG, lora.combine(base, a)))(adapters)["layers"]
    merged = lora.merge(LCFG, lora.combine(base, adapters))
    g_w = jax.grad(lambda p: nll(CFG, p))(merged)["layers"]
    s = LCFG.lora.scale
    for t in LCFG.lora.targets:
        a = np.asarray(adapters["layers"][t + "_lora_a"], np.float64)
        b = np.asarray(adapters["layers"][t + "_lora_b"], np.float64)
        L, r = a.shape[0], a.shape[-1]
        gw = np.asarray(g_w[t], np.float64).reshape(L, a[0].size // r, -1)
        a2, b2 = a.reshape(L, -1, r), b.reshape(L, r, -1)
        ga = s * np.einsum("lkm,lrm->lkr", gw, b2).reshape(a.shape)
        gb = s * np.einsum("lkr,lkm->lrm", a2, gw).reshape(b.shape)
        np.testing.assert_allclose(g[t + "_lora_a"], ga, atol=1e-6, rtol=1e-4, err_msg=t)
        np.testing.assert_allclose(g[t + "_lora_b"], gb, atol=1e-6, rtol=1e-4, err_msg=t)


def test_adapters_are_sharded_like_the_weights_they_adapt():
    """On a 2 x 4 (fsdp x tensor) mesh: A's input dimensions and B's output dimensions
    take the partitioning of the weight's; the rank is replicated."""
    mesh = mesh_2x4()
    weights = models.param_shardings(LCFG, mesh)["layers"]
    adapters = lora.init_adapters(LCFG, seed=0, mesh=mesh)["layers"]
    for t in LCFG.lora.targets:
        w = weights[t].spec
        c = 3 if t == "o" else 2  # layers + the input axes
        a, b = adapters[t + "_lora_a"].sharding.spec, adapters[t + "_lora_b"].sharding.spec
        assert tuple(a) == (*tuple(w)[:c], None), (t, a, w)
        assert tuple(b) == (None, None, *tuple(w)[c:]), (t, b, w)
    assert tuple(weights["q"].spec) == (None, "fsdp", "tensor", None)  # the test means it


def test_step0_sampled_tokens_equal_the_base_models(base):
    """Same key, same logits: the first step's draws are the base model's, unmerged and
    merged, on the 2 x 4 mesh."""
    mesh = mesh_2x4()
    b = jax.device_put(base, models.param_shardings(CFG, mesh))
    params = lora.combine(b, lora.init_adapters(LCFG, seed=3, mesh=mesh))
    ids, mask = sampling.pad_prompts(PROMPTS, pad_id=0)
    plain, adapted = (sampling.Sampler(c, mesh, seed=5) for c in (CFG, LCFG))

    def draw(sampler, p):
        out = sampler.sample(p, ids, mask, SPEC, step=0)
        return np.asarray(out.tokens), np.asarray(out.logprobs)

    tokens, logp = draw(plain, b)
    for sampler, p in ((adapted, params), (plain, lora.make_merge_fn(LCFG, mesh)(params))):
        t, lp = draw(sampler, p)
        np.testing.assert_array_equal(t, tokens)
        np.testing.assert_array_equal(lp, logp)


def host_bytes(tree):
    return jax.tree.map(lambda x: np.asarray(x.astype(jnp.float32)).tobytes(), tree)


def test_only_adapters_train_and_the_base_stays_bit_identical(base):
    """GRPO (beta > 0) for 10 steps on the 2 x 4 mesh, the reference = the base with the
    adapters off: gradients and moments exist for the adapters only, the base's bytes
    never change, the adapters do."""
    mesh = mesh_2x4()
    frozen = jax.device_put(base, models.param_shardings(CFG, mesh))
    before = host_bytes(frozen)
    opt = U.make_optimizer(learning_rate=1e-2, max_grad_norm=1.0)
    adapters = lora.init_adapters(LCFG, seed=1, mesh=mesh)
    state = U.init_train_state(adapters, opt, frozen=frozen)
    adapter_shapes = {x.shape for x in jax.tree.leaves(adapters)}
    assert {x.shape for x in jax.tree.leaves(state.opt_state) if x.ndim} == adapter_shapes
    algo = rl.preset("grpo")
    assert algo.beta > 0
    update = U.make_update_fn(LCFG, algo, opt, SPEC)
    ref_fn = U.make_logprob_fn(CFG, SPEC, mesh=mesh)
    sampler = sampling.Sampler(LCFG, mesh, seed=0)
    ids, mask = sampling.pad_prompts(PROMPTS, pad_id=0)
    for step in range(10):
        out = sampler.sample(state.policy_params(), ids, mask, SPEC, step)
        rewards = (np.asarray(out.tokens)[:, 0] % 2).astype(np.float32)
        ref = ref_fn(state.frozen, out)
        batch = parallel.shard_batch(rl.RolloutBatch.from_sample(out, rewards, ref), mesh)
        state, metrics = update(state, batch)
        assert float(metrics["optim/nonfinite"]) == 0.0
        if step == 0:  # the policy is the reference: no KL yet
            assert abs(float(metrics["loss/kl"])) < 1e-6
    assert state.frozen is frozen
    assert host_bytes(state.frozen) == before
    assert jax.tree.structure(state.params) == jax.tree.structure(adapters)
    assert np.abs(np.asarray(state.params["layers"]["q_lora_b"])).max() > 0


def test_bfloat16_master_copies_cover_only_the_adapters(base):
    """bfloat16 base and adapters: the optimizer's float32 master copy and moments are
    the adapters' (the trainer-level test trains such a run)."""
    frozen = jax.tree.map(lambda x: x.astype(jnp.bfloat16), base)
    opt = U.make_optimizer(learning_rate=1e-2)
    adapters = lora.init_adapters(LCFG, seed=1, dtype="bfloat16")
    state = U.init_train_state(adapters, opt, frozen=frozen)
    master = state.opt_state.master
    assert jax.tree.structure(master) == jax.tree.structure(adapters)
    assert {x.dtype for x in jax.tree.leaves(master)} == {jnp.dtype(jnp.float32)}
    shapes = {x.shape for x in jax.tree.leaves(adapters)}
    assert {x.shape for x in jax.tree.leaves(state.opt_state) if x.ndim} == shapes


# ------------------------------------------------------------------------- dropout
DCFG = CFG.replace(lora=models.LoraConfig(rank=4, alpha=8.0, dropout=0.25))


def test_adapter_dropout_is_inverted_dropout():
    """Each element is kept with probability 1 - p and then scaled by 1 / (1 - p), so
    its mean over masks is the input."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 96)), jnp.float32)
    keys = jax.random.split(jax.random.key(3), 400)
    out = np.asarray(jax.vmap(lambda k: layer_math.adapter_dropout(k, 0.25, x))(keys))
    kept = out != 0
    assert abs(kept.mean() - 0.75) < 0.01
    np.testing.assert_allclose(out[kept], np.broadcast_to(x / 0.75, out.shape)[kept], rtol=1e-6)
    sigma = np.abs(np.asarray(x)) * np.sqrt(0.25 / 0.75 / len(keys))  # of a 400-mask mean
    assert np.all(np.abs(out.mean(0) - x) <= 5.5 * sigma + 1e-6)
    assert not np.array_equal(out[0], out[1])


def test_projection_with_dropout_equals_numpy(base):
    """One layer's adapted projection with a dropout key: x W + s ((x * m / (1 - p)) A) B,
    m the mask the layer's key folds in for that target, in float64 numpy."""
    params = lora.combine(base, trained_adapters(seed=4))
    graphdef, _ = abstract_model(DCFG)
    block = nnx.merge(graphdef, params).layers
    one = nnx.merge(*_layer(block, 1))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, CFG.hidden_size)), jnp.float32)
    key = jax.random.key(7)
    s, p = DCFG.lora.scale, DCFG.lora.dropout
    for t in ("q", "gate"):
        ours = np.asarray(one._proj(t, x, key)).reshape(2, 5, -1)
        keep = jax.random.bernoulli(
            jax.random.fold_in(key, layer_math.lora_target_index(t)), 1 - p, x.shape
        )
        w, a, b = (
            np.asarray(params["layers"][n][1], np.float64)
            for n in (t, t + "_lora_a", t + "_lora_b")
        )
        xd = np.where(np.asarray(keep), np.asarray(x, np.float64) / (1 - p), 0.0)
        expected = x @ w.reshape(CFG.hidden_size, -1) + s * (xd @ a) @ b.reshape(a.shape[-1], -1)
        np.testing.assert_allclose(ours, expected, atol=2e-5, rtol=0, err_msg=t)
        without = np.asarray(one._proj(t, x)).reshape(2, 5, -1)
        assert np.abs(ours - without).max() > 1e-3  # the mask matters


def _layer(block, i):
    graphdef, state = nnx.split(block)
    return graphdef, jax.tree.map(lambda a: a[i], state)


def test_dropout_only_where_a_key_is_given(base):
    """Inference (sampler, reference, log-probs: no key) equals the model without dropout
    bit for bit; a key changes the forward, the same key the same way; with B = 0 (step 0)
    the adapters add nothing, dropped or not."""
    params = lora.combine(base, trained_adapters(seed=5))
    hidden = lambda cfg, p, key=None: models.forward(cfg, p, IDS, MASK, dropout=key)  # noqa: E731
    plain = hidden(LCFG, params)
    np.testing.assert_array_equal(hidden(DCFG, params), plain)
    k1, k2 = jax.random.key(1), jax.random.key(2)
    dropped = hidden(DCFG, params, k1)
    assert float(jnp.abs(dropped - plain).max()) > 1e-3
    np.testing.assert_array_equal(hidden(DCFG, params, k1), dropped)
    assert float(jnp.abs(hidden(DCFG, params, k2) - dropped).max()) > 1e-3
    fresh = lora.combine(base, lora.init_adapters(DCFG, seed=1))
    # float32's rounding of the base matmuls, as in test_step0_logits_equal_the_base_model
    np.testing.assert_allclose(hidden(DCFG, fresh, k1), hidden(CFG, base), rtol=0, atol=1e-6)


def test_update_with_dropout_is_seeded_and_trains_adapters_only(base):
    """The GRPO update with adapter dropout: two updates from the same state and seed are
    identical (the masks come from train.seed and the step), dropout changes the step
    against p = 0, and the base is never touched."""
    opt = U.make_optimizer(learning_rate=1e-2, max_grad_norm=1.0)
    frozen = base
    adapters = trained_adapters(seed=6, scale=0.05)
    sampler = sampling.Sampler(LCFG, None, seed=0)
    ids, mask = sampling.pad_prompts(PROMPTS, pad_id=0)
    out = sampler.sample(lora.combine(frozen, adapters), ids, mask, SPEC, 0)
    rewards = (np.asarray(out.tokens)[:, 0] % 2).astype(np.float32)
    assert 0 < rewards.sum() < len(rewards)
    batch = rl.RolloutBatch.from_sample(out, rewards)
    algo = rl.preset("grpo", beta=0.0)

    def step(cfg, seed):
        state = U.init_train_state(jax.tree.map(jnp.copy, adapters), opt, frozen=frozen)
        new, metrics = U.make_update_fn(cfg, algo, opt, SPEC, seed=seed)(state, batch)
        assert float(metrics["optim/nonfinite"]) == 0.0 and new.frozen is frozen
        return jax.tree.map(np.asarray, new.params)

    a, b, plain = step(DCFG, 0), step(DCFG, 0), step(LCFG, 0)
    jax.tree.map(np.testing.assert_array_equal, a, b)
    diff = jax.tree.map(lambda u, v: np.abs(u - v).max(), a, plain)
    assert max(jax.tree.leaves(diff)) > 1e-6
