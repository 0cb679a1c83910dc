"""Gemma 4's MoE block (`enable_moe_block`, the 26B-A4B model's layers): the router (its
unweighted norm, input scale and scale per expert), the GeGLU experts beside the dense
MLP and the branches' norms against transformers; export, parameter counts and FLOPs;
routing replay in the samplers and the trainer."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_reference import hf_config, hf_logits, hf_model, padded_batch
from test_moe import assert_export_round_trip, max_diff, replay_gaps, tie_sensitive
from test_sampler import PROMPTS, hf_greedy
from tiny_run import tiny_gemma4_config

from jaxrl_llm import models, parallel, sampling
from jaxrl_llm.models import moe
from jaxrl_llm.trainer import perf

# 8 experts of width 32, each token through 2; the full layers as the 26B-A4B's: heads
# twice the sliding layers' size, one KV head, keys as values.
MOE = {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 32}
FULL = {"global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True}
# the same block in ModelConfig's fields
MOE_FIELDS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, router="gemma4")


def moe_model(dtype=torch.float32):
    """A tiny random Gemma4ForCausalLM with the MoE block (`hf_model`'s random tensors),
    its router's input scale lifted to about sqrt(hidden) (x 8, random per dimension) so
    the router's logits are O(1), not near-ties that rounding would decide. The experts
    run as transformers' per-expert loop ("eager"; its grouped matmul has no float64)."""
    model = hf_model("gemma4", seed=1, **MOE, **FULL).to(dtype)
    model.config._experts_implementation = "eager"
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            s = layer.router.scale
            s.copy_(8.0 * (1 + 0.3 * torch.randn(s.shape, generator=g, dtype=s.dtype)))
    return model


@pytest.fixture(scope="module")
def gemma4_moe(tmp_path_factory):
    """(torch model, directory, cfg, params), saved over several files."""
    model = moe_model()
    d = tmp_path_factory.mktemp("gemma4_moe")
    model.save_pretrained(d, max_shard_size="60KB")
    return (model, d, *models.load_hf(d))


def test_logits_equal_transformers(gemma4_moe):
    """Padded rows of 20 tokens, past the window. Against transformers in float64 within
    1e-5 (or twice its own float32 error, as `test_gemma4`), against its float32 logits
    within 2e-5 (or three times that error). With either branch's output norm or the
    scales per expert changed the logits differ (each is exercised)."""
    model, _, cfg, params = gemma4_moe
    assert cfg.router == "gemma4" and cfg.split_attention and cfg.num_sparse_layers == 4
    ids, mask = padded_batch(seed=20, length=20)
    exact = hf_logits(moe_model(torch.float64), ids, mask)
    ref = hf_logits(model, ids, mask)
    own_error = max_diff(ref, exact, mask)
    ours = models.logits(cfg, params, ids, mask)
    assert max_diff(ours, exact, mask) <= max(1e-5, 2 * own_error)
    assert max_diff(ours, ref, mask) <= max(2e-5, 3 * own_error)
    layers = params["layers"]
    for name in ("dense_post_norm", "expert_post_norm", "expert_scale"):
        changed = dict(params, layers=dict(layers, **{name: 0 * layers[name] + 1e-3}))
        assert max_diff(models.logits(cfg, changed, ids, mask), exact, mask) > 1e-3


def test_router_and_replayed_block_equal_transformers():
    """`Gemma4TextRouter`: the same experts and weights. A layer's MLP with replayed
    experts (ones the router would not pick): transformers' dense MLP and experts given
    those experts with the current router's renormalised, scaled probabilities there."""
    torch.manual_seed(0)
    model = moe_model()
    layer, config = model.model.layers[0], model.config
    x = torch.randn(30, 64)
    _, w_hf, ids_hf = layer.router(x)
    cfg = models.ModelConfig.from_hf_dict(config.to_dict())
    W = {
        "router": layer.router.proj.weight.T,
        "router_norm": layer.router.scale,
        "expert_scale": layer.router.per_expert_scale,
        "gate": layer.experts.gate_up_proj[:, :32].transpose(1, 2),
        "up": layer.experts.gate_up_proj[:, 32:].transpose(1, 2),
        "down": layer.experts.down_proj.transpose(1, 2),
        "shared_gate": layer.mlp.gate_proj.weight.T,
        "shared_up": layer.mlp.up_proj.weight.T,
        "shared_down": layer.mlp.down_proj.weight.T,
        "dense_post_norm": layer.post_feedforward_layernorm_1.weight,
        "expert_norm": layer.pre_feedforward_layernorm_2.weight,
        "expert_post_norm": layer.post_feedforward_layernorm_2.weight,
    }
    W = {k: jnp.asarray(v.detach().numpy()) for k, v in W.items()}
    xj = jnp.asarray(x.numpy())
    scores = moe.router_scores(cfg, xj, W["router"], scale=W["router_norm"])
    ids, w, _ = moe.select(cfg, scores, None, expert_scale=W["expert_scale"])
    np.testing.assert_array_equal(np.asarray(ids), ids_hf.numpy())
    np.testing.assert_allclose(np.asarray(w), w_hf.detach().numpy(), atol=1e-6)

    routes = (ids_hf.flip(-1) + 3) % 8  # other experts, in another order
    probs, _, _ = layer.router(x)
    p = probs.gather(1, routes)
    weights = p / p.sum(-1, keepdim=True) * layer.router.per_expert_scale[routes]
    with torch.no_grad():
        h = layer.pre_feedforward_layernorm(x)
        dense = layer.post_feedforward_layernorm_1(layer.mlp(h))
        routed = layer.experts(layer.pre_feedforward_layernorm_2(x), routes, weights)
        expected = dense + layer.post_feedforward_layernorm_2(routed)
    hj = jnp.asarray(h.numpy())[None]
    y, own = moe.moe_mlp(cfg, hj, W, jnp.asarray(routes.numpy())[None], xj[None])
    np.testing.assert_allclose(np.asarray(y[0]), expected.numpy(), atol=2e-5)
    np.testing.assert_array_equal(np.asarray(own[0]), ids_hf.numpy())


def test_sharded_logits_equal_transformers(gemma4_moe):
    """On the 2 x 4 mesh: the experts over `expert`, heads and widths over `tensor`."""
    model, d, _, _ = gemma4_moe
    mesh = parallel.make_mesh({"expert": 2, "tensor": 4})
    cfg, params = models.load_hf(d, mesh=mesh)
    assert params["layers"]["expert_gate"].sharding.spec[1:] == ("expert", None, "tensor")
    ids, mask = padded_batch(seed=2, length=16)
    out = models.logits(cfg, params, *parallel.shard_batch((ids, mask), mesh))
    assert max_diff(out, hf_logits(model, ids, mask), mask) <= 2e-5


def test_greedy_equals_hf_generate(gemma4_moe):
    """12 new tokens past the window; every prompt token has its experts recorded."""
    model, _, cfg, params = gemma4_moe
    out = sampling.generate(cfg, params, PROMPTS, max_new_tokens=12, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.tokens), hf_greedy(model, PROMPTS, 12))
    P = out.prompt_tokens.shape[1]
    assert (np.asarray(out.routes)[:, :P][np.asarray(out.prompt_mask)] >= 0).all()


