"""Mixture-of-experts decoder (Qwen3-MoE) against Hugging Face and a per-expert loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_learning as learning
from hf_reference import hf_logits, hf_model, padded_batch
from test_sampler import PROMPTS, hf_greedy
from tiny_run import tiny_model_config

from jaxrl_llm import models, parallel, rl, sampling
from jaxrl_llm.models import moe
from jaxrl_llm.rl import batch as rl_batch
from jaxrl_llm.rl import update as rl_update


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """(torch model, directory, cfg, params) of a tiny random Qwen3MoeForCausalLM."""
    model = hf_model("qwen3_moe", seed=3)
    d = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(d, max_shard_size="60KB")
    return (model, d, *models.load_hf(d))


def max_diff(a, b, mask):
    return float(np.abs(np.asarray(a) - np.asarray(b))[np.asarray(mask, bool)].max())


def assert_export_round_trip(model, cfg, params, out, ids, mask):
    """save_hf (split over files) -> transformers reloads the same logits, `load_hf` the
    same params and config; the config built from fields says the same model."""
    models.save_hf(cfg, params, out, max_shard_bytes=60_000)
    reloaded = type(model).from_pretrained(out).eval()
    assert max_diff(hf_logits(reloaded, ids, mask), hf_logits(model, ids, mask), mask) <= 1e-5
    cfg2, params2 = models.load_hf(out)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        np.testing.assert_array_equal(a, b)
    rebuilt = models.ModelConfig.from_hf_dict(cfg.replace(hf_config="").to_hf_dict())
    assert rebuilt == cfg


def loop_experts(x, ids, weights, gate, up, down):
    """sum_j w[n, j] * expert_{ids[n, j]}(x[n]): one expert at a time, a Python loop."""
    out = jnp.zeros_like(x)
    for e in range(gate.shape[0]):
        w = jnp.sum(jnp.where(ids == e, weights, 0.0), axis=-1)  # [N]
        y = (jax.nn.silu(x @ gate[e]) * (x @ up[e])) @ down[e]
        out = out + w[:, None] * y
    return out


@pytest.mark.parametrize("impl", ["ragged", "blocked", "dense"])
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

        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2, 3, 4), has_aux=True))(*args)

    f = moe.EXPERT_IMPLS[impl]
    if impl == "blocked":  # blocks of 4 rows: several per expert, padding in most
        f = functools.partial(f, block=4)
    (_, y), grads = loss(f)
    (_, y_ref), grads_ref = loss(loop_experts)
    np.testing.assert_allclose(y, y_ref, atol=1e-5)
    for g, r in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5)
    assert float(jnp.abs(grads[2][E - 1]).max()) == 0.0


@pytest.mark.parametrize("impl", ["ragged", "blocked", "dense"])
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


def test_dense_layer_pattern_equals_transformers(tmp_path):
    """`mlp_only_layers` and `decoder_sparse_step` mixed: of 4 layers only 1 and 3 are
    MoE by the step, and 3 is dense by `mlp_only_layers`: runs dense, MoE, dense (three
    scans, each over its kind's stack). Logits equal transformers'. (The per-layer cache
    over layers of two kinds: tests/test_moe_glm.py's greedy test.)"""
    model = hf_model(
        "qwen3_moe", seed=5, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]
    )
    model.save_pretrained(tmp_path)
    cfg, params = models.load_hf(tmp_path)
    assert cfg.dense_layers == (0, 2, 3) and len(cfg.layer_segments()) == 3
    assert params["layers"]["gate"].shape[0] == 3 and params["layers"]["router"].shape[0] == 1
    assert cfg.num_params() == models.count_params(params) == model.num_parameters()
    ids, mask = padded_batch(seed=1)
    assert (
        max_diff(models.logits(cfg, params, ids, mask), hf_logits(model, ids, mask), mask) <= 1e-5
    )


def test_param_counts_equal_transformers(qwen3_moe):
    model, _, cfg, params = qwen3_moe
    total = sum(p.numel() for p in model.parameters())
    assert cfg.num_params() == models.count_params(params) == total
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    idle = cfg.num_experts - cfg.num_experts_per_tok
    assert cfg.active_params() == total - cfg.num_layers * idle * per_expert


def test_refused_options_name_the_key():
    base = hf_model("qwen3_moe").config.to_dict()
    with pytest.raises(models.UnsupportedModelError, match="decoder_sparse_step"):
        models.ModelConfig.from_hf_dict(base | {"decoder_sparse_step": 0})
    with pytest.raises(models.UnsupportedModelError, match="shared_expert_intermediate_size"):
        models.ModelConfig.from_hf_dict(base | {"shared_expert_intermediate_size": 8})
    cfg = models.ModelConfig.from_hf_dict(base)
    with pytest.raises(ValueError, match="lora targets"):
        cfg.replace(lora=models.LoraConfig(rank=2))
    cfg.replace(lora=models.LoraConfig(rank=2, targets=("q", "v")))


# ------------------------------------------------------------------------ routing replay
def tie_sensitive(cfg, params, eps=1e-6):
    """The router's columns made equal up to eps: its logits are near-ties that float
    rounding decides, so the sampler's and the trainer's forwards route differently."""
    router = params["layers"]["router"]
    layers = dict(params["layers"], router=router[..., :1] + eps * router)
    return dict(params, layers=layers)


def tiny_moe(**overrides):
    fields = dict(
        architecture="Qwen3MoeForCausalLM",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        initializer_range=0.2,
    )
    return tiny_model_config(**(fields | overrides))


def test_sampler_records_the_routes_a_full_forward_takes(qwen3_moe):
    """Every token the sampler reads (prompt, fed completion tokens, tokens appended in a
    second turn) has its experts recorded, equal to the full forward's own top-k; only
    each row's last drawn token, never fed, is not."""
    _, _, cfg, params = qwen3_moe
    spec = sampling.RolloutSpec(num_generations=2, max_new_tokens=3, temperature=1.0)
    sampler = sampling.Sampler(cfg, seed=1)
    state = sampler.start(params, *sampling.pad_prompts(PROMPTS, 0), spec, step=0)
    state = sampler.decode(params, state)
    tool = [[30 + i] * (i % 3) for i in range(8)]  # 0, 1 or 2 appended tokens per row
    width = max(map(len, tool))
    ids = np.array([row + [0] * (width - len(row)) for row in tool], np.int32)
    state = sampler.append(params, state, ids, ids > 0)
    out = sampler.result(sampler.decode(params, state))
    N, P = out.prompt_tokens.shape
    T = out.tokens.shape[1]
    assert out.routes.shape == (N, P + T, cfg.num_layers, 2) and out.routes.dtype == jnp.int16
    ids = jnp.concatenate([out.prompt_tokens, out.tokens], 1)
    mask = np.asarray(jnp.concatenate([out.prompt_mask, out.mask], 1))
    _, own = models.forward(cfg, params, ids, mask, with_routes=True)
    recorded = np.asarray(out.routes)
    seen = recorded[..., 0] >= 0
    np.testing.assert_array_equal(np.asarray(own)[seen], recorded[seen])
    expected = mask.copy()
    expected[np.arange(N), P + np.asarray(out.lengths) - 1] = False
    np.testing.assert_array_equal(seen[:, :, 0] & mask, expected)


REPLAY_PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [11], [3, 1, 4, 1, 5]]


