"""Qwen3.5 (hybrid Gated DeltaNet + gated full attention; dense and MoE) and Qwen3-Next
against Hugging Face, and the two forms of the delta-rule recurrence against a numpy loop."""

import hf_reference
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import hf_logits, hf_model, padded_batch
from test_sampler import PROMPTS, hf_greedy
from tiny_run import teacher_forced_logprobs

from jaxrl_llm import models, parallel, sampling
from jaxrl_llm.models import gated_deltanet as gdn

# float32 logits of these random models (|logit| up to ~5): ours and transformers' each
# differ from a float64 run by up to ~5e-5 (rounding in the recurrence, amplified by the
# random weights), so against transformers the bound is that rounding (1e-4), and against
# float64 ours must be as accurate as transformers' (`test_logits_equal_transformers`).
ATOL, RTOL = 1e-4, 1e-5


def load(name, tmp_path_factory):
    # seed 3's Qwen3-Next draw amplifies float32 rounding to 2-6e-4 against float64 in
    # both implementations (seed 0: ~1.6e-5 in both, as the Qwen3.5 draws)
    model = hf_model(name, seed=0 if name == "qwen3_next" else 3)
    d = tmp_path_factory.mktemp(name)
    model.save_pretrained(d)
    return (model, d, *models.load_hf(d, linear_chunk=4))


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def qwen3_5(request, tmp_path_factory):
    """(torch model, directory, cfg, params) of a tiny random Qwen3.5 (dense or MoE) or
    Qwen3-Next (the MoE one with fused DeltaNet projections and a dense layer)."""
    return load(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """The dense one only: for the tests of the recurrence's paths (their MoE layers
    change nothing there), which keeps the file's run time down."""
    return load("qwen3_5", tmp_path_factory)


def close(ours, ref, mask, slack=0.0):
    """|ours - ref| <= ATOL + RTOL |ref| + slack at the real tokens."""
    mask = np.asarray(mask, bool)
    ours, ref = np.asarray(ours), np.asarray(ref)
    bound = ATOL + RTOL * np.abs(ref) + slack
    over = (np.abs(ours - ref) > bound)[mask]
    assert not over.any(), (np.abs(ours - ref)[mask][over], bound[mask][over])


def test_logits_equal_transformers(qwen3_5):
    """Padded rows (left, right, none); chunks of 4 over 12 and 20 tokens (a partial last
    chunk), and one chunk longer than the sequence."""
    model, _, cfg, params = qwen3_5
    assert cfg.hybrid and cfg.linear_layers == (True, True, True, False)
    runs = 4 if cfg.dense_layers else 2  # Qwen3-Next's dense layer 1: a run of its own
    assert len(cfg.layer_segments()) == runs and params["layers"]["q"].shape[0] == 1
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
        exact = {
            n: np.asarray(models.logits(cfg, p64, *padded_batch(n, length=n))) for n in (12, 20)
        }
    for length in (12, 20):
        ids, mask = padded_batch(seed=length, length=length)
        ref = hf_logits(model, ids, mask)
        ours = np.asarray(models.logits(cfg, params, ids, mask))
        # Within HF's own float32 error of it (against float64): a draw that amplifies
        # rounding (Qwen3-Next's at 20 tokens: ~3e-4 in HF on some CPUs) widens both.
        slack = np.abs(ref - exact[length])
        close(ours, ref, mask, slack)
        close(models.logits(cfg.replace(linear_chunk=64), params, ids, mask), ref, mask, slack)
        err = np.abs(ours - exact[length])[mask].max()
        assert err <= max(1e-5, 1.5 * np.abs(ref - exact[length])[mask].max()), err


def test_sharded_logits_equal_transformers(qwen3_5):
    model, d, _, _ = qwen3_5
    mesh = parallel.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
    cfg, params = models.load_hf(d, mesh=mesh, linear_chunk=4)
    ids, mask = padded_batch(seed=2)
    out = models.logits(cfg, params, *parallel.shard_batch((ids, mask), mesh))
    close(out, hf_logits(model, ids, mask), mask)


def test_param_counts_equal_transformers(qwen3_5):
    model, _, cfg, params = qwen3_5
    assert cfg.num_params() == models.count_params(params) == model.num_parameters()


def test_export_reloads_in_transformers(qwen3_5, tmp_path):
    model, _, cfg, params = qwen3_5
    models.save_hf(cfg, params, tmp_path / "out")
    reloaded = type(model).from_pretrained(tmp_path / "out").eval()
    ids, mask = padded_batch(seed=6)
    close(hf_logits(reloaded, ids, mask), hf_logits(model, ids, mask), mask)
    cfg2, params2 = models.load_hf(tmp_path / "out", linear_chunk=4)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        np.testing.assert_array_equal(a, b)
    # a config built from fields (no HF text kept) writes a dict transformers reads too
    models.save_hf(cfg.replace(hf_config=""), params, tmp_path / "fields")
    again = type(model).from_pretrained(tmp_path / "fields").eval()
    close(hf_logits(again, ids, mask), hf_logits(model, ids, mask), mask)


def test_qwen3_next_dense_layers_and_refusals():
    """Qwen3-Next's dense layers come from `mlp_only_layers` and `decoder_sparse_step` as
    in Qwen3-MoE; a Qwen3-Next without experts is refused naming the key; Qwen3.5-MoE's
    config.json cannot say dense layers or unnormalised top-k, so writing one refuses."""
    d = hf_reference.hf_config("qwen3_next", num_hidden_layers=4).to_dict()
    d["architectures"] = ["Qwen3NextForCausalLM"]
    cfg = models.ModelConfig.from_hf_dict(d | {"decoder_sparse_step": 2, "mlp_only_layers": [1]})
    assert cfg.dense_layers == (0, 1, 2) and not cfg.norm_topk_prob and cfg.moe
    assert models.ModelConfig.from_hf_dict(cfg.replace(hf_config="").to_hf_dict()) == cfg
    for change, message in [
        ({"num_experts": 0}, r"num_experts=0 is not supported \(Qwen3NextForCausalLM\)"),
        ({"decoder_sparse_step": 0}, r"decoder_sparse_step=0 \(must be >= 1\)"),
    ]:
        with pytest.raises(models.UnsupportedModelError, match=message):
            models.ModelConfig.from_hf_dict(d | change)
    moe = cfg.replace(architecture="Qwen3_5MoeForCausalLM", hf_config="")
    with pytest.raises(ValueError, match=r"dense_layers=\[0, 1, 2\].*Qwen3NextForCausalLM can"):
        moe.to_hf_dict()


def test_flops_count_the_active_matmuls_and_the_recurrence(qwen3_5):
    """A token's model FLOPs: twice its matmul parameters (`active_params` without norms,
    the convolution and the DeltaNet's per-head scalars; k of the E experts), plus per
    DeltaNet layer the delta rule (7 Dk Dv per value head) and the convolution."""
    from jaxrl_llm.trainer import perf

    _, _, cfg, _ = qwen3_5
    D, n_lin = cfg.hidden_size, sum(cfg.linear_layers)
    K, C = cfg.linear_conv_kernel, cfg.linear_conv_dim
    Hv, Dk, Dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    matmuls = cfg.active_params(include_embeddings=False) - D - cfg.vocab_size * D
    matmuls -= cfg.num_layers * 2 * D + (cfg.num_layers - n_lin) * 2 * cfg.head_dim
    matmuls -= n_lin * (K * C + 2 * Hv + Dv)
    recurrence = n_lin * (7 * Hv * Dk * Dv + 2 * K * C)
    assert perf.forward_flops(cfg, 1, 0, 0) == 2 * matmuls + recurrence


def test_random_init_runs(dense):
    _, _, cfg, params = dense
    fresh = models.init_params(cfg, 0)
    assert jax.tree.map(jnp.shape, fresh) == jax.tree.map(jnp.shape, params)
    ids, mask = padded_batch()
    assert np.isfinite(np.asarray(models.logits(cfg, fresh, ids, mask))).all()


def test_prefill_then_decode_equals_full_forward(dense):
    """A left-padded prompt prefilled (chunked recurrence from a zero state, in chunks of
    5 prompt tokens too), then one token at a time (the step form): the logits of every
    token equal the full forward's."""
    _, _, cfg, params = dense
    ids, mask = padded_batch(seed=4, length=14)
    mask[:, 8:] = True  # the decoded tokens are real
    full = np.asarray(models.logits(cfg, params, ids, mask))
    for c in (0, 5):
        cfg_c = cfg.replace(prefill_chunk=c)
        cache = models.init_cache(cfg_c, ids.shape[0], 16)
        logits, cache = models.prefill(cfg_c, params, ids[:, :8], mask[:, :8], cache)
        got = [np.asarray(logits)]
        for t in range(8, 14):
            logits, cache = models.decode_step(cfg_c, params, jnp.asarray(ids[:, t]), cache)
            got.append(np.asarray(logits))
        # rounding alone (two chunk sizes of the same forward) moves these random
        # models' float32 logits by up to ~1.1e-4 at a token; the same bound doubled
        np.testing.assert_allclose(np.stack(got, 1), full[:, 7:], RTOL, 2.5e-4)


def test_greedy_equals_hf_generate(qwen3_5):
    model, _, cfg, params = qwen3_5
    out = sampling.generate(cfg, params, PROMPTS, max_new_tokens=10, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.tokens), hf_greedy(model, PROMPTS, 10))


