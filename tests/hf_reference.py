"""Tiny random Hugging Face (PyTorch) models: the independent reference for the decoder."""

from __future__ import annotations

import numpy as np
import torch
import transformers

VOCAB = 96

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

ARCHS = {
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0},
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        {"sliding_window": None},
    ),
    # 8 experts of width 32, each token through 2 of them (renormalised weights).
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        {
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
    ),
    # DeepSeek-V3 routing (GLM-4.5): 3 layers, the first dense; 8 experts in 4 groups, the
    # choice within the best 2 groups; a shared expert; q/k/v bias, q/k norm, half the
    # head rotated.
    "glm4_moe": (
        transformers.Glm4MoeConfig,
        transformers.Glm4MoeForCausalLM,
        {
            "num_hidden_layers": 3,
            "head_dim": 16,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_group": 4,
            "topk_group": 2,
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 1,
            "attention_bias": True,
            "use_qk_norm": True,
        },
    ),
    # 3 layers: sliding, sliding, global (the 270M model's pattern is 5 + 1); a window of 4
    # tokens so the tests' sequences run past it; each layer kind its own RoPE base.
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        {
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "sliding_window": 4,
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            "pad_token_id": 0,
        },
    ),
    # GPT-OSS: sliding (window 4) and full layers, attention sinks, YaRN (the ramp inside
    # the 8 frequencies: original context 16), 8 experts with biases, k = 2, a swiglu
    # limit low enough that the clamps act on the tests' activations.
    "gpt_oss": (
        transformers.GptOssConfig,
        transformers.GptOssForCausalLM,
        {
            "head_dim": 16,
            "intermediate_size": 32,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 4,
            "swiglu_limit": 1.5,
            "max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 16,
            },
        },
    ),
}

# Gemma 4 text: 4 layers, sliding / full / sliding / full, a window of 4; the full layers'
# proportional RoPE rotating a quarter of each head (2 of its 8 pairs, frequencies
# divided by 2), the sliding ones' of base 1e4; final logits soft-capped at 3 (so the cap
# bends the tests' logits); no per-layer embeddings, every layer the same head size.
ARCHS["gemma4"] = (
    transformers.Gemma4TextConfig,
    transformers.Gemma4ForCausalLM,
    {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": 4,
        "head_dim": 16,
        "global_head_dim": 16,
        "hidden_size_per_layer_input": 0,
        "final_logit_softcapping": 3.0,
        "rope_parameters": {
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "factor": 2.0,
                "rope_theta": 1e6,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        "pad_token_id": 0,
    },
)

# Qwen3.5: 4 layers, three Gated DeltaNet then one full attention (the real pattern); 2
# key heads of 8 serving 4 value heads of 8, a 4-tap convolution; gated attention with a
# quarter of each head rotated. The MoE variant adds 8 experts (top 2) and a gated
# shared expert.
_QWEN3_5 = {
    "num_hidden_layers": 4,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
}
ARCHS["qwen3_5"] = (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, _QWEN3_5)
ARCHS["qwen3_5_moe"] = (
    transformers.Qwen3_5MoeTextConfig,
    transformers.Qwen3_5MoeForCausalLM,
    _QWEN3_5
    | {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
)
# Qwen3-Next: Qwen3.5-MoE's decoder with its DeltaNet projections fused (in_proj_qkvz,
# in_proj_ba); layer 1 dense (mlp_only_layers), the top-k weights not renormalised
ARCHS["qwen3_next"] = (
    transformers.Qwen3NextConfig,
    transformers.Qwen3NextForCausalLM,
    ARCHS["qwen3_5_moe"][2] | {"mlp_only_layers": [1], "norm_topk_prob": False},
)
# RMSNorm scales by 1 + weight
ZERO_CENTERED_NORMS = ("gemma3", "qwen3_5", "qwen3_5_moe", "qwen3_next")


def hf_config(arch: str, **overrides):
    config_cls, _, extra = ARCHS[arch]
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    kw.update(extra)
    kw.update(overrides)
    return config_cls(**kw)


def hf_model(arch: str, seed: int = 0, **overrides):
    """A tiny model whose every tensor (norms and biases too) is random and O(1)-scaled,
    so that a mapping mistake anywhere changes the logits."""
    torch.manual_seed(seed)
    _, model_cls, _ = ARCHS[arch]
    model = model_cls(hf_config(arch, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's norms scale by 1 + weight
                centered = arch in ZERO_CENTERED_NORMS and "linear_attn" not in name
                p.copy_((0.0 if centered else 1.0) + 0.3 * torch.randn_like(p))
            elif name.endswith(("A_log", "dt_bias")):  # Gated DeltaNet: HF's own init
                continue
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():  # DeepSeek-V3 routing's selection bias
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
            if name.endswith("layer_scalar"):  # Gemma 4's, stored with the weights
                b.copy_(0.5 + torch.rand_like(b))
    return model


def padded_batch(seed: int = 0, batch: int = 4, length: int = 12):
    """ids [B,T] and a mask mixing left padding, right padding and no padding."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, VOCAB, (batch, length))
    mask = np.ones((batch, length), bool)
    mask[1, :5] = False  # left-padded
    mask[2, length - 3 :] = False  # right-padded
    if batch > 3:
        mask[3, :2] = False
    return ids, mask


def hf_logits(model, ids, mask, positions=None) -> np.ndarray:
    """Reference logits; positions default to real tokens before each token (as generate)."""
    if positions is None:
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    # Gemma 4 with KV sharing and no per-layer inputs: transformers 5.24's shortcut past
    # the shared layers (`_maybe_slice_kv_shared_inputs`) indexes the absent per-layer
    # inputs; asking for the hidden states skips the shortcut, the logits are the same
    hidden = bool(getattr(model.config, "num_kv_shared_layers", 0))
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(np.asarray(ids), dtype=torch.long),
            attention_mask=torch.tensor(np.asarray(mask), dtype=torch.long),
            position_ids=torch.tensor(np.asarray(positions), dtype=torch.long),
            output_hidden_states=hidden,
        )
    return out.logits.float().numpy()
