"""Hugging Face checkpoints in and out: `load_hf` and `save_hf`.

Loading reads each tensor straight into its target sharding with
`jax.make_array_from_callback`: every device shard is cut from the memory-mapped file,
converted to the requested dtype and copied to its device, so no host ever holds a full
copy of the model (each process reads only its own devices' shards). Stacked layer
parameters [L, ...] are assembled from the L per-layer HF tensors the same way.
`load_params` is that path for any tensor source that hands out arrays in the HF layout
(`gguf_io` reads GGUF files through it).

Every tensor the decoder expects must be present with the expected shape, and every
tensor in the checkpoint must be used: the only exceptions are RoPE `inv_freq` buffers
(recomputed from the config) and `lm_head.weight` when the embeddings are tied (HF ties
it to the embedding as well).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxrl_llm.errors import UserError
from jaxrl_llm.models import partitioning
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.hf_config import GPT_OSS, QWEN3_NEXT
from jaxrl_llm.models.params import param_specs, unflatten
from jaxrl_llm.models.safetensors_io import INDEX_FILE, Checkpoint, write_file
from jaxrl_llm.models.segments import DOUBLE_MLP, WIDE_ATTENTION, stacked_over

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class CheckpointError(UserError, ValueError):
    """A checkpoint does not match the model its config describes."""


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


def _hf_shape(m: Mapping, our_shape: tuple[int, ...]) -> tuple[int, ...]:
    per_tensor = our_shape[m.stacked + m.experts :]
    return m.whole_shape(m.to_hf(np.empty(per_tensor, np.int8)).shape)


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    """RoPE buffers, a tied lm_head, GLM-4.5's multi-token-prediction layers (stored
    as layers num_layers.. after the decoder's; the decoder does not use them), and the
    key / value projections and norms a checkpoint may hold for Gemma 4's KV-shared
    layers (transformers ignores them too)."""
    if name.endswith("rotary_emb.inv_freq") or (
        cfg.tie_word_embeddings and name == "lm_head.weight"
    ):
        return True
    for prefix in ("model.layers.", "blk."):  # HF's and GGUF's layer names
        if (cfg.mtp_layers or cfg.kv_shared_layers) and name.startswith(prefix):
            layer, _, rest = name[len(prefix) :].partition(".")
            if cfg.mtp_layers:
                return int(layer) >= cfg.num_layers
            own_kv = rest.split(".")[:2] in [["self_attn", n] for n in _SHARED_KV]
            return own_kv and int(layer) >= cfg.num_layers - cfg.kv_shared_layers
    return False


_SHARED_KV = ("k_proj", "v_proj", "k_norm", "v_norm")  # of a KV-shared layer: unused


def _validate(cfg: ModelConfig, ckpt, maps, path: str, config_name: str) -> None:
    """Every expected tensor present with its shape, and nothing left over."""
    specs, expected = param_specs(cfg), {}
    for p, m in maps.items():
        hf_shape = _hf_shape(m, specs[p].shape)
        for name, _ in m.hf_names(cfg):
            expected[name] = hf_shape
    for name, shape in expected.items():
        if name not in ckpt:
            raise CheckpointError(f"{path}: tensor {name!r} is missing from the checkpoint")
        got = ckpt.tensors[name].shape
        if got != shape:
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {list(got)}, expected {list(shape)} "
                f"from {config_name}"
            )
    extra = sorted(n for n in ckpt.names() if n not in expected and not _ignorable(n, cfg))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(
            f"{path}: unexpected tensor {extra[0]!r}{more}: the {cfg.architecture} decoder "
            f"has no parameter for it"
        )


def load_hf(path, mesh=None, dtype="float32", rules=None, **runtime):
    """Loads a local HF model directory -> (ModelConfig, params).

    Args:
      path: directory with config.json and *.safetensors (single, several, or index json).
      mesh: a `jax.sharding.Mesh` with axes ('data', 'fsdp', 'tensor'); None = one device.
      dtype: parameter dtype ("float32", "bfloat16", ...); files may be fp32/fp16/bf16.
      rules: logical-axis rules (default `partitioning.DEFAULT_RULES`).
      runtime: ModelConfig runtime fields, e.g. remat="full".
    """
    path = os.fspath(path)
    cfg = ModelConfig.from_hf_dir(path, **runtime)
    params = load_params(cfg, Checkpoint(path), mappings(cfg), path, mesh, dtype, rules)
    return cfg, params


def load_params(
    cfg: ModelConfig,
    ckpt,
    maps,
    source: str,
    mesh=None,
    dtype="float32",
    rules=None,
    config_name: str = "config.json",
) -> dict:
    """The params of `cfg`, each tensor read straight into its target sharding.

    Args:
      ckpt: the tensor source: `name in ckpt`, `ckpt.names()`, `ckpt.tensors[name].shape`
        and `ckpt.get(name)` -> an array in the HF layout (a memory map, or any array the
        shard reader may slice).
      maps: {param path: Mapping} whose `name`s are the source's tensor names.
      source: the file or directory named in errors; `config_name` where shapes come from.
    """
    _validate(cfg, ckpt, maps, source, config_name)
    dtype = np.dtype(jnp.dtype(dtype))
    specs, flat = param_specs(cfg), {}
    for p, m in maps.items():
        spec = specs[p]
        sharding = partitioning.logical_to_sharding(spec.axes, spec.shape, mesh, rules)
        flat[p] = jax.make_array_from_callback(
            spec.shape, sharding, _shard_reader(ckpt, m, spec.shape, dtype)
        )
    return unflatten(flat)


def _shard_reader(ckpt, m: Mapping, shape, dtype):
    def read(index: tuple[slice, ...]) -> np.ndarray:
        if not m.stacked:
            return np.asarray(m.ours(ckpt.get(m.name))[index], dtype=dtype)
        layers = m.layers_of(range(*index[0].indices(shape[0])))
        if m.experts:
            experts = range(*index[1].indices(shape[1]))
            return np.stack(
                [
                    np.stack(
                        [
                            np.asarray(m.ours(ckpt.get(m.name.format(i=i, e=e)))[index[2:]])
                            for e in experts
                        ]
                    ).astype(dtype)
                    for i in layers
                ]
            )
        return np.stack(
            [
                np.asarray(m.ours(ckpt.get(m.name.format(i=i)))[index[1:]], dtype=dtype)
                for i in layers
            ]
        )

    return read


def _to_host(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def save_hf(
    cfg: ModelConfig,
    params,
    out_dir,
    tokenizer_dir=None,
    dtype=None,
    max_shard_bytes: int = 2 << 30,
) -> None:
    """Writes params as a HF model directory that `transformers` loads.

    Tensors are gathered one at a time (all processes take part; process 0 writes).
    Files larger than `max_shard_bytes` are split, with a `model.safetensors.index.json`.
    `dtype` defaults to the params' dtype. `tokenizer_dir`: tokenizer files to copy along.
    """
    out_dir = os.fspath(out_dir)
    write = jax.process_index() == 0
    specs, maps = param_specs(cfg), mappings(cfg)
    names = []  # (hf name, our path, layer or None, nbytes)
    for p, m in maps.items():
        leaf = params[p[0]] if len(p) == 1 else params[p[0]][p[1]]
        itemsize = np.dtype(dtype or leaf.dtype).itemsize
        per = int(np.prod(specs[p].shape[m.stacked + m.experts :])) * itemsize
        for name, index in m.hf_names(cfg):
            names.append((name, p, index, per))
    shards, size = [[]], 0
    for entry in sorted(names):
        joined = shards[-1] and shards[-1][-1][0] == entry[0]  # parts of one HF tensor
        if shards[-1] and size + entry[3] > max_shard_bytes and not joined:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry[3]
    if write:
        os.makedirs(out_dir, exist_ok=True)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    weight_map = {}
    for fn, shard in zip(files, shards, strict=True):
        tensors = {}
        for name, p, i, _ in shard:
            leaf = params[p[0]] if len(p) == 1 else params[p[0]][p[1]]
            maps[p].into_hf(_to_host(leaf[i] if i else leaf), tensors, name, dtype)
            weight_map[name] = fn
        if write:
            write_file(os.path.join(out_dir, fn), tensors)
    if not write:
        return
    if len(shards) > 1:
        total = sum(e[3] for e in names)
        with open(os.path.join(out_dir, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    _write_config(cfg, out_dir, np.dtype(dtype or params["embed"].dtype))
    if tokenizer_dir is not None:
        _copy_tokenizer(os.fspath(tokenizer_dir), out_dir)


def _write_config(cfg: ModelConfig, out_dir: str, dtype: np.dtype) -> None:
    d = cfg.to_hf_dict()
    d["architectures"] = [cfg.architecture]
    d["dtype"] = d["torch_dtype"] = {"bfloat16": "bfloat16", "float16": "float16"}.get(
        dtype.name, "float32"
    )
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(d, f, indent=2, sort_keys=True)


def _copy_tokenizer(src: str, out_dir: str) -> None:
    found = [fn for fn in TOKENIZER_FILES if os.path.isfile(os.path.join(src, fn))]
    if not any(fn.startswith("tokenizer") or fn == "vocab.json" for fn in found):
        raise FileNotFoundError(f"{src}: no tokenizer files ({', '.join(TOKENIZER_FILES[:5])}...)")
    for fn in found:
        shutil.copy2(os.path.join(src, fn), os.path.join(out_dir, fn))
    logging.info("copied tokenizer files %s from %s", found, src)