def test_export_reloads_in_transformers(gemma4_moe, tmp_path):
    """save_hf stacks gate and up back into `gate_up_proj` (over several files):
    transformers reloads the same logits, load_hf the same params and config."""
    model, _, cfg, params = gemma4_moe
    assert_export_round_trip(model, cfg, params, tmp_path / "out", *padded_batch(seed=6, length=16))


def test_param_counts_and_flops_equal_transformers(gemma4_moe):
    """Every weight and the layer scalars; the active ones (k of the E experts); a
    token's model FLOPs: the matmul weights it goes through (the router, the dense MLP,
    k experts), and the heads over the keys."""
    model, _, cfg, params = gemma4_moe
    total = sum(p.numel() for p in model.parameters()) + cfg.num_layers
    assert cfg.num_params() == models.count_params(params) == total
    share = cfg.num_experts_per_tok / cfg.num_experts
    named = dict(model.named_parameters())
    experts = sum(p.numel() for n, p in named.items() if ".experts." in n)
    assert cfg.active_params() == total - experts * (1 - share)
    matmuls = sum(
        p.numel() * (share if ".experts." in n else 1)
        for n, p in named.items()
        if ".layers." in n and n.endswith(("weight", "_proj")) and "norm" not in n
    )
    assert perf.forward_flops(cfg, positions=1, context=0, unembedded=0) == 2 * matmuls
    heads = sum(m.self_attn.head_dim for m in model.model.layers) * cfg.num_heads
    assert perf.forward_flops(cfg, 1, 1, 0) - 2 * matmuls == 4 * heads