def replay_gaps(cfg, params, groups=(2,)) -> dict:
    """|trainer's log-prob - sampler's behaviour log-prob| on the sampled tokens of 2 rows
    per prompt, per GRPO group size the trainer reads prompts with (2: once per group, 1:
    per row), without replay ("none") and replaying the recorded experts ("rollout"):
    {(groups, mode): gaps}."""
    out = sampling.generate(cfg, params, REPLAY_PROMPTS, 10, num_samples=2, temperature=1.0, seed=1)
    rows = (out.prompt_tokens, out.prompt_mask, out.tokens, out.mask)
    sampled = np.asarray(out.loss_mask)
    gaps = {}
    for g in groups:
        kw = dict(num_generations=g, micro_batches=1, temperature=1.0, chunk_size=128)
        logprobs = jax.jit(functools.partial(rl_batch.batch_logprobs, cfg, **kw))
        for name, routes in (("none", None), ("rollout", out.routes)):
            logp = logprobs(params, *rows, routes=routes)
            gaps[g, name] = np.abs(np.asarray(logp) - np.asarray(out.logprobs))[sampled]
    return gaps


def test_replay_makes_trainer_logprobs_equal_behaviour():
    """Near-tied router: without replay the trainer's log-probs (each prompt read once
    per group, or per row) differ from the sampler's on some tokens; replaying the
    recorded experts makes them equal on every token. Vocabulary 16: log-probs near -3,
    whose float32 spacing (2.4e-7) leaves the 2e-6 bound room for rounding (measured up
    to 1.2e-6: five spacings, from the two programs' different summation orders)."""
    cfg = tiny_moe(vocab_size=16)
    params = tie_sensitive(cfg, models.init_params(cfg, seed=1))
    gaps = replay_gaps(cfg, params, groups=(2, 1))
    for groups in (2, 1):
        assert np.sum(gaps[groups, "none"] > 1e-2) >= 5, (groups, gaps[groups, "none"])
        assert gaps[groups, "rollout"].max() <= 2e-6, (groups, gaps[groups, "rollout"].max())


