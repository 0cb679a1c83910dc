"""GPT-OSS (`GptOssForCausalLM`): attention sinks, sliding / full layers, YaRN, the biased
top-k softmax router and the experts' biases and clamped SwiGLU, against transformers and
plain implementations."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import hf_logits, hf_model, padded_batch
from test_moe import assert_export_round_trip, max_diff, replay_gaps, tie_sensitive
from test_sampler import PROMPTS, hf_greedy
from tiny_run import TOKENIZER, tiny_config, tiny_gpt_oss_config

from jaxrl_llm import models, parallel, sampling, train
from jaxrl_llm.models import attention as attn
from jaxrl_llm.models import moe, moe_kernels
from jaxrl_llm.trainer.metrics import read_metrics


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(torch model, directory, cfg, params) of a tiny random GptOssForCausalLM: layer 0
    sliding (window 4), layer 1 full, 8 experts (k = 2) with random biases, random sinks."""
    model = hf_model("gpt_oss", seed=3)
    d = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(d, max_shard_size="60KB")
    return (model, d, *models.load_hf(d))


@pytest.mark.parametrize("length", [12, 20])
def test_logits_equal_transformers(gpt_oss, length):
    """Padded rows (left, right, none) past the window; without the window, the sinks or
    the clamp the logits differ (each is exercised)."""
    model, _, cfg, params = gpt_oss
    assert cfg.router == "topk_softmax" and cfg.attention_sinks and cfg.expert_bias
    ids, mask = padded_batch(length=length)
    ref = hf_logits(model, ids, mask)
    assert max_diff(models.logits(cfg, params, ids, mask), ref, mask) <= 1e-5
    if length == 20:
        layers = dict(params["layers"], sinks=-1e4 + 0 * params["layers"]["sinks"])
        for other, p in (
            (cfg.replace(layer_types=None), params),
            (cfg.replace(swiglu_limit=100.0), params),
            (cfg, dict(params, layers=layers)),
        ):
            assert max_diff(models.logits(other, p, ids, mask), ref, mask) > 1e-3


def test_sharded_logits_equal_transformers(gpt_oss):
    """Experts over `expert`, their width, the heads and the sinks over `tensor` (2 x 4)."""
    model, d, _, _ = gpt_oss
    mesh = parallel.make_mesh({"expert": 2, "tensor": 4})
    cfg, params = models.load_hf(d, mesh=mesh)
    assert params["layers"]["expert_gate_bias"].sharding.spec[1:] == ("expert", "tensor")
    assert params["layers"]["sinks"].sharding.spec[1] == "tensor"
    ids, mask = padded_batch(seed=2, length=16)
    out = models.logits(cfg, params, *parallel.shard_batch((ids, mask), mesh))
    assert max_diff(out, hf_logits(model, ids, mask), mask) <= 1e-5


def test_greedy_equals_hf_generate(gpt_oss):
    """12 new tokens after prompts of up to 12 (past the window), scanned layers' cache;
    every token read has its experts recorded."""
    model, _, cfg, params = gpt_oss
    out = sampling.generate(cfg, params, PROMPTS, max_new_tokens=12, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.tokens), hf_greedy(model, PROMPTS, 12))
    P = out.prompt_tokens.shape[1]
    assert (np.asarray(out.routes)[:, :P][np.asarray(out.prompt_mask)] >= 0).all()


def test_export_reloads_in_transformers(gpt_oss, tmp_path):
    """save_hf interleaves gate and up back into `gate_up_proj` (and their biases), split
    over several files; transformers reloads the same logits, and back in the same
    params. The config built from fields says the same model."""
    model, _, cfg, params = gpt_oss
    assert_export_round_trip(model, cfg, params, tmp_path / "out", *padded_batch(seed=6, length=16))


def test_param_counts_and_flops_equal_transformers(gpt_oss):
    """Parameter counts (all, and those a token reads: k of E experts with their biases);
    model FLOPs of a token are twice its matmul weights in transformers' model (experts
    counted k of E; router included; norms, biases, sinks and embeddings not)."""
    from jaxrl_llm.trainer import perf

    model, _, cfg, params = gpt_oss
    total = sum(p.numel() for p in model.parameters())
    assert cfg.num_params() == models.count_params(params) == total
    idle, matmuls = 0.0, 0.0
    for name, p in model.named_parameters():
        if "mlp.experts." in name:
            idle += p.numel() * (1 - cfg.num_experts_per_tok / cfg.num_experts)
        skip = ("norm", "bias", "sinks", "embed", "lm_head")
        if ".layers." in name and not any(s in name for s in skip):
            share = cfg.num_experts_per_tok / cfg.num_experts if "experts" in name else 1
            matmuls += p.numel() * share
    assert cfg.active_params() == total - idle
    assert perf.forward_flops(cfg, positions=1, context=0, unembedded=0) == 2 * matmuls


