"""Gemma 4's KV sharing (`num_kv_shared_layers`, as in its E2B / E4B checkpoints): the
last layers attend over the keys/values of the last earlier layer of their type, have no
key/value projections and keep no KV cache; their MLP is double-wide
(`use_double_wide_mlp`). Logits, sharding, greedy tokens, export, parameter counts and the
shared-prompt path against transformers run in `test_gemma4.py` (its "shared_*" kinds);
here: the layout, the cache paths, gradients, the paged engine, refusals, a GRPO run."""

import functools

import jax
import numpy as np
import pytest
import transformers
from hf_reference import hf_logits, hf_model, padded_batch
from test_gemma4 import KINDS
from test_moe import max_diff
from tiny_run import teacher_forced_logprobs, tiny_gemma4_config

from jaxrl_llm import models, sampling
from jaxrl_llm.rl import batch as rl_batch


@pytest.fixture(scope="module", params=["shared_same", "shared_wide"])
def shared(tmp_path_factory, request):
    """(kind, torch model, cfg, params): `test_gemma4.KINDS`' KV-sharing models."""
    model = hf_model("gemma4", seed=1, **KINDS[request.param])
    d = tmp_path_factory.mktemp("gemma4_kv")
    model.save_pretrained(d)
    return (request.param, model, *models.load_hf(d))


def test_config_and_parameters(shared):
    """Layers 1 and 2 store, 3-5 reuse (transformers' `kv_sharing_modes`); keys and values
    are stacked over the layers that have them, the double-wide MLP over the shared
    ones; the KV cache holds the layers with keys only."""
    kind, model, cfg, params = shared
    assert [s and s[0] for s in cfg.kv_sharing] == model.config.kv_sharing_modes
    assert [cfg.kv_source(i) for i in range(6)] == [0, 1, 2, 1, 2, 1]
    layers = params["layers"]
    assert layers["gate_x2"].shape == (3, 64, 2 * cfg.intermediate_size)
    assert layers["gate"].shape == (3, 64, cfg.intermediate_size)
    if kind == "shared_same":
        assert layers["k"].shape[0] == layers["k_norm"].shape[0] == 3
        assert layers["q"].shape[0] == 6
        assert models.init_cache(cfg, 2, 8).k.shape[0] == 3
    else:  # sliding layers 0, 2 keep keys (4 reuses 2), full layer 1 (3 and 5 reuse it)
        assert layers["k"].shape[0] == 2 and layers["wk"].shape[0] == 1
        assert (layers["q"].shape[0], layers["wq"].shape[0]) == (3, 3)
        cache = models.init_cache(cfg, 2, 8)
        assert cache.k.shape[0] == 2 and cache.wide[0].shape[0] == 1
    without = cfg.replace(kv_shared_layers=0, double_wide_mlp=False)
    assert cfg.kv_per_token < without.kv_per_token


def test_cache_paths_equal_forward(shared):
    """The unrolled layer loop (`scan_layers=False`) and prefill plus decode over the
    stacked cache give the scanned full forward's logits (per-layer arrays and the
    shared-prompt path: `test_gemma4.py`)."""
    _, _, cfg, params = shared
    ids, _ = padded_batch(seed=7, length=14)
    full = np.asarray(models.logits(cfg, params, ids))
    mask = np.ones_like(ids, bool)
    unrolled = cfg.replace(scan_layers=False)
    np.testing.assert_allclose(models.logits(unrolled, params, ids), full, atol=5e-5)
    cache = models.init_cache(cfg, ids.shape[0], 16)
    _, cache = models.prefill(cfg, params, ids[:, :9], mask[:, :9], cache)
    for t in range(9, 14):
        logits, cache = models.decode_step(cfg, params, ids[:, t], cache)
        np.testing.assert_allclose(logits, full[:, t], atol=5e-5)


def test_gradients_reach_the_storing_layers(shared):
    """A loss on the logits differentiates through the shared keys into every storing
    layer's key projection."""
    _, _, cfg, params = shared
    ids, mask = padded_batch(seed=5, length=10)
    name = "wk" if cfg.split_attention else "k"

    def loss(p):
        return models.logits(cfg, p, ids, mask).std()

    grads = np.asarray(jax.grad(loss)(params)["layers"][name])
    assert np.all(np.abs(grads).reshape(grads.shape[0], -1).max(-1) > 0)


