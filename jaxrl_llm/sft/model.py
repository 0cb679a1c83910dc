"""The model SFT trains: an HF model (`model.path`), or a new random one (`sft.new_model`).

    tokenizer, tokenizer_dir = load_tokenizer(config)
    model_cfg, params = init_model(config, tokenizer, mesh)   # sharded over the mesh

A new model's vocabulary is the tokenizer's, and its BOS / EOS / pad ids go into the
exported config.json, so `transformers.generate` stops where the sampler does.
"""

from __future__ import annotations

import json

from jaxrl_llm import config as config_lib
from jaxrl_llm import models
from jaxrl_llm.config import ConfigError
from jaxrl_llm.sft.config import check_lengths


def load_tokenizer(config):
    """-> (tokenizer, its directory): `model.tokenizer`, or the model's own."""
    m = config.model
    if m.tokenizer:
        key, path = "model.tokenizer", m.tokenizer
    else:
        key, path = "model.path", m.path
    path = config_lib.resolve_model_path(path, key, need_config=False)
    tokenizer = models.builtin.load_tokenizer(path, key)
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"{key}: the tokenizer in {path} has no EOS to end completions with")
    return tokenizer, path


def new_model_config(new_model, tokenizer) -> models.ModelConfig:
    """A ModelConfig sized by `sft.new_model`, vocabulary = the tokenizer's."""
    cfg = models.ModelConfig(
        architecture=new_model.architecture,
        vocab_size=len(tokenizer),
        hidden_size=new_model.hidden_size,
        intermediate_size=new_model.intermediate_size,
        num_layers=new_model.num_layers,
        num_heads=new_model.num_heads,
        num_kv_heads=new_model.num_kv_heads,
        head_dim=new_model.head_dim,
        max_position_embeddings=new_model.max_position_embeddings,
        tie_word_embeddings=new_model.tie_word_embeddings,
        rope_theta=float(new_model.rope_theta),
        initializer_range=float(new_model.initializer_range),
        rms_norm_eps=1e-6,
        qk_norm=new_model.architecture == "Qwen3ForCausalLM",
        qkv_bias=new_model.architecture == "Qwen2ForCausalLM",
    )
    hf = cfg.to_hf_dict()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        hf[name] = getattr(tokenizer, name)
    return cfg.replace(hf_config=json.dumps(hf, sort_keys=True))


def init_model(config, tokenizer, mesh):
    """-> (ModelConfig, params on the mesh): loaded from model.path, or new and random
    (seed `train.seed`). Raises ConfigError when the sequences do not fit its context."""
    m = config.model
    runtime = config_lib.model_runtime(config) | {"scan_layers": bool(m.scan_layers)}
    if m.path:
        path = config_lib.resolve_model_path(m.path)
        check_lengths(config, models.builtin.model_config(path))
        return models.builtin.load_model(path, mesh=mesh, dtype=m.dtype, **runtime)
    try:
        cfg = new_model_config(config.sft.new_model, tokenizer).replace(**runtime)
    except ValueError as err:
        raise ConfigError(f"sft.new_model: {err}") from None
    check_lengths(config, cfg)
    return cfg, models.init_params(cfg, config.train.seed, mesh, m.dtype)
