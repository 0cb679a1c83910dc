"""Context parallelism: one 4k-token sequence split over the mesh's `context` axis (4 of
the 8 fake CPU devices, composed with fsdp = 2 over the rows) gives the loss and the
gradients of the same computation on one device."""

import dataclasses

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


def loss(params, prompt, prompt_mask, tokens, mask, cfg=CFG):
    """A weighted sum of the teacher-forced log-probs and entropies (the update's forward)."""
    logp, ent = B.sequence_logprobs(cfg, params, prompt, prompt_mask, tokens, mask, chunk_size=512)
    return jnp.sum(logp * jnp.linspace(0.0, 1.0, T)) + 0.1 * jnp.sum(ent)


def host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.mark.parametrize(
    "implementation", [pytest.param("xla", marks=pytest.mark.slow), "blockwise"]
)
def test_context_parallel_equals_one_device(implementation):
    """Both attention paths: the full score matrix and the blockwise loops (the FLOPs
    XLA reports count a loop's body once, so there the unrolled log-prob chunks and the
    layer's matmuls weigh most)."""
    cfg = dataclasses.replace(CFG, attention=implementation)
    params = models.init_params(cfg, seed=0)
    batch = rows()
    fn = jax.jit(jax.value_and_grad(lambda *args: loss(*args, cfg=cfg)))
    want = host(fn(params, *batch))
    one_device = fn.lower(params, *batch).compile().cost_analysis()["flops"]
    mesh = parallel.make_mesh({"fsdp": 2, "context": 4})
    sharded = jax.device_put(params, models.param_shardings(cfg, mesh))
    with jax.set_mesh(mesh):
        compiled = fn.lower(sharded, *parallel.shard_batch(batch, mesh)).compile()
        got = host(compiled(sharded, *parallel.shard_batch(batch, mesh)))
    # each device computes its share: a row (fsdp) and a quarter of its heads' attention
    # and positions (context), not the whole row
    assert compiled.cost_analysis()["flops"] < one_device / 6
    # q / k / v and the output move between the splits by all-to-all (Ulysses), not by
    # gathering whole tensors onto every device
    assert " all-to-all(" in compiled.as_text()
    assert abs(float(got[0]) - float(want[0])) <= 1e-5 * abs(float(want[0]))
    for path, g, w in zip(
        jax.tree_util.tree_leaves_with_path(got[1]),
        jax.tree.leaves(got[1]),
        jax.tree.leaves(want[1]),
        strict=True,
    ):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=str(path[0]))


@pytest.mark.parametrize("heads", [(6, 3), (8, 2)])
def test_key_value_heads_the_axis_does_not_divide(heads):
    """Query heads split over context = 2 (times tensor = 2 for 8 heads) with key / value
    heads that the split does not divide: each device takes the kv heads its query heads
    read (the one kv head of 8 / 2 heads on 4 devices, one per query head for 6 / 3 heads
    on 2), and the forward equals one device's."""
    n, k = heads
    cfg = tiny_model_config(
        num_layers=1,
        num_heads=n,
        num_kv_heads=k,
        head_dim=4,
        attention="blockwise",
        attention_block=8,
    )
    params = models.init_params(cfg, seed=1)
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(1, 64, (2, 24)), jnp.int32)
    fn = jax.jit(lambda p, x: models.forward(cfg, p, x))
    want = np.asarray(fn(params, ids))
    tensor = 2 if n == 8 else 1
    mesh = parallel.make_mesh({"context": 2, "tensor": tensor}, jax.devices()[: 2 * tensor])
    with jax.set_mesh(mesh):
        got = np.asarray(fn(jax.device_put(params, models.param_shardings(cfg, mesh)), ids))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


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
        prompt_tokens=prompt,
        prompt_mask=prompt_mask,
        tokens=tokens[:, :t],
        mask=mask[:, :t],
        loss_mask=mask[:, :t],
        behaviour_logprobs=np.zeros((n, t), np.float32),
        rewards=np.zeros(n, np.float32),
        policy_version=np.zeros(n, np.int32),
        num_generations=2,
    )
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
