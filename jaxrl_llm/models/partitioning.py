"""Logical axis names -> mesh axes: the one rule table every parameter goes through.

Every parameter of the decoder carries a tuple of logical axis names (its `axes`
metadata, e.g. `('layers', 'embed', 'mlp')`). `DEFAULT_RULES` maps each logical name to
a mesh axis (or a tuple of mesh axes, or None = replicated) of the mesh
`('data', 'fsdp', 'expert', 'context', 'tensor')`:

- weights are sharded FSDP-style over `fsdp` on their `embed` dimension and
  Megatron-style over `tensor` on heads / mlp / vocab; they are replicated over
  `context`;
- the experts of an MoE layer over `expert` (expert parallelism);
- the batch is sharded over `('data', 'fsdp', 'expert')` (see `jaxrl_llm.parallel.mesh`);
- activations of the full-sequence forward (`shard_sequence`, `shard_heads`): the
  sequence over `context`, and around attention the heads over `('tensor', 'context')`
  (context parallelism by an all-to-all over heads; docs/sharding.md).

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
    "seq": "context",  # activations' sequence axis (context parallelism)
    "cache_seq": None,
    "act_heads": ("tensor", "context"),  # attention's q / k / v / output heads
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


# --------------------------------------------------------------- context parallelism
def context_size() -> int:
    """The `context` axis of the mesh set around the trace (`jax.set_mesh`), 1 if none."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "context" not in mesh.axis_names:
        return 1
    return int(mesh.shape["context"])


def _constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    mesh = jax.sharding.get_abstract_mesh()
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, x.shape, mesh))


def heads_spec(shape: Sequence[int]) -> PartitionSpec:
    """The `shard_heads` layout of an array [B, T, heads, H] on the mesh set around the
    trace: rows over the batch axes, heads over ('tensor', 'context') where they divide."""
    mesh = jax.sharding.get_abstract_mesh()
    return logical_to_spec(("batch", None, "act_heads", None), shape, mesh)


def rows_spec(shape: Sequence[int]) -> PartitionSpec:
    """An array [B, ...] split by rows over the batch axes of the mesh set around the
    trace (where they divide B); arrays of fewer than 2 dimensions (shared by the
    rows: mask indices, a window) are replicated."""
    if len(shape) < 2:
        return PartitionSpec()
    mesh = jax.sharding.get_abstract_mesh()
    return logical_to_spec(("batch",) + (None,) * (len(shape) - 1), shape, mesh)


def shard_sequence(x: jax.Array) -> jax.Array:
    """Activations [B, T, ...] with rows over the batch axes and T split over the mesh's
    `context` axis, on the mesh set around the trace; unchanged without one. Token-wise
    layers (norms, projections, MLP) then run on each device's share of the rows and
    positions. The embedding's lookup needs it where `fsdp` splits the embedding's width:
    its output would be split like the table, by width over `fsdp`, and every device
    would then run every row through the layers."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return _constrain(x, ("batch", "seq") + (None,) * (x.ndim - 2))


def shard_heads(x: jax.Array, kind: str = "query") -> jax.Array:
    """Attention's q / k / v / output [B, T, heads, H] with every position and the heads
    split over ('tensor', 'context'): between `shard_sequence`d activations and this
    layout XLA moves the data with an all-to-all over `context` (Ulysses), and each
    device attends with its heads over the whole sequence. The query heads must be
    divisible by tensor x context (ValueError naming mesh.context); key / value heads
    that are not stay whole on every device (GQA: replicated over the context group).
    Unchanged without context > 1."""
    c = context_size()
    if c == 1:
        return x
    heads, split = x.shape[2], c * int(jax.sharding.get_abstract_mesh().shape.get("tensor", 1))
    if kind == "query" and heads % split:
        raise ValueError(
            f"mesh.context={c}: context parallelism splits the attention heads over it "
            f"(times mesh.tensor), and the model's {heads} query heads are not divisible "
            f"by {split}"
        )
    return jax.lax.with_sharding_constraint(x, heads_spec(x.shape))
