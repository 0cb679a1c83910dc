"""The per-family parts of the Hugging Face `config.json` translation (`hf_config`):
for each family past the plain decoder (Qwen3-MoE, GLM-4.5, GPT-OSS, Qwen3.5 and
Qwen3-Next; Gemma 3 and 4 in `hf_gemma`) the options its decoder refuses
(`refuse_*_options`, each given `hf_config`'s one-line `refuse`), the `ModelConfig`
fields its keys map to (`*_fields`) and the HF keys a config gives back (`*_dict`); and
the RoPE reading they share with `hf_config` (`rope`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxrl_llm.models.config import ModelConfig


def rope(d: dict) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(theta, scaling) from either `rope_parameters` (5.x) or `rope_scaling` (4.x)."""
    params = dict(d.get("rope_parameters") or {})
    scaling = dict(d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    params.pop("partial_rotary_factor", None)  # GLM-4.5: `partial_rotary_factor` field
    merged = {**scaling, **params}
    if "type" in merged and "rope_type" not in merged:  # 4.x spelling
        merged["rope_type"] = merged.pop("type")
    merged.pop("type", None)
    merged.setdefault("rope_type", "default")
    if merged["rope_type"] == "default" and len(merged) == 1:
        return theta, None
    return theta, tuple(sorted(merged.items()))


def glm4_moe_dict(cfg: ModelConfig) -> dict:
    k = len(cfg.dense_layers)
    if cfg.dense_layers != tuple(range(k)) or cfg.router != "sigmoid" or cfg.o_bias:
        raise ValueError(
            "Glm4MoeForCausalLM has the sigmoid router, its first layers dense "
            f"(dense_layers={list(cfg.dense_layers)}) and no output bias; cannot "
            "express this config"
        )
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {
        "attention_bias": cfg.qkv_bias,
        "use_qk_norm": cfg.qk_norm,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "n_shared_experts": cfg.n_shared_experts,
        "first_k_dense_replace": k,
        "num_nextn_predict_layers": cfg.mtp_layers,
        "rope_parameters": rope
        | dict(cfg.rope_scaling or ())
        | {"partial_rotary_factor": cfg.partial_rotary_factor},
    }


def num_experts(d: dict) -> int:
    """Qwen3-MoE's expert count: `num_experts` in its config.json (transformers 5 writes
    `num_local_experts`)."""
    return int(d.get("num_experts", d.get("num_local_experts", 0)) or 0)


def refuse_moe_options(d: dict, refuse) -> None:
    """What the Qwen3-MoE decoder lacks: shared experts, and a model without experts."""
    if num_experts(d) < 1:
        refuse("num_experts=0")
    if int(d.get("decoder_sparse_step", 1)) < 1:
        refuse(f"decoder_sparse_step={d['decoder_sparse_step']} (must be >= 1)")
    for key in ("shared_expert_intermediate_size", "n_shared_experts"):
        if d.get(key):
            refuse(f"{key}={d[key]} (shared experts)")


def moe_fields(d: dict) -> dict:
    """Qwen3-MoE: layer i is sparse unless it is in `mlp_only_layers` or (i + 1) is not a
    multiple of `decoder_sparse_step` (transformers' Qwen3MoeDecoderLayer)."""
    n, step = int(d["num_hidden_layers"]), int(d.get("decoder_sparse_step", 1))
    only = {int(i) for i in d.get("mlp_only_layers") or ()}
    dense = tuple(i for i in range(n) if i in only or (i + 1) % step)
    return {
        "num_experts": num_experts(d),
        "num_experts_per_tok": int(d["num_experts_per_tok"]),
        "moe_intermediate_size": int(d["moe_intermediate_size"]),
        "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
        "dense_layers": dense,
    }


def refuse_glm4_moe_options(d: dict, refuse) -> None:
    """GLM-4.5's router is DeepSeek-V3's `noaux_tc` (sigmoid scores + selection bias)."""
    if int(d.get("n_routed_experts", d.get("num_local_experts", 0)) or 0) < 1:
        refuse("n_routed_experts=0")
    if d.get("scoring_func", "sigmoid") != "sigmoid":
        refuse(f"scoring_func={d['scoring_func']!r} (only sigmoid)")
    if d.get("topk_method", "noaux_tc") != "noaux_tc":
        refuse(f"topk_method={d['topk_method']!r} (only noaux_tc)")


def glm4_moe_fields(d: dict) -> dict:
    """GLM-4.5: every layer from `first_k_dense_replace` on is MoE; partial rotary from
    `rope_parameters` (5.x) or the top level (4.x); transformers' default is 0.5."""
    n, first = int(d["num_hidden_layers"]), int(d.get("first_k_dense_replace", 1))
    params = d.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.5))
    return {
        "num_experts": int(d.get("n_routed_experts", d.get("num_local_experts", 0))),
        "num_experts_per_tok": int(d["num_experts_per_tok"]),
        "moe_intermediate_size": int(d["moe_intermediate_size"]),
        "norm_topk_prob": bool(d.get("norm_topk_prob", True)),
        "router": "sigmoid",
        "n_group": int(d.get("n_group", 1)),
        "topk_group": int(d.get("topk_group", 1)),
        "routed_scaling_factor": float(d.get("routed_scaling_factor", 1.0)),
        "n_shared_experts": int(d.get("n_shared_experts", 1)),
        "dense_layers": tuple(range(min(first, n))),
        "partial_rotary_factor": float(factor),
        "mtp_layers": int(d.get("num_nextn_predict_layers", d.get("num_mtp_layers", 0)) or 0),
    }


