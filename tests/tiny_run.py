"""A tiny model directory and a tiny trainer config, shared by the trainer tests (and by
the multi-process test's child processes, which import this file by path)."""

import os

from jaxrl_llm import assets, models
from jaxrl_llm import config as config_lib

TOKENIZER = os.path.join(os.path.dirname(assets.__file__), "arithmetic_tokenizer")


def tiny_model_config(**overrides) -> models.ModelConfig:
    """The tests' tiny random Qwen3 (2 layers, hidden 32, GQA 4/2 heads, QK-norm, vocab 64);
    `overrides` replace any `models.ModelConfig` field."""
    fields = dict(
        architecture="Qwen3ForCausalLM",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qk_norm=True,
    )
    return models.ModelConfig(**(fields | overrides))


def tiny_glm_config(**overrides) -> models.ModelConfig:
    """A tiny GLM-4.5-like MoE: q/k norms, partial rotary, qkv bias, sigmoid-routed experts
    (group-limited) with a shared expert, and a dense first layer (two runs of alike
    layers)."""
    fields = dict(
        architecture="Glm4MoeForCausalLM",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        initializer_range=0.2,
        router="sigmoid",
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        n_shared_experts=1,
        norm_topk_prob=True,
        dense_layers=(0,),
        num_layers=3,
        partial_rotary_factor=0.5,
        qkv_bias=True,
    )
    return tiny_model_config(**(fields | overrides))


def tiny_gemma3_config(**overrides) -> models.ModelConfig:
    """A tiny random Gemma 3: 3 layers (sliding, sliding, global), a window of 4 tokens."""
    fields = dict(
        architecture="Gemma3ForCausalLM",
        layer_types=("sliding_attention", "sliding_attention", "full_attention"),
        num_layers=3,
        sliding_window=4,
        rope_theta=1e6,
        query_pre_attn_scalar=8.0,
    )
    return tiny_model_config(**(fields | overrides))


def tiny_gemma4_config(**overrides) -> models.ModelConfig:
    """A tiny random Gemma 4 text decoder: 4 layers (sliding, full, sliding, full), a window
    of 4 tokens, the full layers' proportional RoPE rotating a quarter of each head, final
    logits soft-capped at 3."""
    proportional = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 2.0}
    fields = dict(
        architecture="Gemma4ForCausalLM",
        layer_types=("sliding_attention", "full_attention") * 2,
        num_layers=4,
        sliding_window=4,
        rope_theta=1e6,
        rope_scaling=tuple(sorted(proportional.items())),
        final_logit_softcapping=3.0,
        initializer_range=0.2,
    )
    return tiny_model_config(**(fields | overrides))


def tiny_gpt_oss_config(**overrides) -> models.ModelConfig:
    """A tiny GPT-OSS: sliding (window 4) and full layers, attention sinks, YaRN, biases on
    attention, router and experts, the clamped SwiGLU (limit 1.5, so it clamps)."""
    yarn = {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 4.0,
        "rope_type": "yarn",
        "original_max_position_embeddings": 16,
        "truncate": False,
    }
    fields = dict(
        architecture="GptOssForCausalLM",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        intermediate_size=16,
        initializer_range=0.2,
        router="topk_softmax",
        norm_topk_prob=True,
        qk_norm=False,
        qkv_bias=True,
        o_bias=True,
        attention_sinks=True,
        expert_bias=True,
        swiglu_limit=1.5,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=4,
        rope_scaling=tuple(sorted(yarn.items())),
        max_position_embeddings=64,
    )
    return tiny_model_config(**(fields | overrides))


def make_model_dir(path: str, gemma3: bool = False) -> str:
    """A random tiny Qwen3 (or `tiny_gemma3_config`; vocab = the arithmetic tokenizer's 33
    tokens) saved as HF."""
    config = tiny_gemma3_config if gemma3 else tiny_model_config
    cfg = config(vocab_size=33, tie_word_embeddings=True, max_position_embeddings=256)
    models.save_hf(cfg, models.init_params(cfg, seed=0), path, tokenizer_dir=TOKENIZER)
    return path


def tiny_config(model_dir: str, **algo):
    """2 GRPO steps of 4 prompts x 4 samples, sharded over 8 devices (fsdp 4 x tensor 2)."""
    c = config_lib.base_config()
    c.model.path = model_dir
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 4, 2
    c.data.name = "arithmetic/digits_1"
    c.data.max_prompt_len = 48
    c.data.template = "{question}="
    c.data.chat_template = "never"
    c.rollout.batch_size = 4
    c.rollout.num_generations = 4
    c.rollout.max_new_tokens = 6
    c.optim.learning_rate = 1e-3
    c.rewards = {"gsm8k": 1.0}
    c.train.num_steps = 2
    c.train.print_samples_every = 0
    c.train.verifier_workers = 1
    c.logging.tensorboard = False
    c.checkpoint.every = 0
    for k, v in algo.items():
        c.algo[k] = v
    return c


def signal_config(model_dir: str):
    """`tiny_config` with a reward the random model earns ~30% of the time (completions
    that start with a digit), so groups are mixed and updates follow real gradients;
    with all-zero rewards Adam would turn float noise into learning-rate-sized steps."""
    c = tiny_config(model_dir)
    c.rewards = {"format": {"weight": 1.0, "options": {"pattern": "[0-9].*"}}}
    return c


def get_config():
    """For `--config=tests/tiny_run.py` (child processes): the model dir from the env."""
    return signal_config(os.environ["TINY_MODEL_DIR"])


def teacher_forced_logprobs(cfg, params, out, temperature):
    """A `SampleOutput`'s tokens' log-probs [N, T] from one full forward of prompt +
    completion (the reference the samplers' behaviour log-probs are checked against)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    ids = jnp.concatenate([out.prompt_tokens, out.tokens], axis=1)
    mask = jnp.concatenate([out.prompt_mask, out.mask], axis=1)
    logits = models.logits(cfg, params, ids, mask)
    P = out.prompt_tokens.shape[1]
    logp = jax.nn.log_softmax(logits[:, P - 1 : -1] / temperature, axis=-1)
    return np.take_along_axis(np.asarray(logp), np.asarray(out.tokens)[..., None], -1)[..., 0]
