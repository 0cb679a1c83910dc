"""An MoE model's layers of two MLP kinds (experts, or a dense MLP: `cfg.dense_layers`):
which Block parameters are stacked over which layers, and the rows a run of alike layers
reads (`ModelConfig.layer_segments`: one scan per run) or one layer reads (unrolled).

    params = segment_params(cfg, stacked, segment)   # a scan's stacked rows
    layer_i = layer_slice(cfg, per_index, i)          # one layer's, from `layer_params`
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.models.config import ModelConfig

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
}
DENSE_MLP = ("gate", "up", "down")


def mlp_kind(name: str) -> bool | None:
    """Whether the Block parameter `name` is stacked over the MoE layers (True), over the
    dense-MLP layers (False, with their LoRA adapters), or over every layer (None)."""
    if name in MOE_WEIGHTS.values():
        return True
    if name.split("_lora_")[0] in DENSE_MLP:
        return False
    return None


def segment_params(cfg: ModelConfig, stacked: dict, segment) -> dict:
    """The stacked parameters of one `cfg.layer_segments()` run (start, stop, sparse,
    first): every layer's slice [start:stop], that MLP kind's [first:first + stop -
    start], and for the other kind's parameters a placeholder of zeros [stop - start]
    (never read by these layers; a scan needs every leaf to have their number of rows)."""
    start, stop, sparse, first = segment
    n, out = stop - start, {}
    for name, a in stacked.items():
        kind = mlp_kind(name)
        if kind is None:
            out[name] = a if (start, stop) == (0, a.shape[0]) else a[start:stop]
        elif kind == sparse:
            out[name] = a if (first, n) == (0, a.shape[0]) else a[first : first + n]
        else:
            out[name] = jnp.zeros((n,), a.dtype)
    return out


def layer_slice(cfg: ModelConfig, per_index: dict, i: int) -> dict:
    """Layer i's parameters out of {name: each row of that stack} (`transformer.
    layer_params`): MLP parameters at the layer's row among its kind, a zero scalar
    placeholder for the other kind's."""
    sparse = cfg.sparse_layers[i]
    row = sum(1 for j in range(i) if cfg.sparse_layers[j] == sparse)
    out = {}
    for name, rows in per_index.items():
        kind = mlp_kind(name)
        if kind is None:
            out[name] = rows[i]
        elif kind == sparse:
            out[name] = rows[row]
        else:
            out[name] = jnp.zeros((), rows[0].dtype)
    return out


def layer_rows(tree, start: int, stop: int):
    """Rows start..stop of every [L, ...] leaf (the whole leaf when that is all of it)."""

    def rows(a):
        return a if (start, stop) == (0, a.shape[0]) else a[start:stop]

    return jax.tree.map(rows, tree)
