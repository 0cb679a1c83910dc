"""The checks that keep a `config.ModelConfig`'s fields consistent (`check`, run when
one is built), and the names they accept."""

from __future__ import annotations

from jaxrl_llm.models.hf_config import (
    GEMMA4,
    GPT_OSS,
    HYBRID_ARCHITECTURES,
    MOE_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    UnsupportedModelError,
)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# YaRN, checked against transformers for GPT-OSS (its RoPE) only; `proportional` (the
# first rotated pairs of the whole head's, `layer_math.rope_frequencies`) for Gemma 4's
EXTRA_ROPE_TYPES = {GPT_OSS: ("yarn",), GEMMA4: ("proportional",)}
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
# HF's names (Gemma 3's and Qwen3.5's `layer_types`)
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
# models.moe: Qwen3-MoE's, DeepSeek-V3's (GLM-4.5), GPT-OSS's (softmax over the top-k logits),
# Gemma 4's (a normed, scaled input; renormalised weights times a scale per expert)
ROUTERS = ("softmax", "sigmoid", "topk_softmax", "gemma4")
MOE_IMPLS = ("auto", "gmm", "ragged", "blocked", "dense")  # models/moe.py, moe_kernels.py
LINEAR_IMPLS = ("auto", "xla", "pallas")  # models/gated_deltanet.py, deltanet_kernel.py
# model.attention (`attention.IMPLEMENTATIONS`; kept here so the config needs no jax)
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "blockwise", "cudnn", "pallas")


