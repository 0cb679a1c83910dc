"""Context parallelism: one 4k-token sequence split over the mesh's `context` axis (4 of
the 8 fake CPU devices, composed with fsdp = 2 over the rows) gives the loss and the
gradients of the same computation on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import tiny_model_config

from jaxrl_llm import models, parallel, rl, sampling
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
        with pytest.raises(ValueError, match=r"mesh.context=8: .* 4 query heads .* by 8"):
            jax.eval_shape(lambda p, x: models.forward(CFG, p, x), params, ids)


def test_update_and_reference_split_sequences_on_a_context_mesh():
    """The jitted update and reference set the mesh around their trace: on fsdp = 2 x
    context = 4 their programs carry the split by positions (lowered, not compiled: the
    numbers are the forward's, tested above)."""
    n, t = 4, 28
    prompt, prompt_mask, tokens, mask = rows(n, seed=2)
    batch = rl.RolloutBatch(
        prompt_tokens=prompt, prompt_mask=prompt_mask, tokens=tokens[:, :t], mask=mask[:, :t],
        loss_mask=mask[:, :t], behaviour_logprobs=np.zeros((n, t), np.float32),
        rewards=np.zeros(n, np.float32), policy_version=np.zeros(n, np.int32),
        num_generations=2,
    )  # fmt: skip
    spec = sampling.RolloutSpec(num_generations=2, max_new_tokens=t)
    opt = rl.make_optimizer(learning_rate=0.1)
    mesh = parallel.make_mesh({"fsdp": 2, "context": 4})
    params = models.init_params(CFG, seed=0, mesh=mesh)
    batch = parallel.shard_batch(batch, mesh)
    update = rl.make_update_fn(CFG, rl.preset("grpo", beta=0.0), opt, spec, chunk_size=8)
    split = '{"fsdp"}, {"context"}, {}]'  # [rows over fsdp, positions over context, D]
    assert split in update.lower(rl.init_train_state(params, opt), batch).as_text()
    ref = rl.make_logprob_fn(CFG, spec, chunk_size=8, mesh=mesh)
    assert split in ref.lower(params, batch).as_text()
