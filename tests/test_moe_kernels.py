"""The TPU grouped-matmul expert path (`model.moe_impl='gmm'`, Pallas interpret mode on
CPU) against a per-expert loop and Hugging Face; which path `auto` picks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import hf_logits, padded_batch
from test_moe import loop_experts, max_diff, qwen3_moe  # noqa: F401 (a fixture)

from jaxrl_llm import models, parallel
from jaxrl_llm.models import moe_kernels


def expert_case(seed, N, D, F, E, k=2):
    """x [N, D], ids [N, k] distinct per token with expert E-1 never chosen, softmax
    gating weights, expert weights."""
    keys = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(keys[0], (N, D))
    first = jax.random.randint(keys[1], (N,), 0, E - 1)
    ids = jnp.stack([first, (first + 1 + first % (E - 2)) % (E - 1)], axis=-1)[:, :k]
    weights = jax.nn.softmax(jax.random.normal(keys[2], (N, k)))
    gate, up = (jax.random.normal(kk, (E, D, F)) / np.sqrt(D) for kk in keys[3:5])
    down = jax.random.normal(keys[5], (E, F, D)) / np.sqrt(F)
    return x, ids, weights, gate, up, down


def value_and_grads(f, x, ids, weights, gate, up, down):
    def fn(x, w, g, u, d):
        y = f(x, ids, w, g, u, d)
        return jnp.sum(y * jnp.cos(y)), y

    grad = jax.value_and_grad(fn, argnums=(0, 1, 2, 3, 4), has_aux=True)
    (_, y), grads = jax.jit(grad)(x, weights, gate, up, down)
    return y, grads


def assert_equal_loop(f, case, atol):
    y, grads = value_and_grads(f, *case)
    y_ref, grads_ref = value_and_grads(loop_experts, *case)
    np.testing.assert_allclose(y, y_ref, atol=atol, rtol=1e-5)
    for g, r in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(g, r, atol=atol, rtol=1e-5)
    return grads


def test_gmm_values_and_gradients_equal_per_expert_loop():
    """The kernel (interpret mode) against a Python loop over experts: outputs and
    gradients w.r.t. input, gating weights and every expert weight. 200 routed rows (two
    row tiles, groups crossing a tile edge, 56 padding rows) and
    contracting / output widths over one 128 tile with a remainder; one expert is unused
    (its gradient is exactly zero)."""
    case = expert_case(0, 100, 160, 144, E=5)
    grads = assert_equal_loop(moe_kernels.gmm_experts, case, atol=2e-5)
    assert float(jnp.abs(grads[2][-1]).max()) == 0.0


def test_gmm_expert_parallel_equals_per_expert_loop():
    """With a mesh set around the trace the kernel runs per device in `shard_map`: experts
    split over `expert` (tokens all-gathered over it, each device its two experts through
    the kernel's group offset, outputs reduce-scattered), rows over (fsdp, expert). Values
    and gradients equal the loop on one device."""
    case = expert_case(1, 16, 8, 6, E=8)
    with jax.set_mesh(parallel.make_mesh({"expert": 4, "fsdp": 2})):
        assert_equal_loop(moe_kernels.gmm_experts, case, atol=2e-5)


def test_gmm_bfloat16_equals_float32_loop():
    """bf16 operands (the kernel accumulates in float32) within bf16 rounding."""
    case = expert_case(2, 13, 8, 6, E=5)
    x, ids, weights, gate, up, down = case
    bf = [a.astype(jnp.bfloat16) for a in (x, gate, up, down)]
    y = jax.jit(moe_kernels.gmm_experts)(bf[0], ids, weights, *bf[1:])
    assert y.dtype == jnp.bfloat16
    x32, g32, u32, d32 = (a.astype(jnp.float32) for a in bf)
    ref = loop_experts(x32, ids, weights, g32, u32, d32)
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("axes", [None, {"expert": 4, "fsdp": 2}], ids=["1-device", "ep4xfsdp2"])
def test_gmm_model_logits_equal_transformers(qwen3_moe, axes):  # noqa: F811 (the fixture)
    """A tiny Qwen3-MoE with `moe_impl='gmm'`: logits of a padded batch equal HF's, on one
    device and with the parameters on a mesh set around the trace (two experts per
    device, the kernel per device in `shard_map`)."""
    model, _, cfg, params = qwen3_moe
    ids, mask = padded_batch(batch=8)
    cfg = cfg.replace(moe_impl="gmm")
    if axes is None:
        ours = models.logits(cfg, params, ids, mask)
    else:
        mesh = parallel.make_mesh(axes)
        params = jax.device_put(params, models.param_shardings(cfg, mesh))
        with jax.set_mesh(mesh):
            ours = models.logits(cfg, params, *parallel.shard_batch((ids, mask), mesh))
    assert max_diff(ours, hf_logits(model, ids, mask), mask) <= 1e-5


def test_auto_picks_the_path_of_each_backend():
    r = moe_kernels.resolve
    assert r("auto", "tpu") == "gmm"
    assert r("auto", "tpu", num_devices=8) == "ragged"  # XLA partitions; gmm it cannot
    assert r("auto", "tpu", num_devices=8, mesh_set=True) == "gmm"
    assert r("auto", "gpu") == "ragged" and r("auto", "cpu") == "blocked"
    assert r("dense", "tpu") == "dense"


def test_moe_impl_is_checked_naming_the_key(qwen3_moe):  # noqa: F811 (the fixture)
    from tiny_run import tiny_config

    from jaxrl_llm import config as config_lib
    from jaxrl_llm.config import checks_model

    c = tiny_config(str(qwen3_moe[1]))
    for name in ("auto", "gmm", "ragged", "blocked", "dense"):
        c.model.moe_impl = name
        checks_model.check_model(c)
    c.model.moe_impl = "megablox"
    with pytest.raises(config_lib.ConfigError, match=r"model\.moe_impl='megablox': expected"):
        checks_model.check_model(c)
