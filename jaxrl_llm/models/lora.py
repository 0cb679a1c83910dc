"""LoRA adapters: their place in the params, the base / adapter split, merging, PEFT files.

    cfg = base_cfg.replace(lora=models.LoraConfig(rank=16, alpha=32))
    adapters = lora.init_adapters(cfg, seed=0, mesh=mesh)     # A random, B = 0
    params = lora.combine(base_params, adapters)                # no copy: the same arrays
    logits = models.logits(cfg, params, ids)                    # x W + (alpha/r) (x A) B
    merged = lora.merge(cfg, params)                            # W + (alpha/r) A B, base cfg
    lora.save_peft(cfg, adapters, out_dir, base_model="Qwen/Qwen2.5-0.5B")

The adapters of projection `t` live next to its weight: `params['layers'][t + '_lora_a']`
[L, *in, r] and `[t + '_lora_b']` [L, r, *out] (`block.Block`), with the logical axes of
the weight's input / output dimensions, so the one rule table shards them like the weight.
`combine` and `split` are dict operations: the base arrays are never copied, so policy
(base + adapters), reference (base alone, `cfg.replace(lora=None)`) and sampler read one
copy of the base weights.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models import partitioning
from jaxrl_llm.models._nnx import nnx
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.layer_math import contracted
from jaxrl_llm.models.layers import Transformer
from jaxrl_llm.models.params import param_shardings, param_specs, unflatten
from jaxrl_llm.models.safetensors_io import write_file
from jaxrl_llm.parallel.mesh import to_host

SUFFIXES = ("_lora_a", "_lora_b")
# "auto" sampler: merge from this many rollout rows per step. A merge costs about one pass
# over the adapted weights, the unmerged adapters two small matmuls per projection and
# token; on CPU the merge paid off from 4 rows, and broke even at 1 (benchmarks/RESULTS.md).
MERGE_MIN_ROWS = 4
PEFT_MODULES = {  # our target -> the HF module it adapts, under model.layers.{i}.
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def is_adapter(name: str) -> bool:
    return name.endswith(SUFFIXES)


def has_adapters(params: dict) -> bool:
    """Whether a parameter tree holds LoRA adapters (base + adapters, unmerged)."""
    return any(is_adapter(k) for k in params.get("layers", {}))


def split(params: dict) -> tuple[dict, dict]:
    """params (base + adapters) -> (adapters, base): the same arrays, two trees."""
    layers = params["layers"]
    adapters = {"layers": {k: v for k, v in layers.items() if is_adapter(k)}}
    base = dict(params, layers={k: v for k, v in layers.items() if not is_adapter(k)})
    return adapters, base


def combine(base: dict | None, adapters: dict) -> dict:
    """The params the adapted model reads: base's entries with the adapters added to
    `layers` (no copy). base None: adapters is already the whole tree."""
    if base is None:
        return adapters
    return dict(base, layers={**base["layers"], **adapters["layers"]})


def adapter_shardings(cfg: ModelConfig, mesh, rules=None) -> dict:
    """Shardings of the adapters, from the same rule table as the weights."""
    specs = {p: s for p, s in param_specs(cfg).items() if is_adapter(p[-1])}
    return unflatten(
        {
            p: partitioning.logical_to_sharding(s.axes, s.shape, mesh, rules)
            for p, s in specs.items()
        }
    )


def init_adapters(cfg: ModelConfig, seed: int = 0, mesh=None, dtype="float32", rules=None):
    """Fresh adapters of `cfg.lora` (A random, B zero), created in their sharding. Only
    the adapters are materialized (the base initialisers are traced, then dropped)."""
    if cfg.lora is None:
        raise ValueError("init_adapters: the model config has no lora")
    dtype = jnp.dtype(dtype)

    def init():
        _, state = nnx.split(Transformer(cfg, nnx.Rngs(seed), dtype))
        return split(nnx.to_pure_dict(state))[0]

    return jax.jit(init, out_shardings=adapter_shardings(cfg, mesh, rules))()


def delta(cfg: ModelConfig, name: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """(alpha / r) A B in the layout of the weight: a [L, *in, r], b [L, r, *out] ->
    [L, *in, *out], float32."""
    c = contracted(name)
    L, r = a.shape[0], a.shape[-1]
    a2 = a.reshape(L, -1, r).astype(jnp.float32)
    b2 = b.reshape(L, r, -1).astype(jnp.float32)
    ab = jnp.einsum("lkr,lrm->lkm", a2, b2) * cfg.lora.scale
    return ab.reshape(L, *a.shape[1 : 1 + c], *b.shape[2:])


def merge(cfg: ModelConfig, params: dict) -> dict:
    """Base + adapters -> the plain model's params (for `cfg.replace(lora=None)`):
    W + (alpha / r) A B per target, rounded once to W's dtype. New arrays for the
    adapted weights, the others shared with `params`."""
    adapters, base = split(params)
    layers = dict(base["layers"])
    for name in cfg.lora.targets:
        a, b = adapters["layers"][name + "_lora_a"], adapters["layers"][name + "_lora_b"]
        w = layers[name]
        layers[name] = (w.astype(jnp.float32) + delta(cfg, name, a, b)).astype(w.dtype)
    return dict(base, layers=layers)


def make_merge_fn(cfg: ModelConfig, mesh=None):
    """Jitted `merge`, its output pinned to the plain model's shardings (what a sampler
    compiled for the base model expects)."""
    out = param_shardings(cfg.replace(lora=None), mesh) if mesh is not None else None
    return jax.jit(lambda p: merge(cfg, p), out_shardings=out)


# ------------------------------------------------------------------------------ PEFT
def peft_tensors(cfg: ModelConfig, adapters: dict) -> dict[str, np.ndarray]:
    """The adapters as PEFT names them: `base_model.model.model.layers.{i}.<module>.
    lora_A.weight` [r, in] and `lora_B.weight` [out, r] (torch Linear layout)."""
    out = {}
    for name in cfg.lora.targets:
        a, b = (to_host(adapters["layers"][name + s]) for s in SUFFIXES)
        r = cfg.lora.rank
        for i in range(cfg.num_layers):
            prefix = f"base_model.model.model.layers.{i}.{PEFT_MODULES[name]}"
            out[prefix + ".lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, r).T)
            out[prefix + ".lora_B.weight"] = np.ascontiguousarray(b[i].reshape(r, -1).T)
    return out


def peft_config(cfg: ModelConfig, base_model: str) -> dict:
    """adapter_config.json: what `peft.PeftModel.from_pretrained` needs to rebuild it."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.lora.rank,
        "lora_alpha": cfg.lora.alpha,
        "lora_dropout": cfg.lora.dropout,
        "target_modules": sorted(PEFT_MODULES[t].split(".")[1] for t in cfg.lora.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def save_peft(cfg: ModelConfig, adapters: dict, out_dir: str, base_model: str, dtype=None):
    """Writes adapter_config.json + adapter_model.safetensors (process 0 writes; every
    process takes part in gathering sharded adapters)."""
    tensors = peft_tensors(cfg, adapters)
    if jax.process_index() != 0:
        return
    os.makedirs(out_dir, exist_ok=True)
    if dtype is not None:
        tensors = {k: v.astype(dtype) for k, v in tensors.items()}
    write_file(os.path.join(out_dir, "adapter_model.safetensors"), tensors)
    with open(os.path.join(out_dir, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(peft_config(cfg, base_model), f, indent=2, sort_keys=True)


def sampler_mode(choice: str, cfg: ModelConfig, rows: int) -> str:
    """How the sampler applies the adapters: `choice` ("merged" / "unmerged"), or for
    "auto" the faster of the two for `rows` rollout rows per step (docs/lora.md)."""
    if choice != "auto":
        return choice
    return "merged" if rows >= MERGE_MIN_ROWS else "unmerged"