def plain_replayed_moe(cfg, h, weights, routes):
    """The MoE block with the experts given, each token's expert weights gathered:
    w = softmax(h W_r) at those experts (renormalised over them when norm_topk_prob),
    y = sum_j w_j expert_{routes_j}(h)."""
    x, ids = h.reshape(-1, h.shape[-1]), routes.reshape(-1, routes.shape[-1])
    p = jax.nn.softmax(x @ weights["router"])
    w = jnp.take_along_axis(p, ids, axis=1)
    if cfg.norm_topk_prob:
        w = w / jnp.sum(w, axis=1, keepdims=True)
    y = 0.0
    for j in range(ids.shape[1]):
        gate, up, down = (weights[n][ids[:, j]] for n in ("gate", "up", "down"))
        act = jax.nn.silu(jnp.einsum("nd,ndf->nf", x, gate)) * jnp.einsum("nd,ndf->nf", x, up)
        y = y + w[:, j, None] * jnp.einsum("nf,nfd->nd", act, down)
    return y.reshape(h.shape)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replayed_gates_differentiate_the_router(norm_topk_prob):
    """With replayed experts (here ones the router would not pick) the output and its
    gradients w.r.t. the router, the input and the experts equal the plain block's."""
    cfg = tiny_moe(norm_topk_prob=norm_topk_prob)
    D, E, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    keys = jax.random.split(jax.random.key(4), 5)
    h = jax.random.normal(keys[0], (2, 3, D))
    weights = {
        "router": jax.random.normal(keys[1], (D, E)) / 4,
        "gate": jax.random.normal(keys[2], (E, D, F)) / 4,
        "up": jax.random.normal(keys[3], (E, D, F)) / 4,
        "down": jax.random.normal(keys[4], (E, F, D)) / 4,
    }
    _, own = moe.moe_mlp(cfg, h, weights)
    routes = (own[..., ::-1] + 3) % E  # other experts, in another order

    def loss(f):
        fn = lambda h, w: jnp.sum(jnp.sin(f(h, w)))  # noqa: E731
        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(h, weights)

    value, grads = loss(lambda h, w: moe.moe_mlp(cfg, h, w, routes)[0])
    value_ref, grads_ref = loss(lambda h, w: plain_replayed_moe(cfg, h, w, routes))
    np.testing.assert_allclose(value, value_ref, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5)
    assert float(jnp.abs(grads[1]["router"]).max()) > 1e-3