@pytest.mark.parametrize(
    "qwen3_5",
    [
        "qwen3_5",
        pytest.param("qwen3_5_moe", marks=pytest.mark.slow),
        pytest.param("qwen3_next", marks=pytest.mark.slow),
    ],
    indirect=True,
)
def test_sampled_logprobs_equal_teacher_forced(qwen3_5):
    """3 samples per prompt (the prompt's cache and DeltaNet state copied to its rows),
    rows that stop early (an eos token): the behaviour log-probs equal one teacher-forced
    forward's."""
    _, _, cfg, params = qwen3_5
    # the sampler decodes with the step form, the forward is chunked: these O(1) random
    # weights amplify the rounding to up to ~4e-5 (most tokens ~1e-6); at the model's own
    # initialisation (`init_params`: weights of std initializer_range) the bound is 1e-5
    # (measured <= 1e-6)
    stopped = []
    for weights, bound in ((params, 1e-4), (models.init_params(cfg, 0), 1e-5)):
        out = sampling.generate(
            cfg,
            weights,
            PROMPTS,
            max_new_tokens=10,
            num_samples=3,
            temperature=0.7,
            seed=1,
            stop_ids=(7, 20, 33),
        )
        mask = np.asarray(out.mask)
        stopped.append(not mask.all())
        ref = teacher_forced_logprobs(cfg, weights, out, 0.7)
        assert np.abs(np.asarray(out.logprobs) - ref)[mask].max() <= bound
    assert stopped[0]  # some rows stopped