def test_refused_options_name_the_key(gpt_oss):
    model, _, cfg, _ = gpt_oss
    base = model.config.to_dict()
    mxfp4 = {"quant_method": "mxfp4"}
    with pytest.raises(models.UnsupportedModelError, match="quantization_config"):
        models.ModelConfig.from_hf_dict(base | {"quantization_config": mxfp4})
    for kernel in ("cudnn", "pallas"):
        with pytest.raises(models.UnsupportedModelError, match="model.attention"):
            cfg.replace(attention=kernel)


# ------------------------------------------------------------------------ attention sinks
def plain_sink_attention(q, k, v, mask, sinks):
    """Softmax over [scores, sink] per query head, the sink's column dropped (HF's eager
    GPT-OSS attention). q [B,T,N,H], k/v [B,S,K,H], mask [B,T,S]."""
    G = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(mask[:, None], s, -1e30)
    sink = jnp.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))
    p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bnts,bsnh->btnh", p, v)


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_sink_attention_values_and_gradients_equal_plain(impl):
    """Padded rows and a window; values and gradients w.r.t. q, k, v and the sinks (the
    blockwise path in blocks of 4, so several key blocks and a skipped one); the cached
    (decode) path's values too."""
    keys = jax.random.split(jax.random.key(0), 4)
    B, T, N, K, H = 2, 10, 4, 2, 8
    q = jax.random.normal(keys[0], (B, T, N, H))
    k, v = (jax.random.normal(kk, (B, T, K, H)) for kk in keys[1:3])
    sinks = jax.random.normal(keys[3], (N,)) * 2
    valid = jnp.ones((B, T), bool).at[1, :3].set(False)
    positions = jnp.maximum(jnp.cumsum(valid, 1) - 1, 0)
    mask = attn.causal_mask(valid, positions).replace(window=jnp.int32(5))

    def loss(f):
        fn = lambda *a: jnp.sum(jnp.sin(f(*a)) * valid[:, :, None, None])  # noqa: E731
        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2, 3)))(q, k, v, sinks)

    ours = loss(lambda *a: attn.attention(*a[:3], mask, impl, 4, sinks=a[3]))
    ref = loss(lambda *a: plain_sink_attention(*a[:3], mask.dense(), a[3]))
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-5)
    for g, r in zip(ours[1], ref[1], strict=True):
        np.testing.assert_allclose(g, r, atol=2e-5)
    assert float(jnp.abs(ours[1][3]).min()) > 1e-4
    cached = attn.cached_attention(
        q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), mask.dense(), sinks
    )
    np.testing.assert_allclose(
        cached, plain_sink_attention(q, k, v, mask.dense(), sinks), atol=1e-5
    )


# ------------------------------------------------------------------------ experts
def loop_biased_experts(x, ids, weights, gate, up, down, glu, biases):
    """sum_j w[n, j] * (down_e glu(gate_e x + b^g_e, up_e x + b^u_e) + b^d_e), e = ids[n, j]:
    one expert at a time."""
    bg, bu, bd = biases
    out = jnp.zeros_like(x)
    for e in range(gate.shape[0]):
        w = jnp.sum(jnp.where(ids == e, weights, 0.0), axis=-1)
        y = glu(x @ gate[e] + bg[e], x @ up[e] + bu[e]) @ down[e] + bd[e]
        out = out + w[:, None] * y
    return out


@pytest.mark.parametrize("impl", ["ragged", "blocked", "dense", "gmm"])
def test_biased_clamped_experts_equal_per_expert_loop(impl):
    """Every expert path with biases and the clamped SwiGLU (limit 0.8: both clamps act):
    values and gradients w.r.t. the input, the gates, the weights and the biases (one
    expert unused: zero gradients)."""
    keys = jax.random.split(jax.random.key(1), 9)
    N, D, F, E, k = 13, 8, 6, 5, 2
    x = jax.random.normal(keys[0], (N, D))
    ids = jax.random.randint(keys[1], (N, k), 0, E - 1)
    ids = ids.at[:, 1].set((ids[:, 0] + 1 + ids[:, 1] % (E - 2)) % (E - 1))
    w = jax.nn.softmax(jax.random.normal(keys[2], (N, k)))
    gate, up = (jax.random.normal(kk, (E, D, F)) / 2 for kk in keys[3:5])
    down = jax.random.normal(keys[5], (E, F, D)) / 3
    biases = (
        jax.random.normal(keys[6], (E, F)),
        jax.random.normal(keys[7], (E, F)),
        jax.random.normal(keys[8], (E, D)),
    )
    glu = moe.clamped_glu(0.8, 1.702)
    assert float(jnp.mean(x @ gate[0] + biases[0][0] > 0.8)) > 0.1

    f = {"gmm": functools.partial(moe_kernels.gmm_experts, interpret=True)}.get(impl)
    f = f or moe.EXPERT_IMPLS[impl]
    if impl == "blocked":
        f = functools.partial(f, block=4)

    def loss(fn):
        def value(x, w, g, u, d, b):
            return jnp.sum(jnp.sin(fn(x, ids, w, g, u, d, glu, b)))

        return jax.jit(jax.value_and_grad(value, argnums=tuple(range(6))))(
            x, w, gate, up, down, biases
        )

    ours, ref = loss(f), loss(loop_biased_experts)
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-5)
    for g, r in zip(jax.tree.leaves(ours[1]), jax.tree.leaves(ref[1]), strict=True):
        np.testing.assert_allclose(g, r, atol=2e-5)
    assert float(jnp.abs(ours[1][5][0][E - 1]).max()) == 0.0