def check(cfg) -> None:
    """Raises on fields that do not fit together: one error naming the key."""
    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {cfg.architecture!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(
            f"num_attention_heads={cfg.num_heads} is not a multiple of "
            f"num_key_value_heads={cfg.num_kv_heads}"
        )
    if cfg.remat not in REMAT_POLICIES:
        raise ValueError(f"remat={cfg.remat!r}; expected one of {REMAT_POLICIES}")
    _attention(cfg)
    scaling = dict(cfg.rope_scaling or ())
    types = SUPPORTED_ROPE_TYPES + EXTRA_ROPE_TYPES.get(cfg.architecture, ())
    if scaling.get("rope_type", "default") not in types:
        raise UnsupportedModelError(
            f"rope type {scaling['rope_type']!r} is not supported; supported: {', '.join(types)}"
        )
    cap = cfg.final_logit_softcapping
    if cap is not None and not cap > 0:
        raise ValueError(f"final_logit_softcapping={cap}: must be > 0 (or None)")
    _layer_types(cfg)
    _moe(cfg)
    _split_attention(cfg)
    _per_layer_inputs(cfg)
    _kv_sharing(cfg)


def _kv_sharing(cfg) -> None:
    n = cfg.kv_shared_layers
    if not n and not cfg.double_wide_mlp:
        return
    if not cfg.gemma4:
        raise ValueError("kv_shared_layers / double_wide_mlp: only Gemma 4 shares keys/values")
    if not 0 < n < cfg.num_layers:
        raise ValueError(
            f"kv_shared_layers={n}: between 1 and num_layers - 1 = {cfg.num_layers - 1}"
        )
    types = cfg.layer_types or ("full_attention",) * cfg.num_layers
    own = set(types[: cfg.num_layers - n])
    if set(types[cfg.num_layers - n :]) - own:
        raise ValueError(
            f"kv_shared_layers={n}: a shared layer's type has no earlier layer of its "
            f"type to take keys/values from (layer_types={list(types)})"
        )
    if cfg.double_wide_mlp and cfg.moe:
        raise UnsupportedModelError(
            "use_double_wide_mlp with enable_moe_block: not supported (Gemma 4's "
            "MoE block beside a double-wide MLP)"
        )
    if cfg.lora is not None:
        raise UnsupportedModelError(
            "model.lora: adapters on Gemma 4 with KV sharing (num_kv_shared_layers) "
            "are not supported"
        )


def _per_layer_inputs(cfg) -> None:
    P, Vp = cfg.per_layer_input_size, cfg.per_layer_vocab_size
    if P and not cfg.gemma4:
        raise ValueError("per_layer_input_size: only Gemma 4 has per-layer input embeddings")
    if P < 0 or (P and Vp < 1):
        raise ValueError(
            f"per_layer_input_size={P}, per_layer_vocab_size={Vp}: both >= 1 (or size 0)"
        )


def _split_attention(cfg) -> None:
    if not cfg.split_attention and not (cfg.global_kv_heads or cfg.k_eq_v):
        return
    if not cfg.gemma4 or not cfg.split_attention:
        raise ValueError(
            "global_head_dim / global_kv_heads / k_eq_v: only Gemma 4, with global_head_dim"
        )
    if cfg.global_head_dim < 2 or cfg.global_head_dim % 2:
        raise ValueError(f"global_head_dim={cfg.global_head_dim}: a positive even size")
    if cfg.num_heads % cfg.full_kv_heads:
        raise ValueError(
            f"num_attention_heads={cfg.num_heads} is not a multiple of the full layers' "
            f"KV heads ({cfg.full_kv_heads})"
        )
    if cfg.lora is not None:
        raise UnsupportedModelError(
            "model.lora: adapters on Gemma 4 with full layers of their own head size "
            "(global_head_dim) are not supported"
        )


def _moe(cfg) -> None:
    if cfg.moe_impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl={cfg.moe_impl!r}; expected one of {MOE_IMPLS}")
    if (cfg.architecture in MOE_ARCHITECTURES) != cfg.moe and not cfg.gemma4:
        raise ValueError(f"num_experts={cfg.num_experts} does not fit {cfg.architecture}")
    rot = cfg.head_dim * cfg.partial_rotary_factor
    if not 0 < cfg.partial_rotary_factor <= 1 or int(rot) % 2:
        raise ValueError(
            f"partial_rotary_factor={cfg.partial_rotary_factor}: head_dim times it must "
            "be a positive even number of dimensions"
        )
    if not cfg.moe:
        if cfg.expert_bias or cfg.swiglu_limit:
            raise ValueError("expert_bias / swiglu_limit: only a mixture-of-experts model")
        return
    if cfg.router not in ROUTERS:
        raise ValueError(f"router={cfg.router!r}; expected one of {ROUTERS}")
    if (cfg.router == "gemma4") != cfg.gemma4:
        raise ValueError(
            f'router={cfg.router!r}: Gemma 4\'s experts take its router "gemma4", and '
            "only Gemma 4 has it"
        )
    extra = cfg.dense_layers, cfg.n_shared_experts, cfg.expert_bias, cfg.swiglu_limit
    if cfg.gemma4 and any(extra):
        raise ValueError(
            f"dense_layers / n_shared_experts / expert_bias / swiglu_limit = {extra}: "
            "Gemma 4 has experts in every layer, beside its dense MLP, without these"
        )
    if sorted(set(cfg.dense_layers)) != list(cfg.dense_layers) or not all(
        0 <= i < cfg.num_layers for i in cfg.dense_layers
    ):
        raise ValueError(
            f"dense_layers={list(cfg.dense_layers)}: expected sorted distinct layer "
            f"indices below num_layers={cfg.num_layers}"
        )
    E, G = cfg.num_experts, cfg.n_group
    if cfg.router == "sigmoid" and (
        E % G
        or E // G < 2
        or not 1 <= cfg.topk_group <= G
        or cfg.num_experts_per_tok > cfg.topk_group * (E // G)
    ):
        raise ValueError(
            f"n_group={G}, topk_group={cfg.topk_group}: the {E} experts must split "
            "into n_group groups of >= 2, topk_group in [1, n_group], and the chosen "
            f"groups must hold num_experts_per_tok={cfg.num_experts_per_tok} experts"
        )
    if not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
        raise ValueError(
            f"num_experts_per_tok={cfg.num_experts_per_tok}: must be in "
            f"[1, num_experts={cfg.num_experts}]"
        )
    if cfg.moe_intermediate_size < 1:
        raise ValueError(f"moe_intermediate_size={cfg.moe_intermediate_size}: must be >= 1")
    if cfg.lora is not None and set(cfg.lora.targets) & {"gate", "up", "down"}:
        raise ValueError(
            f"lora targets={cfg.lora.targets!r}: a mixture-of-experts model adapts only "
            "its attention projections (set model.lora.targets to some of q, k, v, o)"
        )


def _attention(cfg) -> None:
    if cfg.attention not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"model.attention={cfg.attention!r}: expected one of {ATTENTION_IMPLEMENTATIONS}"
        )
    if cfg.attention_block < 1:
        raise ValueError(f"model.attention_block={cfg.attention_block}: must be >= 1")
    if cfg.prefill_chunk < 0:
        raise ValueError(f"rollout.prefill_chunk={cfg.prefill_chunk}: must be >= 0")
    if cfg.attention_sinks and cfg.attention in ("cudnn", "pallas"):
        raise UnsupportedModelError(
            f"model.attention={cfg.attention!r}: that kernel has no attention sinks "
            "(this model has them); use 'auto', 'blockwise' or 'xla'"
        )
    if cfg.attention == "pallas" and cfg.windowed:
        raise UnsupportedModelError(
            "model.attention='pallas' cannot do sliding-window layers (this model has "
            "them); use 'auto', 'blockwise' or 'xla'"
        )


def _layer_types(cfg) -> None:
    types = cfg.layer_types
    if types is None:
        return
    if len(types) != cfg.num_layers or set(types) - set(LAYER_TYPES):
        raise ValueError(f"layer_types={list(types)}: expected {cfg.num_layers} of {LAYER_TYPES}")
    if "sliding_attention" in types and not (cfg.sliding_window or 0) > 0:
        raise ValueError(f"sliding_window={cfg.sliding_window}: sliding layers need >= 1")
    if ("linear_attention" in types) != (cfg.architecture in HYBRID_ARCHITECTURES):
        raise ValueError(f"layer_types={list(types)} does not fit {cfg.architecture}")
    if cfg.hybrid:
        _linear(cfg)


def _linear(cfg) -> None:
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if min(nk, nv, cfg.linear_key_head_dim, cfg.linear_value_head_dim) < 1 or nv % nk:
        raise ValueError(
            f"linear_num_key_heads={nk}, linear_num_value_heads={nv}: both >= 1, the "
            "value heads a multiple of the key heads, head dims >= 1"
        )
    if cfg.linear_impl not in LINEAR_IMPLS:
        raise ValueError(f"model.linear_impl={cfg.linear_impl!r}: expected one of {LINEAR_IMPLS}")
    if cfg.linear_conv_kernel < 1 or cfg.linear_chunk < 1:
        raise ValueError(
            f"linear_conv_kernel={cfg.linear_conv_kernel}, model.linear_chunk="
            f"{cfg.linear_chunk}: both must be >= 1"
        )
    if cfg.lora is not None:
        raise UnsupportedModelError(
            "model.lora: adapters on a hybrid (Gated DeltaNet) model are not supported"
        )