# ------------------------------------------------------------------ the recurrence
def numpy_delta_rule(q, k, v, g, beta, S):
    """The gated delta rule in float64, token by token (the paper's formula)."""
    q, k, v, g, beta, S = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, S))
    out = np.zeros(v.shape)
    for t in range(q.shape[1]):
        S = S * np.exp(g[:, t])[..., None, None]
        delta = (v[:, t] - np.einsum("bhkv,bhk->bhv", S, k[:, t])) * beta[:, t][..., None]
        S = S + k[:, t][..., :, None] * delta[..., None, :]
        out[:, t] = np.einsum("bhkv,bhk->bhv", S, q[:, t])
    return out, S


def random_inputs(seed, B=2, T=19, H=3, Dk=8, Dv=6):
    r = np.random.RandomState(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(r.randn(B, T, H, Dk)) * Dk**-0.5
    k = unit(r.randn(B, T, H, Dk))
    v, S = r.randn(B, T, H, Dv), 0.3 * r.randn(B, H, Dk, Dv)
    g, beta = -np.abs(r.randn(B, T, H)), 1 / (1 + np.exp(-r.randn(B, T, H)))
    return [jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta, S)]


@pytest.mark.parametrize("chunk", [1, 4, 8, 64])
def test_chunked_and_recurrent_forms_equal_a_numpy_loop(chunk):
    """From a nonzero state, over a length that is not a multiple of the chunk."""
    args = random_inputs(0)
    ref_o, ref_S = numpy_delta_rule(*args)
    o, S = gdn.chunked_delta_rule(*args, chunk)
    np.testing.assert_allclose(o, ref_o, atol=2e-5)
    np.testing.assert_allclose(S, ref_S, atol=2e-5)
    o, S = gdn.recurrent_delta_rule(*args)
    np.testing.assert_allclose(o, ref_o, atol=2e-5)
    np.testing.assert_allclose(S, ref_S, atol=2e-5)
    o, S = gdn.kernel_delta_rule(*args, chunk)  # the TPU kernel, interpreted
    np.testing.assert_allclose(o, ref_o, atol=2e-5)
    np.testing.assert_allclose(S, ref_S, atol=2e-5)