def test_refused_options_name_the_key():
    """Every layer shared, a shared type without an earlier layer of its type, the
    double-wide MLP beside the MoE block, adapters."""
    base = hf_model("gemma4", seed=1, **KINDS["shared_same"]).config.to_dict()
    for change, key in (
        ({"num_kv_shared_layers": 6}, "num_kv_shared_layers"),
        ({"use_double_wide_mlp": True, "enable_moe_block": True}, "use_double_wide_mlp"),
    ):
        with pytest.raises(models.UnsupportedModelError, match=key):
            models.ModelConfig.from_hf_dict(base | change)
    cfg = models.ModelConfig.from_hf_dict(base)
    types = ("sliding_attention",) * 3 + ("full_attention",) * 3
    with pytest.raises(ValueError, match="kv_shared_layers=3"):
        cfg.replace(layer_types=types)
    with pytest.raises(models.UnsupportedModelError, match="model.lora"):
        cfg.replace(lora=models.LoraConfig(rank=2))


def test_paged_engine_and_trainer_logprobs_equal_static_sampler():
    """The paged engine (4 slots for 12 rows, preemptions, past the window) gives the
    static sampler's greedy tokens with pages for the non-shared layers only (4 layers,
    the last 2 shared); sampled rows' behaviour log-probs equal the teacher-forced ones
    and the trainer's within 1e-5. With full layers of their own head size:
    tests/test_gemma4.py's "wide" case, which shares as well."""
    from test_paged_engine import paged_greedy_equals_static

    cfg = tiny_gemma4_config(max_position_embeddings=512, kv_shared_layers=2, double_wide_mlp=True)
    params = models.init_params(cfg, seed=1)
    engine, ids, mask = paged_greedy_equals_static(cfg, params)
    spec = sampling.RolloutSpec(num_generations=2, max_new_tokens=12, temperature=0.8)
    kw = dict(num_generations=2, micro_batches=1, temperature=0.8, chunk_size=128)
    trainer = jax.jit(functools.partial(rl_batch.batch_logprobs, cfg, **kw))
    for sampler in (engine(), sampling.Sampler(cfg)):
        out = sampler.sample(params, ids, mask, spec, step=1)
        m = np.asarray(out.mask)
        tf = teacher_forced_logprobs(cfg, params, out, 0.8)
        assert np.abs(np.asarray(out.logprobs) - tf)[m].max() <= 1e-5
        logp = trainer(params, out.prompt_tokens, out.prompt_mask, out.tokens, out.mask)
        assert np.abs(np.asarray(logp) - np.asarray(out.logprobs))[m].max() <= 1e-5


def test_grpo_two_steps(tmp_path):
    """A tiny KV-sharing Gemma 4 (4 layers, the last 2 shared) built from fields and saved
    by `save_hf` (transformers reads it as the same model) through the trainer, beta > 0."""
    from tiny_run import TOKENIZER, tiny_config

    from jaxrl_llm import train

    fields = dict(kv_shared_layers=2, double_wide_mlp=True)
    cfg = tiny_gemma4_config(vocab_size=33, tie_word_embeddings=True, **fields)
    params = models.init_params(cfg, seed=0)
    models.save_hf(cfg, params, tmp_path / "m", tokenizer_dir=TOKENIZER)
    model = transformers.Gemma4ForCausalLM.from_pretrained(tmp_path / "m").eval()
    ids, mask = padded_batch(seed=4, length=12)
    ids = ids % 33
    assert (
        max_diff(models.logits(cfg, params, ids, mask), hf_logits(model, ids, mask), mask) <= 2e-5
    )
    last = train.train(tiny_config(str(tmp_path / "m"), beta=0.04), str(tmp_path / "run"))
    assert np.isfinite(last["loss/total"]) and last["optim/nonfinite"] == 0.0
    assert np.isfinite(last["loss/kl"])


def test_unused_key_projections_in_a_checkpoint_are_skipped(shared, tmp_path):
    """A checkpoint holding key / value projections and norms for the shared layers (as
    transformers' `_keys_to_ignore_on_load_unexpected` allows) loads to the same params;
    any other leftover tensor is still refused."""
    from safetensors.numpy import save_file

    _, model, cfg, params = shared
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    extra = {
        f"model.layers.5.self_attn.{n}.weight": np.ones((4, 64), np.float32)
        for n in ("k_proj", "v_proj")
    }
    model.config.save_pretrained(tmp_path)
    save_file(state | extra, str(tmp_path / "model.safetensors"))
    _, loaded = models.load_hf(tmp_path)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(a, b)
    save_file(
        state | {"model.layers.2.self_attn.k_norm.bias": np.ones(4, np.float32)},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(models.CheckpointError, match="k_norm.bias"):
        models.load_hf(tmp_path)
