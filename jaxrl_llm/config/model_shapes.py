"""A run config's model shapes without a download, for a compile-only run.

cfg = model_config(run_config)      # models.ModelConfig with the config's runtime keys
"""

from __future__ import annotations

from jaxrl_llm import models
from jaxrl_llm.config.derived import ConfigError, model_runtime

# config.json shapes of the hub models the shipped TPU configs name (so a compile-only
# run needs no download), and SmolLM2-135M's (the weight-sync benchmark's); any other
# model: a local directory or a built-in name.
HUB_CONFIGS = {
    "Qwen/Qwen3-1.7B": dict(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        rope_theta=1e6,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        hidden_act="silu",
    ),
    "Qwen/Qwen3-30B-A3B": dict(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        tie_word_embeddings=False,
        rope_theta=1e6,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    "meta-llama/Llama-3.1-8B-Instruct": dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    "HuggingFaceTB/SmolLM2-135M-Instruct": dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        hidden_act="silu",
    ),
    "Qwen/Qwen2.5-0.5B-Instruct": dict(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=1e6,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        hidden_act="silu",
    ),
}


def model_config(c) -> models.ModelConfig:
    """The config's model shapes, with its runtime settings: from HUB_CONFIGS for the
    hub names there, else the local directory or built-in name (never a download)."""
    m, runtime = c.model, model_runtime(c)
    if m.path in HUB_CONFIGS:
        return models.ModelConfig.from_hf_dict(HUB_CONFIGS[m.path], m.path, **runtime)
    path = models.builtin.resolve(m.path, download=False)
    if path is None:
        raise ConfigError(
            f"model.path={m.path!r}: a hub name whose shapes are not known here; give a "
            f"local directory with its config.json (no download in a compile-only run)"
        )
    return models.builtin.model_config(path, **runtime)
