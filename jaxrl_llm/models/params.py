"""Parameter metadata (shape, logical axes), shardings and random initialisation.

`params` everywhere is a plain nested dict of arrays with the structure of the NNX
state of `Transformer` (`nnx.to_pure_dict`), e.g. `params['layers']['q']` of shape
[L, D, N, H]. The logical axes live on the module's `nnx.Param` metadata and are read
from the abstract (shape-only) model, so no arrays are allocated to learn them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl_llm.models import partitioning
from jaxrl_llm.models._nnx import nnx
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.layers import Transformer
from jaxrl_llm.models.transformer import abstract_model


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]


def param_specs(cfg: ModelConfig) -> dict[tuple[str, ...], ParamSpec]:
    """Flat {path: ParamSpec} for every parameter, e.g. ('layers', 'q')."""
    _, state = abstract_model(cfg)
    return {
        tuple(path): ParamSpec(tuple(var.shape), tuple(var.get_metadata()["axes"]))
        for path, var in nnx.to_flat_state(state)
    }


def unflatten(flat: Mapping[tuple[str, ...], object]) -> dict:
    """{('layers', 'q'): x} -> {'layers': {'q': x}}."""
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def param_shardings(cfg: ModelConfig, mesh: Mesh | None, rules=None) -> dict:
    """Nested dict of shardings with the structure of `params`."""
    return unflatten(
        {
            path: partitioning.logical_to_sharding(spec.axes, spec.shape, mesh, rules)
            for path, spec in param_specs(cfg).items()
        }
    )


def init_params(
    cfg: ModelConfig, seed: int = 0, mesh: Mesh | None = None, dtype="float32", rules=None
) -> dict:
    """Random parameters (normal(0, initializer_range), norms 1, biases 0), created sharded."""
    dtype = jnp.dtype(dtype)

    def init():
        _, state = nnx.split(Transformer(cfg, nnx.Rngs(seed), dtype))
        return nnx.to_pure_dict(state)

    return jax.jit(init, out_shardings=param_shardings(cfg, mesh, rules))()


def count_params(params) -> int:
    return sum(x.size for x in jax.tree.leaves(params))
