"""The decoder's modules (Llama 3 / Mistral / Qwen2 / Qwen3 / Gemma 3 / Qwen3-MoE / GLM-4.5)
in Flax NNX: RMSNorm, the dense matmul with its backward written out, rotary embeddings,
one decoder layer and the model.

Gemma 3's layers differ by kind (sliding-window or global attention, each with its own
RoPE base). The kind is data, not code: `layer_kinds(cfg)` gives per-layer arrays that the
layer scan reads like the stacked parameters, so one traced layer serves both kinds.
An MoE model's layers may differ in their MLP (experts or dense, `cfg.dense_layers`): that
is code, so each run of consecutive alike layers is one scan over its kind's parameters
(`ModelConfig.layer_segments`); a model whose layers are all alike is one scan.

The modules only declare parameters (with logical axis names) and the math of one layer;
`transformer.py` holds the functional API that merges a plain params dict into them.
Layer parameters are stacked on a leading `layers` axis and run by one `jax.lax.scan`, so
compile time does not grow with depth; `cfg.remat` selects the activation checkpointing
policy of the scanned layer. `cfg.scan_layers=False` unrolls that scan in the
teacher-forced forward (the backward then reads each layer's residuals where they were
computed instead of from [L, ...] stacks the scan zero-fills and copies into), and with a
KV cache runs prefill and decode over one cache array per layer (`kv_cache.init_cache`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models._nnx import nnx
from jaxrl_llm.models.attention import attention, cached_attention, cached_blockwise, resolve
from jaxrl_llm.models.config import LORA_TARGETS, ModelConfig
from jaxrl_llm.models.moe import moe_mlp
from jaxrl_llm.models.paged_attention import paged_attention, write_layer
from jaxrl_llm.models.partitioning import (
    context_size,
    heads_spec,
    rows_spec,
    shard_heads,
    shard_sequence,
)
from jaxrl_llm.models.segments import MOE_WEIGHTS, layer_rows, layer_slice, segment_params


# ------------------------------------------------------------------------------ modules
def _normal(rngs: nnx.Rngs, shape, axes, std: float, dtype) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape)).astype(dtype), axes=axes)


def _const(value: float, shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.full(shape, value, dtype), axes=axes)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """HF LlamaRMSNorm: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale * y.astype(x.dtype)


def gemma_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF Gemma3RMSNorm: normalise and scale by (1 + weight) in float32, then cast back."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def norm(cfg: ModelConfig, x: jax.Array, weight: jax.Array) -> jax.Array:
    """The architecture's RMSNorm (Gemma stores weight - 1, Llama / Qwen the scale)."""
    return (gemma_rms_norm if cfg.gemma else rms_norm)(x, weight, cfg.rms_norm_eps)


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
    """Input axes of a projection's weight (after `layers`): o's are (q_heads, head_dim)."""
    return 2 if name == "o" else 1


def lora_target_index(name: str) -> int:
    """The projection's place in LORA_TARGETS: what its dropout key folds in."""
    return LORA_TARGETS.index(name)


def adapter_dropout(key: jax.Array, rate: float, x: jax.Array) -> jax.Array:
    """Inverted dropout of an adapter's input: x * m / (1 - rate), m ~ Bernoulli(1 - rate)
    per element (PEFT's lora_dropout, applied before A), so E[(x A) B] is unchanged."""
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros_like(x))