# transformers' GptOssConfig when its config.json names no RoPE
GPT_OSS_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def refuse_gpt_oss_options(d: dict, refuse) -> None:
    """GPT-OSS's released checkpoints store the experts in MXFP4 (`quantization_config`);
    the decoder reads unquantized tensors only (transformers dequantizes on load with
    `Mxfp4Config(dequantize=True)`; save that model to get them)."""
    if d.get("quantization_config"):
        method = (d["quantization_config"] or {}).get("quant_method", "?")
        refuse(f"quantization_config (quant_method={method!r}; dequantize the experts first)")
    if int(d.get("num_local_experts", d.get("num_experts", 0)) or 0) < 1:
        refuse("num_local_experts=0")
    types = set(d.get("layer_types") or ["sliding_attention"]) - {
        "sliding_attention",
        "full_attention",
    }
    if types:
        refuse(f"layer_types={sorted(types)} (only sliding_attention / full_attention)")


def gpt_oss_fields(d: dict) -> dict:
    """GPT-OSS: every layer MoE (experts of width `intermediate_size`, the router's top-k
    logits softmaxed), attention sinks, biases everywhere, layers alternating sliding /
    full from a sliding first one (transformers' default `layer_types`), one YaRN RoPE
    for all layers."""
    n = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    window = d.get("sliding_window", 128)
    if not d.get("rope_parameters") and not d.get("rope_scaling"):
        d = d | {"rope_parameters": GPT_OSS_DEFAULT_ROPE}
    theta, scaling = rope({"rope_theta": 150000.0, **d})
    return {
        "num_experts": int(d.get("num_local_experts", d.get("num_experts", 0))),
        "num_experts_per_tok": int(d["num_experts_per_tok"]),
        "moe_intermediate_size": int(d["intermediate_size"]),
        "norm_topk_prob": True,
        "router": "topk_softmax",
        "layer_types": tuple(types),
        "sliding_window": None if window is None else int(window),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "attention_sinks": True,
        "expert_bias": True,
        "swiglu_limit": float(d.get("swiglu_limit", 7.0)),
        "swiglu_alpha": float(d.get("swiglu_alpha", 1.702)),
    }


def gpt_oss_dict(cfg: ModelConfig) -> dict:
    if cfg.dense_layers or cfg.router != "topk_softmax" or not cfg.expert_bias:
        raise ValueError(
            "GptOssForCausalLM has every layer MoE, the top-k softmax router and expert "
            "biases; cannot express this config"
        )
    if cfg.qkv_bias != cfg.o_bias or cfg.qk_norm or not cfg.attention_sinks:
        raise ValueError(
            "GptOssForCausalLM has attention sinks, no q/k norm and one attention_bias "
            "for q/k/v and o; cannot express this config"
        )
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta} | dict(cfg.rope_scaling or ())
    return {
        "attention_bias": cfg.o_bias,
        "intermediate_size": cfg.moe_intermediate_size,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "layer_types": list(cfg.layer_types or ["full_attention"] * cfg.num_layers),
        "sliding_window": cfg.sliding_window,
        "swiglu_limit": cfg.swiglu_limit,
        "swiglu_alpha": cfg.swiglu_alpha,
        "rope_parameters": rope,
    }