# ------------------------------------------------------------------------------ learning
@pytest.mark.parametrize("replay", ["none", pytest.param("rollout", marks=pytest.mark.slow)])
def test_grpo_learns_target_token(replay):
    """test_learning's task (reward 1 iff the first token is the target) on a tiny MoE,
    the reference and the update routing by themselves or replaying the sampler's
    experts; the routing metrics come out of the update."""
    cfg = tiny_moe(vocab_size=learning.VOCAB, initializer_range=0.02)
    algo = rl.preset("grpo", routing_replay=replay)
    params = models.init_params(cfg, seed=0)
    ref_params = jax.tree.map(jnp.copy, params)
    opt = rl_update.make_optimizer(learning_rate=1e-2, max_grad_norm=1.0)
    state = rl_update.init_train_state(params, opt)
    update = rl_update.make_update_fn(cfg, algo, opt, learning.SPEC)
    ref_fn = rl.make_logprob_fn(cfg, learning.SPEC, replay=replay == "rollout")
    sampler = sampling.Sampler(cfg, seed=0)
    ids, mask = sampling.pad_prompts(learning.PROMPTS, pad_id=0)
    curve = []
    for step in range(24):
        out = sampler.sample(state.params, ids, mask, learning.SPEC, step)
        rewards = learning.first_token_reward(out)
        curve.append(float(rewards.mean()))
        batch = rl.RolloutBatch.from_sample(out, rewards, ref_fn(ref_params, out))
        state, metrics = update(state, batch)
    assert 0.9 <= float(metrics["moe/router_agreement"]) <= 1.0
    assert 1.0 <= float(metrics["moe/layer0/load_max"]) <= cfg.num_experts
    learning.check_learned(curve)


# --------------------------------------------------------------------- expert parallelism
def tree_diff(a, b):
    return jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()), a, b)


def moe_update_batch(cfg, params, spec):
    out = sampling.generate(
        cfg,
        params,
        learning.PROMPTS + [[9, 3]],
        spec.max_new_tokens,
        num_samples=spec.num_generations,
        temperature=1.0,
        seed=2,
    )
    rewards = np.asarray(out.tokens)[:, 0] % 3 == 0
    return rl.RolloutBatch.from_sample(out, rewards.astype(np.float32))


@pytest.mark.parametrize("impl", ["auto", pytest.param("gmm", marks=pytest.mark.slow)])
def test_expert_parallel_update_equals_one_device(impl):
    """One GRPO update (experts replayed) on 8 devices, one expert per device on the
    `expert` axis (which also splits the batch), equals one device. `gmm`: the Pallas
    kernel (interpreted on CPU), per device on its own experts under the update's mesh."""
    cfg = tiny_moe(vocab_size=learning.VOCAB).replace(moe_impl=impl)
    spec = sampling.RolloutSpec(num_generations=4, max_new_tokens=4)
    params = models.init_params(cfg, seed=0)
    batch = moe_update_batch(cfg, params, spec)
    opt = rl_update.make_optimizer(learning_rate=0.3, eps=1.0)
    algo = rl.preset("grpo", beta=0.0, routing_replay="rollout")
    fn = rl_update.make_update_fn(cfg, algo, opt, spec, chunk_size=4)
    single, m_single = fn(rl_update.init_train_state(jax.tree.map(jnp.copy, params), opt), batch)
    mesh = parallel.make_mesh({"expert": 8})
    sharded_params = jax.device_put(params, models.param_shardings(cfg, mesh))
    assert sharded_params["layers"]["expert_up"].sharding.spec[1] == "expert"
    state = rl_update.init_train_state(sharded_params, opt)
    host_batch = jax.tree.map(np.asarray, batch)
    sharded, m_sharded = fn(state, parallel.shard_batch(host_batch, mesh))
    diff = tree_diff((sharded.params, sharded.opt_state), (single.params, single.opt_state))
    assert max(jax.tree.leaves(diff)) <= 1e-5
    for name in ("loss/total", "optim/grad_norm", "moe/router_agreement"):
        np.testing.assert_allclose(float(m_sharded[name]), float(m_single[name]), atol=1e-5)