def test_router_equals_transformers():
    """Top-k of the biased logits, softmax over the k, against GptOssTopKRouter."""
    import torch
    from hf_reference import hf_config
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    config = hf_config("gpt_oss", num_experts_per_tok=3)
    router = GptOssTopKRouter(config)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn_like(router.weight) / 8)
        router.bias.copy_(0.5 * torch.randn_like(router.bias))
    x = np.random.RandomState(0).randn(100, 64).astype(np.float32)
    _, w_hf, ids_hf = router(torch.tensor(x))
    cfg = models.ModelConfig.from_hf_dict(config.to_dict())
    W, b = (jnp.asarray(t.detach().numpy()) for t in (router.weight.T, router.bias))
    ids, w, _ = moe.select(cfg, moe.router_scores(cfg, jnp.asarray(x), W, b), None)
    np.testing.assert_array_equal(np.asarray(ids), ids_hf.numpy())
    np.testing.assert_allclose(np.asarray(w), w_hf.detach().numpy(), atol=1e-6)


# ------------------------------------------------------------------------ replay, trainer
def test_replay_makes_trainer_logprobs_equal_behaviour():
    """Near-tied router: without replay the trainer's log-probs differ from the sampler's
    on some tokens (by more than 0.01); replaying the recorded experts makes them equal on
    every token up to float32 rounding (a few units in the last place of log-probs down
    to -8: 5e-6)."""
    cfg = tiny_gpt_oss_config(vocab_size=16)
    params = models.init_params(cfg, seed=1)
    layers = dict(params["layers"], router_bias=0 * params["layers"]["router_bias"])
    params = tie_sensitive(cfg, dict(params, layers=layers))
    gaps = replay_gaps(cfg, params)
    assert np.sum(gaps[2, "none"] > 1e-2) >= 3, gaps[2, "none"]
    assert gaps[2, "rollout"].max() <= 5e-6, gaps[2, "rollout"].max()


@pytest.mark.slow
def test_grpo_two_steps(tmp_path):
    """A tiny GPT-OSS through the trainer (window 4 < prompt + completion, sinks, experts,
    routing replay, reference model with beta > 0)."""
    cfg = tiny_gpt_oss_config(vocab_size=33, tie_word_embeddings=True)
    models.save_hf(cfg, models.init_params(cfg, seed=0), tmp_path / "m", tokenizer_dir=TOKENIZER)
    c = tiny_config(str(tmp_path / "m"), beta=0.04, routing_replay="rollout")
    last = train.train(c, str(tmp_path / "run"))
    assert [m["step"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    assert np.isfinite(last["loss/total"]) and last["optim/nonfinite"] == 0.0
    assert np.isfinite(last["loss/kl"]) and last["moe/router_agreement"] > 0.5


def test_paged_engine_equals_static_sampler_and_teacher_forced():
    """The paged engine (4 slots for 12 rows, preemptions, prompts and completions past the
    window) gives the static sampler's greedy tokens; sampled rows' behaviour log-probs
    equal the teacher-forced ones within 1e-5."""
    from test_paged_engine import paged_greedy_equals_static
    from tiny_run import teacher_forced_logprobs

    cfg = tiny_gpt_oss_config(max_position_embeddings=512)
    params = models.init_params(cfg, seed=1)
    engine, ids, mask = paged_greedy_equals_static(cfg, params)
    spec = sampling.RolloutSpec(num_generations=2, max_new_tokens=12, temperature=0.8)
    out = engine().sample(params, ids, mask, spec, step=1)
    tf = teacher_forced_logprobs(cfg, params, out, 0.8)
    m = np.asarray(out.mask)
    assert np.abs(np.asarray(out.logprobs) - tf)[m].max() <= 1e-5


def test_context_parallel_sinks_equal_one_device():
    """Under context parallelism (heads split over context 2 x tensor 2) the sinks split
    with the query heads: the forward and its gradients (sinks included) equal one
    device's."""
    cfg = tiny_gpt_oss_config(attention="xla")
    params = models.init_params(cfg, seed=2)
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 24)), jnp.int32)

    def loss(p):
        return jnp.sum(jnp.sin(models.forward(cfg, p, ids)))

    fn = jax.jit(jax.value_and_grad(loss))
    want = fn(params)
    mesh = parallel.make_mesh({"context": 2, "tensor": 2}, jax.devices()[:4])
    with jax.set_mesh(mesh):
        got = fn(jax.device_put(params, models.param_shardings(cfg, mesh)))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        # gradients reach ~100 here; sums reordered across devices round at 1e-6 of that
        assert np.abs(np.asarray(g) - np.asarray(w)).max() <= 1e-5 * np.abs(np.asarray(w)).max()
    assert float(jnp.abs(got[1]["layers"]["sinks"]).max()) > 1e-4
