"""Logical axis names -> mesh axes: the one rule table every parameter goes through.

Every parameter of the decoder carries a tuple of logical axis names (its `axes`
metadata, e.g. `('layers', 'embed', 'mlp')`). `DEFAULT_RULES` maps each logical name to
a mesh axis (or a tuple of mesh axes, or None = replicated) of the mesh
`('data', 'fsdp', 'expert', 'tensor')`:

- weights are sharded FSDP-style over `fsdp` on their `embed` dimension and
  Megatron-style over `tensor` on heads / mlp / vocab;
- the experts of an MoE layer over `expert` (expert parallelism);
- the batch is sharded over `('data', 'fsdp', 'expert')` (see `jaxrl_llm.parallel.mesh`).

A dimension that a mesh axis does not divide (e.g. 2 KV heads on a 4-way tensor axis) is
replicated over that axis instead; `logical_to_spec` reports it once through `logging`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None

DEFAULT_RULES: dict[str, MeshAxes] = {
    "batch": ("data", "fsdp", "expert"),
    "layers": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
    "lora": None,  # the rank of a LoRA adapter (small: replicated)
    "router": None,  # an MoE router's output (one logit per expert): replicated
    "expert": "expert",  # the experts of an MoE layer: expert parallelism
    "expert_mlp": "tensor",  # an expert's hidden width, like a dense MLP's
    "seq": None,
    "cache_seq": None,
}

_reported: set[tuple] = set()


def _mesh_axis_size(mesh: Mesh, axes: MeshAxes) -> int:
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else axes
    size = 1
    for name in names:
        size *= mesh.shape[name]
    return size


def logical_to_spec(
    axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules: Mapping[str, MeshAxes] | None = None,
) -> PartitionSpec:
    """PartitionSpec for an array with these logical axes, shape and mesh."""
    rules = DEFAULT_RULES if rules is None else rules
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
    spec, used = [], set()
    for name, dim in zip(axes, shape, strict=True):
        if name is not None and name not in rules:
            raise KeyError(f"logical axis {name!r} has no partitioning rule; rules: {list(rules)}")
        mesh_axes = None if name is None else rules[name]
        names = (
            () if mesh_axes is None else (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes
        )
        names = tuple(n for n in names if mesh.shape.get(n, 1) > 1 and n not in used)
        if names and dim % _mesh_axis_size(mesh, names):
            key = (tuple(axes), tuple(shape), names)
            if key not in _reported:
                _reported.add(key)
                logging.info(
                    "replicating logical axis %r (size %d) of %s: mesh axes %s (size %d) "
                    "do not divide it",
                    name,
                    dim,
                    tuple(axes),
                    names,
                    _mesh_axis_size(mesh, names),
                )
            names = ()
        used.update(names)
        spec.append(None if not names else names[0] if len(names) == 1 else names)
    return PartitionSpec(*spec)


def logical_to_sharding(
    axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh | None,
    rules: Mapping[str, MeshAxes] | None = None,
) -> jax.sharding.Sharding:
    """NamedSharding on `mesh`, or the first local device when there is no mesh."""
    if mesh is None:
        return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return NamedSharding(mesh, logical_to_spec(axes, shape, mesh, rules))
