"""The translation between a Hugging Face `config.json` and `ModelConfig`'s fields, per
architecture (Llama 3, Mistral, Qwen2, Qwen3, Gemma 3, Gemma 4 text, Qwen3-MoE, GLM-4.5,
GPT-OSS, Qwen3.5, Qwen3-Next).

Reading (`fields_from_hf`) maps each architecture's HF keys onto the one set of
`ModelConfig` fields and refuses, with one line naming the option, anything the decoder
does not implement (sliding windows outside Gemma 3 and GPT-OSS, other MoE families, other
activations, other RoPE variants, logit soft-capping), so a checkpoint never loads into a
model that silently computes something else. Writing (`hf_dict`) gives back the HF dict a
config came from, or builds one transformers loads for a config made from fields.

Reads both the transformers 4.x layout (`rope_theta` + `rope_scaling`) and the 5.x layout
(`rope_parameters`). Kept apart from the dataclass (`models.config`), which calls these
from `ModelConfig.from_hf_dict` / `from_hf_dir` / `to_hf_dict`: the HF names and the
refusals are a topic of their own, and the architecture names here are what both share.
The families past the plain decoder keep their parts in `hf_families` (Gemma in
`hf_gemma`).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from jaxrl_llm.errors import UnsupportedModelError
from jaxrl_llm.models import hf_families as families
from jaxrl_llm.models import hf_gemma as gemma

if TYPE_CHECKING:
    from jaxrl_llm.models.config import ModelConfig

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma4ForCausalLM": "gemma4_text",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Glm4MoeForCausalLM": "glm4_moe",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Qwen3NextForCausalLM": "qwen3_next",
}
_MODEL_TYPE_TO_ARCH = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
GEMMA3 = "Gemma3ForCausalLM"
GEMMA4 = "Gemma4ForCausalLM"
GEMMAS = (GEMMA3, GEMMA4)
# checkpoints with vision / audio towers whose text decoder is one of ours
MULTIMODAL = {
    "Gemma3ForConditionalGeneration": GEMMA3,
    "Gemma4ForConditionalGeneration": GEMMA4,
}
QWEN3_MOE = "Qwen3MoeForCausalLM"
GLM4_MOE = "Glm4MoeForCausalLM"
GPT_OSS = "GptOssForCausalLM"
QWEN3_5 = "Qwen3_5ForCausalLM"
QWEN3_5_MOE = "Qwen3_5MoeForCausalLM"
QWEN3_NEXT = "Qwen3NextForCausalLM"
MOE_ARCHITECTURES = (QWEN3_MOE, GLM4_MOE, GPT_OSS, QWEN3_5_MOE, QWEN3_NEXT)
# Gated DeltaNet and full-attention layers
HYBRID_ARCHITECTURES = (QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT)


def load_config_json(path: str | os.PathLike) -> tuple[dict, str]:
    """The dict in `<path>/config.json` and that file's path (for error messages)."""
    config_path = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path}: no config.json in the model directory")
    with open(config_path, encoding="utf-8") as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_path}: not valid JSON ({e})") from None
    return d, config_path


def fields_from_hf(d: dict, source: str = "config.json") -> dict:
    """The `ModelConfig` fields of a HF config dict (`source` names it in errors),
    refusing what the decoder lacks."""
    arch = _architecture(d, source)
    _refuse_unsupported(d, arch, source)
    try:
        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        rope_theta, scaling = (None, None) if arch in GEMMAS else families.rope(d)
        fields = dict(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", arch in GEMMAS)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(d.get("attention_bias", arch == GPT_OSS)),
            o_bias=arch not in ("Qwen2ForCausalLM", GLM4_MOE)
            and bool(d.get("attention_bias", arch == GPT_OSS)),
            qk_norm=arch in ("Qwen3ForCausalLM", *GEMMAS, QWEN3_MOE)
            or (arch == GLM4_MOE and bool(d.get("use_qk_norm", False))),
            initializer_range=float(d.get("initializer_range", 0.02)),
            hf_config=json.dumps(d, sort_keys=True),
        )
        if arch == GEMMA3:
            fields |= gemma.gemma3_fields(d, source)
        if arch == GEMMA4:
            fields |= gemma.gemma4_fields(d, source)
        if arch == QWEN3_MOE:
            fields |= families.moe_fields(d)
        if arch == GLM4_MOE:
            fields |= families.glm4_moe_fields(d)
        if arch == GPT_OSS:
            fields |= families.gpt_oss_fields(d)
        if arch in HYBRID_ARCHITECTURES:
            fields |= families.qwen3_5_fields(d)
        return fields
    except KeyError as e:
        raise ValueError(f"{source}: required key {e.args[0]!r} is missing") from None


