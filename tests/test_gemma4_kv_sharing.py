"""Gemma 4's KV sharing (`num_kv_shared_layers`, as in its E2B / E4B checkpoints): the
last layers attend over the keys/values of the last earlier layer of their type, have no
key/value projections and keep no KV cache; their MLP is double-wide
(`use_double_wide_mlp`). Logits, sharding, greedy tokens, export, parameter counts and the
shared-prompt path against transformers, and the paged engine, run in `test_gemma4.py`
(its "shared*" kinds); here: the layout, the cache paths, gradients, skipped tensors,
refusals, a GRPO run."""

import jax
import numpy as np
import pytest
from hf_reference import hf_model, padded_batch
from test_gemma4 import KINDS
from test_gemma4_moe import grpo_two_steps
from tiny_run import tiny_gemma4_config

from jaxrl_llm import models


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


def test_grpo_two_steps(tmp_path):
    """A tiny KV-sharing Gemma 4 (4 layers, the last 2 shared) built from fields and saved
    by `save_hf` (transformers reads it as the same model) through the trainer, beta > 0.
    The paged engine on KV-sharing models: `test_gemma4.py`'s paged cases."""
    fields = dict(kv_shared_layers=2, double_wide_mlp=True)
    grpo_two_steps(tiny_gemma4_config(vocab_size=33, tie_word_embeddings=True, **fields), tmp_path)


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