def refuse_qwen3_5_options(d: dict, refuse) -> None:
    """What the Qwen3.5 text decoder lacks: other activations, attention biases, RoPE
    scaling; Qwen3.5-MoE without experts."""
    if d.get("hidden_act", "silu") not in ("silu", "swish"):
        refuse(f"hidden_act={d['hidden_act']!r} (only silu)")
    if d.get("attention_bias"):
        refuse("attention_bias=true")
    rope = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        refuse(f"rope_type={rope.get('rope_type', rope.get('type'))!r} (only default)")
    if d.get("model_type") in ("qwen3_5_moe_text", "qwen3_next") and num_experts(d) < 1:
        refuse("num_experts=0")
    if int(d.get("decoder_sparse_step", 1)) < 1:
        refuse(f"decoder_sparse_step={d['decoder_sparse_step']} (must be >= 1)")
    types = set(d.get("layer_types") or ())
    if types - {"linear_attention", "full_attention"}:
        refuse(f"layer_types={sorted(types)} (only linear_attention, full_attention)")


def qwen3_5_fields(d: dict) -> dict:
    """Qwen3.5 / Qwen3.5-MoE text: Gated DeltaNet layers (`layer_types`, else every
    `full_attention_interval`-th layer full attention), gated full attention with q/k
    norms and partial rotary (`rope_parameters.partial_rotary_factor`, default 0.25),
    (1 + w) RMSNorms. MoE: every layer, renormalised top-k, one gated shared expert.
    Qwen3-Next (`qwen3_next`, the same decoder) has Qwen3-MoE's dense layers
    (`mlp_only_layers`, `decoder_sparse_step`) and `norm_topk_prob`."""
    n = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if not types:
        every = int(d.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    rope = d.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
    fields = {
        "layer_types": tuple(types),
        "rope_scaling": None,  # text positions: the three M-RoPE sections coincide
        "partial_rotary_factor": float(factor),
        "qk_norm": True,
        "attn_output_gate": True,
        "zero_centered_norm": True,
        "linear_num_key_heads": int(d.get("linear_num_key_heads", 16)),
        "linear_num_value_heads": int(d.get("linear_num_value_heads", 32)),
        "linear_key_head_dim": int(d.get("linear_key_head_dim", 128)),
        "linear_value_head_dim": int(d.get("linear_value_head_dim", 128)),
        "linear_conv_kernel": int(d.get("linear_conv_kernel_dim", 4)),
    }
    qwen3_next = d.get("model_type") == "qwen3_next"
    if d.get("model_type") == "qwen3_5_moe_text" or qwen3_next or num_experts(d):
        shared = int(d.get("shared_expert_intermediate_size", 0) or 0)
        if qwen3_next:  # Qwen3-MoE's dense layers
            fields["dense_layers"] = moe_fields(d)["dense_layers"]
        fields |= {
            "num_experts": num_experts(d),
            "num_experts_per_tok": int(d["num_experts_per_tok"]),
            "moe_intermediate_size": int(d["moe_intermediate_size"]),
            "norm_topk_prob": bool(d.get("norm_topk_prob", True)) if qwen3_next else True,
            "n_shared_experts": 1 if shared else 0,
            "shared_expert_size": shared,
            "shared_expert_gate": bool(shared),
        }
    return fields


def qwen3_5_dict(cfg: ModelConfig) -> dict:
    d = {
        "layer_types": list(cfg.layer_types),
        "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary_factor,
        },
    }
    if cfg.moe:
        d |= {
            "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "shared_expert_intermediate_size": cfg.shared_intermediate_size,
        }
    if cfg.model_type == "qwen3_next":
        d |= {
            "norm_topk_prob": cfg.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(cfg.dense_layers),
        }
    elif cfg.moe and (cfg.dense_layers or not cfg.norm_topk_prob):
        raise ValueError(
            f"{cfg.architecture} has experts in every layer, their top-k renormalised; "
            f"cannot express dense_layers={list(cfg.dense_layers)}, "
            f"norm_topk_prob={cfg.norm_topk_prob} (Qwen3NextForCausalLM can)"
        )
    return d