def hf_dict(cfg: ModelConfig) -> dict:
    """The HF config dict of `cfg`: the original one when loaded from HF, else built from
    its fields."""
    if cfg.hf_config:
        return json.loads(cfg.hf_config)
    d = {
        "architectures": [cfg.architecture],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.initializer_range,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
    }
    if cfg.architecture != "Qwen2ForCausalLM":
        d["attention_bias"] = cfg.o_bias
    elif cfg.o_bias or not cfg.qkv_bias:
        raise ValueError("Qwen2 has qkv bias and no output bias; cannot express this config")
    if cfg.architecture == "MistralForCausalLM":
        d["sliding_window"] = None
    if cfg.architecture == QWEN3_MOE:
        d |= {
            "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "norm_topk_prob": cfg.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(cfg.dense_layers),
        }
    if cfg.architecture == GLM4_MOE:
        d |= families.glm4_moe_dict(cfg)
    if cfg.architecture == GPT_OSS:
        del d["rope_theta"], d["rope_scaling"]
        d |= families.gpt_oss_dict(cfg)
    if cfg.hybrid:
        del d["rope_theta"], d["rope_scaling"]
        d |= families.qwen3_5_dict(cfg)
    if cfg.gemma:
        del d["hidden_act"], d["rope_theta"], d["rope_scaling"]
        d |= gemma.gemma_dict(cfg, gemma4=cfg.architecture == GEMMA4)
    return d


def _architecture(d: dict, source: str) -> str:
    archs = d.get("architectures") or []
    if not archs and d.get("model_type") in _MODEL_TYPE_TO_ARCH:
        archs = [_MODEL_TYPE_TO_ARCH[d["model_type"]]]
    if len(archs) != 1:
        raise UnsupportedModelError(
            f"{source}: architectures={archs!r}; expected exactly one of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if archs[0] in MULTIMODAL:
        raise UnsupportedModelError(
            f"{source}: architecture {archs[0]!r} (vision / audio towers) is not supported; "
            f"only its text decoder, {MULTIMODAL[archs[0]]} (a config.json of its "
            "text_config, with the language model's tensors)"
        )
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: architecture {archs[0]!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return archs[0]


def _refuse_unsupported(d: dict, arch: str, source: str) -> None:
    """One clear line for each option the decoder would otherwise silently ignore."""

    def refuse(what: str):
        raise UnsupportedModelError(f"{source}: {what} is not supported ({arch})")

    if arch == GEMMA3:
        gemma.refuse_gemma3_options(d, refuse)
        return
    if arch == GEMMA4:
        gemma.refuse_gemma4_options(d, refuse)
        return
    if arch == GPT_OSS:
        families.refuse_gpt_oss_options(d, refuse)
        return
    if arch in HYBRID_ARCHITECTURES:
        families.refuse_qwen3_5_options(d, refuse)
        return
    if d.get("hidden_act", "silu") not in ("silu", "swish"):
        refuse(f"hidden_act={d['hidden_act']!r} (only silu)")
    if d.get("mlp_bias"):
        refuse("mlp_bias=true")
    if arch == QWEN3_MOE:
        families.refuse_moe_options(d, refuse)
    elif arch == GLM4_MOE:
        families.refuse_glm4_moe_options(d, refuse)
    elif any(k in d for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        refuse("mixture-of-experts")
    if d.get("pretraining_tp", 1) not in (1, None):
        refuse(f"pretraining_tp={d['pretraining_tp']}")
    window = d.get("sliding_window")
    uses_window = d.get("use_sliding_window", arch == "MistralForCausalLM")
    if uses_window and window is not None:
        if int(window) < int(d.get("max_position_embeddings", 0)):
            refuse(f"sliding-window attention (sliding_window={window})")
    layer_types = set(d.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        refuse(f"layer_types={sorted(layer_types)} (only full_attention)")
    if float(d.get("partial_rotary_factor", 1.0)) != 1.0 and arch != GLM4_MOE:
        refuse(f"partial_rotary_factor={d['partial_rotary_factor']}")