def test_lora_on_attention_of_an_moe_model():
    """Adapters on q and v, experts and router frozen: the adapted model starts as the
    base, and one update moves the adapters (the only trained parameters)."""
    cfg = tiny_moe(vocab_size=learning.VOCAB)
    adapted = cfg.replace(lora=models.LoraConfig(rank=2, targets=("q", "v")))
    spec = sampling.RolloutSpec(num_generations=4, max_new_tokens=4)
    base = models.init_params(cfg, seed=0)
    adapters = models.lora.init_adapters(adapted, seed=1)
    assert set(adapters["layers"]) == {"q_lora_a", "q_lora_b", "v_lora_a", "v_lora_b"}
    ids, mask = padded_batch(length=6)
    ids = ids % learning.VOCAB
    np.testing.assert_allclose(
        models.logits(adapted, models.lora.combine(base, adapters), ids, mask),
        models.logits(cfg, base, ids, mask),
        atol=1e-6,
    )
    batch = moe_update_batch(cfg, base, spec)
    opt = rl_update.make_optimizer(learning_rate=1e-2)
    state = rl_update.init_train_state(jax.tree.map(jnp.copy, adapters), opt, frozen=base)
    fn = rl_update.make_update_fn(
        adapted, rl.preset("grpo", beta=0.0, routing_replay="rollout"), opt, spec
    )
    new, metrics = fn(state, batch)
    assert float(metrics["optim/nonfinite"]) == 0.0
    moved = tree_diff(new.params, adapters)["layers"]
    assert moved["q_lora_b"] > 0 and moved["v_lora_b"] > 0  # (A's gradient is 0 while B = 0)


def test_flops_count_the_active_parameters():
    """Model FLOPs of an MoE token: its matmul parameters as `active_params` counts them
    (router + k experts, not the idle ones), twice."""
    from jaxrl_llm.trainer import perf

    cfg = tiny_moe()
    one_token = perf.forward_flops(cfg, positions=1, context=0, unembedded=0)
    matmuls = cfg.active_params(include_embeddings=False) - cfg.hidden_size  # final norm
    matmuls -= cfg.num_layers * (2 * cfg.hidden_size + 2 * cfg.head_dim)  # layer norms
    matmuls -= cfg.vocab_size * cfg.hidden_size  # the unembedding, counted apart
    assert one_token == 2 * matmuls


def test_fit_routes_moves_the_columns_with_the_tokens():
    """A rollout's prompt left-padded from 2 to 3 columns and its completion widened from
    2 to 3 (merged rounds) or cut to 1 (a multi-turn `fit`): routes follow, -1 in new."""
    routes = jnp.arange(2 * 4 * 1 * 2, dtype=jnp.int16).reshape(2, 4, 1, 2)
    wide = np.asarray(sampling.fit_routes(routes, 2, 3, 3))
    assert wide.shape == (2, 6, 1, 2)
    np.testing.assert_array_equal(wide[:, 1:5], np.asarray(routes))
    assert (wide[:, 0] == -1).all() and (wide[:, 5] == -1).all()
    cut = np.asarray(sampling.fit_routes(routes, 2, 2, 1))
    np.testing.assert_array_equal(cut, np.asarray(routes)[:, :3])


def test_paged_engine_with_routing_replay_is_accepted(tmp_path):
    """The paged engine records routes (tests/test_paged_engine.py), so replay with it
    passes the config check."""
    from tiny_run import tiny_config

    from jaxrl_llm.config import checks_rollout

    c = tiny_config(str(tmp_path))
    c.rollout.engine, c.algo.routing_replay = "paged", "rollout"
    checks_rollout.check_engine(c, 1)
