"""Layers of two MLP kinds (an MoE model's experts, or a dense MLP: `cfg.dense_layers`)
and of two attention kinds (a hybrid model's Gated DeltaNet or full attention, Qwen3.5;
Gemma 4's sliding layers and its full layers with a head size of their own):
which Block parameters are stacked over which layers, and the rows a run of alike layers
reads (`ModelConfig.layer_segments`: one scan per run) or one layer reads (unrolled).

    params = segment_params(cfg, stacked, segment)   # a scan's stacked rows
    layer_i = layer_slice(cfg, per_index, i)          # one layer's, from `layer_params`
"""

from __future__ import annotations

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
# A hybrid model's full-attention parameters, stacked over its full-attention layers (in
# Gemma 4 with full layers of their own head size, `split_attention`: over its sliding
# layers, and the full layers' own under the names of WIDE_ATTENTION).
FULL_ATTENTION = tuple("q k v o q_bias k_bias v_bias o_bias q_norm k_norm sinks".split())
WIDE_ATTENTION = {n: "w" + n for n in ("q", "k", "v", "o", "q_norm", "k_norm")}


def mlp_kind(name: str) -> bool | None:
    """Whether the Block parameter `name` is stacked over the MoE layers (True), over the
    dense-MLP layers (False, with their LoRA adapters), or over every layer (None)."""
    if name in MOE_WEIGHTS.values():
        return True
    if name.split("_lora_")[0] in DENSE_MLP:
        return False
    return None


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


def _kind_of(cfg: ModelConfig, name: str) -> tuple[str, bool | str] | None:
    """("mlp" | "attn", kind) of a parameter stacked over one kind of layers, else None."""
    kind = mlp_kind(name)
    if kind is not None:
        return "mlp", kind
    kind = attn_kind(cfg, name)
    return None if kind is None else ("attn", kind)


def segment_params(cfg: ModelConfig, stacked: dict, segment) -> dict:
    """The stacked parameters of one `cfg.layer_segments()` run: every layer's slice
    [start:stop], each kind's own rows from the run's index among that kind's layers
    (`first` for the MLP's, `first_attn` for the attention's), and for the other kind's
    parameters a placeholder of zeros [stop - start] (never read by these layers; a scan
    needs every leaf to have their number of rows)."""
    n, out = segment.stop - segment.start, {}
    mine = {"mlp": (segment.sparse, segment.first), "attn": (segment.attn, segment.first_attn)}
    for name, a in stacked.items():
        group = _kind_of(cfg, name)
        start = segment.start if group is None else mine[group[0]][1]
        if group is not None and group[1] != mine[group[0]][0]:
            out[name] = jnp.zeros((n,), a.dtype)
        else:
            out[name] = a if (start, n) == (0, a.shape[0]) else a[start : start + n]
    return out


def layer_slice(cfg: ModelConfig, per_index: dict, i: int) -> dict:
    """Layer i's parameters out of {name: each row of that stack} (`transformer.
    layer_params`): a kind's parameters at the layer's row among its kind, a zero scalar
    placeholder for the other kind's."""
    kinds = {"mlp": cfg.sparse_layers, "attn": cfg.attention_kinds}
    out = {}
    for name, rows in per_index.items():
        group = _kind_of(cfg, name)
        if group is None:
            out[name] = rows[i]
            continue
        of = kinds[group[0]]
        if of[i] != group[1]:
            out[name] = jnp.zeros((), rows[0].dtype)
        else:
            out[name] = rows[sum(1 for j in range(i) if of[j] == of[i])]
    return out


def layer_rows(tree, start: int, stop: int):
    """Rows start..stop of every [L, ...] leaf (the whole leaf when that is all of it)."""

    def rows(a):
        return a if (start, stop) == (0, a.shape[0]) else a[start:stop]

    return jax.tree.map(rows, tree)
