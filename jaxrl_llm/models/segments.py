"""Layers of several MLP kinds (an MoE model's experts, or a dense MLP: `cfg.dense_layers`;
Gemma 4's double-wide MLP), of two attention kinds (a hybrid model's Gated DeltaNet or
full attention, Qwen3.5; Gemma 4's sliding layers and its full layers with a head size of
their own), and Gemma 4's KV-shared layers, which have no keys/values of their own:
which Block parameters are stacked over which layers, and the rows a run of alike layers
reads (`ModelConfig.layer_segments`: one scan per run) or one layer reads (unrolled).

    params = segment_params(cfg, stacked, segment)   # a scan's stacked rows
    layer_i = layer_slice(cfg, per_index, i)          # one layer's, from `layer_params`
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.gated_deltanet import LINEAR_WEIGHTS

# moe.moe_mlp's weight names -> the Block parameters holding them (stacked over the MoE
# layers only, as the dense MLP's gate / up / down are over the dense layers only).
MOE_WEIGHTS = {
    "router": "router",
    "router_bias": "router_bias",
    "gate": "expert_gate",
    "up": "expert_up",
    "down": "expert_down",
    "shared_gate": "shared_gate",
    "shared_up": "shared_up",
    "shared_down": "shared_down",
    "gate_bias": "expert_gate_bias",
    "up_bias": "expert_up_bias",
    "down_bias": "expert_down_bias",
    "shared_expert_gate": "shared_expert_gate",
    "router_norm": "router_norm",
    "expert_scale": "expert_scale",
    "dense_post_norm": "dense_post_norm",
    "expert_norm": "expert_norm",
    "expert_post_norm": "expert_post_norm",
}
DENSE_MLP = ("gate", "up", "down")
# Gemma 4's double-wide MLP of its KV-shared layers (`ModelConfig.double_wide_mlp`).
DOUBLE_MLP = {n: n + "_x2" for n in DENSE_MLP}
# A hybrid model's full-attention parameters, stacked over its full-attention layers (in
# Gemma 4 with full layers of their own head size, `split_attention`: over its sliding
# layers, and the full layers' own under the names of WIDE_ATTENTION).
FULL_ATTENTION = tuple("q k v o q_bias k_bias v_bias o_bias q_norm k_norm sinks".split())
WIDE_ATTENTION = {n: "w" + n for n in ("q", "k", "v", "o", "q_norm", "k_norm")}
# The parameters a KV-shared layer lacks (`ModelConfig.kv_sharing`): its keys and values.
OWN_KV = ("k", "v", "k_bias", "v_bias", "k_norm", "wk", "wv", "wk_norm")


def attn_kind(cfg: ModelConfig, name: str) -> str | None:
    """The attention kind (`ModelConfig.attention_kinds`) whose layers the Block parameter
    `name` is stacked over, in a model with two: Qwen3.5's Gated DeltaNet ("linear") and
    full attention ("softmax"); Gemma 4's sliding ("softmax") and own-sized full layers
    ("wide"). None for the parameters of every layer, and for every parameter of any
    other model."""
    if cfg.hybrid:
        return "linear" if name in LINEAR_WEIGHTS else "softmax" if name in FULL_ATTENTION else None
    if cfg.split_attention:
        if name in WIDE_ATTENTION.values():
            return "wide"
        return "softmax" if name in FULL_ATTENTION else None
    return None


@functools.lru_cache(maxsize=4096)
def stacked_over(cfg: ModelConfig, name: str) -> tuple[int, ...] | None:
    """The layers whose rows the Block parameter `name` stacks, in layer order; None for
    every layer. An MLP's parameters are stacked over the layers of their MLP kind
    (`ModelConfig.mlp_kinds`: experts, dense, double-wide; LoRA adapters with the weight
    they adapt), attention parameters over the layers of their attention kind
    (`attn_kind`), keys' and values' (`OWN_KV`) over the layers that are not KV-shared."""
    base = name.split("_lora_")[0]
    mlp = True if name in MOE_WEIGHTS.values() else False if base in DENSE_MLP else None
    mlp = "double" if base in DOUBLE_MLP.values() else mlp
    L = range(cfg.num_layers)
    if mlp is not None:
        layers = [i for i in L if cfg.mlp_kinds[i] == mlp]
    else:
        kind = attn_kind(cfg, name)
        layers = [i for i in L if kind is None or cfg.attention_kinds[i] == kind]
        if name in OWN_KV:
            layers = [i for i in layers if cfg.kv_source(i) == i]
    return None if len(layers) == cfg.num_layers else tuple(layers)


def segment_params(cfg: ModelConfig, stacked: dict, segment) -> dict:
    """The stacked parameters of one `cfg.layer_segments()` run: each parameter's rows of
    the run's layers (`stacked_over`), and for a parameter these layers do not have a
    placeholder of zeros [stop - start] (never read by them; a scan needs every leaf to
    have their number of rows)."""
    n, out = segment.stop - segment.start, {}
    for name, a in stacked.items():
        layers = stacked_over(cfg, name)
        if layers is not None and segment.start not in layers:
            out[name] = jnp.zeros((n,), a.dtype)
            continue
        start = segment.start if layers is None else layers.index(segment.start)
        out[name] = a if (start, n) == (0, a.shape[0]) else a[start : start + n]
    return out


def layer_slice(cfg: ModelConfig, per_index: dict, i: int) -> dict:
    """Layer i's parameters out of {name: each row of that stack} (`transformer.
    layer_params`): each parameter's row of layer i, a zero scalar placeholder for a
    parameter layer i does not have."""
    out = {}
    for name, rows in per_index.items():
        layers = stacked_over(cfg, name)
        if layers is None:
            out[name] = rows[i]
        elif i in layers:
            out[name] = rows[layers.index(i)]
        else:
            out[name] = jnp.zeros((), rows[0].dtype)
    return out


def layer_rows(tree, start: int, stop: int):
    """Rows start..stop of every [L, ...] leaf (the whole leaf when that is all of it)."""

    def rows(a):
        return a if (start, stop) == (0, a.shape[0]) else a[start:stop]

    return jax.tree.map(rows, tree)
