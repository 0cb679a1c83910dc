"""One decoder layer in Flax NNX (Llama 3 / Mistral / Qwen2 / Qwen3 / Gemma 3 / Gemma 4 /
Qwen3-MoE / GLM-4.5 / GPT-OSS / Qwen3.5): `Block` declares every layer's parameters,
stacked on a leading `layers` axis with their logical axis names, and computes one layer:
norms, q/k/v projections (with their biases, q/k norms, Gemma 4's value norm and LoRA
adapters), rotary embeddings, attention
over what the layer's cache object holds (`caches`: the sequence itself, a prefix, a KV
cache or the page pool; with GPT-OSS's sinks), the output projection and the MLP (dense
SwiGLU / GeGLU, or the mixture of experts; Gemma 4's beside its dense MLP), and Gemma 4's
scaling of the layer's output.

The layer's math is composed from `layer_math` (norms, the dense matmul, RoPE, layer
kinds), `caches` and `moe`; the loop over layers and the embeddings live in
`layers.Transformer`. An MoE model's layers may differ
in their MLP (experts or dense, `cfg.dense_layers`): the MLP's parameters are then stacked
over the layers of their kind, and `__call__` is told which kind it runs (`sparse`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models._nnx import nnx
from jaxrl_llm.models.config import ModelConfig, Segment
from jaxrl_llm.models.gated_deltanet import LINEAR_WEIGHTS, linear_shapes
from jaxrl_llm.models.layer_math import (
    adapter_dropout,
    apply_rope,
    contracted,
    dense,
    gemma_rms_norm,
    layer_mask,
    lora_target_index,
    norm,
    rope_attention_factor,
    rope_frequencies,
)
from jaxrl_llm.models.moe import moe_mlp
from jaxrl_llm.models.segments import DENSE_MLP, DOUBLE_MLP, MOE_WEIGHTS, WIDE_ATTENTION


def normal_param(rngs: nnx.Rngs, shape, axes, std: float, dtype) -> nnx.Param:
    """A parameter drawn from N(0, std^2) (HF's `initializer_range`), cast to dtype, with
    its logical axis names `axes` (what the partitioning rules shard it by)."""
    return nnx.Param((std * jax.random.normal(rngs.params(), shape)).astype(dtype), axes=axes)


def const_param(value: float, shape, axes, dtype) -> nnx.Param:
    """A parameter filled with `value` (a norm's identity weight, a zero bias or LoRA B),
    with its logical axis names `axes`."""
    return nnx.Param(jnp.full(shape, value, dtype), axes=axes)


class Block(nnx.Module):
    """All decoder layers' parameters, stacked on a leading `layers` axis: over every
    layer, or over the layers of their kind (`segments.stacked_over`: an MoE model's
    dense-MLP layers, a hybrid model's two attention kinds, Gemma 4's own-sized full
    layers and KV-shared layers), and the layer loop scans each run of alike layers
    (`segment_params`).

    `__call__` computes ONE layer and must be given one layer's slice of the parameters
    (the scan in `layers.Transformer` does that by merging a sliced state).
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        normal = functools.partial(normal_param, rngs, std=cfg.initializer_range, dtype=dtype)
        # a norm's identity weight (Gemma 3 and Qwen3.5 scale by 1 + w)
        one = 0.0 if cfg.centered_norm else 1.0
        self.attn_norm = const_param(one, (L, D), ("layers", "norm"), dtype)
        if cfg.hybrid:
            self._add_linear(cfg, normal, rngs, dtype)
        # the softmax-attention layers (all but a hybrid model's DeltaNet ones and Gemma
        # 4's own-sized full layers, `_add_wide`)
        L = cfg.attention_kinds.count("softmax")
        if cfg.split_attention:
            self._add_wide(cfg, normal, dtype)
        Hq = 2 * H if cfg.attn_output_gate else H  # each head's query, then its gate
        Lkv = cfg.cache_layers("softmax")  # keys / values: not in KV-shared layers
        self.q = normal((L, D, N, Hq), ("layers", "embed", "q_heads", "head_dim"))
        self.k = normal((Lkv, D, K, H), ("layers", "embed", "kv_heads", "head_dim"))
        self.v = normal((Lkv, D, K, H), ("layers", "embed", "kv_heads", "head_dim"))
        self.o = normal((L, N, H, D), ("layers", "q_heads", "head_dim", "embed"))
        if cfg.qkv_bias:
            self.q_bias = const_param(0.0, (L, N, H), ("layers", "q_heads", "head_dim"), dtype)
            kv_axes = ("layers", "kv_heads", "head_dim")
            self.k_bias = const_param(0.0, (Lkv, K, H), kv_axes, dtype)
            self.v_bias = const_param(0.0, (Lkv, K, H), kv_axes, dtype)
        if cfg.o_bias:
            self.o_bias = const_param(0.0, (L, D), ("layers", "norm"), dtype)
        if cfg.qk_norm:
            self.q_norm = const_param(one, (L, H), ("layers", "head_dim"), dtype)
            self.k_norm = const_param(one, (Lkv, H), ("layers", "head_dim"), dtype)
        if cfg.attention_sinks:  # GPT-OSS: a logit per query head in the softmax
            self.sinks = normal((L, N), ("layers", "q_heads"))
        L = cfg.num_layers
        if cfg.gemma:  # norms of the attention's and the MLP's outputs
            self.post_attn_norm = const_param(one, (L, D), ("layers", "norm"), dtype)
            self.post_mlp_norm = const_param(one, (L, D), ("layers", "norm"), dtype)
        if cfg.gemma4:  # each layer's output times its own scalar
            self.layer_scalar = const_param(1.0, (L, 1), ("layers", None), dtype)
        if cfg.per_layer_input_size:  # Gemma 4: the per-layer input's gate and projection
            P = cfg.per_layer_input_size
            self.per_layer_gate = normal((L, D, P), ("layers", "embed", None))
            self.per_layer_out = normal((L, P, D), ("layers", None, "embed"))
            self.per_layer_post_norm = const_param(one, (L, D), ("layers", "norm"), dtype)
        self.mlp_norm = const_param(one, (L, D), ("layers", "norm"), dtype)
        if cfg.num_sparse_layers:
            self._add_experts(cfg, normal, dtype)
        for kind, names, width in ((False, DENSE_MLP, F), ("double", DOUBLE_MLP.values(), 2 * F)):
            Ld = cfg.mlp_kinds.count(kind)
            if Ld:  # the dense MLP (Gemma 4's double-wide one), in the layers that have it
                gate, up, down = names
                setattr(self, gate, normal((Ld, D, width), ("layers", "embed", "mlp")))
                setattr(self, up, normal((Ld, D, width), ("layers", "embed", "mlp")))
                setattr(self, down, normal((Ld, width, D), ("layers", "mlp", "embed")))
        if cfg.lora is not None:
            self._add_adapters(cfg.lora, rngs, dtype)
        self.cfg = cfg

    def _add_linear(self, cfg: ModelConfig, normal, rngs: nnx.Rngs, dtype) -> None:
        """The Gated DeltaNet layers' parameters (`gated_deltanet.LINEAR_WEIGHTS`),
        stacked over those layers; initialised as transformers does (norm 1, dt_bias 1,
        A = exp(A_log) ~ U(0.01, 16), the rest normal)."""
        L = sum(cfg.linear_layers)
        for name, (shape, axes) in linear_shapes(cfg).items():
            shape, axes = (L, *shape), ("layers", *axes)
            if name in ("lin_norm", "lin_dt_bias"):
                setattr(self, name, const_param(1.0, shape, axes, dtype))
            elif name == "lin_a_log":
                a = jax.random.uniform(rngs.params(), shape, jnp.float32, 0.01, 16.0)
                setattr(self, name, nnx.Param(jnp.log(a).astype(dtype), axes=axes))
            else:
                setattr(self, name, normal(shape, axes))

    def _add_wide(self, cfg: ModelConfig, normal, dtype) -> None:
        """Gemma 4's full layers with their own head size Hg and KV heads Kg
        (`segments.WIDE_ATTENTION`), stacked over those layers: wq [Lg, D, N, Hg], wk
        [Lg, D, Kg, Hg], wv (none with `k_eq_v`), wo [Lg, N, Hg, D], their q / k norms."""
        L, D, N = cfg.attention_kinds.count("wide"), cfg.hidden_size, cfg.num_heads
        K, H, Lkv = cfg.full_kv_heads, cfg.full_head_dim, cfg.cache_layers("wide")
        self.wq = normal((L, D, N, H), ("layers", "embed", "q_heads", "head_dim"))
        self.wk = normal((Lkv, D, K, H), ("layers", "embed", "kv_heads", "head_dim"))
        if not cfg.k_eq_v:
            self.wv = normal((Lkv, D, K, H), ("layers", "embed", "kv_heads", "head_dim"))
        self.wo = normal((L, N, H, D), ("layers", "q_heads", "head_dim", "embed"))
        self.wq_norm = const_param(1.0, (L, H), ("layers", "head_dim"), dtype)
        self.wk_norm = const_param(1.0, (Lkv, H), ("layers", "head_dim"), dtype)

    def _add_experts(self, cfg: ModelConfig, normal, dtype) -> None:
        """Of the Lm MoE layers: router [Lm, D, E], the experts' SwiGLU weights
        [Lm, E, D, F] / [Lm, E, F, D], the sigmoid router's selection bias [Lm, E] (zero,
        as HF initialises it) and the shared experts' [Lm, D, Fs] / [Lm, Fs, D] (Gemma 4:
        its dense MLP, with its router's scales and the MoE block's norms, all ones as in
        transformers)."""
        L, D, E = cfg.num_sparse_layers, cfg.hidden_size, cfg.num_experts
        F, Fs = cfg.moe_intermediate_size, cfg.shared_intermediate_size
        self.router = normal((L, D, E), ("layers", "embed", "router"))
        self.expert_gate = normal((L, E, D, F), ("layers", "expert", "embed", "expert_mlp"))
        self.expert_up = normal((L, E, D, F), ("layers", "expert", "embed", "expert_mlp"))
        self.expert_down = normal((L, E, F, D), ("layers", "expert", "expert_mlp", "embed"))
        if cfg.router in ("sigmoid", "topk_softmax"):  # the selection bias; the logits'
            self.router_bias = const_param(0.0, (L, E), ("layers", "router"), dtype)
        if cfg.router == "gemma4":  # the router's input scale, a scale per expert, norms
            self.router_norm = const_param(1.0, (L, D), ("layers", "norm"), dtype)
            self.expert_scale = const_param(1.0, (L, E), ("layers", "router"), dtype)
            for name in ("dense_post_norm", "expert_norm", "expert_post_norm"):
                setattr(self, name, const_param(1.0, (L, D), ("layers", "norm"), dtype))
        if cfg.expert_bias:  # GPT-OSS: biases of each expert's projections
            mlp_axes = ("layers", "expert", "expert_mlp")
            self.expert_gate_bias = const_param(0.0, (L, E, F), mlp_axes, dtype)
            self.expert_up_bias = const_param(0.0, (L, E, F), mlp_axes, dtype)
            self.expert_down_bias = const_param(0.0, (L, E, D), ("layers", "expert", "norm"), dtype)
        if Fs:
            self.shared_gate = normal((L, D, Fs), ("layers", "embed", "mlp"))
            self.shared_up = normal((L, D, Fs), ("layers", "embed", "mlp"))
            self.shared_down = normal((L, Fs, D), ("layers", "mlp", "embed"))
        if cfg.shared_expert_gate:  # Qwen3.5-MoE: sigmoid(h w) scales the shared expert
            self.shared_expert_gate = normal((L, D, 1), ("layers", "embed", None))

    def _mlp(self, h, dropout, routes, sparse, residual):
        """The MLP of one layer: (y [B,T,D], the router's own top-k [B,T,k] or None).
        routes [B,T,k]: the experts to replay (MoE only; None: the router's choice).
        sparse: this layer's MLP kind (`ModelConfig.mlp_kinds`: True the mixture of
        experts, "double" the double-wide dense one). residual: the stream h is the norm
        of (Gemma 4's router and experts read it)."""
        cfg = self.cfg
        if sparse is True:
            weights = {n: getattr(self, p)[...] for n, p in MOE_WEIGHTS.items() if hasattr(self, p)}
            return moe_mlp(cfg, h, weights, routes, residual)
        gate, up, down = DOUBLE_MLP.values() if sparse == "double" else DENSE_MLP
        g, u = self._proj(gate, h, dropout), self._proj(up, h, dropout)
        act = jax.nn.gelu(g, approximate=True) if cfg.gemma else jax.nn.silu(g)
        return self._proj(down, act * u, dropout), None

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
            setattr(self, name + "_lora_b", const_param(0.0, b_shape, b_axes, dtype))

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
        self,
        x,
        positions,
        mask,
        cache,
        layer=None,
        dropout=None,
        kind=None,
        *,
        routes=None,
        per_layer=None,
        segment=None,
    ):
        """One layer: (x [B,T,D], the cache as it left it, the MoE router's own top-k
        [B,T,k] or None). positions [B,T]; mask over the keys the cache holds. cache
        (`caches`): takes this layer's keys/values (DeltaNet: its state) and gives what it
        attends over. layer: its cache row (a KV-reusing layer: the storing layer's).
        dropout: its LoRA dropout key or None; kind: its `layer_kinds(cfg)` slice or None;
        routes [B,T,k]: experts to replay; per_layer [B,T,P]: Gemma 4's per-layer input.
        segment (`ModelConfig.layer_segments`; None: a plain layer): its MLP, DeltaNet
        or attention (`wide`: Gemma 4's own head size), KV sharing (`share`)."""
        cfg, seg = self.cfg, segment or Segment(0, 1, self.cfg.moe)
        if seg.linear:
            a, cache = self._linear(x, mask, cache, layer)
        else:
            args = (x, positions, mask, cache, layer, dropout, kind, seg.wide)
            a, cache = self._attention(*args, seg.share[0] if seg.share else None)
        x = x + a
        y, chosen = self._mlp(norm(cfg, x, self.mlp_norm[...]), dropout, routes, seg.mlp, x)
        if cfg.gemma:
            y = norm(cfg, y, self.post_mlp_norm[...])
        x = x + y
        if per_layer is not None:  # gelu(gate x) * input, projected back and normed
            g = jax.nn.gelu(dense(x, self.per_layer_gate[...]), approximate=True) * per_layer
            x = x + norm(cfg, dense(g, self.per_layer_out[...]), self.per_layer_post_norm[...])
        if cfg.gemma4:
            x = x * self.layer_scalar[...]
        return x, cache, chosen

    def _linear(self, x, mask, cache, layer):
        """The DeltaNet token mixer (`gated_deltanet`): (its output [B,T,D], the cache
        with this layer's recurrent state updated; teacher-forced: from a zero state)."""
        h = norm(self.cfg, x, self.attn_norm[...])
        w = {n: getattr(self, n)[...] for n in LINEAR_WEIGHTS}
        return cache.deltanet(self.cfg, layer, w, h, mask)

    def _attention(self, x, positions, mask, cache, layer, dropout, kind, wide=False, share=None):
        """The attention token mixer: (its output [B,T,D], the updated cache). wide: the
        layer's parameters are the own-sized full layers' (`_add_wide`). share: "store"
        or "reuse" in KV sharing (`__call__`), else None."""
        cfg = self.cfg
        names = {n: WIDE_ATTENTION[n] if wide else n for n in WIDE_ATTENTION}
        mask = layer_mask(cfg, mask, kind)
        h = norm(cfg, x, self.attn_norm[...])
        q = self._proj(names["q"], h, dropout)
        gate = None
        if cfg.attn_output_gate:  # Qwen3.5: each head's query, then its output gate
            q, gate = jnp.split(q, 2, axis=-1)
        if cfg.qkv_bias:
            q = q + self.q_bias[...]
        if cfg.qk_norm:
            q = norm(cfg, q, getattr(self, names["q_norm"])[...])
        inv_freq, scale = self._rope(kind, wide), rope_attention_factor(cfg)
        q = apply_rope(q, positions, inv_freq, scale)
        k = v = None  # a KV-shared layer's: its storing layer's, from the cache
        if share != "reuse":
            k, v = self._keys_values(h, positions, names, dropout, wide, inv_freq, scale)
        sinks = self.sinks[...] if cfg.attention_sinks else None
        # attention scales scores by head_dim^-1/2; Gemma 3 by query_pre_attn_scalar^-1/2,
        # Gemma 4 not at all
        scalar, head_dim = 1.0 if cfg.gemma4 else cfg.query_pre_attn_scalar, q.shape[-1]
        if scalar and scalar != head_dim:
            q = q * jnp.asarray((head_dim / scalar) ** 0.5, q.dtype)
        stored = cache.keep(k, v) if share == "store" else None
        a, cache = cache.attend(cfg, layer, q, k, v, mask, sinks)
        if share == "store":
            cache = cache.replace(shared=stored)
        if gate is not None:
            a = a * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(a.dtype)
        a = self._proj(names["o"], a, dropout)
        if cfg.o_bias:
            a = a + self.o_bias[...]
        if cfg.gemma:
            a = norm(cfg, a, self.post_attn_norm[...])
        return a, cache

    def _keys_values(self, h, positions, names, dropout, wide, inv_freq, scale):
        """The layer's keys (normed, rotated) and values [B,T,K,H] from h [B,T,D]."""
        cfg = self.cfg
        k = self._proj(names["k"], h, dropout)
        # keys as values (Gemma 4's `attention_k_eq_v`): k's projection, before its norm
        v = k if wide and cfg.k_eq_v else self._proj(names["v"], h, dropout)
        if cfg.qkv_bias:
            k, v = k + self.k_bias[...], v + self.v_bias[...]
        if cfg.qk_norm:
            k = norm(cfg, k, getattr(self, names["k_norm"])[...])
        if cfg.gemma4:  # values RMS-normed, without a weight
            v = gemma_rms_norm(v, None, cfg.rms_norm_eps)
        return apply_rope(k, positions, inv_freq, scale), v

    def _rope(self, kind, wide: bool):
        """The layer's RoPE inverse frequencies: its kind's (`layer_kinds`), or with
        `split_attention` (whose kinds differ in head size, so stack no frequencies)
        those of the sliding layers or of the full layers' own head size."""
        cfg = self.cfg
        if cfg.split_attention:
            return rope_frequencies(cfg, not wide, cfg.full_head_dim if wide else None)
        return rope_frequencies(cfg) if kind is None else kind["inv_freq"]