def test_refused_and_checked():
    """An MoE block without experts is refused naming the key; the "gemma4" router is
    Gemma 4's own, its experts in every layer and no shared ones."""
    base = hf_config("gemma4", **MOE).to_dict()
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        with pytest.raises(models.UnsupportedModelError, match=key):
            models.ModelConfig.from_hf_dict(base | {key: None})
    with pytest.raises(ValueError, match="gemma4"):
        tiny_gemma4_config(**(MOE_FIELDS | {"router": "softmax"}))
    for change in ({"dense_layers": (0,)}, {"n_shared_experts": 1}):
        with pytest.raises(ValueError, match="dense_layers / n_shared_experts"):
            tiny_gemma4_config(**MOE_FIELDS, **change)


# ------------------------------------------------------------------ routing replay
def test_replay_makes_trainer_logprobs_equal_behaviour():
    """Near-tied router: without replay the trainer's log-probs (its teacher-forced
    forward, `rl.batch_logprobs`) differ from the sampler's behaviour log-probs on some
    tokens (by more than 0.01); replaying the recorded experts makes them equal on every
    token up to float32 rounding (measured 2.4e-6 at most, most tokens 2-7e-7)."""
    cfg = tiny_gemma4_config(vocab_size=16, **MOE_FIELDS)
    params = tie_sensitive(cfg, models.init_params(cfg, seed=1))
    gaps = replay_gaps(cfg, params)
    assert np.sum(gaps[2, "none"] > 1e-2) >= 3, gaps[2, "none"]
    assert gaps[2, "rollout"].max() <= 5e-6, gaps[2, "rollout"].max()


@pytest.mark.slow
def test_grpo_two_steps_with_routing_replay(tmp_path):
    """A tiny Gemma 4 MoE (2 layers, sliding then full) built from fields, saved by
    `save_hf` (transformers reads it as the same model), through the trainer: beta > 0,
    the update replays the sampler's routes."""
    two = dict(num_layers=2, layer_types=("sliding_attention", "full_attention"))
    cfg = tiny_gemma4_config(vocab_size=33, tie_word_embeddings=True, **two, **MOE_FIELDS)
    last = grpo_two_steps(cfg, tmp_path, routing_replay="rollout")
    assert last["moe/router_agreement"] > 0.5


def grpo_two_steps(cfg, tmp_path, **algo) -> dict:
    """cfg's random params saved by `save_hf` with the arithmetic tokenizer (transformers
    reads them as the same model: logits within 2e-5), then 2 GRPO steps of `tiny_config`
    (beta > 0, `algo` overrides) through the trainer -> the last step's metrics, finite."""
    from tiny_run import TOKENIZER, tiny_config

    from jaxrl_llm import train

    params = models.init_params(cfg, seed=0)
    models.save_hf(cfg, params, tmp_path / "m", tokenizer_dir=TOKENIZER)
    model = transformers.Gemma4ForCausalLM.from_pretrained(tmp_path / "m").eval()
    ids, mask = padded_batch(seed=4, length=12)
    ids = ids % cfg.vocab_size
    assert (
        max_diff(models.logits(cfg, params, ids, mask), hf_logits(model, ids, mask), mask) <= 2e-5
    )
    last = train.train(tiny_config(str(tmp_path / "m"), beta=0.04, **algo), str(tmp_path / "run"))
    assert np.isfinite(last["loss/total"]) and last["optim/nonfinite"] == 0.0
    assert np.isfinite(last["loss/kl"])
    return last