def test_kernel_gradients_and_model_equal_the_xla_form(dense):
    """The Pallas kernel's gradients (the XLA form's backward, recomputed) equal the XLA
    form's; `model.linear_impl='pallas'` gives the model's logits within rounding."""
    args = random_inputs(1)

    def loss(fn):
        def f(*a):
            o, S = fn(*a, 4)
            return (o * o).sum() + S.sum()

        return jax.grad(f, argnums=tuple(range(6)))(*args)

    kernel, xla = loss(gdn.kernel_delta_rule), loss(gdn.chunked_delta_rule)
    for a, b in zip(kernel, xla, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    _, _, cfg, params = dense
    ids, mask = padded_batch(seed=5, length=12)
    xla = models.logits(cfg.replace(linear_impl="xla"), params, ids, mask)
    kernel = models.logits(cfg.replace(linear_impl="pallas"), params, ids, mask)
    close(kernel, xla, mask)


def test_auto_takes_the_kernel_on_one_tpu_chip_when_its_blocks_tile(dense, monkeypatch):
    from jaxrl_llm.parallel import target

    auto = dense[2].replace(linear_impl="auto")
    assert not gdn.use_kernel(auto)  # CPU
    monkeypatch.setattr(target, "backend", lambda: "tpu")
    monkeypatch.setattr(target, "device_count", lambda: 1)
    assert not gdn.use_kernel(auto)  # heads of 8: not on Mosaic's 128-lane tiles
    wide = auto.replace(linear_key_head_dim=128, linear_value_head_dim=128, linear_chunk=64)
    assert gdn.use_kernel(wide) and not gdn.use_kernel(wide.replace(linear_chunk=20))
    assert not gdn.use_kernel(wide.replace(linear_impl="xla"))
    monkeypatch.setattr(target, "device_count", lambda: 4)  # a mesh: XLA partitions
    assert not gdn.use_kernel(wide) and gdn.use_kernel(wide.replace(linear_impl="pallas"))


def test_linear_keys_reach_the_model_and_are_checked(dense):
    """`model.linear_chunk` / `model.linear_impl` are run-config keys: they reach the
    `ModelConfig` the trainer builds, and a bad value is refused naming the key."""
    from tiny_run import tiny_config

    from jaxrl_llm import config as config_lib
    from jaxrl_llm.config import checks_model

    c = tiny_config(str(dense[1]))
    c.model.linear_chunk, c.model.linear_impl = 16, "pallas"
    cfg = models.ModelConfig.from_hf_dir(dense[1], **config_lib.model_runtime(c))
    assert (cfg.linear_chunk, cfg.linear_impl) == (16, "pallas")
    checks_model.check_model(c)
    for key, bad in (("linear_impl", "triton"), ("linear_chunk", 0)):
        c.model[key] = bad
        with pytest.raises(config_lib.ConfigError, match=rf"model\.{key}={bad!r}"):
            checks_model.check_model(c)
        c.model[key] = 16 if key == "linear_chunk" else "auto"


def test_masked_tokens_leave_the_state_alone():
    """Holes anywhere in a row: the convolution and the recurrence skip them, so the real
    tokens' outputs and the final state equal those of the row without the holes."""
    x = jnp.asarray(np.random.RandomState(1).randn(1, 9, 5), jnp.float32)
    w = jnp.asarray(np.random.RandomState(2).randn(3, 5), jnp.float32)
    mask = jnp.asarray([[False, True, True, False, False, True, True, False, True]])
    state = jnp.asarray(np.random.RandomState(3).randn(1, 2, 5), jnp.float32)
    y, new = gdn.causal_conv(x, w, mask, state)
    real = np.flatnonzero(np.asarray(mask[0]))
    y2, new2 = gdn.causal_conv(x[:, real], w, jnp.ones((1, len(real)), bool), state)
    np.testing.assert_allclose(np.asarray(y)[:, real], y2, atol=1e-6)
    np.testing.assert_allclose(new, new2, atol=1e-6)
    u = np.concatenate([np.asarray(state[0]), np.asarray(x[0, real])])  # numpy conv
    pre = u[:-2] * w[0] + u[1:-1] * w[1] + u[2:] * w[2]
    ref = pre / (1 + np.exp(-pre))
    np.testing.assert_allclose(y2[0], ref, atol=1e-5)


def test_step_and_chunked_forms_agree_in_the_model(dense):
    """The decode path's step form against the chunked form over the same tokens
    (prefill of everything at once vs one token at a time): float32 within 1e-5 at the
    logits; bfloat16 within its rounding."""
    _, _, cfg, params = dense
    ids = jnp.asarray(np.random.RandomState(7).randint(0, cfg.vocab_size, (2, 10)))
    mask = jnp.ones((2, 10), bool)
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 0.1)):
        p = jax.tree.map(lambda a, dtype=dtype: a.astype(dtype), params)
        cache = models.init_cache(cfg, 2, 10, dtype)
        chunked, _ = models.extend(cfg, p, ids, mask, cache)
        cache = models.init_cache(cfg, 2, 10, dtype)
        steps = []
        for t in range(10):
            h, cache = models.extend(cfg, p, ids[:, t : t + 1], mask[:, t : t + 1], cache)
            steps.append(h)
        a = models.project(cfg, p, chunked)
        b = models.project(cfg, p, jnp.concatenate(steps, 1))
        assert float(jnp.abs(a - b).max()) <= tol * max(1.0, float(jnp.abs(a).max()))