# ------------------------------------------------------------------------ rope, attention
@functools.lru_cache(maxsize=64)
def rope_frequencies(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse frequencies [rotary_dim / 2], float32, with `linear` / `llama3` scaling.
    local: those of Gemma 3's sliding-window layers (base `rope_local_theta`, unscaled)."""
    dim = cfg.rotary_dim
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
    return inv_freq.astype(np.float32)


def layer_kinds(cfg: ModelConfig) -> dict | None:
    """Per-layer data of a model whose layers differ by kind, stacked on a leading axis
    like the layer parameters: {"local": bool [L] (sliding-window attention), "inv_freq":
    float32 [L, head_dim / 2] (that layer's RoPE)}. None when every layer is alike."""
    if not cfg.windowed:
        return None
    local = np.array([t == "sliding_attention" for t in cfg.layer_types])
    freqs = np.stack([rope_frequencies(cfg, bool(flag)) for flag in local])
    return {"local": local, "inv_freq": freqs}


def layer_mask(cfg: ModelConfig, mask, kind: dict | None):
    """The `attention.Mask` of one layer: for a windowed model, `kind["local"]` layers see
    keys fewer than `cfg.sliding_window` positions back, the others every key."""
    if kind is None:
        return mask
    far = jnp.iinfo(jnp.int32).max
    return mask.replace(window=jnp.where(kind["local"], cfg.sliding_window, far))


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding, HF `rotate_half` layout. x [B,T,N,H], positions [B,T]. With fewer
    than H / 2 frequencies (partial rotary, GLM-4.5) only the first 2 * len(inv_freq)
    dimensions of each head rotate; the others pass unchanged."""
    rot = 2 * inv_freq.shape[-1]
    if rot < x.shape[-1]:
        rotated = apply_rope(x[..., :rot], positions, inv_freq)
        return jnp.concatenate([rotated, x[..., rot:]], axis=-1)
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B,T,H/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated * sin).astype(x.dtype)


# ------------------------------------------------------------------ context parallelism
def context_attention(q, k, v, mask, *args, **kwargs) -> jax.Array:
    """`attention` with the mesh's `context` axis (if > 1) moved from the sequence to the
    heads around it: q, k, v go to every position of a share of the heads (an
    all-to-all over `context`, `partitioning.shard_heads`), the output back to a share
    of the positions (`shard_sequence`). Without a context axis this is `attention`.

    Between the two, attention runs per device inside `jax.shard_map` (q / k / v split
    on heads over ('tensor', 'context') and on rows over the batch axes, the mask's
    per-row arrays on rows only), so each device computes its heads and nothing else
    whatever the implementation: the partitioner does not carry the heads split through
    the blockwise path's block layout and loops, and would otherwise replicate them.
    Key / value heads the axes do not divide come whole to every device, which takes
    those its query heads read (`local_kv_heads`)."""
    if context_size() == 1:
        return attention(q, k, v, mask, *args, **kwargs)
    q, k, v = shard_heads(q), shard_heads(k, "kv"), shard_heads(v, "kv")
    q_spec, kv_spec = heads_spec(q.shape), heads_spec(k.shape)
    mask_spec = jax.tree.map(lambda x: rows_spec(jnp.shape(x)), mask)
    heads_axes, num_heads = q_spec[2], q.shape[2]

    def local(q, k, v, mask):
        if kv_spec[2] is None and heads_axes is not None:
            shard = jax.lax.axis_index(heads_axes)
            k, v = local_kv_heads(k, v, q.shape[2], num_heads, shard)
        return attention(q, k, v, mask, *args, **kwargs)

    out = jax.shard_map(
        local,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(q_spec, kv_spec, kv_spec, mask_spec),
        out_specs=q_spec,
        check_vma=False,
    )(q, k, v, mask)
    return shard_sequence(out)


def local_kv_heads(k, v, n: int, num_heads: int, shard) -> tuple[jax.Array, jax.Array]:
    """Of every key / value head [B,S,K,H], those that query-head shard `shard` (traced;
    query heads shard * n .. shard * n + n - 1 of `num_heads`) reads under GQA (query
    head i reads kv head i // (num_heads / K)), ordered so that GQA over the n local
    query heads pairs them right: the one kv head when the shard lies within one group,
    else one kv head per query head. (A shard of whole groups means the kv heads divide
    like the query heads, and they arrive split.)"""
    G = num_heads // k.shape[2]  # query heads per kv head
    first = shard * n
    if G % n == 0:
        return tuple(jax.lax.dynamic_slice_in_dim(x, first // G, 1, axis=2) for x in (k, v))
    heads = (first + jnp.arange(n)) // G
    return jnp.take(k, heads, axis=2), jnp.take(v, heads, axis=2)


class Block(nnx.Module):
    """All decoder layers' parameters, stacked on a leading `layers` axis: over every
    layer, except in an MoE model with dense-MLP layers (`cfg.dense_layers`), where the
    MLP's parameters are stacked over the layers of their kind (`segments.mlp_kind`) and the layer
    loop scans each run of alike layers (`segment_params`).

    `__call__` computes ONE layer and must be given one layer's slice of the parameters
    (the scan in `Transformer` does that by merging a sliced state).
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        normal = functools.partial(_normal, rngs, std=cfg.initializer_range, dtype=dtype)
        one = 0.0 if cfg.gemma else 1.0  # a norm's identity weight (Gemma scales by 1 + w)
        self.attn_norm = _const(one, (L, D), ("layers", "norm"), dtype)
        self.q = normal((L, D, N, H), ("layers", "embed", "q_heads", "head_dim"))
        self.k = normal((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"))
        self.v = normal((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"))
        self.o = normal((L, N, H, D), ("layers", "q_heads", "head_dim", "embed"))
        if cfg.qkv_bias:
            self.q_bias = _const(0.0, (L, N, H), ("layers", "q_heads", "head_dim"), dtype)
            self.k_bias = _const(0.0, (L, K, H), ("layers", "kv_heads", "head_dim"), dtype)
            self.v_bias = _const(0.0, (L, K, H), ("layers", "kv_heads", "head_dim"), dtype)
        if cfg.o_bias:
            self.o_bias = _const(0.0, (L, D), ("layers", "norm"), dtype)
        if cfg.qk_norm:
            self.q_norm = _const(one, (L, H), ("layers", "head_dim"), dtype)
            self.k_norm = _const(one, (L, H), ("layers", "head_dim"), dtype)
        if cfg.gemma:  # norms of the attention's and the MLP's outputs
            self.post_attn_norm = _const(one, (L, D), ("layers", "norm"), dtype)
            self.post_mlp_norm = _const(one, (L, D), ("layers", "norm"), dtype)
        self.mlp_norm = _const(one, (L, D), ("layers", "norm"), dtype)
        if cfg.num_sparse_layers:
            self._add_experts(cfg, normal, dtype)
        if cfg.num_sparse_layers < L:  # the dense MLP, in the layers that have it
            Ld = L - cfg.num_sparse_layers
            self.gate = normal((Ld, D, F), ("layers", "embed", "mlp"))
            self.up = normal((Ld, D, F), ("layers", "embed", "mlp"))
            self.down = normal((Ld, F, D), ("layers", "mlp", "embed"))
        if cfg.lora is not None:
            self._add_adapters(cfg.lora, rngs, dtype)
        self.cfg = cfg

    def _add_experts(self, cfg: ModelConfig, normal, dtype) -> None:
        """Of the Lm MoE layers: router [Lm, D, E], the experts' SwiGLU weights
        [Lm, E, D, F] / [Lm, E, F, D], the sigmoid router's selection bias [Lm, E] (zero,
        as HF initialises it) and the shared experts' [Lm, D, Fs] / [Lm, Fs, D]."""
        L, D, E = cfg.num_sparse_layers, cfg.hidden_size, cfg.num_experts
        F, Fs = cfg.moe_intermediate_size, cfg.shared_intermediate_size
        self.router = normal((L, D, E), ("layers", "embed", "router"))
        self.expert_gate = normal((L, E, D, F), ("layers", "expert", "embed", "expert_mlp"))
        self.expert_up = normal((L, E, D, F), ("layers", "expert", "embed", "expert_mlp"))
        self.expert_down = normal((L, E, F, D), ("layers", "expert", "expert_mlp", "embed"))
        if cfg.router == "sigmoid":
            self.router_bias = _const(0.0, (L, E), ("layers", "router"), dtype)
        if Fs:
            self.shared_gate = normal((L, D, Fs), ("layers", "embed", "mlp"))
            self.shared_up = normal((L, D, Fs), ("layers", "embed", "mlp"))
            self.shared_down = normal((L, Fs, D), ("layers", "mlp", "embed"))

    def _mlp(self, h, dropout, routes, sparse):
        """The MLP of one layer: (y [B,T,D], the router's own top-k [B,T,k] or None).
        routes [B,T,k]: the experts to replay (MoE only; None: the router's choice).
        sparse: this layer's MLP is the mixture of experts."""
        cfg = self.cfg
        if sparse:
            weights = {n: getattr(self, p)[...] for n, p in MOE_WEIGHTS.items() if hasattr(self, p)}
            return moe_mlp(cfg, h, weights, routes)
        gate, up = self._proj("gate", h, dropout), self._proj("up", h, dropout)
        act = jax.nn.gelu(gate, approximate=True) if cfg.gemma else jax.nn.silu(gate)
        return self._proj("down", act * up, dropout), None

    def _add_adapters(self, lora, rngs: nnx.Rngs, dtype) -> None:
        """`<target>_lora_a` [L, *in, r] and `<target>_lora_b` [L, r, *out] per target.

        Each carries the logical axes of the input / output dimensions of the weight it
        adapts (the rank axis is `lora`), so the rule table shards it like that weight.
        A ~ U(+-1/sqrt(fan_in)) (PEFT's kaiming-uniform default), B = 0: the adapted
        model starts as the base model, exactly."""
        for name in lora.targets:
            w = getattr(self, name)
            shape, axes = w.shape, w.get_metadata()["axes"]
            c = 1 + contracted(name)
            fan_in = int(np.prod(shape[1:c]))
            bound = 1.0 / np.sqrt(fan_in)
            a_shape = (*shape[:c], lora.rank)
            a = jax.random.uniform(rngs.params(), a_shape, jnp.float32, -bound, bound)
            a_axes = (*axes[:c], "lora")
            setattr(self, name + "_lora_a", nnx.Param(a.astype(dtype), axes=a_axes))
            b_shape, b_axes = (shape[0], lora.rank, *shape[c:]), ("layers", "lora", *axes[c:])
            setattr(self, name + "_lora_b", _const(0.0, b_shape, b_axes, dtype))

    def _proj(self, name: str, x: jax.Array, dropout: jax.Array | None = None) -> jax.Array:
        """x times the projection `name`, plus (alpha / r) (x A) B where it is adapted.
        dropout: this layer's key for the adapters' input dropout (None: none)."""
        y = dense(x, getattr(self, name)[...], contracted(name))
        lora = self.cfg.lora
        if lora is None or name not in lora.targets:
            return y
        if dropout is not None and lora.dropout > 0:
            key = jax.random.fold_in(dropout, lora_target_index(name))
            x = adapter_dropout(key, lora.dropout, x)
        xa = dense(x, getattr(self, name + "_lora_a")[...], contracted(name))
        return y + dense(
            xa * jnp.asarray(lora.scale, xa.dtype), getattr(self, name + "_lora_b")[...]
        )

    def __call__(
        self, x, positions, mask, kv=None, index=None, layer=None, prefix=None, dropout=None,
        kind=None, routes=None, sparse=None, paged=None,
    ):  # fmt: skip
        """One layer. x [B,T,D], positions [B,T], mask an `attention.Mask` over the S
        keys. dropout: this layer's key for LoRA dropout (`adapter_dropout`), None in
        inference. kind: this layer's slice of `layer_kinds(cfg)`, or None.

        prefix: (k, v) [B,P,K,H] of P earlier tokens that x attends to before itself
        (S = P + T, no cache); the layer then returns its own (k, v) [B,T,K,H].

        kv: the whole cache (k, v) ([L,B,K,H,S], [L,B,K,S,H]), carried through the layer
        scan so that it is updated in place: this layer's new keys/values are written at
        slots index..index+T of [layer] and attention runs over the layer's S slots. With
        layer=None, kv is this layer's own cache arrays (unrolled layers). Without kv,
        S = T. routes [B,T,k]: experts to replay in an MoE layer (None: its own top-k).
        sparse: the layer's MLP is the mixture of experts (None: `cfg.moe`).

        paged: a `paged_attention.PagedWrite` (the page-pool path): kv is then the pool
        (k, v) [L, P, page_size, K, H]; this layer's new keys/values are written to its
        pages at [layer] and x attends to the layer's pages of each row through the
        table (`paged_attention`), mask being `paged_attention.paged_inputs`'.
        Returns (x [B,T,D], the updated (k, v) or None, the MoE router's own top-k
        [B,T,k] int32 or None for a dense layer).
        """
        cfg = self.cfg
        mask = layer_mask(cfg, mask, kind)
        h = norm(cfg, x, self.attn_norm[...])
        q, k, v = (self._proj(n, h, dropout) for n in ("q", "k", "v"))
        if cfg.qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if cfg.qk_norm:
            q, k = norm(cfg, q, self.q_norm[...]), norm(cfg, k, self.k_norm[...])
        inv_freq = rope_frequencies(cfg) if kind is None else kind["inv_freq"]
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        if cfg.query_pre_attn_scalar and cfg.query_pre_attn_scalar != cfg.head_dim:
            # attention scales scores by head_dim^-1/2; Gemma by query_pre_attn_scalar^-1/2
            q = q * jnp.asarray((cfg.head_dim / cfg.query_pre_attn_scalar) ** 0.5, q.dtype)
        if paged is not None:
            kv = write_layer(kv, layer, k, v, paged)
            a = paged_attention(q, kv, layer, paged, mask, cfg.attention, cfg.attention_block)
        elif prefix is not None:
            # Keys/values of earlier tokens ([B, P, K, H] each, e.g. a shared prompt's) come
            # first; this layer's own (after RoPE) are returned for a later suffix.
            own = (k, v)
            k = jnp.concatenate([prefix[0].astype(k.dtype), k], axis=1)
            v = jnp.concatenate([prefix[1].astype(v.dtype), v], axis=1)
            a = context_attention(q, k, v, mask, cfg.attention, cfg.attention_block)
            kv = own
        elif kv is None:
            a = context_attention(q, k, v, mask, cfg.attention, cfg.attention_block)
        else:
            # k [B,T,K,H] -> [B,K,H,T] at slots index.., v -> [B,K,T,H] (see KVCache): at
            # [layer] of an [L, ...] cache (scanned layers), or into this layer's own arrays.
            lead = () if layer is None else (layer,)

            def write(c, new, start):
                new = new if layer is None else new[None]
                return jax.lax.dynamic_update_slice(c, new.astype(c.dtype), lead + start)

            kv = (
                write(kv[0], k.transpose(0, 2, 3, 1), (0, 0, 0, index)),
                write(kv[1], v.transpose(0, 2, 1, 3), (0, 0, index, 0)),
            )
            if layer is None:
                k, v = kv
            else:
                k, v = (jax.lax.dynamic_index_in_dim(c, layer, keepdims=False) for c in kv)
            a = self._cached(q, k, v, mask)
        a = self._proj("o", a, dropout)
        if cfg.o_bias:
            a = a + self.o_bias[...]
        if cfg.gemma:
            a = norm(cfg, a, self.post_attn_norm[...])
        x = x + a
        h = norm(cfg, x, self.mlp_norm[...])
        y, chosen = self._mlp(h, dropout, routes, cfg.moe if sparse is None else sparse)
        if cfg.gemma:
            y = norm(cfg, y, self.post_mlp_norm[...])
        return x + y, kv, chosen

    def _cached(self, q, kt, v, mask):
        """Attention over the cache: the full score matrix for decode and short prefill,
        key blocks (`cached_blockwise`) where `cfg.attention` would not hold [T, S]."""
        cfg = self.cfg
        T, S = q.shape[1], v.shape[-2]
        if T > 1 and resolve(cfg.attention, jax.default_backend(), T, S) != "xla":
            return cached_blockwise(q, kt, v, mask, cfg.attention_block)
        return cached_attention(q, kt.astype(q.dtype), v.astype(q.dtype), mask.dense())


class Transformer(nnx.Module):
    """Embedding, scanned layers, final norm and (untied) output projection."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        V, D = cfg.vocab_size, cfg.hidden_size
        self.embed = _normal(rngs, (V, D), ("vocab", "embed"), cfg.initializer_range, dtype)
        self.layers = Block(cfg, rngs, dtype)
        self.final_norm = _const(0.0 if cfg.gemma else 1.0, (D,), ("norm",), dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _normal(rngs, (D, V), ("embed", "vocab"), cfg.initializer_range, dtype)
        self.cfg = cfg

    def __call__(
        self, tokens, positions, mask, cache=None, index=None, layers=None, dropout=None,
        routes=None, paged=None,
    ):  # fmt: skip
        """tokens [B,T] -> (final-normed hidden states [B,T,D], the new cache k, v, the MoE
        layers' own top-k experts [L,B,T,k] int32 or None for a dense model).

        layers: with a per-layer cache, each layer's parameters already sliced out of the
        stacked ones (`layer_params`), e.g. once before a decode loop instead of per step.
        dropout: a key for LoRA dropout (layer i folds in i), or None.
        routes: [L,B,T,k] experts to replay in the MoE layers (None: the router's own).
        paged: a `paged_attention.PagedWrite`: cache is then the page pool (k, v)
        [L, P, page_size, K, H], each layer writing and reading its own pages (`Block`).
        """
        cfg = self.cfg
        x = shard_sequence(self.embed_tokens(tokens))  # context parallelism
        graphdef, stacked = nnx.split(self.layers)
        stacked = nnx.to_pure_dict(stacked)
        kinds = layer_kinds(cfg)

        def layer(carry, xs, sparse):
            x, kv = carry
            layer_state, i, kind, route = xs
            key = None if dropout is None else jax.random.fold_in(dropout, i)
            block = nnx.merge(graphdef, layer_state)
            x, kv, chosen = block(
                x, positions, mask, kv, index, i, dropout=key, kind=kind, routes=route,
                sparse=sparse, paged=paged,
            )  # fmt: skip
            return (x, kv), chosen

        if paged is not None and layers is not None:  # the pool, layers unrolled
            chosen = []
            for i in range(cfg.num_layers):
                kind = jax.tree.map(lambda a, i=i: a[i], kinds)
                block = nnx.merge(graphdef, layer_slice(cfg, layers, i))
                route = None if routes is None else routes[i]
                x, cache, own = block(
                    x, positions, mask, cache, layer=i, kind=kind, routes=route,
                    sparse=cfg.sparse_layers[i], paged=paged,
                )  # fmt: skip
                chosen.append(own if own is not None else self._no_routes(x))
            chosen = jnp.stack(chosen) if cfg.moe else None
            return norm(cfg, x, self.final_norm[...]), cache, chosen
        if cache is not None and isinstance(cache[0], tuple):  # one cache array per layer
            kv, chosen = [], []
            per_index = layers or {n: [a[j] for j in range(a.shape[0])] for n, a in stacked.items()}
            for i in range(cfg.num_layers):
                kind = jax.tree.map(lambda a, i=i: a[i], kinds)
                block = nnx.merge(graphdef, layer_slice(cfg, per_index, i))
                cache_i = (cache[0][i], cache[1][i])
                route = None if routes is None else routes[i]
                x, layer_kv, own = block(
                    x, positions, mask, cache_i, index, kind=kind, routes=route,
                    sparse=cfg.sparse_layers[i],
                )  # fmt: skip
                kv.append(layer_kv)
                chosen.append(own if own is not None else self._no_routes(x))
            kv = tuple(tuple(c) for c in zip(*kv, strict=True))
            chosen = jnp.stack(chosen) if cfg.moe else None
            return norm(cfg, x, self.final_norm[...]), kv, chosen
        carry, chosen = (x, cache), []
        for segment in cfg.layer_segments():
            start, stop, sparse, _ = segment
            body = _remat(functools.partial(layer, sparse=sparse), cfg.remat)
            unroll = stop - start if cache is None and not cfg.scan_layers else 1
            xs = (
                segment_params(cfg, stacked, segment),
                jnp.arange(start, stop),
                layer_rows(kinds, start, stop),
                layer_rows(routes, start, stop),
            )
            carry, own = jax.lax.scan(body, carry, xs, unroll=unroll)
            chosen.append(own)
        x, kv = carry
        return norm(cfg, x, self.final_norm[...]), kv, self._join_routes(chosen, x)

    def _no_routes(self, x, n: int | None = None) -> jax.Array:
        """The routes of dense-MLP layers in an MoE model: -1 [B,T,k] (or [n,B,T,k])."""
        shape = x.shape[:2] + (self.cfg.num_experts_per_tok,)
        return jnp.full(shape if n is None else (n, *shape), -1, jnp.int32)

    def _join_routes(self, chosen: list, x):
        """The segments' own top-k [n,B,T,k] (None for a dense run) -> [L,B,T,k], -1 in
        the dense layers; None for a dense model."""
        if not self.cfg.moe:
            return None
        if len(chosen) == 1:
            return chosen[0]
        runs = self.cfg.layer_segments()
        return jnp.concatenate(
            [
                self._no_routes(x, r[1] - r[0]) if c is None else c
                for c, r in zip(chosen, runs, strict=True)
            ]
        )

    def embed_tokens(self, tokens) -> jax.Array:
        """tokens [B,T] -> [B,T,D]; Gemma scales by sqrt(D), rounded to the embedding's
        dtype first (as HF does)."""
        x = jnp.take(self.embed[...], tokens, axis=0)
        if self.cfg.gemma:
            x = x * jnp.asarray(self.cfg.hidden_size**0.5, x.dtype)
        return x

    def with_prefix(self, tokens, positions, mask, prefix, dropout=None, routes=None,
                    layers=None):  # fmt: skip
        """tokens [B,T] after a prefix of P tokens whose per-layer keys/values are given ->
        (final-normed hidden [B,T,D], this sequence's keys/values ([L,B,T,K,H] each), the
        MoE layers' own top-k [L,B,T,k] or None).

        prefix: (k, v) [L,B,P,K,H] each (P may be 0), as this method returned them for the
        earlier tokens; mask [B,T,P+T]. Scanned (or unrolled) like the full forward, with
        its remat policy and its attention backward, so it trains as fast. dropout, routes:
        as in `__call__`. layers: each layer's parameters already sliced out of the stacked
        ones (`layer_params`; inference only): the layers run unrolled over them, so a loop
        of calls (a decode loop) does not slice the weights again in every call.
        """
        cfg = self.cfg
        x = shard_sequence(self.embed_tokens(tokens))  # context parallelism
        graphdef, stacked = nnx.split(self.layers)
        stacked = nnx.to_pure_dict(stacked)
        kinds = layer_kinds(cfg)
        if layers is not None:  # inference: unrolled over the caller's per-layer slices
            kv, chosen = [], []
            for i in range(cfg.num_layers):
                kind = jax.tree.map(lambda a, i=i: a[i], kinds)
                route = None if routes is None else routes[i]
                block = nnx.merge(graphdef, layer_slice(cfg, layers, i))
                x, own_kv, own = block(
                    x, positions, mask, prefix=(prefix[0][i], prefix[1][i]), kind=kind,
                    routes=route, sparse=cfg.sparse_layers[i],
                )  # fmt: skip
                kv.append(own_kv)
                chosen.append(own if own is not None else self._no_routes(x))
            kv = tuple(jnp.stack(c) for c in zip(*kv, strict=True))
            chosen = jnp.stack(chosen) if cfg.moe else None
            return norm(cfg, x, self.final_norm[...]), kv, chosen

        def layer(x, xs, sparse):
            layer_state, pk, pv, i, kind, route = xs
            key = None if dropout is None else jax.random.fold_in(dropout, i)
            block = nnx.merge(graphdef, layer_state)
            x, kv, chosen = block(
                x, positions, mask, prefix=(pk, pv), dropout=key, kind=kind, routes=route,
                sparse=sparse,
            )  # fmt: skip
            return x, (kv, chosen)

        kvs, chosen = [], []
        for segment in cfg.layer_segments():
            start, stop, sparse, _ = segment
            body = _remat(functools.partial(layer, sparse=sparse), cfg.remat)
            unroll = 1 if cfg.scan_layers else stop - start
            xs = (
                segment_params(cfg, stacked, segment),
                *(layer_rows(p, start, stop) for p in prefix),
                jnp.arange(start, stop),
                layer_rows(kinds, start, stop),
                layer_rows(routes, start, stop),
            )
            x, (kv, own) = jax.lax.scan(body, x, xs, unroll=unroll)
            kvs.append(kv)
            chosen.append(own)
        kv = kvs[0] if len(kvs) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *kvs)
        return norm(cfg, x, self.final_norm[...]), kv, self._join_routes(chosen, x)


def _remat(fn, policy: str):
    if policy == "none":
        return fn
    policies = {
        "full": None,
        "dots": jax.checkpoint_policies.checkpoint_dots,
        "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    }
    return jax.checkpoint(fn, policy=policies[policy], prevent_cse=False)
