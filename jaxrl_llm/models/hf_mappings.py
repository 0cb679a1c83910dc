"""How each parameter of ours relates to Hugging Face tensors: `Mapping` (an HF name, the
layout change both ways, the layers a stacked parameter covers, and the part of the HF
tensor it is) and `mappings(cfg)`, the table of every parameter of a config, with the
families' own tables (GPT-OSS's and Gemma 4's fused experts, Qwen3.5's Gated DeltaNet,
Qwen3-Next's fused DeltaNet projections). `hf_io` loads and saves through it, `gguf_io`
renames its names to llama.cpp's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.hf_config import GPT_OSS, QWEN3_NEXT
from jaxrl_llm.models.params import param_specs
from jaxrl_llm.models.segments import DOUBLE_MLP, WIDE_ATTENTION, stacked_over


@dataclasses.dataclass(frozen=True)
class Mapping:
    """How one parameter of ours relates to HF tensors.

        `name` is the HF name (with `{i}` for the layer index of stacked parameters, and `{e}`
    for the expert index of an MoE layer's experts, stacked [L, E, ...] on our side);
        `to_ours` turns the HF array into our layout (views only: it runs on memory maps);
        `to_hf` is its inverse.
    """

    name: str
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    # the HF layer index of each row of a stacked parameter (None: row i is layer i); an
    # MLP parameter of an MoE model with dense layers is stacked over its kind's layers
    layer_ids: tuple[int, ...] | None = None
    # (offset, count): the parameter is part `offset` of `count` of the HF tensor along
    # `part_axis`: every count-th entry from offset when `interleaved` (GPT-OSS interleaves
    # its experts' gate and up in `gate_up_proj`'s last axis), else the offset-th of count
    # equal blocks (Gemma 4 stacks them, gate first, in its `gate_up_proj`'s axis -2);
    # (0, 1): the whole tensor
    part: tuple[int, int] = (0, 1)
    part_axis: int = -1
    interleaved: bool = True
    # or (entries, whole): the parameter is these entries, in this order, of the HF
    # tensor's `whole` along `part_axis` (Qwen3-Next interleaves its DeltaNet's q, k, v
    # and z per key-head group in `in_proj_qkvz`, of uneven widths); () : not used
    picks: tuple[tuple[int, ...], int] | tuple[()] = ()

    @property
    def split(self) -> bool:
        """The parameter is a part of its HF tensor."""
        return self.part[1] > 1 or bool(self.picks)

    def _part_index(self, ndim: int, width: int) -> tuple:
        """The index of this parameter's part (`width` entries along `part_axis`) in the
        HF tensor of `ndim` dimensions."""
        offset, count = self.part
        if self.picks:
            where = np.asarray(self.picks[0])
        elif self.interleaved:
            where = slice(offset, None, count)
        else:
            where = slice(offset * width, (offset + 1) * width)
        return (slice(None),) * (self.part_axis % ndim) + (where,)

    def ours(self, w: np.ndarray) -> np.ndarray:
        """The HF array (this parameter's part of it) in our layout; a view, but for
        `picks` (a copy of that part)."""
        if not self.split:
            return self.to_ours(w)
        width = w.shape[self.part_axis] // self.part[1]
        return self.to_ours(w[self._part_index(w.ndim, width)])

    def into_hf(self, x: np.ndarray, tensors: dict, name: str, dtype) -> None:
        """Writes our array x as (its part of) the HF tensor `name` in `tensors`."""
        y = self.to_hf(x).astype(dtype or x.dtype)
        if not self.split:
            tensors[name] = np.ascontiguousarray(y)
            return
        if name not in tensors:
            tensors[name] = np.empty(self.whole_shape(y.shape), y.dtype)
        tensors[name][self._part_index(y.ndim, y.shape[self.part_axis])] = y

    def whole_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The HF tensor's shape from its part's."""
        shape = list(shape)
        if self.picks:
            shape[self.part_axis] = self.picks[1]
        else:
            shape[self.part_axis] *= self.part[1]
        return tuple(shape)

    @property
    def stacked(self) -> bool:
        return "{i}" in self.name

    @property
    def experts(self) -> bool:
        return "{e}" in self.name

    def hf_names(self, cfg: ModelConfig):
        """(HF tensor name, our index into the parameter) for every tensor it is made of."""
        if not self.stacked:
            return [(self.name, ())]
        layers = self.layers(cfg)
        if not self.experts:
            return [(self.name.format(i=i), (row,)) for row, i in enumerate(layers)]
        return [
            (self.name.format(i=i, e=e), (row, e))
            for row, i in enumerate(layers)
            for e in range(cfg.num_experts)
        ]

    def layers(self, cfg: ModelConfig) -> tuple[int, ...]:
        """The HF layer index of each row of the stacked parameter."""
        return tuple(range(cfg.num_layers)) if self.layer_ids is None else self.layer_ids

    def layers_of(self, rows) -> list[int]:
        """The HF layer indices of these rows of the stacked parameter."""
        return list(rows) if self.layer_ids is None else [self.layer_ids[r] for r in rows]


def _identity(x):
    return x


def mappings(cfg: ModelConfig) -> dict[tuple[str, ...], Mapping]:
    D, H = cfg.hidden_size, cfg.head_dim
    N, K = cfg.num_heads, cfg.num_kv_heads

    def in_heads(n, H=H):  # HF [n*H, D] <-> ours [D, n, H]
        return Mapping("", lambda w: w.T.reshape(D, n, H), lambda w: w.reshape(D, n * H).T)

    def bias(n):  # HF [n*H] <-> ours [n, H]
        return Mapping("", lambda b: b.reshape(n, H), lambda b: b.reshape(n * H))

    transpose = Mapping("", lambda w: w.T, lambda w: w.T)
    same = Mapping("", _identity, _identity)
    out_heads = Mapping("", lambda w: w.T.reshape(N, H, D), lambda w: w.reshape(N * H, D).T)
    q_width = 2 if cfg.attn_output_gate else 1  # Qwen3.5: per head its query, then its gate
    layer = "model.layers.{i}."
    table = {
        ("embed",): ("model.embed_tokens.weight", same),
        ("final_norm",): ("model.norm.weight", same),
        ("lm_head",): ("lm_head.weight", transpose),
        ("layers", "attn_norm"): (layer + "input_layernorm.weight", same),
        ("layers", "q"): (layer + "self_attn.q_proj.weight", in_heads(N, H * q_width)),
        ("layers", "k"): (layer + "self_attn.k_proj.weight", in_heads(K)),
        ("layers", "v"): (layer + "self_attn.v_proj.weight", in_heads(K)),
        ("layers", "o"): (layer + "self_attn.o_proj.weight", out_heads),
        ("layers", "q_bias"): (layer + "self_attn.q_proj.bias", bias(N)),
        ("layers", "k_bias"): (layer + "self_attn.k_proj.bias", bias(K)),
        ("layers", "v_bias"): (layer + "self_attn.v_proj.bias", bias(K)),
        ("layers", "o_bias"): (layer + "self_attn.o_proj.bias", same),
        ("layers", "q_norm"): (layer + "self_attn.q_norm.weight", same),
        ("layers", "k_norm"): (layer + "self_attn.k_norm.weight", same),
        ("layers", "mlp_norm"): (layer + "post_attention_layernorm.weight", same),
        ("layers", "gate"): (layer + "mlp.gate_proj.weight", transpose),
        ("layers", "up"): (layer + "mlp.up_proj.weight", transpose),
        ("layers", "down"): (layer + "mlp.down_proj.weight", transpose),
        ("layers", "router"): (layer + "mlp.gate.weight", transpose),
        ("layers", "expert_gate"): (layer + "mlp.experts.{e}.gate_proj.weight", transpose),
        ("layers", "expert_up"): (layer + "mlp.experts.{e}.up_proj.weight", transpose),
        ("layers", "expert_down"): (layer + "mlp.experts.{e}.down_proj.weight", transpose),
        ("layers", "router_bias"): (layer + "mlp.gate.e_score_correction_bias", same),
        ("layers", "shared_gate"): (layer + "mlp.shared_experts.gate_proj.weight", transpose),
        ("layers", "shared_up"): (layer + "mlp.shared_experts.up_proj.weight", transpose),
        ("layers", "shared_down"): (layer + "mlp.shared_experts.down_proj.weight", transpose),
    }
    if cfg.architecture == GPT_OSS:
        table |= _gpt_oss_table(layer, same, transpose)
    if cfg.gemma:  # norms before and after both the attention and the MLP
        table[("layers", "post_attn_norm")] = (layer + "post_attention_layernorm.weight", same)
        table[("layers", "mlp_norm")] = (layer + "pre_feedforward_layernorm.weight", same)
        table[("layers", "post_mlp_norm")] = (layer + "post_feedforward_layernorm.weight", same)
        table[("layers", "layer_scalar")] = (layer + "layer_scalar", same)  # Gemma 4's
    if cfg.hybrid:
        table |= _qwen3_5_table(cfg, layer, same, transpose)
    if cfg.router == "gemma4":
        table |= _gemma4_moe_table(layer, same, transpose)
    if cfg.per_layer_input_size:  # Gemma 4's per-layer input embeddings
        table |= {
            ("per_layer_embed",): ("model.embed_tokens_per_layer.weight", same),
            ("per_layer_proj",): ("model.per_layer_model_projection.weight", transpose),
            ("per_layer_norm",): ("model.per_layer_projection_norm.weight", same),
            ("layers", "per_layer_gate"): (layer + "per_layer_input_gate.weight", transpose),
            ("layers", "per_layer_out"): (layer + "per_layer_projection.weight", transpose),
            ("layers", "per_layer_post_norm"): (layer + "post_per_layer_input_norm.weight", same),
        }
    if cfg.split_attention:  # Gemma 4's full layers, of their own head size
        Hg, Kg = cfg.full_head_dim, cfg.full_kv_heads
        wide = {
            "q": in_heads(N, Hg),
            "k": in_heads(Kg, Hg),
            "v": in_heads(Kg, Hg),
            "o": Mapping("", lambda w: w.T.reshape(N, Hg, D), lambda w: w.reshape(N * Hg, D).T),
            "q_norm": same,
            "k_norm": same,
        }
        for name, ours in WIDE_ATTENTION.items():
            table[("layers", ours)] = (table[("layers", name)][0], wide[name])
    for name, ours in DOUBLE_MLP.items():  # Gemma 4's KV-shared layers' wider MLP
        table[("layers", ours)] = table[("layers", name)]
    out = {}
    for path in param_specs(cfg):
        ids = stacked_over(cfg, path[-1]) if path[0] == "layers" else None
        out[path] = dataclasses.replace(table[path][1], name=table[path][0], layer_ids=ids)
    return out


def _gpt_oss_table(layer: str, same: Mapping, transpose: Mapping) -> dict:
    """GPT-OSS's names: the sinks, the router (`mlp.router`, with its bias) and the
    experts stacked per layer in x @ W layout, gate and up interleaved in `gate_up_proj`
    [E, D, 2F] (gate at even columns, as `GptOssExperts._apply_gate` reads them)."""
    experts = layer + "mlp.experts."

    def part(offset):
        return dataclasses.replace(same, part=(offset, 2))

    return {
        ("layers", "sinks"): (layer + "self_attn.sinks", same),
        ("layers", "router"): (layer + "mlp.router.weight", transpose),
        ("layers", "router_bias"): (layer + "mlp.router.bias", same),
        ("layers", "expert_gate"): (experts + "gate_up_proj", part(0)),
        ("layers", "expert_up"): (experts + "gate_up_proj", part(1)),
        ("layers", "expert_down"): (experts + "down_proj", same),
        ("layers", "expert_gate_bias"): (experts + "gate_up_proj_bias", part(0)),
        ("layers", "expert_up_bias"): (experts + "gate_up_proj_bias", part(1)),
        ("layers", "expert_down_bias"): (experts + "down_proj_bias", same),
    }


def _gemma4_moe_table(layer: str, same: Mapping, transpose: Mapping) -> dict:
    """Gemma 4's MoE block: the router (`router.proj`, its input scale `router.scale`, its
    `per_expert_scale`), the experts stacked per layer in F.linear layout, gate and up
    stacked in `gate_up_proj` [E, 2F, D] (gate first, as `Gemma4TextExperts` chunks
    them), `down_proj` [E, D, F]; the dense MLP (our shared expert) under `mlp.*`; the
    branches' three norms."""
    experts = layer + "experts."
    swap = Mapping("", lambda w: w.swapaxes(-1, -2), lambda w: w.swapaxes(-1, -2))

    def half(offset):
        return dataclasses.replace(swap, part=(offset, 2), part_axis=-2, interleaved=False)

    return {
        ("layers", "router"): (layer + "router.proj.weight", transpose),
        ("layers", "router_norm"): (layer + "router.scale", same),
        ("layers", "expert_scale"): (layer + "router.per_expert_scale", same),
        ("layers", "expert_gate"): (experts + "gate_up_proj", half(0)),
        ("layers", "expert_up"): (experts + "gate_up_proj", half(1)),
        ("layers", "expert_down"): (experts + "down_proj", swap),
        ("layers", "shared_gate"): (layer + "mlp.gate_proj.weight", transpose),
        ("layers", "shared_up"): (layer + "mlp.up_proj.weight", transpose),
        ("layers", "shared_down"): (layer + "mlp.down_proj.weight", transpose),
        ("layers", "dense_post_norm"): (layer + "post_feedforward_layernorm_1.weight", same),
        ("layers", "expert_norm"): (layer + "pre_feedforward_layernorm_2.weight", same),
        ("layers", "expert_post_norm"): (layer + "post_feedforward_layernorm_2.weight", same),
    }


def _qwen3_5_table(cfg: ModelConfig, layer: str, same: Mapping, transpose: Mapping) -> dict:
    """Qwen3.5's Gated DeltaNet tensors (`linear_attn.*`) and Qwen3.5-MoE's gated shared
    expert (`mlp.shared_expert.*`, `mlp.shared_expert_gate`)."""
    D, Hv, Dv = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    lin = layer + "linear_attn."
    z = Mapping("", lambda w: w.T.reshape(D, Hv, Dv), lambda w: w.reshape(D, Hv * Dv).T)
    out = Mapping("", lambda w: w.T.reshape(Hv, Dv, D), lambda w: w.reshape(Hv * Dv, D).T)
    conv = Mapping("", lambda w: w[:, 0, :].T, lambda w: w.T[:, None, :])  # [C,1,K] <-> [K,C]
    mlp = layer + "mlp."
    if cfg.architecture == QWEN3_NEXT:
        projections = _qwen3_next_projections(cfg, lin, z, transpose)
    else:
        projections = {
            ("layers", "lin_qkv"): (lin + "in_proj_qkv.weight", transpose),
            ("layers", "lin_z"): (lin + "in_proj_z.weight", z),
            ("layers", "lin_b"): (lin + "in_proj_b.weight", transpose),
            ("layers", "lin_a"): (lin + "in_proj_a.weight", transpose),
        }
    return projections | {
        ("layers", "lin_conv"): (lin + "conv1d.weight", conv),
        ("layers", "lin_dt_bias"): (lin + "dt_bias", same),
        ("layers", "lin_a_log"): (lin + "A_log", same),
        ("layers", "lin_norm"): (lin + "norm.weight", same),
        ("layers", "lin_out"): (lin + "out_proj.weight", out),
        ("layers", "shared_gate"): (mlp + "shared_expert.gate_proj.weight", transpose),
        ("layers", "shared_up"): (mlp + "shared_expert.up_proj.weight", transpose),
        ("layers", "shared_down"): (mlp + "shared_expert.down_proj.weight", transpose),
        ("layers", "shared_expert_gate"): (mlp + "shared_expert_gate.weight", transpose),
    }


def _qwen3_next_projections(cfg: ModelConfig, lin: str, z: Mapping, transpose: Mapping) -> dict:
    """Qwen3-Next's DeltaNet input projections: `in_proj_qkvz` holds, per key head g,
    its query and key, then the values and output gates of the value heads it serves
    (each a block of rows of the [out, in] weight); `in_proj_ba` per key head its value
    heads' beta, then their decay inputs. Ours are Qwen3.5's: all queries, all keys,
    all values (`lin_qkv`), the gates (`lin_z`), beta (`lin_b`) and decay (`lin_a`)."""
    nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    r = cfg.linear_num_value_heads // nk  # value heads per key head
    rv = r * cfg.linear_value_head_dim
    group = 2 * dk + 2 * rv  # rows of in_proj_qkvz per key head

    def rows(start, width, every):  # that block of every key head's rows, g = 0..nk-1
        return tuple(g * every + start + j for g in range(nk) for j in range(width))

    def picks(m, entries, whole):
        return dataclasses.replace(m, picks=(entries, whole), part_axis=0)

    q, k, v = rows(0, dk, group), rows(dk, dk, group), rows(2 * dk, rv, group)
    qkvz, ba = lin + "in_proj_qkvz.weight", lin + "in_proj_ba.weight"
    return {
        ("layers", "lin_qkv"): (qkvz, picks(transpose, q + k + v, nk * group)),
        ("layers", "lin_z"): (qkvz, picks(z, rows(2 * dk + rv, rv, group), nk * group)),
        ("layers", "lin_b"): (ba, picks(transpose, rows(0, r, 2 * r), 2 * r * nk)),
        ("layers", "lin_a"): (ba, picks(transpose, rows(r, r, 2 * r), 2 * r * nk)),
    }
