"""Decoder-only language models: config, parameters, forward paths and HF checkpoints.

from jaxrl_llm import models
cfg, params = models.load_hf(path, mesh=None, dtype="float32")
cfg, params = models.load_gguf(file, mesh=None, dtype="float32")   # llama.cpp's format
tokenizer = models.load_gguf_tokenizer(file)
logits = models.logits(cfg, params, input_ids, attention_mask)  # [B, T, V] float32
models.save_hf(cfg, params, out_dir, tokenizer_dir=None)
"""

from jaxrl_llm.models import builtin as builtin  # model paths: built-in names, GGUF, HF
from jaxrl_llm.models import lora as lora  # LoRA adapters: split, combine, merge, PEFT
from jaxrl_llm.models.config import LoraConfig, ModelConfig
from jaxrl_llm.models.gguf_io import load_gguf, load_gguf_tokenizer
from jaxrl_llm.models.hf_config import SUPPORTED_ARCHITECTURES, UnsupportedModelError
from jaxrl_llm.models.hf_io import CheckpointError, load_hf, save_hf
from jaxrl_llm.models.kv_cache import KVCache, cache_rows, grow_cache, init_cache
from jaxrl_llm.models.moe import ROUTE_DTYPE, router_agreement
from jaxrl_llm.models.params import (
    ParamSpec,
    count_params,
    init_params,
    param_shardings,
    param_specs,
)
from jaxrl_llm.models.partitioning import DEFAULT_RULES, logical_to_sharding, logical_to_spec
from jaxrl_llm.models.transformer import (
    decode_step,
    default_positions,
    extend,
    forward,
    forward_after_prefix,
    last_hidden,
    layer_params,
    logits,
    paged_forward,
    prefill,
    project,
    unembed_matrix,
)

__all__ = [
    "DEFAULT_RULES",
    "SUPPORTED_ARCHITECTURES",
    "CheckpointError",
    "KVCache",
    "LoraConfig",
    "ModelConfig",
    "ParamSpec",
    "ROUTE_DTYPE",
    "UnsupportedModelError",
    "count_params",
    "decode_step",
    "default_positions",
    "extend",
    "forward",
    "forward_after_prefix",
    "cache_rows",
    "grow_cache",
    "init_cache",
    "init_params",
    "last_hidden",
    "layer_params",
    "load_gguf",
    "load_gguf_tokenizer",
    "load_hf",
    "logical_to_sharding",
    "logical_to_spec",
    "logits",
    "paged_forward",
    "param_shardings",
    "param_specs",
    "prefill",
    "project",
    "router_agreement",
    "save_hf",
    "unembed_matrix",
]
