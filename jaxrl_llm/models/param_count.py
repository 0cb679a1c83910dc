"""Parameter counts of a `ModelConfig` from its fields alone, as `sum(p.size for p in
params)` would give for the model it builds (`ModelConfig.num_params`), and the ones a
token reads (`active_params`: MoE's k of E experts), what model FLOPs are made of."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxrl_llm.models.config import ModelConfig


def num_params(cfg: ModelConfig, include_embeddings: bool = True) -> int:
    """Parameter count, as `sum(p.size for p in params)` would give."""
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    kinds = cfg.attention_kinds
    n_linear = sum(k == "linear" for k in kinds)
    layer = (4 if cfg.gemma else 2) * d + (1 if cfg.gemma4 else 0)
    sparse = cfg.num_sparse_layers
    n = cfg.num_layers * layer + kinds.count("softmax") * _attention_params(cfg, h)
    n -= (kinds.count("softmax") - cfg.cache_layers()) * _own_kv_params(cfg, h)
    if cfg.split_attention:
        H, K = cfg.full_head_dim, cfg.full_kv_heads
        n += kinds.count("wide") * _attention_params(cfg, H, K, cfg.k_eq_v)
        n -= (kinds.count("wide") - cfg.cache_layers("wide")) * _own_kv_params(
            cfg, H, K, cfg.k_eq_v
        )
    # the dense MLP's layers (Gemma 4's double-wide ones twice over) and final norm
    n += (cfg.num_layers - sparse + cfg.mlp_kinds.count("double")) * 3 * d * f + d
    if n_linear:
        nv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        conv = cfg.linear_conv_dim
        per = d * conv + d * nv * dv + 2 * d * nv + conv * cfg.linear_conv_kernel
        n += n_linear * (per + 2 * nv + dv + nv * dv * d)
    if sparse:
        E, fm = cfg.num_experts, cfg.moe_intermediate_size
        per = d * E + 3 * d * fm * E + 3 * d * cfg.shared_intermediate_size
        per += E if cfg.router in ("sigmoid", "topk_softmax") else 0  # the router's bias
        # Gemma 4: the router's input scale, a scale per expert, three more norms
        per += E + 4 * d if cfg.router == "gemma4" else 0
        per += E * (2 * fm + d) if cfg.expert_bias else 0
        per += d if cfg.shared_expert_gate else 0
        n += sparse * per
    if cfg.per_layer_input_size:  # the model's projection and norm, each layer's
        P, L = cfg.per_layer_input_size, cfg.num_layers
        n += d * L * P + P + L * (2 * d * P + d)
        n += cfg.per_layer_vocab_size * L * P if include_embeddings else 0
    if include_embeddings:
        n += cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2)
    elif not cfg.tie_word_embeddings:
        n += cfg.vocab_size * d  # the output projection is a matmul, count it
    return n


def _own_kv_params(cfg: ModelConfig, h: int, kv: int | None = None, k_eq_v: bool = False) -> int:
    """Of `_attention_params`, those of keys and values (a KV-shared layer has none)."""
    kv = kv or cfg.num_kv_heads
    n = cfg.hidden_size * h * (kv if k_eq_v else 2 * kv)
    return n + (2 * kv * h if cfg.qkv_bias else 0) + (h if cfg.qk_norm else 0)


def _attention_params(cfg: ModelConfig, h: int, kv: int | None = None, k_eq_v: bool = False) -> int:
    """One attention layer's parameters with heads of h and kv KV heads (default
    `num_kv_heads`); k_eq_v: no value projection."""
    d, kv = cfg.hidden_size, kv or cfg.num_kv_heads
    q_heads = cfg.num_heads * (2 if cfg.attn_output_gate else 1)
    kv_proj = kv if k_eq_v else 2 * kv
    n = d * h * (q_heads + cfg.num_heads + kv_proj)
    n += (cfg.num_heads + 2 * kv) * h if cfg.qkv_bias else 0
    n += d if cfg.o_bias else 0
    n += 2 * h if cfg.qk_norm else 0
    return n + (cfg.num_heads if cfg.attention_sinks else 0)


def active_params(cfg: ModelConfig, include_embeddings: bool = True) -> int:
    """Parameters one token reads: `num_params` with only k of the E experts counted
    (all of them for a dense model). What the model FLOPs of a token are made of."""
    n = num_params(cfg, include_embeddings)
    if cfg.moe:
        idle = cfg.num_experts - cfg.num_experts_per_tok
        d, f = cfg.hidden_size, cfg.moe_intermediate_size
        per = 3 * d * f + ((2 * f + d) if cfg.expert_bias else 0)
        n -= cfg.num_sparse_layers * idle * per
    return n
