"""Mixture-of-experts decoder (Qwen3-MoE) against Hugging Face and a per-expert loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import hf_logits, hf_model, padded_batch
from test_sampler import PROMPTS, hf_greedy

from jaxrl_llm import models, parallel, sampling
from jaxrl_llm.models import moe


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """(torch model, directory, cfg, params) of a tiny random Qwen3MoeForCausalLM."""
    model = hf_model("qwen3_moe", seed=3)
    d = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(d, max_shard_size="60KB")
    return (model, d, *models.load_hf(d))


def max_diff(a, b, mask):
    return float(np.abs(np.asarray(a) - np.asarray(b))[np.asarray(mask, bool)].max())


def loop_experts(x, ids, weights, gate, up, down):
    """sum_j w[n, j] * expert_{ids[n, j]}(x[n]): one expert at a time, a Python loop."""
    out = jnp.zeros_like(x)
    for e in range(gate.shape[0]):
        w = jnp.sum(jnp.where(ids == e, weights, 0.0), axis=-1)  # [N]
        y = (jax.nn.silu(x @ gate[e]) * (x @ up[e])) @ down[e]
        out = out + w[:, None] * y
    return out


@pytest.mark.parametrize("impl", ["ragged", "dense"])
def test_experts_values_and_gradients_equal_per_expert_loop(impl):
    """The grouped matmul (and the all-experts path) against a per-expert loop: outputs and
    gradients w.r.t. input, gating weights and every expert weight (one expert unused)."""
    keys = jax.random.split(jax.random.key(0), 6)
    N, D, F, E, k = 13, 8, 6, 5, 2
    x = jax.random.normal(keys[0], (N, D))
    ids = jax.random.randint(keys[1], (N, k), 0, E - 1)  # expert E-1 gets no token
    ids = ids.at[:, 1].set((ids[:, 0] + 1 + ids[:, 1] % (E - 2)) % (E - 1))  # k distinct
    weights = jax.nn.softmax(jax.random.normal(keys[2], (N, k)))
    gate, up = (jax.random.normal(kk, (E, D, F)) / 3 for kk in keys[3:5])
    down = jax.random.normal(keys[5], (E, F, D)) / 3
    args = (x, weights, gate, up, down)

    def loss(f):
        def fn(x, w, g, u, d):
            y = f(x, ids, w, g, u, d)
            return jnp.sum(y * jnp.cos(y)), y

        return jax.value_and_grad(fn, argnums=(0, 1, 2, 3, 4), has_aux=True)(*args)

    (_, y), grads = loss(moe.EXPERT_IMPLS[impl])
    (_, y_ref), grads_ref = loss(loop_experts)
    np.testing.assert_allclose(y, y_ref, atol=1e-5)
    for g, r in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5)
    assert float(jnp.abs(grads[2][E - 1]).max()) == 0.0


@pytest.mark.parametrize("impl", ["ragged", "dense"])
def test_logits_equal_transformers(qwen3_moe, impl):
    """Padded batch (left, right, none), checkpoint split over several files."""
    model, d, cfg, params = qwen3_moe
    assert (d / "model.safetensors.index.json").exists()
    assert cfg.moe and cfg.num_experts == 8 and cfg.norm_topk_prob
    ids, mask = padded_batch()
    ours = models.logits(cfg.replace(moe_impl=impl), params, ids, mask)
    assert max_diff(ours, hf_logits(model, ids, mask), mask) <= 1e-5


def test_sharded_logits_equal_transformers(qwen3_moe):
    """Experts' hidden width over `tensor`, their input over `fsdp`, batch over both."""
    model, d, _, _ = qwen3_moe
    mesh = parallel.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
    cfg, params = models.load_hf(d, mesh=mesh)
    spec = params["layers"]["expert_gate"].sharding.spec
    assert spec[2:] == ("fsdp", "tensor"), spec
    ids, mask = padded_batch(seed=2)
    out = models.logits(cfg, params, *parallel.shard_batch((ids, mask), mesh))
    assert max_diff(out, hf_logits(model, ids, mask), mask) <= 1e-5


def test_greedy_equals_hf_generate(qwen3_moe):
    model, _, cfg, params = qwen3_moe
    out = sampling.generate(cfg, params, PROMPTS, max_new_tokens=10, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.tokens), hf_greedy(model, PROMPTS, 10))


def test_export_reloads_in_transformers(qwen3_moe, tmp_path):
    """save_hf writes the per-expert tensors transformers reads; back in, the same params."""
    model, _, cfg, params = qwen3_moe
    models.save_hf(cfg, params, tmp_path / "out", max_shard_bytes=60_000)
    reloaded = type(model).from_pretrained(tmp_path / "out").eval()
    ids, mask = padded_batch(seed=6)
    assert max_diff(hf_logits(reloaded, ids, mask), hf_logits(model, ids, mask), mask) <= 1e-5
    cfg2, params2 = models.load_hf(tmp_path / "out")
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        np.testing.assert_array_equal(a, b)


def test_param_counts_equal_transformers(qwen3_moe):
    model, _, cfg, params = qwen3_moe
    total = sum(p.numel() for p in model.parameters())
    assert cfg.num_params() == models.count_params(params) == total
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    idle = cfg.num_experts - cfg.num_experts_per_tok
    assert cfg.active_params() == total - cfg.num_layers * idle * per_expert


def test_refused_options_name_the_key():
    base = hf_model("qwen3_moe").config.to_dict()
    for key, value in [("decoder_sparse_step", 2), ("mlp_only_layers", [0])]:
        with pytest.raises(models.UnsupportedModelError, match=key):
            models.ModelConfig.from_hf_dict(base | {key: value})
    cfg = models.ModelConfig.from_hf_dict(base)
    with pytest.raises(ValueError, match="lora targets"):
        cfg.replace(lora=models.LoraConfig(rank=2))
    cfg.replace(lora=models.LoraConfig(rank=2, targets=("q", "v")))
