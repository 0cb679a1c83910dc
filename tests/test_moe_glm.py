"""GLM-4.5 (`Glm4MoeForCausalLM`): DeepSeek-V3's sigmoid routing with the selection bias,
expert groups and shared experts, dense first layers, partial rotary, against
transformers and a plain implementation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_reference import hf_config, hf_logits, hf_model, padded_batch
from test_moe import assert_export_round_trip, max_diff, tie_sensitive
from test_sampler import PROMPTS, hf_greedy
from tiny_run import tiny_glm_config

from jaxrl_llm import models, parallel, sampling
from jaxrl_llm.models import moe
from jaxrl_llm.rl import batch as rl_batch


@pytest.fixture(scope="module")
def glm4_moe(tmp_path_factory):
    """(torch model, directory, cfg, params) of a tiny random Glm4MoeForCausalLM: layer 0
    dense, layers 1-2 MoE (8 experts in 4 groups, 2 groups kept, k = 2, a shared expert,
    random selection bias), q/k/v bias, q/k norm, half of each head rotated."""
    model = hf_model("glm4_moe", seed=3)
    d = tmp_path_factory.mktemp("glm4_moe")
    model.save_pretrained(d, max_shard_size="60KB")
    return (model, d, *models.load_hf(d))


def test_logits_equal_transformers(glm4_moe):
    """Padded batch (left, right, none)."""
    model, d, cfg, params = glm4_moe
    assert cfg.router == "sigmoid" and cfg.dense_layers == (0,) and cfg.rotary_dim == 8
    assert cfg.n_group == 4 and cfg.topk_group == 2 and cfg.n_shared_experts == 1
    ids, mask = padded_batch()
    ours = models.logits(cfg, params, ids, mask)
    assert max_diff(ours, hf_logits(model, ids, mask), mask) <= 1e-5


def test_sharded_logits_equal_transformers(glm4_moe):
    """Experts over `expert`, their hidden width and the heads over `tensor` (2 x 4)."""
    model, d, _, _ = glm4_moe
    mesh = parallel.make_mesh({"expert": 2, "tensor": 4})
    cfg, params = models.load_hf(d, mesh=mesh)
    spec = params["layers"]["expert_gate"].sharding.spec
    assert spec[1] == "expert" and spec[3] == "tensor", spec
    ids, mask = padded_batch(seed=2)
    out = models.logits(cfg, params, *parallel.shard_batch((ids, mask), mesh))
    assert max_diff(out, hf_logits(model, ids, mask), mask) <= 1e-5


def test_greedy_equals_hf_generate(glm4_moe):
    """With the per-layer cache (unrolled layers, each layer's MLP parameters picked from
    its kind's stack); the scanned cache runs in the replay test below. The dense layer
    records no experts."""
    model, _, cfg, params = glm4_moe
    unrolled = cfg.replace(scan_layers=False)
    out = sampling.generate(unrolled, params, PROMPTS, max_new_tokens=8, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.tokens), hf_greedy(model, PROMPTS, 8))
    routes, P = np.asarray(out.routes), out.prompt_tokens.shape[1]
    assert (routes[:, :, 0] == -1).all()
    assert (routes[:, :P][np.asarray(out.prompt_mask)][:, 1:] >= 0).all()


def test_export_reloads_in_transformers(glm4_moe, tmp_path):
    """save_hf writes the dense layer's MLP, the experts, the shared experts and the
    selection bias where transformers reads them; back in, the same params. The config
    built from fields (no HF config.json) says the same model."""
    model, _, cfg, params = glm4_moe
    assert_export_round_trip(model, cfg, params, tmp_path / "out", *padded_batch(seed=6))


def test_param_counts_equal_transformers(glm4_moe):
    """Parameters plus the selection bias (a buffer in transformers)."""
    model, _, cfg, params = glm4_moe
    total = sum(p.numel() for p in model.parameters())
    bias = sum(b.numel() for n, b in model.named_buffers() if "e_score_correction" in n)
    assert cfg.num_params() == models.count_params(params) == total + bias
    idle = cfg.num_experts - cfg.num_experts_per_tok
    idle *= cfg.num_sparse_layers * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert cfg.active_params() == total + bias - idle


def test_flops_count_the_active_matmuls(glm4_moe):
    """Model FLOPs of a GLM token: twice its matmul weights in transformers' model, the
    routed experts counted k of E; the dense first layers, the shared experts and the
    router included; norms, biases and the embeddings not (the unembedding apart)."""
    from jaxrl_llm.trainer import perf

    model, _, cfg, _ = glm4_moe
    matmuls = 0.0
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith("bias") or "embed" in name or "lm_head" in name:
            continue
        if "mlp.experts." in name:
            matmuls += p.numel() * cfg.num_experts_per_tok / cfg.num_experts
        elif ".layers." in name:
            matmuls += p.numel()
    assert cfg.dense_layers and cfg.n_shared_experts  # the test covers both
    assert perf.forward_flops(cfg, positions=1, context=0, unembedded=0) == 2 * matmuls


def test_mtp_layers_skipped_and_options_refused(glm4_moe, tmp_path):
    """GLM-4.5's checkpoints carry a multi-token-prediction layer after the decoder's:
    loading skips it. Another scoring function is refused naming the key."""
    model, d, cfg, params = glm4_moe
    assert cfg.mtp_layers == 1
    model.save_pretrained(tmp_path)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    _, loaded = models.load_hf(tmp_path)
    np.testing.assert_array_equal(loaded["layers"]["router_bias"], params["layers"]["router_bias"])
    base = model.config.to_dict()
    with pytest.raises(models.UnsupportedModelError, match="scoring_func"):
        models.ModelConfig.from_hf_dict(base | {"scoring_func": "softmax"})
    with pytest.raises(ValueError, match="n_group"):
        cfg.replace(n_group=3)


# ------------------------------------------------------------------------ routing replay


def test_replay_makes_trainer_logprobs_equal_behaviour():
    """Near-tied router (sigmoid scores nearly equal, selection bias zero): without replay
    the trainer's log-probs differ from the sampler's on some tokens, replaying the
    recorded experts (the dense layer's -1 entries skipped) makes them equal on every
    token."""
    cfg = tiny_glm_config(vocab_size=16, n_group=1, num_layers=2, initializer_range=0.1)
    params = tie_sensitive(cfg, models.init_params(cfg, seed=1))
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [11], [3, 1, 4, 1, 5]]
    out = sampling.generate(cfg, params, prompts, 8, num_samples=2, temperature=1.0, seed=1)
    assert (np.asarray(out.routes)[:, :, 0] == -1).all()
    rows = (out.prompt_tokens, out.prompt_mask, out.tokens, out.mask)
    sampled = np.asarray(out.loss_mask)
    kw = dict(num_generations=2, micro_batches=1, temperature=1.0, chunk_size=128)
    logprobs = jax.jit(functools.partial(rl_batch.batch_logprobs, cfg, **kw))
    gaps = {}
    none = jnp.full_like(out.routes, -1)  # no token recorded: each keeps its own top-k
    for name, routes in (("none", none), ("rollout", out.routes)):
        logp = logprobs(params, *rows, routes=routes)
        gaps[name] = np.abs(np.asarray(logp) - np.asarray(out.logprobs))[sampled]
    assert np.sum(gaps["none"] > 1e-2) >= 3, gaps["none"]
    assert gaps["rollout"].max() <= 1e-6, gaps["rollout"].max()


def plain_replayed_glm_moe(cfg, h, weights, routes):
    """The sigmoid-routed block with the experts given: w = sigmoid(h W_r) at them (h W_r
    in float32, as GLM-4.5 keeps its router), divided by their sum + 1e-20, times
    routed_scaling_factor (no bias, no groups: those only choose),
    y = sum_j w_j expert_{routes_j}(h) + shared(h)."""
    x, ids = h.reshape(-1, h.shape[-1]), routes.reshape(-1, routes.shape[-1])
    f32 = jnp.float32
    s = jax.nn.sigmoid(x.astype(f32) @ weights["router"].astype(f32))
    w = jnp.take_along_axis(s, ids, axis=1)
    w = w / (jnp.sum(w, axis=1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
    y = jax.nn.silu(x @ weights["shared_gate"]) * (x @ weights["shared_up"])
    y = y @ weights["shared_down"]
    for j in range(ids.shape[1]):
        gate, up, down = (weights[n][ids[:, j]] for n in ("gate", "up", "down"))
        act = jax.nn.silu(jnp.einsum("nd,ndf->nf", x, gate)) * jnp.einsum("nd,ndf->nf", x, up)
        y = y + w[:, j, None] * jnp.einsum("nf,nfd->nd", act, down)
    return y.reshape(h.shape)


def test_replayed_gates_differentiate_the_router():
    """Replayed experts (ones the router would not pick): output and gradients w.r.t.
    the router, the input, the experts and the shared expert equal the plain block's
    (in float64 but the float32 router, where two orders of the same sums agree to
    ~1e-12 on any CPU); the selection bias gets no gradient."""
    with jax.enable_x64(True):
        _replayed_gates_differentiate_the_router()


def _replayed_gates_differentiate_the_router():
    cfg = tiny_glm_config(moe_impl="dense")  # the expert paths are tested in test_moe.py
    D, E, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    keys = jax.random.split(jax.random.key(4), 9)
    h = jax.random.normal(keys[0], (2, 3, D), jnp.float64)
    weights = {
        "router": jax.random.normal(keys[1], (D, E), jnp.float64) / 4,
        "router_bias": jax.random.normal(keys[8], (E,), jnp.float64),
        "gate": jax.random.normal(keys[2], (E, D, F), jnp.float64) / 4,
        "up": jax.random.normal(keys[3], (E, D, F), jnp.float64) / 4,
        "down": jax.random.normal(keys[4], (E, F, D), jnp.float64) / 4,
        "shared_gate": jax.random.normal(keys[5], (D, F), jnp.float64) / 4,
        "shared_up": jax.random.normal(keys[6], (D, F), jnp.float64) / 4,
        "shared_down": jax.random.normal(keys[7], (F, D), jnp.float64) / 4,
    }
    _, own = moe.moe_mlp(cfg, h, weights)
    routes = (own[..., ::-1] + 3) % E  # other experts, in another order

    def loss(f):
        fn = lambda h, w: jnp.sum(jnp.sin(f(h, w)))  # noqa: E731
        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(h, weights)

    value, grads = loss(lambda h, w: moe.moe_mlp(cfg, h, w, routes)[0])
    value_ref, grads_ref = loss(lambda h, w: plain_replayed_glm_moe(cfg, h, w, routes))
    assert value.dtype == jnp.float64
    np.testing.assert_allclose(value, value_ref, rtol=1e-9)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-9)
    assert float(jnp.abs(grads[1]["router"]).max()) > 1e-3
    assert float(jnp.abs(grads[1]["router_bias"]).max()) == 0.0


def test_own_choice_equals_transformers_router():
    """The group-limited biased top-k and its gates against transformers'
    Glm4MoeTopkRouter (200 tokens, 16 experts in 4 groups, 2 kept, k = 3); both the
    group limit and the bias decide some tokens' experts (without either the choice
    differs), so the comparison sees them."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config = hf_config("glm4_moe", n_routed_experts=16, num_experts_per_tok=3, topk_group=2)
    router = Glm4MoeTopkRouter(config)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn_like(router.weight) / 8)
        router.e_score_correction_bias.copy_(0.3 * torch.randn(16))
    x = np.random.RandomState(0).randn(200, 64).astype(np.float32)
    _, w_hf, ids_hf = router(torch.tensor(x))
    cfg = models.ModelConfig.from_hf_dict(config.to_dict())
    scores = moe.router_scores(cfg, jnp.asarray(x), jnp.asarray(router.weight.detach().T))
    bias = jnp.asarray(router.e_score_correction_bias.numpy())
    ids, w, own = moe.select(cfg, scores, None, bias)
    order_hf, order = np.argsort(ids_hf.numpy(), -1), np.argsort(np.asarray(ids), -1)
    ids_hf, w_hf = (np.take_along_axis(a.detach().numpy(), order_hf, -1) for a in (ids_hf, w_hf))
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, -1), ids_hf)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, -1), w_hf, atol=1e-6)
    for other, b in ((cfg.replace(n_group=1, topk_group=1), bias), (cfg, 0 * bias)):
        mine = np.sort(np.asarray(moe.own_choice(other, scores, b)), -1)
        assert (mine != np.sort(np.asarray(own), -1)).any(-1).sum() >= 10