# ------------------------------------------------------------------ in the trainer
@pytest.mark.slow
def test_grpo_two_steps_with_routing_replay(tmp_path):
    """A tiny Qwen3-Next (Qwen3.5-MoE's decoder, here with a dense first layer, saved by
    `save_hf` with its fused DeltaNet projections and read back) through the trainer: the
    static sampler carries the DeltaNet state, each row reads its own prompt in the
    reference and the update (beta > 0), and the update replays the sampler's routes."""
    from tiny_run import TOKENIZER, tiny_config

    from jaxrl_llm import train

    cfg = tiny_hybrid(
        architecture="Qwen3NextForCausalLM",
        layer_types=("linear_attention", "linear_attention", "full_attention"),
        num_layers=3,
        dense_layers=(0,),
        vocab_size=33,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=False,
        n_shared_experts=1,
        shared_expert_size=24,
        shared_expert_gate=True,
    )
    models.save_hf(cfg, models.init_params(cfg, seed=0), tmp_path / "m", tokenizer_dir=TOKENIZER)
    c = tiny_config(str(tmp_path / "m"), beta=0.04, routing_replay="rollout")
    last = train.train(c, str(tmp_path / "run"))
    assert np.isfinite(last["loss/total"]) and last["optim/nonfinite"] == 0.0
    assert np.isfinite(last["loss/kl"])


def tiny_hybrid(**overrides):
    """A tiny dense Qwen3.5 built from fields: a DeltaNet layer, then a gated
    full-attention layer."""
    from tiny_run import tiny_model_config

    fields = dict(
        architecture="Qwen3_5ForCausalLM",
        zero_centered_norm=True,
        attn_output_gate=True,
        partial_rotary_factor=0.25,
        layer_types=("linear_attention", "full_attention"),
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )
    return tiny_model_config(**(fields | overrides))


@pytest.mark.slow
def test_training_memory_grows_linearly():
    """XLA's compiled memory of the forward + backward (remat full, blockwise attention in
    the full layers, chunks of 64 in the DeltaNet layers) at 4,096 and 16,384 tokens: 4x
    the tokens, about 4x the temporaries (the chunked recurrence keeps one state per
    chunk); the full attention matrix's grow with T^2, as the contrast shows."""

    from test_attention import grad_temporaries

    def temporaries(attention, T):
        cfg = tiny_hybrid(attention=attention, attention_block=256, remat="full")
        return grad_temporaries(cfg, T)

    growth = temporaries("blockwise", 16384) / temporaries("blockwise", 4096)
    assert growth <= 5.0, growth
    assert temporaries("xla", 16384) / temporaries("xla", 4096) >= 10.0  # the contrast


def test_grpo_learns_target_token_on_a_hybrid_model():
    """The learning-direction test of `test_learning` on the hybrid model: the sampler
    carries the DeltaNet state, the update differentiates the chunked recurrence; the
    mean reward rises from chance to above 0.9 in 25 steps. (Further on, with every
    reward 1 and so no advantage left, Adam at 1e-2 can carry this tiny policy off its
    optimum: a matter of the learning rate, not of the gradients checked here.)"""
    from test_learning import VOCAB, check_learned, train

    from jaxrl_llm import rl

    base = tiny_hybrid(vocab_size=VOCAB)
    check_learned(train(rl.preset("grpo"), steps=25, learning_rate=1e-2, base=base))
