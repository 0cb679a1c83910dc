"""Context parallelism: one 4k-token sequence split over the mesh's `context` axis (4 of
the 8 fake CPU devices, composed with fsdp = 2 over the rows) gives the loss and the
gradients of the same computation on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import tiny_model_config

from jaxrl_llm import models, parallel
from jaxrl_llm.rl import batch as B

P, T = 16, 4080  # 4,096 tokens a row
CFG = tiny_model_config(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=4)


def rows(n=2, seed=0):
    rng = np.random.default_rng(seed)
    prompt_mask = np.ones((n, P), bool)
    prompt_mask[0, :3] = False
    mask = np.ones((n, T), bool)
    mask[1, T - 37 :] = False
    prompt = np.where(prompt_mask, rng.integers(1, 64, (n, P)), 0).astype(np.int32)
    tokens = np.where(mask, rng.integers(1, 64, (n, T)), 0).astype(np.int32)
    return prompt, prompt_mask, tokens, mask


def loss(params, prompt, prompt_mask, tokens, mask):
    """A weighted sum of the teacher-forced log-probs and entropies (the update's forward)."""
    logp, ent = B.sequence_logprobs(CFG, params, prompt, prompt_mask, tokens, mask, chunk_size=512)
    return jnp.sum(logp * jnp.linspace(0.0, 1.0, T)) + 0.1 * jnp.sum(ent)


def host(tree):
    return jax.tree.map(np.asarray, tree)


def test_context_parallel_equals_one_device():
    params = models.init_params(CFG, seed=0)
    batch = rows()
    fn = jax.jit(jax.value_and_grad(loss))
    want = host(fn(params, *batch))
    one_device = fn.lower(params, *batch).compile().cost_analysis()["flops"]
    mesh = parallel.make_mesh({"fsdp": 2, "context": 4})
    sharded = jax.device_put(params, models.param_shardings(CFG, mesh))
    with jax.set_mesh(mesh):
        compiled = fn.lower(sharded, *parallel.shard_batch(batch, mesh)).compile()
        got = host(compiled(sharded, *parallel.shard_batch(batch, mesh)))
    # each device computes its share: a row (fsdp) and a quarter of its heads' attention
    # and positions (context), not the whole row
    assert compiled.cost_analysis()["flops"] < one_device / 6
    assert abs(float(got[0]) - float(want[0])) <= 1e-5 * abs(float(want[0]))
    for path, g, w in zip(
        jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(got[1]),
        jax.tree.leaves(want[1]), strict=True,
    ):  # fmt: skip
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=str(path[0]))


def test_heads_not_divisible_by_the_context_axis_are_refused():
    params = jax.eval_shape(lambda: models.init_params(CFG, seed=0))
    ids = jax.ShapeDtypeStruct((8, 32), jnp.int32)
    with jax.set_mesh(parallel.make_mesh({"context": 8})):
        with pytest.raises(ValueError, match=r"mesh.context=8: .* 4 query heads"):
            jax.eval_shape(lambda p, x: models.forward(CFG, p, x), params, ids)
