"""Hugging Face checkpoints in and out: `load_hf` and `save_hf`.

Loading reads each tensor straight into its target sharding with
`jax.make_array_from_callback`: every device shard is cut from the memory-mapped file,
converted to the requested dtype and copied to its device, so no host ever holds a full
copy of the model (each process reads only its own devices' shards). Stacked layer
parameters [L, ...] are assembled from the L per-layer HF tensors the same way.
`load_params` is that path for any tensor source that hands out arrays in the HF layout
(`gguf_io` reads GGUF files through it). Which HF tensor each parameter is, and in what
layout: `hf_mappings`.

Every tensor the decoder expects must be present with the expected shape, and every
tensor in the checkpoint must be used: the only exceptions are RoPE `inv_freq` buffers
(recomputed from the config) and `lm_head.weight` when the embeddings are tied (HF ties
it to the embedding as well).
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.errors import UserError
from jaxrl_llm.models import partitioning
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.hf_mappings import Mapping, mappings
from jaxrl_llm.models.params import param_specs, unflatten
from jaxrl_llm.models.safetensors_io import INDEX_FILE, Checkpoint, write_file
from jaxrl_llm.parallel.mesh import to_host

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
            maps[p].into_hf(to_host(leaf[i] if i else leaf), tensors, name, dtype)
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
