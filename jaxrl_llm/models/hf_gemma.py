"""Gemma 3 and Gemma 4's parts of the Hugging Face `config.json` translation (`hf_config`,
beside the other families' in `hf_families`): the options their decoders refuse
(`refuse_gemma*_options`), the `ModelConfig` fields their keys map to (`gemma*_fields`)
and the HF keys a config gives back (`gemma_dict`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxrl_llm.errors import UnsupportedModelError
from jaxrl_llm.models.hf_families import rope

if TYPE_CHECKING:
    from jaxrl_llm.models.config import ModelConfig


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
