"""The pure functions a decoder layer is built from: RMSNorm in its conventions (Llama /
Qwen scale by the weight, Gemma 3 by 1 + weight, Gemma 4 by the weight in float32), the
final logits' soft-capping, the dense matmul with its backward written out, the LoRA
adapters' input dropout, rotary embeddings with their `linear` / `llama3` / `yarn` /
`proportional` scaling, and Gemma's per-layer kinds.

They are functions of arrays and the `ModelConfig`, with no parameters of their own:
`block.Block` declares the parameters and composes these into one layer, and
`layers.Transformer` reads `layer_kinds` alongside the stacked parameters in its layer
scan. Keeping them apart from the modules lets tests check each against its reference
(HF's RMSNorm and RoPE, autodiff of the einsum) on its own.

Gemma 3's layers differ by kind (sliding-window or global attention, each with its own
RoPE base). The kind is data, not code: `layer_kinds(cfg)` gives per-layer arrays that the
layer scan reads like the stacked parameters, so one traced layer serves both kinds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.config import LORA_TARGETS, ModelConfig


# -------------------------------------------------------------------- norms, projections
def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """HF LlamaRMSNorm: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale * y.astype(x.dtype)


def gemma_rms_norm(
    x: jax.Array, weight: jax.Array | None, eps: float, offset: float = 1.0
) -> jax.Array:
    """HF Gemma3RMSNorm (offset 1): normalise and scale by (offset + weight) in float32,
    then cast back. Gemma4RMSNorm: offset 0, and weight None for its unweighted norm."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * (offset + weight.astype(jnp.float32))
    return y.astype(x.dtype)


def norm(cfg: ModelConfig, x: jax.Array, weight: jax.Array) -> jax.Array:
    """The architecture's RMSNorm (Gemma 3 and Qwen3.5 store weight - 1, Llama / Qwen the
    scale; Gemma 4 the scale, applied in float32)."""
    if cfg.centered_norm:
        return gemma_rms_norm(x, weight, cfg.rms_norm_eps)
    if cfg.gemma4:
        return gemma_rms_norm(x, weight, cfg.rms_norm_eps, offset=0.0)
    return rms_norm(x, weight, cfg.rms_norm_eps)


def softcap(z: jax.Array, cap: float | None) -> jax.Array:
    """Logit soft-capping (Gemma 2 / 4's final logits): cap * tanh(z / cap); z when cap
    is None."""
    return z if cap is None else cap * jnp.tanh(z / cap)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dense(x: jax.Array, w: jax.Array, contract: int = 1) -> jax.Array:
    """Contracts the last `contract` axes of x with the first ones of w, as one 2-D matmul.

    x [..., K1..Kc], w [K1..Kc, N1..] -> [..., N1..]. The same math as the einsum, with
    the backward written out as the two matmuls it is (dx = g W^T, dW = x^T g over the
    flattened tokens). Left to autodiff of a batched einsum, XLA:CPU transposes the wide
    [tokens, F] cotangent of every MLP matmul in a strided loop before the weight-gradient
    matmul, a copy as large as the matmul's operands (benchmarks/RESULTS.md, "update");
    other backends are unaffected either way.
    """
    return _dense_2d(x, w, contract)[0]


def _dense_2d(x, w, contract):
    k = int(np.prod(w.shape[:contract]))
    x2, w2 = x.reshape(-1, k), w.reshape(k, -1)
    y = (x2 @ w2).reshape(*x.shape[: x.ndim - contract], *w.shape[contract:])
    return y, x2, w2


def _dense_fwd(x, w, contract):
    y, x2, w2 = _dense_2d(x, w, contract)
    return y, (x2, w2, x.shape, w.shape)


def _dense_bwd(contract, res, g):
    x2, w2, x_shape, w_shape = res
    g2 = g.reshape(x2.shape[0], w2.shape[1])
    dx = jnp.einsum("mn,kn->mk", g2, w2).reshape(x_shape)
    dw = jnp.einsum("mk,mn->kn", x2, g2).reshape(w_shape)
    return dx, dw


dense.defvjp(_dense_fwd, _dense_bwd)


def contracted(name: str) -> int:
    """Input axes of a projection's weight (after `layers`): o's (and Gemma 4's full
    layers' wo) are (q_heads, head_dim)."""
    return 2 if name in ("o", "wo") else 1


def lora_target_index(name: str) -> int:
    """The projection's place in LORA_TARGETS: what its dropout key folds in."""
    return LORA_TARGETS.index(name)


def adapter_dropout(key: jax.Array, rate: float, x: jax.Array) -> jax.Array:
    """Inverted dropout of an adapter's input: x * m / (1 - rate), m ~ Bernoulli(1 - rate)
    per element (PEFT's lora_dropout, applied before A), so E[(x A) B] is unchanged."""
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros_like(x))


# ------------------------------------------------------------------ rope, layer kinds
@functools.lru_cache(maxsize=64)
def rope_frequencies(cfg: ModelConfig, local: bool = False, head_dim: int | None = None):
    """Inverse frequencies [rotary_dim / 2], float32, with `linear` / `llama3` / `yarn` /
    `proportional` scaling. local: those of Gemma's sliding-window layers (base
    `rope_local_theta`, unscaled). head_dim: a head size other than `cfg.head_dim`'s
    (Gemma 4's full layers, `global_head_dim`).

    proportional (Gemma 4's full layers): the first int(p * head_dim / 2) of the whole
    head's frequencies (p = `partial_rotary_factor`), the rest zero (those pairs do not
    rotate), all divided by `factor`: in the rotate_half layout dimension i pairs with
    i + head_dim / 2, so the rotated dimensions are two blocks, not a prefix of the head
    as GLM-4.5's `partial_rotary_factor` makes it."""
    dim = cfg.rotary_dim if head_dim is None else head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = {} if local else dict(cfg.rope_scaling or ())
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(medium, smoothed, scaled)
    elif kind == "proportional":
        angles = int(float(scaling.get("partial_rotary_factor", 1.0)) * dim // 2)
        inv_freq = np.concatenate([inv_freq[:angles], np.zeros(dim // 2 - angles)])
        inv_freq = inv_freq / float(scaling.get("factor", 1.0))
    elif kind == "yarn":
        inv_freq = _yarn(inv_freq, scaling, dim, theta, cfg.max_position_embeddings)
    return inv_freq.astype(np.float32)


def _yarn(inv_freq, scaling: dict, dim: int, theta: float, max_positions: int) -> np.ndarray:
    """YaRN (Peng et al. 2023, transformers' `_compute_yarn_parameters`): frequencies that
    turn more than `beta_fast` times over the original context keep their value, those
    turning fewer than `beta_slow` times are divided by `factor`, a linear ramp between."""
    old_len = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_positions / old_len)
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations):
        return dim * np.log(old_len / (rotations * 2 * np.pi)) / (2 * np.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """YaRN's scale of cos and sin (so of q and k): `attention_factor`, else
    0.1 ln(factor) + 1 (or mscale's ratio, as transformers derives it); 1 otherwise."""
    scaling = dict(cfg.rope_scaling or ())
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or cfg.max_position_embeddings / old_len)

    def mscale(m=1.0):
        return 1.0 if factor <= 1 else 0.1 * m * np.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(m) / mscale(m_all)) if m and m_all else float(mscale())


def layer_kinds(cfg: ModelConfig) -> dict | None:
    """Per-layer data of a model whose layers differ by kind, stacked on a leading axis
    like the layer parameters: {"local": bool [L] (sliding-window attention), "inv_freq":
    float32 [L, head_dim / 2] (that layer's RoPE)}. None when every layer is alike."""
    if not cfg.windowed:
        return None
    local = np.array([t == "sliding_attention" for t in cfg.layer_types])
    if cfg.split_attention:  # each kind's frequencies are its own size (`Block._rope`)
        return {"local": local}
    freqs = np.stack([rope_frequencies(cfg, bool(flag) and cfg.local_rope) for flag in local])
    return {"local": local, "inv_freq": freqs}


def layer_mask(cfg: ModelConfig, mask, kind: dict | None):
    """The `attention.Mask` of one layer: for a windowed model, `kind["local"]` layers see
    keys fewer than `cfg.sliding_window` positions back, the others every key."""
    if kind is None:
        return mask
    far = jnp.iinfo(jnp.int32).max
    return mask.replace(window=jnp.where(kind["local"], cfg.sliding_window, far))


def apply_rope(
    x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0
) -> jax.Array:
    """Rotary embedding, HF `rotate_half` layout. x [B,T,N,H], positions [B,T]. With fewer
    than H / 2 frequencies (partial rotary, GLM-4.5) only the first 2 * len(inv_freq)
    dimensions of each head rotate; the others pass unchanged. scale: multiplies cos and
    sin (YaRN's `rope_attention_factor`)."""
    rot = 2 * inv_freq.shape[-1]
    if rot < x.shape[-1]:
        rotated = apply_rope(x[..., :rot], positions, inv_freq, scale)
        return jnp.concatenate([rotated, x[..., rot:]], axis=-1)
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B,T,H/2]
    cos = jnp.concatenate([jnp.cos(angles) * scale] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles) * scale] * 2, axis=-1)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated * sin).astype(x.dtype)
