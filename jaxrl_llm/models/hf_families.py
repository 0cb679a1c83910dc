"""The per-family parts of the Hugging Face `config.json` translation (`hf_config`):
for each family past the plain decoder (Qwen3-MoE, GLM-4.5, Gemma 3 and 4, GPT-OSS, Qwen3.5
and Qwen3-Next)
the options its decoder refuses (`refuse_*_options`, each given `hf_config`'s one-line
`refuse`), the `ModelConfig` fields its keys map to (`*_fields`) and the HF keys a config
gives back (`*_dict`); and the RoPE reading they share with `hf_config` (`rope`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxrl_llm.errors import UnsupportedModelError

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


def refuse_gemma3_options(d: dict, refuse) -> None:
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        refuse(f"hidden_activation={act!r} (only gelu_pytorch_tanh)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(key) is not None:  # Gemma 3 checkpoints set neither
            refuse(f"{key}={d[key]}")
    if d.get("use_bidirectional_attention"):
        refuse("use_bidirectional_attention=true")
    if d.get("attention_bias") or d.get("mlp_bias"):
        refuse("attention_bias / mlp_bias")
    if float(d.get("partial_rotary_factor", 1.0)) != 1.0:
        refuse(f"partial_rotary_factor={d['partial_rotary_factor']}")


def gemma3_fields(d: dict, source: str) -> dict:
    """Gemma 3's layer pattern, window, local RoPE base and query scale from a HF dict.

    `layer_types` (newer configs) or `sliding_window_pattern` (every pattern-th layer is
    global, as transformers derives it); RoPE from the 5.x per-layer-type
    `rope_parameters` or from 4.x `rope_theta` / `rope_local_base_freq` / `rope_scaling`.
    """
    n = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if types is None:
        pattern = int(d.get("sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    params = d.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        theta, local_theta = full.pop("rope_theta", 1e6), local.pop("rope_theta", 1e4)
        if local.get("rope_type", "default") != "default" or len(local) > 1:
            raise UnsupportedModelError(
                f"{source}: RoPE scaling of the sliding layers ({local}) is not supported"
            )
        full.setdefault("rope_type", "default")
        scaling = None if full == {"rope_type": "default"} else tuple(sorted(full.items()))
    else:
        theta, scaling = rope({**d, "rope_theta": d.get("rope_theta", 1e6)})
        local_theta = d.get("rope_local_base_freq", 1e4)
    window = d.get("sliding_window")
    return {
        "layer_types": tuple(types),
        "sliding_window": None if window is None else int(window),
        "rope_theta": float(theta),
        "rope_scaling": scaling,
        "rope_local_theta": float(local_theta),
        "query_pre_attn_scalar": float(d.get("query_pre_attn_scalar", 256)),
    }


# transformers' Gemma4TextConfig when its config.json names none of these
GEMMA4_DEFAULTS = {
    "sliding_window": 512,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1_000_000.0,
        },
    },
}
GEMMA4_GLOBAL_HEAD_DIM = 512  # full-attention layers' head size when the config names none


def refuse_gemma4_options(d: dict, refuse) -> None:
    """What the Gemma 4 text decoder here lacks: every layer KV-shared, a double-wide MLP
    beside the MoE block, per-layer overrides other than the full layers' head size and
    KV heads, bidirectional attention, biases; an MoE block without experts."""
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        refuse(f"hidden_activation={act!r} (only gelu_pytorch_tanh)")
    shared = int(d.get("num_kv_shared_layers") or 0)
    if shared and not 0 < shared < int(d.get("num_hidden_layers") or 0):
        refuse(f"num_kv_shared_layers={shared} (between 1 and num_hidden_layers - 1)")
    if d.get("use_double_wide_mlp") and d.get("enable_moe_block"):
        refuse("use_double_wide_mlp with enable_moe_block")
    if d.get("enable_moe_block"):
        for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            if int(d.get(key) or 0) < 1:
                refuse(f"{key}={d.get(key)} (enable_moe_block needs it >= 1)")
    if d.get("use_bidirectional_attention"):
        refuse(f"use_bidirectional_attention={d['use_bidirectional_attention']!r}")
    if d.get("attention_bias"):
        refuse("attention_bias=true")
    types = set(d.get("layer_types") or ()) - {"sliding_attention", "full_attention"}
    if types:
        refuse(f"layer_types={sorted(types)} (only sliding_attention / full_attention)")
    full = set(_gemma4_types(d)) if "num_hidden_layers" in d else set()
    seen = []
    for layer, over in (d.get("per_layer_config") or {}).items():
        if int(layer) not in full or set(over) - {"head_dim", "num_key_value_heads"}:
            refuse(f"per_layer_config[{layer}]={over} (only full layers' head_dim / KV heads)")
        seen.append(dict(over))
    if any(o != seen[0] for o in seen) or (seen and len(seen) != len(full)):
        refuse(f"per_layer_config={d['per_layer_config']} (full layers alike, all of them)")


def _gemma4_types(d: dict) -> list[int]:
    """The indices of the full-attention layers (the last one always is)."""
    n = int(d["num_hidden_layers"])
    types = list(d.get("layer_types") or [])
    if not types:
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    types[-1] = "full_attention"  # as Gemma4TextConfig forces it
    return [i for i, t in enumerate(types) if t == "full_attention"]


def _gemma4_full_layers(d: dict) -> dict:
    """The full layers' own head size and KV heads, as transformers' Gemma4TextConfig
    derives them: `per_layer_config` when given, else `global_head_dim` (default 512)
    and, with `attention_k_eq_v`, `num_global_key_value_heads`. None for both when those
    layers are like the sliding ones (one stack of attention parameters)."""
    head_dim = int(d.get("head_dim") or 256)
    kv = int(d.get("num_key_value_heads") or d["num_attention_heads"])
    k_eq_v = bool(d.get("attention_k_eq_v"))
    if "per_layer_config" in d:
        over = next(iter((d["per_layer_config"] or {}).values()), {})
        own, own_kv = int(over.get("head_dim", head_dim)), over.get("num_key_value_heads")
    else:
        own = int(d.get("global_head_dim", GEMMA4_GLOBAL_HEAD_DIM))
        own_kv = d.get("num_global_key_value_heads") if k_eq_v else None
    own_kv = kv if own_kv is None else int(own_kv)
    if (own, own_kv, k_eq_v) == (head_dim, kv, False):
        return {}
    return {"global_head_dim": own, "global_kv_heads": own_kv, "k_eq_v": k_eq_v}


def gemma4_fields(d: dict, source: str) -> dict:
    """Gemma 4 text: Gemma 3's layer pattern and per-kind RoPE (the full layers'
    `proportional` one kept in `rope_scaling`), with transformers' defaults (window 512,
    the last layer always full attention); scores unscaled (q and k are RMS-normed),
    values RMS-normed, each layer's output times its `layer_scalar`, RMSNorms scaling by
    the weight itself, the final logits soft-capped; the full layers' own head size, KV
    heads and keys-as-values (`_gemma4_full_layers`); per-layer input embeddings; the MoE
    block (`enable_moe_block`: experts with the "gemma4" router beside the dense MLP in
    every layer); KV sharing (`num_kv_shared_layers`, with `use_double_wide_mlp`)."""
    d = {k: v for k, v in GEMMA4_DEFAULTS.items() if d.get(k) is None} | d
    full = set(_gemma4_types(d))
    types = [
        "full_attention" if i in full else "sliding_attention"
        for i in range(int(d["num_hidden_layers"]))
    ]
    cap = d.get("final_logit_softcapping")
    per_layer = int(d.get("hidden_size_per_layer_input", 256))  # transformers' default
    per_layer_vocab = int(d.get("vocab_size_per_layer_input", 262_144)) if per_layer else 0
    moe = {}
    if d.get("enable_moe_block"):
        moe = {
            "num_experts": int(d["num_experts"]),
            "num_experts_per_tok": int(d["top_k_experts"]),
            "moe_intermediate_size": int(d["moe_intermediate_size"]),
            "norm_topk_prob": True,
            "router": "gemma4",
        }
    return (
        gemma3_fields(d | {"layer_types": types}, source)
        | _gemma4_full_layers(d)
        | {
            "query_pre_attn_scalar": None,
            "final_logit_softcapping": None if cap is None else float(cap),
            "per_layer_input_size": per_layer,
            "per_layer_vocab_size": per_layer_vocab,
            "kv_shared_layers": int(d.get("num_kv_shared_layers") or 0),
            "double_wide_mlp": bool(d.get("use_double_wide_mlp")),
        }
        | moe
    )


def gemma_dict(cfg: ModelConfig, gemma4: bool) -> dict:
    """The keys Gemma 3 and Gemma 4 share: activation, window, layer pattern, per-kind
    RoPE; Gemma 3's query scale, Gemma 4's soft-capping and the head size of every layer."""
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta} | dict(cfg.rope_scaling or ())
    d = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": cfg.sliding_window,
        "layer_types": list(cfg.layer_types or ["full_attention"] * cfg.num_layers),
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta},
        },
    }
    if not gemma4:
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        return d | {"query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar}
    own = {"head_dim": cfg.full_head_dim, "num_key_value_heads": cfg.full_kv_heads}
    full = [i for i, t in enumerate(d["layer_types"]) if t == "full_attention"]
    return d | {
        "final_logit_softcapping": cfg.final_logit_softcapping,
        "hidden_size_per_layer_input": cfg.per_layer_input_size,
        "vocab_size_per_layer_input": cfg.per_layer_vocab_size or cfg.vocab_size,
        # without it transformers gives the full layers a head size of 512
        "per_layer_config": {str(i): own for i in full} if cfg.split_attention else {},
        "attention_k_eq_v": cfg.k_eq_v,
        "enable_moe_block": cfg.moe,
        "num_experts": cfg.num_experts or None,
        "top_k_experts": cfg.num_experts_per_tok or None,
        "moe_intermediate_size": cfg.moe_intermediate_size or None,
        "num_kv_shared_layers": cfg.kv_shared_layers,
        "use_double_wide_mlp": cfg.double_wide_mlp,
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
