"""The PPO critic: the policy's decoder trunk with a scalar value head, and teacher forcing.

Ouyang et al. 2022 ("Training language models to follow instructions with human
feedback") initialise the value model from a language model and replace its unembedding
with a scalar head; we copy the policy's trunk:

    V(s_t) = w . h_t + b,   h_t = final-normed hidden state of the prefix (prompt, o_<t)

so V is the value of the state BEFORE completion token t, read from the hidden state at
sequence position P - 1 + t (the same shift as the token log-probs). The head starts at
w = 0, b = 0 (every value 0): the critic begins as a neutral baseline instead of random
noise. The critic never uses an unembedding: its config is the policy's with tied
embeddings, so its params hold `embed` (the input embedding) but no `lm_head`, and neither
memory nor optimizer state is spent on a [D, V] matrix.

Critic params: {'trunk': <decoder params without lm_head>, 'value_head': {'kernel': [D],
'bias': []}}. `init_critic` COPIES the policy arrays: the update step donates the whole
train state, and a buffer shared by policy and critic would be donated twice.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import models
from jaxrl_llm.rl.batch import completion_hidden


def trunk_config(model_cfg: models.ModelConfig) -> models.ModelConfig:
    """The critic trunk's config: the policy's, with no separate lm_head (and, for a LoRA
    policy, no adapters: the critic is a full copy of the base trunk and trains whole)."""
    return dataclasses.replace(model_cfg, tie_word_embeddings=True, lora=None)


def init_critic(model_cfg: models.ModelConfig, policy_params, seed: int = 0):
    """Critic params: a copy of the policy trunk (same shardings) + a zero value head.

    `seed` is accepted for a future random head; the zero head needs none.
    """
    del seed
    trunk = {k: jax.tree.map(jnp.copy, v) for k, v in policy_params.items() if k != "lm_head"}
    norm = policy_params["final_norm"]
    head = {
        "kernel": jnp.zeros(norm.shape, jnp.float32),
        "bias": jnp.zeros((), jnp.float32),
    }
    # Committed next to the trunk (replicated on its mesh): an uncommitted input would make
    # the update compile a second time once its outputs come back committed.
    sharding = getattr(norm, "sharding", None)
    if isinstance(sharding, NamedSharding):
        head = jax.device_put(head, NamedSharding(sharding.mesh, PartitionSpec()))
    elif sharding is not None:
        head = jax.device_put(head, next(iter(sharding.device_set)))
    return {"trunk": trunk, "value_head": head}


def critic_shardings(model_cfg: models.ModelConfig, mesh) -> dict:
    """Shardings with the structure of `init_critic`'s output (for checkpoint restore)."""
    trunk = models.param_shardings(trunk_config(model_cfg), mesh)
    if mesh is None:
        rep = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    else:
        rep = NamedSharding(mesh, PartitionSpec())
    return {"trunk": trunk, "value_head": {"kernel": rep, "bias": rep}}


def values(model_cfg, critic_params, prompt_tokens, prompt_mask, tokens, mask) -> jax.Array:
    """V(s_t) for every completion token. [N, P], [N, P], [N, T], [N, T] -> [N, T] float32.

    Differentiable w.r.t. critic_params; masked positions hold whatever the head gives
    (the losses mask them).
    """
    hidden = completion_hidden(
        trunk_config(model_cfg), critic_params["trunk"], prompt_tokens, prompt_mask, tokens, mask
    )
    head = critic_params["value_head"]
    v = jnp.einsum("ntd,d->nt", hidden.astype(jnp.float32), head["kernel"].astype(jnp.float32))
    return v + head["bias"].astype(jnp.float32)
